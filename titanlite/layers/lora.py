"""Low-rank adapters (LoRA, Hu et al. 2021) on linear layers.

A target nn.Linear keeps its weight W, frozen, under its own name, and gains two small trained
linears: y = W x + scale * B A dropout(x), A [rank, in] and B [out, rank] (named `lora_A.weight`
and `lora_B.weight`, as PEFT names them). B starts at zero, so a run starts from the base model's
function; A is drawn as PEFT draws it, U(-1/sqrt(in), 1/sqrt(in)), by name (titanlite.layers.init),
so every layout starts from the same adapters. scale = alpha / rank, or alpha / sqrt(rank) with
rsLoRA (Kalajdzievski 2023). This file is the transform: planned (plan_lora, resolving the
config's names on the whole model), applied (apply_lora, which titanlite.parallel.apply calls
before the parallel plan; titanlite.parallel.lora shards the adapters) and recorded (LoRASetup),
and the single-device math (LoRALinear).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from titanlite.config.job import LoRA
from titanlite.errors import ConfigError
from titanlite.layers import init
from titanlite.layers.moe import Router


@dataclass(frozen=True)
class LoRASetup:
    """What the transform does to a model: planned once (plan_lora), applied by apply_lora, saved
    in each checkpoint's titanlite.json (`record`) and read back from it (`of`)."""

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

    def record(self) -> dict[str, Any]:
        """The settings a checkpoint records (titanlite.json's "lora"): those a resumed run must share."""
        return {"rank": self.rank, "alpha": self.alpha, "rslora": self.rslora, "dropout": self.dropout,
                "targets": sorted(self.targets), "full": sorted(self.full)}

    @classmethod
    def of(cls, saved: Mapping[str, Any]) -> LoRASetup:
        """The setup a checkpoint recorded (`record`)."""
        return cls(int(saved["rank"]), float(saved["alpha"]), float(saved["dropout"]), bool(saved["rslora"]),
                   frozenset(saved["targets"]), frozenset(saved["full"]))


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
    off: bool = False
    """True inside adapters_off: the layer is its base linear, bit for bit."""

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
        if self.off:
            return base
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


def _matches(name: str, names: Mapping[str, str], target: str) -> bool:
    """`target` is the module's full titanlite or Hugging Face name, or a dotted suffix of one."""
    return any(n == target or n.endswith("." + target) for n in (name, names.get(name, "")) if n)


def _resolve(targets: list[str], modules: dict[str, nn.Module], names: Mapping[str, str], key: str,
             kind: type | None) -> set[str]:
    """Full names of the modules (of `kind`, if given) each of `targets` takes; a target that takes
    none is refused, naming what it does match."""
    out = set()
    for target in targets:
        hit = {n for n, m in modules.items() if _matches(n, names, target)}
        took = {n for n in hit if kind is None or type(modules[n]) is kind}
        if not took:
            if hit:
                first = min(hit)
                raise ConfigError(f"{key}: '{target}' names {first}, a {type(modules[first]).__name__}, and no "
                                  f"{kind.__name__}: adapters go on linear layers (routed experts' stacked weights "
                                  "take none); name attention or feed-forward linears, e.g. wq or q_proj")
            examples = sorted({n.split(".", 2)[-1] for n, m in modules.items() if type(m) is nn.Linear})[:6]
            raise ConfigError(f"{key}: '{target}' matches no module of this model; its linear layers are named "
                              f"like {', '.join(examples)}, or by the Hugging Face names of the family's mapping")
        out |= took
    return out


def plan_lora(cfg: LoRA, model: nn.Module, names: Mapping[str, str]) -> LoRASetup:
    """The transform lora asks of `model` (the whole model, on meta, which it adapts to count what
    trains): its targets and whole modules by titanlite name or by `names` (a module's full name ->
    its Hugging Face name), refused in one line where they cannot train as PEFT would: a name that
    takes nothing, a MoE router's gate, a whole module that holds an adapter or shares its weight
    with a frozen one. A target that shares its weight (a tied output) is untied by its adapter
    (tied_targets)."""
    modules = {n: m for n, m in model.named_modules() if n and any(True for _ in m.parameters())}
    targets = _resolve(cfg.target_modules, modules, names, "lora.target_modules", nn.Linear)
    routers = sorted(t for t in targets if isinstance(modules.get(t.rpartition(".")[0]), Router))
    if routers:  # transformers' MoE routers are modules of their own, with a weight but no nn.Linear
        raise ConfigError(f"lora.target_modules takes {routers[0]}, a MoE router's gate, which transformers holds as "
                          "a router module PEFT adapts no linear of; train it whole (lora.train_in_full) or leave it")
    full = _resolve(cfg.train_in_full, modules, names, "lora.train_in_full", None)
    for f in sorted(full):
        inside = sorted(t for t in targets if t == f or t.startswith(f + ".") or f.startswith(t + "."))
        if inside:
            raise ConfigError(f"lora.train_in_full takes {f}, which lora.target_modules adapts too ({inside[0]}): a "
                              "module trains whole or through an adapter; leave it out of one of them")
    shared: dict[int, list[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        shared.setdefault(id(p), []).append(n)
    for group in (g for g in shared.values() if len(g) > 1):
        if any(n.startswith(f + ".") for n in group for f in full):
            raise ConfigError(f"lora.train_in_full: {group[0]} and {group[1]} are one weight (tied), which PEFT cannot "
                              "save as a module trained whole; adapt it instead (lora.target_modules) or train an "
                              "untied model")
    setup = LoRASetup(cfg.rank, cfg.alpha, cfg.dropout, cfg.rslora, frozenset(targets), frozenset(full))
    apply_lora(model, setup)
    return dataclasses.replace(setup, trained=sum(p.numel() for p in model.parameters() if p.requires_grad),
                               frozen=sum(p.numel() for p in model.parameters() if not p.requires_grad))


def tied_targets(model: nn.Module, targets: frozenset[str] | tuple[str, ...]) -> dict[str, str]:
    """Each target layer whose weight the model shares with another parameter (a tied output
    layer) -> that parameter's name. Its adapter unties the two: the embedding keeps W, the
    output computes with W + scale B A, so the trained model is an untied one."""
    shared: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        shared.setdefault(id(p), []).append(name)
    return {name.removesuffix(".weight"): next(other for other in group if other != name)
            for group in shared.values() if len(group) > 1
            for name in group if name.endswith(".weight") and name.removesuffix(".weight") in targets}


def apply_lora(model: nn.Module, setup: LoRASetup) -> None:
    """Adapt the target layers this model (or pipeline stage) holds, then freeze every parameter
    but the adapters and those of the modules trained whole."""
    # a pipeline stage holds the layers of other stages as nn.Identity
    for name, module in [(n, m) for n, m in model.named_modules() if n in setup.targets and type(m) is nn.Linear]:
        LoRALinear.adapt(module, setup.rank, setup.scale, setup.dropout)
    own = {f"{t}.lora_{x}.weight" for t in setup.targets for x in "AB"}
    for name, p in model.named_parameters():
        p.requires_grad_(name in own or any(name.startswith(f + ".") for f in setup.full))


@contextlib.contextmanager
def adapters_off(model: nn.Module) -> Iterator[None]:
    """Within: every adapted layer of `model` computes its base linear alone (no adapter, no
    dropout draw), bit-identical to the model before LoRA. A LoRA run's reference model
    (preference optimization, RL's KL term) is the same model inside this, with no second copy."""
    layers = [m for m in model.modules() if isinstance(m, LoRALinear)]
    for m in layers:
        m.off = True
    try:
        yield
    finally:
        for m in layers:
            m.off = False
