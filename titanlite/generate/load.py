"""The model and tokenizer `python -m titanlite.generate` runs: a titanlite checkpoint folder
(DCP, the family and args its titanlite.json records; a LoRA run's adapter merged into the base
it records) or a transformers folder; refusals in one line each (titanlite.errors.ConfigError)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import PrepareModuleInputOutput

import titanlite
from titanlite.checkpoint.dcp import load_initial
from titanlite.checkpoint.folder import INFO, read_info, saved_args
from titanlite.checkpoint.hf import read_config
from titanlite.data.tokenizer import Tokenizer, build_tokenizer
from titanlite.errors import ConfigError
from titanlite.layers import init
from titanlite.model_spec import ModelSpec, get_model_spec
from titanlite.parallel.tensor import apply_tp, between_layout, check_decoder_tp
from titanlite.saved_model import read_dcp

NATIVE = {"llama": "llama3", "qwen3": "qwen3", "qwen3_moe": "qwen3_moe", "gpt_oss": "gpt_oss",
          "deepseek_v3": "deepseek_v3", "qwen3_5_text": "qwen3_5", "qwen3_5_moe_text": "qwen3_5"}
"""config.json model_type -> the titanlite family that reads it; any other model_type is read by
the transformers family."""


def family_of(folder: Path, name: str) -> str:
    """The family that reads transformers folder `folder`: `name`, or by its model_type."""
    return name or NATIVE.get(read_config(folder).get("model_type"), "transformers")


def check_folder(path: Path, fmt: str) -> None:
    """Refuse a path that is not a model of format `fmt` in one line, before anything is read."""
    if not path.is_dir():
        raise ConfigError(f"{path} is not a folder; give a titanlite checkpoint step folder (step-N) or a "
                          "transformers folder with --format hf")
    if fmt == "dcp" and not (path / INFO).is_file():
        hint = (" (it has a config.json: add --format hf)" if (path / "config.json").is_file()
                else "; give a step folder (checkpoint/step-N) or a folder `python -m titanlite.tools.convert` wrote")
        raise ConfigError(f"{path} holds no {INFO}, so it is not a titanlite checkpoint{hint}")
    if fmt == "hf" and not (path / "config.json").is_file():
        raise ConfigError(f"{path} holds no config.json, so it is not a transformers folder; save one with "
                          "model.save_pretrained(folder), or drop --format hf for a titanlite checkpoint")


def check_lora_base(path: Path) -> None:
    """A LoRA run's checkpoint needs the base it was trained on (its adapter alone is no model)."""
    base = read_info(path).get("transform", {}).get("base", {})
    where = base.get("path")
    if where and not Path(where).exists():
        raise ConfigError(f"{path} is a LoRA checkpoint whose base model {where} ({base.get('format')}) is missing; "
                          "put the base back at that path, or merge the adapter where it exists "
                          "(python -m titanlite.tools.convert dcp hf)")


def load_model(path: str | Path, fmt: str = "dcp", name: str = "", device: str | torch.device = "cpu",
               dtype: torch.dtype | None = None, tp: int = 1, mesh: DeviceMesh | None = None
               ) -> tuple[nn.Module, ModelSpec, Any]:
    """(model in eval mode on `device`, its spec, its args) from a checkpoint folder: `fmt` "dcp"
    (a titanlite step folder) or "hf" (a transformers folder; `name` the family, default by its
    model_type). The RoPE tables cover the model's own context, not the one it was trained at.
    `tp` > 1: split over that many ranks (`shard`), on `mesh` (default: one over the launched
    process group); a step folder's weights are then read shard by shard (`load_sharded`)."""
    path = Path(path)
    spec, args = read_model_args(path, fmt, name)
    check_tp_degree(args, tp)
    if tp > 1 and mesh is None:
        if not dist.is_initialized() or dist.get_world_size() != tp:
            raise ConfigError(f"--tp {tp} runs as {tp} ranks: launch it with torchrun --nproc_per_node {tp}")
        mesh = init_device_mesh(torch.device(device).type, (tp,), mesh_dim_names=("tp",))
    if fmt == "dcp":
        check_lora_base(path)
    if fmt == "dcp" and tp > 1 and "lora" not in read_info(path).get("transform", {}):
        args = dataclasses.replace(args, max_seq_len=args.context_len or args.max_seq_len)
        model = load_sharded(path, spec, args, mesh, device)
        return model.to(dtype=dtype).eval(), spec, args
    if fmt == "hf":
        model, args = titanlite.load_hf(path, spec.name)
    else:
        spec, args, state, _ = read_dcp(path)
        args = dataclasses.replace(args, max_seq_len=args.context_len or args.max_seq_len)
        with torch.device("meta"):
            model = spec.build(args)
        model.to_empty(device=device)
        model.init_buffers()  # RoPE tables and MoE counters; the buffers the state dict holds are loaded next
        model.load_state_dict(state, strict=True)
    model = model.to(device=device, dtype=dtype).eval()
    if tp > 1:
        shard(model, spec, mesh)
    return model, spec, args


def load_sharded(path: Path, spec: ModelSpec, args: Any, mesh: DeviceMesh, device: str | torch.device) -> nn.Module:
    """A step folder's model split over `mesh` without a whole copy on any rank: built on meta,
    split by `shard`, allocated, and each rank's DTensor shards read straight from the DCP files
    (the trainer's initial load, with its checks), whatever layout saved them (FSDP's included)."""
    with torch.device("meta"):
        model = spec.build(args)
    shard(model, spec, mesh)
    init.to_empty(model, device)
    model.init_buffers()  # RoPE tables and MoE counters; the buffers the checkpoint holds are read next
    load_initial([model], path, "dcp", spec, args)
    return model


def read_model_args(path: Path, fmt: str, name: str = "") -> tuple[ModelSpec, Any]:
    """The family and args a checkpoint folder records, read before any weight."""
    check_folder(path, fmt)
    if fmt == "hf":
        spec = get_model_spec(family_of(path, name))
        return spec, spec.hf.args_from_hf(read_config(path))
    info = read_info(path)
    spec = get_model_spec(info["model"])
    return spec, saved_args(list(spec.flavors.values()), info["args"])


def check_tp_degree(args: Any, tp: int) -> None:
    """Refuse a tensor-parallel degree the model's heads (or vocabulary) cannot be split by."""
    if tp < 1:
        raise ConfigError(f"--tp {tp}: use 1 (one process) or more")
    try:
        check_decoder_tp(args, tp)
    except ConfigError as e:
        raise ConfigError(str(e).replace("parallelism.tensor_parallel_degree", "--tp")) from None


def shard(model: nn.Module, spec: ModelSpec, mesh: DeviceMesh) -> None:
    """Tensor parallel over `mesh` (one dimension), by the training plan (heads and feed-forward
    widths split), without sequence parallel (a decode step is one token) and with the logits
    whole on every rank, so every rank draws the same tokens. A MoE layer, which training runs on
    each rank's share of the sequence, runs on every token on every rank: a decode step's one
    token cannot be shared out."""
    plan = spec.tp_plan(between_layout(False), False, model)
    if "moe" in plan.block:
        whole = (Replicate(),)
        plan = dataclasses.replace(plan, block={**plan.block, "moe": PrepareModuleInputOutput(
            input_layouts=whole, desired_input_layouts=whole, use_local_input=True, output_layouts=whole,
            desired_output_layouts=whole, use_local_output=True)})
    apply_tp(model, spec.blocks_of(model), mesh, plan, False)


def load_tokenizer(spec: str, path: Path, fmt: str) -> tuple[Tokenizer, str]:
    """The tokenizer `spec` names ("byte", "byte_chat" or a folder); empty: a transformers folder's
    own if it has one, a step folder's run's (the data.tokenizer its titanlite.json records), else
    "byte". Returns it and its name."""
    recorded = ""
    if not spec and fmt == "hf":
        spec = str(path) if (path / "tokenizer_config.json").is_file() else "byte"
    elif not spec:
        recorded = read_info(path).get("config", {}).get("data.tokenizer", "") if (path / INFO).is_file() else ""
        spec = recorded or "byte"
    try:
        return build_tokenizer(spec), spec
    except ConfigError as e:
        if recorded:
            why = str(e).removeprefix("data.tokenizer: ")
            raise ConfigError(f"{path} was trained with data.tokenizer {recorded}, which does not load here ({why}); "
                              "give the tokenizer with --tokenizer") from None
        raise ConfigError(str(e).replace("data.tokenizer", "--tokenizer")) from None


def eos_ids(tokenizer: Tokenizer, path: Path, fmt: str) -> list[int]:
    """Tokens that end a generation: the tokenizer's EOS, the end of a chat turn where the tokenizer
    has one (ChatML's <|im_end|>), and a transformers folder's eos_token_id."""
    ids = {tokenizer.eos_id}
    hf = getattr(tokenizer, "hf", None)
    if hf is not None and "<|im_end|>" in hf.get_vocab():
        ids.add(hf.convert_tokens_to_ids("<|im_end|>"))
    if fmt == "hf":
        for name in ("generation_config.json", "config.json"):
            cfg = path / name
            if cfg.is_file():
                eos = read_config(path).get("eos_token_id") if name == "config.json" else _json(cfg).get("eos_token_id")
                ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
    return sorted(ids)


def _json(path: Path) -> dict[str, Any]:
    import json

    return json.loads(path.read_text())
