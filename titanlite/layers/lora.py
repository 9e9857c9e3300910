"""Low-rank adapters (LoRA, Hu et al. 2021) on linear layers.

A target nn.Linear keeps its weight W, frozen, under its own name, and gains two small trained
linears: y = W x + scale * B A dropout(x), A [rank, in] and B [out, rank] (named `lora_A.weight`
and `lora_B.weight`, as PEFT names them). B starts at zero, so a run starts from the base model's
function; A is drawn as PEFT draws it, U(-1/sqrt(in), 1/sqrt(in)), by name (titanlite.layers.init),
so every layout starts from the same adapters. scale = alpha / rank, or alpha / sqrt(rank) with
rsLoRA (Kalajdzievski 2023). titanlite.parallel.lora applies this to a model before its
parallel plan; this file is the single-device math.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from titanlite.layers import init


@dataclass(frozen=True)
class LoRASetup:
    """What the transform does to a model, resolved once (titanlite.parallel.lora.plan_lora)."""

    rank: int
    alpha: float
    dropout: float
    rslora: bool
    targets: frozenset[str]
    """Full names of the linear layers that get an adapter (a pipeline stage holds some)."""
    full: frozenset[str]
    """Full names of the modules trained whole."""
    trained: int = 0
    """Parameters that train (adapters and whole modules), over the whole model."""
    frozen: int = 0
    """Parameters that are frozen, over the whole model."""

    @property
    def scale(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)


DROPOUT_MASKS = ("its masks come from torch's generator, seeded alike on every rank, so ranks that hold different "
                 "rows of a batch drop the same positions of them: a run with dropout equals neither one process nor "
                 "another layout number for number (without dropout it does)")
"""The truth about LoRA dropout's masks, which a run with lora.dropout prints (titanlite.train)."""


class LoRALinear(nn.Linear):
    """An nn.Linear with an adapter. Made from an existing nn.Linear by `adapt`, which keeps the
    module (its weight, name and hooks) and adds `lora_A`, `lora_B`."""

    lora_A: nn.Linear
    lora_B: nn.Linear
    scale: float
    dropout: float

    @classmethod
    def adapt(cls, linear: nn.Linear, rank: int, scale: float, dropout: float) -> LoRALinear:
        if type(linear) is not nn.Linear:
            raise TypeError(f"LoRALinear adapts a plain nn.Linear, not {type(linear).__qualname__}")
        linear.__class__ = cls  # the same object: its parent, weight and name stay as they are
        w = linear.weight
        linear.lora_A = nn.Linear(linear.in_features, rank, bias=False, device=w.device, dtype=w.dtype)
        linear.lora_B = nn.Linear(rank, linear.out_features, bias=False, device=w.device, dtype=w.dtype)
        linear.scale, linear.dropout = scale, dropout
        # on a real device A holds nn.Linear's kaiming-uniform draw (PEFT's); on meta, materialize draws it
        nn.init.zeros_(linear.lora_B.weight)
        return linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = F.linear(x, self.weight, self.bias)
        # the scale on the rank-r activations, not on B's output: one elementwise pass over a
        # tensor of the layer's full width fewer, in forward and in backward (eager steps are
        # memory-bound there: the dry run put eager LoRA on Llama 3 8B at 9% slower than full
        # fine-tuning with it after B); PEFT scales after B, which differs by rounding only
        return base + self.lora_B(self.lora_A(F.dropout(x, self.dropout, self.training)) * self.scale)

    @torch.no_grad()
    def init_own(self, seed: int, prefix: str) -> None:
        """A ~ U(-1/sqrt(in), 1/sqrt(in)) drawn for its full name (PEFT's kaiming-uniform bound), B = 0.
        titanlite.layers.init.materialize calls it after the model's own init_weights."""
        bound = 1 / math.sqrt(self.in_features)
        init.uniform_(self.lora_A.weight, f"{prefix}.lora_A.weight", seed, -bound, bound)
        init.zeros_(self.lora_B.weight)


def apply_lora(model: nn.Module, setup: LoRASetup) -> None:
    """Adapt the target layers this model (or pipeline stage) holds, then freeze every parameter
    but the adapters and those of the modules trained whole."""
    # a pipeline stage holds the layers of other stages as nn.Identity
    for name, module in [(n, m) for n, m in model.named_modules() if n in setup.targets and type(m) is nn.Linear]:
        LoRALinear.adapt(module, setup.rank, setup.scale, setup.dropout)
    own = {f"{t}.lora_{x}.weight" for t in setup.targets for x in "AB"}
    for name, p in model.named_parameters():
        p.requires_grad_(name in own or any(name.startswith(f + ".") for f in setup.full))
