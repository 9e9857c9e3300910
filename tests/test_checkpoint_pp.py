"""Checkpoints of a pipeline run (pp 2 x dp 2): exact resume on the same layout, and the same
checkpoint loads on one process and on dp 4 and continues the same sample stream; the model
converts to a Hugging Face folder. Parameter names are the whole model's on every stage, so
nothing here is pipeline-specific in the files."""

import json
import shutil

import torch
from harness import TINY, assert_parity, train
from test_checkpoint import assert_same_tensors, train_losses

from titanlite.checkpoint.folder import load_tensors
from titanlite.tools.convert import main as convert_main

# constant LR after warm-up: 10 steps, exit, 10 more is the same job as 20 steps
BASE = [*TINY, "--training.global_batch_size", "8", "--lr_scheduler.decay_ratio", "0",
        "--checkpoint.enable", "--checkpoint.interval", "10"]
PP2_DP2 = ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_microbatch_size", "2",
           "--training.local_batch_size", "4"]


def job(steps: int, *extra: str) -> list[str]:
    return [*BASE, "--training.steps", str(steps), *extra]


def test_pp_checkpoint_resumes_exactly_and_loads_on_other_layouts(tmp_path):
    straight, split = tmp_path / "straight", tmp_path / "split"
    train(4, job(20, *PP2_DP2), dump=straight)
    train(4, job(10, *PP2_DP2), dump=split)
    second = train(4, job(20, *PP2_DP2), dump=split)
    assert "resumed from" in second.output and [r["step"] for r in second.metrics] == list(range(1, 21))
    assert train_losses(split) == train_losses(straight)
    assert_same_tensors(straight / "checkpoint" / "step-20", split / "checkpoint" / "step-20")

    ref = train_losses(straight)[10:]
    for nproc, local in ((1, 8), (4, 2)):
        dump = tmp_path / f"n{nproc}"
        shutil.copytree(straight / "checkpoint" / "step-10", dump / "checkpoint" / "step-10")
        run = train(nproc, job(20, "--training.local_batch_size", str(local)), dump=dump)
        assert "resumed from" in run.output and [r["step"] for r in run.metrics] == list(range(11, 21))
        assert_parity(ref, run.losses)

    hf = tmp_path / "hf"
    convert_main(["dcp", "hf", str(straight / "checkpoint" / "step-20"), str(hf)])
    assert json.loads((hf / "config.json").read_text())["num_hidden_layers"] == 4
    model = load_tensors(straight / "checkpoint" / "step-20", "model.")
    assert len(model) == 2 + 9 * 4 + 1 and all(torch.isfinite(v).all() for v in model.values())


def test_tied_embedding_checkpoint_changes_layout_with_its_optimizer_state(tmp_path):
    """A tied flavor: 1 process -> pp 2 -> 1 process. The shared weight's optimizer state is
    saved under its one-process name from every layout, so each resume loads it; the resumed
    losses equal a straight run's."""
    tied = [*job(20, "--model.flavor", "debugmodel_tied"), "--checkpoint.interval", "5"]
    straight = tmp_path / "straight"
    train(1, tied, dump=straight)
    pp, one = tmp_path / "pp", tmp_path / "one"
    shutil.copytree(straight / "checkpoint" / "step-5", pp / "checkpoint" / "step-5")
    staged = train(2, [*tied, "--training.steps", "15", *PP2_DP2[:4]], dump=pp)
    shutil.copytree(pp / "checkpoint" / "step-15", one / "checkpoint" / "step-15")
    last = train(1, tied, dump=one)
    assert [r["step"] for r in staged.metrics] == list(range(6, 16))
    assert [r["step"] for r in last.metrics] == list(range(16, 21))
    assert_parity(train_losses(straight)[5:], staged.losses + last.losses)
