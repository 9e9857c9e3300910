"""The architecture a run trains, from model.hf_config (a folder with config.json, or a
model_type with transformers' defaults) and model.hf_overrides, checked before launch: a causal
LM, laid out as titanlite cuts it (model.embed_tokens, model.layers, model.norm, lm_head), whose
attention titanlite's attention function can compute and whose training forward is
deterministic (no dropout). Every refusal is one line naming the key or the module."""

from __future__ import annotations

import dataclasses
import difflib
import json
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from transformers import PretrainedConfig
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from titanlite.checkpoint.hf import read_config
from titanlite.errors import ConfigError
from titanlite.layers.attention import AttnContext, AttnSetup

from .model import AttentionDropout, ModelArgs, Unsupported, build, causal_lm_class

LAYOUT = {"model.embed_tokens": nn.Embedding, "model.layers": nn.ModuleList, "model.norm": nn.Module,
          "lm_head": nn.Linear}
"""Where titanlite finds a causal LM's parts (ModelSpec.pre, blocks and post): the layout of
transformers' base_model_pp_plan, which most decoders share."""


def parse_overrides(overrides: tuple[str, ...]) -> dict[str, Any]:
    """["KEY=VALUE", ...] -> {KEY: VALUE}, VALUE read as JSON (else kept as text)."""
    out = {}
    for item in overrides:
        key, eq, text = item.partition("=")
        if not eq or not key.strip():
            raise ConfigError(f"model.hf_overrides: '{item}' is not KEY=VALUE (e.g. num_hidden_layers=2)")
        try:
            out[key.strip()] = json.loads(text)
        except json.JSONDecodeError:
            out[key.strip()] = text
    return out


def resolve(source: str, overrides: tuple[str, ...] = ()) -> PretrainedConfig:
    """The transformers config model.hf_config names, with model.hf_overrides given to its
    constructor (so what transformers derives from them, as layer_types, follows)."""
    values = parse_overrides(overrides)
    if Path(source).is_dir():
        raw = read_config(source)
        where = f"{source}/config.json"
    elif "/" in source or source.endswith(".json"):
        raise ConfigError(f"model.hf_config: '{source}' is not a folder; give a folder with config.json or a "
                          "model_type (llama, qwen3, ...)")
    else:
        raw, where = {"model_type": source}, f"model_type '{source}'"
    return resolve_dict(raw, where, values)


def resolve_dict(raw: dict[str, Any], where: str, values: dict[str, Any] | None = None) -> PretrainedConfig:
    """The transformers config of config.json contents `raw` (`where` names them), `values`
    (checked to be keys of the config) given to its constructor with them."""
    values = values or {}
    model_type = raw.get("model_type")
    if model_type not in CONFIG_MAPPING:
        close = difflib.get_close_matches(str(model_type), list(CONFIG_MAPPING.keys()), n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        raise ConfigError(f"model.hf_config: {where} names model_type '{model_type}', which transformers "
                          f"{_version()} does not know{hint}")
    cls = CONFIG_MAPPING[model_type]
    # transformers 5's configs are dataclasses: their keys without building one (a default config
    # may itself be inconsistent, and say so on stderr: Starcoder2's token ids)
    keys = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set(cls().to_dict())
    known = keys | set(raw)
    for key in values:
        if key not in known:
            close = difflib.get_close_matches(key, sorted(known), n=1)
            raise ConfigError(f"model.hf_overrides: '{key}' is not a key of {cls.__name__}"
                              + (f"; did you mean '{close[0]}'?" if close else ""))
    try:
        return cls.from_dict({**raw, **values})
    except (ValueError, TypeError, KeyError) as e:
        raise ConfigError(f"model.hf_config: transformers refuses {where}"
                          + (" with model.hf_overrides" if values else "")
                          + f" ({(str(e).strip().splitlines() or [type(e).__name__])[0]})") from None


def from_hf_config(source: str, overrides: tuple[str, ...] = ()) -> ModelArgs:
    """ModelSpec.from_hf_config: the args of model.hf_config with model.hf_overrides."""
    return args_from_config(resolve(source, overrides))


def args_from_config(config: PretrainedConfig) -> ModelArgs:
    """The checked ModelArgs of a transformers config."""
    causal_lm_class(config)
    n_heads = config.num_attention_heads
    rope = getattr(config, "rope_parameters", None) or {}
    kinds = getattr(config, "layer_types", None)
    context = getattr(config, "max_position_embeddings", None) or 4096
    # a window that holds the whole context is full attention, as transformers computes it
    # (titanlite.models.transformers.model.titanlite_attention runs it so)
    window = getattr(config, "sliding_window", None) or 0
    args = ModelArgs(dim=config.hidden_size, n_layers=config.num_hidden_layers, n_heads=n_heads,
                     n_kv_heads=getattr(config, "num_key_value_heads", None) or n_heads,
                     vocab_size=config.vocab_size,
                     norm_eps=float(next((getattr(config, k) for k in ("rms_norm_eps", "layer_norm_eps", "norm_eps")
                                          if getattr(config, k, None) is not None), 1e-6)),
                     rope_theta=float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0) or 10000.0)),
                     max_seq_len=context,
                     tie_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
                     sliding_window=window if window < context else 0,
                     layer_types=tuple(kinds or ()),
                     head_dim=getattr(config, "head_dim", None) or config.hidden_size // n_heads,
                     ffn_hidden=getattr(config, "intermediate_size", None) or 4 * config.hidden_size,
                     config=json.dumps(config.to_dict(), sort_keys=True))
    if set(args.layer_types) - set(ModelArgs.layer_kinds):
        other = sorted(set(args.layer_types) - set(ModelArgs.layer_kinds))[0]
        raise ConfigError(f"model.hf_config: {type(config).__name__} layer_types has '{other}' layers; titanlite's "
                          "attention computes full and sliding-window causal attention only: set model.hf_overrides "
                          "layer_types to a list of full_attention and sliding_attention")
    check_model(args)
    return args


def notes(args: ModelArgs) -> tuple[str, ...]:
    """ModelSpec.notes: a load-balancing coefficient the run does not train with (published MoE
    configs set router_aux_loss_coef with output_router_logits false, and transformers then trains
    cross-entropy alone too)."""
    config = json.loads(args.config)
    coef = config.get("router_aux_loss_coef")
    if not coef or config.get("output_router_logits"):
        return ()
    return (f"titanlite: the model's config sets router_aux_loss_coef {coef} with output_router_logits false: no "
            "auxiliary (load-balancing) loss is trained (set model.hf_overrides output_router_logits=true to train it)",)


def check_model(args: ModelArgs) -> None:
    """Refuse, in one line, a model titanlite cannot train as it trains its own: built on meta
    (every layer, at its real size: no memory) and run forward on meta tokens in training mode, so
    that what its attention asks of titanlite's attention function, and every dropout it applies,
    are checked before launch too."""
    check_activations(json.loads(args.config))
    with torch.device("meta"):
        model = build(args)
    name = type(model).__name__.removeprefix("Titanlite")
    for path, kind in LAYOUT.items():
        try:
            part = model.get_submodule(path)
        except AttributeError:
            part = None
        if not isinstance(part, kind):
            raise ConfigError(f"model.hf_config: {name} has no {kind.__name__} at '{path}'; titanlite cuts a causal LM "
                              "at model.embed_tokens, model.layers, model.norm and lm_head (transformers' "
                              "base_model_pp_plan layout)")
    for path, module in model.named_modules():
        if getattr(module, "attn_logit_softcapping", None) is not None:
            raise ConfigError(f"model.hf_config: {name}'s {path} soft-caps its attention logits "
                              f"(attn_logit_softcapping {module.attn_logit_softcapping}), which titanlite's attention "
                              "does not compute; set model.hf_overrides attn_logit_softcapping=null")
    config = json.loads(args.config)
    balancing = ("num_experts", "num_experts_per_tok", "router_aux_loss_coef")
    if config.get("output_router_logits") and not all(hasattr(model, k) for k in balancing):
        # titanlite.models.transformers.model.load_balancing_sum reads them as transformers' forward does
        raise ConfigError(f"model.hf_config: {name} sets output_router_logits, but has no "
                          f"{'/'.join(k for k in balancing if not hasattr(model, k))} for titanlite to compute "
                          "its load-balancing loss from; set model.hf_overrides output_router_logits=false")
    windows = tuple({args.window(i) for i in range(args.n_layers)})
    tokens = torch.zeros(1, 8, dtype=torch.long, device="meta")
    watch = DropoutWatch(model)
    complete = False
    try:
        with torch.no_grad(), watch:
            model.train()(tokens, AttnContext(setup=AttnSetup(windows=windows)))
        complete = True
    except AttentionDropout as e:
        watch.seen.append((e.p, watch.running[-1] if watch.running else e.where))
    except Unsupported as e:
        first = (str(e).strip().splitlines() or [""])[0]
        raise ConfigError(f"model.hf_config: {first}") from None
    except (NotImplementedError, RuntimeError):
        pass  # an operation meta tensors cannot run (a MoE's routing): the first real forward checks the rest
    finally:
        watch.remove()
    check_dropout(name, config, watch.seen, complete)


ACTIVATION_KEYS = ("hidden_act", "hidden_activation", "activation_function")
"""The config keys transformers' models look their activation up by, in ACT2FN."""


def check_activations(config: dict[str, Any]) -> None:
    """Refuse an activation name transformers does not have, naming the key (building the model
    would fail inside transformers' code, as a failure of the model's code)."""
    from transformers.activations import ACT2FN

    for key in ACTIVATION_KEYS:
        value = config.get(key)
        if isinstance(value, str) and value not in ACT2FN:
            raise ConfigError(f"model.hf_config: {key} '{value}' is not an activation transformers has; set "
                              f"model.hf_overrides {key} to one of {', '.join(sorted(ACT2FN))}")


DROPOUT_KEYS = ("dropout", "pdrop")
"""What the config keys of a dropout probability contain (attention_dropout, resid_pdrop, ...)."""


def check_dropout(name: str, config: dict[str, Any], seen: list[tuple[float, str]], complete: bool) -> None:
    """Refuse a model whose training forward applies dropout (`seen`: probability and module of
    each dropout it applied), naming the config keys that set it: titanlite trains without dropout,
    so that every layout computes what one process does. Where the forward could not run to its
    end on meta (`complete` False), any non-zero dropout key of the config is refused."""
    keys = sorted(k for k, v in config.items() if any(d in k for d in DROPOUT_KEYS)
                  and isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0)
    if not seen and (complete or not keys):
        return
    where = f" ({seen[0][0]} in {seen[0][1] or 'the model'})" if seen else ""
    if not keys:
        raise ConfigError(f"model.hf_config: {name} applies dropout in training{where} that no *dropout* or *pdrop* "
                          "key of its config sets; titanlite trains without dropout, so that every layout equals one "
                          "process: docs/transformers_models.md")
    raise ConfigError(f"model.hf_config: {name} applies dropout in training{where}; titanlite trains without dropout, "
                      "so that every layout equals one process: set model.hf_overrides "
                      + ",".join(f"{k}=0" for k in keys))


class DropoutWatch(TorchFunctionMode):
    """Every dropout a forward applies with p > 0 in training, as a module (nn.Dropout calls
    F.dropout) or a function (F.dropout, torch.dropout, native_dropout, their feature and alpha
    variants, sdpa's dropout_p): (p, the innermost module of `model` running it)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.seen: list[tuple[float, str]] = []
        self.running: list[str] = []
        self.handles = []
        for path, module in model.named_modules():
            self.handles.append(module.register_forward_pre_hook(lambda m, a, p=path: self.running.append(p)))
            self.handles.append(module.register_forward_hook(lambda m, a, out: self.running.pop() and None))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        p, training = 0.0, False
        if func is F.scaled_dot_product_attention:  # (q, k, v, attn_mask=None, dropout_p=0.0, ...)
            p, training = kwargs.get("dropout_p", args[4] if len(args) > 4 else 0.0), True
        elif "dropout" in getattr(func, "__name__", ""):
            # F.dropout(input, p=0.5, training=True, ...); torch.dropout / native_dropout(input, p, train)
            p = kwargs.get("p", args[1] if len(args) > 1 else 0.5)
            training = kwargs.get("training", kwargs.get("train", args[2] if len(args) > 2 else True))
        if training and p:
            self.seen.append((float(p), self.running[-1] if self.running else ""))
        return func(*args, **kwargs)


def _version() -> str:
    import transformers

    return transformers.__version__


INERT = frozenset({"_name_or_path", "architectures", "dtype", "torch_dtype", "transformers_version", "use_cache",
                   "output_attentions", "output_hidden_states", "return_dict", "torchscript", "chunk_size_feed_forward",
                   "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id", "id2label", "label2id",
                   "problem_type", "tokenizer_class", "prefix", "task_specific_params", "finetuning_task"})
"""Config keys that change nothing a training step computes (generation, outputs returned, labels,
token ids the loss never reads, a feed-forward computed in chunks): a resumed run may change them."""


def compare_saved(saved: dict[str, Any], args: ModelArgs) -> list[tuple[str, Any, Any]]:
    """ModelSpec.compare_saved: each key of the saved transformers config that differs from this
    run's (INERT keys aside), as the model.hf_overrides key that sets it."""
    old, new = json.loads(saved.get("config", "{}")), json.loads(args.config)
    return [(f"model.hf_overrides {k}", old.get(k), new.get(k)) for k in sorted(old.keys() | new.keys())
            if k not in INERT and old.get(k) != new.get(k)]
