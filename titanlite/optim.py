"""AdamW and the warmup-stable-decay learning-rate schedule."""

from __future__ import annotations

import math

import torch
import torch.nn as nn
from torch.optim.lr_scheduler import LambdaLR

from titanlite.config import LRScheduler, Optimizer


def build_optimizer(model: nn.Module, cfg: Optimizer) -> torch.optim.Optimizer:
    fused = cfg.implementation == "fused"
    return torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                             weight_decay=cfg.weight_decay, fused=fused, foreach=not fused)


def lr_factor(step: int, cfg: LRScheduler, total_steps: int) -> float:
    """LR multiplier for the optimizer step numbered `step` (0-based)."""
    decay_steps = round(cfg.decay_ratio * (total_steps - cfg.warmup_steps))
    decay_start = total_steps - decay_steps
    if step < cfg.warmup_steps:
        return (step + 1) / (cfg.warmup_steps + 1)
    if step < decay_start or decay_steps == 0:
        return 1.0
    progress = (step - decay_start + 1) / decay_steps
    if cfg.decay_type == "cosine":
        shape = 0.5 * (1 + math.cos(math.pi * progress))
    else:
        shape = 1 - progress
    return cfg.min_lr_factor + (1 - cfg.min_lr_factor) * shape


def build_lr_scheduler(opt: torch.optim.Optimizer, cfg: LRScheduler, total_steps: int) -> LambdaLR:
    return LambdaLR(opt, lambda step: lr_factor(step, cfg, total_steps))
