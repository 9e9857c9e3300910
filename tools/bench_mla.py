"""DeepSeek-V3 on CPU: one MLA layer against one grouped-query attention layer of the same width
and heads, and the debug model against its dense twin of the same activated size (MFU ratio).

    OMP_NUM_THREADS=1 python -m titanlite.tools.bench_mla --layer [--rounds 10] [--seq-len 1024]
    OMP_NUM_THREADS=1 python -m titanlite.tools.bench_mla [--warmup 2] [--steps 4] [--repeat 2] [--pair 100M]

--layer: forward + backward of one attention layer (projections, RoPE and the attention seam),
MLA and GQA interleaved round after round in one process, each keeping its best round (on a
shared machine the rounds others slowed down drop out). Shapes: dim 1024, 16 query heads;
MLA with DeepSeek-V3's proportions (kv_lora_rank 256, q_lora_rank 384, qk_nope 64, qk_rope 32,
v 64); GQA with head_dim 64 and 4 KV heads (Llama 3's ratio).

Without --layer: the real trainer (`python -m titanlite.tools.bench`, one process) on a
deepseek_v3 flavor and its dense twin of the same activated parameters (every block, the MTP
one included, dense): debugmodel and debugmodel_dense (210-wide feed-forward), or with --pair
100M, 100M and 100M_dense (~100M activated), MFU over the matmul rate each run measures.
Prints Markdown tables.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def time_layers(rounds: int, seq_len: int) -> None:
    import torch

    from titanlite.layers import rope
    from titanlite.layers.attention import Attention
    from titanlite.models.deepseek_v3 import flavors
    from titanlite.models.deepseek_v3.model import MLA

    args = dataclasses.replace(flavors["debugmodel"], dim=1024, n_heads=16, n_kv_heads=16, q_lora_rank=384,
                               kv_lora_rank=256, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64, yarn=None)
    torch.manual_seed(0)
    layers = {"MLA": MLA(args, rope.rotate_pairs), "GQA": Attention(1024, 16, 4, 64, rope.rotate_halves)}
    tables = {"MLA": rope.tables(rope.frequencies(32, 10000.0, torch.float32), seq_len),
              "GQA": rope.tables(rope.frequencies(64, 10000.0, torch.float32), seq_len)}
    x = torch.randn(1, seq_len, 1024)
    best = dict.fromkeys(layers, float("inf"))
    for _ in range(rounds):
        for name, layer in layers.items():
            cos, sin = (t[None, :, None] for t in tables[name])
            xi = x.clone().requires_grad_()
            t0 = time.perf_counter()
            layer(xi, cos, sin, None).sum().backward()
            best[name] = min(best[name], time.perf_counter() - t0)
    print(f"| layer (seq {seq_len}) | parameters | projection GFLOP | attention GFLOP | fwd+bwd ms (best) |")
    print("|---|---:|---:|---:|---:|")
    dims = {"MLA": (args.head_dim, args.v_head_dim), "GQA": (64, 64)}
    for name, layer in layers.items():
        n = sum(p.numel() for p in layer.parameters() if p.dim() == 2)
        qk, v = dims[name]
        proj = 6 * n * seq_len  # forward + backward
        attn = 3 * 2 * 16 * (qk + v) * seq_len * seq_len / 2  # causal: half the scores
        print(f"| {name} | {n / 1e6:.2f}M | {proj / 1e9:.1f} | {attn / 1e9:.1f} | {1000 * best[name]:.1f} |", flush=True)


def bench(flavor: str, args: argparse.Namespace) -> dict:
    out = Path(tempfile.mkdtemp(prefix="bench-mla-")) / "bench.json"
    cmd = [sys.executable, "-m", "titanlite.tools.bench", "--warmup", str(args.warmup), "--steps", str(args.steps),
           "--repeat", str(args.repeat), "--out", str(out), "--model.name", "deepseek_v3", "--model.flavor", flavor,
           "--training.seq_len", str(args.seq_len), "--training.local_batch_size", str(args.batch),
           "--data.tokenizer", "byte", "--moe.bias_update_rate", "0.001"]
    subprocess.run(cmd, check=True, cwd=REPO, capture_output=True, text=True)
    return json.loads(out.read_text())["results"][0]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layer", action="store_true")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--pair", choices=("debugmodel", "100M"), default="debugmodel")
    args = p.parse_args()
    if args.layer:
        time_layers(args.rounds, args.seq_len)
        return
    print("| model | ms/step | tok/s | activated GFLOP/token | matmul GFLOP/s | MFU % |")
    print("|---|---:|---:|---:|---:|---:|")
    for flavor in (args.pair, f"{args.pair}_dense"):
        r = bench(flavor, args)
        print(f"| {flavor} | {r['ms_per_step']:.0f} | {r['tokens_per_sec_per_device']:,.0f} | "
              f"{r['flops_per_token'] / 1e9:.4f} | {r['matmul_tflops_measured'] * 1e3:.1f} | {r['mfu_pct']:.1f} |",
              flush=True)


if __name__ == "__main__":
    main()
