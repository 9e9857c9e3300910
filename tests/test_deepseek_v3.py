"""DeepSeek-V3 family: parameter counts of the released configs, Hugging Face logits parity both
ways (FP8 checkpoints included), the routing options, what per-block compile compiles, and bad
input before launch."""

import dataclasses
import json
import re

import pytest
import torch

from titanlite.config import load as config_load
from titanlite.preflight import make_plan, preflight
import titanlite
from titanlite.checkpoint.folder import load_tensors
from titanlite.checkpoint.weights import load_hf_weights
from titanlite.checkpoint.hf import read_config, read_safetensors, write_hf_folder
from titanlite.errors import ConfigError
from titanlite.layers.moe import MoE
from titanlite.models.deepseek_v3 import SPEC, activated_params, flavors, hf
from titanlite.models.deepseek_v3.model import Transformer
from titanlite.models.deepseek_v3.parallelize import check_layout
from titanlite.tools.convert import main as convert_main
from titanlite.parallel.mesh import ParallelDims

import transformers  # noqa: E402

# Parameter totals of transformers' build of each released config.json (MTP dropped, as
# transformers drops it): Moonlight-16B-A3B, DeepSeek-V3 (671B), Kimi K2 (1.04T).
PUBLISHED = {"16B": 15_960_108_544, "671B": 671_026_404_352, "1T": 1_026_408_209_408}
# deepseek-ai/DeepSeek-V3's config.json as released (auto_map and token ids left out)
RELEASED_671B = {
    "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "first_k_dense_replace": 3, "hidden_act": "silu", "hidden_size": 7168, "initializer_range": 0.02,
    "intermediate_size": 18432, "kv_lora_rank": 512, "max_position_embeddings": 163840, "model_type": "deepseek_v3",
    "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256,
    "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 128, "num_experts_per_tok": 8,
    "num_hidden_layers": 61, "num_key_value_heads": 128, "num_nextn_predict_layers": 1, "q_lora_rank": 1536,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "weight_block_size": [128, 128]},
    "rms_norm_eps": 1e-06, "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                                            "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                                            "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "seq_aux": True,
    "tie_word_embeddings": False, "topk_group": 4, "topk_method": "noaux_tc", "torch_dtype": "bfloat16",
    "use_cache": True, "v_head_dim": 128, "vocab_size": 129280}


def test_flavor_parameter_counts_match_transformers_and_the_released_config():
    for flavor, total in PUBLISHED.items():
        args = flavors[flavor]
        with torch.device("meta"):
            ours = Transformer(args)
            theirs = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**hf.config_to_hf(args, torch.bfloat16)))
        mine = sum(p.numel() for n, p in ours.named_parameters() if not n.startswith("mtp"))
        assert mine == sum(p.numel() for p in theirs.parameters()) == total, flavor
        assert hf.args_from_hf(theirs.config.to_dict()) == args
    assert hf.args_from_hf(RELEASED_671B) == flavors["671B"]
    # the model cards' activated sizes ("37B", "32B"), input embedding included, MTP not
    for flavor, billions in (("671B", 37), ("1T", 32)):
        args = dataclasses.replace(flavors[flavor], mtp_layers=0)
        assert int((activated_params(args) + args.dim * args.vocab_size) / 1e9) == billions
    # DeepSeek-V3's MTP depth (kept in titanlite's checkpoints, dropped by transformers): with the
    # copies of embedding and head the release stores in it, the "685B" of the model card (684.5B)
    with torch.device("meta"):
        mtp = sum(p.numel() for n, p in Transformer(flavors["671B"]).named_parameters() if n.startswith("mtp"))
    assert round((PUBLISHED["671B"] + mtp + 2 * 129280 * 7168) / 1e9, 1) == 684.5
    for bad, match in [({"scoring_func": "softmax"}, "scoring_func"), ({"topk_method": "greedy"}, "topk_method"),
                       ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope type 'linear'")]:
        with pytest.raises(ConfigError, match=match):
            hf.args_from_hf({**RELEASED_671B, **bad})


def _tiny(q_lora_rank: int, yarn: bool, mtp_layers: int = 0):
    """A random transformers model of the debug shapes (two groups kept of four, a dense first
    layer, a non-zero selection bias), and our args for it."""
    base = flavors["debugmodel"]
    args = dataclasses.replace(base, q_lora_rank=q_lora_rank, max_seq_len=2048, mtp_layers=mtp_layers,
                               yarn=base.yarn if yarn else None, rope_interleave=yarn)
    torch.manual_seed(0)
    cfg = transformers.DeepseekV3Config(**hf.config_to_hf(args, torch.float32), initializer_range=0.1)
    theirs = transformers.DeepseekV3ForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for name, p in theirs.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
        for name, b in theirs.named_buffers():
            if "e_score_correction_bias" in name:
                b.uniform_(-0.05, 0.05)
    return args, theirs


TOKENS = torch.randint(0, 512, (2, 48), generator=torch.Generator().manual_seed(0))


def _max_diff(ours, theirs) -> float:
    with torch.no_grad():
        expected, got = theirs(TOKENS).logits, ours.eval()(TOKENS)
    assert expected.abs().max() > 1.0  # non-trivial logits
    return (got - expected).abs().max().item()


@pytest.mark.parametrize("q_lora_rank,yarn", [(64, True), (0, False)], ids=["q_lora_yarn", "plain_q"])
def test_import_and_export_match_transformers_logits(q_lora_rank, yarn, tmp_path):
    args, theirs = _tiny(q_lora_rank, yarn)
    theirs.save_pretrained(tmp_path / "theirs")
    saved = read_safetensors(tmp_path / "theirs")
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in saved
    assert SPEC.hf.args_from_hf(read_config(tmp_path / "theirs")) == args
    ours = Transformer(args)
    ours.load_state_dict(SPEC.hf.from_hf(saved, args), strict=True)
    assert ours.layers["1"].moe.router.expert_bias.abs().min() > 0  # e_score_correction_bias read
    assert _max_diff(ours, theirs) <= 1e-5
    fused = SPEC.hf.from_hf(theirs.state_dict(), args)  # transformers' in-memory (fused) names
    assert all(torch.equal(fused[k], v) for k, v in ours.state_dict().items())
    # export: our own random weights (and a moved selection bias) -> from_pretrained
    ours.init_weights(3)
    with torch.no_grad():
        for name, p in ours.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
        ours.layers["2"].moe.router.expert_bias.uniform_(-0.05, 0.05)
    write_hf_folder(tmp_path / "ours", SPEC.hf.to_hf(ours.state_dict(), args), SPEC.hf.config_to_hf(args, torch.float32))
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours", dtype=torch.float32).eval()
    assert type(back).__name__ == "DeepseekV3ForCausalLM"
    assert _max_diff(ours, back) <= 1e-5


def test_a_folder_transformers_saved_loads_its_weights_and_seeds_the_mtp_depth(tmp_path, capsys, monkeypatch):
    """save_pretrained keeps num_nextn_predict_layers but never the MTP weights: the Python API and
    the trainer's initial load (load_hf_weights) read every weight the folder holds, the MTP depth
    keeps its seeded values, and one line says so."""
    args, theirs = _tiny(0, False, mtp_layers=1)
    theirs.save_pretrained(tmp_path)
    assert read_config(tmp_path)["num_nextn_predict_layers"] == 1
    assert not any(".layers.3." in k for k in read_safetensors(tmp_path, meta=True))  # no MTP block saved
    seeded = Transformer(args)
    seeded.init_weights(5)
    mtp = {k: v for k, v in seeded.state_dict().items() if k.startswith("mtp.0.")}
    capsys.readouterr()  # transformers' progress bars
    model, loaded_args = titanlite.load_hf(tmp_path, "deepseek_v3", seed=5)
    line = (f"titanlite: {tmp_path} holds no weights for mtp.0.* ({len(mtp)} tensors; transformers does not save "
            "them): they start from their seeded initial values")
    assert capsys.readouterr().err.strip() == line
    assert loaded_args == args and _max_diff(model, theirs) <= 1e-5
    assert len(mtp) > 10 and all(torch.equal(model.state_dict()[k], v) for k, v in mtp.items())
    # the trainer's checkpoint.initial_load_path (format hf) path, into a model built for the run
    ours = Transformer(args)
    ours.init_weights(5)
    with torch.device("meta"):
        whole = Transformer(args).state_dict().keys()
    assert sorted(load_hf_weights([ours], tmp_path, SPEC.hf, args, whole)) == sorted(mtp)
    assert all(torch.equal(ours.state_dict()[k], v) for k, v in model.state_dict().items())
    # tools/convert hf -> dcp writes the whole model, the MTP depth seeded (seed 0) and said so,
    # so the checkpoint loads as a dcp initial_load_path like any other
    convert_main(["hf", "dcp", str(tmp_path), str(tmp_path / "dcp"), "--model", "deepseek_v3"])
    assert "they start from their seeded initial values" in capsys.readouterr().err
    assert sorted(load_tensors(tmp_path / "dcp", "model.")) == sorted(whole)
    # a folder missing a weight that is not optional is still refused, by the API and before launch
    saved = {k: v for k, v in read_safetensors(tmp_path).items() if k != "model.norm.weight"}
    write_hf_folder(tmp_path / "short", saved, read_config(tmp_path))
    with pytest.raises(ConfigError, match="short has no 'norm.weight'"):
        titanlite.load_hf(tmp_path / "short", "deepseek_v3")
    flavor = {"q_lora_rank": 0, "yarn": None, "rope_interleave": False, "mtp_layers": 1}
    monkeypatch.setitem(flavors, "tiny", dataclasses.replace(flavors["debugmodel"], **flavor))
    job = ["--model.name", "deepseek_v3", "--model.flavor", "tiny", "--training.seq_len", "64",
           "--job.dump_folder", str(tmp_path / "dump"), "--checkpoint.initial_load_format", "hf"]
    make_plan(config_load.load([*job, "--checkpoint.initial_load_path", str(tmp_path)])[0], 1)
    with pytest.raises(ConfigError, match="short has no 'norm.weight'"):
        make_plan(config_load.load([*job, "--checkpoint.initial_load_path", str(tmp_path / "short")])[0], 1)


def _quantise(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's FP8 layout: float8_e4m3 weight, float32 inverse scale per 128 x 128 block."""
    rows, cols = w.shape
    pad = torch.zeros(-(-rows // 128) * 128, -(-cols // 128) * 128)
    pad[:rows, :cols] = w
    blocks = pad.unflatten(0, (-1, 128)).unflatten(2, (-1, 128))  # [R, 128, C, 128]
    scale = blocks.abs().amax(dim=(1, 3)) / 448.0
    q = (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn).flatten(2).flatten(0, 1)[:rows, :cols]
    return q, scale


def test_fp8_checkpoint_with_mtp_is_dequantised_on_load(tmp_path):
    """A DeepSeek-style folder: FP8 linear weights with weight_scale_inv, the MTP depth as block
    n_layers with its copies of embedding and head. Loads to the dequantised weights, logits
    as transformers' on the same dequantised weights, and the MTP depth round-trips."""
    args, theirs = _tiny(64, True)
    args = dataclasses.replace(args, mtp_layers=1, dim=160, ffn_hidden=320)  # > 128: blocks at the edge
    src = Transformer(args)
    src.init_weights(5)
    exported = hf.to_hf(src.state_dict(), args)
    assert "model.layers.3.shared_head.head.weight" in exported and "model.layers.3.eh_proj.weight" in exported
    quantised, expected = {}, {}
    for key, w in exported.items():
        if w.dim() == 2 and "proj" in key and "eh_proj" not in key:
            q, s = _quantise(w)
            quantised[key], quantised[key + "_scale_inv"] = q, s
            expected[key] = q.float() * s.repeat_interleave(128, 0)[:w.shape[0]].repeat_interleave(128, 1)[:, :w.shape[1]]
        else:
            quantised[key] = expected[key] = w
    assert quantised["model.layers.0.self_attn.q_a_proj.weight_scale_inv"].shape == (1, 2)
    write_hf_folder(tmp_path, quantised, hf.config_to_hf(args, torch.bfloat16))
    loaded = hf.from_hf(read_safetensors(tmp_path), args)
    want = hf.from_hf(expected, args)
    assert loaded.keys() == src.state_dict().keys()
    assert all(torch.equal(loaded[k], want[k]) for k in want)
    err = (loaded["layers.1.moe.experts.w1"] - src.state_dict()["layers.1.moe.experts.w1"]).abs().max()
    assert 0 < err < 0.01  # FP8 rounding, not garbage
    ours = Transformer(args)
    ours.load_state_dict(loaded, strict=True)
    write_hf_folder(tmp_path / "deq", {k: v for k, v in expected.items() if not k.startswith("model.layers.3.")},
                    {**hf.config_to_hf(args, torch.float32), "num_nextn_predict_layers": 0})
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "deq", dtype=torch.float32).eval()
    assert _max_diff(ours, theirs) <= 1e-5
    with pytest.raises(ConfigError, match="scale_inv has shape"):
        hf.from_hf({**quantised, "model.layers.0.self_attn.q_a_proj.weight_scale_inv": torch.ones(2, 2)}, args)


def test_group_limited_routing_and_scaling():
    """Each token's experts lie in its topk_group best groups (scored by their top-2 biased
    scores), and the gate weights sum to routed_scaling_factor."""
    moe_args = flavors["debugmodel"].moe
    moe = MoE(16, moe_args)
    torch.manual_seed(0)
    with torch.no_grad():
        moe.router.gate.weight.normal_()
        moe.router.expert_bias.uniform_(-0.2, 0.2)
    x = torch.randn(200, 16)
    weights, ids, scores = moe.router(x)
    biased = (scores + moe.router.expert_bias).view(200, 4, 2)
    best = biased.topk(2, dim=-1).values.sum(-1).topk(2, dim=-1).indices
    assert all(set((ids[t] // 2).tolist()) <= set(best[t].tolist()) for t in range(200))
    ungrouped = (scores + moe.router.expert_bias).topk(2, dim=-1).indices
    assert (ids.sort(-1).values != ungrouped.sort(-1).values).any()  # the limit changed some choices
    torch.testing.assert_close(weights.sum(-1), torch.full((200,), 2.5))


def test_bad_model_and_layout_refused_in_one_line():
    base = dataclasses.replace(flavors["debugmodel"], max_seq_len=64)
    one = ParallelDims(1, 1, 1, 1)
    moe = base.moe
    cases = [
        (dataclasses.replace(base, qk_rope_head_dim=15), one, "qk_rope_head_dim 15 must be positive and even"),
        (dataclasses.replace(base, n_kv_heads=2), one, "n_kv_heads 2 must equal n_heads 4"),
        (dataclasses.replace(base, kv_lora_rank=0), one, "MLA dims kv_lora_rank 0"),
        (dataclasses.replace(base, moe=dataclasses.replace(moe, topk_group=5)), one, "topk_group 5 exceeds n_group 4"),
        (dataclasses.replace(base, moe=dataclasses.replace(moe, n_group=3, topk_group=2)), one,
         "num_experts 8 is not divisible into n_group 3"),
        (dataclasses.replace(base, max_seq_len=2), one, "leaves no target for 1 multi-token"),
        (dataclasses.replace(base, moe=dataclasses.replace(moe, aux_loss_coeff=0.01)), ParallelDims(1, 1, 2, 1),
         "sequence-wise auxiliary loss"),
        (dataclasses.replace(base, dim=130), ParallelDims(1, 1, 1, 4, ep=4), "dim (the MTP projection eh_proj) 130"),
        (dataclasses.replace(base, n_layers=1), ParallelDims(1, 1, 1, 1, pp=2), "MTP depth(s) go on the last"),
    ]
    check_layout(base, ParallelDims(1, 2, 1, 2, ep=2, pp=2))  # what the parallel tests run
    for args, dims, match in cases:
        with pytest.raises(ConfigError, match=re.escape(match)) as e:
            check_layout(args, dims)
        assert "\n" not in str(e.value)
    # through the preflight that run_train.sh runs before launching (the debug config's [moe]
    # turns the sequence-wise loss on)
    cfg, _ = config_load.load(["--config", "deepseek_v3_debug.toml", "--parallelism.context_parallel_degree", "2"])
    with pytest.raises(ConfigError, match="sequence-wise auxiliary loss"):
        preflight(cfg, 2)
    cfg, _ = config_load.load(["--config", "deepseek_v3_debug.toml", "--parallelism.expert_parallel_degree", "3"])
    with pytest.raises(ConfigError, match="expert_parallel_degree 3 does not divide the model's 8 experts"):
        preflight(cfg, 3)


def test_mtp_loss_reaches_the_training_loss():
    """The MTP term is computed inside a training step (and only there), its gradient reaches
    the MTP weights and the shared embedding through the main loss's backward."""
    from titanlite.loss import ExtraLosses, cross_entropy_sum
    args = dataclasses.replace(flavors["debugmodel"], max_seq_len=64)
    model = Transformer(args)
    model.init_weights(0)
    tokens = torch.randint(0, 512, (2, 65), generator=torch.Generator().manual_seed(1))
    n = torch.tensor(float(tokens[:, 1:].numel()))
    extra = ExtraLosses()
    extra.bind([model])
    with extra.collect(n) as sums:
        (cross_entropy_sum(model(tokens[:, :-1]), tokens[:, 1:]) / n).backward()
    assert set(sums) == {"mtp_loss"} and sums["mtp_loss"] > 0
    assert model.mtp["0"].eh_proj.weight.grad.abs().sum() > 0
    assert model.mtp_embeddings.weight is model.tok_embeddings.weight
    assert json.dumps(hf.config_to_hf(args, torch.float32))  # serialisable


def test_compile_goes_through_mla_and_the_moe_block_around_the_experts(monkeypatch):
    """Per-block compile: the dense block whole; in a MoE block the attention (MLA), the router,
    the shared experts and the experts' grouped GEMMs; only their data-dependent dispatch stays
    eager. The compiled training run is in test_deepseek_v3_parity.py."""
    from titanlite.layers.moe import moe_layers
    from titanlite.parallel.apply import all_blocks, apply_compile
    compiled: list[torch.nn.Module] = []
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **kwargs: compiled.append(self))
    model = Transformer(dataclasses.replace(flavors["debugmodel"], max_seq_len=64))
    apply_compile(all_blocks(model, SPEC))
    names = {name for name, m in model.named_modules() if any(m is c for c in compiled)}
    # the MTP depth's block too
    assert names == {"layers.0", *(f"{block}.{part}" for block in ("layers.1", "layers.2", "mtp.0.block")
                                   for part in ("attention", "moe.router", "moe.shared"))}
    # the experts' grouped GEMMs and SwiGLU: one compiled function shared by every MoE layer
    assert all(m.experts.compiled for m in moe_layers([model]))
    assert not any(m.experts.compiled for m in moe_layers([Transformer(model.args)]))
