"""Qwen3.5 (dense and MoE): parameter counts of transformers' default configs, Hugging Face logits
parity both ways on random tiny models, the config.json round trip and what it refuses."""

import dataclasses

import pytest
import torch

from titanlite.checkpoint.hf import read_config, read_safetensors, write_hf_folder
from titanlite.errors import ConfigError
from titanlite.models.qwen3_5 import SPEC, flavors, hf
from titanlite.models.qwen3_5.model import Transformer
from titanlite.models.qwen3_5.parallelize import check_layout
from titanlite.parallel.mesh import ParallelDims

transformers = pytest.importorskip("transformers")

DEFAULTS = {"9B": (transformers.Qwen3_5TextConfig, transformers.Qwen3_5ForCausalLM, 8_953_803_264),
            "35B-A3B": (transformers.Qwen3_5MoeTextConfig, transformers.Qwen3_5MoeForCausalLM, 34_660_610_688)}
# 80 tokens: two chunks of 64 (transformers' chunk size too), the second padded
TOKENS = torch.randint(0, 512, (2, 80), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("flavor", list(DEFAULTS))
def test_flavor_is_transformers_default_config_with_its_parameter_count(flavor):
    config, model, total = DEFAULTS[flavor]
    with torch.device("meta"):
        ours, theirs = Transformer(flavors[flavor]), model(config())
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in theirs.parameters()) == total
    assert hf.args_from_hf(theirs.config.to_dict()) == flavors[flavor]


def _tiny(moe: bool):
    """debugmodel(_moe) narrowed, 4 blocks (3 linear, 1 full), random weights everywhere: norms
    and per-head scalars too, so a swapped or missed tensor shows in the logits."""
    args = dataclasses.replace(flavors["debugmodel_moe" if moe else "debugmodel"], dim=64,
                               ffn_hidden=0 if moe else 128, max_seq_len=128)
    cls = transformers.Qwen3_5MoeForCausalLM if moe else transformers.Qwen3_5ForCausalLM
    config = (transformers.Qwen3_5MoeTextConfig if moe else transformers.Qwen3_5TextConfig)(
        **hf.config_to_hf(args, torch.float32))
    torch.manual_seed(0)
    theirs = cls(config).float().eval()
    with torch.no_grad():
        for name, p in theirs.named_parameters():
            if "norm" in name:
                p.uniform_(-0.5, 0.5)
            elif "A_log" in name or "dt_bias" in name:
                p.uniform_(-1.0, 1.0)
            else:
                p.normal_(0, 0.1)  # transformers leaves fused experts and the router at zero
    return args, theirs


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_import_and_export_match_transformers_logits(tmp_path, moe):
    args, theirs = _tiny(moe)
    # import: the saved folder (one tensor per expert on disk) -> titanlite
    theirs.save_pretrained(tmp_path / "theirs")
    saved = read_safetensors(tmp_path / "theirs")
    assert SPEC.hf.args_from_hf(read_config(tmp_path / "theirs")) == args
    ours = Transformer(args)
    ours.load_state_dict(SPEC.hf.from_hf(saved, args), strict=True)
    with torch.no_grad():
        expected, got = theirs(TOKENS).logits, ours.eval()(TOKENS)
    assert expected.abs().max() > 1.0  # the check below is meaningful only for non-trivial logits
    assert (got - expected).abs().max().item() <= 1e-5
    # transformers' in-memory names (fused experts) read the same
    fused = SPEC.hf.from_hf(theirs.state_dict(), args)
    assert all(torch.equal(fused[k], v) for k, v in ours.state_dict().items())
    # export: titanlite (its own init, norms moved off zero) -> a folder transformers loads
    ours.init_weights(3)
    with torch.no_grad():
        for name, p in ours.named_parameters():
            if "norm" in name:
                p.uniform_(-0.5, 0.5)
    write_hf_folder(tmp_path / "ours", SPEC.hf.to_hf(ours.state_dict(), args), SPEC.hf.config_to_hf(args, torch.float32))
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours", dtype=torch.float32).eval()
    assert type(back) is type(theirs)
    with torch.no_grad():
        expected, got = back(TOKENS).logits, ours(TOKENS)
    assert expected.abs().max() > 1.0
    assert (got - expected).abs().max().item() <= 1e-5
    again = SPEC.hf.from_hf(SPEC.hf.to_hf(ours.state_dict(), args), args)
    assert again.keys() == ours.state_dict().keys()
    assert all(torch.equal(again[k], v) for k, v in ours.state_dict().items())


def test_refuses_what_it_cannot_express():
    cfg = hf.config_to_hf(flavors["9B"], torch.bfloat16)
    for bad, match in [({"layer_types": ["linear_attention"] * 31 + ["sliding_attention"]}, "layer_types"),
                       ({"model_type": "qwen3"}, "not 'qwen3_5_text'"),
                       ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "rope type 'yarn'")]:
        with pytest.raises(ConfigError, match=match):
            hf.args_from_hf({**cfg, **bad})
    args = flavors["debugmodel"]
    state = {k: v for k, v in Transformer(args).state_dict().items()}
    with pytest.raises(ConfigError, match="model.visual.patch_embed.proj.weight' has no Qwen3.5 counterpart"):
        hf.from_hf({**hf.to_hf(state, args), "model.visual.patch_embed.proj.weight": torch.zeros(1)}, args)
    with pytest.raises(ConfigError, match=r"^parallelism.context_parallel_degree: linear_backend fla does not run"):
        check_layout(dataclasses.replace(args, linear_backend="fla"), ParallelDims(1, 1, 2, 1))


def test_init_is_qwen3_5s():
    """(1 + w) norms start at zero, decay rates A = exp(A_log) in [1, 16], dt_bias at one."""
    model = Transformer(flavors["debugmodel"])
    model.init_weights(0)
    layer = model.layers["0"].attention
    assert torch.equal(model.norm.weight, torch.zeros(256)) and torch.equal(layer.dt_bias, torch.ones(8))
    assert torch.equal(model.layers["3"].attention.q_norm.weight, torch.zeros(64))
    assert torch.equal(layer.norm.weight, torch.ones(32))  # the gated norm scales by w itself
    assert 1.0 <= layer.A_log.exp().min() and layer.A_log.exp().max() <= 16.0 + 1e-4
