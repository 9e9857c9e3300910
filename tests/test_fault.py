"""Faults on a live gloo job: non-finite steps, preemption signals, dead and hung ranks, profiling.

Ranks are started without a torchrun agent that would kill the survivors for us, as on a
multi-node job where the failed rank is elsewhere. Each test is bounded.
"""

from __future__ import annotations

import json
import math
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from harness import REPO, TINY, Forked, _env, fork_ranks, launch, train

from titanlite.checkpoint.folder import load_tensors

LIMIT_S = 120


@dataclass
class Ranks:
    procs: list[Forked]
    dump: Path

    def log(self, rank: int) -> str:
        return (self.dump / f"rank-{rank}.log").read_text()

    def wait(self, timeout: float = LIMIT_S) -> list[int]:
        deadline = time.monotonic() + timeout
        try:
            return [p.wait(timeout=max(0.1, deadline - time.monotonic())) for p in self.procs]
        finally:
            for p in self.procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()

    def metrics(self) -> list[dict]:
        path = self.dump / "metrics.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    def done(self, rank: int) -> dict:
        return json.loads((self.dump / "status" / f"rank-{rank}.done").read_text())


def spawn(nproc: int, args: list[str], dump: Path, faults: str = "") -> Ranks:
    """Start `nproc` trainer processes that rendezvous on a fresh local port."""
    logs = [dump / f"rank-{rank}.log" for rank in range(nproc)]
    return Ranks(fork_ranks(nproc, ["-m", "titanlite.train", "--job.dump_folder", str(dump), *args], logs,
                            {"TITANLITE_FAULTS": faults}), dump)


def _errors(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("titanlite: error:")]


# -- non-finite loss ----------------------------------------------------------------------

@pytest.mark.parametrize("log_freq", [1, 5])
def test_nonfinite_stop_names_the_step_on_every_rank(tmp_path, log_freq):
    # NaN on rank 1 only: the all-reduced flag must stop rank 0 at the same step. With
    # log_freq 5 step 3 syncs nothing, so its verdict is read during step 4.
    args = [*TINY, "--metrics.log_freq", str(log_freq)]
    ranks = spawn(2, args, tmp_path, faults="nan@3:1")
    codes = ranks.wait()
    assert codes == [1, 1], [ranks.log(0), ranks.log(1)]
    for r in range(2):
        (err,) = _errors(ranks.log(r))
        assert "step 3: non-finite loss (training.on_nonfinite = stop)" in err
        assert "Traceback" not in ranks.log(r)
    # nothing logged after the bad step
    assert [m["step"] for m in ranks.metrics()] == ([1, 2] if log_freq == 1 else [1])


def test_nonfinite_skip_keeps_training_finite(tmp_path):
    args = [*TINY, "--training.on_nonfinite", "skip", "--training.max_skipped_steps", "2"]
    ranks = spawn(2, args, tmp_path, faults="nan@3:1,nan@6")
    assert ranks.wait() == [0, 0], ranks.log(0)
    rows = ranks.metrics()
    assert [m["step"] for m in rows] == list(range(1, 11))
    assert [m["skipped_steps"] for m in rows] == [0, 0, 1, 1, 1, 2, 2, 2, 2, 2]
    assert math.isnan(rows[2]["loss"]) and math.isnan(rows[5]["loss"])
    # one NaN update would have poisoned AdamW's moments and every later loss
    finite = [m["loss"] for i, m in enumerate(rows) if i not in (2, 5)]
    assert all(math.isfinite(v) for v in finite) and finite[-1] < finite[0]
    assert ranks.log(0).count("optimizer step skipped") == 2
    # Logging every 5th step, the host reads steps 3 and 6 late: the device alone must keep
    # their updates out, bit for bit as when the host decided before the update.
    (tmp_path / "late").mkdir()
    late = spawn(2, [*args, "--metrics.log_freq", "5"], tmp_path / "late", faults="nan@3:1,nan@6")
    assert late.wait() == [0, 0], late.log(0)
    assert [(m["step"], m["loss"], m["skipped_steps"]) for m in late.metrics()] == [
        (s, rows[s - 1]["loss"], rows[s - 1]["skipped_steps"]) for s in (1, 5, 10)]
    assert "step 3: non-finite loss; optimizer step skipped" in late.log(0)
    assert "step 6: non-finite loss; optimizer step skipped" in late.log(0)


def test_nonfinite_skip_stops_past_max_skipped_steps(tmp_path):
    args = [*TINY, "--training.on_nonfinite", "skip", "--training.max_skipped_steps", "1"]
    run = launch(1, args, dump=tmp_path, env={"TITANLITE_FAULTS": "nan@2,nan@4"}, timeout=LIMIT_S)
    assert run.returncode != 0
    assert "step 4: 2 steps with non-finite loss or gradients, more than training.max_skipped_steps (1)" in run.output
    assert run.metrics[-1]["step"] == 3


# -- loss spikes and stragglers (one pair of 2-rank launches, plus a resume) ----------------

SPIKY = [*TINY, "--training.steps", "15", "--metrics.log_freq", "4"]


def test_a_spike_is_skipped_as_a_nan_and_a_slow_rank_is_named(tmp_path):
    # spike@11 on rank 1 scales its loss: only the all-reduced loss shows it, so both ranks must
    # judge it from the same window. Step 11 logs nothing: its verdict is read a step late.
    # A NaN at step 7 in both runs: the checkpoint of step 10 holds one skipped step
    skip = ["--training.on_nonfinite", "skip"]
    spiky = [*SPIKY, *skip, "--training.on_spike", "skip", "--training.spike_window", "5", *CKPT,
             "--checkpoint.interval", "10", "--metrics.straggler_ratio", "1.1", "--metrics.straggler_logs", "2"]
    (tmp_path / "spike").mkdir()
    ranks = spawn(2, spiky, tmp_path / "spike", faults="nan@7:1,spike@11:1,slow@8:1")
    (tmp_path / "nan").mkdir()
    nan = spawn(2, [*SPIKY, *skip], tmp_path / "nan", faults="nan@7:1,nan@11:1")
    assert ranks.wait() == [0, 0], [ranks.log(0), ranks.log(1)]
    assert nan.wait() == [0, 0], nan.log(0)
    rows, nan_rows = ranks.metrics(), nan.metrics()
    assert [m["step"] for m in rows] == [m["step"] for m in nan_rows] == [1, 4, 8, 12, 15]
    # bit for bit: a skipped spike leaves the weights, moments and data as a skipped NaN does
    assert [(m["loss"], m["grad_norm"], m["skipped_steps"]) for m in rows] == [
        (m["loss"], m["grad_norm"], m["skipped_steps"]) for m in nan_rows]
    assert [m["spike_steps"] for m in rows] == [0, 0, 0, 1, 1] and "spike_steps" not in nan_rows[0]
    assert [m["skipped_steps"] for m in rows] == [0, 0, 1, 2, 2]
    assert "step 11: loss or gradient norm over training.spike_sigmas (6) standard deviations" in ranks.log(0)
    # rank 1 sleeps in every step from 8: named on steps 8, 12 and 15, warned once, at the 2nd log over
    assert [m["straggler_rank"] for m in rows[2:]] == [1, 1, 1], rows
    assert all(m["straggler_ratio"] > 1.1 and m["straggler_host"] for m in rows[2:])
    assert "straggler_ratio" not in nan_rows[0]
    (warning,) = [line for line in ranks.log(0).splitlines() if "is a straggler" in line]
    assert warning.startswith("titanlite: warning: step 12: rank 1 on ") and "for 2 logs in a row" in warning
    # the window and the counts are part of the checkpoint: resumed at step 10, the spike at 11 is
    # judged as before, and counted on from step 7's skip
    resumed = tmp_path / "resumed"
    (resumed / "checkpoint").mkdir(parents=True)
    (tmp_path / "spike" / "checkpoint" / "step-10").rename(resumed / "checkpoint" / "step-10")
    again = spawn(2, [*spiky, "--metrics.straggler_ratio", "0"], resumed, faults="spike@11:1")
    assert again.wait() == [0, 0], again.log(0)
    assert [(m["step"], m["loss"], m["spike_steps"], m["skipped_steps"]) for m in again.metrics()] == [
        (m["step"], m["loss"], 1, 2) for m in rows[3:]]


def test_spike_rollback_equals_a_resume_that_skips_the_same_samples(tmp_path):
    # two spikes in a row (11, 12) send the run back to step-10 with steps 11-12's samples
    # (global batch 4: 40-48) skipped; a run from that checkpoint told to skip them by config
    # logs the same losses, and the range saved with step-15 keeps a later resume off them
    args = [*SPIKY, "--metrics.log_freq", "1", "--training.on_spike", "rollback", "--training.spike_window", "5",
            "--training.spike_rollback_after", "2", *CKPT, "--checkpoint.interval", "5",
            "--metrics.enable_tensorboard", "true"]
    rolled = train(1, args, dump=tmp_path / "rolled", env={"TITANLITE_FAULTS": "spike@11,spike@12"}, timeout=LIMIT_S)
    said = [line for line in rolled.output.splitlines() if line.startswith("titanlite: warning:")]
    assert [line.split(":")[2] for line in said] == [" step 11", " step 12", " step 12"], said
    assert said[2].endswith("2 spikes in a row (steps 11-12); rolled back to step 10, samples 40-48 skipped from "
                            "now on (training.on_spike = rollback)") and "resumed from" not in rolled.output
    # every spike is recorded (step 12 too, before the rollback); the rows it undid are superseded
    assert [(m["step"], m["superseded"]) for m in rolled.metrics] == [
        *((s, s > 10) for s in range(1, 13)), *((s, False) for s in range(11, 16))]
    assert [rolled.line[s]["spike_steps"] for s in (10, 11, 12, 15)] == [0, 2, 2, 2]  # the rollback keeps the count
    assert rolled.line[11]["begins"] == "rollback to step 10" and rolled.metrics[11]["loss"] > 100
    # TensorBoard shows the run's line: the replayed steps' values, once each
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (tb,) = (tmp_path / "rolled" / "tb").iterdir()
    acc = EventAccumulator(str(tb))
    acc.Reload()
    shown = [(e.step, e.value) for e in acc.Scalars("loss/train")]
    assert shown == [(s, pytest.approx(rolled.line[s]["loss"], rel=1e-6)) for s in range(1, 16)], shown
    # resumed with a global batch of 8: steps 11-12 read samples 40-56 (the cursor's 40 on), not 80-96
    shutil.copytree(tmp_path / "rolled" / "checkpoint" / "step-10", tmp_path / "rebatched" / "checkpoint" / "step-10")
    rebatched = train(1, [*args, "--training.global_batch_size", "8", "--training.steps", "13"],
                      dump=tmp_path / "rebatched", env={"TITANLITE_FAULTS": "spike@11,spike@12"}, timeout=LIMIT_S)
    assert "rolled back to step 10, samples 40-56 skipped from now on" in rebatched.output, rebatched.output
    wider = launch(1, [*args, "--training.global_batch_size", "8", "--training.spike_window", "8"],
                   dump=tmp_path / "rebatched")
    assert wider.returncode == 2 and ("holds 'spike_window.values' of shape (5, 2), this run's training.spike_window "
                                      "makes it (8, 2) (training.spike_window 5 then, 8 now): the checkpoint is sound"
                                      ) in wider.output, wider.output
    (tmp_path / "by_config" / "checkpoint").mkdir(parents=True)
    (tmp_path / "rolled" / "checkpoint" / "step-10").rename(tmp_path / "by_config" / "checkpoint" / "step-10")
    skip = [*args, "--data.skip_samples", "40-48"]
    by_config = train(1, skip, dump=tmp_path / "by_config", timeout=LIMIT_S)
    assert [rolled.line[s]["loss"] for s in range(11, 16)] == by_config.losses  # bit for bit
    # two more steps: the rolled run told nothing, the other still told by config
    later = train(1, [*args, "--training.steps", "17"], dump=tmp_path / "rolled", timeout=LIMIT_S)
    told = train(1, [*skip, "--training.steps", "17"], dump=tmp_path / "by_config", timeout=LIMIT_S)
    assert later.losses[-2:] == told.losses[-2:]


# A signal read late (arrived in step 3, read during step 4) makes step 4 the last: it must
# read its own verdict at once, or a NaN there would be saved without a word.
LATE_STOP = """
import os, signal, sys, torch
os.environ["TITANLITE_REPORT_DIR"] = sys.argv[1]  # under the launcher, which noted no signal: torchrun's
import torch.distributed as dist
from titanlite.config.job import Comm, Training
from titanlite.parallel.grad_norm import global_norm
from titanlite.runtime.fault import Guard, RunError
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
guard = Guard(0, sys.argv[1], Comm(), Training(), shutdown_timeout_s=60, start_step=2)
guard.start_step(3)
os.kill(os.getpid(), signal.SIGTERM)
bad = guard.decide(*global_norm(torch.tensor(4.0), guard.votes(torch.tensor(1.0))), read_now=False)
assert guard.vote.signal_name == "SIGTERM" and not guard.vote.users and not guard.verdict.stop and bad.item() == 0
guard.start_step(4)
try:
    guard.decide(*global_norm(torch.tensor(4.0), guard.votes(torch.tensor(float("nan")))), read_now=False)
except RunError as e:
    print("raised:", e, flush=True)
print("stop:", guard.verdict.stop, flush=True)
guard.close()
"""


def test_the_step_that_stops_reads_its_own_verdict(tmp_path):
    proc = subprocess.run([sys.executable, "-c", LATE_STOP, str(tmp_path)], capture_output=True, text=True,
                          env=_env(None), cwd=REPO, timeout=LIMIT_S)
    assert "raised: step 4: non-finite loss (training.on_nonfinite = stop)" in proc.stdout, proc.stdout + proc.stderr
    assert "stop: True" in proc.stdout
    # torchrun's SIGTERM, sent after another rank failed, is not told as the user's
    assert "received" not in proc.stdout + proc.stderr, proc.stdout + proc.stderr


# -- preemption ---------------------------------------------------------------------------

# log_freq 7: most steps sync nothing, so the signal's verdict is read a step late
@pytest.mark.parametrize("sig,target,log_freq", [(signal.SIGTERM, 1, 7), (signal.SIGINT, 0, 1)])
def test_signal_to_one_rank_stops_all_at_the_same_step(tmp_path, sig, target, log_freq):
    args = [*TINY, "--training.steps", "400", "--job.shutdown_timeout_s", "20", "--metrics.log_freq", str(log_freq)]
    ranks = spawn(2, args, tmp_path)
    deadline = time.monotonic() + LIMIT_S
    while not any(m["step"] >= 3 for m in ranks.metrics()):
        assert time.monotonic() < deadline and all(p.poll() is None for p in ranks.procs), ranks.log(0)
        time.sleep(0.05)
    ranks.procs[target].send_signal(sig)
    signalled = time.monotonic()
    assert ranks.wait() == [0, 0], [ranks.log(0), ranks.log(1)]
    assert time.monotonic() - signalled < 20
    stopped = {ranks.done(r)["step"] for r in range(2)}
    assert len(stopped) == 1 and 3 <= stopped.pop() < 400
    assert ranks.done(target)["signal"] == sig.name
    assert ranks.metrics()[-1]["step"] == ranks.done(0)["step"]
    assert f"stopped at step {ranks.done(0)['step']}" in ranks.log(0)


# -- dead and hung ranks ------------------------------------------------------------------

def test_dead_rank_survivor_exits_with_a_message_and_the_restart_resumes(tmp_path):
    args = [*TINY, "--comm.train_timeout_s", "30", "--comm.init_timeout_s", "60",
            "--checkpoint.enable", "true", "--checkpoint.interval", "2"]
    ranks = spawn(2, args, tmp_path, faults="kill@4:1")
    start = time.monotonic()
    codes = ranks.wait()
    assert codes[1] == -signal.SIGKILL
    assert codes[0] != 0 and time.monotonic() - start < 90, ranks.log(0)
    (err,) = _errors(ranks.log(0))
    # gloo sees the closed connection at once; the watchdog is the fallback for silent peers
    assert "step 4:" in err and ("a peer rank probably died" in err or "exceeded comm.train_timeout_s" in err), err
    assert (tmp_path / "hang" / "rank-0.txt").exists()
    assert sorted(p.name for p in (tmp_path / "checkpoint").iterdir()) == ["step-2"]
    again = spawn(2, args, tmp_path)
    assert again.wait() == [0, 0], again.log(0)
    assert f"resumed from {tmp_path / 'checkpoint' / 'step-2'}" in again.log(0)
    assert again.done(0)["step"] == 10


def test_timeouts_follow_the_phase_and_a_hang_dumps_every_rank_stack(tmp_path):
    # rank 1 starts step 2's save 8 s late, while rank 0 waits in the save's collectives: past
    # the set-up timeout (6 s), inside the save's (30 s). Then it hangs in step 3 and both
    # ranks end on the steady steps' 4 s, not the set-up's 6 s.
    args = [*TINY, "--comm.train_timeout_s", "4", "--comm.init_timeout_s", "6", "--comm.save_timeout_s", "30",
            "--checkpoint.enable", "true", "--checkpoint.interval", "2"]
    ranks = spawn(2, args, tmp_path, faults="slowsave@2:1,hang@3:1")
    start = time.monotonic()
    codes = ranks.wait()
    assert codes == [124, 124], [ranks.log(0), ranks.log(1)]
    assert time.monotonic() - start < 90
    assert (tmp_path / "checkpoint" / "step-2").is_dir()
    first = next(line for line in ranks.log(0).splitlines() if line.startswith("titanlite: "))
    assert first.endswith(", 2 process groups per rank"), first  # the world and this rank alone
    for r in range(2):
        (err,) = _errors(ranks.log(r))
        assert "step 3: exceeded comm.train_timeout_s (4 s)" in err and f"hang/rank-{r}.txt" in err
    hung = (tmp_path / "hang" / "rank-1.txt").read_text()
    waiting = (tmp_path / "hang" / "rank-0.txt").read_text()
    assert "in start_step" in hung  # the injected hang, before any collective of step 3
    assert "in train" in waiting and "train.py" in waiting  # blocked in a collective of the loop
    # the flight recorder (gloo keeps one too) shows the collective rank 0 waits in, never completed
    with open(tmp_path / "hang" / "flight-recorder-rank-0.pkl", "rb") as f:
        last = pickle.load(f)["entries"][-1]
    assert last["profiling_name"] == "gloo:all_reduce" and last["time_discovered_completed_ns"] is None


# -- profiling ----------------------------------------------------------------------------

def test_profiler_writes_a_trace_for_the_window(tmp_path):
    args = [*TINY, "--training.steps", "5", "--profiling.enable", "true", "--profiling.start_step", "2",
            "--profiling.num_steps", "2", "--profiling.memory_snapshot", "true"]
    run = launch(1, args, dump=tmp_path, timeout=LIMIT_S)
    assert run.returncode == 0, run.output[-3000:]
    assert list((tmp_path / "profile").iterdir()) == [tmp_path / "profile" / "step-3"]
    trace = json.loads((tmp_path / "profile" / "step-3" / "rank0.pt.trace.json").read_text())
    steps = {e["name"] for e in trace["traceEvents"] if e.get("name", "").startswith("ProfilerStep#")}
    assert steps == {"ProfilerStep#2", "ProfilerStep#3"}, steps
    assert any(e.get("name") == "aten::mm" for e in trace["traceEvents"])
    assert "memory_snapshot needs CUDA" in run.output
    assert all(r["peak_gib"] > 0 for r in run.metrics)  # CPU peak RSS stands in for CUDA memory


# -- with checkpoints -------------------------------------------------------------------

CKPT = ["--checkpoint.enable", "true"]


def _steps_saved(dump: Path) -> list[str]:
    return sorted(p.name for p in (dump / "checkpoint").iterdir())


def test_sigterm_saves_and_the_restart_matches_an_uninterrupted_run(tmp_path):
    args = [*TINY, *CKPT, "--training.steps", "30", "--checkpoint.interval", "1000"]
    ranks = spawn(2, args, tmp_path)
    deadline = time.monotonic() + LIMIT_S
    while not any(m["step"] >= 3 for m in ranks.metrics()):
        assert time.monotonic() < deadline and all(p.poll() is None for p in ranks.procs), ranks.log(0)
        time.sleep(0.05)
    ranks.procs[1].send_signal(signal.SIGTERM)
    assert ranks.wait() == [0, 0], [ranks.log(0), ranks.log(1)]
    stopped = ranks.done(0)["step"]
    assert ranks.done(1)["step"] == stopped < 30
    assert _steps_saved(tmp_path) == [f"step-{stopped}"]  # saved on the way out, off the interval
    again = spawn(2, args, tmp_path)
    assert again.wait() == [0, 0], again.log(0)
    assert f"resumed from {tmp_path / 'checkpoint' / f'step-{stopped}'}" in again.log(0)
    straight = train(2, args, dump=tmp_path / "straight")
    resumed = {m["step"]: m["loss"] for m in again.metrics()}  # later rows win: the restart's
    assert resumed[30] == straight.metrics[-1]["loss"]  # bitwise: resume is exact on CPU
    assert [resumed[s] for s in range(stopped + 1, 31)] == straight.losses[stopped:]


def test_nonfinite_stop_keeps_the_last_good_checkpoint(tmp_path):
    args = [*TINY, *CKPT, "--checkpoint.interval", "2"]
    run = launch(1, args, dump=tmp_path, env={"TITANLITE_FAULTS": "nan@5"}, timeout=LIMIT_S)
    assert run.returncode == 1 and "step 5: non-finite loss" in run.output
    assert _steps_saved(tmp_path) == ["step-2", "step-4"]
    again = launch(1, args, dump=tmp_path, timeout=LIMIT_S)
    assert again.returncode == 0 and f"resumed from {tmp_path / 'checkpoint' / 'step-4'}" in again.output


def _small_tmpfs(path: Path, size: str) -> None:
    """A real filesystem that fills up: needs root with mount rights."""
    path.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                                           capture_output=True).returncode != 0:
        pytest.skip("needs a small tmpfs (root with mount rights)")


@pytest.mark.parametrize("policy", ["stop", "continue"])
def test_failed_save_keeps_the_previous_checkpoint(tmp_path, policy):
    # a 3.2M-parameter model with AdamW takes ~39 MB a checkpoint: one fits in 60 MB, two do not
    folder = tmp_path / "checkpoint"
    _small_tmpfs(folder, "60m")
    try:
        args = [*TINY, *CKPT, "--training.steps", "6", "--checkpoint.interval", "2",
                "--checkpoint.on_save_error", policy]
        run = launch(1, args, dump=tmp_path, timeout=LIMIT_S)
        saved = _steps_saved(tmp_path)
        intact = load_tensors(folder / "step-2")
    finally:
        subprocess.run(["umount", str(folder)], check=True)
    errors = [line for line in run.output.splitlines() if "titanlite: error:" in line or "warning: checkpoint" in line]
    assert errors and f"saving {folder / 'step-4'} failed" in errors[0] and " 0 MiB free in " in errors[0]
    assert f"previous checkpoint {folder / 'step-2'} is intact" in errors[0]
    assert saved == ["step-2"]  # no half-written step-4 or step-4.tmp
    assert intact and all(torch.isfinite(v).all() for v in intact.values() if v.is_floating_point())
    if policy == "stop":
        assert run.returncode == 1 and run.metrics[-1]["step"] == 3  # step 4 ends in its save, before its log
    else:
        assert run.returncode == 0 and run.metrics[-1]["step"] == 6


def test_post_step_hooks_skip_a_skipped_step(tmp_path):
    # the router-bias update of a MoE model: a NaN step moves no bias, the steps around it do
    args = [*TINY, "--model.name", "qwen3_moe", "--training.steps", "4", "--training.on_nonfinite", "skip",
            "--moe.bias_update_rate", "0.01"]
    run = launch(1, args, dump=tmp_path, env={"TITANLITE_FAULTS": "nan@3"}, timeout=LIMIT_S)
    assert run.returncode == 0, run.output[-3000:]
    norms = [m["moe_router_bias_norm"] for m in run.metrics]
    assert [m["skipped_steps"] for m in run.metrics] == [0, 0, 1, 1]
    assert norms[0] > 0 and norms[2] == norms[1] != norms[3], norms
