"""AdamW (or Muon and AdamW) and the warmup-stable-decay learning-rate schedule, for a list of
model parts.

Each part gets its own optimizers and schedules: torch's checkpoint helpers map an optimizer's
state to the parameter names of one module, and names are what let a checkpoint load on
another pipeline layout. They step together; to the loop they are one optimizer.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn as nn
from dataclasses import dataclass

from torch.distributed.tensor import DTensor
from torch.optim.lr_scheduler import LambdaLR

from titanlite.config.job import LRScheduler, Optimizer
from titanlite.errors import ConfigError
from titanlite.optim.muon import Muon, split_params


@dataclass
class Optimizers:
    """Optimizers and LR schedules, used as one; optimizers[i] updates parameters of parts[i]
    (a part appears once per optimizer it has: with Muon, once for Muon and once for AdamW)."""

    parts: list[nn.Module]
    optimizers: list[torch.optim.Optimizer]
    schedulers: list[LambdaLR]

    def step(self, found_inf: torch.Tensor | None = None) -> None:
        """`found_inf` (fused AdamW and Muon): a device flag, 1.0 skips the update on the device."""
        for opt in self.optimizers:
            if found_inf is not None:
                opt.found_inf = found_inf
            opt.step()

    def step_schedule(self) -> None:
        for sched in self.schedulers:
            sched.step()

    def zero_grad(self) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)

    @property
    def lr(self) -> float:
        return self.schedulers[0].get_last_lr()[0]



def by_mesh(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Tensors split by DTensor mesh: one foreach or fused op takes one mesh, and expert-parallel
    experts live on another mesh than the dense weights."""
    groups: dict[object, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault(t.device_mesh if isinstance(t, DTensor) else None, []).append(t)
    return list(groups.values())


def _adamw(params: list[nn.Parameter], cfg: Optimizer) -> torch.optim.AdamW:
    fused = cfg.implementation == "fused"
    # a param group per mesh: each group is one fused/foreach update
    return torch.optim.AdamW([{"params": ps} for ps in by_mesh(params)], lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                             eps=cfg.eps, weight_decay=cfg.weight_decay, fused=fused, foreach=not fused)


def _muon(params: list[nn.Parameter], cfg: Optimizer, ns_dtype: torch.dtype) -> Muon:
    return Muon(params, lr=cfg.lr if cfg.muon_lr == -1 else cfg.muon_lr,
                weight_decay=cfg.weight_decay if cfg.muon_weight_decay == -1 else cfg.muon_weight_decay,
                momentum=cfg.muon_momentum, nesterov=cfg.muon_nesterov, ns_steps=cfg.muon_ns_steps,
                ns_dtype=ns_dtype)


def build_optimizers(parts: list[nn.Module], cfg: Optimizer, schedule: LRScheduler, total_steps: int,
                     ns_dtype: torch.dtype = torch.float32,
                     lr_scale: Callable[[int], float] | None = None) -> Optimizers:
    """`ns_dtype`: Muon's Newton-Schulz dtype (the parameters' compute dtype: bfloat16 on GPU);
    `lr_scale`: a factor on the schedule's learning rate by (0-based) step (a batch-size warm-up's).
    The optimizers hold the parameters that require grad, and only those: a frozen weight (LoRA's
    base) has no state, no weight decay and no update."""
    owners, opts = [], []
    for part in parts:
        muon, adamw = (split_params(part, cfg.muon_groups) if cfg.name == "Muon"
                       else ([], [p for p in part.parameters() if p.requires_grad]))
        if muon:
            owners.append(part)
            opts.append(_muon(muon, cfg, ns_dtype))
        if adamw:  # a pipeline stage may hold only Muon's kind
            owners.append(part)
            opts.append(_adamw(adamw, cfg))
    if not opts:
        raise ConfigError("this rank's part of the model has no parameter to train (every one is frozen); with "
                          "pipeline stages, give each stage a LoRA target (lora.target_modules)")
    return Optimizers(owners, opts, [build_lr_scheduler(opt, schedule, total_steps, lr_scale) for opt in opts])


def warmup_steps(cfg: LRScheduler, total_steps: int) -> int:
    """The configured warm-up, shortened to fit a run that is not longer than it (a smoke test
    of a real config): every step but the last then warms up."""
    return min(cfg.warmup_steps, total_steps - 1)


def warmup_note(cfg: LRScheduler, total_steps: int) -> str | None:
    """One line for the log when the warm-up was shortened."""
    if warmup_steps(cfg, total_steps) == cfg.warmup_steps:
        return None
    return (f"titanlite: lr_scheduler.warmup_steps {cfg.warmup_steps} does not fit in training.steps "
            f"{total_steps}; warming up for {warmup_steps(cfg, total_steps)} steps instead")


def lr_factor(step: int, cfg: LRScheduler, total_steps: int) -> float:
    """LR multiplier for the optimizer step numbered `step` (0-based)."""
    warmup = warmup_steps(cfg, total_steps)
    decay_steps = round(cfg.decay_ratio * (total_steps - warmup))
    decay_start = total_steps - decay_steps
    if step < warmup:
        return (step + 1) / (warmup + 1)
    if step < decay_start or decay_steps == 0:
        return 1.0
    # past the schedule's end (a run extended on resume computes the old end's next value) it
    # holds its last value: a linear decay would go below zero there
    progress = min(1.0, (step - decay_start + 1) / decay_steps)
    if cfg.decay_type == "cosine":
        shape = 0.5 * (1 + math.cos(math.pi * progress))
    else:
        shape = 1 - progress
    return cfg.min_lr_factor + (1 - cfg.min_lr_factor) * shape


def build_lr_scheduler(opt: torch.optim.Optimizer, cfg: LRScheduler, total_steps: int,
                       scale: Callable[[int], float] | None = None) -> LambdaLR:
    if scale is None:
        return LambdaLR(opt, lambda step: lr_factor(step, cfg, total_steps))
    return LambdaLR(opt, lambda step: lr_factor(step, cfg, total_steps) * scale(step))
