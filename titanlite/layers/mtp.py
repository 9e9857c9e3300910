"""Multi-token prediction (DeepSeek-V3): modules after the last block that each predict one
more token ahead, trained through an extra loss term (titanlite.loss.ExtraLosses).

Depth k (1..n) at position i combines the previous depth's hidden state (depth 1: the last
block's, before the final norm) with the embedding of token i + k, runs one more block and
predicts token i + k + 1 with the model's output head. Positions whose embedded or predicted
token lies past the end of the sequence are left out of the loss (their padded inputs only
reach themselves: attention is causal). The embedding is the model's own, tied, so a
pipeline's last stage holds a copy of it the way it holds a tied output layer.

The tokens come from the model's input on one process and from AttnContext.tokens on a later
pipeline stage; under context parallel each rank holds two chunks of the sequence, so the
whole sequence's ids (one small all-gather) give each position its neighbours.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn

from titanlite.layers.attention import AttnContext
from titanlite.loss import IGNORE_INDEX, ExtraLosses, add_extra_loss, cross_entropy_sum

MTP_LOSS = "mtp_loss"


class MTPModule(nn.Module):
    """One prediction depth: norms of both inputs, their projection to dim, a block, a norm
    before the shared output head (DeepSeek's enorm, hnorm, eh_proj, shared_head.norm)."""

    def __init__(self, dim: int, norm_eps: float, block: nn.Module):
        super().__init__()
        self.enorm = nn.RMSNorm(dim, eps=norm_eps)
        self.hnorm = nn.RMSNorm(dim, eps=norm_eps)
        self.eh_proj = nn.Linear(2 * dim, dim, bias=False)
        self.block = block
        self.norm = nn.RMSNorm(dim, eps=norm_eps)

    def forward(self, h: torch.Tensor, emb: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                ctx: AttnContext | None) -> torch.Tensor:
        return self.block(self.eh_proj(torch.cat([self.enorm(emb), self.hnorm(h)], dim=-1)), cos, sin, ctx)


def mtp_blocks(model: nn.Module) -> list[nn.Module]:
    """The blocks of a model's (or last pipeline stage's) prediction depths, in order (an earlier
    stage holds an nn.Identity in their place)."""
    depths = getattr(model, "mtp", None)
    return [depth.block for depth in depths.values()] if isinstance(depths, nn.ModuleDict) else []


def shifted(tokens: torch.Tensor, ctx: AttnContext | None, depth: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids to embed, targets) for `depth`: tokens i + depth and i + depth + 1 of each of this
    rank's positions i; 0 and IGNORE_INDEX past the end of the sequence."""
    cp = None if ctx is None else ctx.setup.cp
    if cp is None:
        full, index = tokens, torch.arange(tokens.shape[1], device=tokens.device)
    else:
        full = cp.gather(tokens, dim=1)
        index = cp.shard(torch.arange(full.shape[1], device=tokens.device), dim=0)
    padded = torch.cat([full, full.new_full((full.shape[0], depth + 1), IGNORE_INDEX)], dim=1)
    targets = padded[:, index + depth + 1]
    return padded[:, index + depth].clamp(min=0), targets


def mtp_loss(modules: nn.ModuleDict, h: torch.Tensor, tokens: torch.Tensor, ctx: AttnContext | None,
             cos: torch.Tensor, sin: torch.Tensor, embed: nn.Module, norm_head: Callable[[nn.Module, torch.Tensor],
                                                                                   torch.Tensor],
             weight: float, extra: ExtraLosses | None) -> torch.Tensor:
    """Run every depth from the last block's output `h` and add weight / n x the summed token
    losses of all depths to the training loss (`extra`, the step's; logged as MTP_LOSS); returns
    `h`, through which the term's gradient enters. `norm_head(module, x)`: the module's norm,
    then the output head."""
    if not modules or not torch.is_grad_enabled() or extra is None:
        return h  # validation and inference predict the next token only
    total, x = None, h
    for depth, module in enumerate(modules.values(), start=1):
        ids, targets = shifted(tokens, ctx, depth)
        x = module(x, embed(ids), cos, sin, ctx)
        loss = cross_entropy_sum(norm_head(module, x), targets)
        total = loss if total is None else total + loss
    return add_extra_loss(extra, h, MTP_LOSS, total * (weight / len(modules)))
