"""A LoRA run beyond its model (titanlite.layers.lora plans and applies the transform) and its
tensor-parallel plan (titanlite.parallel.lora): its targets also by transformers name, refused
before launch where PEFT could not load the adapter; what its checkpoints hold and record
(titanlite.checkpoint.state.Transformed); the adapter from a PEFT folder at the start and to one
at the end (titanlite.checkpoint.peft maps the tensors).
"""

from __future__ import annotations

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

from titanlite.checkpoint.dcp import model_shapes
from titanlite.checkpoint.folder import load_tensors
from titanlite.checkpoint.hf import HFAdapter
from titanlite.checkpoint.peft import HFLayouts, from_peft, hf_names, to_peft, write_peft
from titanlite.checkpoint.state import ModelState, Transformed
from titanlite.checkpoint.weights import assign_full
from titanlite.config.job import JobConfig, LoRA
from titanlite.errors import ConfigError
from titanlite.layers.lora import LoRASetup, apply_lora, plan_lora, tied_targets
from titanlite.model_spec import ModelSpec


def setup_lora(cfg: LoRA, spec: ModelSpec, args: Any) -> LoRASetup | None:
    """lora's transform (None when lora.rank is 0), planned on the whole model built on meta
    (titanlite.layers.lora.plan_lora, which takes the family's Hugging Face names too), then
    refused in one line where PEFT could not hold what it trains: a target with no transformers
    weight of its own, a whole module with a weight transformers does not save, a PEFT folder to
    start from or write without the family's Hugging Face mapping."""
    if cfg.rank == 0:
        return None
    with torch.device("meta"):
        model = spec.build(args)
    shapes = {k: v.shape for k, v in model.state_dict().items()}
    hf = {} if spec.hf is None else hf_names(spec.hf, args, shapes)
    names = {k.removesuffix(".weight"): v.removesuffix(".weight") for k, v in hf.items() if k.endswith(".weight")}
    setup = plan_lora(cfg, model, names)
    for key, value in (("lora.export_folder", cfg.export_folder), ("lora.initial_adapter", cfg.initial_adapter)):
        if spec.hf is None and value:
            raise ConfigError(f"{key}: model '{spec.name}' has no Hugging Face adapter to map a PEFT adapter with; "
                              f"set {key} = \"\"")
    layout = None if spec.hf is None else HFLayouts(spec.hf, args, shapes)
    for t in sorted(setup.targets) if spec.hf is not None else ():
        try:
            layout(f"{t}.weight")
        except Exception as e:
            raise ConfigError(f"lora.target_modules: {t} has no transformers weight of its own in {spec.name}'s mapping "
                              f"(its weight {e}), so PEFT could not load or merge its adapter; adapt other "
                              "layers") from None
    for f in sorted(setup.full) if spec.hf is not None else ():
        lacking = sorted(k for k in shapes if k.startswith(f + ".") and k not in hf)
        if lacking:
            raise ConfigError(f"lora.train_in_full: {lacking[0]} has no transformers weight of its own in "
                              f"{spec.name}'s mapping, so PEFT could not save {f}; train other modules in full")
    if cfg.initial_adapter:  # an adapter's size: read it whole once before launch, as every rank will
        from_peft(cfg.initial_adapter, setup, spec.hf, args, shapes)
    return setup


def tied_layers(spec: ModelSpec, args: Any, targets: frozenset[str] | tuple[str, ...]) -> dict[str, str]:
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
                                  tied=tied_layers(spec, args, setup.targets))
    return Transformed(functools.partial(apply_lora, setup=setup), record, initial, final)
