"""The shared building blocks in titanlite/layers: YaRN RoPE against transformers."""

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from titanlite.layers.rope import YaRN, tables, yarn_frequencies

# (theta, head_dim, rope_parameters): defaults, DeepSeek-V3's (mscale = mscale_all_dim), unequal
# mscales, gpt-oss's (no truncation), an explicit attention factor, a ramp of zero width
YARN = {
    "defaults": (10000.0, 64, {"factor": 4.0, "original_max_position_embeddings": 2048}),
    "deepseek_v3": (10000.0, 64, {"factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32.0,
                                  "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}),
    "mscales": (10000.0, 128, {"factor": 16.0, "original_max_position_embeddings": 4096, "mscale": 0.707,
                               "mscale_all_dim": 1.0}),
    "gpt_oss": (150000.0, 64, {"factor": 32.0, "original_max_position_embeddings": 4096, "beta_fast": 32.0,
                               "beta_slow": 1.0, "truncate": False}),
    "attention_factor": (500000.0, 64, {"factor": 8.0, "original_max_position_embeddings": 8192,
                                        "attention_factor": 0.9}),
    "narrow_ramp": (10000.0, 16, {"factor": 2.0, "original_max_position_embeddings": 64, "beta_fast": 4.0,
                                  "beta_slow": 3.9}),
}
_NAMES = {"original_max_position_embeddings": "original_max_seq_len"}


def _yarn(name: str) -> tuple[float, int, YaRN, LlamaConfig]:
    theta, head_dim, params = YARN[name]
    ours = YaRN(**{_NAMES.get(k, k): v for k, v in params.items()})
    # max_position_embeddings = factor x the original context, which YaRN's config check expects
    cfg = LlamaConfig(hidden_size=4 * head_dim, num_attention_heads=4, head_dim=head_dim,
                      max_position_embeddings=int(params["factor"] * params["original_max_position_embeddings"]),
                      rope_parameters={"rope_type": "yarn", "rope_theta": theta, **params})
    return theta, head_dim, ours, cfg


@pytest.mark.parametrize("name", YARN)
def test_yarn_equals_transformers(name):
    theta, head_dim, ours, cfg = _yarn(name)
    theirs, their_factor = ROPE_INIT_FUNCTIONS["yarn"](cfg, "cpu")
    freqs, factor = yarn_frequencies(head_dim, theta, ours)
    assert freqs.dtype == theirs.dtype == torch.float32
    assert torch.equal(freqs, theirs)
    assert factor == their_factor


@pytest.mark.parametrize("name", ["deepseek_v3", "mscales"])
def test_yarn_tables_equal_transformers_cos_sin(name):
    """The attention factor scales the tables, as transformers scales cos and sin."""
    theta, head_dim, ours, cfg = _yarn(name)
    positions = 8192
    cos, sin = LlamaRotaryEmbedding(cfg)(torch.zeros(1, positions, head_dim), torch.arange(positions)[None])
    freqs, factor = yarn_frequencies(head_dim, theta, ours)
    got_cos, got_sin = tables(freqs, positions, factor)
    # transformers repeats the frequencies for the rotate-half layout: the first half is ours
    assert torch.equal(got_cos, cos[0, :, : head_dim // 2])
    assert torch.equal(got_sin, sin[0, :, : head_dim // 2])
