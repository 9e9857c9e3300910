"""Published figures of a few GPUs, which the dry run's step-time model (titanlite.dryrun.timing)
runs on.

Datasheet peaks (dense, i.e. without 2:4 sparsity) and rates measured on the real part (the best
matmul rate, FlashAttention-2's attention rates), each with its source, at the part's rated power;
a GPU run under a lower power limit (TorchTitan's 500 W H100s, or whatever limit the driver reports)
computes at the clock that limit sustains (`at_power`; the power-to-clock law is in
titanlite.dryrun.timing). None is fitted to a training run. docs/scaling.md states them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from titanlite.errors import ConfigError

GIB = 2**30


@dataclass(frozen=True)
class GPU:
    name: str
    bf16_flops: float
    """Dense BF16 tensor-core FLOP/s (the datasheet's; MFU's denominator)."""
    hbm_bytes_per_s: float
    nvlink_bytes_per_s: float
    """NVLink bandwidth per GPU, one direction (half the quoted bidirectional figure)."""
    network_bytes_per_s: float
    """Scale-out bandwidth per GPU, one direction: the NIC each GPU of the reference system has."""
    memory_gib: float
    """Device memory as the driver reports it."""
    gpus_per_node: int
    mamf_flops: float
    """Maximum achievable matmul FLOP/s, BF16: the best rate over shapes measured on the part, at
    its rated power."""
    attention_flops: float
    attention_bwd_flops: float
    """FlashAttention-2's measured forward and backward rate (FLOPs of the causal half, head dim
    128, sequence 8k): the kernel PyTorch's SDPA runs on this part, at its rated power."""
    source: str
    mamf_f8_flops: float | None = None
    """The same for float8 (e4m3) inputs; None where the part has no float8 matmuls."""
    rated_w: float = 700.0
    """The board power at which the rates above were measured (the part's default limit)."""
    power_w: float = 700.0
    """The power limit it runs under (`at_power`); below `rated_w` its matmuls and attention run
    at the lower clock that limit sustains (titanlite.dryrun.timing.clock_share)."""


def at_power(gpu: GPU, power_w: float) -> GPU:
    """`gpu` under the power limit `power_w` (watts); the step-time model runs its compute at the
    clock that limit sustains (titanlite.dryrun.timing.clock_share)."""
    if power_w <= 0:
        raise ConfigError(f"--power-limit: expected a positive number of watts, got {power_w:g}")
    return dataclasses.replace(gpu, power_w=power_w)


_MAMF = "ml-engineering, compute/accelerator, Maximum Achievable Matmul FLOPS table"
_H100 = GPU("h100", 989e12, 3.35e12, 450e9, 50e9, 79.6, 8, 794.5e12, 335e12, 290e12,
            "NVIDIA H100 Tensor Core GPU datasheet (SXM5: 989 TFLOPS BF16 dense, 3.35 TB/s HBM3, NVLink 900 "
            f"GB/s, 700 W); DGX H100: one 400 Gb/s ConnectX-7 per GPU; MAMF 794.5 BF16, 1402.6 FP8 TFLOPS ({_MAMF}, "
            "torch 2.7); FlashAttention-2 on H100 ~335 TFLOPS forward (FlashAttention-2 and -3 papers, arXiv "
            "2307.08691, 2407.08608)", 1402.6e12, 700.0, 700.0)
GPUS = {g.name: g for g in [
    _H100,
    # Meta's Grand Teton H100 on which TorchTitan measured (docs/performance.md there): 96 GB
    # HBM2e at 2.4 TB/s, run at its default 500 W power limit; MFU stays against 989 TFLOPS,
    # as TorchTitan reports it
    at_power(dataclasses.replace(
        _H100, name="h100_500w", hbm_bytes_per_s=2.4e12, memory_gib=94.0,
        source="TorchTitan docs/performance.md (Grand Teton: H100 96 GB HBM2e, 2.4 TB/s, 500 W power limit, NVLink "
               "in a host, 400 Gb/s RDMA per GPU); rates: the h100's at its rated 700 W, run at 500 W"), 500.0),
    GPU("h200", 989e12, 4.8e12, 450e9, 50e9, 140.4, 8, 794.5e12, 335e12, 290e12,
        "NVIDIA H200 Tensor Core GPU datasheet (SXM: 989 TFLOPS BF16 dense, 4.8 TB/s HBM3e, NVLink 900 GB/s, "
        f"141 GB, 700 W); DGX H200: one 400 Gb/s ConnectX-7 per GPU; MAMF 794.5 BF16 ('H200 is the same' as H100), "
        f"1453.4 FP8 TFLOPS ({_MAMF}); attention as the h100 (the same SMs)", 1453.4e12, 700.0, 700.0),
    GPU("a100", 312e12, 2.039e12, 300e9, 25e9, 80.0, 8, 271.2e12, 220e12, 190e12,
        "NVIDIA A100 Tensor Core GPU datasheet (SXM 80GB: 312 TFLOPS BF16 dense, 2,039 GB/s HBM2e, NVLink 600 "
        f"GB/s, 400 W); DGX A100: one 200 Gb/s ConnectX-6 per GPU; MAMF 271.2 TFLOPS ({_MAMF}, torch 2.6); no "
        "float8; FlashAttention-2 on A100 ~220 / 190 TFLOPS forward / backward (arXiv 2307.08691, Fig. 4-5)",
        None, 400.0, 400.0),
    GPU("b200", 2.25e15, 8e12, 900e9, 50e9, 179.1, 8, 1745e12, 335e12 * 2.25e15 / 989e12,
        290e12 * 2.25e15 / 989e12,
        "NVIDIA DGX B200 datasheet / HGX B200 (per GPU: 2.25 PFLOPS BF16 dense, 8 TB/s HBM3e, NVLink 5 1.8 "
        f"TB/s, 180 GB, 1000 W); DGX B200: one 400 Gb/s ConnectX-7 per GPU; MAMF 1745 BF16, 3432.5 FP8 TFLOPS "
        f"({_MAMF}); attention: the h100's share of peak, unmeasured", 3432.5e12, 1000.0, 1000.0),
]}


def get_gpu(name: str, power_w: float | None = None) -> GPU:
    """A GPU by name, at its default power limit or at `power_w` watts."""
    if name.lower() not in GPUS:
        raise ConfigError(f"--gpu: unknown GPU '{name}'; known: {', '.join(GPUS)}")
    gpu = GPUS[name.lower()]
    return gpu if power_w is None else at_power(gpu, power_w)
