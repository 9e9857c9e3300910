"""gpt-oss under every parallel dimension reproduces one process, and its checkpoints resume and reshard.

One training launch runs context parallel (packed short documents, so 16-key windows straddle
the cp chunks and documents cross them), tensor parallel (sinks and q/k/v biases sharded with
their heads) and expert parallel together, with FSDP over the cp ranks, per-op activation
checkpointing and balancing on, against one process. It saves at step 5, from where a second
launch on the same layout resumes bit for bit, and one process loads it: the same tensors,
optimizer state and router biases, and the same losses to the parity tolerance. One launch
compiles the blocks (attention with windows, sinks and biases; the router; the experts' grouped
GEMMs with their biases and the clamped SwiGLU) under full activation checkpointing, at
cp 2 x ep 2 on the same documents, against the same one process. One gradient launch compares every parameter's
gradient under FSDP x TP x EP, HSDP x EP and PP x FSDP x EP."""

import json
import shutil
from pathlib import Path

import pytest
from harness import TINY, Run, assert_grad_parity, assert_parity, train

from titanlite.checkpoint.folder import load_tensors

GPT_OSS = [*TINY, "--model.name", "gpt_oss", "--training.global_batch_size", "8", "--training.local_batch_size", "8",
           "--moe.aux_loss_coeff", "0.01", "--moe.bias_update_rate", "0.001", "--lr_scheduler.decay_ratio", "0"]
CP2_TP2_EP2 = ["--parallelism.context_parallel_degree", "2", "--parallelism.tensor_parallel_degree", "2",
               "--parallelism.expert_parallel_degree", "2", "--activation_checkpoint.mode", "selective",
               "--activation_checkpoint.selective_type", "op", "--checkpoint.enable", "--checkpoint.interval", "5"]


def _short_documents(folder: Path) -> str:
    """Documents of 4 to 50 tokens-ish words, so every 64-token sample packs several."""
    docs = [f"doc {i}: " + " ".join(str(i * j % 997) for j in range(i % 23 + 2)) for i in range(400)]
    path = folder / "short.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
    return str(path)


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> list[str]:
    corpus = _short_documents(tmp_path_factory.mktemp("corpus"))
    return [*GPT_OSS, "--data.path", corpus, "--data.document_mask", "true"]


@pytest.fixture(scope="module")
def one_process(job) -> Run:
    return train(1, job)


@pytest.fixture(scope="module")
def cp_tp_ep(job, tmp_path_factory) -> Run:
    return train(4, [*job, *CP2_TP2_EP2], dump=tmp_path_factory.mktemp("cp_tp_ep"))


def _assert_curves_match(ref: Run, run: Run) -> None:
    assert_parity(ref.losses, run.losses)
    for key in ("grad_norm", "moe_aux_loss", "moe_router_bias_norm"):
        assert_parity([r[key] for r in ref.metrics], [r[key] for r in run.metrics], 1e-5, 1e-3)


def _tensors(step: Path) -> dict:
    """A checkpoint's tensors, which must hold the optimizer state, the sinks, the expert biases
    and the router's selection biases (moved by balancing, so non-zero)."""
    got = load_tensors(step, "")
    assert "model.layers.0.attention.sinks" in got and "model.layers.0.moe.experts.b2" in got
    assert any(k.startswith("optimizer.state.") for k in got)
    assert got["model.layers.0.moe.router.expert_bias"].abs().sum() > 0
    return got


def _assert_same_tensors(a: Path, b: Path, rng: bool = True) -> None:
    """`rng` False: each rank's generators aside (keyed by the layout: another layout's differ)."""
    x, y = ({k: v for k, v in _tensors(p).items() if rng or not k.startswith("rng.")} for p in (a, b))
    assert x.keys() == y.keys(), sorted(set(x) ^ set(y))
    assert [k for k in x if not x[k].equal(y[k])] == []


def test_cp_tp_ep_match_one_process(one_process, cp_tp_ep):
    assert "gpt_oss debugmodel" in cp_tp_ep.output
    _assert_curves_match(one_process, cp_tp_ep)


def test_cp_tp_ep_resume_is_bitwise(job, cp_tp_ep, tmp_path):
    straight = cp_tp_ep.dump / "checkpoint"
    shutil.copytree(straight / "step-5", tmp_path / "checkpoint" / "step-5")
    again = train(4, [*job, *CP2_TP2_EP2], dump=tmp_path)
    assert "resumed from" in again.output and [r["step"] for r in again.metrics] == list(range(6, 11))
    assert again.losses == cp_tp_ep.losses[5:]
    _assert_same_tensors(straight / "step-10", tmp_path / "checkpoint" / "step-10")


def test_cp_tp_ep_checkpoint_loads_on_one_process(job, cp_tp_ep, tmp_path):
    """Saved sharded over cp 2 x tp 2 x ep 2 with FSDP, loaded whole: what was loaded, saved
    again, is the saved state tensor for tensor, and steps 6-10 follow the uninterrupted run."""
    saved = cp_tp_ep.dump / "checkpoint" / "step-5"
    shutil.copytree(saved, tmp_path / "checkpoint" / "step-5")
    run = train(1, [*job, "--checkpoint.enable"], dump=tmp_path, env={"TITANLITE_TEST_HOOK": "resave"},
                module="tests.ckpt_hooks")
    _assert_same_tensors(saved, tmp_path / "checkpoint-resaved" / "step-5", rng=False)
    assert [r["step"] for r in run.metrics] == list(range(6, 11))
    # assert_parity wants 10 steps; these are the 5 after the load
    for a, b in zip(cp_tp_ep.losses[5:], run.losses, strict=True):
        assert abs(a - b) / abs(a) <= 1e-4, (cp_tp_ep.losses[5:], run.losses)


def test_compiled_blocks_under_full_ac_match_one_process(job, one_process):
    # cp2 x ep2 (the experts split over the cp pair), packed documents straddling the chunks: windows,
    # sinks and the clamped experts compiled under full AC. Compiling on two loaded cores can outlast
    # the default deadlines; Dynamo's log says what it traced
    slow = ["--comm.init_timeout_s", "1200", "--comm.train_timeout_s", "1200"]
    run = train(2, [*job, "--parallelism.context_parallel_degree", "2", "--parallelism.expert_parallel_degree", "2",
                    "--compile.enable", "true", "--activation_checkpoint.mode", "full", *slow],
                env={"TITANLITE_TEST_HOOK": "log_compiles"}, module="tests.ckpt_hooks")
    _assert_curves_match(one_process, run)
    # Dynamo logs to stderr, which a rank keeps in <dump_folder>/logs/ (titanlite.runtime.console)
    logged = "".join(p.read_text() for p in (run.dump / "logs").glob("rank-*.log"))
    traced = [line.rsplit(" ", 2)[-2:] for line in logged.splitlines() if "torchdynamo start tracing" in line]
    for name, where in (("forward", "titanlite/layers/attention.py"), ("forward", "titanlite/layers/moe.py"),
                        ("grouped_swiglu", "titanlite/layers/moe.py")):
        assert any(n == name and where in w for n, w in traced), (name, where, traced)
    assert "recompile_limit" not in logged  # no compiled part fell back to eager


def test_every_gradient_matches_under_fsdp_tp_ep_hsdp_and_pp():
    # one launch, three layouts on 4 ranks: fsdp2 x tp2 x ep2 (sequence parallel, sinks and biases
    # sharded with their heads), HSDP (2 replicas x fsdp2) x ep2, pp2 x fsdp2 x ep2 (1F1B);
    # 16-key windows over 32 tokens
    assert_grad_parity("gpt_oss", 4, ["2", "2", "ep=2", "+", "2", "1", "ep=2", "rep=2",
                                      "+", "pp", "2", "2", "1", "1F1B", "ep=2"])
