"""Pipeline parallelism: the model cut into stages, run by torch.distributed.pipelining.

The cut is generic: a stage keeps a contiguous range of blocks; the modules a family
declares before the blocks (embeddings) stay on the first stage only and those after
them (final norm, output) on the last only, replaced by nn.Identity elsewhere. Parameter
names stay those of the whole model, so checkpoints load on any layout.

Placement: with one stage per rank, stage i lives on pp rank i. With more, stages loop
over the ranks (stage s on rank s % pp) or, for V schedules, go down and back up
(rank r holds stages r and 2pp-1-r), so the first and last stage share rank 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn
from torch.distributed.pipelining import PipelineStage
from titanlite.config import ConfigError, Parallelism
from torch.distributed.pipelining.schedules import (PipelineScheduleMulti, PipelineScheduleSingle,
                                                    get_schedule_class)

SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble",
             "DualPipeV")
# Schedules with two stages per rank placed in a V (first and last stage on rank 0)
V_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")
# Schedules that split backward into input and weight gradients (the graph is kept between them)
SPLIT_BACKWARD = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")


@dataclass(frozen=True)
class StagePlan:
    """Which blocks each stage holds and which stages this rank runs."""

    n_stages: int
    blocks: tuple[tuple[int, int], ...]
    """[start, stop) block indices of every stage."""
    style: str
    """"loop" or "v"."""
    n_microbatches: int

    def stages_of(self, pp_rank: int, pp: int) -> list[int]:
        if self.style == "v":
            return [pp_rank, 2 * pp - 1 - pp_rank]
        return list(range(pp_rank, self.n_stages, pp))


def is_multi(schedule: str) -> bool:
    return issubclass(get_schedule_class(schedule), PipelineScheduleMulti)


def split_blocks(n_blocks: int, n_stages: int, first_less: int, last_less: int) -> list[int]:
    """Blocks per stage, each at least one, balancing blocks plus the first stage's
    `first_less` and the last stage's `last_less` block-equivalents (embedding, output)."""
    counts = [1] * n_stages
    extra = [0] * n_stages
    extra[0] += first_less
    extra[-1] += last_less
    # middle stages first on ties: they hold no embedding or output
    order = sorted(range(n_stages), key=lambda i: (i in (0, n_stages - 1), i))
    for _ in range(n_blocks - n_stages):
        i = min(order, key=lambda j: counts[j] + extra[j])
        counts[i] += 1
    return counts


def plan_stages(cfg: Parallelism, n_blocks: int, local_batch_size: int) -> StagePlan:
    """Stage count and block ranges, or a ConfigError naming the key to change."""
    pp, name = cfg.pipeline_parallel_degree, cfg.pipeline_parallel_schedule
    key = "parallelism.pipeline_parallel_"
    if name not in SCHEDULES:
        raise ConfigError(f"{key}schedule: unknown schedule '{name}'; use one of {', '.join(SCHEDULES)}")
    mbs = cfg.pipeline_parallel_microbatch_size
    if mbs < 1 or local_batch_size % mbs:
        raise ConfigError(f"{key}microbatch_size {mbs} does not divide training.local_batch_size "
                          f"{local_batch_size}; pick a divisor of it")
    n_mb = local_batch_size // mbs
    first, last = cfg.pipeline_parallel_first_stage_less_layers, cfg.pipeline_parallel_last_stage_less_layers
    if first < 0 or last < 0 or cfg.pipeline_parallel_layers_per_stage < 0:
        raise ConfigError(f"{key}layers_per_stage and {key}first/last_stage_less_layers must be >= 0")
    if pp > n_blocks:
        raise ConfigError(f"{key}degree {pp} exceeds the model's {n_blocks} blocks; "
                          f"use at most {n_blocks} stages")
    per_rank = 2 if is_multi(name) else 1
    if cfg.pipeline_parallel_layers_per_stage:
        n_stages = math.ceil((n_blocks + first + last) / cfg.pipeline_parallel_layers_per_stage)
    else:
        n_stages = pp * per_rank
    placeable = (n_stages == pp if per_rank == 1 else
                 n_stages == 2 * pp if name in V_SCHEDULES else n_stages % pp == 0)
    if not placeable:
        need = {1: f"exactly {pp}", 2: f"exactly {2 * pp}" if name in V_SCHEDULES else f"a multiple of {pp}"}
        raise ConfigError(f"{key}layers_per_stage {cfg.pipeline_parallel_layers_per_stage} makes {n_stages} "
                          f"stages; {name} on {pp} pipeline ranks needs {need[per_rank]}; "
                          f"change {key}layers_per_stage or the schedule")
    if n_stages > n_blocks:
        raise ConfigError(f"{n_stages} pipeline stages exceed the model's {n_blocks} blocks; use fewer "
                          f"stages ({key}degree or {key}layers_per_stage)")
    if name in ("1F1B", "DualPipeV") and n_mb < n_stages:
        # older torch hangs here (1F1B with fewer micro-batches than stages) instead of failing
        raise ConfigError(f"{name} needs at least as many micro-batches as stages ({n_stages}), got "
                          f"{n_mb} (training.local_batch_size {local_batch_size} / {key}microbatch_size "
                          f"{mbs}); raise the local batch size or lower the micro-batch size")
    rounds = max(1, n_mb // pp)
    if name in ("Interleaved1F1B", "InterleavedZeroBubble") and n_mb % rounds:
        raise ConfigError(f"{name} needs the micro-batch count ({n_mb}) to be a multiple of "
                          f"micro-batches // pipeline degree ({rounds}); use a multiple of {pp}")
    counts = split_blocks(n_blocks, n_stages, first, last)
    starts = [sum(counts[:i]) for i in range(n_stages)]
    return StagePlan(n_stages, tuple((s, s + c) for s, c in zip(starts, counts)),
                     "v" if name in V_SCHEDULES else "loop", n_mb)


def cut(model: nn.Module, start: int, stop: int, is_first: bool, is_last: bool,
        blocks: str = "layers", pre: tuple[str, ...] = ("tok_embeddings",),
        post: tuple[str, ...] = ("norm", "output")) -> nn.Module:
    """Keep blocks [start, stop) of `model` in place; parameter names are unchanged."""
    if not is_first:
        for name in pre:
            setattr(model, name, nn.Identity())
    if not is_last:
        for name in post:
            setattr(model, name, nn.Identity())
    layers: nn.ModuleDict = getattr(model, blocks)
    for key in list(layers.keys()):
        if not start <= int(key) < stop:
            del layers[key]
    return model


def _to_context(make_ctx: Callable) -> Callable:
    """A forward pre-hook: the stage is called as part(x, positions=..., document_ids=...)
    (the schedule chunks keyword tensors along the batch for every stage); the model
    wants part(x, ctx)."""
    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return (args[0], make_ctx(kwargs.get("positions"), kwargs.get("document_ids"))), {}
    return hook


def build_stage(part: nn.Module, stage_index: int, n_stages: int, device: torch.device,
                group, make_ctx: Callable, input_meta: torch.Tensor, output_meta: torch.Tensor) -> PipelineStage:
    """A PipelineStage over `part` with static shapes: no shape inference runs, so no
    extra forward (and no loss) happens on the first step."""
    part.register_forward_pre_hook(_to_context(make_ctx), with_kwargs=True)
    return PipelineStage(part, stage_index, n_stages, device, input_args=input_meta,
                         output_args=output_meta, group=group)


def build_schedule(name: str, stages: list[PipelineStage], n_microbatches: int,
                   loss_fn: Callable) -> PipelineScheduleSingle | PipelineScheduleMulti:
    """The schedule; the loss is already divided by the global target count, so
    gradients are not scaled by the number of micro-batches."""
    cls = get_schedule_class(name)
    if issubclass(cls, PipelineScheduleSingle):
        return cls(stages[0], n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False)
    return cls(stages, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False)


@torch.no_grad()
def forward_only_v(stages: list[PipelineStage], n_microbatches: int, args: tuple, kwargs: dict):
    """Forward-only pass over V-placed stages, whose schedules cannot run eval()
    (torch 2.13 still runs their backward actions). Stage by stage, micro-batch by micro-batch,
    with the stages' own send/receive ops; returns the last stage's logits (else None)."""
    from torch.distributed.pipelining.microbatch import split_args_kwargs_into_chunks
    arg_mbs, kwarg_mbs = split_args_kwargs_into_chunks(args, kwargs, n_microbatches)
    local = {s.stage_index: s for s in stages}
    outputs, sends = [], []
    for stage in sorted(stages, key=lambda s: s.stage_index):
        for mb in range(n_microbatches):
            if not stage.is_first and stage.stage_index - 1 not in local:
                for work in _p2p(stage.get_fwd_recv_ops(mb)):
                    work.wait()
            out = stage.forward_one_chunk(mb, arg_mbs[mb], kwarg_mbs[mb])
            if stage.is_last:
                outputs.append(out)
            elif stage.stage_index + 1 in local:
                local[stage.stage_index + 1].set_local_fwd_input(out, mb)
            else:
                sends += _p2p(stage.get_fwd_send_ops(mb))
    for work in sends:
        work.wait()
    for stage in stages:
        stage.clear_runtime_states()
        for m in stage.submod.modules():
            if hasattr(m, "reshard"):
                m.reshard()
    return torch.cat(outputs) if outputs else None


def _p2p(ops):
    import torch.distributed as dist
    return dist.batch_isend_irecv(ops) if ops else []
