"""The one parallelize order, for every model family and every model part:

float8 -> LoRA -> tensor parallel -> expert parallel -> activation checkpointing -> per-block compile -> FSDP
(blocks bottom-up, then the root). LoRA adapts layers and freezes the rest before the plan, so
tensor parallel shards each adapter as its layer (titanlite.parallel.lora) and FSDP shards
adapters and frozen weights alike. Context parallel needs no module change (attention reads the
cp group from its AttnContext); a pipeline stage is cut before this runs on it. No step may
change which parameters train: `parallelize` checks it.
"""

from __future__ import annotations

from dataclasses import dataclass

from functools import partial

import torch
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from titanlite.config.job import ActivationCheckpoint, Compile, Float8
from titanlite.errors import ConfigError
from titanlite.layers.decoder import Recompute
from titanlite.layers.lora import LoRASetup, apply_lora
from titanlite.model_spec import ModelSpec
from titanlite.layers.moe import moe_layers
from titanlite.layers.mtp import mtp_blocks
from titanlite.parallel.expert import apply_ep, set_stats_group, shard_experts
from titanlite.parallel.float8 import apply_float8
from titanlite.parallel.lora import with_adapters
from titanlite.parallel.mesh import Meshes
from titanlite.parallel.tensor import apply_tp, between_layout, check_tp_covered


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
    lora: LoRASetup | None = None
    """Adapters on these layers, every other weight frozen (titanlite.layers.lora.plan_lora); None: all train."""


# Per-op selective AC keeps the outputs of these ops (the expensive ones: matmuls,
# attention, and collectives that TP/CP/EP would otherwise repeat) and recomputes the
# cheap elementwise ops between them (norms, RoPE, SiLU, residual adds).
_SAVE_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops._c10d_functional.reduce_scatter_tensor.default,
    torch.ops._c10d_functional.all_gather_into_tensor.default,
    # mixture of experts: the experts' grouped GEMM and expert parallel's token all-to-all
    torch.ops.aten._grouped_mm.default,
    torch.ops._c10d_functional.all_to_all_single.default,
}


# FSDP modules nested inside a checkpointed block (expert-parallel experts have their own)
# annotate their hooks with profiler ranges a different number of times in forward and in
# recomputation, which per-op AC replays by count and refuses. The ranges compute nothing:
# per-op AC passes them through, as PyTorch does for detach (a known PyTorch issue). Added to
# torch's set where per-op AC is applied, not at import: compile needs torch's own SAC modes as
# the contexts, so the set cannot be scoped to them.
_PROFILER_RANGES = {torch.ops.profiler._record_function_enter_new.default,
                    torch.ops.profiler._record_function_exit._RecordFunction}


def _selective_contexts(alternate: bool = False) -> tuple:
    """Per-op AC's contexts for one block call; `alternate`: every second matmul of the block (in
    forward, and again in its recomputation) is recomputed rather than kept."""
    matmuls = {False: 0, True: 0}

    def policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
        if alternate and op is torch.ops.aten.mm.default:
            matmuls[ctx.is_recompute] += 1
            if matmuls[ctx.is_recompute] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if op in _SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE
    return create_selective_checkpoint_contexts(policy)


def apply_ac(blocks: list[nn.Module], cfg: ActivationCheckpoint, random: bool = False) -> None:
    """Recompute activations in backward: every block whole (full), every N-th block whole
    (selective, layer), or in every block all but the matmul/attention outputs (selective, op).
    A block declares a `recompute` field, which it checkpoints its own forward with
    (titanlite.layers.decoder.Block; models/transformers gives transformers' layers one).
    `random`: the blocks draw random numbers (Recompute.random)."""
    if cfg.mode == "none":
        return
    per_op = cfg.mode == "selective" and cfg.selective_type == "op"
    if per_op:
        torch.utils.checkpoint.SAC_IGNORED_OPS |= _PROFILER_RANGES
    for i, block in enumerate(blocks):
        if not hasattr(block, "recompute"):
            raise ConfigError(f"activation_checkpoint.mode = {cfg.mode}: the model's block {type(block).__name__} "
                              "declares no `recompute` field (a titanlite.layers.decoder.Recompute or None, which "
                              "its forward checkpoints itself with); declare one, as titanlite.layers.decoder.Block "
                              "does, or set activation_checkpoint.mode = none")
        if per_op:
            block.recompute = Recompute(partial(_selective_contexts, cfg.selective_op_matmuls == "alternate"), random)
        elif cfg.mode == "full" or i % cfg.selective_every == 0:
            block.recompute = Recompute(random=random)


def apply_compile(blocks: list[nn.Module]) -> None:
    """Compile each block in place, so parameter names (and checkpoints) are unchanged.
    Runs after AC (the checkpoint region is traced into the graph) and before FSDP (whose
    hooks stay outside the compiled region). A block with MoE layers is not compiled whole:
    ordering tokens by expert is eager, and under expert parallelism it reads the split sizes
    on the host. Its parts with no host read are compiled instead: the family's own non-MoE
    children (attention, a dense feed-forward), each MoE layer's router and shared expert, and
    its experts' grouped GEMMs with the SwiGLU between them, one compiled function for every
    layer, whose row count is dynamic (it follows the routing). torch's modules (the norms)
    have no frame of their own for Dynamo to compile alone."""
    for block in blocks:
        moes = moe_layers([block])
        if not moes:
            block.compile(fullgraph=True)
            continue
        for child in block.children():
            if not moe_layers([child]) and not type(child).__module__.startswith("torch."):
                child.compile(fullgraph=True)
        for moe in moes:
            for part in (moe.router, moe.shared):
                if part is not None:
                    part.compile(fullgraph=True)
            moe.experts.compiled = True


def apply_fsdp(model: nn.Module, blocks: list[nn.Module], meshes: Meshes, opts: ParallelizeOptions) -> None:
    """fully_shard each block bottom-up, then the root (embeddings, final norm, output).
    Expert-parallel experts are sharded first, on their own mesh, so the blocks leave them be."""
    mp = MixedPrecisionPolicy(param_dtype=opts.param_dtype, reduce_dtype=opts.reduce_dtype)
    mesh = meshes.fsdp
    if meshes.dims.ep > 1:
        shard_experts(model, meshes.expert_fsdp, mp, opts.reshard_after_forward != "never")
    for i, block in enumerate(blocks):
        if opts.reshard_after_forward == "default":
            # the last block is needed again at once by backward: keep it gathered
            reshard = i < len(blocks) - 1
        else:
            reshard = opts.reshard_after_forward == "always"
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=opts.reshard_after_forward == "always")
    # The loss is already divided by the global token count, so gradients must be
    # summed across ranks, not averaged. A plain SUM also runs on gloo (no PREMUL_SUM).
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)


def all_blocks(model: nn.Module, spec: ModelSpec) -> list[nn.Module]:
    """The blocks that float8, AC, compile and FSDP treat one by one, in the order they run: the
    model's (or stage's), then its multi-token prediction depths' (which would otherwise sit in
    the root: uncheckpointed, eager, gathered with the embeddings for the whole step)."""
    return [*spec.blocks_of(model).values(), *mtp_blocks(model)]


def parallelize(model: nn.Module, spec: ModelSpec, meshes: Meshes, opts: ParallelizeOptions) -> None:
    """Apply every parallel dimension to `model` (a whole model or a pipeline stage), in place."""
    blocks = spec.blocks_of(model)
    every_block = all_blocks(model, spec)
    if opts.float8.enable:
        apply_float8(every_block, opts.float8, fsdp=meshes.dims.fsdp)
    if opts.lora is not None:
        apply_lora(model, opts.lora)
    trains = {n for n, p in model.named_parameters() if p.requires_grad}
    if meshes.dims.tp > 1:
        plan = spec.tp_plan(between_layout(opts.sequence_parallel), opts.loss_parallel, model)
        plan = plan if opts.lora is None else with_adapters(plan)
        # without FSDP autocast gives the mixed precision, and the residual stream is float32
        autocast = opts.param_dtype if not meshes.dims.fsdp and opts.param_dtype != torch.float32 else None
        apply_tp(model, blocks, meshes.tp, plan, opts.sequence_parallel, gather_dtype=autocast)
    if meshes.dims.ep > 1:
        apply_ep(model, meshes.ep)
    if meshes.dims.tp > 1:
        check_tp_covered(model, spec.name, spec.blocks, meshes.dims.tp)
    if meshes.dims.dp * meshes.dims.cp * meshes.dims.tp > 1:
        set_stats_group(model, meshes.routed["dp_cp_tp"].get_group())
    apply_ac(every_block, opts.activation_checkpoint, random=opts.lora is not None and opts.lora.dropout > 0)
    if opts.compile.enable:
        apply_compile(every_block)
    if meshes.dims.fsdp:
        apply_fsdp(model, every_block, meshes, opts)
    changed = sorted(trains ^ {n for n, p in model.named_parameters() if p.requires_grad})
    if changed:  # a frozen weight that trains (or the reverse) is a silent wrong result: a bug to fix here
        raise RuntimeError(f"the parallel plan changed whether {changed[0]} trains ({len(changed)} parameters): "
                           "a step of titanlite.parallel.apply rebuilt it without keeping requires_grad")
