"""Generation (titanlite.generate): every family's greedy tokens and logits equal transformers'
generate on the same weights, from a left-padded batch of prompts of different lengths, and each
prompt's are those it gets alone (no padding leaks); the cache holds its formula's bytes, which the
dry run's --generate reports; the sampling filters keep exactly what their definitions keep; a
seeded draw does not depend on the batch; EOS and stop strings end a row."""

from __future__ import annotations

import dataclasses
import importlib
import json
import re

import pytest
import torch
import transformers

import titanlite
from titanlite.generate import Sampling, filter_logits, generate
from titanlite.layers import init
from titanlite.layers.cache import Cache, cache_bytes
from titanlite.model_spec import get_model_spec

NEW = 64
SEED = 1
LENGTHS = (5, 23, 12)
"""Prompt lengths: with 64 new tokens, gpt-oss's 16-key window and the transformers family's
8-key ones wrap their rings many times; Qwen3.5's convolution sees pads within its kernel."""
NATIVE = {  # family: (flavor, what the test changes of it: tiny, the context the prompts need)
    "llama3": ("debugmodel", dict(dim=64, n_heads=4, n_kv_heads=2, multiple_of=32)),
    # untied: a tied random model repeats its last token
    "qwen3": ("debugmodel", dict(dim=64, n_heads=4, n_kv_heads=2, head_dim=16, ffn_hidden=128, tie_embeddings=False)),
    "qwen3_moe": ("debugmodel", dict(dim=64, n_heads=4, n_kv_heads=2, head_dim=16)),
    "gpt_oss": ("debugmodel", dict(dim=64, n_heads=4, n_kv_heads=2, head_dim=16)),
    "deepseek_v3": ("debugmodel", {}),  # MLA with YaRN, a dense and MoE blocks, an MTP depth (unused)
    "qwen3_5": ("debugmodel", dict(dim=64, ffn_hidden=128)),
    "qwen3_5_moe": ("debugmodel_moe", dict(dim=64)),
}
TRANSFORMERS = ("debug_mistral", "debug_gemma2", "debug_qwen3")
"""The transformers family: sliding windows (every layer, alternate layers), Gemma 2's logit
softcapping and scaled embedding, QK-norm."""


@pytest.fixture(autouse=True)
def one_thread():
    """Decode steps are small ops, which threads slow down on a loaded machine (several times)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in LENGTHS]


def _native(name: str, folder) -> tuple[torch.nn.Module, torch.nn.Module]:
    """A random titanlite model (norms off one, the rest 4x the init's scale, for logits that
    differ step to step) and transformers' load of its export."""
    flavor, changes = NATIVE[name]
    spec = get_model_spec(name.removesuffix("_moe") if name == "qwen3_5_moe" else name)
    args = dataclasses.replace(spec.flavors[flavor], max_seq_len=128, **changes)
    model = spec.build(args)
    model.init_weights(SEED)
    g = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5, generator=g)
            else:
                p.mul_(4)
    titanlite.write_hf(folder, spec.hf.to_hf(model.state_dict(), args), spec.hf.config_to_hf(args, torch.float32))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    return model.eval(), theirs.eval()


def _transformers(flavor: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The transformers family's model and transformers' own class with its weights."""
    from titanlite.models.transformers.model import causal_lm_class, hf_config

    spec = get_model_spec("transformers")
    with torch.device("meta"):
        model = spec.build(spec.flavors[flavor])
    init.materialize(model, torch.device("cpu"), 1)
    with torch.no_grad():  # as _native's: logits that differ step to step
        for n, p in model.named_parameters():
            if "norm" not in n:
                p.mul_(8)
    config = hf_config(spec.flavors[flavor])
    theirs = causal_lm_class(config)._from_config(config, attn_implementation="eager")
    theirs.load_state_dict(model.state_dict())
    return model.eval(), theirs.eval()


def _theirs(model: torch.nn.Module, prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' greedy generate of the left-padded batch: tokens [B, NEW], logits [B, NEW, V]."""
    longest = max(map(len, prompts))
    ids = torch.zeros(len(prompts), longest, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, longest - len(p):], mask[i, longest - len(p):] = torch.tensor(p), 1
    config = transformers.GenerationConfig(do_sample=False, max_new_tokens=NEW, pad_token_id=0, eos_token_id=None)
    out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config, output_logits=True,
                         return_dict_in_generate=True)
    return out.sequences[:, longest:], torch.stack(out.logits, 1)


class RecordedCache(Cache):
    """The generation cache, each one kept in `made` (to read its bytes after a generation)."""

    made: list[Cache] = []

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        RecordedCache.made.append(self)


def test_every_family_generates_transformers_tokens(tmp_path, monkeypatch):
    """Greedy, 64 new tokens from prompts of 5, 23 and 12 tokens in one batch: the tokens equal
    transformers', every step's logits within 1e-4 (the issue's bound; logits reach 40) of
    transformers' and of the prompt's alone (whose chunks of the delta rule round differently).
    The batch's cache holds the bytes of its formula (cache_bytes: the dry run's figure)."""
    monkeypatch.setattr(importlib.import_module("titanlite.generate"), "Cache", RecordedCache)
    table = {}
    cases = [*((n, lambda n=n: _native(n, tmp_path / n)) for n in NATIVE),
             *((f, lambda f=f: _transformers(f)) for f in TRANSFORMERS)]
    for name, make in cases:
        ours, theirs = make()
        prompts = _prompts(512)  # every debug flavor's vocabulary
        got = generate(ours, prompts, NEW, keep_logits=True)
        if name in NATIVE:  # every slot of the longest prompt and its new tokens, fp32
            assert RecordedCache.made[-1].nbytes() == cache_bytes(ours.args, len(prompts), max(LENGTHS) + NEW), name
        tokens, logits = _theirs(theirs, prompts)
        assert logits.abs().max() > 1.0, name  # logits large enough that 1e-4 means something
        worst = 0.0
        for i, (g, p) in enumerate(zip(got, prompts)):
            assert g.ids == tokens[i].tolist() and g.finish == "length", (name, i)
            assert (g.logits[1:] - g.logits[:-1]).abs().amax(-1).min() > 1e-2, (name, i)  # every step moves
            worst = max(worst, (g.logits - logits[i]).abs().max().item())
            alone = generate(ours, [p], NEW, keep_logits=True)[0]
            assert alone.ids == g.ids and (alone.logits - g.logits).abs().max() <= 1e-4, (name, i)
        table[name] = worst
        assert worst <= 1e-4, (name, worst)
    print("\nfamily x worst logit difference (tokens equal):", {k: f"{v:.1e}" for k, v in table.items()})


def test_a_generation_job_s_memory_is_its_weights_cache_and_decode_step_by_hand(tmp_path, capsys):
    """--generate BATCHxCONTEXT: Llama 3 8B at 32k tokens in bf16, whole and over 2 ranks, and
    DeepSeek-V3 671B's MLA cache (kv_lora_rank 512 + rope 64 a token a layer, whole on every rank);
    the formula is the one the cache's bytes are tested against (tests/test_generate.py)."""
    from titanlite.config import load as config
    from titanlite.dryrun import hardware
    from titanlite.dryrun.generation import generation_memory
    from titanlite.dryrun.run import main

    out = tmp_path / "g.json"
    main(["--config", "llama_8b.toml", "--generate", "1x32768", "--out", str(out)])
    rep = json.loads(out.read_text())["bytes"]
    # 8,030,261,248 parameters and the RoPE tables (2 x 131072 positions x 64) in bf16
    assert rep["weights"] == 8_030_261_248 * 2 + 2 * 131072 * 64 * 2
    assert rep["cache"] == 32 * 32768 * 2 * 8 * 128 * 2 == 4 * 2**30  # layers x tokens x (k, v) x kv heads x 128
    # logits (bf16 and fp32) and the keys and values copied out to the 32 query heads
    assert rep["decode"] == 128256 * (2 + 4) + 2 * 32769 * 32 * 128 * 2
    assert rep["total"] == rep["weights"] + rep["cache"] + rep["decode"]
    assert "cache         4.00 GiB" in capsys.readouterr().out
    two = generation_memory(config.load(["--config", "llama_8b.toml"])[0], 2, "1x32768", hardware.get_gpu("h100"))
    assert two["bytes"]["cache"] == rep["cache"] // 2  # 4 of the 8 kv heads a rank
    # every matrix split in half; the norms (65 x 4096) and the RoPE tables whole
    assert two["bytes"]["weights"] == (8_030_261_248 - 65 * 4096) + 65 * 4096 * 2 + 2 * 131072 * 64 * 2
    ds = generation_memory(config.load(["--config", "deepseek_v3_671b.toml"])[0], 8, "1x32768", hardware.get_gpu("h200"))
    assert ds["bytes"]["cache"] == 61 * 32768 * (512 + 64) * 2  # 2.14 GiB on every rank: the latent is not split
    # logits, and the latent expanded to 128 / 8 heads: keys and values (128 + 128), keys with the RoPE
    # key (128 + 64) and values padded to their width (128 + 64)
    assert ds["bytes"]["decode"] == 129280 * 6 + 32768 * 16 * (256 + 2 * 192) * 2
    assert not ds["fits"]  # every rank holds all 256 experts of each of 58 MoE layers (and the MTP depth's)


@pytest.mark.parametrize("argv, expect", [
    (["--generate", "1x"], "--generate 1x: expected BATCHxCONTEXT, positive integers"),
    (["--generate", "1x200000"], "--generate 1x200000: llama3 debugmodel's context is"),
    (["--generate", "1x64", "--ngpu", "3"], "divisible by --ngpu (the generator's --tp) 3"),
])
def test_the_dry_run_s_generation_bad_input_is_one_line(argv, expect, capsys):
    from titanlite.dryrun.run import main

    with pytest.raises(SystemExit) as e:
        main(["--config", "debug_model.toml", *argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and err[0].startswith("titanlite: error: ") and expect in err[0], err


PROBS = torch.tensor([0.06, 0.4, 0.1, 0.25, 0.04, 0.15])
"""A hand-made distribution, not in order: ranks 1, 3, 5, 2, 0, 4."""


def _kept(**sampling) -> set[int]:
    out = filter_logits(PROBS.log()[None], Sampling(temperature=1.0, **sampling))[0]
    return set(torch.isfinite(out).nonzero().flatten().tolist())


def test_sampling_filters_keep_what_their_definitions_keep():
    assert _kept(top_k=1) == {1} and _kept(top_k=3) == {1, 3, 5} and _kept(top_k=0) == set(range(6))
    # top_p: the most likely tokens until they sum to p (0.4, 0.65, 0.8, 0.9, ...)
    assert _kept(top_p=0.3) == {1} and _kept(top_p=0.6) == {1, 3} and _kept(top_p=0.7) == {1, 3, 5}
    assert _kept(top_p=0.85) == {1, 3, 5, 2} and _kept(top_p=1.0) == set(range(6))
    # min_p: at least min_p x the top probability (0.4)
    assert _kept(min_p=0.3) == {1, 3, 5} and _kept(min_p=0.5) == {1, 3} and _kept(min_p=0.2) == {1, 3, 5, 2}
    # in order: top_k 4 renormalises to 0.44, 0.28, 0.17, 0.11, of which top_p 0.7 keeps two
    assert _kept(top_k=4, top_p=0.7) == {1, 3}
    # transformers' warpers agree on a random distribution
    scores = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    for ours, theirs in [(dict(top_k=7), transformers.TopKLogitsWarper(7)),
                         (dict(top_p=0.6), transformers.TopPLogitsWarper(0.6)),
                         (dict(min_p=0.1), transformers.MinPLogitsWarper(0.1))]:
        want = torch.isfinite(theirs(None, scores.clone()))
        assert torch.equal(torch.isfinite(filter_logits(scores, Sampling(1.0, **ours))), want), ours


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch():
    spec = get_model_spec("llama3")
    model = spec.build(dataclasses.replace(spec.flavors["debugmodel"], dim=64, n_heads=4, n_kv_heads=2,
                                           max_seq_len=64)).eval()
    model.init_weights(0)
    prompts = _prompts(512)
    options = dict(max_new_tokens=16, temperature=1.5, top_k=50, top_p=0.95, min_p=0.01)
    first = generate(model, prompts, seed=[7, 8, 9], **options)
    assert [g.ids for g in first] == [g.ids for g in generate(model, prompts, seed=[7, 8, 9], **options)]
    assert generate(model, prompts[1:2], seed=[8], **options)[0].ids == first[1].ids
    assert generate(model, prompts, seed=3, **options)[1].ids != first[1].ids  # the seed matters
    # EOS ends a row (kept in its ids, not its text); a stop string cuts the text before it
    greedy = generate(model, prompts, max_new_tokens=16)[0].ids
    decode = lambda ids: "".join(chr(65 + t % 26) for t in ids)  # noqa: E731
    ended = generate(model, prompts[:1], max_new_tokens=16, eos_ids=[greedy[5]], decode=decode)[0]
    assert (ended.ids, ended.finish, ended.text) == (greedy[:greedy.index(greedy[5]) + 1], "eos",
                                                     decode(greedy[:greedy.index(greedy[5])]))
    text = decode(greedy)
    stopped = generate(model, prompts[:1], max_new_tokens=16, stop=[text[7:9]], decode=decode)[0]
    assert stopped.finish == "stop" and stopped.text == text[:text.index(text[7:9])]
    # a model in training mode generates in eval mode and is handed back training: a MoE counts no
    # load towards its next router-bias update
    moe_spec = get_model_spec("qwen3_moe")
    moe = moe_spec.build(dataclasses.replace(moe_spec.flavors["debugmodel"], dim=64, n_heads=4, n_kv_heads=2,
                                             head_dim=16, max_seq_len=64))
    moe.init_weights(0)
    generate(moe, prompts, max_new_tokens=4)
    assert moe.training and all(m.moe.tokens_per_expert.sum() == 0 for m in moe.layers.values())
    capped = generate(model, prompts[:1], max_new_tokens=100)[0]  # the 64-position context ends it
    assert capped.finish == "context" and len(capped.ids) == 64 - len(prompts[0])


def test_command_line_reads_every_source_and_refuses_bad_input_in_one_line(tmp_path, capsys, monkeypatch):
    """A step folder and its transformers export generate the same tokens as the function; prompts
    from --prompt, JSON lines and stdin; --chat through byte_chat's template; bad input one line."""
    import io

    from titanlite.checkpoint.folder import write_model_checkpoint
    from titanlite.data.tokenizer import byte_chat_tokenizer
    from titanlite.generate.__main__ import main

    spec = get_model_spec("llama3")
    # trained at 64 positions of a 96-position model: generation reads the model's own context
    args = dataclasses.replace(spec.flavors["debugmodel"], dim=64, n_heads=4, n_kv_heads=2, multiple_of=32,
                               max_seq_len=64, context_len=96)
    model = spec.build(args)
    model.init_weights(2)
    write_model_checkpoint(tmp_path / "step-3", model.state_dict(), "llama3", args)
    titanlite.write_hf(tmp_path / "hf", spec.hf.to_hf(model.state_dict(), args), spec.hf.config_to_hf(args, torch.float32))
    (tmp_path / "p.jsonl").write_text('"Hello"\n\n{"prompt": "The quick brown fox"}\n')
    common = ["--max_new_tokens", "100", "--temperature", "0.8", "--top_k", "40", "--seed", "5"]
    rows = {}
    for name, argv in {"dcp": [str(tmp_path / "step-3"), "--prompts", str(tmp_path / "p.jsonl")],
                       "hf": [str(tmp_path / "hf"), "--format", "hf", "--prompt", "Hello", "--prompt",
                              "The quick brown fox"],
                       "stdin": [str(tmp_path / "step-3")]}.items():
        monkeypatch.setattr("sys.stdin", io.StringIO("Hello\nThe quick brown fox\n"))
        main([*argv, *common, "--out", str(tmp_path / f"{name}.json")])
        rows[name] = json.loads((tmp_path / f"{name}.json").read_text())
    assert rows["dcp"] == rows["hf"] == rows["stdin"]
    # the command under torchrun on 2 ranks (--tp 2: each rank reads its shards of the step folder)
    # writes one process's greedy tokens; rank 0 writes the file once every rank has generated
    from harness import spawn_ranks
    greedy = [str(tmp_path / "step-3"), "--prompts", str(tmp_path / "p.jsonl"), "--max_new_tokens", "24"]
    main([*greedy, "--out", str(tmp_path / "one.json")])
    codes, output = spawn_ranks(2, ["-m", "titanlite.generate", *greedy, "--tp", "2", "--out", str(tmp_path / "tp.json")],
                                timeout=300)
    sigabrt_after_its_file = codes[1] == -6 and (tmp_path / "tp.json").exists()  # gloo's known teardown abort
    assert codes[0] == 0 and (codes[1] == 0 or sigabrt_after_its_file), output[-3000:]
    assert json.loads((tmp_path / "tp.json").read_text()) == json.loads((tmp_path / "one.json").read_text())
    whole = spec.build(dataclasses.replace(args, max_seq_len=96))  # RoPE tables over the model's context
    whole.load_state_dict(model.state_dict())
    want = generate(whole.eval(), [[256, *b"Hello"], [256, *b"The quick brown fox"]], 100, 0.8, 40, seed=5,
                    eos_ids=[257])
    assert [r["ids"] for r in rows["dcp"]] == [g.ids for g in want]
    # the model's 96 positions end both, past the 64 it was trained at
    assert [(r["finish"], len(r["ids"])) for r in rows["dcp"]] == [("context", 96 - 6), ("context", 96 - 20)]
    out = capsys.readouterr().out
    assert "--- prompt 1 (20 tokens; " in out and rows["dcp"][1]["text"] in out
    main([str(tmp_path / "step-3"), "--chat", "--tokenizer", "byte_chat", "--prompt", "Hi", "--max_new_tokens", "4",
          "--out", str(tmp_path / "chat.json")])
    chat = byte_chat_tokenizer()
    rendered = chat.hf.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert json.loads((tmp_path / "chat.json").read_text())[0]["prompt_ids"] == chat.encode(rendered)
    assert rendered.endswith("<|im_start|>assistant\n")
    for argv, message in [
        ([str(tmp_path)], "holds no titanlite.json, so it is not a titanlite checkpoint"),
        ([str(tmp_path / "hf")], r"not a titanlite checkpoint \(it has a config.json: add --format hf\)"),
        ([str(tmp_path / "step-3"), "--format", "hf"], "holds no config.json, so it is not a transformers folder"),
        ([str(tmp_path / "step-3"), "--chat"], "--chat: tokenizer 'byte' has no chat template; use --tokenizer byte_chat"),
        ([str(tmp_path / "step-3"), "--prompt", "x" * 96], "prompt 0 is 97 tokens, the model's context is 96"),
        ([str(tmp_path / "step-3"), "--top_p", "0"], r"--top_p is 0.0; it must be in \(0, 1\]"),
        ([str(tmp_path / "step-3"), "--top_p", "1.5"], r"--top_p is 1.5; it must be in \(0, 1\]"),
        ([str(tmp_path / "step-3"), "--tp", "3"], "--tp 3 exceeds n_kv_heads 2; use a degree <= 2 that divides it"),
        ([str(tmp_path / "step-3"), "--tp", "2"], "--tp 2 runs as 2 ranks: launch it with torchrun --nproc_per_node 2"),
    ]:
        with pytest.raises(SystemExit) as exit_:
            main(argv if "--prompt" in argv else [*argv, "--prompt", "x"])
        line = str(exit_.value.code)
        assert line.startswith("titanlite: error: ") and "\n" not in line, line
        assert re.search(message, line), (message, line)
    # a step folder's run's tokenizer (titanlite.json's data.tokenizer) is the default: an SFT run's chats
    info = json.loads((tmp_path / "step-3" / "titanlite.json").read_text())
    for recorded, message in [("byte_chat", None), (str(tmp_path / "gone"), "was trained with data.tokenizer")]:
        (tmp_path / "step-3" / "titanlite.json").write_text(json.dumps({**info, "config": {"data.tokenizer": recorded}}))
        argv = [str(tmp_path / "step-3"), "--chat", "--prompt", "Hi", "--max_new_tokens", "4", "--out",
                str(tmp_path / "recorded.json")]
        if message is None:
            main(argv)
            assert json.loads((tmp_path / "recorded.json").read_text()) == json.loads((tmp_path / "chat.json").read_text())
            continue
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        line = str(exit_.value.code)
        assert line.startswith("titanlite: error: ") and "\n" not in line and message in line, line
