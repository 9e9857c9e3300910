"""Qwen3.5 (hybrid linear attention) under each parallelism reproduces one process: every
gradient and Muon update of one step (FSDP x TP with and without sequence parallel, HSDP,
pipeline stages, context parallel with FSDP and with TP on packed documents; the MoE flavor
under EP, also EP 4 over FSDP 2 x CP 2), and a 10-step training run with packed documents under context parallel 2 with
activation checkpointing and compiled blocks (the chunk scan and the cp exchange in the graph; TP under compile:
tests/test_speed.py), resumed bitwise from its step-5 checkpoint.
A compiled block: tests/test_linear_attention.py."""

import json
import shutil

import pytest
from harness import TINY, assert_grad_parity, assert_parity, reference, train

QWEN3_5 = [*TINY, "--model.name", "qwen3_5", "--training.global_batch_size", "4", "--data.document_mask", "true",
           "--lr_scheduler.decay_ratio", "0"]
LAYOUTS = ["--training.local_batch_size", "4", "--parallelism.context_parallel_degree", "2",
           "--activation_checkpoint.mode", "full",
           "--checkpoint.enable", "--checkpoint.interval", "5",
           # per-block compile (fullgraph: the chunk scan and the cp exchange inside); compiling on
           # two loaded cores can outlast the default deadlines
           "--compile.enable", "true", "--comm.init_timeout_s", "1200", "--comm.train_timeout_s", "1200"]


@pytest.mark.parametrize("model,layouts", [
    ("qwen3_5", "2 2 muon + 2 2 nosp + 2 1 rep=2 + pp 2 2 1 1F1B muon + 2 1 cp=2 + 1 2 cp=2 muon"),
    ("qwen3_5/debugmodel_moe", "2 2 ep=2 muon + 4 1 ep=4 + pp 2 2 1 1F1B ep=2 + 2 1 cp=2 ep=4"),
], ids=["dense", "moe"])
def test_every_gradient_and_update_matches_one_process(model, layouts):
    assert_grad_parity(model, 4, layouts.split())


def test_training_matches_one_process_and_resumes_bitwise(tmp_path):
    ref = reference([*QWEN3_5, "--training.local_batch_size", "4"])
    run = train(2, [*QWEN3_5, *LAYOUTS], dump=tmp_path / "straight")
    assert "qwen3_5 debugmodel" in run.output
    assert_parity(ref.losses, run.losses)
    assert_parity([r["grad_norm"] for r in ref.metrics], [r["grad_norm"] for r in run.metrics], 1e-5, 1e-3)
    shutil.copytree(tmp_path / "straight" / "checkpoint" / "step-5", tmp_path / "resumed" / "checkpoint" / "step-5")
    again = train(2, [*QWEN3_5, *LAYOUTS], dump=tmp_path / "resumed")
    assert "resumed from" in again.output
    assert [r["loss"] for r in again.metrics] == run.losses[5:]
