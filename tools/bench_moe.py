"""MoE throughput on CPU: grouped GEMM against the loop over experts, and a MoE next to a dense
model of the same activated size, each with MFU against the matmul rate of the same run.

    OMP_NUM_THREADS=1 python -m titanlite.tools.bench_moe [--warmup 2] [--steps 5] [--repeat 2]
    OMP_NUM_THREADS=1 python -m titanlite.tools.bench_moe --layer [--rounds 10]

Runs `python -m titanlite.tools.bench` (the real trainer, one process) for: qwen3_moe
debugmodel with moe.grouped_mm on and off; the ~107M-parameter bench100m (8 experts of width
1024, top 2, 8 layers of width 512) on and off; and its dense twin bench100m_dense (the same
attention, a 2048-wide feed-forward: the same activated parameters). MFU counts activated
parameters only (`flops_per_token`). Prints a Markdown table.

--layer times one MoE layer alone (forward + backward, the debug and bench100m shapes, 1024
tokens), grouped GEMM and loop and a plain matmul of the same FLOPs interleaved round after
round in one process, keeping each one's best round: on a shared machine the rounds that others
slowed down drop out, and the matmul rate is taken in the same minutes as the layer.
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


def time_layers(rounds: int) -> None:
    import dataclasses
    import time

    import torch

    from titanlite.models.qwen3_moe import flavors
    from titanlite.layers.moe import MoE

    print("| shape | experts as | fwd+bwd ms (best) | GFLOP/s | % of matmul rate | matmul GFLOP/s |")
    print("|---|---|---:|---:|---:|---:|")
    for name in ("debugmodel", "bench100m"):
        args = flavors[name]
        x = torch.randn(1024, args.dim)
        layers = {}
        for mode in ("on", "off"):
            torch.manual_seed(0)
            layers[mode] = MoE(args.dim, dataclasses.replace(args.moe, grouped_mm=mode))
            for p in layers[mode].parameters():
                torch.nn.init.normal_(p, std=0.02)
        # routed FLOPs, forward + backward (3x forward): k copies of each token through 3 matmuls
        flops = 3 * 2 * x.shape[0] * args.moe.top_k * 3 * args.dim * args.moe.hidden
        a, b = torch.randn(1024, args.dim), torch.randn(args.dim, args.moe.top_k * 3 * args.moe.hidden)
        best = {"on": float("inf"), "off": float("inf"), "mm": float("inf")}

        def mm() -> None:
            for _ in range(3):
                torch.mm(a, b)

        for _ in range(rounds):
            for key in ("on", "off", "mm"):
                t0 = time.perf_counter()
                if key == "mm":
                    mm()
                else:
                    xi = x.clone().requires_grad_()
                    layers[key](xi[None]).sum().backward()
                best[key] = min(best[key], time.perf_counter() - t0)
        rate = flops / best["mm"]
        for key, how in (("on", "grouped GEMM"), ("off", "loop")):
            got = flops / best[key]
            print(f"| {name} | {how} | {1000 * best[key]:.1f} | {got / 1e9:.1f} | {100 * got / rate:.0f} | "
                  f"{rate / 1e9:.1f} |", flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--layer", action="store_true")
    p.add_argument("--rounds", type=int, default=10)
    args = p.parse_args()
    if args.layer:
        time_layers(args.rounds)
        return
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
