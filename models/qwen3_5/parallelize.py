"""How Qwen3.5 is parallelized: its tensor-parallel plan and the layouts its shapes allow.
titanlite.parallel.apply applies every dimension in one order for every family.

Tensor parallel splits Gated DeltaNet like attention: each rank holds whole q/k and value heads
(wq, wk, wv, wz, wb, wa column-wise; their convolution channels, dt_bias and A_log on dim 0
with them; wo row-wise), so the gated delta rule runs on the rank's heads alone; the gated
norm's weight (one head's width, shared by all heads) is whole on every rank, its gradient
summed over their heads. Full attention splits as Qwen3's, its output gate `wg` with wq."""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, distribute_module
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle

from titanlite.errors import ConfigError
from titanlite.layers.linear_attention import LINEAR_BACKENDS, require_fla
from titanlite.parallel.expert import check_expert_layout
from titanlite.parallel.mesh import ParallelDims
from titanlite.parallel.tensor import TPPlan, TokenParallel, check_tp, decoder_plan

from .model import ModelArgs


def check_layout(args: ModelArgs, dims: ParallelDims) -> None:
    """Refuse layouts the shapes cannot serve, and a linear backend that cannot run, before any
    weight is allocated."""
    if args.linear_backend not in LINEAR_BACKENDS:
        raise ConfigError(f"the flavor's linear_backend {args.linear_backend!r} is not one of {LINEAR_BACKENDS}")
    if dims.cp > 1 and args.linear_backend != "torch":
        raise ConfigError("parallelism.context_parallel_degree: linear_backend fla does not run under context "
                          "parallel (titanlite passes the state between ranks with the torch backend); set it to 1")
    if args.linear_backend == "fla":
        try:
            require_fla()
        except ImportError as e:
            raise ConfigError(str(e)) from None
    sizes = {"n_heads": args.n_heads, "n_kv_heads": args.n_kv_heads, "linear_k_heads": args.linear_k_heads,
             "linear_v_heads": args.linear_v_heads, "vocab_size": args.vocab_size}
    if args.moe is None:
        sizes["ffn_hidden"] = args.ffn_hidden
    check_tp(dims.tp, args.n_kv_heads, sizes)
    if args.moe is not None:
        check_expert_layout(args.moe, dims)


class ReplicatedWeights(ParallelStyle):
    """The module's parameters as Replicate DTensors, its inputs and outputs untouched: for a
    module that reads its weight with `to_local(grad_placements=[Partial()])` on each rank's
    own heads (titanlite.layers.linear_attention.GatedRMSNorm)."""

    def _apply(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        def params(name: str, mod: nn.Module, mesh: DeviceMesh) -> None:
            for pname, p in list(mod.named_parameters(recurse=False)):
                if not isinstance(p, DTensor):
                    mod.register_parameter(pname, nn.Parameter(DTensor.from_local(p, mesh, [Replicate()],
                                                                                  run_check=False),
                                                               requires_grad=p.requires_grad))

        return distribute_module(module, mesh, params)


def tp_plan(between: Placement, loss_parallel: bool, model: object = None) -> TPPlan:
    """Qwen3's plan (QK-norm, MoE entries) plus the full attention's gate and Gated DeltaNet's
    projections; `apply_tp` applies to each block the entries it has modules for."""
    plan = decoder_plan(between, loss_parallel, qk_norm=True, moe=True)
    block = plan.block | {
        "attention.wg": ColwiseParallel(),
        "attention.wz": ColwiseParallel(),
        "attention.wb": ColwiseParallel(),
        "attention.wa": ColwiseParallel(),
        "attention.norm": ReplicatedWeights(),
        "moe.shared_gate": TokenParallel(),
    }
    heads = ("attention.conv_q", "attention.conv_k", "attention.conv_v", "attention.dt_bias", "attention.A_log")
    return TPPlan(plan.root, block, plan.root_norms, plan.block_norms, plan.head_params + heads)
