"""How DeepSeek-V3 is parallelized: the checks its shapes and options need, and its
tensor-parallel plan. titanlite.parallel.apply applies every dimension in one order.

Tensor parallel over MLA: the per-head projections (wq or wq_b, wkv_b) split by heads
(column-wise), wo row-wise; the low-rank down-projections (wq_a, wkv_a: the query latent,
the compressed KV latent and the shared RoPE key) and their norms are small and run whole on
every tp rank, on the whole sequence, their weights Replicate DTensors. The shared RoPE key
feeds every head, so its gradient is summed over the ranks' heads (`SumGradOverHeads`); the
latents' gradients are summed by the column-wise projections they feed. MoE blocks follow
titanlite.parallel.tensor.decoder_plan (each tp rank routes its own sequence shard). The
multi-token prediction depths get the same plan, applied inside each depth by `MTPParallel`.
"""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, PrepareModuleInput, RowwiseParallel

from titanlite.errors import ConfigError
from titanlite.parallel.expert import check_expert_layout
from titanlite.parallel.mesh import ParallelDims
from titanlite.parallel.tensor import TPPlan, apply_tp, check_tp, decoder_plan, run_whole

from .model import ModelArgs


def check_model(args: ModelArgs) -> None:
    """Refuse MLA, routing and MTP settings that cannot build or train, one line each."""
    if args.qk_rope_head_dim <= 0 or args.qk_rope_head_dim % 2:
        raise ConfigError(f"qk_rope_head_dim {args.qk_rope_head_dim} must be positive and even (RoPE rotates pairs)")
    if min(args.kv_lora_rank, args.v_head_dim) <= 0 or args.qk_nope_head_dim < 0 or args.q_lora_rank < 0:
        raise ConfigError(f"MLA dims kv_lora_rank {args.kv_lora_rank}, v_head_dim {args.v_head_dim} must be "
                          f"positive and qk_nope_head_dim {args.qk_nope_head_dim}, q_lora_rank {args.q_lora_rank} "
                          "non-negative (q_lora_rank 0: no query bottleneck)")
    if args.n_kv_heads != args.n_heads:
        raise ConfigError(f"n_kv_heads {args.n_kv_heads} must equal n_heads {args.n_heads}: MLA expands the "
                          "compressed KV into one key and value per query head")
    moe = args.moe
    if moe.topk_group > moe.n_group:
        raise ConfigError(f"moe topk_group {moe.topk_group} exceeds n_group {moe.n_group}: a token cannot "
                          f"keep more expert groups than there are; use topk_group <= {moe.n_group}")
    if moe.n_group > 1 and (moe.num_experts % moe.n_group or moe.num_experts // moe.n_group < 2):
        raise ConfigError(f"moe num_experts {moe.num_experts} is not divisible into n_group {moe.n_group} "
                          "groups of at least 2 experts (a group is scored by its top 2); pick n_group dividing it")
    if moe.n_group > 1 and moe.top_k > moe.topk_group * (moe.num_experts // moe.n_group):
        raise ConfigError(f"moe top_k {moe.top_k} exceeds the {moe.topk_group} kept groups' "
                          f"{moe.topk_group * (moe.num_experts // moe.n_group)} experts; raise topk_group")
    if args.mtp_layers and args.max_seq_len <= args.mtp_layers + 1:
        raise ConfigError(f"training.seq_len {args.max_seq_len} leaves no target for {args.mtp_layers} "
                          f"multi-token prediction depth(s); use a sequence longer than {args.mtp_layers + 1}")


def check_layout(args: ModelArgs, dims: ParallelDims) -> None:
    """Refuse layouts the shapes cannot serve, before any weight is allocated."""
    check_model(args)
    if dims.tp > 1:
        sizes = {"n_heads": args.n_heads, "ffn_hidden": args.ffn_hidden, "vocab_size": args.vocab_size}
        if args.mtp_layers:
            sizes["dim (the MTP projection eh_proj)"] = args.dim
        check_tp(dims.tp, args.n_kv_heads, sizes)
    if args.moe.aux_loss_coeff and args.moe.aux_loss_per_sequence and dims.cp * dims.tp > 1:
        raise ConfigError("the sequence-wise auxiliary loss (moe aux_loss_per_sequence) needs whole sequences "
                          f"on each rank, but context_parallel_degree {dims.cp} x tensor_parallel_degree "
                          f"{dims.tp} (sequence parallel) splits them; set moe.aux_loss_coeff 0 or use dp/ep/pp")
    if args.mtp_layers and dims.pp > 1 and args.n_layers < dims.pp:
        raise ConfigError(f"{args.mtp_layers} MTP depth(s) go on the last of {dims.pp} pipeline stages, which "
                          f"needs at least one of the model's {args.n_layers} blocks; lower pipeline_parallel_degree")
    check_expert_layout(args.moe, dims)


class Replicated(ParallelStyle):
    """Run a module whole on every tp rank on the same (plain, whole) input; its parameters
    become Replicate DTensors, whose gradients are complete on every rank."""

    def _apply(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        return run_whole(module, mesh, Replicate())


class SumGradOverHeads(ParallelStyle):
    """Identity forward on a plain whole tensor every tp rank shares (the RoPE key); in backward
    its gradient, each rank's over its own heads, is summed over the tp ranks."""

    def _apply(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, mesh,
                                 input_fn=lambda mod, inputs, mesh: tuple(
                                     DTensor.from_local(x, mesh, [Replicate()], run_check=False) for x in inputs),
                                 output_fn=lambda mod, out, mesh: out.to_local(grad_placements=[Partial()]))


class MTPParallel(ParallelStyle):
    """Each multi-token prediction depth: its projection eh_proj split column-wise (the residual
    layout in and out), its norms on the residual stream, its block as every other block."""

    def __init__(self, between: Placement, block: TPPlan):
        super().__init__()
        self.between, self.block = between, block

    def _apply(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        plan = TPPlan(root={"eh_proj": ColwiseParallel(input_layouts=self.between, output_layouts=self.between)},
                      block=self.block.block, root_norms=("enorm", "hnorm", "norm"),
                      block_norms=self.block.block_norms)
        for depth in module.values():
            apply_tp(depth, nn.ModuleDict({"block": depth.block}), mesh, plan, isinstance(self.between, Shard))
        return module


def tp_plan(between: Placement, loss_parallel: bool, model: object = None) -> TPPlan:
    base = decoder_plan(between, loss_parallel, moe=True)
    latent = {f"attention.{n}": Replicated() for n in ("wq_a", "q_norm", "wkv_a", "kv_norm")}
    block = {k: v for k, v in base.block.items() if not k.startswith("attention.")} | latent | {
        # plain whole-sequence input: the latent projections run whole on it
        "attention": PrepareModuleInput(input_layouts=(between, None, None, None),
                                        desired_input_layouts=(Replicate(), None, None, None), use_local_output=True),
        "attention.wq": ColwiseParallel(), "attention.wq_b": ColwiseParallel(),
        "attention.wkv_b": ColwiseParallel(), "attention.k_rope_heads": SumGradOverHeads(),
        "attention.wo": RowwiseParallel(output_layouts=between)}
    blocks = TPPlan(base.root, block, base.root_norms, base.block_norms)
    root = base.root | {"mtp_embeddings": base.root["tok_embeddings"], "mtp": MTPParallel(between, blocks)}
    return TPPlan(root, block, base.root_norms, base.block_norms)
