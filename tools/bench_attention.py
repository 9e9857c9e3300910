"""One attention layer's time and peak memory per backend and mask kind, on this machine.

`python -m titanlite.tools.bench_attention [--seq 2048 8192] [--repeat 3] [--out FILE]`

The shape is the 100M model's (12 query heads, 4 KV heads, head dim 64, batch 1). For each
sequence length and kind (plain causal; packed documents of 512 tokens; a 128-key window with
sinks, gpt-oss's), it times the seam `titanlite.layers.attention.attention` forward + backward
with sdpa, and forward alone with sdpa and flex (torch has no FlexAttention backward on CPU),
keeping the fastest of --repeat runs, and reports the peak of allocated tensor bytes (the
profiler's memory timeline). Plain causal under sdpa is the reference each row is compared to.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from titanlite.layers.attention import AttnSetup, attention

HQ, HKV, D, DOC, WINDOW = 12, 4, 64, 512, 128


def _inputs(seq: int, grad: bool) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, HQ, seq, D, generator=g).requires_grad_(grad)
    k = torch.randn(1, HKV, seq, D, generator=g).requires_grad_(grad)
    v = torch.randn(1, HKV, seq, D, generator=g).requires_grad_(grad)
    return q, k, v


def _call(kind: str, backend: str, seq: int, grad: bool) -> None:
    q, k, v = _inputs(seq, grad)
    docs = (torch.arange(seq) // DOC)[None] if kind == "documents" else None
    sinks = torch.zeros(HQ, requires_grad=grad) if kind == "window+sinks" else None
    ctx = AttnSetup(backend).context(document_ids=docs)
    with torch.set_grad_enabled(grad):
        out = attention(q, k, v, ctx, window=WINDOW if kind == "window+sinks" else None, sinks=sinks)
        if grad:
            out.sum().backward()


def _fastest(fn, repeat: int) -> float:
    fn()  # warm-up: kernel selection, allocator
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _peak_bytes(fn) -> int:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    live = peak = 0
    for event in sorted(prof.events(), key=lambda e: e.time_range.start):
        live += event.self_cpu_memory_usage  # self: a parent op also counts its children's
        peak = max(peak, live)
    return peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out", default="")
    opts = parser.parse_args()
    rows = []
    for seq in opts.seq:
        for kind in ("causal", "documents", "window+sinks"):
            for backend, grad in (("sdpa", True), ("sdpa", False), ("flex", False)):
                def run():
                    _call(kind, backend, seq, grad)
                rows.append({"seq": seq, "kind": kind, "backend": backend,
                             "pass": "fwd+bwd" if grad else "fwd", "ms": 1e3 * _fastest(run, opts.repeat),
                             "peak_mib": _peak_bytes(run) / 2**20})
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; 1 x {HQ}/{HKV} heads x {D}, fp32")
    print(f"{'seq':>6} {'kind':<13} {'backend':<7} {'pass':<8} {'ms':>9} {'vs causal':>9} {'peak MiB':>9}")
    for r in rows:
        base = next(b for b in rows if b["seq"] == r["seq"] and b["kind"] == "causal"
                    and b["backend"] == "sdpa" and b["pass"] == r["pass"])
        r["vs_causal_sdpa"] = r["ms"] / base["ms"]
        print(f"{r['seq']:>6} {r['kind']:<13} {r['backend']:<7} {r['pass']:<8} {r['ms']:>9.1f} "
              f"{r['vs_causal_sdpa']:>8.2f}x {r['peak_mib']:>9.1f}")
    if opts.out:
        with open(opts.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
