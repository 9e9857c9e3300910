"""docs/fork_a_model.md, step by step, in a temporary copy of the repository."""

import os
import re
import shutil
import subprocess
import sys

from harness import REPO, Run

ARGS = ["--model.flavor", "debugmodel", "--training.seq_len", "64", "--training.local_batch_size", "8",
        "--metrics.log_freq", "1", "--metrics.enable_tensorboard", "false", "--data.holdout_fraction", "0.0"]


def _run_train(repo, dump, args, code=0):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONWARNINGS": "ignore",
           "PYTHONPATH": str(repo), "NGPU": "1"}
    proc = subprocess.run(["bash", "run_train.sh", "--job.dump_folder", str(dump), *ARGS, *args],
                          capture_output=True, text=True, env=env, cwd=repo, timeout=300)
    run = Run(proc.returncode, proc.stdout + proc.stderr, dump)
    # run_train.sh's launcher already ignores the known post-completion gloo SIGABRT
    assert proc.returncode == code, run.output[-4000:]
    return run


def _edit(path, old, new):
    text = path.read_text()
    assert text.count(old) == 1, f"{old!r} not found exactly once in {path}"
    path.write_text(text.replace(old, new))


def test_copy_edit_and_train_a_forked_model(tmp_path):
    repo = tmp_path / "repo"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for folder in ("titanlite", "models", "train_configs"):
        shutil.copytree(REPO / folder, repo / folder, ignore=ignore, symlinks=True)  # titanlite/models links to models/
    shutil.copy2(REPO / "run_train.sh", repo / "run_train.sh")

    # 1. copy  2. name  3. change one detail (the documented SiLU -> GELU)
    shutil.copytree(repo / "models" / "llama3", repo / "models" / "my_llama", ignore=ignore)
    _edit(repo / "models" / "my_llama" / "__init__.py", 'name="llama3"', 'name="my_llama"')
    _edit(repo / "models" / "my_llama" / "model.py", "FeedForward(args.dim, args.ffn_hidden, F.silu)",
          "FeedForward(args.dim, args.ffn_hidden, F.gelu)")

    # 4. train from the command line, in two halves: the fork's checkpoint records its family, so
    # the fork resumes it, while llama3, with the very same parameter names and shapes, is refused
    # on the ranks (the preflight, skipped here, refuses it too)
    ckpt = ["--checkpoint.enable", "--checkpoint.interval", "15", "--lr_scheduler.warmup_steps", "3"]
    fork = _run_train(repo, tmp_path / "fork", ["--model.name", "my_llama", "--training.steps", "15", *ckpt])
    assert re.search(r"titanlite: my_llama debugmodel", fork.output), fork.output[-2000:]
    saved = tmp_path / "fork" / "checkpoint" / "step-15"
    refused = _run_train(repo, tmp_path / "fork", ["--skip-preflight", "--model.name", "llama3",
                                                   "--training.steps", "30", *ckpt], code=2)
    line = (f"titanlite: error: {saved} holds a checkpoint of model 'my_llama', not of 'llama3' (model.name): "
            "another model's weights would load into it")
    assert line in refused.output.strip().splitlines()[-1], refused.output[-2000:]
    resumed = _run_train(repo, tmp_path / "fork", ["--model.name", "my_llama", "--training.steps", "30", *ckpt])
    assert f"resumed from {saved}" in resumed.output, resumed.output[-2000:]
    losses = resumed.losses  # both halves' rows
    assert len(losses) == 30
    assert max(losses[-5:]) < 0.6 * losses[0], losses

    # the edit took effect: with the same seeded weights, the fork's logits differ from llama3's
    probe = """
import torch
import titanlite.models.llama3 as base, titanlite.models.my_llama as fork
args = base.flavors["debugmodel"].__class__(**{**base.flavors["debugmodel"].__dict__, "max_seq_len": 16})
a, b = base.Transformer(args), fork.Transformer(args)
a.init_weights(0); b.init_weights(0)
assert a.state_dict().keys() == b.state_dict().keys()
assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
tokens = torch.randint(0, args.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
print((a(tokens) - b(tokens)).abs().max().item())
"""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(repo)}
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, cwd=repo,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert float(proc.stdout) > 1e-4, proc.stdout
