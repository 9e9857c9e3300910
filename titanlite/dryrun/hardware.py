"""Datasheet figures of a few GPUs and the step-time model the dry run predicts with.

Every constant is a published hardware figure (dense, i.e. without 2:4 sparsity), never a
value fitted to measured training runs. The model is deliberately simple; docs/scaling.md
states it and its limits.
"""

from __future__ import annotations

from dataclasses import dataclass

from titanlite.errors import ConfigError

GIB = 2**30


@dataclass(frozen=True)
class GPU:
    name: str
    bf16_flops: float
    """Dense BF16 tensor-core FLOP/s."""
    hbm_bytes_per_s: float
    nvlink_bytes_per_s: float
    """NVLink bandwidth per GPU, one direction (half the quoted bidirectional figure)."""
    network_bytes_per_s: float
    """Scale-out bandwidth per GPU, one direction: the NIC each GPU of the reference system has."""
    memory_gib: float
    """Device memory as the driver reports it."""
    gpus_per_node: int
    source: str


GPUS = {g.name: g for g in [
    GPU("h100", 989e12, 3.35e12, 450e9, 50e9, 79.6, 8,
        "NVIDIA H100 Tensor Core GPU datasheet (SXM5: 989 TFLOPS BF16 dense, 3.35 TB/s HBM3, "
        "NVLink 900 GB/s); DGX H100: one 400 Gb/s ConnectX-7 per GPU"),
    GPU("h200", 989e12, 4.8e12, 450e9, 50e9, 140.4, 8,
        "NVIDIA H200 Tensor Core GPU datasheet (SXM: 989 TFLOPS BF16 dense, 4.8 TB/s HBM3e, "
        "NVLink 900 GB/s, 141 GB); DGX H200: one 400 Gb/s ConnectX-7 per GPU"),
    GPU("a100", 312e12, 2.039e12, 300e9, 25e9, 80.0, 8,
        "NVIDIA A100 Tensor Core GPU datasheet (SXM 80GB: 312 TFLOPS BF16 dense, 2,039 GB/s HBM2e, "
        "NVLink 600 GB/s); DGX A100: one 200 Gb/s ConnectX-6 per GPU"),
    GPU("b200", 2.25e15, 8e12, 900e9, 50e9, 179.1, 8,
        "NVIDIA DGX B200 datasheet / HGX B200 (per GPU: 2.25 PFLOPS BF16 dense, 8 TB/s HBM3e, "
        "NVLink 5 1.8 TB/s, 180 GB); DGX B200: one 400 Gb/s ConnectX-7 per GPU"),
]}


def get_gpu(name: str) -> GPU:
    if name.lower() not in GPUS:
        raise ConfigError(f"--gpu: unknown GPU '{name}'; known: {', '.join(GPUS)}")
    return GPUS[name.lower()]


# Bytes each rank sends per byte of the full buffer, for ring algorithms on a group of n
_BUS = {"all_gather": lambda n: (n - 1) / n, "reduce_scatter": lambda n: (n - 1) / n,
        "all_reduce": lambda n: 2 * (n - 1) / n, "all_to_all": lambda n: (n - 1) / n,
        "broadcast": lambda n: 1.0, "send": lambda n: 1.0,
        # links are full duplex: a rank receives while it sends, so each transfer is timed once
        "recv": lambda n: 0.0}


def comm_seconds(kind: str, nbytes: float, ranks: tuple[int, ...], gpu: GPU) -> float:
    """Bandwidth term only: a group within one node runs at NVLink speed, a group that
    spans nodes at the per-GPU network speed (a ring is as fast as its slowest link)."""
    n = len(ranks)
    if n <= 1:
        return 0.0
    one_node = len({r // gpu.gpus_per_node for r in ranks}) == 1
    return _BUS[kind](n) * nbytes / (gpu.nvlink_bytes_per_s if one_node else gpu.network_bytes_per_s)


def compute_seconds(ops: list[tuple[int, int]], gpu: GPU) -> float:
    """Roofline per op: the slower of its FLOPs at peak and its bytes at HBM bandwidth."""
    return sum(max(f / gpu.bf16_flops, b / gpu.hbm_bytes_per_s) for f, b in ops)


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
    n_blocks: int

    def step(self, pp: int = 1, slots: int = 1) -> float:
        """FSDP's collectives for a block overlap the neighbouring block's compute, so each block
        costs the slower of the two; the root's collectives overlap the rest of the compute.
        A pipeline adds the schedule's bubble: (pp - 1) idle slots per `slots` busy ones, where
        slots is micro-batches x stages per rank (GPipe, 1F1B: micro-batches; interleaved:
        the bubble divided by the stages per rank)."""
        busy = (self.exposed + self.n_blocks * max(self.compute_block, self.overlapped_block)
                + max(self.compute_rest, self.overlapped_rest))
        return busy * (slots + pp - 1) / slots
