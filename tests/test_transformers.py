"""The transformers family (models/transformers): any transformers causal LM, trained by titanlite.

In one process: every architecture of the family's debug list equals transformers' own
forward and backward (the loss and every gradient to 1e-6 in float32) and keeps packed
documents apart as transformers computes each alone, its buffers (RoPE's
inv_freq, Gemma's embedding scale) recomputed rather than left as meta init leaves them; a
saved transformers model loaded through its folder gives transformers' logits, with the
folder's config unchanged; activation checkpointing recomputes a transformers layer, and a
layer compiles as one graph; bad input is one line (dropout named by its config keys). On 2 gloo
ranks, one launch for the list: FSDP 2, HSDP 2 x 1, TP 2, CP 2 and PP 2 each equal one process or
are refused by the preflight, which is docs/transformers_models.md's table; three architectures
also compiled, on one layout each.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from harness import REPO, spawn_ranks

from titanlite.errors import ConfigError
from titanlite.layers import init
from titanlite.layers.attention import AttnContext
from titanlite.loss import ExtraLosses, cross_entropy_sum
from titanlite.model_spec import get_model_spec

transformers = pytest.importorskip("transformers")
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

SPEC = get_model_spec("transformers")
FLAVORS = [f for f in SPEC.flavors if f != "debugmodel"]


def _reference(args, config=None):
    """transformers' own model of the same config, with the attention it ships (sdpa where the
    architecture supports it, else eager)."""
    from titanlite.models.transformers.model import causal_lm_class, hf_config

    config = config or hf_config(args)
    cls = causal_lm_class(config)
    return cls._from_config(config, attn_implementation="sdpa" if cls._supports_sdpa else "eager")


def _titanlite(args, seed: int = 0) -> torch.nn.Module:
    """As the trainer makes it: built on meta, then materialised by titanlite's init."""
    with torch.device("meta"):
        model = SPEC.build(args)
    init.materialize(model, torch.device("cpu"), seed)
    return model


def test_every_architecture_equals_transformers():
    """Forward and backward; and a batch of packed documents (positions restarting at each):
    with titanlite's document masks, every document's logits are those transformers gives it
    alone."""
    tokens = torch.randint(0, 512, (2, 33), generator=torch.Generator().manual_seed(0))
    spans = ((0, 5), (5, 12), (12, 16), (16, 32))
    docs = torch.cat([torch.full((2, b - a), i) for i, (a, b) in enumerate(spans)], 1)
    positions = torch.cat([torch.arange(b - a) for a, b in spans])[None].expand(2, -1)
    for flavor in FLAVORS:
        args = SPEC.flavors[flavor]
        model = _titanlite(args)
        ref = _reference(args)
        ref.load_state_dict(model.state_dict())
        with torch.no_grad():
            want = torch.cat([ref(input_ids=tokens[:, a:b]).logits for a, b in spans], 1)
            got = model(tokens[:, :32], AttnContext(positions, docs))
        assert ((got - want).abs().max() / want.abs().max()).item() <= 1e-6, (flavor, "documents")
        # buffers meta init leaves empty (RoPE's inv_freq, Gemma's embedding scale) are transformers' own values
        want = dict(ref.named_buffers())
        for name, buf in model.named_buffers():
            assert torch.equal(buf, want[name]), (flavor, name)
            assert "inv_freq" not in name or buf.abs().min() > 0, (flavor, name)
        inputs, labels = tokens[:, :-1], tokens[:, 1:]
        # the same 32 rows both ways (a load-balancing loss counts rows, not targets): transformers'
        # shift_labels are the targets as given
        out = ref(input_ids=inputs, labels=inputs, shift_labels=labels.contiguous())
        out.loss.backward()
        extra = ExtraLosses()  # as a training step runs it: Mixtral's load-balancing loss joins the loss
        extra.bind([model])
        with extra.collect(torch.tensor(float(labels.numel()))) as terms:
            loss = cross_entropy_sum(model(inputs, AttnContext()), labels) / labels.numel()
            loss.backward()
        assert ("moe_aux_loss" in terms) == (flavor == "debug_mixtral"), flavor
        loss = loss + sum(terms.values()) / labels.numel()
        assert abs(loss.item() - out.loss.item()) <= 1e-6 * out.loss.item(), (flavor, loss.item(), out.loss.item())
        grads = dict(ref.named_parameters())
        for name, p in model.named_parameters():
            want = grads[name].grad
            diff = ((p.grad - want).abs().max() / want.abs().max()).item()
            assert diff <= 1e-6, (flavor, name, diff)


def test_initialisation_is_transformers_rule_drawn_by_name():
    """Each parameter drawn with its module's transformers rule (Gemma's (1 + w) norms start at 0,
    Llama's at 1; linears N(0, initializer_range)), from a generator seeded by (seed, name)."""
    gemma, llama = _titanlite(SPEC.flavors["debug_gemma3_text"]), _titanlite(SPEC.flavors["debug_llama"])
    assert torch.equal(gemma.model.norm.weight, torch.zeros(64))
    assert torch.equal(llama.model.norm.weight, torch.ones(64))
    q = llama.model.layers[0].self_attn.q_proj.weight
    assert 0.015 < q.std() < 0.025
    again, other = _titanlite(SPEC.flavors["debug_llama"]), _titanlite(SPEC.flavors["debug_llama"], seed=1)
    assert torch.equal(again.model.layers[0].self_attn.q_proj.weight, q)
    assert not torch.equal(other.model.layers[0].self_attn.q_proj.weight, q)


def test_dropout_is_found_by_what_the_model_computes():
    """GPT-2 drops out through modules and through sdpa's dropout_p (its eager and sdpa attention):
    every one is seen in a meta forward, and the refusal names each config key that sets one."""
    from titanlite.models.transformers.config import DropoutWatch, check_dropout

    for impl in ("eager", "sdpa"):
        config = AutoConfig.for_model("gpt2", n_embd=64, n_layer=1, n_head=4, vocab_size=512, n_positions=64,
                                      bos_token_id=1, eos_token_id=2, attn_pdrop=0.3, attn_implementation=impl)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        watch = DropoutWatch(model)
        with watch:
            model.train()(torch.zeros(1, 8, dtype=torch.long, device="meta"))
        watch.remove()
        assert sorted(set(watch.seen)) == [(0.1, "transformer.drop"), (0.1, "transformer.h.0.attn.resid_dropout"),
                                           (0.1, "transformer.h.0.mlp.dropout"), (0.3, "transformer.h.0.attn")], impl
        with pytest.raises(ConfigError, match=r"set model.hf_overrides attn_pdrop=0,embd_pdrop=0,resid_pdrop=0,"
                                              r"summary_first_dropout=0$"):
            check_dropout("GPT2LMHeadModel", config.to_dict(), watch.seen, True)


def test_a_window_holding_the_context_is_full_attention():
    """A sliding window at least as long as the model's context (a real config shrunk to test) is
    full attention, as transformers computes it: accepted, planned full, transformers' logits."""
    from titanlite.models.transformers import TINY
    from titanlite.models.transformers.config import args_from_config, resolve_dict

    args = args_from_config(resolve_dict({"model_type": "cohere2", **TINY, "sliding_window": 4096}, "cohere2"))
    assert args.sliding_window == 0 and {args.window(i) for i in range(args.n_layers)} == {None}
    assert set(args.layer_types) == {"sliding_attention"}
    model, ref = _titanlite(args), _reference(args)
    ref.load_state_dict(model.state_dict())
    tokens = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = ref(input_ids=tokens).logits, model(tokens)
    assert ((got - want).abs().max() / want.abs().max()).item() <= 1e-6


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A random transformers Gemma 3 (tied embeddings, a scaled embedding, local and global RoPE)
    saved as a folder, with config values the family's defaults would not give."""
    from titanlite.models.transformers import DEBUG, TINY

    folder = tmp_path_factory.mktemp("gemma3")
    config = AutoConfig.for_model("gemma3_text", **{**TINY, **DEBUG["gemma3_text"], "rms_norm_eps": 1e-5,
                                                    "max_position_embeddings": 96})
    torch.manual_seed(3)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return folder


def test_a_saved_model_loads_through_its_folder_with_transformers_logits(saved):
    """TorchTitan's three bugs when loading pretrained weights, each checked: RoPE's inv_freq
    (and Gemma's embedding scale) recomputed, not zero; the folder's config values, not the
    family's; the tied embedding shared by lm_head."""
    from titanlite.checkpoint.dcp import load_hf_weights, model_shapes

    from titanlite.model_spec import model_args

    ref = AutoModelForCausalLM.from_pretrained(saved, attn_implementation="sdpa")
    # as the preflight makes them: the training sequence (32) is titanlite's, not the config's (96)
    args = model_args(SPEC, "debugmodel", 0, 32, hf_config=str(saved))
    assert args.max_seq_len == 32
    model = _titanlite(args, seed=7)
    assert load_hf_weights([model], saved, SPEC.hf, args, model_shapes(SPEC, args)) == []
    theirs, ours = ref.config.to_dict(), model.config.to_dict()
    assert {k: v for k, v in ours.items() if theirs.get(k) != v and k != "_name_or_path"} == {}
    assert (ours["max_position_embeddings"], ours["rms_norm_eps"]) == (96, 1e-5)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    for name, buf in model.named_buffers():
        assert torch.equal(buf, dict(ref.named_buffers())[name]), name
    tokens = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(1))
    want = ref(input_ids=tokens).logits
    got = model(tokens)
    assert ((got - want).abs().max() / want.abs().max()).item() <= 1e-6


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral"])
def test_a_moe_folder_as_save_pretrained_writes_it_loads_and_exports_back(model_type, tmp_path):
    """save_pretrained keeps the experts one by one, as the published folders do (Mixtral's under
    its old block_sparse_moe.experts.N.w1/w2/w3 names); transformers fuses them as it loads. The
    family loads the folder through transformers' own conversion, one block at a time, with
    from_pretrained's logits, and exports the folder's names and tensors back."""
    from titanlite.checkpoint.dcp import load_hf_weights, model_shapes
    from titanlite.checkpoint.hf import read_safetensors
    from titanlite.model_spec import model_args
    from titanlite.models.transformers import DEBUG, TINY

    config = AutoConfig.for_model(model_type, **{**TINY, **DEBUG[model_type]})
    torch.manual_seed(5)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    saved = read_safetensors(tmp_path)
    assert any(".experts.3." in k for k in saved) and not any(k.endswith(".experts.down_proj") for k in saved)
    ref = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="sdpa")
    args = model_args(SPEC, "debugmodel", 0, 32, hf_config=str(tmp_path))
    model = _titanlite(args, seed=7)
    assert load_hf_weights([model], tmp_path, SPEC.hf, args, model_shapes(SPEC, args)) == []
    tokens = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, got = ref(input_ids=tokens).logits, model(tokens)
    assert ((got - want).abs().max() / want.abs().max()).item() <= 1e-5
    exported = SPEC.hf.to_hf(model.state_dict(), args)
    assert exported.keys() == saved.keys() and all(torch.equal(exported[k], saved[k]) for k in saved)
    # a folder of the model's own (fused) names, as titanlite's earlier workaround wrote, loads too
    assert SPEC.hf.from_hf(model.state_dict(), args).keys() == model.state_dict().keys()


def test_activation_checkpointing_recomputes_a_transformers_layer():
    """A transformers decoder layer is no titanlite Block: its forward is wrapped in place, and
    backward runs it again; gradients are those without it, bit for bit."""
    from titanlite.config.job import ActivationCheckpoint
    from titanlite.parallel.apply import all_blocks, apply_ac

    tokens = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    grads, calls = [], []
    for mode in ("none", "full"):
        model = _titanlite(SPEC.flavors["debug_qwen3"])
        apply_ac(all_blocks(model, SPEC), ActivationCheckpoint(mode=mode))
        count = [0]
        model.model.layers[0].mlp.register_forward_pre_hook(lambda *_: count.__setitem__(0, count[0] + 1))
        cross_entropy_sum(model(tokens[:, :-1]), tokens[:, 1:]).backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
        calls.append(count[0])
    assert calls == [1, 2]
    assert all(torch.equal(grads[0][n], g) for n, g in grads[1].items())


def test_a_transformers_layer_compiles_as_one_graph():
    """Per-block compile (fullgraph) through titanlite's attention function, with checkpointing."""
    from titanlite.config.job import ActivationCheckpoint
    from titanlite.parallel.apply import all_blocks, apply_ac

    tokens = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    losses = []
    for compiled in (False, True):
        model = _titanlite(SPEC.flavors["debug_llama"])
        blocks = all_blocks(model, SPEC)
        apply_ac(blocks, ActivationCheckpoint(mode="full"))
        if compiled:
            torch._dynamo.reset()
            for block in blocks:
                block.compile(fullgraph=True, backend="eager")
        losses.append(cross_entropy_sum(model(tokens[:, :-1]), tokens[:, 1:]))
    assert torch.equal(losses[0], losses[1])


def _check(argv: list[str], tmp_path) -> None:
    """`python -m titanlite.train --check ...`, in process: the preflight every rank runs."""
    from titanlite.train import main

    with pytest.raises(SystemExit) as stop:
        main(["--check", "--job.dump_folder", str(tmp_path), "--training.seq_len", "32", "--model.name",
              "transformers", *argv])
    assert stop.value.code == 2


SMALL = "num_hidden_layers=2,hidden_size=64,intermediate_size=128"
"""model.hf_overrides that make a model_type's default config small enough to check in a second."""


@pytest.mark.parametrize("argv,expect", [
    (["--model.hf_config", "t5"], r"model_type 't5' is not a causal language model"),
    (["--model.hf_config", "lama"], r"does not know; did you mean 'llama'"),
    (["--model.hf_config", "llama", "--model.hf_overrides", "hiden_size=64"],
     r"model.hf_overrides: 'hiden_size' is not a key of LlamaConfig; did you mean 'hidden_size'"),
    (["--model.hf_config", "gemma2", "--model.hf_overrides", "num_hidden_layers=2,hidden_size=64"],
     r"soft-caps its attention logits \(attn_logit_softcapping 50.0\)"),
    (["--model.hf_config", "llama", "--model.hf_overrides", "attention_dropout=0.1"],
     r"LlamaForCausalLM applies dropout in training \(0.1 in model.layers.0.self_attn\); titanlite trains without "
     r"dropout, so that every layout equals one process: set model.hf_overrides attention_dropout=0$"),
    # Seed-OSS's published config: attention dropout, and residual dropout applied functionally (no nn.Dropout)
    (["--model.hf_config", "seed_oss", "--model.hf_overrides", SMALL], r"set model.hf_overrides "
                                                                       r"attention_dropout=0,residual_dropout=0$"),
    (["--model.hf_config", "seed_oss", "--model.hf_overrides", f"{SMALL},attention_dropout=0"],
     r"SeedOssForCausalLM applies dropout in training \(0.1 in model.layers.0.self_attn\).* residual_dropout=0$"),
    (["--model.hf_config", "phi3", "--model.hf_overrides", f"{SMALL},embd_pdrop=0.1,resid_pdrop=0.2"],
     r"Phi3ForCausalLM applies dropout .* set model.hf_overrides embd_pdrop=0,resid_pdrop=0$"),
    # StableLM's decoder layer drops the forward's keyword arguments: no documents, no context parallel
    (["--model.hf_config", "stablelm", "--model.hf_overrides", SMALL], r"StableLmAttention is reached without the "
                                                                       r"keyword arguments of the model's forward"),
    (["--model.hf_config", "llama", "--model.hf_overrides", SMALL, "--training.seq_len", "8192"],
     r"training.seq_len 8192 exceeds llama's max_position_embeddings 2048.* max_position_embeddings=8192"),
    (["--model.hf_overrides", "hidden_size=64"], r"model.hf_overrides change model.hf_config's config"),
    (["--model.hf_config", "qwen3", "--model.hf_overrides", f"{SMALL},hidden_act=gelu_fancy"],
     r"model.hf_config: hidden_act 'gelu_fancy' is not an activation transformers has; set model.hf_overrides "
     r"hidden_act to one of .*silu"),
    (["--model.flavor", "debug_qwen3_moe", "--parallelism.tensor_parallel_degree", "2"],
     # transformers 5.25 dropped the experts' entry from the plan; 5.24 has it in a style titanlite does not apply
     r"parallelism.tensor_parallel_degree 2: Qwen3MoeConfig(.s layers.\*.mlp.experts is in no base_model_tp_plan "
     r"entry but sees one rank's share of mlp|.base_model_tp_plan entry 'layers.\*.mlp.experts.gate_up_proj': "
     r"'packed_colwise' is not a style titanlite applies.*); train it with tensor_parallel_degree 1"),
    (["--model.flavor", "debug_mixtral", "--parallelism.pipeline_parallel_degree", "2"],
     r"pipeline_parallel_degree 2: MixtralConfig's load-balancing loss \(output_router_logits\) couples the routing "
     r"of every layer.*output_router_logits=false$"),
    (["--model.flavor", "debug_qwen3_moe", "--moe.aux_loss_coeff", "0.01"],
     r"the \[moe\] keys set titanlite's MoE layers; .* set model.hf_overrides output_router_logits=true,"
     r"router_aux_loss_coef=COEF$"),
    (["--model.flavor", "debug_qwen3_moe", "--parallelism.expert_parallel_degree", "2"],
     r"expert_parallel_degree 2: expert parallelism shards titanlite's MoE layers"),
    (["--model.flavor", "debug_granite", "--parallelism.pipeline_parallel_degree", "2"],
     r"GraniteForCausalLM's forward changes the hidden states between its embedding and its block 0"),
    (["--model.flavor", "debug_llama", "--optimizer.name", "Muon"], r"optimizer.name Muon"),
])
def test_bad_input_is_one_line(argv, expect, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    _check(argv, tmp_path)
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and re.search(expect, lines[0]) and lines[0].startswith("titanlite: error: "), lines


def test_hf_config_is_for_the_transformers_family(tmp_path, capsys):
    from titanlite.train import main

    with pytest.raises(SystemExit):
        main(["--check", "--job.dump_folder", str(tmp_path), "--model.name", "llama3", "--model.hf_config", "llama"])
    assert "llama3 takes its architecture from model.flavor" in capsys.readouterr().err


def _table(found: dict) -> str:
    """docs/transformers_models.md's table of what the parity launch found."""
    layouts = list(next(iter(found["results"].values())))
    rows = [f"| architecture | {' | '.join(layouts)} |", "|" + " --- |" * (len(layouts) + 1)]
    reasons = []
    for flavor, results in found["results"].items():
        cells = []
        for layout in layouts:
            outcome = results[layout]
            if outcome.startswith("refused: "):
                reasons.append(outcome.removeprefix("refused: "))
                outcome = f"refused ({len(reasons)})"
            cells.append(outcome)
        rows.append(f"| {flavor.removeprefix('debug_')} | {' | '.join(cells)} |")
    rows += ["", *(f"{i}. `{r}`" for i, r in enumerate(reasons, 1))]
    return "\n".join(rows)


def test_every_architecture_on_every_layout_is_the_table_in_the_docs(tmp_path):
    out = tmp_path / "parity.json"
    codes, output = spawn_ranks(2, [str(REPO / "tests" / "transformers_parity.py"), str(out)], timeout=600)
    assert out.exists(), output[-6000:]
    found = json.loads(out.read_text())
    bad = {f: {k: v for k, v in r.items() if v == "MISMATCH"} for f, r in found["results"].items()}
    assert not any(bad.values()) and codes == [0, 0], (bad, output[-6000:])
    assert len(found["compiled"]) >= 3 and set(found["compiled"].values()) == {"passed"}, found["compiled"]
    docs = (REPO / "docs" / "transformers_models.md").read_text()
    written = re.search(r"differs\), on transformers (\S+?)[ :]", docs).group(1)
    if found["transformers"] != written:  # another version in pyproject's range: its refusals may differ
        pytest.skip(f"the docs' table is transformers {written}'s; parity on {found['transformers']} held")
    table = _table(found)
    assert table in docs, f"docs/transformers_models.md's table is not what the test found; it found:\n{table}"


def test_the_dry_run_traces_transformers_llama_as_native_llama3():
    """Memory and time come from the traced step (so the planner's do too): transformers' Llama
    at the shapes of llama3's debug model, on 4 ranks (FSDP 2 x TP 2), moves the same
    collectives with the same bytes and does the same FLOPs as llama3; its peak is within 10%
    (it computes RoPE's tables per step where llama3 keeps them)."""
    from titanlite.config import load as config
    from titanlite.dryrun.run import dry_run

    a = get_model_spec("llama3").flavors["debugmodel"]
    shapes = (f"hidden_size={a.dim},num_hidden_layers={a.n_layers},num_attention_heads={a.n_heads},"
              f"num_key_value_heads={a.n_kv_heads},vocab_size={a.vocab_size},intermediate_size={a.ffn_hidden}")
    roles = []
    for model in (["--model.name", "llama3"],
                  ["--model.name", "transformers", "--model.hf_config", "llama", "--model.hf_overrides", shapes]):
        cfg, _ = config.load([*model, "--training.seq_len", "64", "--training.local_batch_size", "1",
                              "--parallelism.tensor_parallel_degree", "2"])
        roles.append(dry_run(cfg, 4)["_roles"][0])
    native, ours = roles
    assert ours.comms == native.comms and ours.flops == native.flops
    for phase, peak in native.peaks.items():
        assert abs(ours.peaks[phase]["total"] - peak["total"]) <= 0.1 * peak["total"], phase


def test_the_dry_run_plans_every_transformers_moe():
    """transformers' experts run as transformers runs them (its grouped_mm, not the eager loop whose
    .nonzero() has a data-dependent shape): the class reads as transformers' own (not custom
    code) and the dry run traces each debug MoE at the default job's sequence length."""
    from titanlite.config import load as config
    from titanlite.dryrun.run import dry_run

    for flavor in ("debug_qwen3_moe", "debug_mixtral"):
        args = SPEC.flavors[flavor]
        ours, ref = _titanlite(args), _reference(args)
        assert ours.config._experts_implementation == ref.config._experts_implementation == "grouped_mm", flavor
        assert not type(ours).is_custom_code(), flavor
        cfg, _ = config.load(["--model.name", "transformers", "--model.flavor", flavor, "--training.seq_len", "256",
                              "--training.local_batch_size", "1"])
        assert dry_run(cfg, 1)["_roles"][0].flops > 0, flavor
    # Qwen3-MoE's default coefficient with router logits off trains nothing, which the run's start says
    assert "router_aux_loss_coef 0.001 with output_router_logits false: no auxiliary" in SPEC.notes(args=SPEC.flavors[
        "debug_qwen3_moe"])[0]
    assert SPEC.notes(SPEC.flavors["debug_mixtral"]) == SPEC.notes(SPEC.flavors["debug_llama"]) == ()
