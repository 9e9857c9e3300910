"""The training loss: cross-entropy summed over target tokens (the caller divides by the
global target count), optionally compiled."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from titanlite.config import Compile

IGNORE_INDEX = -100


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum",
                           ignore_index=IGNORE_INDEX)


def build_loss_fn(cfg: Compile) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    if cfg.enable and "loss" in cfg.components:
        return torch.compile(cross_entropy_sum, fullgraph=True)
    return cross_entropy_sum
