"""The one attention entry point that model code calls.

Models never know about context parallelism or document masking: they pass an
`AttnContext` through, and this function picks the right kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttnContext:
    """Per-batch attention facts the trainer knows and the model doesn't."""

    positions: torch.Tensor | None = None
    """[batch, seq] global token positions for RoPE; None means 0..seq-1."""


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: AttnContext | None) -> torch.Tensor:
    """Causal attention. q: [B, Hq, S, D]; k, v: [B, Hkv, S, D] with Hq a multiple of Hkv."""
    rep = q.shape[1] // k.shape[1]
    if rep > 1:
        # expand + reshape rather than enable_gqa: every SDPA backend (and DTensor) takes it
        k = k.unsqueeze(2).expand(-1, -1, rep, -1, -1).flatten(1, 2)
        v = v.unsqueeze(2).expand(-1, -1, rep, -1, -1).flatten(1, 2)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)
