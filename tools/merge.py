"""Average checkpoints' weights (checkpoint merging), in fp32, in one process:

    python -m titanlite.tools.merge CKPT [CKPT ...] OUT [--weights W1,W2,...] [--format dcp|hf] [--dtype D]

Each CKPT is a titanlite checkpoint folder (step-N, export-step-N, a merge's step-N/merged, a
converted one); only the model is read, one tensor at a time from every checkpoint (DCP reads
just that tensor's bytes), so a model larger than this host's memory merges. A LoRA run's
checkpoint is the model it defines: each base weight plus scale B A in fp32, as convert dcp hf
merges it (its base read one tensor at a time from a titanlite checkpoint, whole from a
transformers folder or the seed). The average is sum(w_i x model_i) / sum(w_i) in fp32, the
checkpoints summed in the order given (equal weights by default), written in each tensor's
saved dtype (or --dtype). OUT is a model-only titanlite checkpoint (dcp: for
checkpoint.initial_load_path or titanlite.tools.convert), or with --format hf a transformers
folder, written one decoder block at a time where the family maps a block alone; it is written
whole or not at all. Checkpoints a resume would refuse (another family, other model-identity
args, tensor names or shapes) are refused. docs/recipes.md.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from titanlite.checkpoint.dcp import check_saved_model, model_shapes
from titanlite.checkpoint.folder import INFO, read_info, read_metadata, saved_args
from titanlite.checkpoint.hf import INDEX, HFAdapter
from titanlite.checkpoint.merge import (Member, average, check_mergeable, merged_info, model_entries, plain_member,
                                        read_tensor, write_lazily)
from titanlite.layers.lora import LoRASetup
from titanlite.errors import ConfigError
from titanlite.model_spec import ModelSpec, get_model_spec
from titanlite.saved_model import base_weights


def _weights(text: str, n: int) -> list[float]:
    if not text:
        return [1.0] * n
    try:
        weights = [float(w) for w in text.split(",")]
    except ValueError:
        raise ConfigError(f"--weights: expected {n} numbers separated by commas, got '{text}'") from None
    if len(weights) != n or min(weights) < 0 or not sum(weights) > 0:
        raise ConfigError(f"--weights: need {n} weights (one per checkpoint), each >= 0 and not all 0; got '{text}'")
    return weights


def _blocks(names: list[str], blocks: str) -> list[list[str]]:
    """Tensor names by decoder block (<blocks>.<i>.), those outside every block first."""
    groups: dict[int, list[str]] = {}
    for name in names:
        rest = name.removeprefix(blocks + ".").split(".")[0] if name.startswith(blocks + ".") else ""
        groups.setdefault(int(rest) if rest.isdigit() else -1, []).append(name)
    return [groups[b] for b in sorted(groups)]


def _by_block(adapter: HFAdapter, args: Any, block: list[str], shapes: dict[str, tuple[torch.Size, torch.dtype]]
              ) -> bool:
    """Whether the family's to_hf maps one block's tensors alone (tried on meta: no memory; vectors
    as zeros, which to_hf may test); Qwen3.5's maps every block at once."""
    probe = {n: torch.zeros((), dtype=d).expand(*s) if len(s) < 2 else torch.empty(s, dtype=d, device="meta")
             for n, (s, d) in ((n, shapes[n]) for n in block)}
    try:
        adapter.to_hf(probe, args)
    except Exception:  # it looked for another block's tensors
        return False
    return True


def _base_reader(spec: ModelSpec, args: Any, base: dict[str, Any]) -> Callable[[str], torch.Tensor]:
    """A LoRA run's base weights by name: a dcp base one tensor at a time, a transformers folder
    or the seed as a whole model, held while the merge runs."""
    if base["format"] == "dcp":  # checked as the run's initial load checked it
        whole = model_shapes(spec, args)
        check_saved_model(Path(base["path"]), read_info(base["path"]), read_metadata(Path(base["path"])), spec, args,
                          whole, whole)
        entries = model_entries(Path(base["path"]))
        return lambda name: read_tensor(Path(base["path"]), name, entries[name])
    whole = base_weights(spec, args, base)
    return whole.__getitem__


def members(paths: list[Path]) -> list[Member]:
    """Each checkpoint as the model it defines (a LoRA run's: its base plus its adapters)."""
    out, bases = [], {}
    for path in paths:
        info = read_info(path)
        record = info.get("transform", {})
        if "lora" not in record:
            out.append(plain_member(path, info))
            continue
        spec = get_model_spec(info["model"])
        args = saved_args(list(spec.flavors.values()), info["args"])
        key = json.dumps([info["model"], info["args"], record["base"]], sort_keys=True)
        if key not in bases:  # one copy of a base the checkpoints share
            bases[key] = _base_reader(spec, args, record["base"])
        shapes = {k: (s, torch.float32) for k, s in model_shapes(spec, args).items()}
        out.append(Member(path, info, model_entries(path), shapes, LoRASetup.of(record["lora"]), bases[key]))
    return out


def merge(paths: list[Path], out: Path, weights: list[float], fmt: str = "dcp", dtype: str = "") -> None:
    if out.exists():
        raise ConfigError(f"{out} exists; give the merge a new folder")
    group = members(paths)
    check_mergeable(group)
    cast = getattr(torch, dtype) if dtype else None
    shapes = {k: (s, cast or d) for k, (s, d) in group[0].shapes.items()}

    def compute(name: str) -> torch.Tensor:
        return average(group, name, weights).to(shapes[name][1])

    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        if fmt == "dcp":
            write_lazily(tmp, shapes, compute)
            (tmp / INFO).write_text(json.dumps(merged_info([m.info for m in group], paths, weights), indent=2))
        else:
            _write_hf(tmp, group[0].info, shapes, compute)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # whole or absent
        raise
    tmp.rename(out)


def _write_hf(tmp: Path, info: dict[str, Any], shapes: dict[str, tuple[torch.Size, torch.dtype]],
              compute: Callable[[str], torch.Tensor]) -> None:
    """A transformers folder, one decoder block at a time where the family maps a block alone."""
    spec = get_model_spec(info["model"])
    if spec.hf is None:
        raise ConfigError(f"--format hf: model '{spec.name}' has no Hugging Face adapter")
    args = saved_args(list(spec.flavors.values()), info["args"])
    groups = _blocks(list(shapes), spec.blocks)
    if not _by_block(spec.hf, args, groups[-1], shapes):
        groups = [list(shapes)]
    tmp.mkdir(parents=True)
    weight_map, total = {}, 0
    for i, names in enumerate(groups, 1):  # one block's tensors at a time: an adapter maps them together
        block = spec.hf.to_hf({n: compute(n) for n in names}, args)
        file = f"model-{i:05d}-of-{len(groups):05d}.safetensors"
        save_file({k: v.contiguous() for k, v in block.items()}, str(tmp / file), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(block, file)
        total += sum(v.numel() * v.element_size() for v in block.values())
    (tmp / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    (tmp / "config.json").write_text(json.dumps(spec.hf.config_to_hf(args, next(iter(shapes.values()))[1]), indent=2))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m titanlite.tools.merge", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("paths", nargs="+", metavar="CKPT... OUT")
    parser.add_argument("--weights", default="", help="one weight per checkpoint, comma-separated (default: equal)")
    parser.add_argument("--format", default="dcp", choices=("dcp", "hf"), help="OUT's format (default dcp)")
    parser.add_argument("--dtype", default="", choices=("", "float32", "bfloat16", "float16"),
                        help="OUT's dtype (default: each tensor's saved dtype)")
    a = parser.parse_args(argv)
    try:
        if len(a.paths) < 2:
            raise ConfigError("give at least one checkpoint and the output folder: CKPT [CKPT ...] OUT")
        *paths, out = [Path(p) for p in a.paths]
        for p in paths:
            if not p.is_dir():
                raise ConfigError(f"{p} is not a checkpoint folder")
        weights = _weights(a.weights, len(paths))
        merge(paths, out, weights, a.format, a.dtype)
    except ConfigError as e:
        sys.exit(f"titanlite: error: {e}")
    print(f"titanlite: wrote {out} ({a.format}): the average of {len(paths)} checkpoint(s), weights {weights}")


if __name__ == "__main__":
    main()
