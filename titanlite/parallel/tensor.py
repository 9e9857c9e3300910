"""Tensor (Megatron-style), sequence and loss parallel, driven by a model family's plan.

A family declares which modules split how (`TPPlan`); this file applies it the same way for
every family. Between blocks the residual stream is a plain tensor: this rank's sequence
shard with sequence parallel, else the whole sequence. Attention and feed-forward take the
whole sequence, work on this rank's heads / hidden units, and reduce(-scatter) back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (ColwiseParallel, ParallelStyle, PrepareModuleInput,
                                               PrepareModuleInputOutput, RowwiseParallel, SequenceParallel,
                                               parallelize_module)

from titanlite.errors import ConfigError


@dataclass(frozen=True)
class TPPlan:
    """A family's tensor-parallel plan for one value of `between` (see `between_layout`)."""

    root: dict[str, ParallelStyle]
    """Top-level modules (embedding, output) -> style."""
    block: dict[str, ParallelStyle]
    """Module names inside one block -> style; applied to every block."""
    root_norms: tuple[str, ...] = ()
    block_norms: tuple[str, ...] = ()
    """Norms on the residual stream: sequence parallel with it on, else run whole on every rank."""
    head_params: tuple[str, ...] = ()
    """Parameters inside a block with one entry per query head (attention sinks): sharded on dim 0
    with the heads, where a block has them."""


def replicate_params(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
    """`module`'s own parameters as Replicate DTensors on `mesh`, each keeping its requires_grad
    (torch's styles make every one trainable again: a frozen norm under LoRA would train)."""
    for pname, p in list(module.named_parameters(recurse=False)):
        module.register_parameter(pname, nn.Parameter(DTensor.from_local(p, mesh, [Replicate()], run_check=False),
                                                      requires_grad=p.requires_grad))


class NormParallel(SequenceParallel):
    """torch's SequenceParallel, each parameter keeping its requires_grad (replicate_params)."""

    def _replicate_module_fn(self, name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
        replicate_params(name, module, device_mesh)


def between_layout(sequence_parallel: bool) -> Placement:
    """The residual stream's layout between blocks, which a family's plan is written against."""
    return Shard(1) if sequence_parallel else Replicate()


def run_whole(module: nn.Module, mesh: DeviceMesh, inputs: Placement) -> nn.Module:
    """`module` whole on every tp rank: its parameters Replicate DTensors, its plain inputs taken
    as `inputs` (Replicate: the same tensor on every rank; Shard(0): each rank's own tokens), its
    output handed back plain. Every parameter lives on the tp mesh: plain parameters among DTensor
    ones would break the optimizer's and the gradient clipping's foreach ops."""
    return distribute_module(module, mesh, replicate_params,
                             input_fn=lambda mod, xs, mesh: tuple(DTensor.from_local(x, mesh, [inputs], run_check=False)
                                                                  for x in xs),
                             output_fn=lambda mod, out, mesh: out.to_local())


class TokenParallel(ParallelStyle):
    """Run a module whole on every TP rank, on that rank's own tokens (dim 0 of its inputs), as
    a MoE layer's router does under sequence parallel. Its parameters are Replicate DTensors
    used on Shard(0) inputs, so their gradients come out Partial and are summed over tp."""

    def _apply(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        return run_whole(module, mesh, Shard(0))


def check_decoder_tp(args: Any, tp: int) -> None:
    """What every family's shapes must allow under tensor parallel (titanlite.preflight calls
    it for all of them): whole KV heads per rank and heads and vocabulary divisible. Every other
    split width (FFN hidden units, MLA projections) is checked where the plan splits it (`apply_tp`)."""
    if tp > 1:
        check_tp(tp, args.n_kv_heads, {"n_heads": args.n_heads, "n_kv_heads": args.n_kv_heads,
                                       "vocab_size": args.vocab_size})


def check_tp(tp: int, n_kv_heads: int, sizes: dict[str, int]) -> None:
    """Refuse a tensor-parallel degree the shapes cannot serve, before any weight is allocated:
    `sizes` names each width the plan splits (heads, FFN hidden units, vocabulary)."""
    if tp > n_kv_heads:
        # each rank needs at least one whole KV head; replicating KV heads is not implemented
        raise ConfigError(f"parallelism.tensor_parallel_degree {tp} exceeds n_kv_heads {n_kv_heads}; "
                          f"use a degree <= {n_kv_heads} that divides it")
    for what, size in sizes.items():
        if size % tp:
            raise ConfigError(f"{what} {size} is not divisible by parallelism.tensor_parallel_degree "
                              f"{tp}; pick a degree that divides it")


def decoder_plan(between: Placement, loss_parallel: bool, qk_norm: bool = False, moe: bool = False) -> TPPlan:
    """The plan of a titanlite.layers.decoder.Decoder: heads and FFN hidden units split over TP,
    the residual stream `between` outside them, embedding and output sharded on the vocabulary.

    `qk_norm`: the QK-norm weights (head_dim elements, shared by all heads) are not split: each
    rank normalises its own heads, [B, S, heads, head_dim] sharded on dim 2, with the weight a
    Replicate DTensor, so its gradient comes out Partial and is summed over the ranks' heads.

    `moe`: a MoE layer is not split over tp: each tp rank routes its own sequence shard (the
    layer's input and output stay Shard(1); without sequence parallel the layer takes its shard
    of the whole sequence and gathers the result), dispatching it over the expert-parallel
    group, which spans whole tp groups. The router (and a shared expert) run whole on each
    rank's tokens, their gradients summed over tp. Blocks with a dense feed-forward take the
    dense entries: `apply_tp` applies to each block the entries it has modules for."""
    root = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=between),
        # with loss parallel the logits stay a DTensor sharded on vocab for the loss
        "output": ColwiseParallel(input_layouts=between,
                                  output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                  use_local_output=not loss_parallel),
    }
    norms = {"attention.q_norm": NormParallel(sequence_dim=2, use_local_output=True),
             "attention.k_norm": NormParallel(sequence_dim=2, use_local_output=True)} if qk_norm else {}
    block = {
        # (x, cos, sin, ctx): only x is distributed; the RoPE tables are whole on every rank.
        # x stays a DTensor so that wq, wk and wv's input gradients (Partial) are summed first
        # and leave the sub-layer as one reduce-scatter (one all-reduce without sequence
        # parallel); a plain x would make each of them all-reduce its own gradient.
        "attention": PrepareModuleInput(input_layouts=(between, None, None, None),
                                        desired_input_layouts=(Replicate(), None, None, None)),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        **norms,
        "attention.wo": RowwiseParallel(output_layouts=between),
        "feed_forward": PrepareModuleInput(input_layouts=(between,), desired_input_layouts=(Replicate(),)),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=between),
        "feed_forward.w3": ColwiseParallel(),
    }
    if moe:
        block |= {
            "moe": PrepareModuleInputOutput(input_layouts=(between,), desired_input_layouts=(Shard(1),),
                                            use_local_input=True, output_layouts=(Shard(1),),
                                            desired_output_layouts=(between,), use_local_output=True),
            "moe.router.gate": TokenParallel(),
            "moe.shared": TokenParallel(),
        }
    return TPPlan(root, block, root_norms=("norm",), block_norms=("attention_norm", "ffn_norm"),
                  head_params=("attention.sinks",))


def wait_on_output(module: nn.Module) -> None:
    """Make `module` return a plain tensor where tensor parallel leaves an AsyncCollectiveTensor
    (the embedding's reduce-scatter is issued async). A compiled block given one as input
    answers in backward with a plain gradient that DTensor's redistribute cannot take
    (torch 2.13); the first block needs the value at once, so waiting loses no overlap."""
    def wait(mod: nn.Module, inputs: tuple, out: torch.Tensor) -> torch.Tensor:
        # a non-view op waits and unwraps (a view would stay async); the copy is one activation
        return out.clone() if isinstance(out, AsyncCollectiveTensor) else out

    module.register_forward_hook(wait)


def _present(module: nn.Module, names: tuple[str, ...] | list[str]) -> list[str]:
    # a pipeline stage holds some top-level modules as nn.Identity: nothing to split there
    return [n for n in names if not isinstance(module.get_submodule(n), nn.Identity)]


def _has(module: nn.Module, name: str) -> bool:
    try:
        module.get_submodule(name)
    except AttributeError:
        return False
    return True


def _check_split_widths(block: nn.Module, entries: dict[str, ParallelStyle], tp: int) -> None:
    """Refuse a width the plan splits that tp does not divide (a fork's FFN hidden size), naming
    the parameter, before any weight is allocated: DTensor would shard it unevenly without a word."""
    for name, style in entries.items():
        module = block.get_submodule(name)
        style = getattr(style, "base", style)  # a style that shards an adapter too (titanlite.parallel.lora)
        dim = 0 if isinstance(style, ColwiseParallel) else 1 if isinstance(style, RowwiseParallel) else None
        weight = getattr(module, "weight", None)
        if dim is None or not isinstance(weight, torch.Tensor) or weight.shape[dim] % tp == 0:
            continue
        raise ConfigError(f"parallelism.tensor_parallel_degree {tp} does not divide {name}.weight's "
                          f"{'output' if dim == 0 else 'input'} width {weight.shape[dim]}, which the TP plan splits; "
                          "pick a degree that divides it")


def check_tp_covered(model: nn.Module, family: str, blocks: str, tp: int) -> None:
    """After tensor (and expert) parallel: refuse, naming it and the plan entry to add, any
    parameter the plan left a plain tensor. Its neighbours are DTensors, so it would be trained
    as if each rank's copy were the whole (a QK-norm weight's gradient summed over one rank's
    heads only) and drift apart across ranks, with no error."""
    for name, p in model.named_parameters():
        if isinstance(p, DTensor):
            continue
        owner, _, attr = name.rpartition(".")
        in_block = owner.startswith(blocks + ".")
        rest = owner.removeprefix(blocks + ".")
        path = rest.partition(".")[2] if in_block else owner  # within the block (or the root); "": itself
        if not path or next(model.get_submodule(owner).children(), None) is not None:
            # held directly by a module with children (attention sinks, a fork's own scale)
            entry = f"{path}.{attr}".lstrip(".")
            where = ("TPPlan.head_params (split with the heads), or a module of its own in TPPlan.block"
                     if in_block else "a module of its own in TPPlan.root")
        elif path.rpartition(".")[2].endswith("norm"):
            entry = path
            where = ("TPPlan.block (QK-norm: decoder_plan(..., qk_norm=True)) or block_norms (on the residual stream)"
                     if in_block else "TPPlan.root_norms")
        else:
            entry, where = path, "TPPlan.block" if in_block else "TPPlan.root"
        raise ConfigError(f"parallelism.tensor_parallel_degree {tp}: parameter {name} is not covered by {family}'s "
                          f"TP plan (models/{family}/parallelize.py tp_plan); add '{entry}' to {where}")


def gather_in(module: nn.Module, dtype: torch.dtype) -> None:
    """Cast `module`'s floating-point inputs to `dtype` before its TP input hook gathers them.
    Under autocast the residual stream (and a norm's output) is float32 and the matmuls cast
    it to `dtype` anyway: casting before the all-gather rather than after moves half the bytes
    forward, and the input gradient is reduce-scattered in `dtype` too, as under FSDP."""
    def cast(mod: nn.Module, inputs: tuple) -> tuple:
        return tuple(x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x for x in inputs)

    module.register_forward_pre_hook(cast, prepend=True)


def apply_tp(model: nn.Module, blocks: dict[str, nn.Module], mesh: DeviceMesh, plan: TPPlan, sequence_parallel: bool,
             gather_dtype: torch.dtype | None = None) -> None:
    """Split `model` over the TP mesh as `plan` says, keeping shared (tied) parameters shared.
    `gather_dtype`: the dtype autocast computes in, when autocast gives the mixed precision."""
    shared = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        shared.setdefault(id(p), []).append(name)
    tied = [names for names in shared.values() if len(names) > 1]
    root = {n: plan.root[n] for n in _present(model, list(plan.root))}
    block = dict(plan.block)
    if sequence_parallel:
        root |= {n: NormParallel() for n in _present(model, plan.root_norms)}
        block |= {n: NormParallel() for n in plan.block_norms}
    else:
        norms = [model.get_submodule(n) for n in _present(model, plan.root_norms)]
        # as under sequence parallel, a block holds the norms it has (a fork may drop ffn_norm)
        norms += [b.get_submodule(n) for b in blocks.values() for n in plan.block_norms if _has(b, n)]
        for norm in norms:
            run_whole(norm, mesh, Replicate())
    parallelize_module(model, mesh, root)
    for name in root:
        if isinstance(model.get_submodule(name), nn.Embedding):
            wait_on_output(model.get_submodule(name))  # before compiled blocks
        elif gather_dtype is not None:
            gather_in(model.get_submodule(name), gather_dtype)
    for b in blocks.values():
        # a block holds either a dense feed-forward or a MoE layer: its plan is the entries it has
        entries = {n: style for n, style in block.items() if _has(b, n)}
        _check_split_widths(b, entries, mesh.size())
        parallelize_module(b, mesh, entries)
        for name in plan.head_params:
            owner, _, attr = name.rpartition(".")
            if isinstance(getattr(b.get_submodule(owner), attr, None), nn.Parameter):
                param = getattr(b.get_submodule(owner), attr)
                setattr(b.get_submodule(owner), attr, nn.Parameter(distribute_tensor(param, mesh, [Shard(0)]),
                                                                   requires_grad=param.requires_grad))
        if gather_dtype is not None:
            for n, style in block.items():
                if isinstance(style, PrepareModuleInput) and _has(b, n):
                    gather_in(b.get_submodule(n), gather_dtype)
    for names in tied:
        # parallelize_module gave each module its own copy; tied modules share a layout (e.g.
        # embedding and output both shard the vocab), so one DTensor serves all of them
        first = model.get_parameter(names[0])
        for name in names[1:]:
            owner, _, attr = name.rpartition(".")
            setattr(model.get_submodule(owner), attr, first)
