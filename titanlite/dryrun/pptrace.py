"""Trace a pipeline schedule's step without running every micro-batch.

A pipeline stage does the same work for each micro-batch, except the first (FSDP gathers the
stage's parameters, gradients are created) and the last (gradients are reduced). The dry run
therefore runs three micro-batches per stage for real, the first, the second and the last,
and lets the real schedule walk the others in its own order: their forward, loss and backward
calls are skipped, and the tracer counts a copy of what the second micro-batch's same call
logged (memory, operations, collectives) at the point where the call would have run. The
schedule's sends and receives still run for every micro-batch, on stand-in tensors of the
right shape that hold no counted memory.

So memory is replayed with the schedule's real order (how many micro-batches each stage has
in flight at once), and the step's work and traffic are counted in full, at the cost of three
micro-batches per stage. tests/test_dryrun.py checks it against running every micro-batch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import weakref

import torch
from torch.autograd.graph import GradientEdge

from titanlite.dryrun.steptrace import StepTracer

GENERIC = 1
"""The micro-batch whose calls stand in for the skipped ones: neither a stage's first nor its last."""

# Schedules whose replay equals a trace of every micro-batch (tests/test_dryrun.py). The others
# are traced in full: LoopedBFS runs backward from the last micro-batch, so micro-batch 1's calls
# come after those they stand for; the zero-bubble and V schedules split backward in two, and
# the autograd graph kept between the halves holds memory no stand-in can mirror.
REPLAYED = ("ScheduleGPipe", "Schedule1F1B", "ScheduleInterleaved1F1B")


def skip_microbatches(schedule, stages: list, tracer: StepTracer, n_microbatches: int) -> None:
    """Patch `schedule` and its `stages` (torch.distributed.pipelining objects) so that only
    micro-batches 0, 1 and n - 1 run; the others are counted as copies of micro-batch 1."""
    real = {0, GENERIC, n_microbatches - 1}
    if len(real) == n_microbatches or type(schedule).__name__ not in REPLAYED:
        return
    # call key -> stand-ins for what micro-batch 1's call left behind, and their originals'
    # storage ids (holding the originals themselves would keep them alive)
    templates = {}

    def remember(key, x) -> None:
        ghosts = _once(x, tracer.ghost)
        pairs = zip(_tensors(ghosts), _tensors(x), strict=True)
        templates[key] = (ghosts, {id(g): tracer.storage_id(t) for g, t in pairs})

    def stand_in(key):
        """Fresh stand-ins for micro-batch 1's results, each freeing what its original held."""
        ghosts, originals = templates[key]
        return _once(ghosts, lambda g: tracer.ghost(g, originals[id(g)]))

    # torch 2.15 allocates a receive buffer per micro-batch (older torch keeps one per micro-batch
    # for good), which a skipped call takes from the stage as the real one would: autograd holds
    # received activations as leaves, on the last stage until the step drops its losses,
    # elsewhere until the backward; a received gradient lives through the backward. Each
    # micro-batch's buffers are its own: copies of micro-batch 1 leave its buffers out
    received = {}

    def uncopied(run, mb):
        out = run(mb)
        if mb == GENERIC:
            for t in _tensors(out):
                tracer.uncopied(t)
        return out

    for stage in stages:
        s = stage.stage_index

        def forward(run, mb, *args, stage=stage, s=s, **kwargs):
            if mb in real:
                with tracer.span(("forward", s)) if mb == GENERIC else contextlib.nullcontext():
                    out = run(mb, *args, **kwargs)
                if mb == GENERIC:
                    remember(("forward", s), (out, forward_record(stage, mb)))
                return out
            tracer.copy(("forward", s))
            if not stage.is_first:
                received[s, mb] = _tensors(stage._retrieve_recv_activations(mb))
            out, forward_records(stage)[mb] = stand_in(("forward", s))
            return out

        def backward(run, mb, *args, stage=stage, s=s, last_backward=False, full_backward=True, **kwargs):
            key = ("backward", s, full_backward)
            if mb in real:
                with tracer.span(key) if mb == GENERIC else contextlib.nullcontext():
                    run(mb, *args, last_backward=last_backward, full_backward=full_backward, **kwargs)
                if mb == GENERIC:
                    remember(key, stage.bwd_cache.get(mb))
                return
            _skippable(mb, last_backward, s)
            tracer.copy(key)
            forward_records(stage).pop(mb)
            if not stage.is_last:
                received.pop((s, mb), None)
                stage._retrieve_recv_grads(mb)
            if templates[key][0] is not None:  # the first stage has no input gradient to send
                stage.bwd_cache[mb] = stand_in(key)

        def weight(run, mb, last_backward=False, s=s):
            if mb in real:
                with tracer.span(("weight", s)) if mb == GENERIC else contextlib.nullcontext():
                    return run(mb, last_backward=last_backward)
            _skippable(mb, last_backward, s)
            tracer.copy(("weight", s))

        stage.forward_one_chunk = functools.partial(forward, stage.forward_one_chunk)
        for name in ("_retrieve_recv_activations", "_retrieve_recv_grads"):
            setattr(stage, name, functools.partial(uncopied, getattr(stage, name)))
        stage.backward_one_chunk = functools.partial(backward, stage.backward_one_chunk)
        stage.backward_weight_one_chunk = functools.partial(weight, stage.backward_weight_one_chunk)

    def loss(run, stage, output, target_mbs, mb, *args):
        s = stage.stage_index
        if mb in real:
            with tracer.span(("loss", s)) if mb == GENERIC else contextlib.nullcontext():
                run(stage, output, target_mbs, mb, *args)
            if mb == GENERIC and stage.is_last:
                remember(("loss", s), schedule._internal_losses[-1])
            return
        if stage.is_last:
            tracer.copy(("loss", s))
            ghost = stand_in(("loss", s))
            weakref.finalize(ghost, list.clear, received.pop((s, mb), []))
            schedule._internal_losses.append(ghost)  # the list is indexed by micro-batch

    schedule._maybe_compute_loss = functools.partial(loss, schedule._maybe_compute_loss)


def _skippable(mb: int, last_backward: bool, stage: int) -> None:
    if last_backward:  # the gradient reduction must run for real
        raise RuntimeError(f"stage {stage}'s last backward is micro-batch {mb}, which the dry run skips")


# The one private attribute of torch.distributed.pipelining the replay needs: a stage's record of
# each micro-batch's forward (its outputs, to send, and its inputs, for backward), which a skipped
# forward must fill with stand-ins. It is `fwd_cache` (a tuple per micro-batch) up to torch 2.14
# and `_forward_chunk_states` (a dataclass per micro-batch) from 2.15.
_RECORDS = ("fwd_cache", "_forward_chunk_states")


def forward_records(stage) -> dict:
    """The stage's per-micro-batch forward records, or one line naming this torch if unknown."""
    for name in _RECORDS:
        records = getattr(stage, name, None)
        if isinstance(records, dict):
            return records
    raise RuntimeError(f"the dry run's pipeline replay does not know torch {torch.__version__}'s PipelineStage "
                       f"(no {' or '.join(_RECORDS)}); run it with --full, or with a torch in pyproject's range")


def forward_record(stage, mb: int):
    record = forward_records(stage).get(mb)
    if not (isinstance(record, tuple) or dataclasses.is_dataclass(record)):
        raise RuntimeError(f"the dry run's pipeline replay cannot read torch {torch.__version__}'s forward record "
                           f"of micro-batch {mb} ({type(record).__name__}); run it with --full")
    return record


def _once(x, fn):
    """`x` with `fn` applied to each tensor in it, once per distinct tensor (an output is also
    recorded for backward: one stand-in for both); containers and dataclasses are rebuilt, and
    autograd edges dropped (a stand-in is never differentiated, and must not keep micro-batch
    1's graph alive)."""
    return _walk(x, fn, {})


def _walk(v, fn, memo: dict):
    # a module-level function, not a closure over itself: a cycle through its cell would keep
    # the memo's tensors alive until the garbage collector runs, at a point no trace can predict
    if isinstance(v, torch.Tensor):
        if id(v) not in memo:
            memo[id(v)] = fn(v)
        return memo[id(v)]
    if isinstance(v, GradientEdge):
        return None
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return dataclasses.replace(v, **{f.name: _walk(getattr(v, f.name), fn, memo) for f in dataclasses.fields(v)})
    if isinstance(v, tuple) and hasattr(v, "_fields"):
        return type(v)(*(_walk(x, fn, memo) for x in v))
    if isinstance(v, (list, tuple)):
        return type(v)(_walk(x, fn, memo) for x in v)
    if isinstance(v, dict):
        return {k: _walk(x, fn, memo) for k, x in v.items()}
    return v


def _tensors(x) -> list[torch.Tensor]:
    out = []
    _once(x, out.append)
    return out
