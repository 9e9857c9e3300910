"""MoE throughput on CPU: grouped GEMM against the loop over experts, and a MoE next to a dense
model of the same activated size, each with MFU against the matmul rate of the same run.

    OMP_NUM_THREADS=1 python scripts/bench_moe.py [--warmup 2] [--steps 5] [--repeat 2]

Runs `python -m titanlite.tools.bench` (the real trainer, one process) for: qwen3_moe
debugmodel with moe.grouped_mm on and off; the ~107M-parameter bench100m (8 experts of width
1024, top 2, 8 layers of width 512) on and off; and its dense twin bench100m_dense (the same
attention, a 2048-wide feed-forward: the same activated parameters). MFU counts activated
parameters only (`flops_per_token`). Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

RUNS = [("debugmodel", "on"), ("debugmodel", "off"), ("bench100m", "on"), ("bench100m", "off"),
        ("bench100m_dense", "auto")]


def bench(flavor: str, grouped: str, args: argparse.Namespace) -> dict:
    out = Path(tempfile.mkdtemp(prefix="bench-moe-")) / "bench.json"
    cmd = [sys.executable, "-m", "titanlite.tools.bench", "--warmup", str(args.warmup), "--steps", str(args.steps),
           "--repeat", str(args.repeat), "--out", str(out), "--model.name", "qwen3_moe", "--model.flavor", flavor,
           "--moe.grouped_mm", grouped, "--training.seq_len", str(args.seq_len),
           "--training.local_batch_size", str(args.batch), "--data.tokenizer", "byte"]
    subprocess.run(cmd, check=True, cwd=REPO, capture_output=True, text=True)
    data = json.loads(out.read_text())
    return data["results"][0]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    args = p.parse_args()
    print("| model | experts as | ms/step | tok/s | activated GFLOP/token | matmul GFLOP/s | MFU % |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for flavor, grouped in RUNS:
        r = bench(flavor, grouped, args)
        how = {"on": "grouped GEMM", "off": "loop", "auto": "(dense)"}[grouped]
        print(f"| {flavor} | {how} | {r['ms_per_step']:.0f} | {r['tokens_per_sec_per_device']:,.0f} | "
              f"{r['flops_per_token'] / 1e9:.3f} | {r['matmul_tflops_measured'] * 1e3:.1f} | {r['mfu_pct']:.1f} |",
              flush=True)


if __name__ == "__main__":
    main()
