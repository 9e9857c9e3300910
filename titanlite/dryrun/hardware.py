"""Published figures of a few GPUs, which the dry run's step-time model (titanlite.dryrun.timing)
runs on.

Datasheet peaks (dense, i.e. without 2:4 sparsity) and rates measured on the real part (the best
matmul rate, FlashAttention-2's attention rates), each with its source; none is fitted to a
training run. docs/scaling.md states them.
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
    mamf_flops: float
    """Maximum achievable matmul FLOP/s, BF16: the best rate over shapes measured on the part."""
    attention_flops: float
    attention_bwd_flops: float
    """FlashAttention-2's measured forward and backward rate (FLOPs of the causal half, head dim
    128, sequence 8k): the kernel PyTorch's SDPA runs on this part."""
    source: str


GPUS = {g.name: g for g in [
    GPU("h100", 989e12, 3.35e12, 450e9, 50e9, 79.6, 8, 792.1e12, 335e12, 290e12,
        "NVIDIA H100 Tensor Core GPU datasheet (SXM5: 989 TFLOPS BF16 dense, 3.35 TB/s HBM3, "
        "NVLink 900 GB/s); DGX H100: one 400 Gb/s ConnectX-7 per GPU; MAMF 792.1 TFLOPS (ml-engineering, "
        "compute/accelerator, CUDA 12.1); FlashAttention-2 on H100 ~335 TFLOPS forward (FlashAttention-2 "
        "and -3 papers, arXiv 2307.08691, 2407.08608)"),
    # Meta's Grand Teton H100 on which TorchTitan measured (docs/performance.md there): 96 GB
    # HBM2e at 2.4 TB/s, a 500 W power limit, "peak between SXM and NVL" (989 and 835 TFLOPS):
    # the measured rates are the SXM part's scaled by the midpoint, 912 / 989; MFU stays
    # against 989 TFLOPS, as TorchTitan reports it
    GPU("h100_500w", 989e12, 2.4e12, 450e9, 50e9, 94.0, 8, 792.1e12 * 912 / 989, 335e12 * 912 / 989,
        290e12 * 912 / 989,
        "TorchTitan docs/performance.md (Grand Teton: H100 96 GB HBM2e, 2.4 TB/s, 500 W, NVLink in a "
        "host, 400 Gb/s RDMA per GPU); rates: the h100's scaled by (989 + 835) / 2 / 989"),
    GPU("h200", 989e12, 4.8e12, 450e9, 50e9, 140.4, 8, 794.5e12, 335e12, 290e12,
        "NVIDIA H200 Tensor Core GPU datasheet (SXM: 989 TFLOPS BF16 dense, 4.8 TB/s HBM3e, "
        "NVLink 900 GB/s, 141 GB); DGX H200: one 400 Gb/s ConnectX-7 per GPU; MAMF 794.5 TFLOPS "
        "(ml-engineering); attention as the h100 (the same SMs)"),
    GPU("a100", 312e12, 2.039e12, 300e9, 25e9, 80.0, 8, 267.9e12, 220e12, 190e12,
        "NVIDIA A100 Tensor Core GPU datasheet (SXM 80GB: 312 TFLOPS BF16 dense, 2,039 GB/s HBM2e, "
        "NVLink 600 GB/s); DGX A100: one 200 Gb/s ConnectX-6 per GPU; MAMF 267.9 TFLOPS "
        "(ml-engineering, CUDA 12.1); FlashAttention-2 on A100 ~220 / 190 TFLOPS forward / backward "
        "(arXiv 2307.08691, Fig. 4-5)"),
    GPU("b200", 2.25e15, 8e12, 900e9, 50e9, 179.1, 8, 1745e12, 335e12 * 2.25e15 / 989e12,
        290e12 * 2.25e15 / 989e12,
        "NVIDIA DGX B200 datasheet / HGX B200 (per GPU: 2.25 PFLOPS BF16 dense, 8 TB/s HBM3e, "
        "NVLink 5 1.8 TB/s, 180 GB); DGX B200: one 400 Gb/s ConnectX-7 per GPU; MAMF 1745 TFLOPS "
        "(ml-engineering); attention: the h100's share of peak, unmeasured"),
]}


def get_gpu(name: str) -> GPU:
    if name.lower() not in GPUS:
        raise ConfigError(f"--gpu: unknown GPU '{name}'; known: {', '.join(GPUS)}")
    return GPUS[name.lower()]
