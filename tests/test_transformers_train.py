"""The transformers family through the real trainer, as a native family: a saved transformers
model (Qwen2, tied embeddings) starts a 2-rank FSDP run through checkpoint.initial_load_format
hf with transformers' own first loss; the run resumes bitwise from its checkpoint, reshards onto
tensor parallel, and its checkpoint exports back to a folder transformers loads with the
trained model's logits. Three launches of 2 gloo ranks."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from harness import TINY, train
from test_checkpoint import assert_same_tensors, losses_by_step

from titanlite.checkpoint.folder import load_tensors
from titanlite.config import load as config_load
from titanlite.config.data import Data
from titanlite.data.loader import build_dataloader
from titanlite.data.tokenizer import build_tokenizer
from titanlite.errors import ConfigError
from titanlite.model_spec import get_model_spec
from titanlite.preflight import preflight
from titanlite.tools.convert import convert

transformers = pytest.importorskip("transformers")
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

STEPS = 4


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    from titanlite.models.transformers import DEBUG, TINY as SIZES

    path = tmp_path_factory.mktemp("qwen2")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen2", **{**SIZES, **DEBUG["qwen2"]})).save_pretrained(path)
    return path


def job(folder: Path, *extra: str) -> list[str]:
    return [*TINY, "--model.name", "transformers", "--model.hf_config", str(folder), "--training.steps", str(STEPS),
            "--training.local_batch_size", "4", "--checkpoint.enable", "--checkpoint.interval", "2",
            "--checkpoint.initial_load_path", str(folder), "--checkpoint.initial_load_format", "hf",
            "--lr_scheduler.warmup_steps", "1", *extra]


@pytest.fixture(scope="module")
def straight(folder, tmp_path_factory) -> Path:
    dump = tmp_path_factory.mktemp("straight")
    run = train(2, job(folder), dump=dump)
    assert f"initial weights from {folder} (hf)" in run.output
    return dump


def test_the_first_step_is_transformers_loss_on_the_folder_s_weights(folder, straight):
    """FSDP 2, the embedding tied to lm_head: step 1's loss is the folder's model's own on the
    step's batch (RoPE recomputed, the config the folder's, the tie kept)."""
    loader = build_dataloader(Data(holdout_fraction=0.0), build_tokenizer("byte"), seq_len=64, global_batch_size=8,
                              local_batch_size=8, dp_rank=0, dp_degree=1)
    batch = next(iter(loader))
    model = AutoModelForCausalLM.from_pretrained(folder)
    logits = model(input_ids=batch["input_ids"]).logits
    want = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten()).item()
    assert abs(losses_by_step(straight)[1] - want) <= 1e-6 * want


def test_resume_is_bitwise(folder, straight, tmp_path):
    shutil.copytree(straight / "checkpoint" / "step-2", tmp_path / "checkpoint" / "step-2")
    run = train(2, job(folder), dump=tmp_path)
    assert "resumed from" in run.output
    assert [r["loss"] for r in run.metrics] == [losses_by_step(straight)[s] for s in (3, 4)]
    assert_same_tensors(straight / "checkpoint" / "step-4", tmp_path / "checkpoint" / "step-4")


def test_a_checkpoint_reshards_onto_tensor_parallel(folder, straight, tmp_path):
    shutil.copytree(straight / "checkpoint" / "step-2", tmp_path / "checkpoint" / "step-2")
    run = train(2, job(folder, "--parallelism.tensor_parallel_degree", "2", "--training.local_batch_size", "8"),
                dump=tmp_path)
    want = [losses_by_step(straight)[s] for s in (3, 4)]
    assert [r["step"] for r in run.metrics] == [3, 4]
    assert all(abs(a - b) <= 1e-5 * b for a, b in zip(run.losses, want)), (run.losses, want)


def test_export_is_a_folder_transformers_loads_with_equal_logits(folder, straight, tmp_path):
    convert(str(straight / "checkpoint" / "step-4"), str(tmp_path / "hf"), "dcp", "hf")
    exported = json.loads((tmp_path / "hf" / "config.json").read_text())
    original = json.loads((folder / "config.json").read_text())
    assert {k: v for k, v in original.items() if exported.get(k) != v} == {"transformers_version":
                                                                            original["transformers_version"]}
    ref = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    spec = get_model_spec("transformers")
    model = spec.build(spec.from_hf_config(str(folder), ()))
    model.load_state_dict(load_tensors(straight / "checkpoint" / "step-4", "model."))
    assert ref.lm_head.weight is ref.model.embed_tokens.weight
    tokens = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(0))
    want, got = ref(input_ids=tokens).logits, model(tokens)
    assert ((got - want).abs().max() / want.abs().max()).item() <= 1e-6
    assert not torch.equal(ref.lm_head.weight, AutoModelForCausalLM.from_pretrained(folder).lm_head.weight)


def test_a_checkpoint_of_another_transformers_config_is_refused(folder, straight, tmp_path):
    """Every key of the saved transformers config that changes what the model computes is
    compared on resume, before launch: another activation, norm epsilon or RoPE scaling is
    refused naming the model.hf_overrides key with both values; use_cache changes nothing and may
    differ."""
    shutil.copytree(straight / "checkpoint" / "step-2", tmp_path / "checkpoint" / "step-2")
    step2 = tmp_path / "checkpoint" / "step-2"
    linear = '{"rope_type": "linear", "factor": 8.0, "rope_theta": 10000.0}'
    (tmp_path / "rope.toml").write_text(f"[model]\nhf_overrides = ['rope_parameters={linear}']\n")  # commas: TOML
    # rms_norm_eps: the key the user sets, not titanlite's ModelArgs.norm_eps made of it
    for override, key, saved, now in ((["--model.hf_overrides", "hidden_act=gelu"], "hidden_act", "'silu'", "'gelu'"),
                                      (["--model.hf_overrides", "rms_norm_eps=1e-5"], "rms_norm_eps", "1e-06", "1e-05"),
                                      (["--config", str(tmp_path / "rope.toml")], "rope_parameters",
                                       "{'rope_theta': 10000.0, 'rope_type': 'default'}",
                                       "{'factor': 8.0, 'rope_theta': 10000.0, 'rope_type': 'linear'}")):
        cfg, _ = config_load.load([*override, *job(folder), "--job.dump_folder", str(tmp_path)])
        with pytest.raises(ConfigError, match=re.escape(f"{step2} holds a checkpoint of model 'transformers' with "
                                                        f"model.hf_overrides {key} {saved}, but this run has {now}")):
            preflight(cfg, 2)
    preflight(config_load.load([*job(folder, "--model.hf_overrides", "use_cache=false"), "--job.dump_folder",
                                str(tmp_path)])[0], 2)


def test_a_moe_trains_with_transformers_load_balancing_loss(tmp_path):
    """A Qwen3-MoE folder as published configs ship it (router logits off, router_aux_loss_coef
    0.001), trained with model.hf_overrides output_router_logits=true,router_aux_loss_coef=0.5 on
    FSDP 2: step 1's loss plus its logged moe_aux_loss is transformers' own loss with router logits
    on the global batch (the loads counted over both ranks' rows, as transformers counts them)."""
    from safetensors.torch import save_file

    from titanlite.models.transformers import DEBUG, TINY as SIZES

    config = AutoConfig.for_model("qwen3_moe", **{**SIZES, **DEBUG["qwen3_moe"], "output_router_logits": True,
                                                  "router_aux_loss_coef": 0.5})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    AutoConfig.for_model("qwen3_moe", **{**SIZES, **DEBUG["qwen3_moe"]}).save_pretrained(tmp_path / "hf")
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, tmp_path / "hf" / "model.safetensors")
    run = train(2, [*TINY, "--model.name", "transformers", "--model.hf_config", str(tmp_path / "hf"),
                    "--training.steps", "1", "--training.local_batch_size", "4", "--checkpoint.initial_load_path",
                    str(tmp_path / "hf"), "--checkpoint.initial_load_format", "hf", "--model.hf_overrides",
                    "output_router_logits=true,router_aux_loss_coef=0.5"], dump=tmp_path / "run")
    loader = build_dataloader(Data(holdout_fraction=0.0), build_tokenizer("byte"), seq_len=64, global_batch_size=8,
                              local_batch_size=8, dp_rank=0, dp_degree=1)
    batch = next(iter(loader))
    want = model(input_ids=batch["input_ids"], labels=batch["input_ids"], shift_labels=batch["labels"].contiguous(),
                 output_router_logits=True)
    row = run.metrics[0]
    # to 1e-6, as every first-step loss: counted on each rank's rows alone, the term is 4e-5 off
    assert abs(row["moe_aux_loss"] - 0.5 * want.aux_loss.item()) <= 1e-6 * want.aux_loss.item(), (row, want.aux_loss)
    assert abs(row["loss"] + row["moe_aux_loss"] - want.loss.item()) <= 1e-6 * want.loss.item(), (row, want.loss)
