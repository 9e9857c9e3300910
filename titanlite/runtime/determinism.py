"""training.deterministic: the same job on the same machine gives the same bits.

On CPU that is torch's deterministic algorithms. On CUDA it also takes: cuBLAS with a fixed
workspace (CUBLAS_WORKSPACE_CONFIG, read when the process makes its first cuBLAS handle, so
this runs before any matmul), cuDNN without autotuning and with its deterministic algorithms,
and attention on the math SDPA kernel only, since the flash, memory-efficient and cuDNN
kernels accumulate their backward in an order that varies. The CUDA part is set up by
construction and checked on the host; it has not been run on a GPU here.
"""

from __future__ import annotations

import os

import torch


def set_determinism(device: torch.device) -> None:
    """Deterministic kernels for `device`; call before the first matmul. A CUBLAS_WORKSPACE_CONFIG
    the user exported wins (":16:8" is the other valid value)."""
    torch.use_deterministic_algorithms(True)
    if device.type != "cuda":
        return  # the SDPA switches below also steer CPU attention, whose kernels are deterministic
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    torch.backends.cuda.enable_flash_sdp(False)
    torch.backends.cuda.enable_mem_efficient_sdp(False)
    torch.backends.cuda.enable_cudnn_sdp(False)
    torch.backends.cuda.enable_math_sdp(True)
