"""The step-time model against measured runs, and the layout planner.

Each run of titanlite.dryrun.calibration.RUNS (TorchTitan's published ones on 64 A100 and on 8 to
256 H100 at 500 W, eager, compiled and float8; titanlite's own on a lent H100 and H200) is dry-run
at its layout, and its leave-one-out prediction (the factors fitted without it; the float8 runs
are fitted on by none) held to its bound: 15% of a published run's tokens/s, 10% of an own run's
tokens/s and of its peak memory. The factors the dry run reads are the fit's."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from titanlite.dryrun import calibration, hardware, timing
from titanlite.dryrun.calibration import RUNS


@pytest.fixture(scope="module")
def rows() -> dict:
    """Every run's row (each traced once; a run and its compiled twin share a trace)."""
    return {row.run.name: row for row in calibration.leave_one_out()}


def test_the_factors_are_the_fit():
    """timing.FITTED is what calibration.fit finds over the runs marked `fit`: 16 runs, 5 factors."""
    fitted = [r for r in RUNS if r.fit]
    assert len(fitted) == 16 and len(calibration.BOUNDS) == 5
    assert calibration.fit(fitted) == timing.FITTED


@pytest.mark.parametrize("name", [r.name for r in RUNS])
def test_leave_one_out_prediction_within_its_bound(rows, name):
    row = rows[name]
    assert abs(row.error) <= row.run.bound, f"{name}: {row.held_out:,.0f} against {row.run.tokens_per_sec_per_gpu:,.0f}"
    if row.run.peak_gib is not None:  # no factor is fitted to memory: its prediction is held out
        assert abs(row.peak_error) <= 0.10, f"{name}: {row.peak_gib:.2f} GiB against {row.run.peak_gib} GiB"


def test_no_measured_figure_reaches_the_prediction():
    """The modules the dry run predicts with never import the calibration table (only the fit
    reads it): their imports, read from the source."""
    root = Path(calibration.__file__).parent
    for name in ("run", "report", "timing", "hardware", "steptrace", "replay", "blocktrace", "pptrace", "standins"):
        tree = ast.parse((root / f"{name}.py").read_text())
        imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        names = {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
        assert "titanlite.dryrun.calibration" not in imported and "calibration" not in names, name


def test_a_lower_power_limit_slows_compute_not_memory():
    """The GPU under a power limit: its matmul and attention at the clock that limit sustains
    (the fitted law: 500 W of the H100's 700 W sustains about two thirds of its clock), its
    memory and links as they are; at or above the rated power nothing changes."""
    h100 = hardware.get_gpu("h100")
    assert timing.clock_share(h100, timing.FITTED) == 1.0
    assert timing.clock_share(hardware.get_gpu("h100", 900), timing.FITTED) == 1.0
    shares = [timing.clock_share(hardware.get_gpu("h100", w), timing.FITTED) for w in (600, 500, 450)]
    assert 1 > shares[0] > shares[1] > shares[2] > 0 and 0.6 < shares[1] < 0.75, shares
    capped = hardware.get_gpu("h100", 500)
    ops = timing.compact([(1e14, 1e6, "matmul", 1), (0.0, 1e9, "memory", 1)])
    matmul, memory = (timing.compact([op]) for op in [(1e14, 1e6, "matmul", 1), (0.0, 1e9, "memory", 1)])
    assert timing.compute_seconds(matmul, capped) == pytest.approx(timing.compute_seconds(matmul, h100) / shares[1],
                                                                   rel=1e-3)
    assert timing.compute_seconds(memory, capped) == timing.compute_seconds(memory, h100)
    assert timing.compute_seconds(ops, capped) > timing.compute_seconds(ops, h100)
    assert hardware.GPUS["h100_500w"].power_w == 500 and hardware.GPUS["h100_500w"].mamf_flops == h100.mamf_flops


def test_planner_bounds_hold_and_layouts_keep_the_global_batch():
    """Every enumerated layout uses the whole world and keeps the config's global batch; for two
    of them (tp 2 with full AC; pp 2 under 1F1B, its bubble) the cheap bounds the planner prunes
    with lie on the right side of the dry run: memory below the traced peak, tokens/s above the
    prediction."""
    from titanlite.dryrun import hardware
    from titanlite.dryrun.report import report
    from titanlite.dryrun.run import dry_run
    from titanlite.config import load as config
    from titanlite import plan as planner

    argv = ["--config", "debug_model.toml", "--training.seq_len", "128"]
    cfg, plan = planner._base(argv, 4)
    gpu = hardware.get_gpu("h100")
    lays = planner.layouts(plan, 4, 8, 128)
    assert {lay.ac for lay in lays} == set(planner.AC_MODES) and {lay.tp for lay in lays} == {1, 2, 4}
    for lay in lays:
        assert lay.dp_replicate * lay.dp_shard * lay.tp * lay.cp * lay.pp == 4
        assert lay.local_batch * lay.dp_replicate * lay.dp_shard == plan.global_batch_size
    picks = [lay for lay in lays if (lay.tp, lay.pp, lay.cp, lay.dp_replicate, lay.ac, lay.schedule) in
             ((2, 1, 1, 1, "full", "1F1B"), (1, 2, 1, 1, "none", "1F1B")) and (lay.pp == 1 or lay.microbatch == 1)]
    assert len(picks) == 2
    for lay in picks:
        b = planner.bound(lay, plan, 128, gpu, 8)
        rep = report(dry_run(config.load([*argv, *lay.overrides()])[0], 4), gpu)
        assert b.peak_bytes <= max(r["memory_gib"]["peak"] for r in rep["roles"]) * hardware.GIB, lay
        assert b.tokens_per_sec_per_gpu >= rep["predicted"]["tokens_per_sec_per_gpu"], lay
    # Qwen3.5 9B at 64 GPUs (docs/scaling.md has the search's pick): its context-parallel layouts
    # pass the family's layout checks, which the planner's traces run (they refused cp before its
    # linear blocks ran under it)
    _, hybrid = planner._base(["--config", "qwen3_5_9b.toml"], 64)
    lays = [lay for lay in planner.layouts(hybrid, 64, 8, 8192) if lay.cp > 1 and lay.pp == 1]
    assert {lay.cp for lay in lays} >= {2, 8}
    for cp in (2, 8):
        lay = next(lay for lay in lays if lay.cp == cp)
        assert planner._base(["--config", "qwen3_5_9b.toml", *lay.overrides()], 64)[1].dims.cp == cp


def test_planner_finds_fitting_layouts_best_first(tmp_path, capsys):
    import json

    from titanlite import plan as planner

    out = tmp_path / "plan.json"
    planner.main(["--config", "debug_model.toml", "--training.seq_len", "128", "--ngpu", "2", "--top", "2",
                  "--max-traces", "2", "--out", str(out)])
    result = json.loads(out.read_text())
    tps = [r["predicted"]["tokens_per_sec_per_gpu"] for r in result["layouts"]]
    assert 1 <= len(tps) <= 2 and tps == sorted(tps, reverse=True)
    for r in result["layouts"]:
        assert r["peak_gib"] <= result["memory_limit_gib"] and r["predicted"]["mfu_pct"] > 0
        assert "--parallelism.tensor_parallel_degree" in r["overrides"] and r["parallelism"]["tp"] in (1, 2)
    assert "best" in capsys.readouterr().out


def test_planner_answer_does_not_depend_on_the_clock(monkeypatch):
    """The search stops after --max-traces traces, never on time: on a machine where every
    call of the clock takes 1000 s it ranks the same layouts. The dry run is a stand-in (a
    prediction from the layout's degrees), so nothing is traced."""
    import types

    from titanlite import plan as planner
    from titanlite.dryrun import hardware

    def fake_dry_run(job, ngpu):
        p, ac = job.parallelism, job.activation_checkpoint.mode
        tps = 1000 + 10 * p.data_parallel_shard_degree - 7 * p.tensor_parallel_degree - 3 * p.pipeline_parallel_degree
        return {"roles": [{"memory_gib": {"peak": 1.0}}],
                "predicted": {"tokens_per_sec_per_gpu": tps - {"none": 0, "selective": 1, "full": 2}[ac], "mfu_pct": 1.0}}

    monkeypatch.setattr(planner, "dry_run", fake_dry_run)
    monkeypatch.setattr(planner, "report", lambda result, gpu: result)
    argv, gpu = ["--config", "debug_model.toml", "--training.seq_len", "128"], hardware.get_gpu("h100")
    quiet = planner.search(argv, 8, gpu, top=3, max_traces=4, log=lambda *a: None)
    clock = iter(range(0, 10**9, 1000))
    monkeypatch.setattr(planner, "time", types.SimpleNamespace(perf_counter=lambda: float(next(clock))))
    busy = planner.search(argv, 8, gpu, top=3, max_traces=4, log=lambda *a: None)
    assert busy["layouts"] == quiet["layouts"] and len(quiet["layouts"]) == 3
    assert busy["searched"]["traced"] == quiet["searched"]["traced"] == 4
    assert busy["searched"]["stopped"] == "4 layouts traced (--max-traces)"
    assert busy["searched"]["seconds"] >= 1000


@pytest.mark.parametrize("argv, expect", [
    (["--ngpu", "8", "--top", "0"], "--top: expected a positive integer, got '0'"),
    (["--ngpu", "x"], "--ngpu: expected a positive integer, got 'x'"),
    ([], "--ngpu is required"),
    (["--ngpu", "8", "--gpu", "v100"], "--gpu: unknown GPU 'v100'"),
    (["--ngpu", "8", "--budget-s", "150"], "--budget-s is gone"),
])
def test_planner_bad_input_is_one_line(argv, expect, capsys):
    from titanlite import plan as planner

    with pytest.raises(SystemExit) as e:
        planner.main(["--config", "debug_model.toml", *argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and expect in err[0], err
