"""The recipes of docs/recipes.md: z-loss, batch-size and sequence-length warm-up, checkpoint merging."""

from __future__ import annotations

import ctypes
import dataclasses
import json
import os
import random
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from harness import TINY, train

import titanlite
from titanlite.checkpoint.folder import load_tensors, write_model_checkpoint
from titanlite.checkpoint.state import DataState, SkippedSamples
from titanlite.config.data import Data
from titanlite.config.job import Compile, Training
from titanlite.data import schedule as data_schedule
from titanlite.data.loader import build_dataloader
from titanlite.data.schedule import DataSchedule
from titanlite.data.tokenizer import ByteTokenizer
from titanlite.loss import IGNORE_INDEX, Z_LOSS, ExtraLosses, build_loss_fn, cross_entropy_sum
from titanlite.tools import merge

BYTE = ByteTokenizer()


def _dense_reference(logits: torch.Tensor, labels: torch.Tensor, z: float) -> tuple[float, float, torch.Tensor]:
    """(cross-entropy sum, z-loss sum, gradient of (both) / targets), written out densely in fp32."""
    x = logits.clone().requires_grad_()
    mask = labels != IGNORE_INDEX
    ce = F.cross_entropy(x.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")
    z_sum = z * torch.logsumexp(x, -1)[mask].square().sum()
    ((ce + z_sum) / mask.sum()).backward()
    return ce.item(), z_sum.item(), x.grad


@pytest.mark.parametrize("chunk_bytes", [1 << 28, 4 * 96 * 10], ids=["whole", "chunks_of_10"])
def test_z_loss_value_and_gradient_equal_a_dense_reference(monkeypatch, chunk_bytes):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 48, 96, generator=gen) * 4 + 3  # logsumexp far from 0
    labels = torch.randint(0, 96, (2, 48), generator=gen)
    labels[0, :5] = labels[1, 40:] = IGNORE_INDEX  # not targets: no z-loss either
    z = 1e-2
    ref_ce, ref_z, ref_grad = _dense_reference(logits, labels, z)
    monkeypatch.setattr("titanlite.loss.CHUNK_BYTES", chunk_bytes)
    loss_fn = build_loss_fn(Compile(), loss_parallel=False, z_loss=z)
    x = logits.clone().requires_grad_()
    n = (labels != IGNORE_INDEX).sum()
    extra = ExtraLosses()
    with extra.collect(n) as sums:
        ce = loss_fn(x, labels, extra)
        (ce / n).backward()
    assert ce.item() == pytest.approx(ref_ce, rel=1e-6)  # the loss logged: the cross-entropy alone
    assert sums[Z_LOSS].item() == pytest.approx(ref_z, rel=1e-6)
    torch.testing.assert_close(x.grad, ref_grad, rtol=1e-6, atol=1e-9)
    # outside a training step (validation) the cross-entropy, as without z-loss
    with torch.no_grad():
        assert loss_fn(logits, labels).item() == cross_entropy_sum(logits, labels).item()


def test_z_loss_off_is_the_plain_loss():
    # nothing on the path when off: the very function every run used before
    assert build_loss_fn(Compile(), loss_parallel=False, z_loss=0.0) is cross_entropy_sum


# -- batch-size and sequence-length warm-up: the data ------------------------------------------

def _corpus(path: Path, words: tuple[int, int] = (3, 40)) -> Path:
    rng = random.Random(0)
    with open(path, "w") as f:
        for i in range(300):  # random numbers: no two windows of a few tokens coincide
            f.write(json.dumps({"text": " ".join(str(rng.randrange(10**6)) for _ in range(rng.randint(*words)))}) + "\n")
    return path


def _schedule(dp: int, steps: int = 12, **warmup) -> DataSchedule:
    t = Training(steps=steps, seq_len=64, local_batch_size=2, **warmup)
    return data_schedule.build(t, global_batch_size=8, dp=dp)


def _read(path: Path, schedule: DataSchedule, dp: int, steps: range, skip: str = "", loaders=None):
    """Each step's rows over all dp ranks, in order: (input_ids, labels) rows and each micro-batch's
    shape; `loaders`: the ranks' loaders to go on with."""
    loaders = loaders or [iter(build_dataloader(Data(path=str(path), document_mask=True, skip_samples=skip), BYTE,
                                                seq_len=64, global_batch_size=8, local_batch_size=2, dp_rank=r,
                                                dp_degree=dp, schedule=schedule)) for r in range(dp)]
    rows, shapes = [], []
    for step in steps:
        for it in loaders:
            for _ in range(schedule.phase(step).micro_batches):
                b = next(it)
                shapes.append((step, *b["input_ids"].shape))
                rows += list(zip(b["input_ids"], b["labels"]))
    return rows, shapes, loaders


@pytest.mark.parametrize("constant_tokens", [True, False], ids=["constant_tokens", "constant_rows"])
def test_warmup_reads_in_order_what_the_final_batch_size_reads(tmp_path, constant_tokens):
    """Batch warm-up to 8 and sequence 16 -> 32 -> 64 on 2 dp ranks: the target tokens of the run,
    in order, are those of a run at batch 8 x 64 from the first sample (none lost, none twice).
    The accumulation grows with the batch (below 2 ranks x local batch 2, the local batch); a
    shorter sequence keeps a micro-batch's tokens, or its rows (and a step reads fewer samples)."""
    path = _corpus(tmp_path / "docs.jsonl")
    warm = _schedule(2, batch_warmup=["2:3", "4:6"] if constant_tokens else ["4:3"], seq_warmup=["16:2", "32:5"],
                     seq_warmup_constant_tokens=constant_tokens)
    rows, shapes, _ = _read(path, warm, 2, range(1, 13))
    n = warm.samples_before(13)
    ref, _, _ = _read(path, _schedule(1), 1, range(1, n // 8 + 2))  # batch 8 x 64 from the first sample
    got, want = torch.cat([y for _, y in rows]), torch.cat([y for _, y in ref])
    assert len(got) == n * 64 and torch.equal(got, want[:n * 64])
    samples = build_dataloader(Data(path=str(path)), BYTE, seq_len=64, global_batch_size=8, local_batch_size=2,
                               dp_rank=0, dp_degree=1).dataset
    assert torch.equal(got, torch.cat([samples[g]["labels"] for g in range(n)]))  # samples 0 .. n - 1, in order
    # (rows, length) of each micro-batch of rank 0, then of rank 1
    per_step = {s: [(r, l) for t, r, l in shapes if t == s] for s in (1, 3, 4, 6, 7)}
    if constant_tokens:  # batch 2 (one micro-batch of 1 sample per rank), 4, then 8 (two)
        assert per_step == {1: [(4, 16)] * 2, 3: [(2, 32)] * 2, 4: [(4, 32)] * 2, 6: [(2, 64)] * 2,
                            7: [(2, 64)] * 4}
    else:  # batch 4 rows, then 8 (two micro-batches per rank): 2 rows of any length
        assert per_step == {1: [(2, 16)] * 2, 3: [(2, 32)] * 2, 4: [(2, 32)] * 4, 6: [(2, 64)] * 4,
                            7: [(2, 64)] * 4}


def test_sqrt_lr_rescale_follows_the_batch():
    """With batch_warmup_sqrt_lr the learning rate is optimizer.lr x sqrt(batch / final batch): x2
    the batch, x sqrt(2) the rate (here on a constant schedule, no warm-up, no decay)."""
    from titanlite.config.job import LRScheduler, Optimizer
    from titanlite.optim import build_optimizers

    schedule = _schedule(1, batch_warmup=["2:3", "4:6"], batch_warmup_sqrt_lr=True)
    opt = build_optimizers([torch.nn.Linear(2, 2)], Optimizer(lr=1e-3), LRScheduler(warmup_steps=0, decay_ratio=0),
                           12, lr_scale=schedule.lr_scale)
    lrs = []
    for _ in range(8):
        lrs.append(opt.lr)
        opt.step()
        opt.step_schedule()
    assert lrs == pytest.approx([1e-3 * 0.5] * 3 + [1e-3 * 0.5 ** 0.5] * 3 + [1e-3] * 2, rel=1e-12)
    assert _schedule(1, batch_warmup=["2:3"]).lr_scale is None  # off unless asked


def test_rollback_across_a_batch_size_change_skips_exactly_the_spiking_steps(tmp_path):
    """Steps 5-7 spike (batch 4, then 8 from step 7): the run goes back to its step-4 checkpoint with
    those steps' samples skipped (train.roll_back's arithmetic), restored as a checkpoint restores
    them. Every sample is read once, in order, but those: none lost, none twice."""
    path = _corpus(tmp_path / "docs.jsonl")
    warm = _schedule(1, batch_warmup=["2:3", "4:6"])
    before, _, loaders = _read(path, warm, 1, range(1, 8))
    data = Data(path=str(path), document_mask=True)
    loader = build_dataloader(data, BYTE, seq_len=64, global_batch_size=8, local_batch_size=2, dp_rank=0,
                              dp_degree=1, schedule=warm)
    start, end = loader.batch_sampler.sample_range(5, 7)
    assert (start, end) == (warm.samples_before(5), warm.samples_before(8)) == (10, 26)
    state = DataState(loader, data, 64, 8)
    state.load_state_dict({**state.state_dict(), "samples_seen": warm.samples_before(5)})  # back to step 4
    SkippedSamples(loader).add(start, end)
    after, _, _ = _read(path, warm, 1, range(5, 13), loaders=[iter(loader)])
    samples = loader.dataset
    read = [y for _, y in before[:10] + after]  # steps 1-4 (samples 0-9), then the steps after the rollback
    assert len(after) == 2 * 4 + 6 * 8
    assert torch.equal(torch.cat(read), torch.cat([samples[g]["labels"] for g in [*range(10), *range(26, 26 + 56)]]))


def test_a_shorter_sequence_of_packed_documents_equals_its_documents_unpacked(tmp_path):
    """A warm-up's row (a piece of 32 tokens of a sample of 128) with document masking: its tokens
    are the sample's, its documents numbered from 0 and its positions from 0 at each document (and
    at the row's start), so the model's logits equal those of each document run alone. A packed
    chat sample cuts its rows with row_of, which gives the same rows."""
    from titanlite.data.order import row_of
    from titanlite.layers.attention import AttnContext
    from titanlite.models.llama3 import Transformer, flavors

    path = _corpus(tmp_path / "docs.jsonl", words=(1, 4))  # documents of 9-30 tokens
    data = build_dataloader(Data(path=str(path), document_mask=True), BYTE, seq_len=128, global_batch_size=1,
                            local_batch_size=1, dp_rank=0, dp_degree=1).dataset
    args = dataclasses.replace(flavors["debugmodel"], max_seq_len=32)
    model = Transformer(args)
    model.init_weights(0)
    whole, docs = data[5], 0
    for k in range(4):
        row = data[(5, 32, k)]
        cut = row_of(whole, 32, k)  # how a packed chat sample cuts its rows: the same
        assert row.keys() == cut.keys() and all(torch.equal(row[key], cut[key]) for key in row)
        assert torch.equal(row["input_ids"], whole["input_ids"][32 * k:32 * (k + 1)])
        assert torch.equal(row["labels"], whole["labels"][32 * k:32 * (k + 1)])
        ids, pos = row["document_ids"], row["positions"]
        bounds = [0, *[i for i in range(1, 32) if ids[i] != ids[i - 1]], 32]
        docs += len(bounds) - 1
        for a, b in zip(bounds, bounds[1:]):
            assert pos[a:b].tolist() == list(range(b - a))
        with torch.no_grad():
            packed = model(row["input_ids"][None], AttnContext(pos[None], ids[None]))
            alone = torch.cat([model(row["input_ids"][None, a:b]) for a, b in zip(bounds, bounds[1:])], dim=1)
        torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-5)
    assert docs >= 8  # rows that hold several documents, one begun in the row before


def test_a_warmup_compiles_each_block_twice_not_once_per_shape(monkeypatch):
    """Compiled blocks (compile.enable) through a warm-up's micro-batch shapes, 16 x 16 -> 8 x 32 ->
    4 x 64 (constant tokens), forward and backward: Dynamo compiles the block once for the first
    shape and once more, with the batch and sequence dimensions dynamic, at the first change
    (automatic dynamic shapes); no later change compiles again. Counted with a backend that runs
    the traced graph as it is (the count is Dynamo's, whichever backend)."""
    import torch._dynamo

    from titanlite.layers.attention import AttnSetup
    from titanlite.models.llama3 import Transformer, flavors
    from titanlite.parallel.apply import apply_compile

    graphs = []

    def counting(gm: torch.fx.GraphModule, inputs: list) -> Callable:
        graphs.append(gm)
        return gm.forward

    compile_module = torch.nn.Module.compile
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **kw: compile_module(self, backend=counting, **kw))
    torch._dynamo.reset()
    model = Transformer(dataclasses.replace(flavors["debugmodel"], max_seq_len=64))
    model.init_weights(0)
    apply_compile(list(model.layers.values()))
    for rows, length in ((16, 16), (8, 32), (4, 64), (2, 64)):
        ctx = AttnSetup().context(None, None, seq_len=length, device=torch.device("cpu"))  # as PlainStep makes it
        model(torch.randint(0, 512, (rows, length)), ctx).sum().backward()
    assert len(graphs) == 2
    torch._dynamo.reset()


BAD = [
    (["--training.z_loss", "-1e-5"], 1, "training.z_loss must be >= 0, got -1e-05"),
    (["--training.batch_warmup", "4:5,2:8"], 1, "training.batch_warmup: '4:5' then '2:8' is not increasing"),
    (["--training.batch_warmup", "4:5,8:3"], 1, "training.batch_warmup: '4:5' then '8:3' is not increasing"),
    (["--training.batch_warmup", "4-5"], 1, "training.batch_warmup: bad entry '4-5'; expected VALUE:UNTIL"),
    (["--training.batch_warmup", "3:5"], 1, "training.batch_warmup: size 3 is not below training.global_batch_size 8 "
                                            "as a whole factor of it"),
    (["--training.batch_warmup", "4:10"], 1, "a phase lasts until step 10, not before training.steps 10"),
    (["--training.batch_warmup", "4:100000", "--training.warmup_unit", "tokens"], 1,
     "the warm-up lasts until after training.steps 10"),
    (["--training.batch_warmup", "1:5"], 2, "training.batch_warmup: size 1 does not divide over 2 data-parallel "
                                            "rank(s) x local_batch_size 4"),
    (["--training.seq_warmup", "24:5"], 1, "training.seq_warmup: length 24 is not below training.seq_len 64 as a "
                                           "whole factor of it"),
    (["--training.seq_warmup", "2:5", "--parallelism.context_parallel_degree", "2"], 2,
     "training.seq_warmup: length 2 does not split over context and sequence parallelism (a multiple of 4"),
    (["--training.seq_warmup", "32:5", "--parallelism.pipeline_parallel_degree", "2",
      "--parallelism.pipeline_parallel_microbatch_size", "2"], 2, "training.seq_warmup with "
                                                                 "parallelism.pipeline_parallel_degree > 1"),
    (["--training.batch_warmup", "4:5", "--parallelism.pipeline_parallel_degree", "2",
      "--training.local_batch_size", "8", "--parallelism.pipeline_parallel_microbatch_size", "4",
      "--training.global_batch_size", "16"], 2, "size 4 is below 1 data-parallel rank(s) x local_batch_size 8"),
    (["--training.seq_warmup", "16:5", "--training.seq_warmup_constant_tokens", "false",
      "--training.batch_warmup", "2:3"], 1, "training.seq_warmup: 2 rows of 16 tokens (seq_warmup_constant_tokens "
                                            "false) hold 0.5 samples of training.seq_len 64, not a whole number"),
    (["--checkpoint.merge_last", "6", "--checkpoint.enable", "--checkpoint.interval", "5"], 1,
     "checkpoint.merge_last 6: need 0 (off) or 1 .. checkpoint.interval (5)"),
    (["--checkpoint.merge_last", "2"], 1, "and checkpoint.enable = true"),
]


@pytest.mark.parametrize("args,world,says", BAD, ids=[f"{i}" for i in range(len(BAD))])
def test_bad_recipe_input_is_one_line_before_launch(tmp_path, args, world, says):
    """Each refused before any process group (run_train.sh's checks), naming the key."""
    from titanlite.config import load as config_load
    from titanlite.errors import ConfigError
    from titanlite.preflight import make_plan

    with pytest.raises(ConfigError) as e:
        cfg, _ = config_load.load([*TINY, "--training.global_batch_size", "8", "--job.dump_folder", str(tmp_path),
                                   *args])
        make_plan(cfg, world)
    assert says in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_warmup_with_replica_groups_is_exact_or_refused():
    """A quorum of 2 replica groups splits batch 4 over 2 groups x local batch 2, not batch 2."""
    from titanlite.config.job import FaultTolerance
    from titanlite.errors import ConfigError
    from titanlite.runtime.replicas import check_split

    f = FaultTolerance(enable=True, group_size=2)
    check_split(f, _schedule(1, batch_warmup=["4:3"]), 1)
    with pytest.raises(ConfigError, match="training.batch_warmup: steps 1-3 read 2 rows, which do not split over a "
                                          "quorum of 2 replica groups x 1 data-parallel ranks x 2 rows"):
        check_split(f, _schedule(1, batch_warmup=["2:3"]), 1)


def test_the_dry_run_plans_a_warmup_at_its_largest_batch_and_times_each_phase(tmp_path, capsys):
    """Batch 4 -> 16 and sequence 32 -> 64 on 2 ranks: the report's memory is the last phase's, the
    largest; the earlier phase is traced for its step time."""
    from titanlite.dryrun.run import main

    main(["--config", "debug_model.toml", "--ngpu", "2", "--training.seq_len", "64", "--training.local_batch_size",
          "4", "--training.global_batch_size", "16", "--training.steps", "100", "--training.batch_warmup", "4:10",
          "--training.seq_warmup", "32:10", "--out", str(tmp_path / "r.json")])
    rep = json.loads((tmp_path / "r.json").read_text())
    assert [p["steps"] for p in rep["phases"]] == [[1, 10]]
    assert "warm-up steps 1-10: 8 x 32 tokens, 1 micro-batch(es) of 4 per rank: step" in capsys.readouterr().out
    times = [p["step_s"] for p in rep["phases"]] + [rep["predicted"]["step_s"]]
    assert times[0] < times[-1], times  # one micro-batch of 4 x 32 against two of 4 x 64
    assert all(p["peak_gib"] < rep["roles"][0]["memory_gib"]["peak"] for p in rep["phases"])


# -- checkpoint merging ---------------------------------------------------------------------------

def _checkpoint(path: Path, seed: int) -> dict:
    """A one-block debug model, every value random, as a model-only checkpoint."""
    args = dataclasses.replace(titanlite.get_model_spec("llama3").flavors["debugmodel"], n_layers=1)
    model = titanlite.get_model_spec("llama3").build(args)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(seed)))
    write_model_checkpoint(path, model.state_dict(), "llama3", args)
    return load_tensors(path)


def test_merge_of_two_checkpoints_is_their_mean(tmp_path):
    a, b = _checkpoint(tmp_path / "a", seed=1), _checkpoint(tmp_path / "b", seed=2)
    merge.main([str(tmp_path / "a"), str(tmp_path / "b"), str(tmp_path / "mean")])
    mean = load_tensors(tmp_path / "mean")
    assert mean.keys() == a.keys()
    for k in a:  # sum, then divide: the in-run merge's order too
        assert torch.equal(mean[k], (a[k] + b[k]) / 2), k
    merge.main([str(tmp_path / "a"), str(tmp_path / "b"), str(tmp_path / "hf"), "--weights", "1,3", "--format", "hf"])
    model, _ = titanlite.load_hf(tmp_path / "hf", "llama3")  # transformers' names, config and row order
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, (a[k] + 3 * b[k]) / 4, rtol=1e-6, atol=1e-6)


def _family_checkpoint(path: Path, family: str, flavor: str, seed: int, bias: bool = False, **changes) -> None:
    """Random weights; buffers (a MoE's selection bias) as built unless `bias`."""
    spec = titanlite.get_model_spec(family)
    args = dataclasses.replace(spec.flavors[flavor], **changes)
    model = spec.build(args)
    g = torch.Generator().manual_seed(seed)
    trained = dict(model.named_parameters())
    state = {k: torch.randn(v.shape, generator=g) * 0.02 if k in trained or bias else v
             for k, v in model.state_dict().items()}
    write_model_checkpoint(path, state, family, args)


def test_merge_to_hf_is_the_mean_of_the_exports_for_every_family(tmp_path):
    """Every family with a transformers mapping, Qwen3.5 (whose to_hf maps all blocks at once) and
    the transformers family included: the merge written as a transformers folder equals the
    weighted mean of the checkpoints' own exports (convert dcp hf); checkpoints that differ in
    max_seq_len (a training knob resume accepts) merge. A merge that fails leaves no folder."""
    from titanlite.checkpoint.hf import read_safetensors
    from titanlite.tools.convert import main as convert_main

    for family in titanlite.available_models():
        spec = titanlite.get_model_spec(family)
        if spec.hf is None:
            continue
        flavor = next(f for f in spec.flavors if f.startswith("debug"))
        # two blocks (fewer tensors to read), but Qwen3.5's four: its full-attention block is the last
        depth = {} if family == "qwen3_5" else {"n_layers": 2}
        a, b, out = tmp_path / f"{family}-a", tmp_path / f"{family}-b", tmp_path / f"{family}-hf"
        _family_checkpoint(a, family, flavor, 1, **depth)
        _family_checkpoint(b, family, flavor, 2, max_seq_len=spec.flavors[flavor].max_seq_len // 2, **depth)
        merge.main([str(a), str(b), str(out), "--weights", "1,3", "--format", "hf"])
        got, exports = read_safetensors(out), []
        for c in (a, b):
            convert_main(["dcp", "hf", str(c), str(c) + "-export"])
            exports.append(read_safetensors(str(c) + "-export"))
        assert got.keys() == exports[0].keys(), family
        for k, v in got.items():
            torch.testing.assert_close(v, (exports[0][k] + 3 * exports[1][k]) / 4, rtol=1e-6, atol=1e-6,
                                       msg=f"{family} {k}")
    # Qwen3.5 has no router bias: a non-zero one (aux-loss-free balancing) cannot be exported
    _family_checkpoint(tmp_path / "biased", "qwen3_5", "debugmodel_moe", 3, bias=True)
    with pytest.raises(SystemExit, match="has no router bias"):
        merge.main([str(tmp_path / "biased"), str(tmp_path / "biased"), str(tmp_path / "failed"), "--format", "hf"])
    assert not list(tmp_path.glob("failed*"))


@pytest.mark.parametrize("other,says", [
    (("llama3", "debugmodel_tied", (4, 8)), "different tie_embeddings"),
    (("qwen3", "debugmodel", (4, 8)), "holds a 'qwen3' model"),
    (("llama3", "debugmodel", (4, 9)), r"'w' is \(4, 9\) but \(4, 8\) in .*a; merge checkpoints of one model"),
], ids=["other_args", "other_family", "other_shape"])
def test_merge_refuses_checkpoints_of_different_models(tmp_path, other, says):
    family, flavor, shape = other
    write_model_checkpoint(tmp_path / "a", {"w": torch.zeros(4, 8)}, "llama3",
                           titanlite.get_model_spec("llama3").flavors["debugmodel"])
    write_model_checkpoint(tmp_path / "b", {"w": torch.zeros(shape)}, family,
                           titanlite.get_model_spec(family).flavors[flavor])
    with pytest.raises(SystemExit, match=says) as e:
        merge.main([str(tmp_path / "a"), str(tmp_path / "b"), str(tmp_path / "out")])
    assert str(e.value).startswith("titanlite: error: ") and "\n" not in str(e.value)
    assert not (tmp_path / "out").exists()


def _status_mib(key: str) -> float:
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith(key)) / 1024


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="Linux's peak-RSS reset")
def test_merge_holds_about_one_tensor_not_the_model(tmp_path):
    """Two checkpoints of 8 tensors of 8 MiB merge with a peak of ~3 tensors over the memory before
    (a read buffer, the tensor read, the fp32 sum), not the 128 MiB read: a model larger than the
    host's memory merges. glibc is told to give freed blocks of over 1 MiB back at once (mallopt
    M_MMAP_THRESHOLD), so the peak is what the merge holds, not what the allocator keeps."""
    args, mib = titanlite.get_model_spec("llama3").flavors["debugmodel"], 8
    for c in range(2):
        write_model_checkpoint(tmp_path / f"in{c}", {f"t{i}": torch.full((mib, 2**18), i + c, dtype=torch.float32)
                                                    for i in range(8)}, "llama3", args)
    assert ctypes.CDLL(None).mallopt(-3, 2**20) == 1  # M_MMAP_THRESHOLD
    merge.main([str(tmp_path / "in0"), str(tmp_path / "in0"), str(tmp_path / "warm")])  # imports, first reads
    Path("/proc/self/clear_refs").write_text("5")  # the peak RSS starts again from now
    before = _status_mib("VmRSS")
    merge.main([str(tmp_path / "in0"), str(tmp_path / "in1"), str(tmp_path / "out")])
    assert _status_mib("VmHWM") - before < 4 * mib, (before, _status_mib("VmHWM"))
    assert torch.equal(load_tensors(tmp_path / "out")["t3"], torch.full((mib, 2**18), 3.5))


# -- in a run ---------------------------------------------------------------------------------

MERGED = [*TINY, "--training.global_batch_size", "8", "--training.batch_warmup", "2:2,4:4",
          "--training.seq_warmup", "32:6", "--data.document_mask", "true", "--checkpoint.enable",
          "--checkpoint.interval", "5", "--checkpoint.merge_last", "2"]


def test_warmup_and_merge_resume_bitwise_and_the_merge_is_the_offline_one(tmp_path):
    """Batch 2 -> 4 -> 8 (from steps 3 and 5) and sequence 32 -> 64 (from step 7), the weights of
    steps 4-5 and 9-10 merged at the saves of steps 5 and 10. A run stopped (SIGTERM) after step 4
    (at the batch's last change, before the sequence's) and after step 9 (after both), each time
    inside a merge window whose sum its checkpoint holds, and resumed, logs the losses of the
    uninterrupted run and saves the same merged weights, bit for bit; those equal the offline merge
    of the steps' checkpoints."""
    straight = train(1, MERGED, dump=tmp_path / "straight")
    rows = {}
    for stop in (4, 9, 10):
        run = train(1, MERGED, dump=tmp_path / "stopped", env={"TITANLITE_FAULTS": "term@4,term@9"})
        assert run.metrics[-1]["step"] == stop
        rows |= {r["step"]: r["loss"] for r in run.metrics}  # a resumed run's rows come last
    assert [rows[s] for s in range(1, 11)] == straight.losses
    ckpt, again = tmp_path / "straight" / "checkpoint", tmp_path / "stopped" / "checkpoint"
    for step, first in ((5, 4), (10, 9)):
        merged = load_tensors(ckpt / f"step-{step}" / "merged")
        assert json.loads((ckpt / f"step-{step}" / "merged" / "titanlite.json").read_text())["merged_steps"] == [
            first, step]
        resumed = load_tensors(again / f"step-{step}" / "merged")
        merge.main([str(again / f"step-{first}"), str(again / f"step-{step}"), str(tmp_path / f"offline-{step}")])
        offline = load_tensors(tmp_path / f"offline-{step}")
        for k, v in merged.items():
            assert torch.equal(resumed[k], v) and torch.equal(offline[k], v), (step, k)
