"""Peak memory per rank and throughput of context parallelism at a long sequence, on CPU.

    OMP_NUM_THREADS=1 python -m titanlite.tools.bench_cp --seq-len 8192 --cp 1 2 4

Each cp degree runs the real trainer under torchrun (gloo, one sample of seq_len per
step, debugmodel); every rank records its own peak RSS when it exits. glibc is told to
map tensors above 128 KiB on their own (MALLOC_MMAP_THRESHOLD_, unless set), so freed
activations leave RSS instead of staying as heap slack. Prints a Markdown table. tok/s is
the trainer's per-rank figure averaged over the steps after the first.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def worker(argv: list[str]) -> None:
    """One torchrun rank: train, then leave this process's peak RSS next to the metrics."""
    from titanlite.train import main

    try:
        main(argv)
    finally:
        dump = Path(argv[argv.index("--job.dump_folder") + 1])
        rss_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux: KiB
        (dump / f"rss-rank{os.environ.get('RANK', '0')}.json").write_text(json.dumps(rss_gib))


def run(cp: int, seq_len: int, steps: int, extra: list[str]) -> dict:
    dump = Path(tempfile.mkdtemp(prefix=f"bench-cp{cp}-"))
    args = ["--model.flavor", "debugmodel", "--training.seq_len", str(seq_len), "--training.local_batch_size", "1",
            "--training.steps", str(steps), "--lr_scheduler.warmup_steps", "1", "--metrics.log_freq", "1",
            "--metrics.enable_tensorboard", "false", "--parallelism.context_parallel_degree", str(cp),
            "--job.dump_folder", str(dump), *extra]
    env = {"OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "131072", **os.environ, "PYTHONWARNINGS": "ignore",
           "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={cp}",
           "-m", __spec__.name, "--worker", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO)
    rows = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()] \
        if (dump / "metrics.jsonl").exists() else []
    done = all((dump / "status" / f"rank-{r}.done").exists() for r in range(cp))
    if not done or len(rows) < 2:
        sys.exit(f"cp={cp} failed (exit {proc.returncode}):\n{(proc.stdout + proc.stderr)[-4000:]}")
    rss = [json.loads((dump / f"rss-rank{r}.json").read_text()) for r in range(cp)]
    tok_s = sum(r["tokens_per_sec"] for r in rows[1:]) / len(rows[1:])
    return {"cp": cp, "rss": rss, "tok_s_rank": tok_s, "tok_s_total": tok_s * cp, "loss": rows[-1]["loss"]}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        return worker(sys.argv[2:])
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("extra", nargs="*", help="more trainer flags, after --")
    a = p.parse_args()
    print("| cp | peak RSS per rank (GiB) | tok/s per rank | tok/s total | final loss |")
    print("|---:|---|---:|---:|---:|")
    for cp in a.cp:
        r = run(cp, a.seq_len, a.steps, a.extra)
        rss = ", ".join(f"{x:.2f}" for x in r["rss"])
        print(f"| {cp} | {rss} | {r['tok_s_rank']:,.0f} | {r['tok_s_total']:,.0f} | {r['loss']:.4f} |", flush=True)


if __name__ == "__main__":
    main()
