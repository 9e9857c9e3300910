"""Rotary position embeddings: the frequencies (plain, Llama 3.1 scaling, YaRN), the cos/sin
tables a model indexes by position, and the two layouts of rotated pairs.

Frequencies and tables are computed on the CPU whatever the current device (a model built on
meta, or on a GPU): the tables then hold the same bits on every device. Each family picks the
dtype its released weights were trained with (Llama 3 float64, Qwen3 float32).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


def frequencies(head_dim: int, theta: float, dtype: torch.dtype) -> torch.Tensor:
    """Plain RoPE: one rotation frequency per rotated pair, theta^(-2i/head_dim)."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=dtype, device="cpu") / head_dim))


def llama3_scaling(freqs: torch.Tensor, factor: float, low_freq_factor: float, high_freq_factor: float,
                   original_max_seq_len: int) -> torch.Tensor:
    """Llama 3.1 context extension (transformers' rope_type "llama3"): frequencies whose wavelength
    exceeds the original context / low_freq_factor are divided by `factor`, those shorter than
    the original context / high_freq_factor are kept, and the band between is blended."""
    wavelen = 2 * math.pi / freqs
    low_wavelen = original_max_seq_len / low_freq_factor
    high_wavelen = original_max_seq_len / high_freq_factor
    smooth = (original_max_seq_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * freqs / factor + smooth * freqs
    return torch.where(wavelen > low_wavelen, freqs / factor, torch.where(wavelen < high_wavelen, freqs, blended))


@dataclass(frozen=True)
class YaRN:
    """YaRN context extension (transformers' rope_type "yarn"; DeepSeek-V3, gpt-oss). Field names
    follow the config.json keys, `original_max_seq_len` being original_max_position_embeddings."""

    factor: float
    original_max_seq_len: int
    beta_fast: float = 32.0
    """Rotations over the original context above which a frequency is kept (extrapolated)."""
    beta_slow: float = 1.0
    """Rotations below which a frequency is divided by `factor` (interpolated); a ramp between."""
    mscale: float | None = None
    mscale_all_dim: float | None = None
    """With `mscale`, DeepSeek's attention factor: mscale(factor, mscale) / mscale(factor, mscale_all_dim)."""
    truncate: bool = True
    """Round the ramp's ends to whole dimensions (gpt-oss turns this off)."""
    attention_factor: float | None = None
    """Overrides the factor derived from `factor` and the mscales."""


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_frequencies(head_dim: int, theta: float, yarn: YaRN) -> tuple[torch.Tensor, float]:
    """YaRN's float32 frequencies and the attention factor that scales the cos/sin tables,
    computed as transformers' ROPE_INIT_FUNCTIONS["yarn"] computes them (bit for bit)."""
    if yarn.attention_factor is not None:
        attention_factor = yarn.attention_factor
    elif yarn.mscale and yarn.mscale_all_dim:
        attention_factor = _yarn_mscale(yarn.factor, yarn.mscale) / _yarn_mscale(yarn.factor, yarn.mscale_all_dim)
    else:
        attention_factor = _yarn_mscale(yarn.factor)

    def dim_of(rotations: float) -> float:
        """The dimension whose frequency turns `rotations` times over the original context."""
        return head_dim * math.log(yarn.original_max_seq_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(yarn.beta_fast), dim_of(yarn.beta_slow)
    if yarn.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # a ramp of zero width would divide by zero
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device="cpu") / head_dim)
    kept = 1 - ramp  # per frequency: 1 as trained (extrapolated), 0 divided by factor (interpolated)
    return 1.0 / (yarn.factor * pos_freqs) * (1 - kept) + 1.0 / pos_freqs * kept, attention_factor


def yarn_softmax_factor(yarn: YaRN | None) -> float:
    """DeepSeek's factor on the softmax scale under YaRN, mscale(factor, mscale_all_dim)^2 (1 without
    mscale_all_dim), as transformers' DeepSeek-V3 attention applies it."""
    if yarn is None or not yarn.mscale_all_dim:
        return 1.0
    return _yarn_mscale(yarn.factor, yarn.mscale_all_dim) ** 2


def tables(freqs: torch.Tensor, max_seq_len: int, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of every position's angles, [max_seq_len, len(freqs)], in freqs' dtype;
    `scale` is YaRN's attention factor (1 otherwise)."""
    angles = torch.outer(torch.arange(max_seq_len, dtype=freqs.dtype, device=freqs.device), freqs)
    return angles.cos() * scale, angles.sin() * scale


def rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent pairs, dims 2i and 2i+1 (Meta's layout). x: [B, S, H, D]; cos/sin: [B or 1, S, 1, D/2]."""
    pairs = x.float().unflatten(-1, (-1, 2))
    x0, x1 = pairs[..., 0], pairs[..., 1]
    out = torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1)
    return out.flatten(-2).type_as(x)


def rotate_halves(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate dim i with dim i + D/2 (the layout of transformers' rotate_half, which Qwen's weights
    are trained in). x: [B, S, H, D]; cos/sin: [B or 1, S, 1, D/2]."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).type_as(x)
