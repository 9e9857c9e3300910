"""Qwen3 under each parallelism reproduces its single-process run on the same global batch."""

import pytest
from harness import TINY, assert_parity, reference, train

QWEN3 = [*TINY, "--model.name", "qwen3", "--training.global_batch_size", "8"]


@pytest.mark.parametrize("nproc,local", [(2, 4), (4, 2)])
def test_fsdp_matches_single_process(nproc, local):
    ref = reference([*QWEN3, "--training.local_batch_size", "8"])
    run = train(nproc, [*QWEN3, "--training.local_batch_size", str(local)])
    assert "qwen3 debugmodel" in run.output
    assert_parity(ref.losses, run.losses)
    assert_parity([r["grad_norm"] for r in ref.metrics], [r["grad_norm"] for r in run.metrics], 1e-5, 1e-3)
