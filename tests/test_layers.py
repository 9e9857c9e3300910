"""The shared building blocks in titanlite/layers: YaRN RoPE against transformers, and a model's
buffers, computed at construction and again on the trainer's meta -> to_empty path."""

import dataclasses

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from titanlite.layers import init
from titanlite.layers.rope import YaRN, tables, yarn_frequencies
from titanlite.model_spec import get_model_spec

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


@pytest.mark.parametrize("family", ["llama3", "qwen3", "qwen3_moe", "gpt_oss"])
def test_buffers_are_computed_at_construction_and_after_to_empty(family):
    """spec.build on a real device gives the RoPE tables (and zero MoE state) at once; built on
    meta, init.materialize computes the same buffers after to_empty, bit for bit."""
    spec = get_model_spec(family)
    args = dataclasses.replace(spec.flavors["debugmodel"], max_seq_len=64)
    built = spec.build(args)
    # cos of position 0, times YaRN's attention factor (gpt-oss; 1 elsewhere)
    assert torch.equal(built.rope_cos[0], torch.full_like(built.rope_cos[0], built.rope_scale))
    assert built.rope_sin[1:].abs().min() > 0
    expected = {name: buf.clone() for name, buf in built.named_buffers()}
    with torch.device("meta"):
        meta = spec.build(args)
    init.materialize(meta, torch.device("cpu"), 0)
    built.init_weights(0)
    assert dict(meta.named_buffers()).keys() == expected.keys()
    assert all(torch.equal(buf, expected[name]) for name, buf in meta.named_buffers())
    assert all(torch.equal(p, meta.get_parameter(name)) for name, p in built.named_parameters())
    # whatever the buffers hold (to_empty leaves garbage), init_buffers gives them their values
    for buf in built.buffers():
        buf.fill_(float("nan"))
    built.init_buffers()
    assert all(torch.equal(buf, expected[name]) for name, buf in built.named_buffers())
