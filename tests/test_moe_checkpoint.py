"""Qwen3-MoE checkpoints: exact resume under expert parallelism, and a checkpoint saved at ep2
loads at ep1 (one process) and at ep4, holds the same stacked expert tensors, and continues
the same sample stream. Balancing is on, so the router biases (buffers) travel too."""

import json
import shutil
from pathlib import Path

import pytest
from harness import TINY, train

from titanlite.checkpoint.folder import load_tensors

BASE = [*TINY, "--model.name", "qwen3_moe", "--training.global_batch_size", "8", "--lr_scheduler.decay_ratio", "0",
        "--checkpoint.enable", "--checkpoint.interval", "5", "--moe.aux_loss_coeff", "0.01",
        "--moe.bias_update_rate", "0.001"]
EP = {1: ["--training.local_batch_size", "8"],
      2: ["--training.local_batch_size", "4", "--parallelism.expert_parallel_degree", "2"],
      4: ["--training.local_batch_size", "2", "--parallelism.expert_parallel_degree", "4"]}


def job(ep: int, steps: int) -> list[str]:
    return [*BASE, *EP[ep], "--training.steps", str(steps)]


def losses(dump: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (dump / "metrics.jsonl").read_text().splitlines()]


def assert_same_tensors(a: Path, b: Path, prefix: str = "", rng: bool = True) -> None:
    """`rng` False: each rank's generators aside (keyed by the layout: another layout's differ)."""
    x, y = ({k: v for k, v in load_tensors(p, prefix).items() if rng or not k.startswith("rng.")} for p in (a, b))
    assert x.keys() == y.keys(), sorted(set(x) ^ set(y))
    assert "model.layers.0.moe.experts.w1" in x and x["model.layers.0.moe.experts.w1"].shape[0] == 8
    assert x["model.layers.0.moe.router.expert_bias"].abs().sum() > 0
    different = [k for k in x if not x[k].equal(y[k])]
    assert not different, f"{a} vs {b} differ in {different[:5]}"


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    dump = tmp_path_factory.mktemp("moe_ep2")
    train(2, job(2, 10), dump=dump)
    return dump


def test_resume_is_bitwise_under_ep2(straight, tmp_path):
    train(2, job(2, 5), dump=tmp_path)
    second = train(2, job(2, 10), dump=tmp_path)
    assert "resumed from" in second.output
    assert losses(tmp_path) == losses(straight)
    assert_same_tensors(straight / "checkpoint" / "step-10", tmp_path / "checkpoint" / "step-10")


@pytest.mark.parametrize("ep", [1, 4])
def test_ep2_checkpoint_loads_at_another_degree(ep, straight, tmp_path):
    shutil.copytree(straight / "checkpoint" / "step-5", tmp_path / "checkpoint" / "step-5")
    run = train(ep, job(ep, 10), dump=tmp_path, env={"TITANLITE_TEST_HOOK": "resave"}, module="tests.ckpt_hooks")
    assert_same_tensors(straight / "checkpoint" / "step-5", tmp_path / "checkpoint-resaved" / "step-5", rng=False)
    assert [r["step"] for r in run.metrics] == list(range(6, 11))
    # assert_parity wants 10 steps; these are the 5 after the load
    for a, b in zip(losses(straight)[5:], run.losses):
        assert abs(a - b) / abs(a) <= 1e-4, (losses(straight)[5:], run.losses)
