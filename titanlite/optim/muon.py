"""Muon for the matrices inside blocks, each orthogonalised whole, once per step.

The update of one matrix W [A, B] with gradient G (as torch.optim.Muon with
adjust_lr_fn="match_rms_adamw", Moonlight's RMS matching):

    M <- momentum * M + (1 - momentum) * G                  (exponential average)
    U <- (1 - momentum) * G + momentum * M if nesterov else M
    O <- NewtonSchulz_k(U / |U|_F)                          (5 quintic steps by default)
    W <- W * (1 - lr * weight_decay) - lr * 0.2 * sqrt(max(A, B)) * O

Sharded matrices (FSDP, TP, HSDP, EP and their products) are not gathered on every rank: the
momentum updates of same-shaped matrices are stacked into one DTensor, whose sharding is moved
off the matrix dims onto the stacking dim (DTensor.redistribute: an all-to-all on each mesh dim
that shards a matrix dim, a local slice on each that replicates it). Every rank then holds a
share of the matrices whole, orthogonalises them, and the reverse redistribute sends each its
shards back. Expert weights [n_experts, A, B] stack to [n, n_experts, A, B]; a mesh dim that
already shards the experts keeps doing so, so each expert matrix is orthogonalised by one rank.
"""

from __future__ import annotations

import math

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
from torch.distributed.tensor import DTensor, Placement, Shard

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_EPS = 1e-7


def muon_group(name: str, p: torch.Tensor) -> str | None:
    """The muon_groups entry a parameter belongs to, or None (AdamW): the 2-D matrices of a
    block's attention and feed_forward, and the [n_experts, A, B] weights of its experts."""
    parts = [s for s in name.split(".") if not s.startswith("_")]  # compile/checkpoint wrappers
    if len(parts) < 4 or parts[0] != "layers":
        return None
    if "experts" in parts:
        return "experts" if p.ndim == 3 else None
    return parts[2] if parts[2] in ("attention", "feed_forward") and p.ndim == 2 else None


def newton_schulz(u: torch.Tensor, steps: int, dtype: torch.dtype) -> torch.Tensor:
    """Orthogonalise each matrix of a batch [n, A, B] (torch.optim.Muon's iteration, batched)."""
    a, b, c = NS_COEFFICIENTS
    x = u.to(dtype)
    tall = x.size(-2) > x.size(-1)
    if tall:  # the Gram matrix of the short side is the cheaper one
        x = x.mT
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=NS_EPS)  # spectral norm <= 1
    for _ in range(steps):
        gram = x @ x.mT
        x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return (x.mT if tall else x).to(u.dtype)


def _whole_matrices(placements: tuple[Placement, ...], batch_dims: int) -> list[Placement]:
    """Placements with no mesh dim sharding the last two (matrix) dims: a mesh dim that shards a
    batch dim keeps it; every other one shards the stacking dim 0 instead."""
    return [pl if pl.is_shard() and pl.dim < batch_dims else Shard(0) for pl in placements]


def _sizes(total: int, parts: int) -> list[int]:
    """torch.chunk's sizes (as a Shard placement cuts a dim), zeros for ranks past the end."""
    step = -(-total // parts)
    return [max(0, min(step, total - i * step)) for i in range(parts)]


def _orthogonalise_1d(stack: DTensor, dim: int, steps: int, dtype: torch.dtype) -> torch.Tensor:
    """The one-mesh-dim case (FSDP alone, TP alone) as two all-to-alls: DTensor's own redistribute
    turns an all-to-all into an all-gather on a CPU mesh (gloo has none), which would put every
    matrix on every rank, and the dry run, which traces on CPU meshes, would count that."""
    group, ranks, me = stack.device_mesh.get_group(), stack.device_mesh.size(), stack.device_mesh.get_local_rank()
    local = stack.to_local()
    counts = [len(c) for c in torch.arange(local.shape[0]).tensor_split(ranks)]  # matrices per owner
    widths = _sizes(stack.shape[dim], ranks)  # each rank's share of the sharded matrix dim
    rest = math.prod(local.shape[1:dim]) * math.prod(local.shape[dim + 1:])  # elements per unit of width
    received = [counts[me] * w * rest for w in widths]
    sent = [c * local.shape[dim] * rest for c in counts]
    got = funcol.all_to_all_single(local.flatten(), received, sent, group)
    mine = torch.cat([piece.view(counts[me], *local.shape[1:dim], w, *local.shape[dim + 1:])
                      for piece, w in zip(got.split(received), widths)], dim)
    done = newton_schulz(mine.flatten(0, -3), steps, dtype).view(mine.shape)
    back = funcol.all_to_all_single(torch.cat([p.flatten() for p in done.split(widths, dim)]), sent, received, group)
    return back.view(local.shape)


def orthogonalise(updates: list[torch.Tensor], steps: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """Newton-Schulz of same-shaped, same-placed updates (matrices or stacks of experts), each
    matrix computed by one rank; returns local tensors shaped as the inputs' local shards."""
    stack = torch.stack(updates)
    if not isinstance(stack, DTensor):
        return list(newton_schulz(stack.flatten(0, -3), steps, dtype).view(stack.shape).unbind(0))
    mesh, placements = stack.device_mesh, stack.placements
    if mesh.ndim == 1 and type(placements[0]) is Shard and placements[0].dim >= stack.ndim - 2:
        return list(_orthogonalise_1d(stack, placements[0].dim, steps, dtype).unbind(0))
    spread = stack.redistribute(mesh, _whole_matrices(placements, stack.ndim - 2))
    local = spread.to_local()
    done = newton_schulz(local.flatten(0, -3), steps, dtype).view(local.shape)
    back = DTensor.from_local(done, mesh, spread.placements, run_check=False, shape=stack.shape,
                              stride=stack.stride()).redistribute(mesh, placements)
    return list(back.to_local().unbind(0))


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class Muon(torch.optim.Optimizer):
    """Muon over whole matrices, for plain tensors and DTensors of any placement.

    `found_inf` (set as an attribute, as for fused AdamW): a device flag; 1.0 leaves parameters
    and momentum as they were, without a host sync."""

    def __init__(self, params, lr: float, weight_decay: float, momentum: float, nesterov: bool,
                 ns_steps: int, ns_dtype: torch.dtype = torch.float32) -> None:
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay, momentum=momentum,
                                      nesterov=nesterov, ns_steps=ns_steps))
        self.ns_dtype = ns_dtype
        self.found_inf: torch.Tensor | None = None

    @torch.no_grad()
    def step(self, closure=None):
        assert closure is None, "Muon takes no closure"
        keep = None if self.found_inf is None else self.found_inf == 0
        for group in self.param_groups:
            self._step_group(group, keep)

    def _step_group(self, group: dict, keep: torch.Tensor | None) -> None:
        lr, wd, mu = group["lr"], group["weight_decay"], group["momentum"]
        batches: dict[tuple, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p)
            buf, grad = _local(state["momentum_buffer"]), _local(p.grad)
            # the same elementwise arithmetic as torch.optim.Muon, on this rank's shard
            new_buf = buf.lerp(grad, 1 - mu)
            update = grad.lerp(new_buf, mu) if group["nesterov"] else new_buf
            buf.copy_(new_buf if keep is None else torch.where(keep, new_buf, buf))
            if isinstance(p, DTensor):
                update = DTensor.from_local(update, p.device_mesh, p.placements, run_check=False,
                                            shape=p.shape, stride=p.stride())
                key = (p.device_mesh, p.placements, p.shape)
            else:
                key = (None, (), p.shape)
            batches.setdefault(key, []).append((p, update))
        for (_, _, shape), pairs in batches.items():
            scale = 0.2 * math.sqrt(max(shape[-2:]))
            done = orthogonalise([u for _, u in pairs], group["ns_steps"], self.ns_dtype)
            for (p, _), o in zip(pairs, done):
                w = _local(p)
                new_w = (w.mul_ if keep is None else w.mul)(1 - lr * wd).add_(o, alpha=-lr * scale)
                if keep is not None:
                    w.copy_(torch.where(keep, new_w, w))


def split_params(part: nn.Module, groups: list[str]) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """A part's parameters as (Muon's, AdamW's)."""
    muon, adamw = [], []
    for name, p in part.named_parameters():
        (muon if muon_group(name, p) in groups else adamw).append(p)
    return muon, adamw
