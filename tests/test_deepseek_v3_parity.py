"""DeepSeek-V3 under every parallel dimension reproduces its single-process run on the same
global batch (loss, gradient norm, MTP loss and router biases over 10 steps), with two
four-rank launches: FSDP x TP (sequence and loss parallel, MLA's latent projections whole on
each rank) with the experts split over the tp pair under per-op AC, and PP x CP (the MTP depth on the last
stage) with the experts split over the cp pair. The second saves checkpoints, from which a
resumed run continues bit for bit. Per-parameter gradients under TP: tests/grad_parity.py."""

import json
import shutil

from harness import TINY, assert_grad_parity, assert_parity, reference, train

from titanlite.checkpoint.dcp import load_tensors

DSV3 = [*TINY, "--model.name", "deepseek_v3", "--training.global_batch_size", "8", "--moe.bias_update_rate", "0.001",
        "--lr_scheduler.decay_ratio", "0"]
EP2 = ["--parallelism.expert_parallel_degree", "2"]
# per-op activation checkpointing on top: recomputation must neither count a layer's routed
# tokens nor its extra loss terms twice
FSDP_TP = ["--training.local_batch_size", "4", "--parallelism.data_parallel_shard_degree", "2",
           "--parallelism.tensor_parallel_degree", "2", *EP2,
           "--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_type", "op"]
# four pipeline micro-batches of two rows; the reference runs the eight rows as one micro-batch
PP_CP = ["--training.local_batch_size", "8", "--parallelism.context_parallel_degree", "2",
         "--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule", "1F1B",
         "--parallelism.pipeline_parallel_microbatch_size", "2", *EP2,
         "--checkpoint.enable", "--checkpoint.interval", "5"]


def _matches(ref, run) -> None:
    assert_parity(ref.losses, run.losses)
    for key in ("grad_norm", "mtp_loss", "moe_router_bias_norm"):
        assert_parity([r[key] for r in ref.metrics], [r[key] for r in run.metrics], 1e-5, 1e-4)
    assert [r["moe_load_max_over_mean_avg"] for r in ref.metrics] == [r["moe_load_max_over_mean_avg"] for r in run.metrics]
    assert run.metrics[-1]["moe_router_bias_norm"] > 0 and run.metrics[-1]["mtp_loss"] > 0


def test_fsdp_tp_ep_ac_matches_single_process():
    ref = reference([*DSV3, "--training.local_batch_size", "8"])
    _matches(ref, train(4, [*DSV3, *FSDP_TP]))


def test_pp_cp_ep_matches_single_process_and_resumes_bitwise(tmp_path):
    ref = reference([*DSV3, "--training.local_batch_size", "8"])
    run = train(4, [*DSV3, *PP_CP], dump=tmp_path / "straight")
    _matches(ref, run)
    shutil.copytree(tmp_path / "straight" / "checkpoint" / "step-5", tmp_path / "resumed" / "checkpoint" / "step-5")
    again = train(4, [*DSV3, *PP_CP], dump=tmp_path / "resumed")
    assert "resumed from" in again.output
    assert again.losses == run.losses[5:]
    assert [r["mtp_loss"] for r in again.metrics] == [r["mtp_loss"] for r in run.metrics[5:]]
    a, b = (load_tensors(tmp_path / d / "checkpoint" / "step-10") for d in ("straight", "resumed"))
    assert a.keys() == b.keys() and a["mtp.0.block.moe.router.expert_bias"].abs().sum() > 0
    assert all(a[k].equal(b[k]) for k in a), [k for k in a if not a[k].equal(b[k])][:5]


def test_every_gradient_matches_under_tp():
    # the shared RoPE key's gradient left unsummed over the tp ranks' heads passed the loss
    # parity above (7e-5 after 10 steps); per parameter it is off by 2%
    assert_grad_parity("deepseek_v3", 4, ["2", "2", "ep=2", "+", "2", "2", "nosp", "ep=2"])
