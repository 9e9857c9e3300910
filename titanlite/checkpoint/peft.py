"""LoRA adapters as PEFT folders (adapter_config.json + adapter_model.safetensors), both ways, and
merged into the base model, without peft installed.

An adapter follows its weight's mapping: W [out, in] maps to one transformers weight by the
family's own HFAdapter.to_hf, which renames it and may permute its rows and columns (Llama 3's
q and k rows). Then B's rows move as W's rows and A's columns as W's columns (P W Q + s P B A Q
= P (W + s B A) Q). The permutations are read off to_hf itself, run on index tensors, so they
cannot drift from the weights' mapping. A weight to_hf does not map to one transformers weight
by a permutation (fused with another, or split) has no adapter PEFT could load: `hf_layout`
says so, and titanlite.checkpoint.lora.setup_lora refuses it as a target before launch.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from titanlite.checkpoint.hf import HFAdapter
from titanlite.errors import ConfigError
from titanlite.layers.lora import LoRASetup

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model."
"""Where PeftModel keeps the transformers model: every saved key starts with it."""


# ---- the weights' mapping, read off the family's to_hf ------------------------------

def _untied(args: Any) -> Any:
    # a tied output is dropped by to_hf (transformers re-ties it): asked about alone, it has its own
    # name (lm_head), which PEFT adapts; an adapter on it unties the model, and the merged exports
    # are written untied (titanlite.layers.lora.tied_targets)
    return dataclasses.replace(args, tie_embeddings=False) if getattr(args, "tie_embeddings", False) else args


def _module(key: str) -> str:
    return key.removesuffix(".weight")


def _mapped(adapter: HFAdapter, args: Any, key: str, probe: torch.Tensor, shapes: Mapping[str, torch.Size],
            whole: bool) -> dict[str, torch.Tensor]:
    """What to_hf makes of `probe` as weight `key`, alone or (`whole`, for a family that maps the
    whole model at once) among the model's other tensors, on meta (no memory) except the key's
    own block and the vectors, as zeros that take none until to_hf copies them: the outputs not
    on meta."""
    state = {key: probe}
    if whole:
        head, _, rest = key.partition(".")
        mine = f"{head}.{rest.partition('.')[0]}." if head == "layers" else None
        # a vector (a norm, a bias, a router's selection bias) as zeros too, which to_hf may test
        state = {k: torch.zeros((), dtype=probe.dtype).expand(*s) if (mine and k.startswith(mine)) or len(s) < 2
                 else torch.empty(s, device="meta") for k, s in shapes.items()} | state
    return {k: v for k, v in adapter.to_hf(state, _untied(args)).items() if not (whole and v.is_meta)}


def hf_names(adapter: HFAdapter, args: Any, shapes: Mapping[str, torch.Size]) -> dict[str, str]:
    """titanlite name -> the one transformers name to_hf gives it alone, for each key of `shapes`
    that to_hf maps by itself (on meta: no memory); a family whose to_hf maps the whole model at
    once (Qwen3.5) gives none."""
    out = {}
    for key, shape in shapes.items():
        try:
            got = _mapped(adapter, args, key, torch.empty(shape, device="meta"), shapes, whole=False)
        except Exception:  # to_hf needs more of the state dict
            continue
        if len(got) == 1:
            out[key] = next(iter(got))
    return out


def _probe(adapter: HFAdapter, args: Any, key: str, shapes: Mapping[str, torch.Size], dim: int,
           whole: bool) -> tuple[str, torch.Tensor]:
    """Where to_hf sends the rows (dim 0) or columns (dim 1) of `key`: its transformers name and
    the order (transformers index i holds titanlite index order[i]); `whole`: as `_mapped`."""
    shape = shapes[key]
    index = torch.arange(1, shape[dim] + 1, dtype=torch.float32)  # exact to 2**24; from 1: 0 is the others'
    probe = (index[:, None] if dim == 0 else index[None, :]).expand(*shape)
    got = _mapped(adapter, args, key, probe, shapes, whole)
    got = {k: v for k, v in got.items() if v.count_nonzero() > 0} if whole else got  # the rest of its block: zeros
    if len(got) != 1:
        raise ConfigError(f"{'is split into' if len(got) > 1 else 'maps to'} {len(got)} transformers weights"
                          + (f" ({', '.join(sorted(got)[:2])})" if got else ""))
    (name, t), = got.items()
    if tuple(t.shape) != tuple(shape):
        raise ConfigError(f"maps to {name} of shape {tuple(t.shape)}, not its own {tuple(shape)} (fused or reshaped)")
    order = t[:, 0] if dim == 0 else t[0, :]
    line = order[:, None] if dim == 0 else order[None, :]
    if not torch.equal(order.sort().values, index) or not torch.equal(t, line.expand_as(t)):
        raise ConfigError(f"maps to {name} by more than a permutation of its rows and columns")
    return name, order.long() - 1


def hf_layout(adapter: HFAdapter, args: Any, key: str, shapes: Mapping[str, torch.Size]
              ) -> tuple[str, torch.Tensor, torch.Tensor]:
    """(transformers weight name, row order, column order) of weight `key` (its shape in `shapes`,
    the whole model's), or a ConfigError saying why it has no transformers weight of its own."""
    found = []
    for dim in (0, 1):
        try:
            found.append(_probe(adapter, args, key, shapes, dim, whole=False))
        except Exception:  # alone it is not enough for this family's to_hf
            found.append(_probe(adapter, args, key, shapes, dim, whole=True))
    (name, rows), (other, cols) = found
    if name != other:
        raise ConfigError(f"its rows map to {name} but its columns to {other}")
    return name, rows, cols


class HFLayouts:
    """`hf_layout` of many weights, read once per name within a block: the orders found for the
    same name and shape in two blocks that agree serve the other blocks (a probe copies a weight's
    size), each weight's own transformers name still read from to_hf (on meta). A name whose
    orders differ between blocks is read in every block."""

    def __init__(self, adapter: HFAdapter, args: Any, shapes: Mapping[str, torch.Size]) -> None:
        self.adapter, self.args, self.shapes = adapter, args, shapes
        self.seen: dict[tuple, list[tuple[torch.Tensor, torch.Tensor]] | None] = {}

    def __call__(self, key: str) -> tuple[str, torch.Tensor, torch.Tensor]:
        head, _, rest = key.partition(".")
        block, _, inner = rest.partition(".")
        slot = (inner, tuple(self.shapes[key])) if head == "layers" and block.isdigit() else None
        orders = self.seen.get(slot, [])
        name = hf_names(self.adapter, self.args, {key: self.shapes[key]}).get(key)
        if slot is None or orders is None or len(orders) < 2 or name is None:
            name, rows, cols = hf_layout(self.adapter, self.args, key, self.shapes)
            if slot is not None and orders is not None and len(orders) < 2:
                agree = all(torch.equal(rows, r) and torch.equal(cols, c) for r, c in orders)
                self.seen[slot] = [*orders, (rows, cols)] if agree else None
            return name, rows, cols
        return name, *orders[0]


# ---- PEFT folders -----------------------------------------------------------------------

def _target_list(modules: list[str], every: list[str]) -> list[str]:
    """PEFT's target_modules: the modules' last names where those select exactly them among
    `every` transformers module, else their full names (PEFT matches a name or a dotted suffix)."""
    short = sorted({m.rpartition(".")[2] for m in modules})
    chosen = {m for m in every if m.rpartition(".")[2] in short}
    return short if chosen == set(modules) else sorted(modules)


def to_peft(state: Mapping[str, torch.Tensor], setup: LoRASetup, adapter: HFAdapter, args: Any,
            shapes: Mapping[str, torch.Size], base: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """A LoRA run's trained tensors (full, titanlite names: `<layer>.lora_A.weight`, ... and the
    whole modules' parameters) -> PEFT's tensors and adapter_config.json. `shapes`: the base
    model's weights (whole model); `base`: base_model_name_or_path."""
    tensors, targets, layout = {}, [], HFLayouts(adapter, args, shapes)
    for layer in sorted(setup.targets):
        name, rows, cols = layout(f"{layer}.weight")
        module = _module(name)
        targets.append(module)
        tensors[f"{PREFIX}{module}.lora_A.weight"] = state[f"{layer}.lora_A.weight"][:, cols].contiguous()
        tensors[f"{PREFIX}{module}.lora_B.weight"] = state[f"{layer}.lora_B.weight"][rows].contiguous()
    full_modules = []
    for module in sorted(setup.full):
        own = {k: v for k, v in state.items() if k.startswith(f"{module}.")}
        mapped = adapter.to_hf(own, _untied(args))
        tensors |= {PREFIX + k: v.contiguous() for k, v in mapped.items()}
        full_modules += sorted({k.rpartition(".")[0] for k in mapped})
    every = sorted({_module(n) for n in hf_names(adapter, args, shapes).values()})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base, "r": setup.rank,
              "lora_alpha": setup.alpha, "lora_dropout": setup.dropout, "use_rslora": setup.rslora,
              "target_modules": _target_list(targets, every), "modules_to_save": full_modules or None,
              "bias": "none", "fan_in_fan_out": False, "init_lora_weights": True, "inference_mode": True,
              "layers_to_transform": None, "layers_pattern": None, "rank_pattern": {}, "alpha_pattern": {}}
    return tensors, config


def write_peft(folder: str | Path, tensors: Mapping[str, torch.Tensor], config: Mapping[str, Any]) -> None:
    """adapter_model.safetensors and adapter_config.json, as PeftModel.save_pretrained writes them."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(folder / WEIGHTS),
              metadata={"format": "pt"})
    (folder / CONFIG).write_text(json.dumps(config, indent=2))


def read_peft_config(folder: str | Path) -> dict[str, Any]:
    path = Path(folder) / CONFIG
    try:
        config = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"lora.initial_adapter: cannot read {path} ({e}); expected a folder PEFT's save_pretrained "
                          "wrote") from None
    if config.get("peft_type") != "LORA":
        raise ConfigError(f"{path}: peft_type is {config.get('peft_type')!r}, not 'LORA'")
    return config


def from_peft(folder: str | Path, setup: LoRASetup, adapter: HFAdapter, args: Any,
              shapes: Mapping[str, torch.Size]) -> dict[str, torch.Tensor]:
    """A PEFT folder -> the run's adapter tensors (titanlite names, `setup`'s targets), after
    refusing in one line a folder made for other settings: another rank, alpha or scaling, or
    another set of adapted layers or whole modules (nothing is left at its initial value unsaid)."""
    folder, config = Path(folder), read_peft_config(folder)
    where = f"lora.initial_adapter {folder}"
    theirs = (config.get("r"), float(config.get("lora_alpha", 8)), bool(config.get("use_rslora", False)))
    if theirs != (setup.rank, setup.alpha, setup.rslora) or config.get("rank_pattern") or config.get("alpha_pattern"):
        raise ConfigError(f"{where} has r={theirs[0]}, lora_alpha={theirs[1]:g}, use_rslora={theirs[2]}"
                          f"{' and per-module patterns' if config.get('rank_pattern') or config.get('alpha_pattern') else ''}"
                          f"; this run has lora.rank {setup.rank}, lora.alpha {setup.alpha:g}, lora.rslora {setup.rslora}: "
                          "set those to the folder's")
    try:
        with safe_open(str(folder / WEIGHTS), framework="pt") as f:
            saved = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:
        raise ConfigError(f"{where}: unreadable {WEIGHTS} ({e})") from None
    out, used, layout = {}, set(), HFLayouts(adapter, args, shapes)
    for layer in sorted(setup.targets):
        name, rows, cols = layout(f"{layer}.weight")
        for part, (dim, order) in (("lora_A", (1, cols)), ("lora_B", (0, rows))):
            key = f"{PREFIX}{_module(name)}.{part}.weight"
            if key not in saved:
                raise ConfigError(f"{where} has no {key}, the adapter of {layer} (lora.target_modules); it adapts "
                                  f"other layers: give this run its target_modules")
            back = torch.argsort(order)  # transformers index i holds titanlite index order[i]
            out[f"{layer}.{part}.weight"] = saved[key].index_select(dim, back)
            used.add(key)
    for module in sorted(setup.full):
        own = {k: v for k, v in shapes.items() if k.startswith(f"{module}.")}
        for key, hf_key in hf_names(adapter, args, own).items():  # (setup_lora checked each has one)
            if PREFIX + hf_key not in saved:
                raise ConfigError(f"{where} has no {PREFIX + hf_key} for {module} (lora.train_in_full)")
            out |= adapter.from_hf({hf_key: saved[PREFIX + hf_key]}, _untied(args))
            used.add(PREFIX + hf_key)
    extra = sorted(saved.keys() - used)
    if extra:
        raise ConfigError(f"{where} holds {extra[0]}" + (f" (and {len(extra) - 1} more)" if len(extra) > 1 else "")
                          + ", which this run does not train; give this run the folder's target_modules and "
                            "modules_to_save (lora.target_modules, lora.train_in_full)")
    return out


def merge(base: Mapping[str, torch.Tensor], trained: Mapping[str, torch.Tensor], setup: LoRASetup
          ) -> dict[str, torch.Tensor]:
    """The base model's full state dict with each adapter added to its weight, W + scale B A in
    float32, and the whole modules' trained weights in place (titanlite names, float32)."""
    out = {k: v.float() for k, v in base.items()}
    for key, value in trained.items():
        if ".lora_" not in key:
            out[key] = value.float()
    for layer in sorted(setup.targets):
        a, b = trained[f"{layer}.lora_A.weight"].float(), trained[f"{layer}.lora_B.weight"].float()
        out[f"{layer}.weight"] = out[f"{layer}.weight"] + (b @ a) * setup.scale
    return out
