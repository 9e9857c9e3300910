"""Watch one training step run on fake tensors: memory by category, collectives, FLOPs.

A `TorchDispatchMode` that sits above the FakeTensorMode and sees every local op (DTensor
ops are let through to be desugared into local ones first, as torch's FSDP memory tracker
does). It logs each storage's allocation, resize and free, every collective with its group
and payload, and each op's FLOPs (torch's FlopCounterMode formulas) and bytes read and
written. Categories are decided after the step, when it is known which storages ended up
as parameters, gradients and optimizer state; the log is then replayed to find each
phase's peak and what it was made of.
"""

from __future__ import annotations

import contextlib
import weakref
from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch._guards import active_fake_mode
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._sharding_prop import ShardingPropagator
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass_type
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count
from torch.utils.weak import WeakIdKeyDictionary

from titanlite.dryrun.timing import op_class

PHASES = ("forward", "backward", "optimizer")
CATEGORIES = ("parameters", "gradients", "optimizer", "activations", "collectives", "temporaries")

_c10d, _fn = torch.ops.c10d, torch.ops._c10d_functional
# op -> (kind, index of the process group argument, index of the tensor whose size is the payload;
# "out" means the result). The payload is the full (unsharded) buffer a ring moves (n-1)/n of.
_COLLECTIVES = {
    _c10d._allgather_base_.default: ("all_gather", 2, 0),
    _c10d._reduce_scatter_base_.default: ("reduce_scatter", 2, 1),
    _c10d.allreduce_.default: ("all_reduce", 1, 0),
    _c10d.broadcast_.default: ("broadcast", 1, 0),
    _c10d.alltoall_base_.default: ("all_to_all", 2, 1),
    _c10d.send.default: ("send", 1, 0), _c10d.recv_.default: ("recv", 1, 0),
    _fn.all_gather_into_tensor.default: ("all_gather", 2, "out"),
    _fn.reduce_scatter_tensor.default: ("reduce_scatter", 3, 0),
    _fn.all_reduce.default: ("all_reduce", 2, 0),
    _fn.all_reduce_.default: ("all_reduce", 2, 0),
    _fn.all_to_all_single.default: ("all_to_all", 3, 0),
    _fn.broadcast.default: ("broadcast", 2, 0),
}
_ATEN = torch.ops.aten


def _cpu_sdpa_flops(func, args, out) -> int:
    """The CPU flash kernel is missing from FlopCounterMode's table: count it as the CUDA one is
    (grouped K/V heads cost as many FLOPs as expanded ones)."""
    if func is _ATEN._scaled_dot_product_flash_attention_for_cpu.default:
        q, k, v = args[:3]
        return sdpa_flop_count(q.shape, (*k.shape[:1], q.shape[1], *k.shape[2:]),
                               (*v.shape[:1], q.shape[1], *v.shape[2:]))
    grad, q, k, v = args[:4]
    return sdpa_backward_flop_count(grad.shape, q.shape, (*k.shape[:1], q.shape[1], *k.shape[2:]),
                                    (*v.shape[:1], q.shape[1], *v.shape[2:]))


def _grouped_mm_flops(func, args, out) -> int:
    """Every row of a meets one group's matrix: forward (a [M, K] x b [G, K, N]) and the weight
    gradient (a [K, M] x b [M, N], groups along M) both cost 2 M K N, a group's share of a 3-D a
    only its group's columns."""
    a, b = args[:2]
    return 2 * a.numel() * b.shape[-1] // (a.shape[0] if a.dim() == 3 and b.dim() == 2 else 1)


# titanlite's own formulas, used for these ops whatever torch's table holds: torch 2.15 added
# one for the CPU flash kernel, with another signature and its own count of grouped K/V heads
OWN_FLOPS = {_ATEN._scaled_dot_product_flash_attention_for_cpu.default: _cpu_sdpa_flops,
             _ATEN._scaled_dot_product_flash_attention_for_cpu_backward.default: _cpu_sdpa_flops,
             _ATEN._grouped_mm.default: _grouped_mm_flops}


def flop_formula(func):
    """`func`'s FLOP count as a function of (args, kwargs, out), or None: titanlite's formula
    where it has one (OWN_FLOPS), else FlopCounterMode's, each called with its own signature."""
    own = OWN_FLOPS.get(func)
    if own is not None:
        return lambda args, kwargs, out: own(func, args, out)
    theirs = flop_registry.get(func._overloadpacket)
    return None if theirs is None else lambda args, kwargs, out: theirs(*args, **kwargs, out_val=out)


def _fake_grouped_mm(a, b, *args, **kwargs):
    """torch's fake kernel for _grouped_mm accepts bf16 only (its CUTLASS kernel's dtype); CPU
    and CUDA's fallback run any float dtype: the bf16 result's shape, in a's dtype."""
    bf16 = torch.bfloat16
    return _ATEN._grouped_mm.default(a.to(bf16), b.to(bf16), *args, **kwargs).to(a.dtype)


def within(span: tuple, outer: tuple) -> bool:
    """Whether the (start, end) cursors of `span` lie inside `outer`'s."""
    return all(map(int.__le__, outer[0], span[0])) and all(map(int.__le__, span[1], outer[1]))


def _covered(spans: list[tuple], i: int, length: int) -> bytearray:
    """1 for each entry of a log (cursor component i) inside one of the spans."""
    out = bytearray(length)
    for a, b in spans:
        out[a[i]:b[i]] = b"\1" * (b[i] - a[i])
    return out


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local tensor, without dispatching an op (to_local() runs a view through the
    tracer, which would count a storage it has not seen as allocated there)."""
    return t._local_tensor if isinstance(t, DTensor) else t


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@dataclass
class Comm:
    kind: str
    group: str
    """Mesh dimension name(s) of the group, or "world"."""
    size: int
    """Ranks in the group."""
    ranks: tuple[int, ...]
    phase: str
    count: int = 0
    bytes: int = 0


class StepTracer(TorchDispatchMode):
    """Use inside the FakeTensorMode: `with StepTracer(groups) as t: <step>`, then
    `titanlite.dryrun.replay.result(t, ...)`."""

    def __init__(self, group_names: dict):
        """group_names: process group name -> mesh dimension, or (kind, group name) -> the
        dimension that kind of collective serves there, where a group serves several."""
        super().__init__()
        self.group_names = group_names
        self.phase = "forward"
        self.sid = WeakIdKeyDictionary()  # storage -> id
        self.sizes: dict[int, int] = {}
        self.log: list[tuple[int, int, int]] = []  # (phase index, storage id, byte delta)
        self.alloc_phase: dict[int, str] = {}
        self.saved: set[int] = set()  # forward storages still live when a backward starts
        self.comm_touched: set[int] = set()
        self.resized: set[int] = set()
        self.comms: dict[tuple, Comm] = {}
        self.comm_log: list[tuple[tuple, int]] = []  # (key into comms, bytes) per collective
        self.ops: list[tuple] = []
        # per op, its inputs' (storage id, bytes) and its outputs' storage ids; per collective,
        # its payload's storage id: a block period's share of an op is decided after the step
        self.op_io: list[tuple[tuple, tuple]] = []
        self.comm_sids: list[int | None] = []
        self.spans: dict[tuple, tuple[tuple[int, int, int], tuple[int, int, int], str]] = {}
        self.copies: list[tuple[tuple[int, int, int], tuple]] = []  # (where, key of the span to copy)
        self.live = False
        self.muted = 0
        self.marks: dict[tuple, list[tuple[int, int, int]]] = defaultdict(list)
        self.own_per_copy: set[int] = set()

    # ---- storage bookkeeping
    def _id(self, t: torch.Tensor, note: set[int] | None = None) -> int:
        st = t.untyped_storage()
        sid = self.sid.get(st)
        if sid is None:
            sid = self.sid[st] = len(self.sizes)
            self.sizes[sid] = 0
            self.alloc_phase[sid] = self.phase
            self._change(sid, st.nbytes())
            weakref.finalize(st, self._freed, sid)
        if note is not None:
            note.add(sid)
        return sid

    def _change(self, sid: int, new: int) -> None:
        if self.live and new != self.sizes[sid]:
            self.log.append((PHASES.index(self.phase), sid, new - self.sizes[sid]))
        self.sizes[sid] = new

    def _freed(self, sid: int) -> None:
        self._change(sid, 0)

    def track(self, tensors) -> None:
        """Count tensors that exist before the step (parameters, buffers, inputs)."""
        for t in tensors:
            self._id(t.to_local() if isinstance(t, DTensor) else t)

    def mark(self, key: tuple) -> None:
        """Remember this point of the step (e.g. a block's forward starts), once per occurrence."""
        self.marks[key].append(self.cursor())

    def cursor(self) -> tuple[int, int, int]:
        return len(self.log), len(self.ops), len(self.comm_log)

    @contextlib.contextmanager
    def span(self, key: tuple):
        """Remember what the body logs (memory, ops, collectives) under `key`."""
        start = self.cursor()
        yield
        self.spans[key] = (start, self.cursor(), self.phase)

    def copy(self, key: tuple) -> None:
        """Count here, once more, what the span `key` logged: work the step skipped because it
        repeats that span exactly (a pipeline micro-batch like another; titanlite.dryrun.pptrace)."""
        self.copies.append((self.cursor(), key))
        self.set_phase(self.spans[key][2])

    def spanned(self, method, spans: list):
        """`method`, remembering in `spans` the span of the step each call takes (and its
        handle's wait, for an asynchronous one: an FSDP gather)."""
        def run(*args, **kwargs):
            start = self.cursor()
            handle = method(*args, **kwargs)
            spans.append((start, self.cursor()))
            if handle is not None:
                handle.wait = self.spanned(handle.wait, spans)
            return handle
        return run

    def storage_id(self, t: torch.Tensor) -> int | None:
        """The id of the storage under `t`, None if the step never counted it (a pipeline
        stage's receive buffer, say): looking must not count it now."""
        return self.sid.get(_local(t).untyped_storage())

    def uncopied(self, t: torch.Tensor) -> None:
        """A copied span leaves out what happens to `t`'s storage: each copy has its own (a
        pipeline stage's receive buffer, allocated outside the span and freed inside)."""
        sid = self.storage_id(t)
        if sid is not None:
            self.own_per_copy.add(sid)

    def ghost(self, t: torch.Tensor, like: int | None = None) -> torch.Tensor:
        """A tensor like `t` that holds no counted memory: a stand-in for what a copied span
        returned. Passing `like` (the storage id of the span's own result) makes the stand-in's
        death free what that storage holds, if the span allocated it and it outlives the span."""
        self.muted += 1
        try:
            g = torch.empty_like(t)
        finally:
            self.muted -= 1
        st = _local(g).untyped_storage()
        self.sid[st] = len(self.sizes)
        self.sizes[len(self.sizes)] = 0
        if like is not None:
            weakref.finalize(st, self._ghost_freed, like)
        return g

    def _ghost_freed(self, sid: int) -> None:
        if self.live:
            self.log.append((PHASES.index(self.phase), sid, None))  # resolved in result()

    def set_phase(self, phase: str) -> None:
        if phase == "backward" and self.phase == "forward":
            self.saved |= {s for s, n in self.sizes.items() if n and self.alloc_phase[s] == "forward"}
        if self.live and phase != self.phase:
            # what is live on entering a phase is part of its peak, even if it allocates nothing
            # (a fused optimizer step updates in place)
            self.log.append((PHASES.index(phase), -1, 0))
        self.phase = phase

    # ---- the mode
    def __enter__(self):
        self._fake = active_fake_mode()
        self._resize = torch.UntypedStorage.resize_
        tracer = self

        def resize_(st, size):
            tracer._resize(st, size)
            sid = tracer.sid.get(st)
            if sid is None:
                return
            tracer.resized.add(sid)
            tracer._change(sid, st.nbytes())

        torch.UntypedStorage.resize_ = resize_
        # DTensor runs each op once on global-shape fake tensors to learn the output's shape;
        # under our FakeTensorMode those ops pass through here but are no part of the step
        self._meta = ShardingPropagator._propagate_tensor_meta_non_cached

        def propagate(*args, **kwargs):
            tracer.muted += 1
            try:
                return tracer._meta(*args, **kwargs)
            finally:
                tracer.muted -= 1

        ShardingPropagator._propagate_tensor_meta_non_cached = propagate
        self.live = True
        return super().__enter__()

    def __exit__(self, *exc):
        self.live = False
        self.muted = 0
        torch.UntypedStorage.resize_ = self._resize
        ShardingPropagator._propagate_tensor_meta_non_cached = self._meta
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) or is_traceable_wrapper_subclass_type(t) for t in types):
            return NotImplemented  # let DTensor (or torchao's float8 tensors) run their local ops through this mode
        kwargs = kwargs or {}
        if func is _ATEN._local_scalar_dense.default and active_fake_mode() is self._fake:
            # a fake tensor has no value to read; the one read in a step is the pipeline
            # schedule's first-step vote on static shapes, to which every stage says yes (1)
            return 1
        if self.phase == "forward" and torch._C._current_autograd_node() is not None:
            self.set_phase("backward")
        # FakeTensorMode's own wait_tensor returns a new tensor; eager waits in place
        if func is _fn.wait_tensor.default:
            out = args[0]
        elif func is _ATEN._grouped_mm.default and args[0].dtype != torch.bfloat16:
            out = _fake_grouped_mm(*args, **kwargs)  # its casts run below this mode: not counted
        else:
            out = func(*args, **kwargs)
        if self.muted or active_fake_mode() is not self._fake:
            return out
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        ins = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        comm = _COLLECTIVES.get(func)
        for t in outs:
            self._id(t, self.comm_touched if comm else None)
        if comm:
            self._collective(func, comm, args, out, ins)
        elif outs and not func.is_view:  # no tensor out (prim.device, sizes): no work
            formula = flop_formula(func)
            flops = 0 if formula is None else formula(args, kwargs, out)
            self.ops.append((flops, sum(map(_nbytes, ins)) + sum(map(_nbytes, outs)), op_class(func), 1))
            self.op_io.append((tuple((self.sid.get(t.untyped_storage()), _nbytes(t)) for t in ins),
                               tuple((self.sid[t.untyped_storage()], _nbytes(t)) for t in outs)))
        return out

    def _collective(self, func, comm, args, out, ins) -> None:
        kind, pg_arg, payload = comm
        for t in ins:
            self._id(t, self.comm_touched)
        pg = args[pg_arg]
        if isinstance(pg, str):
            pg = dist.distributed_c10d._resolve_process_group(pg)
        elif not isinstance(pg, dist.ProcessGroup):
            pg = dist.ProcessGroup.unbox(pg)
        t = out if payload == "out" else args[payload]
        t = t[0] if isinstance(t, (list, tuple)) else t
        t = t[0] if isinstance(t, (list, tuple)) else t
        if kind in ("send", "recv") and not t.is_floating_point():
            return  # the schedule's first-step handshake (an integer vote): no part of a steady step
        name = self.group_names.get((kind, pg.group_name)) or self.group_names.get(
            pg.group_name, "world" if pg.size() == dist.get_world_size() else "?")
        # a pipeline stage receives the next micro-batch's input while the last one's backward runs
        phase = "pipeline" if kind in ("send", "recv") else self.phase
        key = (kind, name, phase)
        if key not in self.comms:
            self.comms[key] = Comm(kind, name, pg.size(), tuple(dist.get_process_group_ranks(pg)), phase)
        self.comm_log.append((key, _nbytes(t)))
        self.comm_sids.append(self.sid.get(t.untyped_storage()))

    # ---- after the step
    def start(self) -> None:
        """Mark the sizes counted so far as the step's starting point."""
        self._initial = {s: n for s, n in self.sizes.items() if n}
