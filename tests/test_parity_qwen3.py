"""Qwen3 under each parallelism reproduces its single-process run on the same global batch."""

import pytest
from harness import TINY, assert_grad_parity, assert_parity, reference, train

QWEN3 = [*TINY, "--model.name", "qwen3", "--training.global_batch_size", "4"]
# Every dimension at once, with tied embeddings (FSDP and CP alone are Llama 3's tests: the
# family differs from it in its blocks); its TP plan alone is in the gradient test below and, compiled,
# in tests/test_speed.py
LAYOUTS = {
    "fsdp2_cp2_tp2": (8, ["--training.local_batch_size", "2", "--parallelism.data_parallel_shard_degree", "2",
                          "--parallelism.context_parallel_degree", "2", "--parallelism.tensor_parallel_degree", "2"]),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_parallel_layout_matches_single_process(layout):
    nproc, extra = LAYOUTS[layout]
    ref = reference([*QWEN3, "--training.local_batch_size", "4"])
    run = train(nproc, [*QWEN3, "--training.local_batch_size", "4", *extra])
    assert "qwen3 debugmodel" in run.output
    assert_parity(ref.losses, run.losses)
    assert_parity([r["grad_norm"] for r in ref.metrics], [r["grad_norm"] for r in run.metrics], 1e-5, 1e-3)


@pytest.mark.parametrize("nproc,args", [(4, ["2", "2"]), (2, ["1", "2", "nosp"])],
                         ids=["fsdp2xtp2", "tp2_no_sequence_parallel"])
def test_every_gradient_matches_under_tp(nproc, args):
    # with the QK-norm gradients left unreduced across tensor-parallel ranks the loss
    # parity above still passed; per parameter it fails
    assert_grad_parity("qwen3", nproc, args)
