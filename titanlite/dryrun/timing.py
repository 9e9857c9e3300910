"""The dry run's step-time model: the traced step's ops and collectives in seconds on a named GPU.

Compute is timed per op class at rates measured on real hardware (hardware.GPU: the best matmul
rate a GPU reaches, FlashAttention-2's attention rates, at the clocks its power limit sustains),
memory-bound ops at HBM bandwidth, plus a launch gap per eager kernel; collectives per link
(NVLink inside a node, the per-GPU network across nodes) at NCCL's bus efficiency plus a latency
each. The trace is eager; a compiled job's blocks are timed with their memory-bound ops fused.
Four factors are fitted offline to the calibration table (titanlite.dryrun.calibration.fit);
this module only reads them (FITTED). docs/scaling.md states every constant, its source and
the fit, with each run's leave-one-out error.
"""

from __future__ import annotations

from array import array
from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from titanlite.dryrun.hardware import GPU


@dataclass(frozen=True)
class Factors:
    """What the datasheets and microbenchmarks do not say, fitted to measured steps."""

    matmul: float
    """Share of the part's best matmul rate (MAMF, at its sustained clock) a step's GEMMs reach."""
    hbm: float
    """Share of HBM bandwidth the eager step's memory-bound kernels reach (small tensors, fp32
    casts, reductions, a kernel per aten op)."""
    contention: float
    """Share of FSDP's overlapped traffic that still costs the compute it runs beside (NCCL's
    kernels take SMs and HBM bandwidth from the GEMMs they overlap)."""
    fixed_power: float
    """Share of a GPU's rated power that does not scale with its compute clock (HBM, I/O,
    leakage): under a lower power limit only the rest is cut, clock_share."""
    kernel_gap_us: float
    """Microseconds each kernel of the step adds beyond its work: the launch and the host's
    dispatch of an eager op, which the host's run-ahead does not hide behind short kernels."""


def clock_share(gpu: GPU, k: "Factors") -> float:
    """The share of its rated compute clock `gpu` sustains under its power limit. The power that
    scales with the clock goes as its cube (f V^2, the voltage rising with the clock); the rest
    (Factors.fixed_power) stays. A limit at or above the rated power gains nothing."""
    ratio = min(1.0, gpu.power_w / gpu.rated_w)
    if ratio >= 1.0:
        return 1.0
    return max(ratio - k.fixed_power, 0.0) ** (1 / 3) / (1 - k.fixed_power) ** (1 / 3)


# Fitted by titanlite.dryrun.calibration.fit (least squares on the log of predicted / measured
# step time over every run of calibration.RUNS marked `fit`); the run and parameter counts and
# each run's leave-one-out error are in docs/scaling.md. tests/test_timing.py refits and checks
# these are the fit's.
FITTED = Factors(matmul=1.0, hbm=0.87, contention=0.03, fixed_power=0.58, kernel_gap_us=9.27)

# Stated, not fitted: NCCL's bus bandwidth as a share of the link's (nccl-tests reach ~80% of
# NVLink and ~90% of a 200/400 Gb/s NIC), with a fixed latency per collective (nccl-tests'
# small-message times: ~10 us in a node, ~30 us across nodes).
LINK_EFFICIENCY = {"nvlink": 0.80, "network": 0.90}
LATENCY_S = {"nvlink": 10e-6, "network": 30e-6}

# The mesh dimensions whose collectives FSDP/HSDP issue beside compute (efsdp: the experts')
OVERLAPPED = {"dp_shard_cp", "dp_replicate", "efsdp"}

_MATMULS = {"mm", "addmm", "bmm", "baddbmm", "_grouped_mm"}
_FLOAT8_MATMULS = {"_scaled_mm", "_scaled_grouped_mm"}


def op_class(func) -> str:
    """matmul, matmul_f8 (float8 inputs), attention, attention_backward or memory (everything
    else: norms, RoPE, casts, the optimizer), from the aten op's name."""
    name = func.__name__.split(".")[0]
    if name in _MATMULS:
        return "matmul"
    if name in _FLOAT8_MATMULS:
        return "matmul_f8"
    if "attention" in name:
        return "attention_backward" if "backward" in name else "attention"
    return "memory"


CLASSES = ("matmul", "matmul_f8", "attention", "attention_backward", "memory")


def _rates(gpu: GPU, k: Factors) -> np.ndarray:
    """FLOP/s per op class (CLASSES order) at the clock the GPU's power limit sustains; attention
    FLOPs are counted as the full square (torch's counter, the MFU formula) and a causal kernel
    computes half of it; memory-bound ops have no FLOPs."""
    clock = clock_share(gpu, k)
    return np.array([gpu.mamf_flops * k.matmul * clock, (gpu.mamf_f8_flops or np.nan) * k.matmul * clock,
                     2 * gpu.attention_flops * clock, 2 * gpu.attention_bwd_flops * clock, np.inf])


def compact(ops: list[tuple]) -> array:
    """(FLOPs, bytes, class, kernels) per op as rows (FLOPs, bytes, class index, count, kernels),
    equal ops merged, so a trace of thousands of ops keeps a few hundred rows, timed at once.
    Plain doubles: a traced role comes back from its process pickled."""
    merged: dict[tuple, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for f, b, c, n in ops:
        if f or b or n:
            row = merged[f, b, CLASSES.index(c)]
            row[0] += 1
            row[1] += n
    return array("d", [x for (f, b, c), (m, n) in merged.items() for x in (f, b, c, m, n)])


def compute_seconds(ops: array, gpu: GPU, k: Factors = FITTED) -> float:
    """Compacted ops one after another: each the slower of its FLOPs at its class's rate and its
    bytes at achievable HBM bandwidth, plus a launch gap per kernel."""
    if not len(ops):
        return 0.0
    f, b, c, m, n = np.frombuffer(ops).reshape(-1, 5).T
    t = np.maximum(f / _rates(gpu, k)[c.astype(int)], b / (gpu.hbm_bytes_per_s * k.hbm))
    return float((m * t).sum() + n.sum() * k.kernel_gap_us * 1e-6)


# Bytes each rank sends per byte of the full buffer, for ring algorithms on a group of n
_BUS = {"all_gather": lambda n: (n - 1) / n, "reduce_scatter": lambda n: (n - 1) / n,
        "all_reduce": lambda n: 2 * (n - 1) / n, "all_to_all": lambda n: (n - 1) / n,
        "broadcast": lambda n: 1.0, "send": lambda n: 1.0,
        # links are full duplex: a rank receives while it sends, so each transfer is timed once
        "recv": lambda n: 0.0}


def comm_seconds(kind: str, nbytes: float, count: float, ranks: tuple[int, ...], gpu: GPU) -> float:
    """A group within one node runs at NVLink speed, a group that spans nodes at the per-GPU
    network speed (a ring is as fast as its slowest link), each at NCCL's efficiency, plus a
    latency per call (none for a receive: its sender's call is timed)."""
    n = len(ranks)
    if n <= 1:
        return 0.0
    link = "nvlink" if len({r // gpu.gpus_per_node for r in ranks}) == 1 else "network"
    bandwidth = (gpu.nvlink_bytes_per_s if link == "nvlink" else gpu.network_bytes_per_s) * LINK_EFFICIENCY[link]
    return _BUS[kind](n) * nbytes / bandwidth + (kind != "recv") * count * LATENCY_S[link]


@dataclass(frozen=True)
class Unit:
    """One traced block (or activation-checkpointing period) that stands for `count` of the
    model's blocks of its kind: its compacted ops and its collectives."""

    count: float
    """How many times the real model runs this unit (its blocks over its period)."""
    ops: array
    compiled_ops: array
    """The same ops as a compiled block runs them (titanlite.dryrun.replay._fused)."""
    comms: tuple
    period: int = 1
    """Blocks in the unit: an activation-checkpointing period under selective layer AC."""


@dataclass(frozen=True)
class Work:
    """What one rank's traced step computes and sends, at the model's depth, in a form any GPU
    and any factors time (titanlite.dryrun.replay.Trace, compacted)."""

    ops: array
    comms: tuple
    units: tuple[Unit, ...]
    """One per kind of block the replay repeated (titanlite.dryrun.blocktrace)."""
    block_ops: array
    """The ops of every block (the units' repeats, the first, second and last blocks)."""
    compiled_block_ops: array
    """The same as compiled blocks run them."""


@dataclass(frozen=True)
class StepTimes:
    """Seconds per step on one rank, split into what the model's blocks add and the rest."""

    blocks: float
    """Each block costs the slower of its compute and the FSDP traffic beside it, plus the
    share of that traffic that slows its compute (Factors.contention); summed over blocks."""
    compute_rest: float
    overlapped_rest: float
    exposed: float
    """Collectives on the critical path (tensor and context parallel, the gradient-norm reduction)."""
    edges: float
    """FSDP traffic no compute hides: the first block's forward gather, the last reduction."""
    contention: float

    def step(self, pp: int = 1, slots: int = 1) -> float:
        """The root's collectives overlap the rest of the compute. A pipeline adds the schedule's
        bubble: (pp - 1) idle slots per `slots` busy ones, where slots is micro-batches x stages
        per rank (GPipe, 1F1B: micro-batches; interleaved: the bubble divided by the stages per rank)."""
        rest = _overlap(self.compute_rest, self.overlapped_rest, self.contention)
        return (self.exposed + self.edges + self.blocks + rest) * (slots + pp - 1) / slots


def _overlap(compute: float, comm: float, contention: float) -> float:
    return max(compute, comm) + contention * min(compute, comm)


def step_times(work: Work, gpu: GPU, compiled: bool = False, k: Factors = FITTED) -> StepTimes:
    """A traced step's time terms on `gpu`: what each kind of block adds (its compute; the FSDP
    traffic that can hide behind it) times its count, and the rest. The trace is eager;
    `compiled` times the blocks as torch.compile runs them (the rest stays eager)."""
    def comm_s(cs, overlapped: bool, edge: bool = False) -> float:
        return sum(comm_seconds(c.kind, c.bytes, c.count, c.ranks, gpu) for c in cs
                   if (c.group in OVERLAPPED and c.phase != "optimizer") == overlapped
                   and (not edge or c.phase == "forward" or c.kind != "all_gather"))

    blocks, overlapped, edges, unit_compute = 0.0, 0.0, 0.0, 0.0
    for u in work.units:
        c, o = compute_seconds(u.compiled_ops if compiled else u.ops, gpu, k), comm_s(u.comms, True)
        blocks += u.count * _overlap(c, o, k.contention)
        unit_compute += u.count * c
        overlapped += u.count * o
        edges = max(edges, comm_s(u.comms, True, edge=True) / u.period)
    # the rest: what runs outside the blocks (eager), and the blocks no unit stands for (compiled
    # if the job is)
    rest = (compute_seconds(work.ops, gpu, k) - compute_seconds(work.block_ops, gpu, k)
            + compute_seconds(work.compiled_block_ops if compiled else work.block_ops, gpu, k) - unit_compute)
    return StepTimes(blocks, rest, comm_s(work.comms, True) - overlapped, comm_s(work.comms, False), edges,
                     k.contention)


def matmul_bound(gpu: GPU) -> float:
    """The fastest a step's GEMMs run on `gpu` by this model: the planner's speed bound."""
    return gpu.mamf_flops * FITTED.matmul * clock_share(gpu, FITTED)


QUORUM_S = 0.05
"""A replica group's per-step round trip to torchft's lighthouse and its peers' managers (quorum,
should_commit): an assumption, not measured on a cluster (about 1 ms on one CPU machine)."""


def replica_step_seconds(grad_bytes_per_rank: float, groups: int, gpu: GPU) -> float:
    """What replica groups (fault_tolerance.enable, titanlite.runtime.replicas) add to each step
    on `gpu`: the quorum's round trip and one all-reduce of every rank's gradient shard with the
    same rank of the other groups (a ring across nodes, one rank per node), after the backward
    and not overlapped with it. The dry run adds it to a replica group's step."""
    if groups <= 1:
        return 0.0
    ranks = tuple(range(0, groups * gpu.gpus_per_node, gpu.gpus_per_node))
    return QUORUM_S + comm_seconds("all_reduce", grad_bytes_per_rank, 1, ranks, gpu)
