"""Qwen3-MoE under expert parallelism reproduces its single-process run on the same global batch.

Each single-process reference runs the global batch as one micro-batch: the auxiliary loss
balances each micro-batch's tokens over all data-parallel ranks, so it is layout independent
for a fixed split of the step into micro-batches, not across different splits."""

import pytest
from harness import TINY, assert_grad_parity, assert_parity, reference, train

MOE = [*TINY, "--model.name", "qwen3_moe", "--training.global_batch_size", "8"]
BALANCE = ["--moe.aux_loss_coeff", "0.01", "--moe.bias_update_rate", "0.001"]
LAYOUTS = {
    "ep2": (2, ["--training.local_batch_size", "4", "--parallelism.expert_parallel_degree", "2"], []),
    # experts split in two, each half FSDP-sharded over two ranks
    "ep2xdp2_balanced": (4, ["--training.local_batch_size", "2", "--parallelism.expert_parallel_degree", "2"],
                         BALANCE),
    "ep4_balanced_op_ac": (4, ["--training.local_batch_size", "2", "--parallelism.expert_parallel_degree", "4",
                               "--activation_checkpoint.mode", "selective",
                               "--activation_checkpoint.selective_type", "op"], BALANCE),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_expert_parallel_matches_single_process(layout):
    nproc, extra, knobs = LAYOUTS[layout]
    ref = reference([*MOE, "--training.local_batch_size", "8", *knobs])
    run = train(nproc, [*MOE, *extra, *knobs])
    assert_parity(ref.losses, run.losses)
    for key in ["grad_norm"] + (["moe_aux_loss", "moe_router_bias_norm"] if knobs else []):
        assert_parity([r[key] for r in ref.metrics], [r[key] for r in run.metrics], 1e-5, 1e-3)
    for key in ("moe_load_max_over_mean_worst", "moe_load_max_over_mean_avg"):
        assert [r[key] for r in ref.metrics] == [r[key] for r in run.metrics]
    if knobs:  # the bias moved, and the auxiliary loss was on
        assert run.metrics[-1]["moe_router_bias_norm"] > 0 and run.metrics[-1]["moe_aux_loss"] > 0


def test_every_gradient_matches_under_ep2_with_fsdp2():
    assert_grad_parity("qwen3_moe", 4, ["4", "1", "ep=2"])
