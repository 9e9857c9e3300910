"""The traced step replayed at the model's depth: memory peaks by category, the work and traffic
of the whole step and of each block unit, eager and as compiled blocks run it.

titanlite.dryrun.steptrace logs one step of a shallow model (every storage's allocations and
frees, each op's FLOPs and bytes, each collective); titanlite.dryrun.blocktrace says which spans
of that log are units (a block period of one kind) and how often the real model runs each.
`result` replays the log with each unit repeated, and each storage in its final category.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field, replace

import torch
from torch.distributed.tensor import DTensor

from titanlite.dryrun.steptrace import CATEGORIES, PHASES, Comm, StepTracer, _covered, within


@dataclass
class UnitSpans:
    """What a traced unit (a block period of one kind) did, for `result`."""

    spans: list[tuple]
    times: int
    state: list[torch.Tensor]
    nested: list[tuple] = field(default_factory=list)


@dataclass
class Trace:
    """What one traced step did on this rank."""

    peaks: dict[str, dict[str, int]]
    """phase -> category -> bytes live at that phase's peak, plus "total"."""
    comms: list[Comm]
    flops: int
    ops: list[tuple] = field(repr=False)
    """(FLOPs, bytes read + written, class, kernels) per compute op (titanlite.dryrun.timing)."""
    units: list[tuple[int, list[tuple], list[tuple], list[Comm]]] = field(repr=False)
    """Per unit (a block period of one kind, titanlite.dryrun.blocktrace): the times the step
    runs it, and what one instance adds to the step (every micro-batch): its ops eager and
    compiled, its collectives."""
    copied: int = 0
    """Calls the step skipped and counted as copies of another (titanlite.dryrun.pptrace)."""
    compiled_peaks: dict[str, dict[str, int]] | None = None
    """The peaks as compiled blocks hold them (_recomputed)."""
    block_ops: list[tuple] = field(default_factory=list, repr=False)
    """The ops of every block at the model's depth, as eager runs them and as compiled blocks
    run them (_fused)."""
    compiled_block_ops: list[tuple] = field(default_factory=list, repr=False)
    eval_transient: int | None = None
    """An in-loop evaluation's forward: the most it holds beyond what stays between steps
    (titanlite.dryrun.evaltrace); None where the job has no [eval] tasks."""


def result(t: StepTracer, params, grads, optim_state, units: list[UnitSpans] = (), blocks: list[tuple] = (),
           compiled: list[tuple] = ()) -> Trace:
    """Replay the step with each storage's final category; call before the step's tensors die.

    A deeper model's step is replayed from this one: its extra blocks do what a traced unit
    (a block period of one kind) already did here (titanlite.dryrun.blocktrace). For each unit:
    - each (start, end) span of `spans` (cursors: the period's forward or backward, or what
      is done for it elsewhere, as FSDP's gathers and gradient reductions under a pipeline
      schedule) counts `times` times; its `nested` spans (its calls inside another unit's
      span: FSDP's prefetch of its first block) count its `times` in the work and traffic,
      and the enclosing unit's in the memory timeline;
    - its own `state` (parameters, gradients, buffers, optimizer state) is held from the
      start times - 1 more times;
    - outside every block's span (`blocks`: each block's forward and backward), what its
      spans created is freed `times` times where it is freed once (a cache of every
      block's tensors emptied at once: autocast's weight casts, the weight gradients autograd
      casts back at the end of a backward call), and each op and collective there counts
      its share in the unit's storages times - 1 more times (the end of a backward call;
      gradient norm, clipping, the optimizer step). What the next block's span frees (the
      block's output, say) is the next repeat's, as it stands.
    One instance of each is the step's work per unit (Trace.units). The peaks are replayed a
    second time as compiled blocks hold them (`compiled`: the blocks' forward spans)."""
    def ids(ts):
        return {t._id(x.to_local() if isinstance(x, DTensor) else x) for x in ts}
    final = [("optimizer", ids(optim_state)), ("gradients", ids(grads)), ("parameters", ids(params)),
             ("collectives", t.resized), ("activations", t.saved), ("collectives", t.comm_touched)]

    def category(sid: int) -> str:
        return next((name for name, s in final if sid in s), "temporaries")

    owned = [ids(u.state) for u in units]
    more = {sid: u.times - 1 for u, own in zip(units, owned) for sid in own}
    live = defaultdict(int)
    for sid, n in t._initial.items():
        live[category(sid)] += n * (1 + more.get(sid, 0))
    peaks = {p: {**live, "total": sum(live.values())} for p in PHASES}
    repeat = sorted((a, b, u.times, i) for i, u in enumerate(units) for a, b in u.spans)
    nested = sorted((a, b, u.times, i) for i, u in enumerate(units) for a, b in u.nested)
    used = set()

    # a copied span's result the schedule holds dies with its stand-in, unless alive at the end (as the copies')
    inside = defaultdict(int)
    for (a, _, _), (b, _, _), _ in t.spans.values():
        for _, sid, delta in t.log[a:b]:
            inside[sid] += delta or 0
    resolved = [e if e[2] is not None else (e[0], e[1], -max(inside[e[1]], 0) if t.sizes[e[1]] == 0 else 0)
                for e in t.log]
    born = [set() for _ in units]
    for a, b, _, i in repeat:
        born[i] |= {sid for _, sid, delta in t.log[a[0]:b[0]] if delta and delta > 0}
    born_times = {sid: units[i].times for i, sids in enumerate(born) for sid in sids}
    spans = [*((a, b) for a, b, _, _ in repeat), *blocks]
    covered = _covered(spans, 0, len(resolved))
    for i, (phase, sid, delta) in enumerate(resolved):
        if delta < 0 and sid in born_times and not covered[i]:
            resolved[i] = (phase, sid, delta * born_times[sid])
    # each op and collective outside the spans with each unit's share in it (0: none), and
    # as it counts in the deeper step
    op_shares, comm_shares = [], []
    for own, new in zip(owned, born):
        op_part, comm_part = _shares(t, own | new, spans)
        op_shares.append([(f * p, n * p, c, p) for (f, n, c, _), p in zip(t.ops, op_part)])
        comm_shares.append([(key, n * p, int(p == 1)) for (key, n), p in zip(t.comm_log, comm_part)])
    extra = [u.times - 1 for u in units]
    ops = [(f + sum(m * s[j][0] for m, s in zip(extra, op_shares)), n + sum(m * s[j][1] for m, s in zip(extra, op_shares)),
            c, k + sum(m * s[j][3] for m, s in zip(extra, op_shares))) for j, (f, n, c, k) in enumerate(t.ops)]
    comms = [(key, n + sum(m * s[j][1] for m, s in zip(extra, comm_shares)),
              1 + sum(m * s[j][2] for m, s in zip(extra, comm_shares))) for j, (key, n) in enumerate(t.comm_log)]
    # the ops inside every block's spans (the ones a compiled block runs fused), the rest zero
    inblock = _covered(list(compiled), 1, len(t.ops))
    params_ids = ids(params)
    fused = _fused(t, list(compiled), t.saved - _recomputed(t, params_ids, compiled))
    block_ops = [op if inblock[j] else (0, 0, op[2], 0) for j, op in enumerate(ops)]
    compiled_ops = [fused.get(j, op) if inblock[j] else (0, 0, op[2], 0) for j, op in enumerate(ops)]
    lists = (resolved, ops, comms, block_ops, compiled_ops, *op_shares, *comm_shares)
    where = (0, 1, 2, 1, 1, *[1] * len(units), *[2] * len(units))
    unit_ops, unit_comms = [[] for _ in units], [[] for _ in units]
    unit_compiled = [[] for _ in units]

    def piece(seq: list, i: int, start: tuple, end: tuple, times: int) -> list:
        """seq over a repeated span: `times` copies; in the work and traffic (i > 0) each
        nested span of another unit inside it at that unit's times."""
        if i == 0:
            return seq[start[i]:end[i]] * times
        out, at = [], start[i]
        for a, b, tv, _ in nested:
            if within((a, b), (start, end)):
                out += seq[at:a[i]] * times + seq[a[i]:b[i]] * tv
                at = b[i]
        return out + seq[at:end[i]] * times

    def expand(a: tuple, b: tuple) -> tuple[list, ...]:
        """The log, ops, collectives and their shares from cursor a to b, each repeated span
        in it `times` times."""
        out = tuple([] for _ in lists)
        for start, end, times, u in repeat:
            if within((start, end), (a, b)):
                for o, seq, i in zip(out, lists, where):
                    o += seq[a[i]:start[i]] + piece(seq, i, start, end, times)
                holes = [(s, e, v) for s, e, _, v in nested if within((s, e), (start, end))]
                mine = [j for j in range(start[1], end[1]) if not any(s[1] <= j < e[1] for s, e, _ in holes)]
                unit_ops[u].extend(t.ops[j] for j in mine)
                unit_compiled[u].extend(fused.get(j, t.ops[j]) for j in mine)
                unit_comms[u].extend((key, n, 1) for j, (key, n) in enumerate(t.comm_log[start[2]:end[2]], start[2])
                                     if not any(s[2] <= j < e[2] for s, e, _ in holes))
                for s, e, v in holes:
                    unit_ops[v].extend(t.ops[s[1]:e[1]])
                    unit_compiled[v].extend(fused.get(j, t.ops[j]) for j in range(s[1], e[1]))
                    unit_comms[v].extend((key, n, 1) for key, n in t.comm_log[s[2]:e[2]])
                a = end
                used.add((start, end))
        for o, seq, i in zip(out, lists, where):
            o += seq[a[i]:b[i]]
        return out

    inserts = []
    for at, key in t.copies:
        log_part, *rest = expand(*t.spans[key][:2])
        inserts.append((at, ([e for e in log_part if e[1] not in t.own_per_copy], *rest)))
    streams, last = tuple([] for _ in lists), (0, 0, 0)
    for at, entries in sorted(inserts, key=lambda x: x[0]):
        for whole, before, inserted in zip(streams, expand(last, at), entries):
            whole += before + inserted
        last = at
    for whole, rest in zip(streams, expand(last, t.cursor())):
        whole += rest
    if used != {(a, b) for a, b, _, _ in repeat}:
        raise RuntimeError("a repeated block's span of the step straddles a skipped pipeline call")
    log, ops, comm_log, block_ops, compiled_ops = streams[:5]
    for i in range(len(units)):
        unit_ops[i] += [op for op in streams[5 + i] if op[1]]
        unit_compiled[i] += [op for op in streams[5 + i] if op[1]]
        unit_comms[i] += [c for c in streams[5 + len(units) + i] if c[1]]
    start = dict(live)
    both = []
    for skip in (set(), _recomputed(t, params_ids, compiled)):
        live, top = defaultdict(int, start), {p: dict(v) for p, v in peaks.items()}
        for phase, sid, delta in log:
            if sid in skip:
                continue
            live[category(sid)] += delta
            total = sum(live.values())
            if total > top[PHASES[phase]]["total"]:
                top[PHASES[phase]] = {**live, "total": total}
        both.append({p: {c: v.get(c, 0) for c in (*CATEGORIES, "total")} for p, v in top.items()})
    return Trace(both[0], _tally(t, comm_log), sum(op[0] for op in ops), ops,
                 [(u.times, o, oc, _tally(t, c)) for u, o, oc, c in zip(units, unit_ops, unit_compiled, unit_comms)],
                 len(t.copies), both[1], [op for op in block_ops if op[3]], [op for op in compiled_ops if op[3] or op[1]])

def _recomputed(t: StepTracer, params: set[int], compiled: list[tuple]) -> set[int]:
    """What a compiled block does not keep for backward: in the blocks' forward spans
    (`compiled`), the outputs of elementwise ops whose inputs backward holds anyway (saved
    tensors, parameters), which torch.compile's partitioner recomputes in backward rather
    than save (SwiGLU's silu(a) and silu(a) * b from the matmul outputs a and b, autocast's
    bf16 copies of the weights). One level: an op whose input is not otherwise saved (a
    norm's output) keeps its output saved."""
    inside = _covered(compiled, 1, len(t.ops))
    kept = t.saved | params
    out = set()
    for i, (ins, outs) in enumerate(t.op_io):
        if inside[i] and t.ops[i][2] == "memory" and all(sid in kept for sid, _ in ins):
            read = {sid for sid, _ in ins}  # an output on an input's storage (_unsafe_view) is that input
            out |= {sid for sid, _ in outs if sid in t.saved and sid not in params and sid not in read}
    return out


def _fused(t: StepTracer, blocks: list[tuple], saved: set[int]) -> dict[int, tuple]:
    """Each elementwise op of a block as a compiled block runs it: (FLOPs, bytes, class,
    kernels). torch.compile fuses a block's elementwise ops into kernels that keep their
    intermediates in registers, so an op reads from memory only what no elementwise op of the
    same span (a block's forward, or its backward) produced, and writes only what leaves the
    fused kernels: an output a matmul, attention or a collective reads, one read outside the span
    or by nothing, or one `saved` for backward (a compiled block keeps: _recomputed). It ends a
    kernel where it writes. An upper bound of inductor's fusion: it counts a tensor read by two
    kernels twice, and fuses across a reduction where inductor may not."""
    region = [-1] * len(t.ops)
    for r, (a, b) in enumerate(blocks):
        for j in range(a[1], b[1]):
            region[j] = r
    producer, readers = {}, defaultdict(list)
    for j, (ins, outs) in enumerate(t.op_io):
        for sid, _ in ins:
            readers[sid].append(j)
        for sid, _ in outs:
            producer.setdefault(sid, j)
    leaves = {sid for sid in t.comm_sids if sid is not None} | saved
    memory = "memory"

    def fused_in(sid: int, r: int) -> bool:
        j = producer.get(sid)
        return j is not None and region[j] == r and t.ops[j][2] == memory

    out = {}
    for j, (ins, outs) in enumerate(t.op_io):
        r = region[j]
        if r < 0 or t.ops[j][2] != memory:
            continue
        read = sum(n for sid, n in ins if not fused_in(sid, r))
        written = sum(n for sid, n in outs if sid in leaves or not readers[sid] or any(
            region[k] != r or t.ops[k][2] != memory for k in readers[sid]))
        out[j] = (t.ops[j][0], read + written, memory, 1 if written else 0)
    return out


def _shares(t: StepTracer, seeds: set[int], spans: list[tuple]) -> tuple[list[float], list[float]]:
    """A block period's share of each op and collective outside every span (0 inside): by
    the bytes an op reads from the period's own storages (`seeds`: its state, what its
    spans created), carried on to what the op creates (a stack of every layer's
    statistics, say); a collective's, its payload's."""
    share = dict.fromkeys(seeds, 1.0)
    covered = _covered(spans, 1, len(t.ops)), _covered(spans, 2, len(t.comm_log))
    op_part = [0.0] * len(t.ops)
    for i, (ins, outs) in enumerate(t.op_io):
        own = 0 if covered[0][i] else sum(n * share.get(sid, 0) for sid, n in ins)
        if own:
            op_part[i] = own / max(sum(n for _, n in ins), 1)
            for sid, _ in outs:
                share.setdefault(sid, op_part[i])
    return op_part, [0.0 if covered[1][i] else share.get(sid, 0.0) for i, sid in enumerate(t.comm_sids)]


def _tally(t: StepTracer, comm_log: list[tuple]) -> list[Comm]:
    comms = {k: replace(c) for k, c in t.comms.items()}
    for key, n, count in comm_log:
        comms[key].count += count
        comms[key].bytes += n
    return [c for c in comms.values() if c.count]
