"""The dry run's step-time model: the traced step's ops and collectives in seconds on a named GPU.

Compute is timed per op class at rates measured on real hardware (hardware.GPU: the best matmul
rate a GPU reaches, FlashAttention-2's attention rates), memory-bound ops at HBM bandwidth, plus
a launch gap per eager kernel; collectives per link (NVLink inside a node, the per-GPU network
across nodes) at NCCL's bus efficiency plus a latency each. The trace is eager; a compiled
job's blocks are timed with their memory-bound ops fused. Three factors are fitted to published
runs (MATMUL_SUSTAINED, HBM_ACHIEVED, COMPILED_MEMORY_SHARE); docs/scaling.md states every
constant, its source and the calibration, with the runs held out of it.
"""

from __future__ import annotations

from dataclasses import dataclass

from titanlite.dryrun.hardware import GPU

# Fitted by least squares to the two runs calibration.RUNS marks (docs/scaling.md, "Calibration"):
# the share of the GPU's best matmul rate (MAMF) that a step's GEMMs sustain, bounded by 1, and
# of HBM bandwidth that eager elementwise kernels reach (small tensors, fp32 casts, reductions).
# The fit sits on the bound; the two are not separately identifiable from these runs.
MATMUL_SUSTAINED = 1.00
HBM_ACHIEVED = 0.51
# Stated, not fitted: the gap between two eager kernels on a busy stream (launch latency the
# host's run-ahead cannot hide for short kernels), and NCCL's bus bandwidth as a share of the
# link's (nccl-tests reach ~80% of NVLink and ~90% of a 200/400 Gb/s NIC), with a fixed latency
# per collective (nccl-tests' small-message times: ~10 us in a node, ~30 us across nodes).
KERNEL_GAP_S = 2e-6
# Fitted to the one published compiled run calibration.RUNS marks (docs/scaling.md): in a block
# that torch.compile fuses, its memory-bound ops (norms, RoPE, SwiGLU's products, casts, the
# residual adds) run as fewer kernels that keep intermediates in registers; they move this share
# of the eager ops' bytes, with a launch gap per fused kernel taken as the same share of the
# eager ops' count. Matmuls and attention keep their kernels.
COMPILED_MEMORY_SHARE = 0.54
LINK_EFFICIENCY = {"nvlink": 0.80, "network": 0.90}
LATENCY_S = {"nvlink": 10e-6, "network": 30e-6}

# The mesh dimensions whose collectives FSDP/HSDP issue beside compute (efsdp: the experts')
OVERLAPPED = {"dp_shard_cp", "dp_replicate", "efsdp"}

_MATMULS = {"mm", "addmm", "bmm", "baddbmm", "_grouped_mm", "_scaled_mm", "_scaled_grouped_mm"}


def op_class(func) -> str:
    """matmul, attention, attention_backward or memory (everything else: norms, RoPE, casts,
    the optimizer), from the aten op's name."""
    name = func.__name__.split(".")[0]
    if name in _MATMULS:
        return "matmul"
    if "attention" in name:
        return "attention_backward" if "backward" in name else "attention"
    return "memory"


def op_seconds(flops: float, nbytes: float, kind: str, kernels: float, gpu: GPU) -> float:
    """One op (or an op's share): the slower of its FLOPs at its class's rate and its bytes at
    achievable HBM bandwidth, plus the launch gap. Attention FLOPs are counted as the full square
    (torch's counter, the MFU formula); a causal kernel computes half of it."""
    mem = nbytes / (gpu.hbm_bytes_per_s * HBM_ACHIEVED)
    if kind == "attention":
        t = flops / 2 / gpu.attention_flops
    elif kind == "attention_backward":
        t = flops / 2 / gpu.attention_bwd_flops
    else:
        t = flops / (gpu.mamf_flops * MATMUL_SUSTAINED)
    return max(t, mem) + kernels * KERNEL_GAP_S


def compute_seconds(ops: list[tuple], gpu: GPU, compiled: bool = False) -> float:
    """The ops one after another; `compiled`: as a compiled block runs them (memory-bound ops fused)."""
    share = COMPILED_MEMORY_SHARE if compiled else 1.0
    return sum(op_seconds(f, b * share, c, k * share, gpu) if c == "memory" else op_seconds(f, b, c, k, gpu)
               for f, b, c, k in ops)


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
class StepTimes:
    """Seconds per step on one rank, split into the part that repeats per block and the rest."""

    compute_block: float
    compute_rest: float
    overlapped_block: float
    """Collectives that run beside compute (FSDP/HSDP all-gathers, reduce-scatters, all-reduces)."""
    overlapped_rest: float
    exposed: float
    """Collectives on the critical path (tensor and context parallel, the gradient-norm reduction)."""
    edges: float
    """FSDP traffic no compute hides: the first block's forward gather, the last reduction."""
    n_blocks: int

    def step(self, pp: int = 1, slots: int = 1) -> float:
        """FSDP's collectives for a block overlap the neighbouring block's compute, so each block
        costs the slower of the two; the root's collectives overlap the rest of the compute.
        A pipeline adds the schedule's bubble: (pp - 1) idle slots per `slots` busy ones, where
        slots is micro-batches x stages per rank (GPipe, 1F1B: micro-batches; interleaved:
        the bubble divided by the stages per rank)."""
        busy = (self.exposed + self.edges + self.n_blocks * max(self.compute_block, self.overlapped_block)
                + max(self.compute_rest, self.overlapped_rest))
        return busy * (slots + pp - 1) / slots


def step_times(tr, n: int, period: int, gpu: GPU, compiled: bool = False) -> StepTimes:
    """A trace's (titanlite.dryrun.steptrace.Trace) time terms on `gpu`: what each of the `n`
    blocks adds (its compute; the FSDP traffic that can hide behind it) and the rest. The trace
    is eager; `compiled` times the blocks as torch.compile runs them (the rest stays eager)."""
    def comm_s(cs: list, overlapped: bool, edge: bool = False) -> float:
        return sum(comm_seconds(c.kind, c.bytes, c.count, c.ranks, gpu) for c in cs
                   if (c.group in OVERLAPPED and c.phase != "optimizer") == overlapped
                   and (not edge or c.phase == "forward" or c.kind != "all_gather"))

    eager_block = compute_seconds(tr.block_ops, gpu) / period
    cb, ob = compute_seconds(tr.block_ops, gpu, compiled) / period, comm_s(tr.block_comms, True) / period
    return StepTimes(cb, compute_seconds(tr.ops, gpu) - n * eager_block, ob, comm_s(tr.comms, True) - n * ob,
                     comm_s(tr.comms, False), comm_s(tr.block_comms, True, edge=True) / period, n)


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
