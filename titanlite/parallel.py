"""Model-agnostic parallel helpers that a model's parallelize.py composes in order."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from titanlite.config import ActivationCheckpoint, Compile, Float8


@dataclass(frozen=True)
class ParallelizeOptions:
    """The narrow slice of the job config that parallelize functions need."""

    param_dtype: torch.dtype
    reduce_dtype: torch.dtype
    reshard_after_forward: str
    activation_checkpoint: ActivationCheckpoint
    compile: Compile
    loss_parallel: bool = False
    """Leave the logits sharded on vocab (a DTensor) for a loss-parallel cross-entropy."""
    sequence_parallel: bool = True
    """With TP, shard the sequence between blocks (norms and residual stream)."""
    float8: Float8 = Float8()


# Per-op selective AC keeps the outputs of these ops (the expensive ones: matmuls,
# attention, and collectives that TP/CP would otherwise repeat) and recomputes the
# cheap elementwise ops between them (norms, RoPE, SiLU, residual adds).
_SAVE_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops._c10d_functional.reduce_scatter_tensor.default,
    torch.ops._c10d_functional.all_gather_into_tensor.default,
}


def _save_matmuls_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def apply_ac(blocks: nn.ModuleDict, cfg: ActivationCheckpoint) -> None:
    """Recompute activations in backward: every block whole (full), every N-th block whole
    (selective, layer), or in every block all but the matmul/attention outputs (selective, op)."""
    if cfg.mode == "none":
        return
    for i, name in enumerate(list(blocks.keys())):
        if cfg.mode == "selective" and cfg.selective_type == "op":
            blocks[name] = checkpoint_wrapper(
                blocks[name], preserve_rng_state=False,
                context_fn=partial(create_selective_checkpoint_contexts, _save_matmuls_policy))
        elif cfg.mode == "full" or i % cfg.selective_every == 0:
            blocks[name] = checkpoint_wrapper(blocks[name], preserve_rng_state=False)


def wait_on_output(module: nn.Module) -> None:
    """Make `module` return a plain tensor where tensor parallel leaves an AsyncCollectiveTensor
    (the embedding's reduce-scatter is issued async). A compiled block given one as input
    answers in backward with a plain gradient that DTensor's redistribute cannot take
    (torch 2.13); the first block needs the value at once, so waiting loses no overlap."""
    def wait(mod: nn.Module, inputs: tuple, out: torch.Tensor) -> torch.Tensor:
        # a non-view op waits and unwraps (a view would stay async); the copy is one activation
        return out.clone() if isinstance(out, AsyncCollectiveTensor) else out

    module.register_forward_hook(wait)


def apply_compile(blocks: nn.ModuleDict) -> None:
    """Compile each block in place, so parameter names (and checkpoints) are unchanged.
    Runs after AC (the checkpoint region is traced into the graph) and before FSDP (whose
    hooks stay outside the compiled region)."""
    for block in blocks.values():
        block.compile(fullgraph=True)


def apply_fsdp(model: nn.Module, blocks: nn.ModuleDict, mesh: DeviceMesh, opts: ParallelizeOptions) -> None:
    """fully_shard each block bottom-up, then the root (embeddings, final norm, output)."""
    mp = MixedPrecisionPolicy(param_dtype=opts.param_dtype, reduce_dtype=opts.reduce_dtype)
    names = list(blocks.keys())
    for i, name in enumerate(names):
        if opts.reshard_after_forward == "default":
            # the last block is needed again at once by backward: keep it gathered
            reshard = i < len(names) - 1
        else:
            reshard = opts.reshard_after_forward == "always"
        fully_shard(blocks[name], mesh=mesh, mp_policy=mp, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=opts.reshard_after_forward == "always")
    # The loss is already divided by the global token count, so gradients must be
    # summed across ranks, not averaged. A plain SUM also runs on gloo (no PREMUL_SUM).
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)


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


def _owns(g: torch.Tensor) -> bool:
    """Whether this rank counts this gradient shard, so that each distinct shard counts once."""
    if not isinstance(g, DTensor):
        return not dist.is_initialized() or dist.get_rank() == 0  # the same on every rank
    if any(pl.is_partial() for pl in g.placements):
        raise RuntimeError(f"local_grad_sq: gradient with placements {g.placements} is not reduced; "
                           "call reduce_partial_grads first")
    if g.device_mesh.size() != dist.get_world_size():
        raise RuntimeError(f"local_grad_sq: gradient on {g.device_mesh} does not span all ranks; "
                           "parallelize every parameter over the whole mesh")
    coord = g.device_mesh.get_coordinate()
    return not any(c and pl.is_replicate() for c, pl in zip(coord, g.placements))


@torch.no_grad()
def local_grad_sq(params: list[nn.Parameter]) -> torch.Tensor:
    """This rank's share of the squared global L2 gradient norm, over every rank and mesh dimension.

    Each rank squares the norm of the gradient shards it owns (a shard replicated over HSDP
    replicas or TP ranks is owned once), so one SUM all-reduce over all ranks, whatever the
    mesh, gives the square of the global norm (fault.Guard.end_step makes that reduction).
    """
    grads = [p.grad for p in params if p.grad is not None]
    owned = [g.to_local() if isinstance(g, DTensor) else g for g in grads if _owns(g)]
    if not owned:
        return torch.zeros((), device=grads[0].device if grads else torch.device("cpu"))
    return torch.nn.utils.get_total_norm(owned, norm_type=2.0, foreach=True).float() ** 2
