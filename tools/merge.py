"""Average checkpoints' weights (checkpoint merging), in fp32, in one process:

    python -m titanlite.tools.merge CKPT [CKPT ...] OUT [--weights W1,W2,...] [--format dcp|hf] [--dtype D]

Each CKPT is a titanlite checkpoint folder (step-N, export-step-N, a merge's step-N/merged, a
converted one); only the model is read, one tensor at a time from every checkpoint (DCP reads
just that tensor's bytes), so a model larger than this host's memory merges. The average is
sum(w_i x weights_i) / sum(w_i) in fp32, the checkpoints summed in the order given (equal
weights by default), written in each tensor's saved dtype (or --dtype). OUT is a model-only
titanlite checkpoint (dcp: for checkpoint.initial_load_path or titanlite.tools.convert), or with
--format hf a transformers folder, written one decoder block at a time. Checkpoints of different
models (family, model args, tensor names or shapes) are refused. docs/recipes.md.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from titanlite.checkpoint.hf import INDEX
from titanlite.checkpoint.merge import (INFO, average, check_mergeable, merged_info, model_entries, read_infos,
                                        write_lazily)
from titanlite.errors import ConfigError
from titanlite.model_spec import get_model_spec
from titanlite.tools.convert import _rebuild


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
        parts = name.split(".")
        groups.setdefault(int(parts[1]) if parts[0] == blocks and parts[1].isdigit() else -1, []).append(name)
    return [groups[b] for b in sorted(groups)]


def merge(paths: list[Path], out: Path, weights: list[float], fmt: str = "dcp", dtype: str = "") -> None:
    infos = read_infos(paths)
    entries = [model_entries(p) for p in paths]
    check_mergeable(paths, infos, entries)
    if out.exists():
        raise ConfigError(f"{out} exists; give the merge a new folder")
    cast = getattr(torch, dtype) if dtype else None
    shapes = {k: (e.size, cast or e.properties.dtype) for k, e in entries[0].items()}

    def compute(name: str) -> torch.Tensor:
        return average(paths, name, entries, weights).to(shapes[name][1])

    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    if fmt == "dcp":
        write_lazily(tmp, shapes, compute)
        (tmp / INFO).write_text(json.dumps(merged_info(infos, paths, weights), indent=2))
    else:
        spec = get_model_spec(infos[0]["model"])
        if spec.hf is None:
            raise ConfigError(f"--format hf: model '{spec.name}' has no Hugging Face adapter")
        args = _rebuild(list(spec.flavors.values()), infos[0]["args"])
        groups = _blocks(list(shapes), spec.blocks)
        tmp.mkdir(parents=True)
        weight_map, total = {}, 0
        for i, names in enumerate(groups, 1):  # one block's tensors at a time: an adapter maps them together
            block = spec.hf.to_hf({n: compute(n) for n in names}, args)
            file = f"model-{i:05d}-of-{len(groups):05d}.safetensors"
            save_file({k: v.contiguous() for k, v in block.items()}, str(tmp / file), metadata={"format": "pt"})
            weight_map |= dict.fromkeys(block, file)
            total += sum(v.numel() * v.element_size() for v in block.values())
        (tmp / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
        out_dtype = cast or next(iter(shapes.values()))[1]
        (tmp / "config.json").write_text(json.dumps(spec.hf.config_to_hf(args, out_dtype), indent=2))
    tmp.rename(out)  # whole or absent


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
