"""The attention seam on a CUDA GPU: what the CPU cannot run (flex's backward, compiled flex,
varlen, sdpa's GPU kernels), checked against the dense reference and timed.

`python -m titanlite.tools.gpu_attention [--out FILE] [--seq 8192 32768]`, from a checkout (the cases and the
dense reference are tests/attention_parity.py's)

1. Parity: every mask kind of tests/attention_parity.py (documents, a window straddling the
   query blocks, sinks, v narrower than q/k) under sdpa and flex in float32 (outputs
   and the gradients of q, k, v and the sinks against the dense reference on the same GPU; q/k head
   dim 32, v 16, as compiled flex needs 16 at least), and
   under varlen, which runs in bfloat16 only: its error is reported next to sdpa's in bfloat16
   on the same inputs, the peer it should match.
2. Time and peak memory of forward + backward, bfloat16, Llama 3 8B's heads (32 query, 8 KV,
   head dim 128, batch 1), per backend and kind (plain causal, documents of 2048 tokens, a
   128-key window with sinks), CUDA events over 10 calls after 3 warm-ups.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from titanlite.layers import attention as attn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import attention_parity as ap  # noqa: E402  (the CPU test's cases and dense reference)


def seam_errors(backend: str, dtype: torch.dtype, docs: bool, window: int | None, sinks: bool) -> list[float]:
    """Max abs error of the output and of each input gradient against the float32 reference."""
    q, k, v, d, s = (x.cuda() for x in ap.inputs())
    d = d if docs else None
    grad_out = torch.randn(ap.B, ap.HQ, ap.S, ap.DV, generator=torch.Generator().manual_seed(1)).cuda()
    leaves = [x.clone().requires_grad_() for x in (q, k, v, s)]
    ref = ap.reference(*leaves[:3], d, window, leaves[3] if sinks else None, 0.3)
    (ref * grad_out).sum().backward()
    mine = [x.detach().to(dtype).requires_grad_() for x in (q, k, v, s)]
    ctx = attn.AttnSetup(backend, (window,)).context(document_ids=d, seq_len=ap.S, device=q.device)
    out = attn.attention(*mine[:3], ctx, window, mine[3] if sinks else None, 0.3)
    (out.float() * grad_out).sum().backward()
    errors = [(out.float() - ref).abs().max().item()]
    errors += [(m.grad.float() - r.grad).abs().max().item() for m, r in zip(mine[:3], leaves[:3])]
    if sinks:
        errors.append((mine[3].grad.float() - leaves[3].grad).abs().max().item())
    return errors


def parity() -> list[dict]:
    # compiled flex needs head dims of at least 16 (the CPU test's v is 8 wide); v stays narrower than q/k
    ap.DQK, ap.DV = 32, 16
    block, attn.QUERY_BLOCK = attn.QUERY_BLOCK, 16  # several query blocks per sequence, as at full length
    todo = [(name, backend, torch.float32, docs, window, sinks) for name, backend, docs, window, sinks in ap.cases()]
    for docs, window in [(False, None), (True, None), (False, ap.WINDOW), (True, ap.WINDOW)]:
        name = "+".join(["causal"] + ["docs"] * docs + [f"window{window}"] * (window is not None))
        todo += [(f"{backend}:{name}", backend, torch.bfloat16, docs, window, False) for backend in ("sdpa", "varlen")]
    rows = []
    for name, backend, dtype, docs, window, sinks in todo:
        try:
            errors = seam_errors(backend, dtype, docs, window, sinks)
        except Exception as e:  # noqa: BLE001  (reported, not hidden: the row says why)
            errors = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        rows.append({"case": name, "dtype": str(dtype).removeprefix("torch."), "errors": errors})
        print(json.dumps(rows[-1]), flush=True)
    attn.QUERY_BLOCK = block
    return rows


def _timed(backend: str, kind: str, seq: int) -> dict:
    hq, hkv, dim = 32, 8, 128
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, h, seq, dim, device="cuda", generator=g, dtype=torch.bfloat16).requires_grad_()
               for h in (hq, hkv, hkv))
    docs = (torch.arange(seq, device="cuda") // 2048)[None] if kind == "documents" else None
    window = 128 if kind == "window+sinks" else None
    sinks = torch.zeros(hq, device="cuda", requires_grad=True) if kind == "window+sinks" else None
    grad = torch.randn(1, hq, seq, dim, device="cuda", dtype=torch.bfloat16)

    def step() -> None:
        ctx = attn.AttnSetup(backend, (window,)).context(document_ids=docs, seq_len=seq, device=q.device)
        attn.attention(q, k, v, ctx, window, sinks).backward(grad)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        step()
    end.record()
    torch.cuda.synchronize()
    return {"backend": backend, "kind": kind, "seq": seq, "ms": start.elapsed_time(end) / 10,
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30}


def timings(seqs: list[int]) -> list[dict]:
    rows = []
    for seq in seqs:
        for kind in ("causal", "documents", "window+sinks"):
            for backend in ("sdpa", "flex", "varlen"):
                if backend == "varlen" and kind == "window+sinks":
                    continue  # varlen applies no sinks (refused before launch)
                torch.compiler.reset()  # fresh compile caches: flex would fall back to eager past its recompile limit
                t0 = time.perf_counter()
                try:
                    row = _timed(backend, kind, seq)
                except Exception as e:  # noqa: BLE001
                    row = {"backend": backend, "kind": kind, "seq": seq,
                           "error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
                row["wall_s"] = time.perf_counter() - t0
                print(json.dumps(row), flush=True)
                rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, nargs="*", default=[8192, 32768])
    parser.add_argument("--out", default="gpu_attention.json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("titanlite: error: gpu_attention needs a CUDA GPU (none found); the CPU's attention checks are "
                 "`python -m pytest tests/test_attention.py`")
    info = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    print(json.dumps(info), flush=True)
    result = {**info, "parity": parity()}
    Path(args.out).write_text(json.dumps(result, indent=1))
    result["timings"] = timings(args.seq)
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
