"""gpt-oss under every parallel dimension reproduces one process.

One training launch runs context parallel (packed short documents, so 16-key windows straddle
the cp chunks and documents cross them), tensor parallel (sinks and q/k/v biases sharded with
their heads) and expert parallel together, with FSDP over the cp ranks, per-op activation
checkpointing and balancing on, against
one process, which checkpoints and is resumed bitwise (the same checkpoint code under expert
parallel and resharding is tests/test_moe_checkpoint.py's). One gradient launch compares every
parameter's gradient under FSDP x TP x EP, HSDP x EP and PP x FSDP x EP."""

import json
import shutil

from harness import TINY, assert_grad_parity, assert_parity, train

from titanlite.checkpoint.dcp import load_tensors

GPT_OSS = [*TINY, "--model.name", "gpt_oss", "--training.global_batch_size", "8", "--training.local_batch_size", "8",
           "--moe.aux_loss_coeff", "0.01", "--moe.bias_update_rate", "0.001", "--lr_scheduler.decay_ratio", "0"]
CP2_TP2_EP2 = ["--parallelism.context_parallel_degree", "2", "--parallelism.tensor_parallel_degree", "2",
               "--parallelism.expert_parallel_degree", "2", "--activation_checkpoint.mode", "selective",
               "--activation_checkpoint.selective_type", "op"]
CKPT = ["--checkpoint.enable", "--checkpoint.interval", "5"]


def _short_documents(folder) -> str:
    """Documents of 4 to 50 tokens-ish words, so every 64-token sample packs several."""
    docs = [f"doc {i}: " + " ".join(str(i * j % 997) for j in range(i % 23 + 2)) for i in range(400)]
    path = folder / "short.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
    return str(path)


def test_cp_tp_ep_match_one_process_and_resume_bitwise(tmp_path_factory):
    data = ["--data.path", _short_documents(tmp_path_factory.mktemp("corpus")), "--data.document_mask", "true"]
    straight = tmp_path_factory.mktemp("straight")
    ref = train(1, [*GPT_OSS, *data, *CKPT], dump=straight)
    run = train(4, [*GPT_OSS, *data, *CP2_TP2_EP2])
    assert "gpt_oss debugmodel" in run.output
    assert_parity(ref.losses, run.losses)
    for key in ("grad_norm", "moe_aux_loss", "moe_router_bias_norm"):
        assert_parity([r[key] for r in ref.metrics], [r[key] for r in run.metrics], 1e-5, 1e-3)
    # resume from step 5: the same losses and weights, bit for bit
    resumed = tmp_path_factory.mktemp("resumed")
    shutil.copytree(straight / "checkpoint" / "step-5", resumed / "checkpoint" / "step-5")
    again = train(1, [*GPT_OSS, *data, *CKPT], dump=resumed)
    assert "resumed from" in again.output and [r["step"] for r in again.metrics] == list(range(6, 11))
    assert again.losses == ref.losses[5:]
    a, b = load_tensors(straight / "checkpoint" / "step-10"), load_tensors(resumed / "checkpoint" / "step-10")
    assert a.keys() == b.keys() and "layers.0.attention.sinks" in a and "layers.0.moe.experts.b2" in a
    assert a["layers.0.moe.router.expert_bias"].abs().sum() > 0
    assert [k for k in a if not a[k].equal(b[k])] == []

def test_every_gradient_matches_under_fsdp_tp_ep_hsdp_and_pp():
    # one launch, three layouts on 4 ranks: fsdp2 x tp2 x ep2 (sequence parallel, sinks and biases
    # sharded with their heads), HSDP (2 replicas x fsdp2) x ep2, pp2 x fsdp2 x ep2 (1F1B);
    # 16-key windows over 32 tokens
    assert_grad_parity("gpt_oss", 4, ["2", "2", "ep=2", "+", "2", "1", "ep=2", "rep=2",
                                      "+", "pp", "2", "2", "1", "1F1B", "ep=2"])
