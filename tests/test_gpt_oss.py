"""gpt-oss: published parameter counts, Hugging Face logits parity both ways (windows shorter than
the sequence, sinks, biases, the clamped SwiGLU, YaRN), MXFP4 checkpoints, and refusals."""

import dataclasses
import json

import pytest
import torch
from safetensors.torch import save_file

import titanlite
from titanlite.checkpoint.weights import load_hf_weights
from titanlite.checkpoint.hf import read_config, read_safetensors, write_hf_folder
from titanlite.preflight import check_attention
from titanlite.errors import ConfigError
from titanlite.layers import rope
from titanlite.layers.attention import AttnSetup, attention
from titanlite.models.gpt_oss import SPEC, activated_params, flavors
from titanlite.models.gpt_oss.model import Transformer
from titanlite.parallel.mesh import ParallelDims

import transformers  # noqa: E402

# openai/gpt-oss-20b's config.json as published (transformers 4.55 format, MXFP4 experts)
RELEASED_20B = {
    "architectures": ["GptOssForCausalLM"], "attention_bias": True, "attention_dropout": 0.0, "eos_token_id": 200002,
    "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880, "initial_context_length": 4096,
    "initializer_range": 0.02, "intermediate_size": 2880,
    "layer_types": ["sliding_attention", "full_attention"] * 12, "max_position_embeddings": 131072,
    "model_type": "gpt_oss", "num_attention_heads": 64, "num_experts_per_tok": 4, "num_hidden_layers": 24,
    "num_key_value_heads": 8, "num_local_experts": 32, "output_router_logits": False, "pad_token_id": 199999,
    "quantization_config": {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                       "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"},
    "rms_norm_eps": 1e-05, "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                                            "original_max_position_embeddings": 4096, "rope_type": "yarn",
                                            "truncate": False},
    "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
    "tie_word_embeddings": False, "transformers_version": "4.55.0.dev0", "use_cache": True, "vocab_size": 201088}
# totals and activated counts of the model card (active: everything but the input embedding)
PUBLISHED = {"20B": (20_914_757_184, "3.61"), "120B": (116_829_156_672, "5.13")}


@pytest.mark.parametrize("flavor", list(PUBLISHED))
def test_flavor_parameter_counts_match_transformers_and_the_model_card(flavor):
    released = RELEASED_20B if flavor == "20B" else {**RELEASED_20B, "num_hidden_layers": 36, "num_local_experts": 128,
                                                      "layer_types": ["sliding_attention", "full_attention"] * 18}
    args = flavors[flavor]
    assert SPEC.hf.args_from_hf(released) == dataclasses.replace(args, max_seq_len=131072)
    with torch.device("meta"):
        ours = Transformer(args)
        theirs = transformers.GptOssForCausalLM(transformers.GptOssConfig(**released))
    total, active = PUBLISHED[flavor]
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in theirs.parameters()) == total
    assert f"{activated_params(args) / 1e9:.2f}" == active


def _tiny():
    """Every architectural feature at a tiny size: 8-key windows on even blocks of 64-token
    sequences, YaRN over 16 original positions, 4 experts (top 2) of width 32."""
    args = dataclasses.replace(flavors["debugmodel"], dim=64, n_heads=4, n_kv_heads=2, head_dim=16, max_seq_len=64,
                               sliding_window=8, yarn=rope.YaRN(factor=4.0, original_max_seq_len=16, truncate=False),
                               moe=dataclasses.replace(flavors["debugmodel"].moe, hidden=32, num_experts=4))
    torch.manual_seed(0)
    cfg = transformers.GptOssConfig(**SPEC.hf.config_to_hf(args, torch.float32), initializer_range=0.1)
    theirs = transformers.GptOssForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for name, p in theirs.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)  # norms start at ones: random ones catch a swapped or missed one
            elif "experts" in name or "router" in name or "bias" in name:
                p.normal_(0, 0.1)  # transformers starts expert biases at zero, and all biases matter here
            elif "sinks" in name:
                p.normal_(0, 1.0)
    return args, theirs


TOKENS = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(0))


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        out = model.eval()(TOKENS)
    return out.logits if hasattr(out, "logits") else out


def test_import_and_export_match_transformers_logits(tmp_path):
    args, theirs = _tiny()
    theirs.save_pretrained(tmp_path / "theirs")
    assert SPEC.hf.args_from_hf(read_config(tmp_path / "theirs")) == args
    ours = Transformer(args)
    ours.init_weights(1)
    ours.load_state_dict(SPEC.hf.from_hf(read_safetensors(tmp_path / "theirs"), args), strict=True)
    expected = _logits(theirs)
    assert expected.abs().max() > 1.0  # the check below is meaningful only for non-trivial logits
    assert (_logits(ours) - expected).abs().max().item() <= 1e-5
    # the experts' loop (grouped GEMM off) gives the same logits as the grouped GEMM above
    loop = Transformer(dataclasses.replace(args, moe=dataclasses.replace(args.moe, grouped_mm="off")))
    loop.load_state_dict(ours.state_dict())
    assert (_logits(loop) - expected).abs().max().item() <= 1e-5
    assert ours.layers["0"].moe.experts.use_grouped_mm and loop.layers["0"].moe.experts.use_grouped_mm is False
    # every feature changes the logits, so the parity above covers each of them
    for change in (dict(sliding_window=0, layer_types=()), dict(attn_sinks=False), dict(yarn=None),
                   dict(moe=dataclasses.replace(args.moe, swiglu_limit=0.0))):
        other = Transformer(dataclasses.replace(args, **change))
        other.load_state_dict(ours.state_dict(), strict=False)
        assert (_logits(other) - expected).abs().max() > 1e-3, change
    # export: fresh weights of ours, written in transformers' format, load there with our logits
    ours.init_weights(2)
    with torch.no_grad():
        for name, p in ours.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif "bias" in name or "b1" in name or "b2" in name or "b3" in name:
                p.normal_(0, 0.1)
    state = ours.state_dict()
    back = SPEC.hf.from_hf(SPEC.hf.to_hf(state, args), args)
    assert back.keys() == state.keys() and all(torch.equal(back[k], v) for k, v in state.items())
    write_hf_folder(tmp_path / "ours", SPEC.hf.to_hf(state, args), SPEC.hf.config_to_hf(args, torch.float32))
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours", dtype=torch.float32)
    assert type(loaded).__name__ == "GptOssForCausalLM"
    assert (_logits(loaded) - _logits(ours)).abs().max().item() <= 1e-5
    ours.layers["1"].moe.router.expert_bias[0] = 0.5
    with pytest.raises(ConfigError, match="layers.1.moe.router.expert_bias is non-zero"):
        SPEC.hf.to_hf(ours.state_dict(), args)


# MXFP4 written here from the format's definition (OCP microscaling): blocks of 32 values share an
# e8m0 scale 2^(s - 127); each value is FP4 e2m1 (sign, 2 exponent bits, 1 mantissa bit), two per
# byte with the first value in the low nibble.
MAGNITUDES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., cols] -> (blocks uint8 [..., cols / 32, 16], scales uint8 [..., cols / 32])."""
    groups = w.float().unflatten(-1, (-1, 32))
    exponent = torch.ceil(torch.log2(groups.abs().amax(-1).clamp_min(1e-30) / 6.0)).clamp(-127, 127)
    scaled = groups / torch.exp2(exponent).unsqueeze(-1)
    codes = (scaled.abs().unsqueeze(-1) - MAGNITUDES).abs().argmin(-1) + 8 * (scaled < 0)
    pairs = codes.to(torch.uint8).unflatten(-1, (-1, 2))
    return pairs[..., 0] | (pairs[..., 1] << 4), (exponent + 127).to(torch.uint8)


def dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    codes = torch.stack([blocks & 15, blocks >> 4], -1).flatten(-2).long()
    values = MAGNITUDES[codes % 8] * (1 - 2 * (codes // 8)).float()
    return (values * torch.exp2(scales.float() - 127).unsqueeze(-1)).flatten(-2)


def _quantized_folder(tmp_path, theirs) -> dict[str, torch.Tensor]:
    """The model's experts in the published MXFP4 layout (nn.Linear's (out, in), gate and up rows
    interleaved), the rest as saved; transformers' model gets the weights the folder holds."""
    state = {k: v.contiguous() for k, v in theirs.state_dict().items()}
    for key in [k for k in state if k.endswith(("gate_up_proj", "down_proj"))]:
        blocks, scales = quantize(state.pop(key).transpose(1, 2))
        state[key + "_blocks"], state[key + "_scales"] = blocks, scales
        with torch.no_grad():
            theirs.get_parameter(key).copy_(dequantize(blocks, scales).transpose(1, 2))
    tmp_path.mkdir()
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    cfg = {**theirs.config.to_dict(), "quantization_config": {"quant_method": "mxfp4"}}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return state


def test_mxfp4_experts_are_dequantised_on_import(tmp_path):
    args, theirs = _tiny()
    state = _quantized_folder(tmp_path / "q", theirs)
    # the quantiser is not the identity on these weights, and its blocks hold every code
    assert len(torch.unique(torch.cat([state[k].flatten() & 15 for k in state if k.endswith("_blocks")]))) == 16
    config, hf_state = titanlite.read_hf(tmp_path / "q")
    args_q = SPEC.hf.args_from_hf(config)
    ours = SPEC.build(args_q)
    ours.load_state_dict(SPEC.hf.from_hf(hf_state, args_q), strict=True)
    gate_up = theirs.model.layers[1].mlp.experts.gate_up_proj.detach()
    assert torch.equal(ours.layers["1"].moe.experts.w3.detach(), gate_up[..., 1::2].transpose(1, 2))
    expected = _logits(theirs)
    assert expected.abs().max() > 1.0
    assert (_logits(ours) - expected).abs().max().item() <= 1e-5
    # the trainer's load (checkpoint.initial_load_format hf): shapes from the headers, then a block at a time
    again = SPEC.build(args_q)
    load_hf_weights([again], tmp_path / "q", SPEC.hf, args_q)
    assert all(torch.equal(again.state_dict()[k], v) for k, v in ours.state_dict().items())


def test_malformed_mxfp4_is_refused_in_one_line_naming_key_and_file(tmp_path):
    args, theirs = _tiny()
    state = _quantized_folder(tmp_path / "q", theirs)
    key = "model.layers.0.mlp.experts.down_proj"
    for name, change in [("half_blocks", {key + "_blocks": state[key + "_blocks"][..., :8]}),
                         ("scales", {key + "_scales": state[key + "_scales"][:, :1]}),
                         ("float", {key + "_blocks": state[key + "_blocks"].float()}),
                         ("no_scales", {key + "_scales": None})]:
        bad = {k: v for k, v in {**state, **change}.items() if v is not None}
        folder = tmp_path / name
        folder.mkdir()
        save_file({k: v.contiguous() for k, v in bad.items()}, str(folder / "model.safetensors"))
        for meta in (True, False):  # the header check before loading, and the load itself
            with pytest.raises(ConfigError) as e:
                read_safetensors(folder, meta=meta)
            message = str(e.value)
            assert "\n" not in message and key in message and str(folder / "model.safetensors") in message, message
    # a state dict handed to the adapter without one half of a pair
    with pytest.raises(ConfigError, match=f"{key}_scales: missing"):
        SPEC.hf.from_hf({k: v for k, v in state.items() if k != key + "_scales"}, args)


def test_bad_attention_and_layout_input_is_refused_in_one_line():
    args = flavors["debugmodel"]
    with pytest.raises(ConfigError, match="sliding_window 8192 is larger than the model's context"):
        check_attention("sdpa", dataclasses.replace(args, sliding_window=8192), cp=1, cuda=False)
    with pytest.raises(ConfigError, match="model.attn_backend varlen cannot apply attention sinks"):
        check_attention("varlen", args, cp=1, cuda=True)
    q = torch.zeros(1, 2, 4, 8)
    with pytest.raises(ValueError, match="varlen cannot apply attention sinks"):
        attention(q, q, q, AttnSetup("varlen").context(), sinks=torch.zeros(2))
    with pytest.raises(ConfigError, match="expert_parallel_degree 3 does not divide"):
        SPEC.check_layout(args, ParallelDims(1, 3, 1, 1, ep=3))
    with pytest.raises(ConfigError, match="multiple of it"):
        SPEC.check_layout(args, ParallelDims(1, 2, 1, 2, ep=1))
    for bad, match in [({"model_type": "qwen3_moe"}, "not 'gpt_oss'"), ({"attention_bias": False}, "attention_bias"),
                       ({"quantization_config": {"quant_method": "fp8"}}, "quant_method is 'fp8'")]:
        with pytest.raises(ConfigError, match=match):
            SPEC.hf.args_from_hf({**RELEASED_20B, **bad})
