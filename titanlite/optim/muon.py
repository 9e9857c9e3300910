"""Muon for the matrices inside blocks, each orthogonalised whole, once per step.

The update of one matrix W [A, B] with gradient G (as torch.optim.Muon with
adjust_lr_fn="match_rms_adamw", Moonlight's RMS matching):

    M <- momentum * M + (1 - momentum) * G                  (exponential average)
    U <- (1 - momentum) * G + momentum * M if nesterov else M
    O <- NewtonSchulz_k(U / |U|_F)                          (5 quintic steps by default)
    W <- W * (1 - lr * weight_decay) - lr * 0.2 * sqrt(max(A, B)) * O

Sharded matrices (FSDP, TP, HSDP, EP and their products) are not gathered on every rank: the
momentum updates of same-shaped matrices are stacked, each rank receives a share of them whole
(an all-to-all over each mesh dim that cuts a matrix dim, a slice over each that replicates it),
orthogonalises them, and the reverse collectives send each rank its shards of the results.
Expert weights [n_experts, A, B] stack to [n, n_experts, A, B]; a mesh dim that shards the
experts keeps doing so, so each expert matrix is orthogonalised by one rank.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
from torch.distributed.tensor import DTensor, Shard

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_EPS = 1e-7


def muon_group(name: str, p: torch.Tensor) -> str | None:
    """The muon_groups entry a parameter belongs to, or None (AdamW): the 2-D matrices of a
    block's attention and feed_forward (a MoE's always-on shared experts are a dense
    feed-forward), and the [n_experts, A, B] weights of its routed experts. A multi-token
    prediction depth's block (mtp.N.block) is a block like the others."""
    parts = [s for s in name.split(".") if not s.startswith("_")]  # compile/checkpoint wrappers
    if parts[:1] == ["layers"]:
        inner = parts[2:]
    elif parts[:1] == ["mtp"] and parts[2:3] == ["block"]:
        inner = parts[3:]
    else:
        return None
    if "experts" in inner:
        return "experts" if p.ndim == 3 else None
    if p.ndim != 2 or len(inner) < 2:
        return None
    if inner[0] in ("attention", "feed_forward"):
        return inner[0]
    return "feed_forward" if inner[:2] == ["moe", "shared"] else None


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


def _sizes(total: int, parts: int) -> list[int]:
    """torch.chunk's sizes (as a Shard placement cuts a dim), zeros for ranks past the end."""
    step = -(-total // parts)
    return [max(0, min(step, total - i * step)) for i in range(parts)]


def _owners(n: int, parts: int) -> list[int]:
    """How many of n matrices each of `parts` ranks orthogonalises."""
    return [n // parts + (i < n % parts) for i in range(parts)]


def _matrix_shards(mesh, placements, shape: tuple[int, ...]) -> list[tuple[int, int, int]]:
    """The mesh dims that cut the matrix dims of a stack (dim 0 added in front of tensors placed
    as `placements`), as (mesh dim, stack dim, that dim's size before the cut) in the order to
    undo them: the reverse of the order they were applied in, which is mesh order except that a
    strided shard (FSDP over a tensor-parallel weight) cuts last."""
    coord, cuts = mesh.get_coordinate(), []
    for d in (len(shape) - 2, len(shape) - 1):
        # getattr: a strided shard is no Shard subclass, but has a dim too; d - 1: the stack's dim 0
        on_d = [m for m, pl in enumerate(placements) if getattr(pl, "dim", None) == d - 1]
        size = shape[d]
        for m in sorted(on_d, key=lambda m: (type(placements[m]) is not Shard, m)):
            cuts.append((m, d, size))
            size = _sizes(size, mesh.size(m))[coord[m]]
    return cuts[::-1]


def _gather_cut(local: torch.Tensor, group, me: int, d: int, parent: int) -> tuple[torch.Tensor, tuple]:
    """All-to-all over one mesh dim cutting tensor dim d: each rank gets its share of the stack
    with dim d whole (as it was before the cut); returns it and what _scatter_cut needs."""
    ranks = dist.get_world_size(group)
    counts, widths = _owners(local.shape[0], ranks), _sizes(parent, ranks)
    rest = math.prod(local.shape[1:d]) * math.prod(local.shape[d + 1:])  # elements per unit of width
    received = [counts[me] * w * rest for w in widths]
    sent = [c * local.shape[d] * rest for c in counts]
    got = funcol.all_to_all_single(local.flatten(), received, sent, group)
    whole = torch.cat([piece.view(counts[me], *local.shape[1:d], w, *local.shape[d + 1:])
                       for piece, w in zip(got.split(received), widths)], d)
    return whole, (group, d, widths, sent, received, local.shape)


def _scatter_cut(done: torch.Tensor, group, d: int, widths: list[int], sent: list[int], received: list[int],
                 shape: torch.Size) -> torch.Tensor:
    """The reverse of _gather_cut: each rank's shard of every matrix back to it."""
    pieces = torch.cat([p.flatten() for p in done.split(widths, d)])
    return funcol.all_to_all_single(pieces, sent, received, group).view(shape)


def orthogonalise(updates: list[torch.Tensor], steps: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """Newton-Schulz of same-shaped, same-placed updates (matrices or stacks of experts), each
    matrix computed by one rank; returns local tensors shaped as the inputs' local shards.

    A mesh dim that replicates the matrices splits the stack (its ranks each take a share, an
    all-gather returns the results); one that cuts a matrix dim trades shards of all matrices
    for whole ones of a share (an all-to-all each way); one that shards the experts keeps them.
    DTensor.redistribute would do the same on NCCL, but turns each all-to-all into an all-gather
    on a CPU mesh (gloo has none), putting every matrix on every rank (and the dry run, which
    traces on CPU meshes, would count that)."""
    first = updates[0]
    if not isinstance(first, DTensor):
        stack = torch.stack(updates)
        return list(newton_schulz(stack.flatten(0, -3), steps, dtype).view(stack.shape).unbind(0))
    # the local shards are stacked, not the DTensors: torch 2.11's DTensor stack leaves a strided
    # shard on the dim it named before the stack's new dim 0 (the placements then say another
    # layout than the data's). In the Newton-Schulz dtype from here on: bfloat16 halves the
    # traffic and loses nothing that the iteration would not drop anyway
    mesh, placements = first.device_mesh, first.placements
    local = torch.stack([u.to_local() for u in updates]).to(dtype)
    coord = mesh.get_coordinate()
    shares = []
    for m in [m for m, pl in enumerate(placements) if pl.is_replicate()]:
        counts = _owners(local.shape[0], mesh.size(m))
        shares.append((m, counts))
        local = local.split(counts)[coord[m]]
    cuts = []
    for m, d, parent in _matrix_shards(mesh, placements, (len(updates), *first.shape)):
        local, undo = _gather_cut(local, mesh.get_group(m), coord[m], d, parent)
        cuts.append(undo)
    done = newton_schulz(local.flatten(0, -3), steps, dtype).view(local.shape)
    for undo in reversed(cuts):
        done = _scatter_cut(done, *undo)
    for m, counts in reversed(shares):
        padded = torch.cat([done, done.new_zeros(max(counts) - done.shape[0], *done.shape[1:])])
        gathered = funcol.all_gather_tensor(padded, 0, mesh.get_group(m)).split(max(counts))
        done = torch.cat([g[:c] for g, c in zip(gathered, counts)])
    return list(done.unbind(0))


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
    """A part's parameters that train as (Muon's, AdamW's). A LoRA adapter's matrices are in the
    group of the layer they adapt (layers.<i>.attention.wq.lora_A.weight: attention)."""
    muon, adamw = [], []
    for name, p in part.named_parameters():
        if p.requires_grad:
            (muon if muon_group(name, p) in groups else adamw).append(p)
    return muon, adamw
