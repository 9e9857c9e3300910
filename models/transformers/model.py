"""A transformers causal LM as a titanlite model: transformers' own modules and forward, with
what titanlite asks of a model added by a mixin class and changed only through transformers'
public hooks (its attention-function registry and the config).

- `build(args)` makes the architecture's *ForCausalLM class (a subclass of it with `CausalLM`
  mixed in, so parameter names are transformers' own) on the current device, its attention set to
  the function registered here as "titanlite", which calls titanlite.layers.attention.attention:
  the trainer's context (positions, documents, the context-parallel group) reaches it through
  the forward's keyword arguments, which transformers passes down to every attention call.
- `init_buffers()` recomputes what construction computes (RoPE's inv_freq, Gemma's embedding
  scale) with transformers' own rules, all parameters marked initialised so that only buffers
  are written; `init_weights(seed)` draws every parameter with transformers' rule for its module
  (`_init_weights`, the architecture's documented initialisation hook) from a generator seeded
  by (seed, module name), whole, then keeps this rank's shard: the same values on every layout.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from functools import cache
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from transformers import AttentionInterface, PretrainedConfig
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from titanlite.errors import ConfigError
from titanlite.layers import init
from titanlite.layers.attention import AttnContext, attention
from titanlite.layers.decoder import DecoderArgs, Recompute
from titanlite.layers.moe import AUX_LOSS
from titanlite.loss import ExtraLosses

ATTENTION = "titanlite"
"""The name titanlite's attention function is registered under with transformers."""


@dataclass(frozen=True)
class ModelArgs(DecoderArgs):
    """The sizes titanlite reads (from the config, by titanlite.models.transformers.config) and
    the whole transformers config, which alone says what the model computes."""

    head_dim: int = 0
    ffn_hidden: int = 0
    config: str = "{}"
    """The transformers config as JSON (config.to_dict()); `n_layers` and `vocab_size` override
    its num_hidden_layers and vocab_size (shallow copies for pipeline shapes and the dry run,
    model.vocab_size)."""


def hf_config(args: ModelArgs) -> PretrainedConfig:
    """The transformers config `args` describe: their JSON config with their depth, vocabulary and
    tying. Per-layer lists (layer_types, ...) keep their first n_layers entries in a shallower copy."""
    values = json.loads(args.config)
    depth = values["num_hidden_layers"]
    for key, value in values.items():
        if isinstance(value, list) and len(value) == depth != args.n_layers:
            values[key] = value[:args.n_layers]
    # the constructor's attn_implementation: titanlite's attention, registered with transformers;
    # tie_embeddings as every family's args say it (an export untied by a LoRA on lm_head)
    values.update(num_hidden_layers=args.n_layers, vocab_size=args.vocab_size, attn_implementation=ATTENTION,
                  tie_word_embeddings=args.tie_embeddings)
    return CONFIG_MAPPING[values["model_type"]].from_dict(values)


def causal_lm_class(config: PretrainedConfig) -> type[nn.Module]:
    """The architecture's *ForCausalLM class, or one line saying it has none."""
    cls = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None)
    if cls is None or getattr(config, "is_encoder_decoder", False):
        raise ConfigError(f"model.hf_config: model_type '{config.model_type}' is not a causal language model in "
                          f"transformers {_version()} (no *ForCausalLM class); titanlite trains decoder-only LMs")
    return cls


def build(args: ModelArgs) -> nn.Module:
    """The architecture's causal LM with titanlite's mixin, on the current device (the trainer's
    is meta; on a real one transformers initialises it, from torch's global generator)."""
    return titanlite_class(causal_lm_class(hf_config(args)))(hf_config(args))


@cache
def titanlite_class(base: type[nn.Module]) -> type[nn.Module]:
    """`base` with CausalLM mixed in (one class per architecture, made once), declared in `base`'s
    module: transformers reads the module a class is defined in to decide what the class may do
    (PreTrainedModel.is_custom_code, which keeps a custom class from its checkpoint conversion;
    whether it may choose its experts implementation). Declared in this module, a MoE would run the
    eager experts loop (a .nonzero() of data-dependent shape, which the dry run cannot trace)
    where transformers runs `base` with its default, grouped_mm."""
    return type(f"Titanlite{base.__name__}", (CausalLM, base), {"__module__": base.__module__})


@cache
def recomputing_class(base: type[nn.Module]) -> type[nn.Module]:
    """`base` (a decoder layer class) with a `recompute` field: the block protocol of
    titanlite.parallel.apply's activation checkpointing (titanlite.layers.decoder.Block's)."""
    return type(base.__name__, (Recomputing, base), {"__module__": base.__module__})


def kernel_routing(cls: type[nn.Module]) -> Callable | None:
    """The forward `cls` had before the kernels package's `use_kernelized_func` wrapped it, None if
    it did not. That wrapper routes a global function (transformers 5.25: apply_rotary_pos_emb) to
    a hub kernel chosen by `kernels.kernelize`, which titanlite never calls (nothing downloads), so
    the function it routes to is the plain one; but it sets a module-level variable on every call,
    a side effect compile cannot trace inside an activation checkpoint (fullgraph fails)."""
    try:
        from kernels import use_kernelized_func
    except ImportError:  # transformers' own no-op decorator wraps nothing
        return None
    code = getattr(cls.forward, "__code__", None)
    if code is None or code.co_filename != use_kernelized_func.__code__.co_filename:
        return None
    return cls.forward.__wrapped__


@cache
def unrouted_class(base: type[nn.Module]) -> type[nn.Module]:
    """`base` with the forward the kernels package wrapped (kernel_routing): the same computation."""
    return type(base.__name__, (base,), {"forward": kernel_routing(base), "__module__": base.__module__})


class Recomputing:
    """A decoder layer that checkpoints its own forward with `recompute` when the plan sets it,
    so its parameter names, and FSDP's and compile's hooks, stay the layer's own."""

    recompute: Recompute | None = None

    def forward(self, *args, **kwargs):
        if self.recompute is None:
            return super().forward(*args, **kwargs)
        return self.recompute(super().forward, *args, **kwargs)


class CausalLM:
    """What titanlite asks of a model, on top of a transformers *ForCausalLM class: forward(tokens,
    ctx), init_buffers() and init_weights(seed). Pipeline stages: a stage without the embedding
    is handed hidden states (transformers' inputs_embeds), one without lm_head returns the base
    model's hidden states (its final norm an nn.Identity but on the last stage)."""

    def __init__(self, config: PretrainedConfig):
        super().__init__(config)
        for layer in self.model.layers:
            layer.__class__ = recomputing_class(type(layer))
        for module in self.modules():
            if kernel_routing(type(module)) is not None:
                module.__class__ = unrouted_class(type(module))
        # a weight shared between modules (a tied embedding) is drawn by the module that holds it
        # first; a pipeline stage that holds only a later one draws it by a copy of that module
        first: dict[int, str] = {}
        ties = {}
        for name, p in self.named_parameters(remove_duplicate=False):
            if id(p) in first:
                owner = first[id(p)].rpartition(".")[0]
                ties[name] = (owner, copy.deepcopy(self.get_submodule(owner)).to("meta"))
            first.setdefault(id(p), name)
        self.tied_to = ties
        """Name of each parameter that shares another's -> (the module holding that one first, a
        meta copy of it)."""

    extra_losses: ExtraLosses | None = None
    """Where the load-balancing loss goes (output_router_logits): the training step's, bound by it."""
    stats_group: dist.ProcessGroup | None = None
    """The ranks routing different tokens of one micro-batch (data x context parallel), over which
    the load-balancing loss counts the experts' loads; None on one process."""

    def forward(self, tokens: torch.Tensor, ctx: AttnContext | None = None) -> torch.Tensor:
        ctx = ctx or AttnContext()
        inputs = {"inputs_embeds" if tokens.is_floating_point() else "input_ids": tokens}
        # given always: transformers would count them from the embedding's output, which sequence
        # parallel shards
        positions = ctx.positions if ctx.positions is not None else torch.arange(tokens.shape[1], device=tokens.device)
        kwargs = dict(position_ids=positions.expand(tokens.shape[0], -1), use_cache=False, titanlite_ctx=ctx)
        if isinstance(self.lm_head, nn.Identity):
            return self.model(**inputs, **kwargs).last_hidden_state
        balance = getattr(self.config, "output_router_logits", False) and torch.is_grad_enabled()
        # transformers' aux_loss (computed when asked) is this rank's alone: titanlite's is the batch's
        out = super().forward(**inputs, **kwargs, **({"output_router_logits": balance} if balance else {}))
        if not balance or self.extra_losses is None:
            return out.logits
        aux = load_balancing_sum(out.router_logits, self.num_experts, self.num_experts_per_tok, self.stats_group)
        return self.extra_losses.add(out.logits, AUX_LOSS, self.router_aux_loss_coef * aux)

    @torch.no_grad()
    def init_buffers(self) -> None:
        """Every buffer's value from transformers' own rules; the parameters are left alone."""
        if any(b.is_meta for b in self.buffers()):
            return
        for p in self.parameters():
            p._is_hf_initialized = True
        for m in self.modules():
            m._is_hf_initialized = False
        self.initialize_weights()

    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> None:
        """Draw every parameter this module holds (a pipeline stage holds some) with its module's
        transformers rule, from a generator seeded by (seed, module name). Without a seed,
        transformers' own initialisation (its construction calls that)."""
        if seed is None:
            super().init_weights()
            return
        mine = dict(self.named_parameters())  # a tied weight once, under the name that holds it first
        for name, module in self.named_modules():
            full = {n: f"{name}.{n}".lstrip(".") for n, _ in module.named_parameters(recurse=False)}
            own = {n: mine[f] for n, f in full.items() if f in mine and f not in self.tied_to}
            if own:
                self._draw(module, name, own, seed)
        for name, (owner, template) in self.tied_to.items():
            if name in mine:  # this stage holds the tied weight without the module that owns it first
                self._draw(template, owner, {name.rpartition(".")[2]: mine[name]}, seed)

    def _draw(self, module: nn.Module, name: str, own: dict[str, nn.Parameter], seed: int) -> None:
        """`own` (parameters of `module`, named `name`) from transformers' rule for `module`."""
        full = {}
        for n, p in own.items():
            device = (p.to_local() if isinstance(p, DTensor) else p).device
            device = torch.device("cpu") if device.type == "meta" else device
            full[n] = nn.Parameter(torch.full(p.shape, float("nan"), device=device))
        saved = {n: module._parameters[n] for n in own}
        module._parameters.update(full)
        try:
            devices = [d.index or 0 for d in {f.device for f in full.values()} if d.type == "cuda"]
            with torch.random.fork_rng(devices=devices):
                # the generators transformers' rules draw from: the CPU's and these devices'
                torch.default_generator.manual_seed(init.seed_of(seed, name))
                for index in devices:
                    torch.cuda.default_generators[index].manual_seed(init.seed_of(seed, name))
                self._init_weights(module)
        finally:
            module._parameters.update(saved)
        for n, p in own.items():
            if torch.isnan(full[n]).any():
                raise ConfigError(f"{type(self).__name__}: transformers' _init_weights leaves {name}.{n} "
                                  "uninitialised; start from weights (checkpoint.initial_load_path)")
            init.copy_full_(p, full[n].detach().to(p.dtype))


def load_balancing_sum(router_logits: tuple[torch.Tensor, ...], num_experts: int, top_k: int,
                       group: dist.ProcessGroup | None) -> torch.Tensor:
    """transformers' load-balancing loss (its load_balancing_loss_func, without an attention mask:
    E x sum_e f_e P_e, f_e the share of top-k slots routed to expert e and P_e its mean router
    probability, both over every layer's rows) as this rank's share of a sum over tokens: divided
    by the step's target count (titanlite.loss.ExtraLosses), the micro-batch's loss on every layout.
    The loads (counts, no gradient, as in transformers) and the row count are summed over `group`;
    P_e's sum is this rank's rows', which the gradient reduction adds up."""
    probs = [F.softmax(layer.float(), dim=-1) for layer in router_logits]
    counts = sum(torch.zeros(num_experts, device=p.device).scatter_add_(
        0, p.topk(top_k, dim=-1).indices.flatten(), torch.ones(p.shape[0] * top_k, device=p.device)) for p in probs)
    rows = torch.tensor(float(sum(p.shape[0] for p in probs)), device=counts.device)
    stats = torch.cat([counts, rows[None]])
    if group is not None:
        dist.all_reduce(stats, group=group)
    counts, rows = stats[:-1], stats[-1]
    # the micro-batch's loss E x sum_e (counts_e / rows) (prob sum_e / rows), times its tokens (rows / layers)
    return num_experts * (counts / rows * sum(p.sum(0) for p in probs)).sum() / len(probs)


class Unsupported(RuntimeError):
    """What a model asks of its attention function that titanlite's cannot compute."""


class AttentionDropout(Unsupported):
    """Dropout on the attention weights, which titanlite's attention does not apply: the model
    check (titanlite.models.transformers.config.check_model) names the config key that sets it."""

    def __init__(self, p: float, where: str):
        super().__init__(f"{where} has attention dropout {p}, which titanlite's attention cannot compute; "
                         "set the config's attention dropout to 0 in model.hf_overrides")
        self.p, self.where = p, where


KWARGS = {"position_ids", "use_cache", "cache_position", "output_attentions", "titanlite_ctx", "is_causal",
          "output_router_logits"}
"""Keywords transformers' decoders pass their attention function that change nothing it
computes in training (position_ids reached RoPE before it; no cache; the router's logits are
recorded by the model, not by attention); any other is refused
unless it is None or False (a feature switched off: Gemma 2's softcap=None)."""


def titanlite_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                        sliding_window: int | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function interface over titanlite's attention: query [B, Hq, S, D],
    key and value [B, Hkv, S, D] (this rank's heads and sequence shard) -> [B, S, Hq, D]. The mask
    is titanlite's (causal, the layer's window, the batch's documents): transformers builds none
    for a function it has no mask function for, and anything it would ask beyond that is refused."""
    if "titanlite_ctx" not in kwargs:
        # the batch's documents, the context-parallel group and the backend would be lost: a silent wrong
        raise Unsupported(f"{type(module).__name__} is reached without the keyword arguments of the model's forward "
                          "(a layer of it drops them), so titanlite's attention would not see the batch's documents "
                          "or the context-parallel group; titanlite cannot train it")
    ctx: AttnContext = kwargs["titanlite_ctx"]
    if dropout:
        raise AttentionDropout(dropout, type(module).__name__)
    context = getattr(getattr(module, "config", None), "max_position_embeddings", None)
    if sliding_window and context and sliding_window >= context:
        sliding_window = None  # it holds every training sequence (at most the context): full attention
    unknown = sorted(k for k, v in kwargs.items() if k not in KWARGS and v is not None and v is not False)
    causal = getattr(module, "is_causal", True) and kwargs.get("is_causal", True) is not False
    why = (f"passes '{unknown[0]}'" if unknown else "passes a mask of its own" if attention_mask is not None
           else "is not causal" if not causal
           else f"slides over {sliding_window} keys, a window its config does not declare"
           if ctx.setup.windows and sliding_window not in ctx.setup.windows else None)
    if why:
        raise Unsupported(f"{type(module).__name__} {why}, which titanlite's attention cannot compute; "
                           "docs/transformers_models.md")
    out = attention(query, key, value, ctx, window=sliding_window, scale=scaling, layer=module)
    return out.transpose(1, 2), None


AttentionInterface.register(ATTENTION, titanlite_attention)


def _version() -> str:
    import transformers

    return transformers.__version__
