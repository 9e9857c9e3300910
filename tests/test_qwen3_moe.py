"""Qwen3-MoE: published parameter counts, Hugging Face logits parity both ways, layout-free init."""

import dataclasses
import math

import pytest
import torch

from titanlite.models.qwen3_moe import SPEC, activated_params, flavors, hf
from titanlite.models.qwen3_moe.model import Transformer
from titanlite.errors import ConfigError
from harness import TINY, train

from titanlite.checkpoint.folder import load_tensors, write_model_checkpoint
from titanlite.config.data import Data
from titanlite.data.loader import build_dataloader
from titanlite.checkpoint.hf import read_config, read_safetensors
from titanlite.data.tokenizer import ByteTokenizer
from titanlite.tools.convert import main as convert_main

import transformers  # noqa: E402

# Totals and activated sizes as published for Qwen/Qwen3-30B-A3B and Qwen/Qwen3-235B-A22B
PUBLISHED = {"30B-A3B": (30_532_122_624, "3.3"), "235B-A22B": (235_093_634_560, "22")}


def _hf_config(args, **extra):
    return transformers.Qwen3MoeConfig(**hf.config_to_hf(args, torch.float32), **extra)


@pytest.mark.parametrize("flavor", list(PUBLISHED))
def test_flavor_parameter_counts_match_published_and_transformers(flavor):
    args = flavors[flavor]
    with torch.device("meta"):
        ours = Transformer(args)
        theirs = transformers.Qwen3MoeForCausalLM(_hf_config(args))
    total, active_b = PUBLISHED[flavor]
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in theirs.parameters()) == total
    # the model cards truncate (3.35B reads "3.3B"); activated counts include the input embedding
    scale = 10 ** len(active_b.partition(".")[2])
    active = (activated_params(args) + args.dim * args.vocab_size) / 1e9
    assert str(math.floor(active * scale) / scale).removesuffix(".0") == active_b
    assert hf.args_from_hf(theirs.config.to_dict()) == args


def test_released_config_json_gives_the_flavor():
    # Qwen/Qwen3-30B-A3B's config.json as released (transformers 4.51 format)
    released = {"architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
                "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128,
                "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 6144,
                "max_position_embeddings": 40960, "max_window_layers": 48, "mlp_only_layers": [],
                "model_type": "qwen3_moe", "moe_intermediate_size": 768, "norm_topk_prob": True,
                "num_attention_heads": 32, "num_experts": 128, "num_experts_per_tok": 8,
                "num_hidden_layers": 48, "num_key_value_heads": 4, "output_router_logits": False,
                "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000.0,
                "router_aux_loss_coef": 0.001, "sliding_window": None, "tie_word_embeddings": False,
                "torch_dtype": "bfloat16", "use_cache": True, "use_sliding_window": False, "vocab_size": 151936}
    assert hf.args_from_hf(released) == flavors["30B-A3B"]
    assert hf.args_from_hf({**released, "decoder_sparse_step": 2}).dense_layers == tuple(range(0, 48, 2))
    for bad, match in [({"model_type": "qwen3"}, "not 'qwen3_moe'"), ({"attention_bias": True}, "attention_bias"),
                       ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope type 'yarn'")]:
        with pytest.raises(ConfigError, match=match):
            hf.args_from_hf({**released, **bad})


def _tiny():
    # 4 layers, the third dense (mlp_only_layers), 8 experts of width 64, top 2, renormalised
    args = dataclasses.replace(flavors["debugmodel"], dim=128, ffn_hidden=256, max_seq_len=64, dense_layers=(2,),
                               moe=dataclasses.replace(flavors["debugmodel"].moe, hidden=64))
    torch.manual_seed(0)
    theirs = transformers.Qwen3MoeForCausalLM(_hf_config(args, initializer_range=0.1)).float().eval()
    with torch.no_grad():
        for name, p in theirs.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)  # norms start at ones: random ones catch a swapped or missed one
            elif "experts" in name or "mlp.gate" in name:
                p.normal_(0, 0.1)  # transformers leaves fused expert weights and the router at zero
    return args, theirs


TOKENS = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(0))


def test_import_matches_transformers_logits(tmp_path):
    args, theirs = _tiny()
    theirs.save_pretrained(tmp_path, max_shard_size="200KB")  # several shards plus an index
    saved = read_safetensors(tmp_path)
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    assert "model.layers.0.mlp.experts.7.down_proj.weight" in saved  # one tensor per expert on disk
    assert SPEC.hf.args_from_hf(read_config(tmp_path)) == args
    ours = Transformer(args)
    ours.init_weights(1)
    ours.load_state_dict(SPEC.hf.from_hf(saved, args), strict=True)
    with torch.no_grad():
        expected, got = theirs(TOKENS).logits, ours.eval()(TOKENS)
    assert expected.abs().max() > 1.0  # the check below is meaningful only for non-trivial logits
    assert (got - expected).abs().max().item() <= 1e-5
    # transformers' fused in-memory names read the same
    fused = SPEC.hf.from_hf(theirs.state_dict(), args)
    assert all(torch.equal(fused[k], v) for k, v in ours.state_dict().items())


def test_a_model_built_on_cpu_runs_on_imported_weights_without_init_weights():
    """spec.build computes the RoPE tables and zeroes the router state: loading the weights is
    all a model built on a real device needs (init_weights only draws parameters)."""
    args, theirs = _tiny()
    ours = SPEC.build(args)
    ours.load_state_dict(SPEC.hf.from_hf(theirs.state_dict(), args), strict=True)
    with torch.no_grad():
        expected, got = theirs(TOKENS).logits, ours.eval()(TOKENS)
    assert expected.abs().max() > 1.0
    assert (got - expected).abs().max().item() <= 1e-5


def test_export_through_the_converter_loads_in_transformers(tmp_path):
    """titanlite checkpoint -> convert dcp hf -> from_pretrained gives our logits; and back."""
    args, _ = _tiny()
    ours = Transformer(args)
    ours.init_weights(2)
    with torch.no_grad():
        for name, p in ours.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    back = SPEC.hf.from_hf(SPEC.hf.to_hf(ours.state_dict(), args), args)
    assert back.keys() == ours.state_dict().keys()
    assert all(torch.equal(back[k], v) for k, v in ours.state_dict().items())
    write_model_checkpoint(tmp_path / "step-0", ours.state_dict(), "qwen3_moe", args)
    convert_main(["dcp", "hf", str(tmp_path / "step-0"), str(tmp_path / "hf")])
    assert "model.layers.1.mlp.experts.3.up_proj.weight" in read_safetensors(tmp_path / "hf")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    assert type(theirs).__name__ == "Qwen3MoeForCausalLM"
    with torch.no_grad():
        assert (theirs(TOKENS).logits - ours.eval()(TOKENS)).abs().max().item() <= 1e-5
    convert_main(["hf", "dcp", str(tmp_path / "hf"), str(tmp_path / "dcp"), "--model", "qwen3_moe"])
    again = load_tensors(tmp_path / "dcp")
    assert all(torch.equal(again[k], v) for k, v in ours.state_dict().items())


def test_training_starts_from_hf_weights_under_ep2(tmp_path):
    """The trainer's HF import, experts split over two ranks, computes transformers' loss at step 1."""
    args = dataclasses.replace(flavors["debugmodel"], max_seq_len=64)
    torch.manual_seed(0)
    theirs = transformers.Qwen3MoeForCausalLM(_hf_config(args, initializer_range=0.1)).float().eval()
    with torch.no_grad():
        for name, p in theirs.named_parameters():
            if "experts" in name or "mlp.gate" in name:
                p.normal_(0, 0.1)
    theirs.save_pretrained(tmp_path / "hf")
    batch = next(iter(build_dataloader(Data(holdout_fraction=0.0), ByteTokenizer(), seq_len=64, global_batch_size=4,
                                       local_batch_size=4, dp_rank=0, dp_degree=1)))
    with torch.no_grad():
        logits = theirs(batch["input_ids"]).logits
    expected = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten()).item()
    run = train(2, [*TINY, "--model.name", "qwen3_moe", "--training.steps", "3", "--training.global_batch_size", "4",
                    "--training.local_batch_size", "2", "--parallelism.expert_parallel_degree", "2",
                    "--checkpoint.initial_load_path", str(tmp_path / "hf"), "--checkpoint.initial_load_format", "hf"])
    assert "initial weights from" in run.output
    assert abs(run.losses[0] - expected) / expected <= 1e-5, (run.losses[0], expected)


def test_export_refuses_a_router_bias():
    args = flavors["debugmodel"]
    ours = Transformer(args)
    ours.init_weights(0)
    ours.layers["1"].moe.router.expert_bias[3] = 0.01
    with pytest.raises(ConfigError, match="layers.1.moe.router.expert_bias is non-zero"):
        SPEC.hf.to_hf(ours.state_dict(), args)


def test_init_depends_only_on_seed_name_and_shape():
    """Each parameter's values are a function of (seed, name, shape): a model with fewer layers
    (as a pipeline stage would hold) starts with the same values for the names they share."""
    args = flavors["debugmodel"]
    full, short = Transformer(args), Transformer(dataclasses.replace(args, n_layers=2))
    full.init_weights(7)
    short.init_weights(7)
    shared = short.state_dict()
    assert all(torch.equal(full.state_dict()[k], v) for k, v in shared.items())
    experts = full.layers["0"].moe.experts
    assert not torch.equal(experts.w1[0], experts.w1[1])
    assert 0.015 < experts.w1.std() < 0.025  # truncated N(0, 0.02)
    other = Transformer(args)
    other.init_weights(8)
    assert not torch.equal(other.layers["0"].moe.experts.w1, experts.w1)


def test_hf_load_reads_one_block_at_a_time(tmp_path, monkeypatch):
    """checkpoint.initial_load_format hf reads the folder one decoder block at a time, and only
    the blocks a part holds (here a pipeline stage without block 2), and loads exactly what
    the adapter maps the whole folder to."""
    from titanlite.checkpoint import weights
    from titanlite.checkpoint.hf import write_hf_folder

    args = flavors["debugmodel"]
    source = Transformer(args)
    source.init_weights(0)
    write_hf_folder(tmp_path, hf.to_hf(source.state_dict(), args), hf.config_to_hf(args, torch.float32))
    reads, real = [], weights.read_safetensors

    def spy(path, names=None, meta=False):
        if not meta:
            reads.append({n.split(".")[2] if n.startswith("model.layers.") else "top" for n in names})
        return real(path, names, meta)

    monkeypatch.setattr(weights, "read_safetensors", spy)
    stage = Transformer(args)
    stage.init_weights(1)
    del stage.layers["2"]
    weights.load_hf_weights([stage], tmp_path, SPEC.hf, args)
    assert sorted(map(sorted, reads)) == [["0"], ["1"], ["3"], ["top"]]
    expected = hf.from_hf(real(tmp_path), args)
    assert all(torch.equal(v, expected[k]) for k, v in stage.state_dict().items())
