"""The step-time model against published runs, and the layout planner.

Each published run (titanlite.dryrun.calibration.RUNS: TorchTitan's on 64 A100 and on 8 to 128
H100) is dry-run at its layout and its predicted tokens/s per GPU held within 15% of the
published figure, the runs that fitted the model's two factors and the held-out ones alike."""

from __future__ import annotations

import pytest

from titanlite.dryrun.calibration import RUNS, predict


@pytest.mark.parametrize("run", RUNS, ids=[r.name for r in RUNS])
def test_prediction_within_15_percent_of_published(run):
    pred = predict(run)["predicted"]
    tps = pred["tokens_per_sec_per_gpu"]
    assert tps == pytest.approx(run.tokens_per_sec_per_gpu, rel=0.15), f"{run.name}: {tps:.0f}"
    assert pred["gpu"] == run.gpu
