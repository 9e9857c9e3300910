"""Hugging Face folders: config.json plus (sharded) safetensors, read and written without transformers.

A model family describes its own mapping with an `HFAdapter` (see models/llama3/hf.py), from
the pieces here that transformers' Llama-like decoders share: their parameter names, the
config.json keys they all write and read, and the renaming loops. This file also moves full
tensors between memory and disk.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Collection, Iterable
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file

from titanlite.checkpoint import mxfp4
from titanlite.errors import ConfigError
from titanlite.layers.attention import Attention
from titanlite.layers.decoder import Block, Decoder
from titanlite.layers.feed_forward import FeedForward
from titanlite.layers.moe import MoE

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
    optional: tuple[str, ...] = ()
    """Prefixes of titanlite names a transformers folder may lack as a whole (DeepSeek-V3's
    multi-token prediction depths: its config counts them, save_pretrained never writes them):
    they keep their seeded initial values, and the load says so in one line (fresh_names)."""
    training: tuple[str, ...] = ()
    """config.json keys that say how the model trains, not what its weights compute (a transformers
    MoE's load-balancing loss): a run may set them otherwise than the folder it starts from."""


def fresh_names(adapter: HFAdapter, expected: Iterable[str], found: Collection[str]) -> list[str]:
    """The `expected` names the folder does not hold and that start from their initial values: a
    whole `adapter.optional` group, never part of one (then they are missing, which the caller's
    shape check reports)."""
    fresh = []
    for prefix in adapter.optional:
        group = [k for k in expected if k.startswith(prefix)]
        if group and not any(k in found for k in group):
            fresh += group
    return fresh


def fresh_line(fresh: list[str], folder: str | Path) -> str:
    """The one line that says which weights a transformers folder left to their initial values."""
    groups = sorted({k.split(".", 2)[0] + "." + k.split(".", 2)[1] for k in fresh})
    return (f"titanlite: {folder} holds no weights for {', '.join(g + '.*' for g in groups)} ({len(fresh)} tensors; "
            "transformers does not save them): they start from their seeded initial values")


TOP = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
       "output.weight": "lm_head.weight"}
"""titanlite -> transformers names outside the blocks."""
DECODER_LAYER = {
    "attention.wq.weight": "self_attn.q_proj.weight", "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight", "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight", "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight", "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight"}
"""titanlite -> transformers names inside block i (model.layers.<i>.), for a Block of
titanlite.layers.decoder with a dense feed-forward."""
QK_NORM = {"attention.q_norm.weight": "self_attn.q_norm.weight", "attention.k_norm.weight": "self_attn.k_norm.weight"}


def rename_to_hf(state_dict: dict[str, torch.Tensor], layer: dict[str, str], tied: bool,
                 other: Callable[[str, str, torch.Tensor], dict[str, torch.Tensor]] | None = None
                 ) -> dict[str, torch.Tensor]:
    """Full (unsharded) titanlite state dict -> transformers names: `TOP`, and `layer` inside each
    block. A block entry `layer` does not name goes to `other(i, name, tensor)`, which returns its
    transformers entries. A tied output is left out: transformers re-ties lm_head to the embedding."""
    out = {}
    for key, w in state_dict.items():
        if key == "output.weight" and tied:
            continue
        if key in TOP:
            out[TOP[key]] = w
            continue
        _, i, rest = key.split(".", 2)
        if other is not None and rest not in layer:
            out |= other(i, rest, w)
        else:
            out[f"model.layers.{i}.{layer[rest]}"] = w
    return out


def rename_from_hf(state_dict: dict[str, torch.Tensor], layer: dict[str, str], tied: bool, family: str,
                   other: Callable[[str, torch.Tensor], dict[str, torch.Tensor] | None] | None = None
                   ) -> dict[str, torch.Tensor]:
    """transformers state dict -> titanlite names, the inverse of `rename_to_hf`: `other(key,
    tensor)` returns the titanlite entries of a key it takes (else None); any other key is a
    ConfigError naming `family`. With `tied`, lm_head is dropped and output.weight is the embedding."""
    top = {v: k for k, v in TOP.items()}
    back = {v: k for k, v in layer.items()}
    out = {}
    for key, w in state_dict.items():
        if key.endswith("rotary_emb.inv_freq"):
            continue  # a buffer older transformers saved; recomputed from the config
        if key in top:
            if not (key == "lm_head.weight" and tied):
                out[top[key]] = w
            continue
        if other is not None and (taken := other(key, w)) is not None:
            out |= taken
            continue
        parts = key.split(".", 3)
        if len(parts) != 4 or parts[:2] != ["model", "layers"] or parts[3] not in back:
            raise ConfigError(f"Hugging Face weight '{key}' has no {family} counterpart in titanlite")
        out[f"layers.{parts[2]}.{back[parts[3]]}"] = w
    if tied and "tok_embeddings.weight" in out:
        out["output.weight"] = out["tok_embeddings.weight"]
    return out


def decoder_config(args: Any, dtype: torch.dtype, architecture: str, model_type: str,
                   rope_scaling: dict[str, Any] | None = None, *, hidden_act: str, **extra: Any) -> dict[str, Any]:
    """config.json contents of a Llama-like decoder, keys that transformers 4.x and 5.x both
    read (rope_theta and rope_scaling apart), then the family's `extra` keys. `hidden_act`: what
    the built model computes (decoder_facts), never assumed."""
    return {"architectures": [architecture], "model_type": model_type, "hidden_size": args.dim,
            "intermediate_size": args.ffn_hidden, "num_hidden_layers": args.n_layers,
            "num_attention_heads": args.n_heads, "num_key_value_heads": args.n_kv_heads,
            "head_dim": args.head_dim, "vocab_size": args.vocab_size, "rms_norm_eps": args.norm_eps,
            "rope_theta": args.rope_theta, "rope_scaling": rope_scaling, "max_position_embeddings": args.context_len or args.max_seq_len,
            "tie_word_embeddings": args.tie_embeddings, "hidden_act": hidden_act, "attention_bias": False,
            **extra, "torch_dtype": str(dtype).removeprefix("torch.")}


ACTIVATIONS: dict[Callable[..., torch.Tensor], str] = {F.silu: "silu", F.gelu: "gelu", F.relu: "relu"}
"""Feed-forward activations -> the transformers name (ACT2FN) that computes exactly the same."""


def on_meta(build: Callable[[Any], nn.Module], args: Any) -> nn.Module:
    """The model `build` makes of `args`, on meta: its structure, for decoder_facts, at no cost."""
    with torch.device("meta"):
        return build(args)


def decoder_facts(model: nn.Module, architecture: str, layer: dict[str, str], rotate: Callable[..., Any],
                  attention: tuple[type, ...] = (Attention,), forward: Callable[..., Any] | None = Decoder.forward,
                  complete: bool = True) -> dict[str, Any]:
    """What config.json must say about a built model that only its code shows (its activation, as
    hidden_act), after refusing in one line anything `architecture` cannot compute that the args
    do not show, so that a fork's edit to model.py exports right or not at all: a top-level forward
    of its own, a block that is not titanlite.layers.decoder.Block (a parallel attention + MLP
    block), attention not of the `attention` types or rotating otherwise than `rotate`, a
    feed-forward other than FeedForward or MoE, an activation with no transformers name, or block
    parameters outside `layer` (the names the architecture has; a MoE layer's are its own).
    `forward`: the top-level forward the architecture computes (None: the family's own, as
    DeepSeek-V3's with its multi-token prediction, which the adapter's names then check alone).
    `complete`: every block has every name of `layer` (False: `layer` lists alternatives, as
    DeepSeek-V3's attention with or without a query LoRA; a name outside it is still refused)."""
    def refuse(what: str) -> ConfigError:
        return ConfigError(f"{architecture} cannot express this model: {what}; export a model it can compute, "
                           f"or write an adapter (models/<name>/hf.py) for an architecture that has it")

    if forward is not None and type(model).forward is not forward:
        raise refuse(f"{type(model).__qualname__} overrides {forward.__qualname__}")
    acts = set()
    for i, block in getattr(model, "layers").items():
        if type(block) is not Block:
            raise refuse(f"block {i} is {type(block).__module__}.{type(block).__qualname__}, not "
                         "titanlite.layers.decoder.Block (attention, then the feed-forward, each after its own norm)")
        turn = getattr(block.attention, "rotate", None)
        if type(block.attention) not in attention or turn is not rotate:
            raise refuse(f"block {i}'s attention is {type(block.attention).__qualname__} rotating with "
                         f"{getattr(turn, '__name__', turn)}, not {' or '.join(a.__name__ for a in attention)} "
                         f"rotating with {rotate.__name__}")
        names = set(block.state_dict())
        dense = {n for n in layer if not n.startswith("moe.")} if block.moe is None else \
            {n for n in layer if not n.startswith("feed_forward.")}
        mine = {n for n in names if not n.startswith("moe.")} | (names & set(layer))
        if mine - dense or (complete and dense - mine):
            diff = sorted(mine - dense) or sorted(dense - mine)
            more = f" (and {len(diff) - 1} more)" if len(diff) > 1 else ""
            why = "which it has no name for" if mine - dense else "which it has in every block"
            raise refuse(f"block {i} {'has' if mine - dense else 'lacks'} '{diff[0]}'{more}, {why}")
        ffns = [block.feed_forward] if block.moe is None else [m for m in (block.moe.shared,) if m is not None]
        if block.moe is not None:
            if type(block.moe) is not MoE:
                raise refuse(f"block {i}'s moe is {type(block.moe).__qualname__}, not titanlite.layers.moe.MoE")
            acts.add("silu")  # the routed experts' gate (titanlite.layers.moe)
        for ffn in ffns:
            if type(ffn) is not FeedForward or ffn.act not in ACTIVATIONS:
                act = getattr(ffn, "act", None)
                raise refuse(f"block {i}'s feed-forward is {type(ffn).__qualname__} with activation "
                             f"{getattr(act, '__name__', act)}; exportable: FeedForward with "
                             + ", ".join(f.__name__ for f in ACTIVATIONS))
            acts.add(ACTIVATIONS[ffn.act])
    if len(acts) > 1:
        raise refuse(f"its blocks mix the activations {', '.join(sorted(acts))}; config.json has one hidden_act")
    return {"hidden_act": acts.pop()}


def read_decoder_config(cfg: dict[str, Any], model_type: str, family: str, rope_types: tuple[str, ...],
                        biases: tuple[str, ...] = ("attention_bias",)) -> dict[str, Any]:
    """Refuse a config.json of another model_type, with biases, or a RoPE type not in `rope_types`;
    return its RoPE parameters, rope_type and rope_theta set. Its hidden_act is not args: it is
    held against what the family's model computes by check_hf_config, so a GELU fork reads back
    its own export and a SiLU family refuses it."""
    if cfg.get("model_type") != model_type:
        raise ConfigError(f"config.json model_type is '{cfg.get('model_type')}', not '{model_type}'")
    for key in biases:
        if cfg.get(key):
            raise ConfigError(f"config.json sets {key}; titanlite's {family} has no biases")
    # transformers 5 nests rope_theta in rope_parameters; 4.x keeps rope_theta and rope_scaling apart
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    rope["rope_type"] = rope.get("rope_type", rope.get("type", "default"))
    rope["rope_theta"] = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    if rope["rope_type"] not in rope_types:
        supported = " or ".join(rope_types) + (" only" if len(rope_types) == 1 else "")
        raise ConfigError(f"config.json rope type '{rope['rope_type']}' is not supported ({supported})")
    return rope


def decoder_args(cfg: dict[str, Any], rope: dict[str, Any], max_seq_len: int) -> dict[str, Any]:
    """The ModelArgs fields every Llama-like family reads the same way from config.json
    (`max_seq_len`: the default when it has no max_position_embeddings)."""
    n_heads = cfg["num_attention_heads"]
    return dict(dim=cfg["hidden_size"], n_layers=cfg["num_hidden_layers"], n_heads=n_heads,
                n_kv_heads=cfg.get("num_key_value_heads") or n_heads, vocab_size=cfg["vocab_size"],
                norm_eps=cfg.get("rms_norm_eps", 1e-6), rope_theta=rope["rope_theta"],
                max_seq_len=cfg.get("max_position_embeddings", max_seq_len),
                tie_embeddings=bool(cfg.get("tie_word_embeddings", False)))


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
    raw = read_config(folder)
    theirs = adapter.config_to_hf(adapter.args_from_hf(raw), torch.float32)
    # config_to_hf reads the activation off the model this family builds; the folder's is its own
    theirs["hidden_act"] = raw.get("hidden_act", "silu")
    ours = adapter.config_to_hf(args, torch.float32)
    diff = [k for k in ours if k not in ("max_position_embeddings", "torch_dtype", *adapter.training)
            and ours[k] != theirs.get(k)]
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


def read_safetensors(folder: str | Path, names: Collection[str] | None = None, meta: bool = False
                     ) -> dict[str, torch.Tensor]:
    """The folder's tensors (those in `names`, else all) on CPU; with `meta`, meta tensors of
    their shapes, from the files' headers alone."""
    out: dict[str, torch.Tensor] = {}
    quantized: dict[str, tuple[Path, tuple[int, ...], str]] = {}  # MXFP4 pairs, checked from the headers
    for path in _weight_files(Path(folder)):
        try:
            with safe_open(str(path), framework="pt") as f:
                for key in f.keys():
                    if names is None or key in names:
                        if key.endswith((mxfp4.BLOCKS, mxfp4.SCALES)):
                            part = f.get_slice(key)
                            quantized[key] = (path, tuple(part.get_shape()), part.get_dtype())
                        out[key] = (torch.empty(f.get_slice(key).get_shape(), device="meta") if meta
                                    else f.get_tensor(key))
        except Exception as e:  # safetensors raises its own error types for truncated headers
            raise ConfigError(f"{path}: unreadable safetensors file ({e})") from None
    mxfp4.check_headers(quantized)
    return out


def block_groups(names: Iterable[str]) -> list[list[str]]:
    """Transformers tensor names by decoder block (model.layers.<i>.), the names outside every
    block first: a load can then hold one block's full tensors at a time."""
    groups: dict[int, list[str]] = {}
    for name in names:
        parts = name.split(".")
        block = int(parts[2]) if parts[:2] == ["model", "layers"] and len(parts) > 3 and parts[2].isdigit() else -1
        groups.setdefault(block, []).append(name)
    return [groups[b] for b in sorted(groups)]


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
