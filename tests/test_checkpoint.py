"""Checkpointing through the real trainer: exact resume, atomic saves, resharding, seed and export.

Jobs keep the LR constant after warm-up (decay_ratio 0), so a 10-step job follows the same
schedule as the first half of a 20-step one and "train 10, exit, train 10 more" is the
same job as "train 20". Every layout uses the same global batch of 8 samples.
"""

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch
from harness import BUILTIN_EVAL, TINY, assert_parity, launch, train

from titanlite.config import load as config_load
from titanlite.checkpoint.dcp import check_saved_model, model_shapes
from titanlite.checkpoint.folder import load_tensors, read_info, read_metadata
from titanlite.checkpoint.state import DataState, OptimizerState, SchedulerState
from titanlite.config.data import Data
from titanlite.errors import ConfigError
from titanlite.data.loader import build_dataloader
from titanlite.data.tokenizer import build_tokenizer
from titanlite.model_spec import get_model_spec
from titanlite.optim import build_optimizers, lr_factor
from titanlite.preflight import preflight

BASE = [*TINY, "--training.global_batch_size", "8", "--lr_scheduler.decay_ratio", "0",
        "--checkpoint.enable", "--checkpoint.interval", "10"]
HOOKS = "tests.ckpt_hooks"


def job(nproc: int, steps: int, *extra: str) -> list[str]:
    return [*BASE, "--training.local_batch_size", str(8 // nproc), "--training.steps", str(steps), *extra]


def hooked(nproc: int, args: list[str], dump: Path, hook: str):
    return train(nproc, args, dump=dump, env={"TITANLITE_TEST_HOOK": hook}, module=HOOKS)


def assert_same_tensors(a: Path, b: Path, prefix: str = "", rng: bool = True) -> None:
    """`rng` False: the generators aside (each rank's, keyed by the layout: another layout's differ)."""
    x, y = load_tensors(a, prefix), load_tensors(b, prefix)
    if not rng:
        x, y = ({k: v for k, v in t.items() if not k.startswith("rng.")} for t in (x, y))
    assert x.keys() == y.keys(), sorted(set(x) ^ set(y))
    different = [k for k in x if not torch.equal(x[k], y[k])]
    assert not different, f"{a} vs {b} differ in {different[:5]}"
    assert any(k.startswith("optimizer.state") for k in x) or prefix == "model."


def losses_by_step(dump: Path) -> dict[int, float]:
    """The last logged loss of each step (a resumed run logs after the killed one)."""
    rows = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows}


@pytest.fixture(scope="module")
def straight1(tmp_path_factory):
    dump = tmp_path_factory.mktemp("straight1")
    train(1, job(1, 20, "--checkpoint.export_dtype", "bfloat16"), dump=dump)
    return dump


@pytest.fixture(scope="module")
def straight2(tmp_path_factory):
    dump = tmp_path_factory.mktemp("straight2")
    train(2, job(2, 20), dump=dump)
    return dump


@pytest.fixture(scope="module")
def async2(tmp_path_factory):
    """2 ranks, async saves: 10 steps, exit, then 10 more."""
    dump = tmp_path_factory.mktemp("async2")
    train(2, job(2, 10, "--checkpoint.async_mode", "async"), dump=dump)
    second = train(2, job(2, 20, "--checkpoint.async_mode", "async"), dump=dump)
    assert "resumed from" in second.output
    return dump


def test_resume_is_bitwise_on_one_rank(straight1, tmp_path):
    # [eval] after steps 5, 10 (the save's step), 15 and 20: a resume across evaluations
    train(1, job(1, 10, *BUILTIN_EVAL), dump=tmp_path)
    assert (tmp_path / "checkpoint" / "step-10").is_dir()
    second = train(1, job(1, 20, *BUILTIN_EVAL), dump=tmp_path)
    assert "resumed from" in second.output and [r["step"] for r in second.metrics] == list(range(1, 21))
    assert [r.get("begins") for r in second.metrics if "begins" in r] == ["start", "resume after step 10"]
    assert second.losses == train_losses(straight1)
    assert_same_tensors(straight1 / "checkpoint" / "step-20", tmp_path / "checkpoint" / "step-20")


def train_losses(dump: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (dump / "metrics.jsonl").read_text().splitlines()]


def test_async_resume_is_bitwise_on_two_ranks(straight2, async2):
    assert train_losses(async2) == train_losses(straight2)
    for step in (10, 20):
        assert_same_tensors(straight2 / "checkpoint" / f"step-{step}", async2 / "checkpoint" / f"step-{step}")


@pytest.mark.parametrize("layout", ["fsdp4", "one_process", "tp2"])
def test_reshard_loads_identical_state_and_continues_the_stream(layout, straight2, async2, tmp_path):
    """A 2-rank FSDP checkpoint (step 10) loads on another layout: what was loaded, saved
    again, is tensor-for-tensor the original, and steps 11-20 match the uninterrupted run."""
    # one_process also finds the newer step-20 and must still obey load_step (then re-save step 20)
    nproc, extra = {"fsdp4": (4, []), "one_process": (1, ["--checkpoint.load_step", "10"]),
                    "tp2": (2, ["--parallelism.tensor_parallel_degree", "2", "--training.local_batch_size", "8"])}[layout]
    shutil.copytree(async2 / "checkpoint" / "step-10", tmp_path / "checkpoint" / "step-10")
    if layout == "one_process":
        shutil.copytree(async2 / "checkpoint" / "step-20", tmp_path / "checkpoint" / "step-20")
    run = hooked(nproc, job(nproc, 20, *extra), tmp_path, "resave")
    assert_same_tensors(async2 / "checkpoint" / "step-10", tmp_path / "checkpoint-resaved" / "step-10", rng=False)
    now = {"fsdp4": "dps4_cp1_tp1", "one_process": "dps1_cp1_tp1", "tp2": "dps1_cp1_tp2"}[layout]
    assert (f"saved on another layout (pp1_dpr1_dps2_cp1_tp1_ep1; this run: pp1_dpr1_{now}_ep1): each rank's "
            "random generators restart from training.seed") in run.output
    assert [r["step"] for r in run.metrics] == list(range(11, 21))
    assert_parity(train_losses(straight2)[10:], run.losses)


def test_kill_during_save_keeps_the_previous_checkpoint(straight1, tmp_path):
    ckpt = tmp_path / "checkpoint"
    killed = launch(1, job(1, 10, "--checkpoint.interval", "5"), dump=tmp_path,
                    env={"TITANLITE_TEST_HOOK": "kill_at_step=10"}, module=HOOKS)
    assert killed.returncode != 0 and not (tmp_path / "status" / "rank-0.done").exists()
    assert (ckpt / "step-5").is_dir() and (ckpt / "step-10.tmp").is_dir() and not (ckpt / "step-10").exists()
    assert any((ckpt / "step-10.tmp").glob("*.distcp"))  # the kill came mid-save, after data was written
    # a newer folder that is no checkpoint at all must be skipped too
    (ckpt / "step-7").mkdir()
    (ckpt / "step-7" / ".metadata").write_bytes(b"not a checkpoint")
    resumed = train(1, job(1, 20, "--checkpoint.interval", "5", "--checkpoint.keep_latest_k", "2"), dump=tmp_path)
    assert "removing" in resumed.output and "step-10.tmp" in resumed.output
    assert "skipping checkpoint" in resumed.output and "step-7" in resumed.output
    assert "resumed from" in resumed.output and "step-5 " in resumed.output
    ref = train_losses(straight1)
    got = losses_by_step(tmp_path)
    assert [got[s] for s in range(6, 21)] == ref[5:]
    assert_same_tensors(straight1 / "checkpoint" / "step-20", ckpt / "step-20")
    # keep_latest_k 2: the newest two, exactly (the step it resumed from, and the bogus folder, gone)
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-15", "step-20"]


def test_export_writes_bf16_model_only(straight1):
    export = straight1 / "checkpoint" / "export-step-20"
    info = json.loads((export / "titanlite.json").read_text())
    assert info["model_only"] and info["dtype"] == "bfloat16"
    got, full = load_tensors(export, ""), load_tensors(straight1 / "checkpoint" / "step-20", "model.")
    assert all(k.startswith("model.") for k in got)
    assert {k[6:] for k in got} == set(full)
    assert all(got["model." + k].dtype == torch.bfloat16 and torch.equal(got["model." + k], v.bfloat16())
               for k, v in full.items())


def test_seed_checkpoint_gives_the_same_weights_on_any_layout(straight2, tmp_path):
    seed_run = launch(1, job(1, 10, "--checkpoint.create_seed_checkpoint", "--training.seed", "1"), dump=tmp_path)
    seed = tmp_path / "checkpoint" / "step-0"
    assert seed.is_dir(), seed_run.output[-3000:]
    assert json.loads((seed / "titanlite.json").read_text())["model_only"]
    assert not any(k.startswith("optimizer") for k in load_tensors(seed, ""))
    run = hooked(2, job(2, 10), tmp_path, "resave")  # training.seed 0: weights must come from the seed
    assert "initial weights from" in run.output
    assert_same_tensors(seed, tmp_path / "checkpoint-resaved" / "step-0", "model.")
    assert run.losses[0] != train_losses(straight2)[0]  # seed 1 weights differ from seed 0's


def test_shape_mismatch_is_one_clear_error(straight1, tmp_path):
    shutil.copytree(straight1 / "checkpoint" / "step-10", tmp_path / "checkpoint" / "step-10")
    run = launch(1, job(1, 20, "--model.vocab_size", "1024"), dump=tmp_path)
    assert run.returncode != 0
    assert "titanlite: error:" in run.output and "'tok_embeddings.weight' has shape (512, 256)" in run.output
    assert "model's is (1024, 256)" in run.output
    assert "titanlite/checkpoint/dcp.py" not in run.output  # one line, no traceback from our code


def test_checkpoint_problems_are_found_before_launch(straight1, tmp_path):
    shutil.copytree(straight1 / "checkpoint" / "step-10", tmp_path / "checkpoint" / "step-10")
    dump = ["--job.dump_folder", str(tmp_path)]
    for extra, match in [(["--model.vocab_size", "1024"], r"'tok_embeddings.weight' has shape \(512, 256\)"),
                         (["--checkpoint.load_step", "20"], r"load_step 20: no complete checkpoint .* complete ones: \[10\]")]:
        cfg, _ = config_load.load([*job(1, 20, *extra), *dump])
        with pytest.raises(ConfigError, match=match):
            preflight(cfg, 1)
    cfg, _ = config_load.load([*job(1, 20, "--checkpoint.enable", "false", "--model.vocab_size", "1024"), *dump,
                               "--checkpoint.initial_load_path", str(straight1 / "checkpoint" / "step-10")])
    with pytest.raises(ConfigError, match="model's is \\(1024, 256\\)"):
        preflight(cfg, 1)
    preflight(config_load.load([*job(1, 20), *dump])[0], 1)  # the matching model resumes


def test_another_models_checkpoint_is_refused_before_launch(straight1, tmp_path, fork):
    """A llama3 checkpoint never loads into a fork with the very same parameters (nor another
    flavor, nor a model lacking any saved weight): resumed, by load_step or as initial weights."""
    step10 = straight1 / "checkpoint" / "step-10"
    shutil.copytree(step10, tmp_path / "checkpoint" / "step-10")
    dump = ["--job.dump_folder", str(tmp_path)]
    fork("my_llama", "my_llama")
    refused = "{} holds a checkpoint of model 'llama3', not of 'my_llama' \\(model.name\\)"
    for extra in ([], ["--checkpoint.load_step", "10"]):
        cfg, _ = config_load.load([*job(1, 20, "--model.name", "my_llama", *extra), *dump])
        with pytest.raises(ConfigError, match=refused.format(tmp_path / "checkpoint" / "step-10")):
            preflight(cfg, 1)
    cfg, _ = config_load.load([*job(1, 20, "--model.name", "my_llama", "--checkpoint.enable", "false"), *dump,
                               "--checkpoint.initial_load_path", str(step10)])
    with pytest.raises(ConfigError, match=refused.format(step10)):
        preflight(cfg, 1)
    # the same family, another flavor with the same shapes (tied embeddings)
    cfg, _ = config_load.load([*job(1, 20, "--model.flavor", "debugmodel_tied"), *dump])
    with pytest.raises(ConfigError, match=r"with tie_embeddings=False, but this run's llama3 flavor has tie_embeddings=True"):
        preflight(cfg, 1)
    # a saved weight the running model lacks (check_shapes alone looks only the other way)
    spec, args = get_model_spec("llama3"), preflight(config_load.load([*job(1, 20), *dump])[0], 1).args
    fewer = {k: v for k, v in model_shapes(spec, args).items() if k != "layers.3.ffn_norm.weight"}
    with pytest.raises(ConfigError, match=r"with 'layers.3.ffn_norm.weight', which this run's llama3 lacks"):
        check_saved_model(step10, read_info(step10), read_metadata(step10), spec, args, fewer, fewer)
    # a fork whose SPEC keeps the name of the family it copied is refused by the registry
    fork("my_llama_misnamed", "llama3")
    with pytest.raises(ConfigError, match=r"models/my_llama_misnamed/__init__.py: SPEC.name is 'llama3' but its "
                                          r"folder is 'my_llama_misnamed'; set ModelSpec\(name=\"my_llama_misnamed\""):
        get_model_spec("my_llama_misnamed")


def test_fine_tuning_starts_from_a_full_runs_weights_only(straight1, tmp_path):
    """Supervised fine-tuning (chats, their own tokenizer) from a pre-training run's step-20, a full
    checkpoint: its weights load exactly, and nothing else does (the optimizer's moments start at
    zero, the schedule at its first warm-up step, the data at its first sample). The run's folder
    of checkpoints is refused, naming them, rather than one picked."""
    step20 = straight1 / "checkpoint" / "step-20"
    chat = ["--data.format", "chat", "--data.tokenizer", "byte_chat", "--data.document_mask", "true",
            "--training.seq_len", "128", "--training.local_batch_size", "2", "--training.global_batch_size", "2"]
    cfg, _ = config_load.load([*job(1, 3, *chat), "--job.dump_folder", str(tmp_path),
                               "--checkpoint.initial_load_path", str(step20.parent)])
    with pytest.raises(ConfigError, match=r"holds the checkpoints step-10, step-20, not one checkpoint; name the "
                                          r"one to start from, e\.g\. .*/checkpoint/step-20$"):
        preflight(cfg, 1)
    run = hooked(1, [*job(1, 3, *chat), "--checkpoint.initial_load_path", str(step20)], tmp_path, "resave")
    assert f"initial weights from {step20} (dcp)" in run.output and "chat data:" in run.output
    resaved = tmp_path / "checkpoint-resaved" / "step-0"
    assert_same_tensors(step20, resaved, "model.")
    moments = {k: v for k, v in load_tensors(resaved, "optimizer.state.").items() if "exp_avg" in k}
    assert moments and all(not v.any() for v in moments.values())
    assert run.metrics[0]["lr"] == losses_rows(straight1)[0]["lr"]  # warm-up step 1, not step 21


def losses_rows(dump: Path) -> list[dict]:
    return [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]


def test_seed_checkpoint_needs_one_process():
    cfg, _ = config_load.load([*job(2, 10), "--checkpoint.create_seed_checkpoint"])
    with pytest.raises(ConfigError, match="create_seed_checkpoint runs on one process"):
        preflight(cfg, 2)


def test_data_cursor_refuses_what_cannot_be_remapped():
    loader = build_dataloader(Data(), build_tokenizer("byte"), seq_len=64, global_batch_size=8,
                              local_batch_size=4, dp_rank=0, dp_degree=2)
    saved = DataState(loader, Data(), 64, 8).state_dict()
    with pytest.raises(ConfigError, match="data order differs in seed"):
        DataState(loader, Data(seed=3), 64, 8).load_state_dict(saved)
    with pytest.raises(ConfigError, match="data order differs in seq_len"):
        DataState(loader, Data(), 32, 8).load_state_dict(saved)
    with pytest.raises(ConfigError, match="consumed 24 samples, not a multiple of training.global_batch_size 16"):
        DataState(loader, Data(), 64, 16).load_state_dict({**saved, "samples_seen": 24})
    # a data key added since a checkpoint was saved reads as its default there; another value refuses
    older = json.dumps({k: v for k, v in json.loads(saved["order"]).items() if k not in ("format", "train_on")})
    DataState(loader, Data(), 64, 8).load_state_dict({**saved, "order": older})
    with pytest.raises(ConfigError, match="data order differs in format"):
        DataState(loader, Data(format="chat"), 64, 8).load_state_dict({**saved, "order": older})
    # a different global batch that divides the samples seen maps exactly
    cursor = DataState(loader, Data(), 64, 16)
    cursor.load_state_dict({**saved, "samples_seen": 32})
    assert loader.batch_sampler.state_dict() == {"global_batch": 2, "micro_batch": 0}


def test_config_rejects_bad_checkpoint_fields():
    for args, match in [(["--checkpoint.async_mode", "sometimes"], "async_mode"),
                        (["--checkpoint.initial_load_format", "gguf"], "initial_load_format"),
                        (["--checkpoint.interval", "0"], "interval"),
                        (["--checkpoint.initial_load_path", "/nonexistent"], "initial_load_path"),
                        (["--checkpoint.export_dtype", "int8"], "export_dtype")]:
        with pytest.raises(ConfigError, match=match):
            config_load.load(args)


def test_streamed_run_resumes_exactly(tmp_path):
    """data.streaming resumes each dp rank at its saved position in its share of the stream:
    the resumed losses are the uninterrupted run's, bit for bit."""
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"document {i}: " + "lorem ipsum dolor sit amet " * (i % 7 + 1)})
                              + "\n" for i in range(400)))
    streamed = ["--data.path", str(corpus), "--data.streaming", "true"]
    straight = train(2, job(2, 12, *streamed), dump=tmp_path / "straight")
    train(2, job(2, 6, *streamed), dump=tmp_path / "resumed")
    second = train(2, job(2, 12, *streamed), dump=tmp_path / "resumed")
    assert "resumed from" in second.output
    assert second.losses[-6:] == straight.losses[-6:]


def test_a_resume_runs_the_config_s_schedule_and_optimizer_settings(straight1, tmp_path):
    """Resumed from step 10 (saved by a 20-step run at lr 8e-4) as a 20-step run with another lr,
    a decay and another weight decay: steps 11-20 run a fresh 20-step run's lrs, the line says what changed; a changed optimizer is refused as such, naming
    the route that keeps the weights; a checkpoint at training.steps says so and still exports."""
    shutil.copytree(straight1 / "checkpoint" / "step-10", tmp_path / "checkpoint" / "step-10")
    new = ["--optimizer.lr", "2e-3", "--lr_scheduler.decay_ratio", "0.5", "--optimizer.weight_decay", "0.5"]
    run = train(1, [*job(1, 20), *new], dump=tmp_path)
    cfg, _ = config_load.load([*job(1, 20), *new])
    lrs = [cfg.optimizer.lr * lr_factor(step, cfg.lr_scheduler, 20) for step in range(20)]  # LambdaLR's
    assert [r["lr"] for r in run.metrics] == lrs[10:] and lrs[10] != 8e-4
    assert (f"resumed from {tmp_path}/checkpoint/step-10 (5,120 tokens seen); step 11 runs at lr {lrs[10]:.2e} "
            "(the checkpoint's schedule: 8.00e-04); changed since the save: optimizer.lr 0.0008 -> 0.002, "
            "optimizer.weight_decay 0.1 -> 0.5, lr_scheduler.decay_ratio 0.0 -> 0.5, checkpoint.export_dtype "
            "'bfloat16' -> ''\n") in run.output, run.output
    muon = launch(1, [*job(1, 20), "--optimizer.name", "Muon", "--checkpoint.load_step", "10"], dump=tmp_path)
    assert muon.returncode == 2 and "titanlite/checkpoint" not in muon.output, muon.output
    assert (f"step-10 holds AdamW optimizer state for 'layers.0.attention.wq.weight', which this run trains with "
            "Muon, optimizer.name 'Muon' (saved with 'AdamW'): a changed optimizer cannot resume") in muon.output
    assert f"--checkpoint.initial_load_path {tmp_path}/checkpoint/step-10 (it loads the weights only)" in muon.output
    done = launch(1, [*job(1, 10), "--checkpoint.load_step", "10", "--checkpoint.export_dtype", "bfloat16"],
                  dump=tmp_path)
    assert done.returncode == 0 and ("the checkpoint of step 10 is at or past training.steps 10: nothing to train "
                                     "(raise training.steps to train on); writing export-step-10") in done.output
    weights, export = load_tensors(tmp_path / "checkpoint" / "step-10", "model."), \
        load_tensors(tmp_path / "checkpoint" / "export-step-10", "model.")
    assert weights.keys() == export.keys() and all(torch.equal(v.bfloat16(), export[k]) for k, v in weights.items())


def test_loaded_optimizer_state_keeps_the_moments_under_the_config_s_settings():
    """OptimizerState and SchedulerState loaded into optimizers built with other settings: each
    update is AdamW's with the new weight decay, betas and eps on the saved moments, at the new
    schedule's lr; a linear decay past its end holds its last value, never below zero."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    old_cfg, _ = config_load.load(["--optimizer.weight_decay", "0.1", "--lr_scheduler.warmup_steps", "1"])
    new_cfg, _ = config_load.load(["--optimizer.weight_decay", "5", "--optimizer.beta1", "0.5", "--optimizer.eps",
                                   "1e-3", "--optimizer.lr", "1e-2", "--lr_scheduler.warmup_steps", "1"])
    old = build_optimizers([model], old_cfg.optimizer, old_cfg.lr_scheduler, 4)
    for _ in range(3):
        model(torch.randn(2, 8)).square().sum().backward()
        old.step()
        old.step_schedule()
        old.zero_grad()
    saved = {"optimizer": OptimizerState(old, ()).state_dict(), "lr_scheduler": SchedulerState(old.schedulers).state_dict()}
    moments = copy.deepcopy(old.optimizers[0].state_dict())
    new = build_optimizers([model], new_cfg.optimizer, new_cfg.lr_scheduler, 8)
    OptimizerState(new, ()).load_state_dict(saved["optimizer"])
    SchedulerState(new.schedulers).load_state_dict(saved["lr_scheduler"])
    assert new.lr == 1e-2 * lr_factor(3, new_cfg.lr_scheduler, 8)
    ref_model = copy.deepcopy(model)
    ref = torch.optim.AdamW(ref_model.parameters(), foreach=True)
    ref.load_state_dict(moments)
    ref.param_groups[0].update(lr=new.lr, betas=(0.5, 0.95), eps=1e-3, weight_decay=5.0)
    x = torch.randn(2, 8)
    for m, opt in ((model, new), (ref_model, ref)):
        m(x).square().sum().backward()
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref_model.parameters()))
    cfg = new_cfg.lr_scheduler
    assert [lr_factor(s, cfg, 4) for s in (3, 4, 9)] == [cfg.min_lr_factor] * 3
