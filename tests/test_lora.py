"""LoRA: adapters on every layout, adapter checkpoints, and PEFT interop checked by logits.

One gloo launch (tests/lora_layouts.py) runs the real trainer on FSDP 2 (saving at steps 5 and
10), FSDP 2 again resumed from step 5, TP 2, PP 2, CP 2 (with activation checkpointing) and HSDP
2 x 1 (compiled) on llama3, EP 2 on qwen3_moe, and TP 2 (sequence parallel), FSDP 2 and HSDP 2 x 1 on
the transformers family's Qwen3; each llama3 run starts from a transformers folder (TP 2
from the same weights as a titanlite checkpoint) and from an adapter PEFT made (random, non-zero
lora_B), with Muon on the adapters and AdamW on lm_head, trained whole. Every loss equals the
single-process run's, the optimizer holds exactly the adapters and lm_head, every frozen weight
is bitwise what it was loaded as, and the resumed run's losses and adapter are bitwise the
straight run's. The PEFT tests run in this process with peft and transformers.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
import warnings
from pathlib import Path

import pytest
import torch
import titanlite
from harness import TINY, assert_parity, reference, spawn_ranks, train
from peft import LoraConfig, PeftModel, get_peft_model
from peft.utils import get_peft_model_state_dict
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from titanlite.checkpoint.dcp import model_shapes
from titanlite.checkpoint.folder import read_metadata, write_model_checkpoint
from titanlite.checkpoint.hf import read_safetensors, write_hf_folder
from titanlite.checkpoint.peft import from_peft, to_peft, write_peft
from titanlite.checkpoint.weights import assign_full
from titanlite.config import load as config_load
from titanlite.config.job import LoRA
from titanlite.data.loader import build_dataloader
from titanlite.errors import ConfigError
from titanlite.loss import IGNORE_INDEX
from titanlite.model_spec import get_model_spec, model_args
from titanlite.checkpoint.lora import setup_lora
from titanlite.layers.lora import apply_lora
from titanlite.preflight import make_plan, preflight
from titanlite.tools.convert import main as convert_main
from titanlite.tools.merge import main as merge_main

REPO = Path(__file__).resolve().parent.parent
TARGETS = "q_proj,k_proj,v_proj,o_proj,down_proj"  # by their Hugging Face names


def _hf_base(name: str, folder: Path, seed: int = 7, layers: int = 0,
             flavor: str = "debugmodel") -> tuple[torch.nn.Module, object]:
    """A random titanlite model (non-trivial norms; the flavor, with `layers` blocks if given)
    written as a transformers folder."""
    spec = get_model_spec(name)
    args = model_args(spec, flavor, 0, 64)
    args = dataclasses.replace(args, n_layers=layers) if layers else args
    model = spec.build(args)
    model.init_weights(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(seed))
    write_hf_folder(folder, spec.hf.to_hf(model.state_dict(), args), spec.hf.config_to_hf(args, torch.float32))
    return model, args


def _load_peft(base: Path, adapter: Path) -> PeftModel:
    """transformers' model with PEFT's load of `adapter`; a missing or unexpected adapter key fails."""
    hf = AutoModelForCausalLM.from_pretrained(base, attn_implementation="eager").float().eval()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = PeftModel.from_pretrained(hf, adapter).eval()
    assert not [w for w in caught if "adapter keys" in str(w.message)], [str(w.message) for w in caught]
    saved = load_file(adapter / "adapter_model.safetensors")
    assert set(get_peft_model_state_dict(model)) == set(saved)  # nothing missing, nothing left unread
    return model


@pytest.mark.parametrize("name,targets,full,rslora", [
    ("llama3", "wq,wk,wv,wo,w1,w2,w3", "output", False),          # the q/k row permutation
    ("qwen3", "q_proj,k_proj,v_proj,o_proj,mlp.gate_proj,up_proj,w2", "norm", True),
    ("qwen3_moe", "wq,wk,wv,wo", "lm_head", False),
    ("transformers", "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj", "lm_head", False)])  # Llama via transformers
def test_export_loads_in_peft_with_equal_logits(name, targets, full, rslora, tmp_path):
    model, args = _hf_base(name, tmp_path / "base", layers=2)
    spec = get_model_spec(name)
    setup = setup_lora(LoRA(rank=4, alpha=8.0, rslora=rslora, target_modules=targets.split(","),
                           train_in_full=[full]), spec, args)
    apply_lora(model, setup)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # non-zero random adapters: a wrong mapping cannot hide behind B = 0
        for p in (p for p in model.parameters() if p.requires_grad):
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    trained = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
    write_peft(tmp_path / "peft", *to_peft(trained, setup, spec.hf, args, model_shapes(spec, args), str(tmp_path / "base")))
    tokens = torch.randint(0, args.vocab_size, (2, 24), generator=g)
    peft = _load_peft(tmp_path / "base", tmp_path / "peft")
    with torch.no_grad():
        ours, theirs = model.eval()(tokens), peft(tokens).logits
        with peft.disable_adapter():
            base = peft(tokens).logits
    assert (ours - base).abs().max() > 1.0  # the adapters change the logits by far more than the tolerance
    assert (ours - theirs).abs().max().item() <= 1e-5


@pytest.mark.parametrize("name,flavor,targets", [("llama3", "debugmodel_tied", "wq,output"),
                                                  ("transformers", "debug_qwen2", "q_proj,lm_head")])
def test_an_adapter_on_a_tied_output_exports_the_model_that_trained(name, flavor, targets, tmp_path, capsys):
    """The output layer shares the embedding's weight; its adapter changes the output only, so the
    merged exports are untied (lm_head.weight of its own; the torch file loads into the untied
    model, as its line says) and give the LoRA model's logits, and so does the PEFT folder,
    unmerged on the tied base (PEFT warns) and merged too on an untied one (no warning)."""
    spec = get_model_spec(name)
    args = dataclasses.replace(model_args(spec, flavor, 0, 64), n_layers=2)
    assert args.tie_embeddings
    model = spec.build(args)
    model.init_weights(5)
    write_hf_folder(tmp_path / "base", spec.hf.to_hf(model.state_dict(), args), spec.hf.config_to_hf(args, torch.float32))
    setup = setup_lora(LoRA(rank=4, alpha=8.0, target_modules=targets.split(",")), spec, args)
    apply_lora(model, setup)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in (p for p in model.parameters() if p.requires_grad):
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    trained = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
    write_model_checkpoint(tmp_path / "step-1", trained, name, args)
    info = json.loads((tmp_path / "step-1" / "titanlite.json").read_text())
    info["transform"] = {"lora": setup.record(), "base": {"path": str(tmp_path / "base"), "format": "seed", "seed": 5}}
    (tmp_path / "step-1" / "titanlite.json").write_text(json.dumps(info))
    convert_main(["dcp", "hf", str(tmp_path / "step-1"), str(tmp_path / "merged")])
    convert_main(["dcp", "peft", str(tmp_path / "step-1"), str(tmp_path / "peft")])
    convert_main(["dcp", "torch", str(tmp_path / "step-1"), str(tmp_path / "merged.pt")])
    peft_line, torch_line = capsys.readouterr().out.strip().splitlines()[-2:]
    assert "is tied to" in peft_line and "titanlite.tools.convert dcp hf" in peft_line, peft_line
    assert "tie_embeddings=False" in torch_line, torch_line
    untied_model = spec.build(dataclasses.replace(args, tie_embeddings=False))
    untied_model.load_state_dict(torch.load(tmp_path / "merged.pt", weights_only=True))
    config = json.loads((tmp_path / "merged" / "config.json").read_text())
    assert config["tie_word_embeddings"] is False and "lm_head.weight" in read_safetensors(tmp_path / "merged")
    tokens = torch.randint(0, args.vocab_size, (2, 24), generator=g)
    load = functools.partial(AutoModelForCausalLM.from_pretrained, attn_implementation="eager")
    on_tied = PeftModel.from_pretrained(load(tmp_path / "base").float(), tmp_path / "peft").eval()  # PEFT warns
    untied = load(tmp_path / "base", tie_word_embeddings=False).float()  # as PEFT's warning at merge says
    untied.lm_head.weight.data = untied.model.embed_tokens.weight.data.clone()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        on_untied = PeftModel.from_pretrained(untied, tmp_path / "peft").eval()
    assert not [w for w in caught if re.search("tie|adapter keys", str(w.message))], [str(w.message) for w in caught]
    with torch.no_grad():
        ours = model.eval()(tokens)
        with on_tied.disable_adapter():
            assert (ours - on_tied(tokens).logits).abs().max() > 0.1  # the adapters change the logits
        for theirs in (load(tmp_path / "merged").float().eval(), on_tied, on_untied, on_untied.merge_and_unload()):
            assert (ours - theirs(tokens).logits).abs().max().item() <= 1e-5
        assert (ours - untied_model.eval()(tokens)).abs().max().item() <= 1e-5


# ---- the layouts launch ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    """The runs of the module doc, their reference runs, and the folders they started from."""
    root = tmp_path_factory.mktemp("lora")
    hf_model, args = _hf_base("llama3", root / "base")
    write_model_checkpoint(root / "base_dcp", hf_model.state_dict(), "llama3", args)
    made = get_peft_model(AutoModelForCausalLM.from_pretrained(root / "base").float(),
                          LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS.split(","), modules_to_save=["lm_head"]))
    with torch.no_grad():
        g = torch.Generator().manual_seed(3)
        for n, p in made.named_parameters():
            if p.requires_grad:  # every lora_A and lora_B, and PEFT's trained copy of lm_head
                p.add_(torch.randn(p.shape, generator=g) * 0.05)
    made.save_pretrained(root / "made")
    lora = [*TINY, "--training.global_batch_size", "8", "--lora.rank", "4", "--lora.alpha", "8",
            "--lora.target_modules", TARGETS, "--lora.train_in_full", "lm_head", "--lora.initial_adapter",
            str(root / "made"), "--checkpoint.initial_load_path", str(root / "base"), "--checkpoint.initial_load_format",
            "hf", "--optimizer.name", "Muon", "--optimizer.lr", "3e-3"]
    moe = [*TINY, "--model.name", "qwen3_moe", "--training.global_batch_size", "8", "--lora.rank", "4",
           "--lora.target_modules", "wq,wv", "--moe.aux_loss_coeff", "0.01"]
    # the transformers family (Qwen3: QK-norms, a sliding-window layer) from a folder, its norms frozen
    _hf_base("transformers", root / "tf_base", flavor="debug_qwen3")
    tf = [*TINY, "--model.name", "transformers", "--model.flavor", "debug_qwen3", "--training.global_batch_size", "8",
          "--lora.rank", "4", "--lora.alpha", "8", "--lora.target_modules", TARGETS, "--optimizer.lr", "1e-2",
          "--checkpoint.initial_load_path", str(root / "tf_base"), "--checkpoint.initial_load_format", "hf"]
    ckpt = ["--checkpoint.enable", "true", "--checkpoint.interval", "5"]
    pp_dropout = [*lora, "--training.local_batch_size", "8", "--parallelism.pipeline_parallel_degree", "2",
                  "--parallelism.pipeline_parallel_microbatch_size", "2", "--lora.dropout", "0.1",
                  "--parallelism.pipeline_parallel_first_stage_less_layers", "0"]
    runs = {
        "fsdp2": [*lora, "--training.local_batch_size", "4", *ckpt, "--job.run_name", "straight"],
        "resumed": [*lora, "--training.local_batch_size", "4", *ckpt, "--job.run_name", "resumed",
                    "--checkpoint.load_step", "5", "--lora.export_folder", "peft_resumed"],
        "tp2": [*lora, "--training.local_batch_size", "8", "--parallelism.tensor_parallel_degree", "2",
                "--checkpoint.initial_load_path", str(root / "base_dcp"), "--checkpoint.initial_load_format", "dcp"],
        "pp2": [*lora, "--training.local_batch_size", "8", "--parallelism.pipeline_parallel_degree", "2",
                "--parallelism.pipeline_parallel_microbatch_size", "2"],
        "cp2": [*lora, "--training.local_batch_size", "8", "--parallelism.context_parallel_degree", "2",
                "--activation_checkpoint.mode", "full"],
        "hsdp2x1": [*lora, "--training.local_batch_size", "4", "--parallelism.data_parallel_replicate_degree", "2",
                    "--compile.enable", "true"],
        "ep2": [*moe, "--training.local_batch_size", "4", "--parallelism.expert_parallel_degree", "2"],
        "tf_tp2": [*tf, "--training.local_batch_size", "8", "--parallelism.tensor_parallel_degree", "2", *ckpt],
        "tf_fsdp2": [*tf, "--training.local_batch_size", "4", *ckpt],
        "tf_hsdp2x1": [*tf, "--training.local_batch_size", "4", "--parallelism.data_parallel_replicate_degree", "2"],
        # dropout on stages of 3 and 1 blocks (unequal draws per rank): 10 steps, and from step 5
        "pp2_dropout": [*pp_dropout, *ckpt, "--job.run_name", "straight"],
        "pp2_dropout_resumed": [*pp_dropout, *ckpt, "--job.run_name", "resumed", "--checkpoint.load_step", "5"],
    }
    shared = {"resumed": "fsdp2", "pp2_dropout_resumed": "pp2_dropout"}  # a resume writes to its run's folder
    dumps = {name: root / shared.get(name, name) for name in runs}
    argv = " + ".join(" ".join([*args, "--job.dump_folder", str(dumps[name])]) for name, args in runs.items())
    codes, output = spawn_ranks(2, [str(REPO / "tests" / "lora_layouts.py"), *argv.split()], timeout=900)
    refs = {"llama3": reference([*lora, "--training.local_batch_size", "8"]),
            "qwen3_moe": reference([*moe, "--training.local_batch_size", "8"]),
            "transformers": reference([*tf, "--training.local_batch_size", "8"])}
    return dict(root=root, runs=runs, dumps=dumps, output=output, codes=codes, refs=refs, lora=lora)


def _rows(dump: Path, run: str | None = None) -> list[dict]:
    rows = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "loss" in r and (run is None or r["run"] == run)]


def test_every_layout_matches_one_process_and_trains_only_the_adapters(layouts):
    out = layouts["output"]
    for i, name in enumerate(layouts["runs"]):
        lines = re.findall(rf"rank \d run {i}: (.*)", out)
        assert len(lines) == 2 and all("optimizer exact: True" in x and "frozen unchanged: True" in x for x in lines), \
            (name, lines, out[-4000:])
    for name in ("fsdp2", "tp2", "pp2", "cp2", "hsdp2x1", "ep2"):
        ref = layouts["refs"]["qwen3_moe" if name == "ep2" else "llama3"]
        got = _rows(layouts["dumps"][name], "straight" if name == "fsdp2" else None)
        assert_parity(ref.losses, [r["loss"] for r in got])
        diffs = [abs(a - r["loss"]) / a for a, r in zip(ref.losses, got)]
        print(f"{name}: first-step loss rel. diff {diffs[0]:.1e}, worst of {len(diffs)} steps {max(diffs):.1e}")


def test_the_transformers_family_on_every_layout_matches_one_process(layouts):
    """TP 2 with sequence parallel (its norms frozen through NormParallel), FSDP 2 and HSDP 2 x 1:
    each rank's optimizer holds the adapters alone and every frozen weight is bitwise unchanged
    (the first test), and the losses are one process's: 1e-6 at step 1, 1e-5 over 10 steps."""
    for name in ("tf_tp2", "tf_fsdp2", "tf_hsdp2x1"):
        assert_parity(layouts["refs"]["transformers"].losses, [r["loss"] for r in _rows(layouts["dumps"][name])],
                      rtol=1e-5)


@pytest.mark.parametrize("run", ["tf_fsdp2", "tf_tp2"])
def test_a_two_rank_transformers_export_loads_in_peft_with_the_runs_logits(layouts, run, tmp_path):
    """The PEFT adapter a 2-rank run of the transformers family wrote (gathered from FSDP's or
    TP's shards) gives, in peft over the base folder, the logits of the run's last checkpoint
    merged into the base (titanlite's convert, read by transformers)."""
    root, dump = layouts["root"], layouts["dumps"][run]
    convert_main(["dcp", "hf", str(dump / "checkpoint" / "step-10"), str(tmp_path / "merged")])
    peft = _load_peft(root / "tf_base", dump / "peft")
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", attn_implementation="eager").float().eval()
    tokens = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs, ours = peft(tokens).logits, merged(input_ids=tokens).logits
        with peft.disable_adapter():
            base = peft(tokens).logits
    assert (ours - base).abs().max() > 0.5  # ten steps moved the logits far beyond the tolerance
    assert (ours - theirs).abs().max().item() <= 1e-5


def test_resume_is_bitwise_and_a_checkpoint_holds_the_adapter_only(layouts):
    for dump in (layouts["dumps"]["fsdp2"], layouts["dumps"]["pp2_dropout"]):
        straight, resumed = _rows(dump, "straight"), _rows(dump, "resumed")
        assert [r["step"] for r in resumed] == list(range(6, 11))
        assert [r["loss"] for r in resumed] == [r["loss"] for r in straight[5:]], dump
    dump = layouts["dumps"]["fsdp2"]
    step5 = dump / "checkpoint" / "step-5"
    # resumed: the run's kind is named (checkpoint.state.check_run_kind); as initial weights: the adapters
    for extra, expect in ((["--checkpoint.enable", "true", "--checkpoint.load_step", "5"],
                           rf"resuming {step5}: that checkpoint is a LoRA run's \(it holds the adapters only\), and this "
                           r"run trains every weight \(lora.rank 0\)"),
                          (["--checkpoint.initial_load_path", str(step5)],
                           rf"{step5} is a LoRA run's checkpoint \(lora.rank 4, 20 adapted layers\): it holds the "
                           "adapters, not the model's weights")):
        cfg, _ = config_load.load([*TINY, "--training.local_batch_size", "8", "--job.dump_folder", str(dump), *extra])
        with pytest.raises(ConfigError, match=expect):
            preflight(cfg, 1)
    a, b = load_file(dump / "peft" / "adapter_model.safetensors"), load_file(dump / "peft_resumed" / "adapter_model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    meta = read_metadata(dump / "checkpoint" / "step-5").state_dict_metadata
    size = {k: m.size.numel() * 4 for k, m in meta.items() if hasattr(m, "size")}
    model = {k.removeprefix("model."): v for k, v in size.items() if k.startswith("model.")}
    assert all(".lora_" in k or k == "output.weight" for k in model) and len(model) == 4 * 5 * 2 + 1
    whole = sum(s.numel() * 4 for s in model_shapes(*_llama_spec_args()).values())
    trained = sum(model.values())
    # the adapter, Muon's momentum (adapters) and AdamW's two moments (lm_head), the data cursor
    assert sum(size.values()) <= 3 * trained + 4096 < whole / 3, (sum(size.values()), trained, whole)


def _llama_spec_args():
    spec = get_model_spec("llama3")
    return spec, model_args(spec, "debugmodel", 0, 64)


def test_peft_adapter_imports_and_trains_on(layouts):
    """PEFT's adapter in titanlite gives PEFT's logits, and the single-process run started from it
    has the PEFT model's loss on its first batch, and trains on."""
    root = layouts["root"]
    cfg, _ = config_load.load([*layouts["lora"], "--training.local_batch_size", "8", "--job.dump_folder",
                               str(root / "probe")])
    plan = preflight(cfg, 1)
    batch = next(iter(build_dataloader(cfg.data, plan.tokenizer, seq_len=64, global_batch_size=8,
                                       local_batch_size=8, dp_rank=0, dp_degree=1)))
    peft = _load_peft(root / "base", root / "made")
    model, args = titanlite.load_hf(root / "base", "llama3")
    spec = get_model_spec("llama3")
    setup = setup_lora(LoRA(rank=4, alpha=8.0, target_modules=TARGETS.split(","), train_in_full=["lm_head"]), spec, args)
    apply_lora(model, setup)
    assign_full(model, from_peft(root / "made", setup, spec.hf, args, model_shapes(spec, args)))
    with torch.no_grad():
        logits, ours = peft(batch["input_ids"]).logits, model.eval()(batch["input_ids"])
        with peft.disable_adapter():
            base = peft(batch["input_ids"]).logits
    assert (ours - base).abs().max() > 1.0 and (ours - logits).abs().max().item() <= 1e-5
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(),
                                             ignore_index=IGNORE_INDEX)
    ref = layouts["refs"]["llama3"].losses
    assert abs(ref[0] - loss.item()) / loss.item() < 1e-5 and ref[-1] < ref[0]


def test_export_merge_and_convert_agree_with_peft(layouts, tmp_path):
    root, dump = layouts["root"], layouts["dumps"]["fsdp2"]
    convert_main(["dcp", "peft", str(dump / "checkpoint" / "step-10"), str(tmp_path / "converted")])
    a, b = load_file(dump / "peft" / "adapter_model.safetensors"), load_file(tmp_path / "converted" / "adapter_model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    config = json.loads((dump / "peft" / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"], config["use_rslora"], config["task_type"],
            config["base_model_name_or_path"]) == ("LORA", 4, 8.0, False, "CAUSAL_LM", str((root / "base").resolve()))
    assert sorted(config["target_modules"]) == sorted(TARGETS.split(",")) and config["modules_to_save"] == ["lm_head"]
    convert_main(["dcp", "hf", str(dump / "checkpoint" / "step-10"), str(tmp_path / "merged")])
    assert (tmp_path / "merged" / "model.safetensors.index.json").is_file()
    merged = read_safetensors(tmp_path / "merged")
    theirs = _load_peft(root / "base", dump / "peft").merge_and_unload().state_dict()
    assert merged.keys() == theirs.keys()
    assert max((merged[k] - theirs[k]).abs().max().item() for k in merged) <= 1e-6
    base = read_safetensors(root / "base")
    assert (merged["model.layers.0.self_attn.q_proj.weight"] - base["model.layers.0.self_attn.q_proj.weight"]).abs().max() > 1e-3


def test_merge_of_lora_checkpoints_is_the_mean_of_their_models(layouts, tmp_path):
    """tools.merge of a LoRA run's checkpoints (steps 5 and 10): the mean of the models they define
    (each base + scale B A, then the mean; not mean(B) mean(A)), as dcp and as hf, equals the mean
    of their merged exports; the dcp merge is the base of a new run, whose first loss is the
    merged model's on its first batch."""
    ckpt, root = layouts["dumps"]["fsdp2"] / "checkpoint", layouts["root"]
    steps, exports = [ckpt / "step-5", ckpt / "step-10"], []
    for step in steps:
        convert_main(["dcp", "hf", str(step), str(tmp_path / step.name)])
        exports.append(read_safetensors(tmp_path / step.name))
    q = "model.layers.0.self_attn.q_proj.weight"
    assert (exports[0][q] - exports[1][q]).abs().max() > 1e-3  # steps 5 and 10 are models apart
    mean = {k: (exports[0][k] + exports[1][k]) / 2 for k in exports[0]}
    merge_main([*map(str, steps), str(tmp_path / "mean")])
    merge_main([*map(str, steps), str(tmp_path / "mean_hf"), "--format", "hf"])
    convert_main(["dcp", "hf", str(tmp_path / "mean"), str(tmp_path / "mean_export")])
    for got in (read_safetensors(tmp_path / "mean_hf"), read_safetensors(tmp_path / "mean_export")):
        assert got.keys() == mean.keys()
        assert max((got[k] - mean[k]).abs().max().item() for k in got) <= 1e-6
    run = train(1, [*TINY, "--training.global_batch_size", "8", "--training.local_batch_size", "8",
                    "--training.steps", "1", "--checkpoint.initial_load_path", str(tmp_path / "mean")],
                dump=tmp_path / "next")
    assert f"initial weights from {tmp_path / 'mean'} (dcp)" in run.output
    cfg, _ = config_load.load([*layouts["lora"], "--training.local_batch_size", "8", "--job.dump_folder",
                               str(root / "probe")])
    batch = next(iter(build_dataloader(cfg.data, preflight(cfg, 1).tokenizer, seq_len=64, global_batch_size=8,
                                       local_batch_size=8, dp_rank=0, dp_degree=1)))
    model, _ = titanlite.load_hf(tmp_path / "mean_hf", "llama3")
    with torch.no_grad():
        logits = model.eval()(batch["input_ids"])
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=IGNORE_INDEX)
    assert abs(run.losses[0] - loss.item()) / loss.item() <= 1e-6, (run.losses, loss.item())


# ---- bad input --------------------------------------------------------------------------------

@pytest.mark.parametrize("extra,message", [
    (["--lora.target_modules", "wq,attention.wz"], "lora.target_modules: 'attention.wz' matches no module"),
    (["--model.name", "qwen3_moe", "--lora.target_modules", "experts"], "names layers.0.moe.experts, a GroupedExperts"),
    (["--model.name", "qwen3_moe", "--lora.target_modules", "mlp.gate"], "takes layers.0.moe.router.gate, a MoE router's gate"),
    (["--model.name", "qwen3_5", "--model.flavor", "debugmodel", "--lora.target_modules", "wq"],
     "has no transformers weight of its own in qwen3_5's mapping"),
    (["--lora.train_in_full", "attention"], "lora.train_in_full takes layers.0.attention, which lora.target_modules"),
    (["--model.flavor", "debugmodel_tied", "--lora.train_in_full", "output"], "are one weight (tied)"),
    (["--lora.train_in_full", "nothing_here"], "lora.train_in_full: 'nothing_here' matches no module"),
    (["--float8.enable", "true"], "float8.enable with lora.rank 4"),
    (["--moe.bias_update_rate", "0.001", "--model.name", "qwen3_moe"], "moe.bias_update_rate with lora.rank 4"),
    (["--checkpoint.export_dtype", "bfloat16"], "checkpoint.export_dtype with lora.rank 4"),
    (["--checkpoint.merge_last", "2", "--checkpoint.enable", "true"], "checkpoint.merge_last with lora.rank 4: the mean of the adapters' A and B"),
    (["--lora.alpha", "0"], "lora: need rank >= 0 (0: off), alpha > 0"),
    (["--lora.target_modules", ""], "and target_modules (e.g. wq,wv), got rank 4, alpha 16.0, dropout 0.0, []"),
], ids=["nothing", "experts", "router", "fused", "overlap", "tied", "full_nothing", "float8", "router_bias", "export_dtype",
        "merge_last", "alpha", "empty"])
def test_bad_lora_input_is_one_line_before_launch(extra, message):
    with pytest.raises(ConfigError, match=re.escape(message)) as err:
        cfg, _ = config_load.load([*TINY, "--lora.rank", "4", *extra])
        make_plan(cfg, 1)
    assert "\n" not in str(err.value)


def test_an_adapter_for_other_settings_is_refused(tmp_path):
    _, args = _hf_base("llama3", tmp_path / "base", layers=1)
    made = get_peft_model(AutoModelForCausalLM.from_pretrained(tmp_path / "base"),
                          LoraConfig(r=8, lora_alpha=8, target_modules=["q_proj"]))
    made.save_pretrained(tmp_path / "made")
    cfg, _ = config_load.load([*TINY, "--lora.rank", "4", "--lora.alpha", "8", "--lora.target_modules", "q_proj",
                               "--lora.initial_adapter", str(tmp_path / "made")])
    with pytest.raises(ConfigError, match="lora.initial_adapter .* has r=8"):  # before launch
        make_plan(cfg, 1)
    spec = get_model_spec("llama3")
    setup = setup_lora(LoRA(rank=4, alpha=8.0, target_modules=["q_proj"]), spec, args)
    with pytest.raises(ConfigError, match="has r=8, lora_alpha=8, use_rslora=False; this run has lora.rank 4"):
        from_peft(tmp_path / "made", setup, spec.hf, args, model_shapes(spec, args))
    wider = dataclasses.replace(setup, rank=8, targets=setup.targets | {"layers.0.attention.wv"})
    with pytest.raises(ConfigError, match="has no base_model.model.model.layers.0.self_attn.v_proj.lora_A.weight"):
        from_peft(tmp_path / "made", wider, spec.hf, args, model_shapes(spec, args))


@pytest.mark.parametrize("mode", ["full", "op"])
def test_dropout_draws_the_same_masks_when_a_block_is_recomputed(mode):
    """LoRA's dropout under activation checkpointing: the recomputation draws the forward's masks,
    so the gradients are those of the run without it."""
    from titanlite.config.job import ActivationCheckpoint
    from titanlite.parallel.apply import apply_ac

    spec = get_model_spec("llama3")
    args = dataclasses.replace(model_args(spec, "debugmodel", 0, 32), n_layers=1)
    model = spec.build(args)
    model.init_weights(0)
    apply_lora(model, setup_lora(LoRA(rank=4, dropout=0.5, target_modules=["wq", "w2"]), spec, args))
    with torch.no_grad():
        for p in (p for p in model.parameters() if p.requires_grad):
            p.normal_(0, 0.05)
    tokens = torch.randint(0, args.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))

    def grads() -> list[torch.Tensor]:
        model.zero_grad()
        torch.manual_seed(5)
        model(tokens).square().mean().backward()
        return [p.grad.clone() for p in model.parameters() if p.requires_grad]

    plain = grads()
    apply_ac(list(model.layers.values()), ActivationCheckpoint(mode="selective" if mode == "op" else "full",
                                                               selective_type=mode), random=True)
    assert all(torch.equal(a, b) for a, b in zip(plain, grads()))


def test_generation_reads_a_lora_checkpoint_as_its_merged_model(layouts, tmp_path):
    """python -m titanlite.generate over the LoRA run's step folder (the adapter applied to the base
    it records) writes the tokens of its merged transformers folder, which differ from the base's;
    with its base gone, one line."""
    import shutil

    from titanlite.generate.__main__ import main as generate_main

    step = layouts["dumps"]["fsdp2"] / "checkpoint" / "step-10"
    convert_main(["dcp", "hf", str(step), str(tmp_path / "merged")])
    common = ["--prompt", "Hello", "--prompt", "A longer prompt than that", "--max_new_tokens", "16",
              "--tokenizer", "byte"]
    runs = {"lora": [str(step)], "merged": [str(tmp_path / "merged"), "--format", "hf"],
            "base": [str(layouts["root"] / "base"), "--format", "hf"]}
    ids, threads = {}, torch.get_num_threads()
    torch.set_num_threads(1)  # decode steps are small ops, which threads slow down on a loaded machine
    try:
        for name, argv in runs.items():
            generate_main([*argv, *common, "--out", str(tmp_path / f"{name}.json")])
            ids[name] = [row["ids"] for row in json.loads((tmp_path / f"{name}.json").read_text())]
    finally:
        torch.set_num_threads(threads)
    assert ids["lora"] == ids["merged"] != ids["base"]
    shutil.copytree(step, tmp_path / "moved")
    info = json.loads((tmp_path / "moved" / "titanlite.json").read_text())
    info["transform"]["base"]["path"] = str(tmp_path / "gone")
    (tmp_path / "moved" / "titanlite.json").write_text(json.dumps(info))
    with pytest.raises(SystemExit, match="is a LoRA checkpoint whose base model .*gone .* is missing"):
        generate_main([str(tmp_path / "moved"), *common])

