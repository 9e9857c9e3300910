"""Every mask kind of the attention seam against a dense single-process reference, on random
tensors: outputs (and input gradients where the backend has a backward) to 1e-5 in fp32.

Run in one process by tests/test_attention.py, and as N gloo ranks (`CP TP FOLDER` on the command
line: context parallel over the sequence's head-tail chunks, tensor parallel over heads, a folder
for generate_tp's checkpoints) by
tests/harness.spawn_ranks; every rank prints one line per case, "MISMATCH" on a failure.
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from titanlite.layers import attention as attn
from titanlite.parallel.context import ContextParallel, gather_sequence, shard_sequence

B, HQ, HKV, S, DQK, DV = 2, 4, 2, 64, 16, 8
WINDOW = 21  # straddles the 16-token chunks of cp 2 and the 16-query blocks below


def reference(q, k, v, docs, window, sinks, scale):
    """Dense attention: every score, the mask written out, sinks as an extra logit column."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = q @ k.transpose(-1, -2) * scale
    i = torch.arange(q.shape[2], device=q.device)[:, None]
    j = torch.arange(k.shape[2], device=q.device)[None, :]
    mask = (j <= i)[None, None]
    if window is not None:
        mask = mask & (i - j < window)
    if docs is not None:
        mask = mask & (docs[:, :, None] == docs[:, None, :])[:, None]
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        scores = torch.cat([scores, sinks.view(1, -1, 1, 1).expand(*scores.shape[:3], 1)], dim=-1)
    probs = scores.softmax(-1)[..., :k.shape[2]]
    return probs @ v


def cases():
    """(name, backend, documents?, window, sinks?) for every kind and combination."""
    kinds = [(d, w, s) for d, w, s in itertools.product((False, True), (None, WINDOW), (False, True))]
    for backend in ("sdpa", "flex"):
        for docs, window, sinks in kinds:
            name = "+".join(["causal"] + ["docs"] * docs + [f"window{window}"] * (window is not None)
                            + ["sinks"] * sinks)
            yield f"{backend}:{name}", backend, docs, window, sinks


def inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(B, HQ, S, DQK, generator=g), torch.randn(B, HKV, S, DQK, generator=g)
    v = torch.randn(B, HKV, S, DV, generator=g)
    # documents of random lengths, some crossing the cp chunks; the rows differ
    cuts = torch.rand(B, S, generator=g) < 0.12
    docs = cuts.long().cumsum(1)
    sinks = torch.randn(HQ, generator=g)
    return q, k, v, docs, sinks


def run(cp: int = 1, tp: int = 1) -> int:
    """Compare each case on this rank's share; returns the number of mismatches."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    cp_rank, tp_rank = rank // tp, rank % tp
    cp_group = tp_group = None
    if dist.is_initialized():
        for c in range(cp):  # every rank takes part in creating every group
            g = dist.new_group([c * tp + t for t in range(tp)])
            tp_group = g if c == cp_rank else tp_group
        for t in range(tp):
            g = dist.new_group([c * tp + t for c in range(cp)])
            cp_group = g if t == tp_rank and cp > 1 else cp_group
    attn.QUERY_BLOCK = 16  # several blocks per query chunk, as long sequences have
    q, k, v, docs, sinks = inputs()
    heads = slice(tp_rank * HQ // tp, (tp_rank + 1) * HQ // tp)
    kv_heads = slice(tp_rank * HKV // tp, (tp_rank + 1) * HKV // tp)
    bad = 0
    for name, backend, use_docs, window, use_sinks in cases():
        scale = 0.3
        d, s = (docs if use_docs else None), (sinks if use_sinks else None)
        grad = backend == "sdpa"  # torch has no FlexAttention backward on CPU
        leaves = [x.clone().requires_grad_(grad) for x in (q, k, v)] + [sinks.clone().requires_grad_(grad)]
        ref = reference(*leaves[:3], d, window, leaves[3] if use_sinks else None, scale)
        mine = [shard_sequence(x[:, h], cp_rank, cp, dim=2) if cp > 1 else x[:, h]
                for x, h in zip(leaves[:3], (heads, kv_heads, kv_heads))]
        mine = [x.detach().requires_grad_(grad) for x in mine]
        my_sinks = leaves[3][heads].detach().requires_grad_(grad) if use_sinks else None
        positions = shard_sequence(torch.arange(S)[None], cp_rank, cp) if cp > 1 else None
        cp_shards = ContextParallel.of(cp_group) if cp > 1 else None
        ctx = attn.AttnSetup(backend, cp=cp_shards).context(positions, d)
        out = attn.attention(*mine, ctx, window, my_sinks, scale)
        full = gather_sequence(out, cp_group, dim=2) if cp > 1 else out
        errors = [(full - ref[:, heads]).abs().max().item()]
        if grad:
            g_out = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1))
            (ref * g_out).sum().backward()
            (out * (shard_sequence(g_out[:, heads], cp_rank, cp, dim=2) if cp > 1 else g_out[:, heads])).sum().backward()
            for x, mine_x, h in zip(leaves[:3], mine, (heads, kv_heads, kv_heads)):
                want = shard_sequence(x.grad[:, h], cp_rank, cp, dim=2) if cp > 1 else x.grad[:, h]
                errors.append((mine_x.grad - want).abs().max().item())
            if use_sinks:
                if cp > 1:  # each cp rank has its queries' share; FSDP's reduction over dp x cp sums them
                    dist.all_reduce(my_sinks.grad, group=cp_group)
                errors.append((my_sinks.grad - leaves[3].grad[heads]).abs().max().item())
        worst = max(errors)
        ok = worst <= 1e-5
        bad += not ok
        print(f"rank {rank} {name}: worst abs diff {worst:.2e}{'' if ok else ' MISMATCH'}", flush=True)
    return bad


if __name__ == "__main__":
    cp, tp = int(sys.argv[1]), int(sys.argv[2])
    dist.init_process_group("gloo")
    failures = run(cp, tp)
    if tp > 1:  # generation under tensor parallel, on each tp group (tests/generate_tp.py)
        from generate_tp import run as generate_tp

        rank = dist.get_rank()
        groups = [dist.new_group([c * tp + t for t in range(tp)]) for c in range(cp)]
        failures += generate_tp(groups[rank // tp], Path(sys.argv[3]))
    dist.barrier()
    dist.destroy_process_group()
    sys.exit(1 if failures else 0)
