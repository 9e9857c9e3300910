"""The decoder-only transformer every family here is built as: token embedding, pre-norm blocks
(attention, then a dense or mixture-of-experts feed-forward), final norm, output projection,
with the RoPE tables the blocks read. A family's model.py says what its blocks and RoPE
frequencies are, and subclasses `Decoder` with them; this file holds the rest once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, ClassVar

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from titanlite.layers import init, rope
from titanlite.layers.attention import AttnContext
from titanlite.layers.moe import MoE, moe_layers


@dataclass(frozen=True)
class DecoderArgs:
    """The sizes every decoder has. A family's ModelArgs subclasses this, adds what is its own
    and gives `head_dim` and `ffn_hidden` (as fields or as properties); its flavors set the rest."""

    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_seq_len: int = 4096
    """Positions the RoPE tables cover: the model's context length, until training shrinks it to
    training.seq_len (titanlite.model_spec.model_args)."""
    context_len: int = 0
    """The model's own context length (Hugging Face's max_position_embeddings) once max_seq_len
    was shrunk for training; 0: max_seq_len is it."""
    tie_embeddings: bool = False
    sliding_window: int = 0
    """Keys a query sees (itself included) in sliding-window layers; 0: no window."""
    layer_types: tuple[str, ...] = ()
    """Per layer one of `layer_kinds` (Hugging Face's names); empty: every layer slides when
    sliding_window is set."""
    layer_kinds: ClassVar[tuple[str, ...]] = ("full_attention", "sliding_attention")
    """The layer types the family builds (Qwen3.5's: linear_attention and full_attention)."""
    attn_sinks: bool = False
    """A learned sink logit per query head in every layer (gpt-oss)."""

    def window(self, layer: int) -> int | None:
        """The sliding window of block `layer`, or None for full causal attention."""
        if not self.sliding_window or (self.layer_types and self.layer_types[layer] != "sliding_attention"):
            return None
        return self.sliding_window


@dataclass(frozen=True)
class Recompute:
    """How a block recomputes its activations in backward (activation checkpointing), which
    titanlite.parallel.apply gives a Block as its plan says; `context_fn`: torch's selective
    checkpoint contexts (per-op AC), None for the whole block."""

    context_fn: Callable[[], tuple] | None = None

    def __call__(self, forward: Callable[..., torch.Tensor], *args, **kwargs) -> torch.Tensor:
        # compile traces a context_fn it is handed, but not torch's default one (torch 2.15:
        # "checkpoint not implemented for LazyVariableTracker context_fn"): pass none then
        options = {} if self.context_fn is None else {"context_fn": self.context_fn}
        return checkpoint(forward, *args, use_reentrant=False, preserve_rng_state=False, **options, **kwargs)


class Block(nn.Module):
    """x + attention(norm(x)), then h + ffn(norm(h)). The feed-forward is registered as
    `feed_forward` (dense) or `moe` (titanlite.layers.moe.MoE), so parameter names say which.
    `attention` is any mixer called as attention(x, cos, sin, ctx): softmax attention or a linear
    one (titanlite.layers.linear_attention.GatedDeltaNet)."""

    def __init__(self, dim: int, norm_eps: float, attention: nn.Module, feed_forward: nn.Module | None = None,
                 moe: MoE | None = None, norm: Callable[..., nn.Module] = nn.RMSNorm):
        super().__init__()
        if (feed_forward is None) == (moe is None):
            raise ValueError("a Block takes either a feed_forward or a moe layer")
        self.attention_norm = norm(dim, eps=norm_eps)
        self.attention = attention
        self.ffn_norm = norm(dim, eps=norm_eps)
        self.feed_forward = feed_forward
        self.moe = moe
        self.recompute: Recompute | None = None
        """Activation checkpointing, set by the parallel plan; None: activations are kept. The
        block checkpoints its own forward, so its parameter names and FSDP's and compile's
        hooks are those of the block itself."""

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: AttnContext | None) -> torch.Tensor:
        if self.recompute is None:
            return self._forward(x, cos, sin, ctx)
        return self.recompute(self._forward, x, cos, sin, ctx)

    def _forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: AttnContext | None
                 ) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin, ctx)
        ffn = self.feed_forward if self.moe is None else self.moe
        return h + ffn(self.ffn_norm(h))


class Decoder(nn.Module):
    """tok_embeddings -> layers -> norm -> output. `block(i)` builds block i; `rope_freqs` are
    the RoPE frequencies (CPU, in the dtype the tables are computed in) and `rope_scale` the
    factor on the tables (YaRN's attention factor, else 1); `norm(dim, eps=...)` builds the final
    norm (titanlite.layers.norm.OffsetRMSNorm for a (1 + w) family)."""

    def __init__(self, args: DecoderArgs, block: Callable[[int], nn.Module], rope_freqs: torch.Tensor,
                 rope_scale: float = 1.0, norm: Callable[..., nn.Module] = nn.RMSNorm):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        # a dict keeps parameter names stable if layers are ever removed (pipeline stages)
        self.layers = nn.ModuleDict({str(i): block(i) for i in range(args.n_layers)})
        self.norm = norm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        # plain CPU attributes, not buffers: `to_empty` leaves them, so the tables can be recomputed
        self.rope_freqs, self.rope_scale = rope_freqs, rope_scale
        self.register_buffer("rope_cos", torch.empty(args.max_seq_len, len(rope_freqs)), persistent=False)
        self.register_buffer("rope_sin", torch.empty(args.max_seq_len, len(rope_freqs)), persistent=False)
        self.init_buffers()

    @torch.no_grad()
    def init_buffers(self) -> None:
        """Give every buffer its initial value: the RoPE tables (from the args alone) and zero
        MoE loads and selection biases. Called at construction, and by titanlite.layers.init.materialize
        after `to_empty` (which leaves buffers uninitialised)."""
        if not self.rope_cos.is_meta:  # on meta there is nothing to fill: spare computing the tables
            cos, sin = rope.tables(self.rope_freqs, self.args.max_seq_len, self.rope_scale)
            self.rope_cos.copy_(cos)
            self.rope_sin.copy_(sin)
        for moe in moe_layers([self]):
            moe.init_buffers()

    def init_weights(self, seed: int) -> None:
        """Draw every parameter this module holds (a pipeline stage holds some), by name. A value
        depends only on (seed, its name, its full shape), so every layout (tensor, expert or
        pipeline parallel) starts from the weights one process would draw. Any name has a rule
        (`init_rule`), so a parameter a fork adds anywhere is drawn the same on every layout."""
        # parameter names are the single-device model's on every layout (nothing wraps a module)
        for name, param in self.named_parameters():
            draw, std, cutoff = self.init_rule(name)
            if std is None:
                init.ones_(param)
            else:
                init.normal_(param, draw, seed, std, cutoff)

    def block_depth(self, name: str) -> int | None:
        """The block index a parameter belongs to (`layers.<i>.…`), None outside the blocks. A
        family with more blocks elsewhere (DeepSeek-V3's MTP depths) numbers them after these."""
        head, _, rest = name.partition(".")
        index = rest.partition(".")[0]
        return int(index) if head == "layers" and index.isdigit() else None

    def init_rule(self, name: str) -> tuple[str, float | None, float | None]:
        """(the name the value is drawn for, std, truncation in stds) of parameter `name`; std None:
        ones (a norm's scale). Tied weights are drawn under one name, on whichever stage holds them."""
        if name.endswith("norm.weight"):
            return name, None, None
        if name == "tok_embeddings.weight" and not self.args.tie_embeddings:
            return name, 1.0, None
        if name in ("tok_embeddings.weight", "output.weight"):
            return "output.weight", self.args.dim ** -0.5, 3.0
        depth = self.block_depth(name)
        linear = name.removesuffix(".weight").rsplit(".", 1)[-1]
        if depth is not None and linear in ("wo", "w2", "w3"):
            # deeper blocks write smaller updates so the residual stream does not grow with depth
            return name, 0.02 / (2 * (depth + 1)) ** 0.5, 3.0
        # every other weight and bias, a fork's own top-level parameters included
        return name, 0.02, 3.0

    def forward(self, tokens: torch.Tensor, ctx: AttnContext | None = None) -> torch.Tensor:
        """tokens: [B, S] (or hidden states [B, S, dim] on a later pipeline stage) -> logits
        [B, S, vocab] (or hidden states on an earlier stage)."""
        h, _, _ = self.hidden(tokens, ctx)
        return self.output(self.norm(h))

    def hidden(self, tokens: torch.Tensor, ctx: AttnContext | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The last block's output, before the final norm, and the RoPE tables it used (a family
        that runs more after the blocks, as DeepSeek-V3's MTP, reuses them)."""
        if ctx is not None and ctx.positions is not None:
            cos, sin = self.rope_cos[ctx.positions], self.rope_sin[ctx.positions]
        else:
            cos, sin = self.rope_cos[: tokens.shape[1]][None], self.rope_sin[: tokens.shape[1]][None]
        cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, cos, sin, ctx)
        return h, cos, sin


def attention_params(args: DecoderArgs) -> int:
    """Weights of one block's attention projections (q, k, v, o)."""
    return 2 * args.dim * args.n_heads * args.head_dim + 2 * args.dim * args.n_kv_heads * args.head_dim


def flops_per_token(args: DecoderArgs, seq_len: int, activated_params: int) -> float:
    """6 x the non-embedding parameters a token passes through (matmuls, forward + backward)
    + causal attention scores."""
    return 6 * activated_params + 12 * args.n_layers * args.n_heads * args.head_dim * seq_len


def dense_flops_per_token(args: DecoderArgs, seq_len: int) -> float:
    """ModelSpec.flops_per_token of a decoder whose every block has a dense feed-forward."""
    per_layer = attention_params(args) + 3 * args.dim * args.ffn_hidden
    return flops_per_token(args, seq_len, args.n_layers * per_layer + args.dim * args.vocab_size)
