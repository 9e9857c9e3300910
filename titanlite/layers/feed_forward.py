"""The gated feed-forward of every family here (SwiGLU with SiLU), and of a MoE layer's shared expert."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn


class FeedForward(nn.Module):
    """w2(act(w1 x) * w3 x): w1 the gate, w3 the up and w2 the down projection, no biases.
    `act` is an argument so that a family (or a fork) states its activation where it builds the block."""

    def __init__(self, dim: int, hidden: int, act: Callable[[torch.Tensor], torch.Tensor]):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.act(self.w1(x)) * self.w3(x))
