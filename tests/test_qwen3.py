"""Qwen3: published parameter counts, Hugging Face logits parity, export round trip, configs."""

import dataclasses

import pytest
import torch
from harness import TINY, train

from titanlite.models.qwen3 import SPEC, flavors, hf
from titanlite.models.qwen3.model import Transformer
from titanlite.config import load as config_load
from titanlite.layers import init
from titanlite.checkpoint.folder import load_tensors, write_model_checkpoint
from titanlite.config.data import Data
from titanlite.errors import ConfigError
from titanlite.tools.convert import main as convert_main
from titanlite.data.loader import build_dataloader
from titanlite.checkpoint.hf import read_config, read_safetensors
from titanlite.data.tokenizer import ByteTokenizer
from titanlite.preflight import preflight

import transformers  # noqa: E402

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


TOKENS = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("tie", [True, False])
def test_import_matches_transformers_logits(tie, tmp_path):
    args, theirs = _tiny(tie)
    theirs.save_pretrained(tmp_path, max_shard_size="100KB")  # several shards plus an index
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    assert SPEC.hf.args_from_hf(read_config(tmp_path)) == args
    ours = Transformer(args)
    ours.init_weights(1)
    ours.load_state_dict(SPEC.hf.from_hf(read_safetensors(tmp_path), args), strict=True)
    assert (ours.output.weight is ours.tok_embeddings.weight) == tie
    with torch.no_grad():
        expected, got = theirs(TOKENS).logits, ours.eval()(TOKENS)
    assert expected.abs().max() > 1.0  # the check below is meaningful only for non-trivial logits
    assert (got - expected).abs().max().item() <= 1e-5


@pytest.mark.parametrize("tie", [True, False])
def test_export_round_trips_through_transformers(tie, tmp_path):
    args, _ = _tiny(tie)
    ours = Transformer(args)
    ours.init_weights(2)
    exported = SPEC.hf.to_hf(ours.state_dict(), args)
    assert ("lm_head.weight" in exported) != tie
    back = SPEC.hf.from_hf(exported, args)
    assert back.keys() == ours.state_dict().keys()
    assert all(torch.equal(back[k], v) for k, v in ours.state_dict().items())

    # titanlite checkpoint -> HF folder -> transformers gives our logits
    write_model_checkpoint(tmp_path / "step-0", ours.state_dict(), "qwen3", args)
    convert_main(["dcp", "hf", str(tmp_path / "step-0"), str(tmp_path / "hf")])
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    assert type(loaded).__name__ == "Qwen3ForCausalLM" and loaded.config.tie_word_embeddings == tie
    with torch.no_grad():
        assert (loaded(TOKENS).logits - ours.eval()(TOKENS)).abs().max().item() <= 1e-5
    # and back into a titanlite checkpoint, bit for bit
    convert_main(["hf", "dcp", str(tmp_path / "hf"), str(tmp_path / "dcp"), "--model", "qwen3"])
    again = load_tensors(tmp_path / "dcp")
    assert all(torch.equal(again[k], v) for k, v in ours.state_dict().items())


def test_training_starts_from_hf_weights_under_tp(tmp_path):
    """The trainer's HF import (sharded over TP ranks) computes transformers' loss at step 1."""
    args = dataclasses.replace(flavors["debugmodel"], max_seq_len=64)
    torch.manual_seed(0)
    theirs = transformers.Qwen3ForCausalLM(_hf_config(args, initializer_range=0.1)).float().eval()
    theirs.save_pretrained(tmp_path / "hf")
    batch = next(iter(build_dataloader(Data(holdout_fraction=0.0), ByteTokenizer(), seq_len=64, global_batch_size=4,
                                       local_batch_size=4, dp_rank=0, dp_degree=1)))
    with torch.no_grad():
        logits = theirs(batch["input_ids"]).logits
    expected = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten()).item()
    run = train(2, [*TINY, "--model.name", "qwen3", "--training.steps", "3", "--training.global_batch_size", "4",
                    "--parallelism.tensor_parallel_degree", "2", "--checkpoint.initial_load_path",
                    str(tmp_path / "hf"), "--checkpoint.initial_load_format", "hf"])
    assert "initial weights from" in run.output
    assert abs(run.losses[0] - expected) / expected <= 1e-5, (run.losses[0], expected)


def test_tied_embeddings_survive_materialisation():
    with torch.device("meta"):
        model = Transformer(dataclasses.replace(flavors["debugmodel"], max_seq_len=64))
    init.materialize(model, torch.device("cpu"), 0)
    assert model.output.weight is model.tok_embeddings.weight
    assert torch.isfinite(model(torch.zeros(1, 8, dtype=torch.long))).all()


@pytest.mark.parametrize("name,world", [("qwen3_debug.toml", 1), ("qwen3_0.6b.toml", 8), ("qwen3_8b.toml", 64)])
def test_train_configs_pass_preflight(name, world):
    # the checks run_train.sh --check makes before launching, for the config's target world size
    cfg, _ = config_load.load(["--config", name])
    plan = preflight(cfg, world)
    assert (cfg.model.name, plan.spec.name) == ("qwen3", "qwen3")
    flavor = flavors[cfg.model.flavor]
    # training shrinks the RoPE tables to its sequence; the model's own context stays recorded
    assert plan.args == dataclasses.replace(flavor, max_seq_len=cfg.training.seq_len,
                                            context_len=flavor.context_len or flavor.max_seq_len)


@pytest.mark.parametrize("tp,message", [(3, "n_heads 8 is not divisible by parallelism.tensor_parallel_degree 3"),
                                        (8, "tensor_parallel_degree 8 exceeds n_kv_heads 4")])
def test_bad_tp_degree_is_refused_in_preflight(tp, message):
    cfg, _ = config_load.load(["--config", "qwen3_debug.toml", "--parallelism.tensor_parallel_degree", str(tp)])
    with pytest.raises(ConfigError, match=message):
        preflight(cfg, tp)
