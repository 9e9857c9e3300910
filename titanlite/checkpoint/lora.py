"""A LoRA run beyond its model (titanlite.layers.lora) and its tensor-parallel plan
(titanlite.parallel.lora): which layers it adapts, by titanlite or transformers name, refused
before launch where PEFT could not load the adapter; what its checkpoints hold and record
(titanlite.checkpoint.state.Transformed); the adapter from a PEFT folder at the start and to one
at the end (titanlite.checkpoint.peft maps the tensors).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import shutil
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn

from titanlite.checkpoint.dcp import load_tensors, model_shapes
from titanlite.checkpoint.hf import HFAdapter
from titanlite.checkpoint.peft import HFLayouts, from_peft, hf_names, to_peft, write_peft
from titanlite.checkpoint.state import ModelState, Transformed
from titanlite.checkpoint.weights import assign_full
from titanlite.config.job import JobConfig, LoRA
from titanlite.errors import ConfigError
from titanlite.layers.lora import LoRASetup, apply_lora, tied_targets
from titanlite.layers.moe import Router
from titanlite.model_spec import ModelSpec


def _matches(name: str, names: dict[str, str], target: str) -> bool:
    """`target` is the module's full titanlite or transformers name, or a dotted suffix of one."""
    return any(n == target or n.endswith("." + target) for n in (name, names.get(name, "")) if n)


def _resolve(targets: list[str], modules: dict[str, nn.Module], names: dict[str, str], key: str,
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


def plan_lora(cfg: LoRA, spec: ModelSpec, args: Any) -> LoRASetup | None:
    """The targets and whole modules of lora (None when lora.rank is 0), resolved on the whole
    model built on meta and refused in one line where they cannot train or be exported: a name
    that takes nothing, a whole module that holds an adapter or shares its weight with a frozen
    one, a target with no transformers weight of its own for PEFT to adapt."""
    if cfg.rank == 0:
        return None
    with torch.device("meta"):
        model = spec.build(args)
    modules = {n: m for n, m in model.named_modules() if n and any(True for _ in m.parameters())}
    shapes = {k: v.shape for k, v in model.state_dict().items()}
    hf = {} if spec.hf is None else hf_names(spec.hf, args, shapes)
    names = {k.removesuffix(".weight"): v.removesuffix(".weight") for k, v in hf.items() if k.endswith(".weight")}
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
    for key, value in (("lora.export_folder", cfg.export_folder), ("lora.initial_adapter", cfg.initial_adapter)):
        if spec.hf is None and value:
            raise ConfigError(f"{key}: model '{spec.name}' has no Hugging Face adapter to map a PEFT adapter with; "
                              f"set {key} = \"\"")
    layout = None if spec.hf is None else HFLayouts(spec.hf, args, shapes)
    for t in sorted(targets) if spec.hf is not None else ():
        try:
            layout(f"{t}.weight")
        except Exception as e:
            raise ConfigError(f"lora.target_modules: {t} has no transformers weight of its own in {spec.name}'s mapping "
                              f"(its weight {e}), so PEFT could not load or merge its adapter; adapt other "
                              "layers") from None
    for f in sorted(full) if spec.hf is not None else ():
        lacking = sorted(k for k in shapes if k.startswith(f + ".") and k not in hf)
        if lacking:
            raise ConfigError(f"lora.train_in_full: {lacking[0]} has no transformers weight of its own in "
                              f"{spec.name}'s mapping, so PEFT could not save {f}; train other modules in full")
    setup = LoRASetup(cfg.rank, cfg.alpha, cfg.dropout, cfg.rslora, frozenset(targets), frozenset(full))
    if cfg.initial_adapter:  # an adapter's size: read it whole once before launch, as every rank will
        from_peft(cfg.initial_adapter, setup, spec.hf, args, shapes)
    apply_lora(model, setup)
    return dataclasses.replace(setup, trained=sum(p.numel() for p in model.parameters() if p.requires_grad),
                               frozen=sum(p.numel() for p in model.parameters() if not p.requires_grad))


def tied(spec: ModelSpec, args: Any, targets: frozenset[str] | tuple[str, ...]) -> dict[str, str]:
    """titanlite.layers.lora.tied_targets of the whole model (built on meta)."""
    with torch.device("meta"):
        return tied_targets(spec.build(args), targets)


def tied_note(tied: Mapping[str, str], step: str = "<step folder>") -> str:
    """What a PEFT folder of an adapter on a tied weight needs said: PEFT loads it on the tied base
    (and warns), right unmerged, but its merge_and_unload adds the adapter to the weight both
    layers share; titanlite's merged export writes the model untied."""
    if not tied:
        return ""
    layer, other = min(tied.items())
    other = other.removesuffix(".weight")
    return (f"; {layer} is tied to {other} and its adapter changes {layer} alone: use the adapter unmerged, or merge "
            f"with python -m titanlite.tools.convert dcp hf {step} OUT (written untied), not PEFT's "
            f"merge_and_unload, which would change {other} too")


def trained_names(parts: list[nn.Module]) -> set[str]:
    return {n for part in parts for n, p in part.named_parameters() if p.requires_grad}


def load_adapter(parts: list[nn.Module], folder: str, setup: LoRASetup, adapter: HFAdapter, args: Any,
                 shapes: Mapping[str, torch.Size]) -> None:
    """lora.initial_adapter into the parts' adapters (and whole modules), on every rank: each
    reads the folder (an adapter's size) and keeps its shards."""
    tensors = from_peft(folder, setup, adapter, args, shapes)
    for part in parts:
        assign_full(part, tensors)
    if dist.get_rank() == 0:
        print(f"titanlite: adapters from {folder} (PEFT)", flush=True)


def export_adapter(parts: list[nn.Module], folder: Path, setup: LoRASetup, adapter: HFAdapter, args: Any,
                   shapes: Mapping[str, torch.Size], base: str, tied: Mapping[str, str]) -> None:
    """The parts' adapters as a PEFT folder, written whole or not at all. Every rank saves its
    shards with DCP (any layout, pipeline stages included) and rank 0 reads them back whole."""
    tmp = folder.with_name(folder.name + ".tmp")
    gathered = tmp / "dcp"
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    dist.barrier()
    dcp.save({"model": ModelState(parts, trained_names(parts))}, checkpoint_id=str(gathered))
    if dist.get_rank() == 0:
        with warnings.catch_warnings():  # DCP's note that it reads in one process, which it does on purpose
            warnings.simplefilter("ignore", UserWarning)
            trained = load_tensors(gathered)
        tensors, config = to_peft(trained, setup, adapter, args, shapes, base)
        write_peft(tmp, tensors, config)
        shutil.rmtree(gathered)
        shutil.rmtree(folder, ignore_errors=True)
        tmp.rename(folder)
        print(f"titanlite: adapter written to {folder} (PEFT){tied_note(tied)}", flush=True)
    dist.barrier()


def checkpointing(setup: LoRASetup, cfg: JobConfig, spec: ModelSpec, args: Any) -> Transformed:
    """What a LoRA run asks of its checkpoints (titanlite.checkpoint.state.Transformed): the adapted
    model's names, the settings and base weights a resumed run must share (recorded), the
    adapter from lora.initial_adapter at the start and as a PEFT folder at the end."""
    c = cfg.checkpoint
    base = ({"path": str(Path(c.initial_load_path).resolve()), "format": c.initial_load_format} if c.initial_load_path
            else {"path": "", "format": "seed", "seed": cfg.training.seed})
    record = json.loads(json.dumps({"lora": setup.record(), "base": base}))
    shapes = model_shapes(spec, args)
    initial = final = None
    if cfg.lora.initial_adapter:
        initial = functools.partial(load_adapter, folder=cfg.lora.initial_adapter, setup=setup, adapter=spec.hf,
                                    args=args, shapes=shapes)
    if cfg.lora.export_folder:
        final = functools.partial(export_adapter, folder=Path(cfg.job.dump_folder) / cfg.lora.export_folder,
                                  setup=setup, adapter=spec.hf, args=args, shapes=shapes, base=base["path"],
                                  tied=tied(spec, args, setup.targets))
    return Transformed(functools.partial(apply_lora, setup=setup), record, initial, final)
