"""Hugging Face interop: the Llama 3 mapping, the converter, and numerics against transformers (fp32).

Tiny random LlamaForCausalLM models cover GQA, tied embeddings and Llama 3.1 RoPE scaling
(with a short original context so all three frequency bands of the scaling are exercised).
"""

import dataclasses
import json

import pytest
import torch
import titanlite
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from titanlite.models.llama3 import SPEC
from titanlite.models.llama3.model import ModelArgs, Transformer
from titanlite.checkpoint.folder import load_tensors, saved_args, write_model_checkpoint
from titanlite.errors import ConfigError
from titanlite.model_spec import get_model_spec, model_args
from titanlite.tools.convert import main as convert_main
from titanlite.checkpoint.hf import check_hf_config, read_config, read_safetensors

ADAPTER = SPEC.hf
SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 64}
CONFIGS = {
    "gqa_rope_scaling": dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=8,
                             num_key_value_heads=2, vocab_size=96, rope_scaling=SCALING, rope_theta=10000.0,
                             tie_word_embeddings=False),
    "tied_mha": dict(hidden_size=48, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=4, vocab_size=80, rope_theta=500000.0, tie_word_embeddings=True),
}
TOKENS = torch.randint(0, 80, (2, 40), generator=torch.Generator().manual_seed(0))


def hf_model(name: str) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(**CONFIGS[name], max_position_embeddings=128, rms_norm_eps=1e-5, initializer_range=0.1,
                      attn_implementation="eager")
    model = LlamaForCausalLM(cfg).float().eval()
    with torch.no_grad():  # non-trivial norm weights, so a swapped norm mapping shows
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return model


def titanlite_model(args: ModelArgs, state_dict: dict[str, torch.Tensor] | None = None) -> Transformer:
    model = Transformer(args)
    model.init_weights(0)  # the weights when no state dict is given
    if state_dict is not None:
        model.load_state_dict(state_dict, strict=True)
    return model.eval()


@pytest.mark.parametrize("name", CONFIGS)
def test_import_matches_transformers_logits(name, tmp_path):
    hf = hf_model(name)
    hf.save_pretrained(tmp_path, max_shard_size="20KB")  # several shards plus an index
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    args = ADAPTER.args_from_hf(read_config(tmp_path))
    assert (args.n_kv_heads, args.tie_embeddings) == (CONFIGS[name]["num_key_value_heads"],
                                                      CONFIGS[name]["tie_word_embeddings"])
    model = titanlite_model(args, ADAPTER.from_hf(read_safetensors(tmp_path), args))
    with torch.no_grad():
        ours, theirs = model(TOKENS), hf(TOKENS).logits
    assert theirs.abs().max() > 1.0  # logits large enough that a wrong mapping cannot hide under 1e-5
    assert (ours - theirs).abs().max().item() <= 1e-5


@pytest.mark.parametrize("name", CONFIGS)
def test_export_reproduces_logits_in_transformers(name, tmp_path):
    args = ADAPTER.args_from_hf(dict(CONFIGS[name], model_type="llama", max_position_embeddings=128,
                                     rms_norm_eps=1e-5))
    model = titanlite_model(args)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.normal_(0, 0.1) if not n.endswith("norm.weight") else p.uniform_(0.5, 1.5)
    write_model_checkpoint(tmp_path / "step-0", model.state_dict(), "llama3", args)
    convert_main(["dcp", "hf", str(tmp_path / "step-0"), str(tmp_path / "hf"), "--max-shard-gb", "0.00002"])
    assert len(list((tmp_path / "hf").glob("*.safetensors"))) > 1
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager").float().eval()
    assert hf.config.tie_word_embeddings == args.tie_embeddings
    with torch.no_grad():
        ours, theirs = model(TOKENS), hf(TOKENS).logits
    assert ours.abs().max() > 1.0
    assert (ours - theirs).abs().max().item() <= 1e-5


def test_convert_hf_to_dcp_and_torch(tmp_path):
    hf = hf_model("gqa_rope_scaling")
    hf.save_pretrained(tmp_path / "hf")
    convert_main(["hf", "dcp", str(tmp_path / "hf"), str(tmp_path / "dcp")])
    convert_main(["dcp", "torch", str(tmp_path / "dcp"), str(tmp_path / "model.pt"), "--dtype", "bfloat16"])
    args = ADAPTER.args_from_hf(read_config(tmp_path / "hf"))
    expected = ADAPTER.from_hf(read_safetensors(tmp_path / "hf"), args)
    got = load_tensors(tmp_path / "dcp")
    assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in got)
    saved = torch.load(tmp_path / "model.pt", weights_only=True)
    assert all(saved[k].dtype == torch.bfloat16 and torch.equal(saved[k], expected[k].bfloat16()) for k in expected)
    # and back: hf -> dcp -> hf gives the same safetensors
    convert_main(["dcp", "hf", str(tmp_path / "dcp"), str(tmp_path / "hf2")])
    a, b = read_safetensors(tmp_path / "hf"), read_safetensors(tmp_path / "hf2")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_q_k_permutation_round_trips():
    args = ModelArgs(dim=64, n_layers=1, n_heads=8, n_kv_heads=2, vocab_size=32, multiple_of=32)
    sd = {k: torch.randn(v.shape) for k, v in Transformer(args).state_dict().items()}
    hf = ADAPTER.to_hf(sd, args)
    assert not torch.equal(hf["model.layers.0.self_attn.q_proj.weight"], sd["layers.0.attention.wq.weight"])
    back = ADAPTER.from_hf(hf, args)
    assert back.keys() == sd.keys() and all(torch.equal(back[k], sd[k]) for k in sd)


def test_unsupported_configs_and_bad_folders_are_clear_errors(tmp_path, capsys):
    base = dict(CONFIGS["tied_mha"], model_type="llama")
    with pytest.raises(ConfigError, match="attention_bias"):
        ADAPTER.args_from_hf(dict(base, attention_bias=True))
    with pytest.raises(ConfigError, match="rope type 'yarn'"):
        ADAPTER.args_from_hf(dict(base, rope_scaling={"rope_type": "yarn", "factor": 2.0}))
    with pytest.raises(ConfigError, match="no Llama 3 counterpart"):
        ADAPTER.from_hf({"model.layers.0.self_attn.q_norm.weight": torch.ones(4)}, ADAPTER.args_from_hf(base))
    with pytest.raises(SystemExit, match="no config.json"):
        convert_main(["hf", "dcp", str(tmp_path), str(tmp_path / "out")])
    with pytest.raises(SystemExit, match="not a readable DCP checkpoint|titanlite.json"):
        convert_main(["dcp", "hf", str(tmp_path), str(tmp_path / "out")])
    with pytest.raises(SystemExit, match="cannot convert hf to torch"):
        convert_main(["hf", "torch", str(tmp_path), str(tmp_path / "x.pt")])


def test_training_starts_from_a_transformers_folder(tmp_path):
    """checkpoint.initial_load_format hf on 2 FSDP ranks: the sharded weights the trainer loaded,
    saved again, are exactly the transformers weights mapped to titanlite."""
    from harness import TINY, train

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=256, intermediate_size=704, num_hidden_layers=4, num_attention_heads=8,
                      num_key_value_heads=4, vocab_size=512, rms_norm_eps=1e-5, rope_theta=500000.0,
                      rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                      max_position_embeddings=8192, tie_word_embeddings=False)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path / "hf")
    run = train(2, [*TINY, "--checkpoint.enable", "--checkpoint.initial_load_path", str(tmp_path / "hf"),
                    "--checkpoint.initial_load_format", "hf"],
                dump=tmp_path / "run", env={"TITANLITE_TEST_HOOK": "resave"}, module="tests.ckpt_hooks")
    assert "initial weights from" in run.output
    args = ADAPTER.args_from_hf(cfg.to_dict())
    expected = ADAPTER.from_hf(read_safetensors(tmp_path / "hf"), args)
    got = load_tensors(tmp_path / "run" / "checkpoint-resaved" / "step-0")
    assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in got)


def test_initial_load_refuses_a_different_architecture(tmp_path):
    hf_model("gqa_rope_scaling").save_pretrained(tmp_path)
    args = ADAPTER.args_from_hf(read_config(tmp_path))
    check_hf_config(ADAPTER, tmp_path, dataclasses.replace(args, max_seq_len=64))  # context length may differ
    with pytest.raises(ConfigError, match=r"vocab_size \(96 vs 128\)"):
        check_hf_config(ADAPTER, tmp_path, dataclasses.replace(args, vocab_size=128))
    with pytest.raises(ConfigError, match="rope_scaling"):
        check_hf_config(ADAPTER, tmp_path, dataclasses.replace(args, rope_scaling_factor=4.0))


def test_public_api_reads_builds_and_writes_a_transformers_folder(tmp_path):
    """The README's script: titanlite.read_hf -> the family's adapter -> a model -> titanlite.write_hf,
    which transformers loads with the same logits."""
    import titanlite

    assert {"llama3", "qwen3", "qwen3_moe"} <= set(titanlite.available_models())
    spec = titanlite.get_model_spec("llama3")
    hf_model("gqa_rope_scaling").save_pretrained(tmp_path / "in")
    config, hf_state = titanlite.read_hf(tmp_path / "in")
    args = spec.hf.args_from_hf(config)
    model = titanlite_model(args, spec.hf.from_hf(hf_state, args))
    titanlite.write_hf(tmp_path / "out", spec.hf.to_hf(model.state_dict(), args),
                       spec.hf.config_to_hf(args, torch.float32))
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager").float().eval()
    with torch.no_grad():
        ours, theirs = model(TOKENS), hf(TOKENS).logits
    assert theirs.abs().max() > 1.0
    assert (ours - theirs).abs().max().item() <= 1e-5


def test_every_flavor_of_every_family_comes_back_from_its_saved_args():
    # what a checkpoint stores (titanlite.json) and the converter reads back; DeepSeek-V3 16B
    # and 100M leave YaRN None where the family's first flavor sets it
    for family in ("llama3", "qwen3", "qwen3_moe", "deepseek_v3", "gpt_oss"):
        flavors = list(get_model_spec(family).flavors.values())
        for args in flavors:
            assert saved_args(flavors, json.loads(json.dumps(dataclasses.asdict(args)))) == args, (family, args)


@pytest.mark.parametrize("family", ["llama3", "qwen3", "qwen3_moe", "gpt_oss"])
def test_export_writes_the_model_context_length_not_the_training_one(family):
    # training shrinks max_seq_len to training.seq_len (RoPE tables); the args a checkpoint
    # stores (titanlite.json, read back by the converter) must still export the model's own
    spec = get_model_spec(family)
    args = model_args(spec, "debugmodel", 0, seq_len=64)
    saved = saved_args(list(spec.flavors.values()), json.loads(json.dumps(dataclasses.asdict(args))))
    cfg = spec.hf.config_to_hf(saved, torch.float32)
    assert args.max_seq_len == 64
    assert cfg["max_position_embeddings"] == spec.flavors["debugmodel"].max_seq_len > 64


GELU = (("model.py", "FeedForward(args.dim, args.ffn_hidden, F.silu)", "FeedForward(args.dim, args.ffn_hidden, F.gelu)"),)
"""docs/fork_a_model.md's first example: SiLU -> GELU, which ModelArgs does not show."""
PARALLEL = (("model.py", "def block(args: ModelArgs, layer: int) -> Block:", """class ParallelBlock(Block):
    def forward(self, x, cos, sin, ctx):
        h = self.attention_norm(x)
        return x + self.attention(h, cos, sin, ctx) + self.feed_forward(h)


def block(args: ModelArgs, layer: int) -> Block:"""),
            ("model.py", "return Block(args.dim, args.norm_eps, attention,", "return ParallelBlock(args.dim, args.norm_eps, attention,"))
"""GPT-J's parallel attention + MLP block, with LlamaForCausalLM's parameter names."""


def test_a_forks_activation_is_exported_and_a_parallel_block_refused(tmp_path, fork):
    """What config.json says comes from the built model, not from constants: a GELU fork exports
    hidden_act gelu and transformers reproduces its logits; what LlamaForCausalLM cannot compute
    (a parallel block) is refused in one line, by tools/convert and the Python API alike."""
    fork("my_gelu", "my_gelu", GELU)
    fork("my_parallel", "my_parallel", PARALLEL)
    models = {}
    for name in ("my_gelu", "my_parallel"):
        spec = get_model_spec(name)
        args = spec.hf.args_from_hf(dict(CONFIGS["gqa_rope_scaling"], model_type="llama", max_position_embeddings=128,
                                         rms_norm_eps=1e-5))
        model = spec.build(args)
        model.init_weights(0)
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.normal_(0, 0.1) if not n.endswith("norm.weight") else p.uniform_(0.5, 1.5)
        write_model_checkpoint(tmp_path / name, model.state_dict(), name, args)
        models[name] = model.eval()
    convert_main(["dcp", "hf", str(tmp_path / "my_gelu"), str(tmp_path / "gelu_hf")])
    assert read_config(tmp_path / "gelu_hf")["hidden_act"] == "gelu"
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "gelu_hf", attn_implementation="eager").float().eval()
    with torch.no_grad():
        ours, theirs = models["my_gelu"](TOKENS), hf(TOKENS).logits
    assert ours.abs().max() > 1.0
    assert (ours - theirs).abs().max().item() <= 1e-5
    refused = ("titanlite: error: LlamaForCausalLM cannot express this model: block 0 is "
               "titanlite.models.my_parallel.model.ParallelBlock, not titanlite.layers.decoder.Block")
    with pytest.raises(SystemExit) as e:
        convert_main(["dcp", "hf", str(tmp_path / "my_parallel"), str(tmp_path / "parallel_hf")])
    assert str(e.value).startswith(refused) and "\n" not in str(e.value), e.value
    assert not (tmp_path / "parallel_hf").exists()
    with pytest.raises(ConfigError, match="block 0 is titanlite.models.my_parallel.model.ParallelBlock"):
        get_model_spec("my_parallel").hf.config_to_hf(args, torch.float32)
    # importing: a SiLU folder never loads into the GELU fork, whose args alone would match it
    hf_model("gqa_rope_scaling").save_pretrained(tmp_path / "silu_hf")
    with pytest.raises(ConfigError, match=r"differs from the model config in hidden_act \(silu vs gelu\)"):
        titanlite.load_hf(tmp_path / "silu_hf", "my_gelu")
    # and both ways: the GELU fork reads its own export back, the SiLU family it came from refuses it
    loaded, _ = titanlite.load_hf(tmp_path / "gelu_hf", "my_gelu")
    with torch.no_grad():
        assert torch.equal(loaded.eval()(TOKENS), ours)
    with pytest.raises(ConfigError, match=r"differs from the model config in hidden_act \(gelu vs silu\)"):
        titanlite.load_hf(tmp_path / "gelu_hf", "llama3")
