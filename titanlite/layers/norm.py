"""RMSNorm scaled by (1 + weight): the norm of Qwen3.5 and Qwen3-Next (and Gemma)."""

from __future__ import annotations

import torch
import torch.nn as nn


class OffsetRMSNorm(nn.Module):
    """x / rms(x) * (1 + weight), the weight starting at zero, so that weight decay pulls the scale
    towards one rather than towards zero. Normalised and scaled in float32, then cast back (the
    reference's order: a 16-bit x is rounded once, after the scale)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)
