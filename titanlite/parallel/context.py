"""Context parallelism: the sequence is sharded over the cp mesh dimension.

Head-tail load balancing: the sequence is cut into 2N chunks and cp rank i holds chunks
i and 2N-1-i, so under a causal mask every rank has the same attention work. Attention
all-gathers K and V over the cp group (their gradients are reduce-scattered back) and
runs local SDPA; see titanlite.layers.attention. Plain collectives only, so it trains on CPU
(gloo) as well as on GPU, and composes with FSDP and TP.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from titanlite.errors import ConfigError

# torch 2.13 renamed these; older releases only have the *_tensor names
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def check_seq_len(seq_len: int, cp_degree: int) -> None:
    """Refuse a sequence length the head-tail layout cannot split evenly."""
    if cp_degree > 1 and seq_len % (2 * cp_degree):
        raise ConfigError(f"training.seq_len {seq_len} is not divisible by 2 x "
                          f"parallelism.context_parallel_degree {cp_degree} = {2 * cp_degree} "
                          "(head-tail load balancing cuts the sequence into 2 x cp chunks); "
                          "change one of them")


def chunks_of(cp_rank: int, cp_degree: int) -> tuple[int, int]:
    """The two global chunk indices (of 2 x cp_degree) that cp rank holds."""
    return cp_rank, 2 * cp_degree - 1 - cp_rank


def shard_sequence(x: torch.Tensor, cp_rank: int, cp_degree: int, dim: int = 1) -> torch.Tensor:
    """This rank's head-tail share of `x` along `dim`."""
    chunks = x.chunk(2 * cp_degree, dim=dim)
    head, tail = chunks_of(cp_rank, cp_degree)
    return torch.cat([chunks[head], chunks[tail]], dim=dim)


def shard_batch(batch: dict[str, torch.Tensor], cp_rank: int, cp_degree: int) -> dict[str, torch.Tensor]:
    """Shard input_ids, labels and positions ([B, S]) over cp; positions default to the
    global ones so RoPE sees each token where it sits in the whole sequence.
    document_ids stays whole: every rank needs the documents of all keys."""
    seq_len = batch["input_ids"].shape[1]
    out = dict(batch)
    if "positions" not in out:
        out["positions"] = torch.arange(seq_len, device=batch["input_ids"].device)[None]
    for key in ("input_ids", "labels", "positions"):
        out[key] = shard_sequence(out[key], cp_rank, cp_degree)
    return out


class _AllGather(torch.autograd.Function):
    """All-gather along dim 0; backward reduce-scatters the gradient to its owner."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        x = x.contiguous()
        out = x.new_empty((dist.get_world_size(group) * x.shape[0], *x.shape[1:]))
        _all_gather(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous()
        out = grad.new_empty((grad.shape[0] // dist.get_world_size(ctx.group), *grad.shape[1:]))
        _reduce_scatter(out, grad, group=ctx.group)
        return out, None


def gather_sequence(x: torch.Tensor, group: dist.ProcessGroup, dim: int) -> torch.Tensor:
    """The whole sequence along `dim`, in global order, from every rank's head-tail shard."""
    degree = dist.get_world_size(group)
    full = _AllGather.apply(x.movedim(dim, 0), group)
    # gathered chunk j is global chunk order[j]; put them back in sequence order
    order = [c for r in range(degree) for c in chunks_of(r, degree)]
    # a permutation of views, not an index tensor: that would be a host-to-device copy
    # (a stream sync on CUDA) in every attention layer
    chunks = full.unflatten(0, (2 * degree, -1))
    full = torch.cat([chunks[order.index(c)] for c in range(2 * degree)])
    return full.movedim(0, dim)


def gather_chunks(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """x: [2, ...], one piece per local chunk (head, tail). Returns [2 x degree, ...]: every
    chunk's piece in sequence order (what linear attention passes along: states, conv halos);
    backward sums each piece's gradient back to its owner."""
    degree = dist.get_world_size(group)
    full = _AllGather.apply(x, group)
    order = [c for r in range(degree) for c in chunks_of(r, degree)]
    return torch.stack([full[order.index(c)] for c in range(2 * degree)])


@dataclass(frozen=True)
class ContextParallel:
    """The cp group as attention and multi-token prediction see it (the SequenceShards of
    titanlite.layers.attention): bound once, when the model's attention is set up for the run."""

    group: dist.ProcessGroup
    rank: int
    degree: int

    @classmethod
    def of(cls, group: dist.ProcessGroup) -> ContextParallel:
        return cls(group, dist.get_rank(group), dist.get_world_size(group))

    def chunks(self) -> tuple[int, int]:
        return chunks_of(self.rank, self.degree)

    def gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        return gather_sequence(x, self.group, dim)

    def shard(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        return shard_sequence(x, self.rank, self.degree, dim)

    def gather_chunks(self, x: torch.Tensor) -> torch.Tensor:
        return gather_chunks(x, self.group)
