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

import contextlib
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.microbatch import split_args_kwargs_into_chunks
from torch.distributed.pipelining.schedules import (PipelineScheduleMulti, PipelineScheduleSingle,
                                                    get_schedule_class)

from titanlite.layers.attention import AttnSetup
from titanlite.config.job import CHOICES, Parallelism
from titanlite.errors import ConfigError
from titanlite.data.packing import IGNORE_INDEX
from titanlite.loss import ExtraLosses, LossFn, loss_context, token_logprobs
from titanlite.model_spec import Elsewhere, ModelSpec
from titanlite.parallel.apply import ParallelizeOptions
from titanlite.parallel.mesh import Meshes, ParallelDims
from titanlite.step import Batch, StepOutput, count_targets

SCHEDULES = CHOICES["parallelism.pipeline_parallel_schedule"]
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
    tied: tuple[tuple[str, ...], ...] = ()
    """Names of each weight the whole model shares between modules (a tied embedding)."""

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


def tied_names(model: nn.Module) -> tuple[tuple[str, ...], ...]:
    """The names of each parameter the model shares between modules (a tied embedding)."""
    shared: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        shared.setdefault(id(p), []).append(name)
    return tuple(tuple(names) for names in shared.values() if len(names) > 1)


def cut(model: nn.Module, spec: ModelSpec, start: int, stop: int, is_first: bool, is_last: bool) -> nn.Module:
    """Keep blocks [start, stop) of `model` in place; parameter names are unchanged."""
    kept = (spec.blocks, *spec.pre, *spec.post)
    # every stage would hold its own untied copy of these, trained on that stage's gradients alone
    stray = [n for n, _ in model.named_parameters() if not any(n.startswith(k + ".") for k in kept)]
    if stray:
        raise ConfigError(f"parallelism.pipeline_parallel_degree > 1: {spec.name}'s {_outside(stray[0], kept)} is in "
                          f"no pipeline stage's list; add it to ModelSpec.pre (runs before the blocks) or post "
                          f"(after them) in models/{spec.name}/__init__.py")
    for name in (spec.pre if not is_first else ()) + (spec.post if not is_last else ()):
        model.set_submodule(name, nn.Identity())
    blocks = model.get_submodule(spec.blocks)
    for key in [k for k, _ in blocks.named_children() if not start <= int(k) < stop]:
        if isinstance(blocks, nn.ModuleDict):
            del blocks[key]
        else:  # a list keeps its length: the model's forward may pick each block's inputs by its index
            blocks[int(key)] = Elsewhere()
    return model


def _outside(name: str, kept: tuple[str, ...]) -> str:
    """The outermost module holding parameter `name` that no kept path runs through, or the
    parameter itself when its owner is such a path's parent (the model, a base model)."""
    parents = {k.rsplit(".", i)[0] for k in kept for i in range(1, k.count(".") + 1)}
    owner = name.rpartition(".")[0].split(".") if "." in name else []
    for i in range(1, len(owner) + 1):
        if ".".join(owner[:i]) not in parents:
            return f"module '{'.'.join(owner[:i])}'"
    return f"parameter '{name}' (hold it in a module of its own)"


def stage_modules(spec: ModelSpec, args, stages: StagePlan, meshes: Meshes) -> list[nn.Module]:
    """This rank's stages, each cut from its own whole model (build on meta), FQNs unchanged;
    every parameter's value depends only on its name, so a stage initialises as the whole model would."""
    return [cut(spec.build(args), spec, *stages.blocks[s], s == 0, s == stages.n_stages - 1)
            for s in stages.stages_of(meshes.pp.get_local_rank(), meshes.dims.pp)]


def _to_context(attn: AttnSetup) -> Callable:
    """A forward pre-hook: a stage is called as part(x, positions=..., document_ids=...) (the
    schedule chunks keyword tensors along the batch, for every stage); the model wants part(x, ctx)."""
    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        x = args[0]
        return (x, attn.context(kwargs.get("positions"), kwargs.get("document_ids"), seq_len=x.shape[1],
                            device=x.device, tokens=kwargs.get("tokens"))), {}
    return hook


@dataclass(frozen=True)
class StageShapes:
    """Per-rank shapes of one pipeline micro-batch: the first stage's tokens, the hidden states
    between stages, the last stage's logits; stages are built with them (static shapes)."""

    tokens: tuple[int, ...]
    hidden: tuple[int, ...]
    logits: tuple[int, ...]
    hidden_dtype: torch.dtype
    logits_dtype: torch.dtype


def stage_shapes(spec: ModelSpec, args, microbatch_size: int, seq_len: int, dims: ParallelDims,
                 opts: ParallelizeOptions) -> StageShapes:
    """Found by running the model's first and last parts, with no block between them, on meta
    tensors, so a family declares nothing more (blocks keep the residual stream's shape, and
    none runs: a mixture-of-experts block would route by values meta tensors do not hold)."""
    with torch.device("meta"), torch.no_grad():  # no grad: training-only extras (MTP) stay out
        tokens = torch.zeros(microbatch_size, seq_len // dims.cp, dtype=torch.long)
        logits = cut(spec.build(replace(args, n_layers=1)), spec, 0, 0, True, True)(tokens)
        hidden = cut(spec.build(replace(args, n_layers=1)), spec, 0, 0, True, False)(tokens)
    rows, seq, dim = hidden.shape
    if dims.tp > 1 and opts.sequence_parallel:
        seq //= dims.tp  # the residual stream is sharded on the sequence between blocks
    # FSDP computes in its parameter dtype; autocast keeps the residual stream in float32, and
    # either gives the output layer's logits in the parameter dtype
    dtype = opts.param_dtype if dims.fsdp else torch.float32
    return StageShapes(tuple(tokens.shape), (rows, seq, dim), tuple(logits.shape), dtype, opts.param_dtype)


@dataclass
class PipelineStep:
    """The step seam over pipeline stages: each micro-batch of the step (gradient accumulation)
    is one run of the schedule, which cuts it into pipeline micro-batches. The last stage's
    loss is each pipeline micro-batch's summed token loss over the step's global target count,
    as in PlainStep, so gradients need no scaling by the micro-batch count."""

    parts: list[nn.Module]
    plan: StagePlan
    schedule_name: str
    meshes: Meshes
    loss_fn: LossFn
    opts: ParallelizeOptions
    attn: AttnSetup
    """The model's attention setup (backend, windows, cp), which makes each micro-batch's context."""
    autocast: contextlib.AbstractContextManager
    device: torch.device
    shapes: StageShapes

    def __post_init__(self) -> None:
        ids = self.plan.stages_of(self.meshes.pp.get_local_rank(), self.meshes.dims.pp)
        self.is_first, self.is_last = 0 in ids, self.plan.n_stages - 1 in ids
        self.stages = [self._stage(part, s) for part, s in zip(self.parts, ids)]
        self.schedule = self._schedule()
        self._tie(ids)
        self._sums: list[torch.Tensor] = []
        self._n_targets: torch.Tensor | None = None
        self._ran = False  # the schedule has set its stages up (its first run does)
        self.extra = ExtraLosses()
        self.extra.bind(self.parts)

    def _stage(self, part: nn.Module, s: int) -> PipelineStage:
        sh = self.shapes
        # static shapes: no shape inference, which on torch 2.13 runs a real forward and backward
        # (the loss included) before the first step; a received input must require grad, or
        # the previous stage gets no gradient back
        hidden = torch.empty(sh.hidden, dtype=sh.hidden_dtype, device="meta", requires_grad=True)
        inp = torch.empty(sh.tokens, dtype=torch.long, device="meta") if s == 0 else hidden
        # the last stage's declared logits carry their real dtype: torch 2.11 checks it against the output
        out = torch.empty(sh.logits, dtype=sh.logits_dtype, device="meta") if s == self.plan.n_stages - 1 else hidden
        part.register_forward_pre_hook(_to_context(self.attn), with_kwargs=True)
        stage = PipelineStage(part, s, self.plan.n_stages, self.device, input_args=inp, output_args=out,
                              group=self.meshes.pp.get_group())
        _skip_links_to_self(stage)
        return stage

    def _tie(self, ids: list[int]) -> None:
        """Tied weights (an embedding shared with the output layer) live on the first and the
        last stage as two copies that start equal; their gradients are summed after each step,
        so the same optimizer update keeps them equal. `mirrors` are the copies past the first
        stage, which the gradient norm must not count again. Both copies have one layout (the
        stages share dp, cp and tp), so the local shards add up."""
        # a frozen shared weight (LoRA's base) has no gradients to sum
        self.copies = [[part.get_parameter(n) for part in self.parts for n in names
                        if n in dict(part.named_parameters()) and part.get_parameter(n).requires_grad]
                       for names in self.plan.tied]
        first = self.parts[ids.index(0)] if 0 in ids else None
        self.mirrors = tuple(p for copies in self.copies for p in copies
                             if first is None or all(p is not q for q in first.parameters()))
        # first and last stage on different ranks (loop placement): one group per pair (with two
        # stages, the pp groups); under a V both sit on pp rank 0 and add up locally
        self.tie_group = None
        if self.plan.tied and self.plan.style == "loop":
            per = dist.get_world_size() // self.meshes.dims.pp
            self.tie_group = self.meshes.groups.of(tuple((c, (self.meshes.dims.pp - 1) * per + c) for c in range(per)))

    @torch.no_grad()
    def _sum_tied_grads(self) -> None:
        for copies in self.copies:
            if not copies:
                continue
            local = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in copies]
            total = torch.stack(local).sum(0) if len(local) > 1 else local[0].clone()
            if self.tie_group is not None:
                dist.all_reduce(total, group=self.tie_group)
            for g in local:
                g.copy_(total)

    def _schedule(self) -> PipelineScheduleSingle | PipelineScheduleMulti:
        cls = get_schedule_class(self.schedule_name)
        stages = self.stages if issubclass(cls, PipelineScheduleMulti) else self.stages[0]
        # the loss is already over the global target count: no division by the micro-batch count
        return cls(stages, n_microbatches=self.plan.n_microbatches, loss_fn=self._loss, scale_grads=False)

    def _loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():  # the schedule's own forward-only run (_first_forward): not the step's
            return logits.new_zeros(())
        loss = self.loss_fn(logits, labels, self.extra)
        self._sums.append(loss.detach())
        return loss / self._n_targets

    def _inputs(self, batch: Batch) -> tuple[tuple, dict]:
        """Positional inputs (the first stage's tokens) and the keyword tensors every stage gets,
        [batch, ...] so the schedule can cut them into micro-batches."""
        rows, seq = batch["input_ids"].shape
        # explicit positions: a later stage sees hidden states, sequence-sharded under sequence
        # parallel, whose length is not the sequence's
        batch = {"positions": torch.arange(seq, device=batch["input_ids"].device)[None], **batch}
        kwargs = {k: batch[k].expand(rows, -1) for k in ("positions", "document_ids") if k in batch}
        kwargs["tokens"] = batch["input_ids"]  # every stage: a last stage's multi-token prediction reads them
        return ((batch["input_ids"],) if self.is_first else ()), kwargs

    def __call__(self, batches: list[Batch]) -> StepOutput:
        self._n_targets = count_targets(batches, self.meshes.dp_cp.get_group())
        self._sums.clear()
        with self.extra.collect(self._n_targets) as extra:
            for batch in batches:
                args, kwargs = self._inputs(batch)
                with loss_context(self.opts.loss_parallel), self.autocast, self._compile_options():
                    self.schedule.step(*args, target=batch["labels"] if self.is_last else None,
                                       return_outputs=False, **kwargs)
        self._ran = True
        self._sum_tied_grads()
        zero = torch.zeros((), device=self._n_targets.device)
        return StepOutput(torch.stack(self._sums).sum() if self._sums else zero, self._n_targets, extra)

    def _compile_options(self) -> contextlib.AbstractContextManager:
        """Split-backward schedules' weight-gradient pass reuses the graph their input-gradient
        pass kept, which a compiled backward refuses while it donates its buffers: blocks
        compile (on the first step) with donation off, set for the step alone."""
        if self.opts.compile.enable and self.schedule_name in SPLIT_BACKWARD:
            return torch._functorch.config.patch(donated_buffer=False)
        return contextlib.nullcontext()

    def eval_loss_sum(self, batch: Batch) -> torch.Tensor:
        args, kwargs = self._inputs(batch)
        with loss_context(self.opts.loss_parallel), self.autocast:
            logits = (forward_only(self.stages, self.plan.n_microbatches, args, kwargs) if self._ran
                      else self._first_forward(args, kwargs, batch["labels"]))
            if logits is None:
                return torch.zeros((), device=batch["labels"].device)
            return self.loss_fn(logits, batch["labels"])

    def eval_logprobs(self, batch: Batch) -> torch.Tensor:
        """Each label's log-probability (titanlite.loss.token_logprobs) of a prepared batch, forward
        only through the stages, on the last stage's ranks; zeros on the others, whose sums the
        in-loop evaluation's all-reduce over the pipeline ranks (titanlite.eval.score) adds to
        the last stage's. The stages take training.local_batch_size rows (static shapes): the
        batch runs in pieces of that many, the last one filled with row 0 and no labels."""
        return self.eval_rows(batch, token_logprobs, torch.float32)

    def eval_rows(self, batch: Batch, fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                  dtype: torch.dtype) -> torch.Tensor:
        """fn(logits, labels) of a prepared batch as eval_logprobs runs it ([rows, seq] of `dtype`,
        zeros off the last stage): token_logprobs there, greedy tokens for exact match."""
        labels = batch["labels"]
        rows, size = labels.shape[0], self.plan.n_microbatches * self.shapes.tokens[0]
        out = torch.zeros(labels.shape, dtype=dtype, device=labels.device)
        for start in range(0, rows, size):
            n = min(size, rows - start)
            piece = {k: _rows(v, start, n, size, k == "labels") if v.shape[0] == rows else v for k, v in batch.items()}
            args, kwargs = self._inputs(piece)
            with loss_context(self.opts.loss_parallel), self.autocast:
                logits = forward_only(self.stages, self.plan.n_microbatches, args, kwargs)
                if logits is not None:
                    out[start:start + n] = fn(logits, piece["labels"])[:n]
        return out

    @torch.no_grad()
    def _first_forward(self, args: tuple, kwargs: dict, labels: torch.Tensor) -> torch.Tensor | None:
        """A forward-only pass before the schedule's first step (a preference run's reference pass),
        whose stages forward_only cannot run yet: the schedule sets them up in its first run, here
        its own forward-only one (eval). The last stage's logits, else None."""
        logits = self.schedule.eval(*args, target=labels if self.is_last else None, **kwargs)
        self._ran = True
        for stage in self.stages:
            _trainable_receives(stage)
            for module in stage.submod.modules():
                if isinstance(module, FSDPModule):  # as forward_only leaves them
                    module.reshard()
        return logits if self.is_last else None


def _rows(x: torch.Tensor, start: int, n: int, size: int, labels: bool) -> torch.Tensor:
    """Rows start .. start + n of x, then row 0 again up to `size` rows (labels: none scored)."""
    fill = x[:1].expand(size - n, *x.shape[1:])
    return torch.cat([x[start:start + n], torch.full_like(fill, IGNORE_INDEX) if labels else fill])


def _trainable_receives(stage: PipelineStage) -> None:
    """torch 2.11 makes a stage's receive buffers in the schedule's first run and has them require
    grad only if that run has a backward: after a forward-only first run (eval) they never do, and
    the previous stage gets no gradient back. They are made to, as a first training run would
    (private: torch has no public way); newer torch (2.15, whose buffers have take_buffer) decides
    per run and is left alone."""
    for infos in getattr(stage, "args_recv_info", {}).values():
        for info in infos:
            if isinstance(getattr(info, "buffer", None), torch.Tensor) and not hasattr(info, "take_buffer"):
                info.buffer.requires_grad_(True)


class _Scale(torch.autograd.Function):
    """x * w as a custom autograd function: a compiled block's backward is one of these."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        return x * w

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, w = ctx.saved_tensors
        return g * w, g * x


@functools.cache
def split_backward_through_custom_functions() -> bool:
    """Whether torch's split backward (input gradients, the stage output dropped, then weight
    gradients: the zero-bubble schedules) gets through a custom autograd function, as a
    compiled block is. torch 2.11's weight pass keeps only the Python handles of the nodes it
    resumes from, and a custom function's handle dies with the graph above it (its weight pass
    then fails reading the node); found by running it on two numbers."""
    # private (torch has no public split backward); imported here so that only this check needs it
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    x, w = torch.full((2,), 3.0, requires_grad=True), torch.ones(2, requires_grad=True)
    out = _Scale.apply(x * 1, w) * 1
    _, groups = stage_backward_input([out], [torch.ones(2)], [x], iter([w]))
    del out
    try:
        stage_backward_weight(iter([w]), groups)
    except RuntimeError:
        return False
    return w.grad is not None and torch.equal(w.grad, x.detach())


def _skip_links_to_self(stage: PipelineStage) -> None:
    """torch 2.11's multi-stage schedules open each stage's links to its neighbour stages with one
    batch of sends and receives (`_get_init_p2p_neighbors_ops`) before the first step, the link
    between two stages on the same rank (the middle of a V) included, which gloo cannot connect
    to itself. Such a link never carries anything (the rank hands activations over locally), so
    it is left out; a torch without that method (newer ones) opens its links its own way."""
    ops = getattr(stage, "_get_init_p2p_neighbors_ops", None)
    if ops is not None:
        stage._get_init_p2p_neighbors_ops = lambda: [op for op in ops() if op.group_peer != stage.group_rank]


@torch.no_grad()
def forward_only(stages: list[PipelineStage], n_microbatches: int, args: tuple,
                 kwargs: dict) -> torch.Tensor | None:
    """Forward only through this rank's stages (validation), with the stages' own send and
    receive ops: stage by stage, micro-batch by micro-batch. Returns the last stage's logits,
    else None. The schedules' eval() is not used: on torch 2.13 the V schedules still run their
    backward actions there and fail."""
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
                # waited at the end: a rank blocked on a send while its peer blocks on its own deadlocks
                sends += _p2p(stage.get_fwd_send_ops(mb))
    for work in sends:
        work.wait()
    for stage in stages:
        stage.clear_runtime_states()
        # multi-stage schedules gather and free FSDP parameters themselves; leave them sharded
        for module in stage.submod.modules():
            if isinstance(module, FSDPModule):
                module.reshard()
    return torch.cat(outputs) if outputs else None


def _p2p(ops: list[dist.P2POp]) -> list[dist.Work]:
    return dist.batch_isend_irecv(ops) if ops else []
