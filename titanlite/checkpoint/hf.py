"""Hugging Face folders: config.json plus (sharded) safetensors, read and written without transformers.

A model family describes its own mapping with an `HFAdapter` (see models/llama3/hf.py);
this file only moves full tensors between memory and disk.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from titanlite.errors import ConfigError

INDEX = "model.safetensors.index.json"


@dataclass(frozen=True)
class HFAdapter:
    """How one model family maps to and from its transformers counterpart (full tensors only)."""

    to_hf: Callable[[dict[str, torch.Tensor], Any], dict[str, torch.Tensor]]
    """(titanlite state dict, ModelArgs) -> transformers state dict."""
    from_hf: Callable[[dict[str, torch.Tensor], Any], dict[str, torch.Tensor]]
    """(transformers state dict, ModelArgs) -> titanlite state dict."""
    config_to_hf: Callable[[Any, torch.dtype], dict[str, Any]]
    """(ModelArgs, dtype) -> config.json contents."""
    args_from_hf: Callable[[dict[str, Any]], Any]
    """config.json contents -> ModelArgs; raises ConfigError for what the family cannot express."""


def read_config(folder: str | Path) -> dict[str, Any]:
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise ConfigError(f"{folder}: no config.json; expected a folder saved by transformers' save_pretrained")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: invalid JSON ({e})") from None


def check_hf_config(adapter: HFAdapter, folder: str | Path, args: Any) -> None:
    """Refuse a transformers folder whose architecture differs from `args` (context length aside)."""
    theirs = adapter.config_to_hf(adapter.args_from_hf(read_config(folder)), torch.float32)
    ours = adapter.config_to_hf(args, torch.float32)
    diff = [k for k in ours if k not in ("max_position_embeddings", "torch_dtype") and ours[k] != theirs.get(k)]
    if diff:
        raise ConfigError(f"{folder}/config.json differs from the model config in "
                          + ", ".join(f"{k} ({theirs.get(k)} vs {ours[k]})" for k in diff))


def _weight_files(folder: Path) -> list[Path]:
    index = folder / INDEX
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [folder / n for n in names]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise ConfigError(f"{index} lists missing file(s): {', '.join(missing)}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"{folder}: no *.safetensors files (only safetensors weights are read)")
    return files


def read_safetensors(folder: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor in the folder's safetensors files, on CPU."""
    out: dict[str, torch.Tensor] = {}
    for path in _weight_files(Path(folder)):
        try:
            with safe_open(str(path), framework="pt") as f:
                for key in f.keys():
                    out[key] = f.get_tensor(key)
        except Exception as e:  # safetensors raises its own error types for truncated headers
            raise ConfigError(f"{path}: unreadable safetensors file ({e})") from None
    return out


def write_hf_folder(folder: str | Path, state_dict: dict[str, torch.Tensor], config: dict[str, Any],
                    max_shard_bytes: int = 5 * 2**30) -> None:
    """config.json, model-0000i-of-0000n.safetensors shards and the index transformers reads."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key, tensor in state_dict.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = tensor.contiguous()
        size += nbytes
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(folder / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
    total = sum(t.numel() * t.element_size() for t in state_dict.values())
    (folder / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    (folder / "config.json").write_text(json.dumps(config, indent=2))
