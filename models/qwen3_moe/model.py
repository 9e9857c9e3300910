"""Qwen3-MoE, as plain single-device PyTorch.

Qwen3 dense with the feed-forward of (by default) every block replaced by titanlite.moe.MoE:
softmax router over 128 experts, top 8, top-k probabilities renormalised, no shared expert.
Attention (QK-norm, rotate-half RoPE in float32 angles) is Qwen3's, imported from that
family: the two families run the same attention by definition, and a fork of the dense family
that changes attention is a new family anyway. Parallelism lives in parallelize.py.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from models.qwen3.model import Attention, FeedForward, rope_angles
from titanlite import init
from titanlite.attention import AttnContext
from titanlite.moe import MoE, MoEArgs


@dataclass(frozen=True)
class ModelArgs:
    dim: int = 2048
    n_layers: int = 48
    n_heads: int = 32
    n_kv_heads: int = 4
    head_dim: int = 128
    ffn_hidden: int = 6144
    """Width of the dense feed-forward in `dense_layers` (Hugging Face's intermediate_size)."""
    vocab_size: int = 151936
    norm_eps: float = 1e-6
    rope_theta: float = 1000000.0
    max_seq_len: int = 40960
    tie_embeddings: bool = False
    moe: MoEArgs = field(default_factory=lambda: MoEArgs(num_experts=128, top_k=8, hidden=768))
    dense_layers: tuple[int, ...] = ()
    """Blocks with a dense feed-forward instead of experts (Hugging Face's mlp_only_layers)."""


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, args: ModelArgs):
        super().__init__()
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        if layer_id in args.dense_layers:
            self.feed_forward = FeedForward(args.dim, args.ffn_hidden)
        else:
            self.moe = MoE(args.dim, args.moe)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: AttnContext | None) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin, ctx)
        ffn = self.moe if hasattr(self, "moe") else self.feed_forward
        return h + ffn(self.ffn_norm(h))


# Second projections of each residual branch start smaller with depth (as in Qwen3 here).
_OUT_PROJ = ("wo", "w2", "w3")


def _param_std(fqn: str, args: ModelArgs) -> tuple[float, float | None]:
    """(std, truncation in stds) of a parameter by its canonical name."""
    if fqn == "tok_embeddings.weight" and not args.tie_embeddings:
        return 1.0, None
    if fqn in ("output.weight", "tok_embeddings.weight"):  # tied: the table is initialised as the output
        return args.dim ** -0.5, 3.0
    layer = int(fqn.split(".")[1])
    leaf = fqn.removesuffix(".weight").rsplit(".", 1)[-1]
    if leaf in _OUT_PROJ:
        return 0.02 / (2 * (layer + 1)) ** 0.5, 3.0
    return 0.02, 3.0


def _normal(param: torch.Tensor, fqn: str, seed: int, std: float, cutoff: float | None) -> None:
    """Draw the full parameter from a generator keyed by (seed, name, shape), keep this rank's part:
    the same values on every layout, whatever else the model holds."""
    key = zlib.crc32(f"{seed}:{fqn}:{tuple(param.shape)}".encode())
    full = torch.empty(param.shape, dtype=torch.float32)
    gen = torch.Generator().manual_seed(key)
    if cutoff is None:
        torch.nn.init.normal_(full, std=std, generator=gen)
    else:
        torch.nn.init.trunc_normal_(full, std=std, a=-cutoff * std, b=cutoff * std, generator=gen)
    with torch.no_grad():
        init._assign(param, full.to(device=param.device, dtype=param.dtype))


def canonical(fqn: str) -> str:
    return fqn.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        # a dict keeps parameter names stable if layers are ever removed (pipeline stages)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(i, args) for i in range(args.n_layers)})
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.register_buffer("rope_cos", torch.empty(args.max_seq_len, args.head_dim // 2), persistent=False)
        self.register_buffer("rope_sin", torch.empty(args.max_seq_len, args.head_dim // 2), persistent=False)

    @torch.no_grad()
    def init_weights(self, seed: int | torch.Generator) -> None:
        """Fill every parameter and buffer; call after `to_empty` on the target device. Each
        parameter's values depend only on (seed, name, full shape), so any layout, expert
        shards included, starts from the same weights."""
        if isinstance(seed, torch.Generator):
            seed = seed.initial_seed()
        if self.args.tie_embeddings and self.output.weight is not self.tok_embeddings.weight:
            self.output.weight = self.tok_embeddings.weight  # to_empty unties plain parameters
        angles = rope_angles(self.args)
        self.rope_cos.copy_(angles.cos())
        self.rope_sin.copy_(angles.sin())
        for name, p in self.named_parameters():
            fqn = canonical(name)
            if fqn.endswith("norm.weight"):
                init.ones_(p)
            else:
                _normal(p, fqn, seed, *_param_std(fqn, self.args))
        for name, b in self.named_buffers():
            if name.endswith("expert_bias") or name.endswith("tokens_per_expert"):
                b.zero_()

    def forward(self, tokens: torch.Tensor, ctx: AttnContext | None = None) -> torch.Tensor:
        """tokens: [B, S] (or hidden states [B, S, dim] on a later pipeline stage) -> logits."""
        if ctx is not None and ctx.positions is not None:
            cos, sin = self.rope_cos[ctx.positions], self.rope_sin[ctx.positions]
        else:
            cos, sin = self.rope_cos[: tokens.shape[1]][None], self.rope_sin[: tokens.shape[1]][None]
        cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, cos, sin, ctx)
        return self.output(self.norm(h))
