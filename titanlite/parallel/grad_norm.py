"""The global gradient norm: reduce each gradient to its parameter's layout, then let every
rank square only the shards it owns, so one SUM all-reduce over the world gives the norm."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from titanlite.optim import by_mesh


@torch.no_grad()
def reduce_partial_grads(params: list[nn.Parameter]) -> None:
    """Give each DTensor gradient its parameter's layout.

    Without FSDP (which does this itself), a replicated parameter used on sharded
    activations (a sequence-parallel norm) gets a Partial gradient and a row-wise
    embedding a Replicate one. Reducing once here spares the optimizer from doing
    it in every foreach op, and lets the norm below count each shard once.
    """
    for p in params:
        if isinstance(p.grad, DTensor) and p.grad.placements != p.placements:
            p.grad = p.grad.redistribute(p.device_mesh, p.placements)


def _owns(g: torch.Tensor, stage_ranks: Sequence[int]) -> bool:
    """Whether this rank counts this gradient shard, so that each distinct shard counts once
    among the ranks that hold the same model part (`stage_ranks`)."""
    if not isinstance(g, DTensor):
        return not dist.is_initialized() or dist.get_rank() == min(stage_ranks)
    if any(pl.is_partial() for pl in g.placements):
        raise RuntimeError(f"local_grad_sq: gradient with placements {g.placements} is not reduced; "
                           "call reduce_partial_grads first")
    # A mesh spanning part of the stage (experts on an ep x dp view, say) has one copy per
    # coordinate of the dimensions it leaves out; the copy holding the stage's first rank counts.
    if min(stage_ranks) not in _ranks(g.device_mesh):
        return False
    coord = g.device_mesh.get_coordinate()
    return not any(c and pl.is_replicate() for c, pl in zip(coord, g.placements))


def _ranks(mesh: DeviceMesh) -> set[int]:
    return set(mesh.mesh.flatten().tolist())


@torch.no_grad()
def local_grad_sq(params: list[nn.Parameter], stage_ranks: Sequence[int]) -> torch.Tensor:
    """This rank's share of the squared global L2 gradient norm, over every rank and mesh dimension.

    Each rank squares the norm of the gradient shards it owns (a shard replicated over HSDP
    replicas, TP ranks or the copies of a partial mesh is owned once, and pipeline stages own
    their own parameters), so one SUM all-reduce over all ranks gives the square of the global
    norm (`global_norm` makes that reduction).
    """
    grads = [p.grad for p in params if p.grad is not None]
    owned = [g.to_local() if isinstance(g, DTensor) else g for g in grads if _owns(g, stage_ranks)]
    rows = [_row_norms(g) for g in owned if g.numel()]
    if not rows:
        return torch.zeros((), device=grads[0].device if grads else torch.device("cpu"))
    return torch.cat(rows).double().square().sum().float()  # every gradient's rows, summed in float64


def _row_norms(g: torch.Tensor) -> torch.Tensor:
    """The float32 norms of g's rows (along its last dimension), whose squares local_grad_sq sums
    in float64. A float32 norm of a whole large tensor drifts (torch's CPU kernel is 1e-5 low on
    a 4096 x 256 gradient), which a parallel run, squaring smaller shards, does not share; a
    float64 copy of g would cost twice its memory."""
    return torch.linalg.vector_norm(g.reshape(-1, g.shape[-1]) if g.dim() else g.reshape(1, 1), dim=1,
                                    dtype=torch.float32)


def global_norm(grad_sq: torch.Tensor, votes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The global gradient norm from each rank's `local_grad_sq`, and `votes` (a vector of
    per-rank counts) summed over the world: one SUM all-reduce for both, so the step's verdict
    (titanlite.runtime.fault) costs no collective of its own."""
    stats = torch.cat([grad_sq.reshape(1), votes])
    dist.all_reduce(stats)
    return stats[0].sqrt(), stats[1:]


@torch.no_grad()
def clip_grads(params: list[nn.Parameter], max_norm: float, norm: torch.Tensor) -> None:
    """Scale every gradient by max_norm / `norm` where the global norm exceeds it (max_norm <= 0:
    no clipping), one foreach op per mesh."""
    if max_norm > 0:
        for group in by_mesh([p for p in params if p.grad is not None]):
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, norm, foreach=True)
