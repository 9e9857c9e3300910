"""Qwen3-MoE under expert parallelism reproduces its single-process run on the same global batch.

Each single-process reference runs the global batch as one micro-batch: the auxiliary loss
balances each micro-batch's tokens over all data-parallel ranks, so it is layout independent
for a fixed split of the step into micro-batches, not across different splits. Pipeline
parallel runs each pipeline micro-batch as one such micro-batch: its reference accumulates
gradients over the same rows (a layout with one data-parallel rank, so the rows match)."""

import pytest
from harness import BUILTIN_EVAL, BUILTIN_EXACT, TINY, assert_eval_parity, assert_grad_parity, assert_parity, reference, train

MOE = [*TINY, "--model.name", "qwen3_moe", "--training.global_batch_size", "8"]
BALANCE = ["--moe.aux_loss_coeff", "0.01", "--moe.bias_update_rate", "0.001"]
EP2 = ["--parallelism.expert_parallel_degree", "2"]
LAYOUTS = {
    # experts split in two, each half FSDP-sharded over two ranks
    "ep2xdp2": (4, ["--training.local_batch_size", "2", *EP2]),
    # experts whole on each rank (ep = dp_shard: no FSDP over experts)
    "ep4_op_ac": (4, ["--training.local_batch_size", "2", "--parallelism.expert_parallel_degree", "4",
                      "--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_type", "op"]),
    # attention and output split over tp (sequence and loss parallel); each tp rank routes its
    # own sequence shard, the expert-parallel group is the tp pair, experts FSDP-sharded over dp
    "ep2xtp2": (4, ["--training.local_batch_size", "4", "--parallelism.tensor_parallel_degree", "2", *EP2]),
    # expert-parallel ranks taken from the context-parallel ones; two stages, four pipeline
    # micro-batches of two rows: the reference accumulates the same four
    "ep2xcp2xpp2": (4, ["--training.local_batch_size", "8", "--parallelism.context_parallel_degree", "2",
                        "--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule",
                        "1F1B", "--parallelism.pipeline_parallel_microbatch_size", "2", *EP2], 2),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_expert_parallel_matches_single_process(layout):
    """Balancing on in every layout: the router biases move after each step and the
    auxiliary loss is part of the loss, so both must come out the same."""
    nproc, extra, *ref_rows = LAYOUTS[layout]
    # the [eval] tasks scored with experts split; exact match generated where no sequence
    # parallel splits the tokens (pipeline parallel: scored in tests/test_parity_pp.py)
    tasks = {"ep2xdp2": BUILTIN_EXACT, "ep4_op_ac": BUILTIN_EXACT, "ep2xtp2": BUILTIN_EVAL}.get(layout, [])
    ref = reference([*MOE, *BALANCE, "--training.local_batch_size", str(ref_rows[0] if ref_rows else 8), *tasks])
    run = train(nproc, [*MOE, *BALANCE, *extra, *tasks])
    assert_parity(ref.losses, run.losses)
    if tasks:
        assert assert_eval_parity(ref, run) == 2 * (4 + (tasks is BUILTIN_EXACT))
    for key in ("grad_norm", "moe_aux_loss", "moe_router_bias_norm"):
        assert_parity([r[key] for r in ref.metrics], [r[key] for r in run.metrics], 1e-5, 1e-3)
    for key in ("moe_load_max_over_mean_worst", "moe_load_max_over_mean_avg"):
        assert [r[key] for r in ref.metrics] == [r[key] for r in run.metrics]
    assert run.metrics[-1]["moe_router_bias_norm"] > 0 and run.metrics[-1]["moe_aux_loss"] > 0


def test_every_gradient_matches_under_expert_parallel():
    # one launch, four layouts: ep2 x fsdp2 (experts FSDP-sharded in pairs), ep2 x tp2 (sequence
    # parallel, each tp rank routing its own tokens), HSDP (2 replicas x ep2), ep2 x pp2 (1F1B)
    assert_grad_parity("qwen3_moe", 4, ["4", "1", "ep=2", "+", "2", "2", "ep=2", "+", "2", "1", "ep=2", "rep=2",
                                        "+", "pp", "2", "2", "1", "1F1B", "ep=2"])
