"""Trace a few blocks and replay the step as the model's depth would run it.

A model's blocks come in kinds (a hybrid stack's linear and full attention, DeepSeek-V3's dense
and MoE blocks, gpt-oss's sliding and full windows): a block's kind is its structure (its
modules, their shapes) and its attention window. Blocks 0 and 1 and the last of each stage
differ from the others (FSDP gathers the first ahead of time; the last has no next block to
prefetch), so the dry run builds each stage from a few of the real model's blocks (`select`):
those three, and for every kind of block period in between (one block, or with `selective`
layer AC a whole period of consecutive blocks) one that stands for every period of that kind
the stage runs. The tracer replays what each such unit did once per period of its kind
(titanlite.dryrun.replay.result). What a unit did is:

- its forward and its backward, each from its mark to the next block's (the marks follow
  FSDP's hooks for a block: its unshard, the prefetch of the next one);
- what is done for it elsewhere: FSDP's gathers, frees and gradient reductions when a pipeline
  schedule calls them itself, and the reduction of its partial gradients;
- its share of the whole-model operations after backward (gradient norm, clipping, the
  optimizer step), by the bytes they read from its parameters, gradients and state;
- what it creates that the step frees outside every block's span, at once for all blocks
  (autocast's weight casts; bf16 weight gradients cast back at the end of a backward call).

tests/test_dryrun.py checks the replay against a trace of every block, of one kind and of a
hybrid stack.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule

from titanlite.dryrun.replay import UnitSpans
from titanlite.dryrun.steptrace import StepTracer, within
from titanlite.model_spec import ModelSpec
from titanlite.parallel.grad_norm import reduce_partial_grads
from titanlite.preflight import Plan


@dataclass(frozen=True)
class UnitPlan:
    """A traced block period that stands for `times` periods of its kind in its stage."""

    start: int
    """The shallow model's index of its first block."""
    times: int


@dataclass(frozen=True)
class Selection:
    """Which of the real model's blocks the shallow model traces, and the units it replays."""

    chosen: tuple[int, ...]
    """The real index of each block of the shallow model, in order."""
    units: tuple[UnitPlan, ...]
    period: int
    kinds: dict[str, int]
    """The model's blocks by kind (a name for each: the module types not every block has)."""
    sizes: tuple[int, ...]
    """Blocks traced per pipeline stage (one entry without stages)."""


def block_kinds(spec: ModelSpec, args) -> list[tuple]:
    """Each block's kind: the modules it is built of (their types and shapes) and its window."""
    with torch.device("meta"):
        model = spec.build(args)
    return [(tuple((n, type(m).__name__, m.extra_repr()) for n, m in block.named_modules()), args.window(i))
            for i, block in enumerate(spec.blocks_of(model).values())]


def _kind_name(block: tuple, common: set[str]) -> str:
    """A short name for a kind: its modules' types that not every block has, and its window."""
    modules, window = block
    return ("+".join(sorted({t for _, t, _ in modules} - common)) or "block") + (f" (window {window})" if window else "")


MARGIN = 2
"""Blocks of its own kind a repeated block needs on either side (FSDP's reach, above)."""


def select(plan: Plan, period: int, full: bool) -> Selection:
    """Per stage (the whole model without pipeline stages): blocks 0, 1 and the last; the periods
    of `period` consecutive blocks from block 2 on, one of each kind standing for the others of
    its kind (all of them, each for itself, if `full`); the few blocks left before the last. A
    stage of fewer than period + 3 blocks is traced whole.

    FSDP gathers and reduces the parameters of the blocks around the one that runs (the next in
    forward; in backward up to two before it and the one after), so a repeated block must sit
    between MARGIN blocks of its own kind on either side, or each repeat would gather the wrong
    kind: where the traced neighbours differ, MARGIN more blocks of its kind are traced beside
    it, each counted as itself. A stage with more than one kind under selective layer AC (a
    period of several blocks) is traced whole. Every traced period is a unit
    (titanlite.dryrun.timing), its own or standing for others."""
    kinds = block_kinds(plan.spec, plan.args)
    common = set.intersection(*({t for _, t, _ in modules} for modules, _ in kinds))
    ranges = [(0, plan.args.n_layers)] if plan.stages is None else list(plan.stages.blocks)
    chosen, units, named, sizes = [], [], {}, []
    for kind in kinds:
        named[_kind_name(kind, common)] = named.get(_kind_name(kind, common), 0) + 1
    for a, b in ranges:
        start = len(chosen)
        if b - a < period + 3:
            chosen += range(a, b)
            sizes.append(len(chosen) - start)
            continue
        windows = list(range(a + 2, b - period, period))
        chosen += [a, a + 1]
        classes: dict[tuple, list[int]] = {}
        for w in windows:
            classes.setdefault(tuple(kinds[w:w + period]), []).append(w)
        if full or (len(classes) > 1 and period > 1):  # every period traced as itself
            for w in windows:
                units.append(UnitPlan(len(chosen), 1))
                chosen += range(w, w + period)
        else:
            # the kind whose last period comes last is traced last: the first blocks backward
            # runs (while most activations are held) are of the kinds the model ends with
            order = sorted(classes.items(), key=lambda kv: kv[1][-1])
            tail = [kinds[j] for j in range(windows[-1] + period, b)][:MARGIN]
            for i, (key, ws) in enumerate(order):
                after = [order[i + 1][0][0]] if i + 1 < len(order) else tail
                before = MARGIN * (any(kinds[c] != key[0] for c in chosen[-MARGIN:]))
                after = MARGIN * (any(k != key[0] for k in after))
                if len(ws) <= before + after + 1:  # nothing to repeat: each traced as itself
                    picks = [(w, 1) for w in ws]
                else:
                    picks = ([(w, 1) for w in ws[:before]] + [(ws[before], len(ws) - before - after)]
                             + [(w, 1) for w in ws[len(ws) - after:]])
                for w, times in picks:
                    units.append(UnitPlan(len(chosen), times))
                    chosen += range(w, w + period)
        chosen += range(windows[-1] + period, b)
        sizes.append(len(chosen) - start)
    return Selection(tuple(chosen), tuple(units), period, named, tuple(sizes))


def shallow_plan(plan: Plan, selection: Selection) -> Plan:
    """The plan of a model made of the selected blocks (same schedule, placement and
    micro-batches): its spec builds the real model and keeps those blocks, renumbered."""
    spec, args, chosen = plan.spec, plan.args, selection.chosen

    def build(_args) -> nn.Module:
        model = spec.build(args)
        parent, _, name = spec.blocks.rpartition(".")  # a dotted path (the transformers family's)
        owner = model.get_submodule(parent)
        blocks = getattr(owner, name)
        kept = [blocks[r] if isinstance(blocks, nn.ModuleList) else blocks[str(r)] for r in chosen]
        setattr(owner, name, nn.ModuleList(kept) if isinstance(blocks, nn.ModuleList) else
                nn.ModuleDict({str(j): b for j, b in enumerate(kept)}))
        return model

    shallow = dataclasses.replace(plan, spec=dataclasses.replace(spec, build=build),
                                  args=dataclasses.replace(args, n_layers=len(chosen)))
    if plan.stages is None:
        return shallow
    ends = [sum(selection.sizes[:i + 1]) for i in range(len(selection.sizes))]
    stages = dataclasses.replace(plan.stages, blocks=tuple(zip([0, *ends[:-1]], ends)))
    return dataclasses.replace(shallow, stages=stages)


class BlockWatch:
    """Marks every block of `parts` (their family's blocks: ModelSpec.blocks_of) while a step is
    traced; `replay` then says what the tracer repeats to reach the real depth."""

    def __init__(self, parts: list[torch.nn.Module], spec: ModelSpec, tracer: StepTracer, selection: Selection):
        self.tracer, self.period = tracer, selection.period
        self.handles, self.patched, self.others = [], [], []
        # per unit: the shallow model's index of its first block, its blocks, the spans of what is
        # done for them elsewhere, how many periods of its kind it stands for
        self.units = [(u.start, [], [], u.times) for u in selection.units]
        self.indices = []
        for part in parts:
            blocks = spec.blocks_of(part)
            self.indices.append(sorted(int(i) for i in blocks))
            self.handles += [h for i, block in blocks.items() for h in _marks(tracer, block, int(i))]
            for start, mine, _, _ in self.units:
                mine += [blocks[str(j)] for j in range(start, start + self.period) if str(j) in blocks]
            # a pipeline schedule gathers, reduces and frees each stage's FSDP blocks itself:
            # a unit's calls repeat with it, the others' are no block's own span
            for b in (b for b in blocks.values() if isinstance(b, FSDPModule)):
                spans = next((spans for _, mine, spans, _ in self.units if any(b is u for u in mine)), self.others)
                for obj, name in [(b, "unshard"), (b, "reshard"), (b._get_fsdp_state()._fsdp_param_group,
                                                                   "post_backward")]:
                    setattr(obj, name, tracer.spanned(getattr(obj, name), spans))
                    self.patched.append((obj, name))

    def reduce_partial_grads(self, params: list) -> None:
        """train.py's partial-gradient reduction, each unit's own part spanned."""
        mine = []
        for _, blocks, spans, _ in self.units:
            own = [p for b in blocks for p in b.parameters()]
            self.tracer.spanned(reduce_partial_grads, spans)(own)
            mine += own
        reduce_partial_grads([p for p in params if all(p is not q for q in mine)])

    def close(self) -> None:
        for h in self.handles:
            h.remove()
        for obj, name in self.patched:
            del obj.__dict__[name]

    def replay(self, optimizers) -> dict:
        """titanlite.dryrun.replay.result's units, blocks and compiled arguments."""
        m, period = self.tracer.marks, self.period
        # each unit's forward and backward, one span each per micro-batch with pipeline stages
        own = [[*zip(m["forward", start], m["forward", start + period]),
                *zip(m["backward", start + period - 1], m["backward", start - 1])] for start, *_ in self.units]
        units = []
        for mine, (_, blocks, elsewhere, times) in zip(own, self.units):
            # what is done for it elsewhere: inside its own spans it repeats with them; inside
            # another unit's (its first block's prefetch) it is that unit's in the memory timeline
            others = [r for spans in own if spans is not mine for r in spans]
            calls = [s for s in elsewhere if not any(within(s, r) for r in mine)]
            units.append(UnitSpans(mine + [s for s in calls if not any(within(s, r) for r in others)], times,
                                   _held(blocks, optimizers), [s for s in calls if any(within(s, r) for r in others)]))
        # every block's forward and backward, to the next block's; the last forward to the next
        # mark of any kind (what it used dies as its call returns), the first backward to its end
        spans, compiled, marked = list(self.others), [], sorted(c for cs in m.values() for c in cs)
        for ids in self.indices:
            for at, i in enumerate(ids):
                ends = (m["forward", ids[at + 1]] if at + 1 < len(ids) else
                        [next((c for c in marked if c > e), self.tracer.cursor()) for e in m["forward_end", i]])
                backward = [*zip(m["backward", i], m["backward", ids[at - 1]] if at else m["backward_end", i])]
                spans += [*zip(m["forward", i], ends), *backward]
                # what a compiled block runs: its forward to its end, its backward
                compiled += [*zip(m["forward", i], m["forward_end", i]), *backward]
        return {"units": units, "blocks": spans, "compiled": compiled}


def _marks(tracer: StepTracer, block: torch.nn.Module, i: int) -> list:
    """Hooks marking where block i's forward starts and ends, and where its backward starts
    (its output's gradient arrives) and ends (its input's); they follow FSDP's own hooks."""
    def before(mod, args):
        tracer.mark(("forward", i))
        if args and isinstance(args[0], torch.Tensor) and args[0].requires_grad:
            args[0].register_hook(lambda grad: tracer.mark(("backward_end", i)))

    def after(mod, args, out):
        tracer.mark(("forward_end", i))
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(lambda grad: tracer.mark(("backward", i)))
    return [block.register_forward_pre_hook(before), block.register_forward_hook(after)]


def _held(blocks: list, optimizers) -> list[torch.Tensor]:
    """The blocks' parameters, gradients, optimizer state and buffers."""
    return [*(x for b in blocks for p in b.parameters() for x in [p, *([p.grad] if p.grad is not None else []),
              *(v for opt in optimizers.optimizers for k, v in opt.state.get(p, {}).items() if k != "step")]),
            *(x for b in blocks for x in b.buffers())]
