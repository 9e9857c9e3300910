"""End to end through run_train.sh: the default job, multi-rank launch, metrics, bad input."""

import json
import re
import socket
import subprocess
import sys
import time

import pytest
from harness import REPO, TINY, _env, reference

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from titanlite.config.load import load, to_toml

TAGS = {"loss/train", "train/grad_norm", "train/lr", "perf/tokens_per_sec", "memory/peak_gib"}
KEYS = {"step", "loss", "grad_norm", "lr", "tokens_per_sec", "mfu_pct", "peak_gib", "skipped_steps", "epoch", "run",
        "superseded"}


def run_sh(args, ngpu=1, timeout=600):
    env = _env({"NGPU": str(ngpu)})
    start = time.monotonic()
    proc = subprocess.run([str(REPO / "run_train.sh"), *args], capture_output=True, text=True, env=env,
                          timeout=timeout, cwd=REPO)
    return proc, time.monotonic() - start


def test_default_job_loss_falls_and_metrics_are_written(tmp_path):
    """The README's quick start (the default config), cut from 100 steps to 20 to save CI minutes."""
    proc, _ = run_sh(["--job.dump_folder", str(tmp_path), "--job.run_name", "r", "--training.steps", "20"])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 10, 20]
    assert set(rows[0]) == KEYS | {"begins"} and all(set(r) == KEYS for r in rows[1:])
    assert rows[0]["begins"] == "start" and {r["run"] for r in rows} == {"r"} and not any(r["superseded"] for r in rows)
    assert rows[-1]["loss"] < 0.6 * rows[0]["loss"], [r["loss"] for r in rows]
    events = EventAccumulator(str(tmp_path / "tb" / "r"))
    events.Reload()
    assert TAGS <= set(events.Tags()["scalars"])
    assert "config/text_summary" in events.Tags()["tensors"]
    assert [e.value for e in events.Scalars("loss/train")] == pytest.approx([r["loss"] for r in rows])


def test_launcher_resolves_config_and_runs_gloo_ranks(tmp_path):
    """The user's multi-rank path: NGPU=2 ./run_train.sh --config NAME (a bare name found in
    train_configs/) with TP 2, logging every 4th step, against the single-process run."""
    job = ["--config", "debug_model.toml", "--training.steps", "12", "--training.seq_len", "64",
           "--training.local_batch_size", "4", "--lr_scheduler.warmup_steps", "2", "--metrics.enable_tensorboard", "false",
           "--data.holdout_fraction", "0.0"]
    proc, _ = run_sh([*job, "--job.dump_folder", str(tmp_path), "--metrics.log_freq", "4",
                      "--parallelism.tensor_parallel_degree", "2"], ngpu=2)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "tp=2" in proc.stdout
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 4, 8, 12]
    one = reference([*job, "--metrics.log_freq", "1"]).losses
    for row in rows:
        rel = abs(row["loss"] - one[row["step"] - 1]) / abs(one[row["step"] - 1])
        assert rel <= (1e-6 if row["step"] == 1 else 1e-4), (row, one)


def test_lone_process_needs_no_free_port(tmp_path):
    """Without torchrun the trainer is a world of one on an in-memory store: it does not bind
    the default rendezvous port, so a second lone run (or anything else on 29500) is no clash."""
    env = {k: v for k, v in _env(None).items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")}
    with socket.socket() as busy:
        busy.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            busy.bind(("127.0.0.1", 29500))
            busy.listen()
        except OSError:
            pass  # already taken by something else: just as busy
        proc = subprocess.run([sys.executable, "-m", "titanlite.train", *TINY, "--training.steps", "3",
                               "--job.dump_folder", str(tmp_path)], capture_output=True, text=True, env=env,
                              timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "status" / "rank-0.done").exists()


def test_help_and_print_config():
    proc, _ = run_sh(["--help"])
    assert proc.returncode == 0 and "--training.steps" in proc.stdout
    proc, _ = run_sh(["--config", "llama_8b.toml", "--print-config"])
    assert proc.returncode == 0 and 'flavor = "8B"' in proc.stdout
    # one default job: the bare command runs train_configs/debug_model.toml, its Muon LR included
    proc, _ = run_sh(["--print-config"])
    default, _ = load(["--config", "debug_model.toml"])
    assert proc.returncode == 0 and proc.stdout == to_toml(default) + "\n", proc.stdout + proc.stderr
    assert "muon_lr = 0.016" in proc.stdout


def _tokenizer_folder_without_files(tmp_path):
    folder = tmp_path / "tok"
    folder.mkdir()
    (folder / "README").write_text("no tokenizer here")
    return str(folder)


@pytest.mark.parametrize("case", ["missing_config", "unknown_model", "unknown_flavor", "missing_data",
                                  "empty_tokenizer", "world_size", "typo", "wrong_type"])
def test_bad_input_one_line_fast_nonzero(tmp_path, case):
    args, ngpu, expect = {
        "missing_config": (["--config", "nope.toml"], 1, "config file 'nope.toml' not found"),
        "unknown_model": (["--model.name", "gpt5"], 1, "unknown model 'gpt5'"),
        "unknown_flavor": (["--model.flavor", "9B"], 1, "unknown flavor '9B'"),
        "missing_data": (["--data.path", str(tmp_path / "none")], 1, "does not exist"),
        "empty_tokenizer": (["--data.tokenizer", _tokenizer_folder_without_files(tmp_path)], 1,
                            "has no tokenizer files"),
        "world_size": (["--parallelism.data_parallel_shard_degree", "3"], 2, "differ from the world size 2"),
        "typo": (["--training.stepz", "3"], 1, "did you mean 'steps'?"),
        "wrong_type": (["--training.steps", "many"], 1, "expected int"),
    }[case]
    proc, elapsed = run_sh(args, ngpu=ngpu, timeout=60)
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("titanlite: error: ") and expect in lines[0], proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    assert elapsed < 30


def test_bad_input_under_plain_torchrun_exits_on_every_rank(tmp_path):
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           "-m", "titanlite.train", "--data.path", str(tmp_path / "missing")],
                          capture_output=True, text=True, env=_env(None), timeout=60, cwd=REPO)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0 and time.monotonic() - start < 30
    # Each rank says the error itself, unless torchrun's agent, seeing the other rank fail
    # first, ended it (SIGTERM, listed in the agent's failure report) before it got there. A
    # rank can do both: say it, then be ended while it exits.
    suffix = {0: "$", 1: r" \[rank 1\]"}
    said = [r for r in (0, 1) if re.search(r"titanlite: error: data\.path: .* does not exist" + suffix[r], output, re.M)]
    ended = [r for r in (0, 1) if re.search(rf"rank\s*: {r} \(local_rank: {r}\)\s*\n\s*exitcode\s*: -15 ", output)]
    assert said and set(said) | set(ended) == {0, 1}, output
