"""Recovery times of replica groups, measured from docs/reliability.md's example as written.

    python -m titanlite.tools.bench_recovery [--out DIR] [--kill-after STEP] [LIGHTHOUSE FLAGS ...]

Starts the example's lighthouse (`torchft_lighthouse --min_replicas 1 --join_timeout_ms 10000`,
and any flags given here, e.g. `--heartbeat_timeout_ms 2000`) and its two groups (`NGPU=2
./run_train.sh --fault_tolerance.enable --fault_tolerance.group_size 2 --fault_tolerance.replica_id
G --fault_tolerance.max_restarts 3 --job.dump_folder DIR/gG --training.global_batch_size 64`, on a
CPU 2 gloo ranks each, `--metrics.log_freq 1` added so that every step leaves a timed row). Once
group 0 has logged step --kill-after, SIGKILLs group 1's rank 1 and times, from the kill:
  survivor  group 0's next committed step (its row in metrics.jsonl);
  healed    group 1's first committed step after torchrun restarted it and it healed from group 0.
Then stops both groups (SIGTERM: they save and exit 0) and the lighthouse. Prints the commands and
the two figures, with group 0's median step time before the kill for scale.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LIGHTHOUSE = ["torchft_lighthouse", "--min_replicas", "1", "--join_timeout_ms", "10000"]
LIMIT_S = 600


def group_command(g: int, out: Path) -> list[str]:
    return [str(REPO / "run_train.sh"), "--fault_tolerance.enable", "--fault_tolerance.group_size", "2",
            "--fault_tolerance.replica_id", str(g), "--fault_tolerance.max_restarts", "3",
            "--job.dump_folder", str(out / f"g{g}"), "--training.global_batch_size", "64", "--metrics.log_freq", "1"]


class Rows:
    """The rows of a metrics.jsonl and when each was first seen (polled)."""

    def __init__(self, path: Path) -> None:
        self.path, self.rows, self.times = path, [], []

    @property
    def seen(self) -> int:
        return len(self.rows)

    def poll(self) -> None:
        if self.path.exists():
            new = [json.loads(line) for line in self.path.read_text().splitlines()[self.seen:] if line.strip()]
            self.times += [time.monotonic()] * len(new)
            self.rows += new


def _descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        for children in Path(f"/proc/{todo.pop()}/task").glob("*/children"):
            for child in map(int, children.read_text().split()):
                out.append(child)
                todo.append(child)
    return out


def _rank_pid(launcher: subprocess.Popen, rank: int) -> int | None:
    for pid in _descendants(launcher.pid):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"titanlite.train" in cmd and f"RANK={rank}".encode() in env:
            return pid
    return None


def _wait(until, what: str, deadline: float, *rows: Rows) -> None:
    while not until():
        if time.monotonic() > deadline:
            raise SystemExit(f"bench_recovery: timed out waiting for {what}")
        for r in rows:
            r.poll()
        time.sleep(0.02)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="", help="folder for the groups' dump folders (default: a temporary one)")
    parser.add_argument("--kill-after", type=int, default=5, help="group 0's step after which group 1 loses a rank")
    args, lighthouse_flags = parser.parse_known_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="titanlite-recovery-"))
    out.mkdir(parents=True, exist_ok=True)
    for g in (0, 1):
        shutil.rmtree(out / f"g{g}", ignore_errors=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    lighthouse = [*LIGHTHOUSE, *lighthouse_flags, "--bind", f"[::]:{port}"]
    env = {**os.environ, "NGPU": "2", "TORCHFT_LIGHTHOUSE": f"http://{socket.gethostname()}:{port}"}
    print("$ " + " ".join(lighthouse))
    procs = [subprocess.Popen(lighthouse, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
    try:
        rows = [Rows(out / f"g{g}" / "metrics.jsonl") for g in (0, 1)]
        for g in (0, 1):
            cmd = group_command(g, out)
            print(f"$ NGPU=2 TORCHFT_LIGHTHOUSE={env['TORCHFT_LIGHTHOUSE']} " + " ".join(cmd))
            procs.append(subprocess.Popen(cmd, cwd=REPO, env=env, stdout=open(out / f"g{g}.out", "w"),
                                          stderr=subprocess.STDOUT, start_new_session=True))
        deadline = time.monotonic() + LIMIT_S
        _wait(lambda: rows[0].seen >= args.kill_after, f"group 0's step {args.kill_after}", deadline, *rows)
        before = [b - a for a, b in zip(rows[0].times[1:], rows[0].times[2:])]
        victim = _rank_pid(procs[2], 1)
        if victim is None:
            raise SystemExit("bench_recovery: group 1's rank 1 not found")
        os.kill(victim, signal.SIGKILL)  # within a poll of group 0's row: its next step has just begun
        killed, seen = time.monotonic(), rows[0].seen
        _wait(lambda: rows[0].seen > seen, "group 0's next step", deadline, *rows)
        survivor = rows[0].times[seen] - killed

        def restarted() -> int | None:  # the restarted attempt's first row says where it begins
            return next((i for i, row in enumerate(rows[1].rows) if i and "begins" in row), None)
        _wait(lambda: restarted() is not None, "group 1's first step after its heal", deadline, *rows)
        healed = rows[1].times[restarted()] - killed
        step = statistics.median(before) if before else float("nan")
        print(f"group 0's step before the kill: {step:.1f} s (median); from the kill of group 1's rank 1 to group 0's "
              f"next step: {survivor:.1f} s; to group 1's first step after its restart and heal: {healed:.1f} s")
    finally:
        for p in procs[1:]:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in procs[1:]:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
        procs[0].terminate()
        procs[0].wait()


if __name__ == "__main__":
    sys.exit(main())
