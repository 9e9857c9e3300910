"""Trace a few blocks and replay the step as the model's depth would run it.

Blocks are identical. Blocks 0 and 1 and the last differ from the others (FSDP gathers the
first ahead of time; the last has no next block to prefetch), so the dry run builds each
stage with a few blocks and lets block 2 (with `selective` layer AC, the whole period from
block 2) stand for every block the real model has in between: the tracer replays what that
block did once per such block (titanlite.dryrun.steptrace.StepTracer.result). What it did is:

- its forward and its backward, each from its mark to the next block's (the marks follow
  FSDP's hooks for a block: its unshard, the prefetch of the next one);
- what is done for it elsewhere: FSDP's gathers, frees and gradient reductions when a pipeline
  schedule calls them itself, and the reduction of its partial gradients;
- its share of the whole-model operations after backward (gradient norm, clipping, the
  optimizer step), by the bytes they read from its parameters, gradients and state;
- what it creates that the step frees outside every block's span, at once for all blocks
  (autocast's weight casts; bf16 weight gradients cast back at the end of a backward call).

tests/test_dryrun.py checks the replay against a trace of every block.
"""

from __future__ import annotations

import torch
from torch.distributed.fsdp import FSDPModule

from titanlite.model_spec import ModelSpec
from titanlite.parallel.grad_norm import reduce_partial_grads
from titanlite.dryrun.steptrace import StepTracer, within


def traced_depth(n: int, period: int, full: bool) -> int:
    """The blocks traced: the fewest congruent to n modulo the AC period that hold a period
    other than the first two blocks and the last, or n."""
    k = next(k for k in range(period + 3, 2 * period + 3) if k % period == n % period)
    return n if full else min(k, n)


class BlockWatch:
    """Marks every block of `parts` (their family's blocks: ModelSpec.blocks_of) while a step is
    traced; `replay` then says what the tracer repeats to reach the real depth."""

    def __init__(self, parts: list[torch.nn.Module], spec: ModelSpec, tracer: StepTracer, n_blocks: int, period: int):
        self.tracer, self.period = tracer, period
        self.indices, self.unit, self.elsewhere, self.others, self.handles, self.patched = [], [], [], [], [], []
        self.repeats = n_blocks >= period + 3
        for part in parts:
            blocks = spec.blocks_of(part)
            ids = sorted(int(i) for i in blocks)
            self.indices.append(ids)
            self.handles += [h for i, block in blocks.items() for h in _marks(tracer, block, int(i))]
            if self.repeats:
                self.unit += [blocks[str(ids[j])] for j in range(2, 2 + period)]
            # a pipeline schedule gathers, reduces and frees each stage's FSDP blocks itself:
            # the repeated blocks' calls repeat with them, the others' are no block's own span
            for b in (b for b in blocks.values() if isinstance(b, FSDPModule)):
                spans = self.elsewhere if any(b is u for u in self.unit) else self.others
                for obj, name in [(b, "unshard"), (b, "reshard"), (b._get_fsdp_state()._fsdp_param_group,
                                                                   "post_backward")]:
                    setattr(obj, name, tracer.spanned(getattr(obj, name), spans))
                    self.patched.append((obj, name))

    def reduce_partial_grads(self, params: list) -> None:
        """train.py's partial-gradient reduction, the repeated blocks' own part spanned."""
        mine = [p for b in self.unit for p in b.parameters()]
        self.tracer.spanned(reduce_partial_grads, self.elsewhere)(mine)
        reduce_partial_grads([p for p in params if all(p is not q for q in mine)])

    def close(self) -> None:
        for h in self.handles:
            h.remove()
        for obj, name in self.patched:
            del obj.__dict__[name]

    def replay(self, optimizers) -> dict:
        """StepTracer.result's repeat, unit_state and blocks arguments."""
        m, period = self.tracer.marks, self.period
        # with pipeline stages, one span per micro-batch
        repeat = [pair for ids in self.indices if self.repeats
                  for pair in [*zip(m["forward", ids[2]], m["forward", ids[2 + period]]),
                               *zip(m["backward", ids[1 + period]], m["backward", ids[1]])]]
        repeat += [s for s in self.elsewhere if not any(within(s, r) for r in repeat)]
        # every block's forward and backward, to the next block's; the last forward to the next
        # mark of any kind (what it used dies as its call returns), the first backward to its end
        spans, marked = list(self.others), sorted(c for cs in m.values() for c in cs)
        for ids in self.indices:
            for at, i in enumerate(ids):
                ends = (m["forward", ids[at + 1]] if at + 1 < len(ids) else
                        [next((c for c in marked if c > e), self.tracer.cursor()) for e in m["forward_end", i]])
                spans += [*zip(m["forward", i], ends),
                          *zip(m["backward", i], m["backward", ids[at - 1]] if at else m["backward_end", i])]
        return {"repeat": repeat, "unit_state": _held(self.unit, optimizers), "blocks": spans}


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
