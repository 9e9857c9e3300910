"""Qwen3: published parameter counts, Hugging Face logits parity, export round trip, configs."""

import dataclasses
import json

import pytest
import torch
from safetensors.torch import save_file

from models.qwen3 import flavors, hf
from models.qwen3.model import Transformer
from titanlite import config
from titanlite.config import ConfigError
from titanlite.train import preflight

transformers = pytest.importorskip("transformers")

# Totals as published for the Qwen/Qwen3-* releases (tied sizes count the table once),
# and the model cards' non-embedding counts in billions.
PUBLISHED = {"0.6B": (596_049_920, "0.44"), "1.7B": (1_720_574_976, "1.4"), "4B": (4_022_468_096, "3.6"),
             "8B": (8_190_735_360, "6.95"), "14B": (14_768_307_200, "13.2"), "32B": (32_762_123_264, "31.2")}


def _count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # parameters() yields a tied weight once


@pytest.mark.parametrize("flavor", list(PUBLISHED))
def test_flavor_parameter_counts_match_published_and_transformers(flavor):
    args = flavors[flavor]
    with torch.device("meta"):
        ours = Transformer(args)
        theirs = transformers.Qwen3ForCausalLM(_hf_config(args))
    total, non_embedding_b = PUBLISHED[flavor]
    assert _count(ours) == _count(theirs) == total
    embedding = args.vocab_size * args.dim * (1 if args.tie_embeddings else 2)
    digits = len(non_embedding_b.partition(".")[2])
    assert f"{(total - embedding) / 1e9:.{digits}f}" == non_embedding_b
    assert hf.args_from_hf(theirs.config.to_dict()) == args


def _hf_config(args, **extra):
    return transformers.Qwen3Config(**hf.config_to_hf(args, torch.float32), **extra)


def test_published_config_json_gives_the_flavor():
    # Qwen/Qwen3-0.6B's config.json as released (transformers 4.51 format)
    released = {"architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
                "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
                "hidden_size": 1024, "initializer_range": 0.02, "intermediate_size": 3072,
                "max_position_embeddings": 40960, "max_window_layers": 28, "model_type": "qwen3",
                "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8,
                "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None,
                "tie_word_embeddings": True, "torch_dtype": "bfloat16", "use_cache": True,
                "use_sliding_window": False, "vocab_size": 151936}
    assert hf.args_from_hf(released) == flavors["0.6B"]
    for bad, match in [({"model_type": "llama"}, "not 'qwen3'"), ({"attention_bias": True}, "attention_bias"),
                       ({"use_sliding_window": True}, "sliding"),
                       ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope type 'yarn'")]:
        with pytest.raises(ConfigError, match=match):
            hf.args_from_hf({**released, **bad})
    with pytest.raises(ConfigError, match="no Qwen3 counterpart"):
        hf.from_hf({"model.layers.0.self_attn.q_proj.bias": torch.zeros(4)}, flavors["0.6B"])


def _tiny(tie: bool):
    args = dataclasses.replace(flavors["debugmodel"], n_layers=2, max_seq_len=64, tie_embeddings=tie)
    torch.manual_seed(0)
    # larger weights than the default make the logits a sharper check
    theirs = transformers.Qwen3ForCausalLM(_hf_config(args, initializer_range=0.1)).float().eval()
    with torch.no_grad():  # norms start at ones; random ones catch a swapped or missed norm weight
        for name, p in theirs.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return args, theirs


@pytest.mark.parametrize("tie", [True, False])
def test_import_matches_transformers_logits(tie):
    args, theirs = _tiny(tie)
    ours = Transformer(args)
    ours.init_weights(torch.Generator().manual_seed(1))
    ours.load_state_dict(hf.from_hf(theirs.state_dict(), args), strict=True)
    assert (ours.output.weight is ours.tok_embeddings.weight) == tie
    tokens = torch.randint(0, args.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected, got = theirs(tokens).logits, ours.eval()(tokens)
    assert expected.abs().max() > 1.0  # the check below is meaningful only for non-trivial logits
    assert (got - expected).abs().max().item() <= 1e-5


@pytest.mark.parametrize("tie", [True, False])
def test_export_round_trips_through_transformers(tie, tmp_path):
    args, _ = _tiny(tie)
    ours = Transformer(args)
    ours.init_weights(torch.Generator().manual_seed(2))
    exported = hf.to_hf(ours.state_dict(), args)
    assert ("lm_head.weight" in exported) != tie
    back = hf.from_hf(exported, args)
    assert back.keys() == ours.state_dict().keys()
    assert all(torch.equal(back[k], v) for k, v in ours.state_dict().items())

    # what transformers itself loads from the exported files gives our logits
    save_file({k: v.contiguous() for k, v in exported.items()}, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps(hf.config_to_hf(args, torch.float32)))
    loaded = transformers.Qwen3ForCausalLM.from_pretrained(tmp_path, torch_dtype=torch.float32).eval()
    tokens = torch.randint(0, args.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (loaded(tokens).logits - ours.eval()(tokens)).abs().max().item() <= 1e-5
    assert hf.args_from_hf(loaded.config.to_dict()) == args


def test_tied_embeddings_survive_materialisation():
    with torch.device("meta"):
        model = Transformer(dataclasses.replace(flavors["debugmodel"], max_seq_len=64))
    model.to_empty(device="cpu")
    model.init_weights(torch.Generator().manual_seed(0))
    assert model.output.weight is model.tok_embeddings.weight
    assert torch.isfinite(model(torch.zeros(1, 8, dtype=torch.long))).all()


@pytest.mark.parametrize("name,world", [("qwen3_debug.toml", 1), ("qwen3_0.6b.toml", 8), ("qwen3_8b.toml", 64)])
def test_train_configs_pass_preflight(name, world):
    # the checks run_train.sh --check makes before launching, for the config's target world size
    cfg, _ = config.load(["--config", name])
    plan = preflight(cfg, world)
    assert (cfg.model.name, plan.spec.name) == ("qwen3", "qwen3")
    assert plan.args == dataclasses.replace(flavors[cfg.model.flavor], max_seq_len=cfg.training.seq_len)


@pytest.mark.parametrize("tp,message", [(3, "n_heads 8 is not divisible by parallelism.tensor_parallel_degree 3"),
                                        (8, "tensor_parallel_degree 8 exceeds n_kv_heads 4")])
def test_bad_tp_degree_is_refused_in_preflight(tp, message):
    cfg, _ = config.load(["--config", "qwen3_debug.toml", "--parallelism.tensor_parallel_degree", str(tp)])
    with pytest.raises(ConfigError, match=message):
        preflight(cfg, tp)
