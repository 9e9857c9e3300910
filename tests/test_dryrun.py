"""The dry run: one real step on a fake process group with fake tensors.

A step replayed from a shallow trace (few blocks, three micro-batches per pipeline stage)
equals a trace of every block and micro-batch; FLOPs match the model's
own formula; every shipped config runs at the scale its comment names and fits in 80 GiB
per GPU; bad input ends in one line."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from harness import REPO, _env

from titanlite.config import load as config

from titanlite.dryrun import run as dryrun_module

from titanlite.preflight import make_plan
from titanlite.dryrun import hardware, timing
from titanlite.dryrun.report import report
from titanlite.dryrun.run import dry_run, main
from titanlite.model_spec import get_model_spec
from titanlite.dryrun.steptrace import OWN_FLOPS, PHASES
from torch.utils.flop_counter import flop_registry

# Dry-run by hand at their scale (docs/scaling.md), not here: 17-30 s each on two cores, and
# 150-225 s for DeepSeek-V3 671B and Kimi K2 at 512 GPUs (three pipeline roles, 256-384 experts);
# Qwen3.5 9B took 198 s at 64 GPUs (its chunk scans trace one op per chunk and block)
BY_HAND = {"gpt_oss_20b", "gpt_oss_120b", "deepseek_v3_16b", "deepseek_v3_671b", "kimi_k2", "qwen3_5_9b",
           "qwen3_5_35b_a3b"}
CONFIGS = sorted(p for p in (REPO / "train_configs").glob("*.toml") if p.stem not in BY_HAND)


def _scale(path: Path) -> int:
    found = re.search(r"^# Intended scale: (\d+) GPU", path.read_text(), re.M)
    assert found, f"{path.name}: the header must name its intended scale ('# Intended scale: N GPUs')"
    return int(found.group(1))


@pytest.mark.parametrize("name", sorted(BY_HAND))
def test_configs_dry_run_by_hand_pass_preflight_at_their_scale(name):
    """Their full dry runs are in docs/scaling.md; here, at their intended scale, the layout and
    model checks pass and the model state (fp32 weights, gradients and AdamW's two moments)
    spread over every rank fits an 80 GiB GPU."""
    path = REPO / "train_configs" / f"{name}.toml"
    ngpu = _scale(path)
    cfg, _ = config.load(["--config", str(path)])
    plan = make_plan(cfg, ngpu)
    assert plan.n_params * 16 / ngpu / 2**30 < 80, (name, plan.n_params, ngpu)


def test_shallow_trace_replayed_equals_every_block(monkeypatch):
    """An 8-block debug model traced at 4 and 6 blocks (selective AC every 2nd block: one period
    more) and replayed to 8, against all 8 traced: the same peaks per phase and category,
    collectives and FLOPs, under FSDP x TP with sequence parallel."""
    spec = get_model_spec("llama3")
    monkeypatch.setitem(spec.flavors, "debug8", dataclasses.replace(spec.flavors["debugmodel"], n_layers=8))
    cfg, _ = config.load(["--model.flavor", "debug8", "--training.seq_len", "64", "--training.local_batch_size", "2",
                          "--parallelism.tensor_parallel_degree", "2", "--activation_checkpoint.mode", "selective",
                          "--activation_checkpoint.selective_type", "layer", "--activation_checkpoint.selective_every", "2"])
    (short,) = dry_run(cfg, 4)["_roles"]
    (full,) = dry_run(cfg, 4, full=True)["_roles"]
    assert short.traced_blocks == 6 and full.traced_blocks == 8
    _assert_same_trace(short, full)


def test_flops_match_the_model_formula_and_layout_divides_the_work(monkeypatch):
    """FlopCounterMode's count of the traced step (forward + backward, every rank's share)
    against 6 x (activated) parameters + attention: within 1%, and TP 2 halves each rank's
    share. An MoE step counts only the top-k experts each token meets (balanced routing).
    Each op has one formula, called with its own signature: titanlite's own (the CPU flash
    kernel, grouped GEMM) whatever torch's table holds for them (torch 2.15 added one for the
    former), here a formula of torch's signature that would count 10^18."""
    for op in OWN_FLOPS:
        monkeypatch.setitem(flop_registry, op._overloadpacket, lambda *args, out_val=None, **kwargs: 10**18)
    shape = ["--training.seq_len", "64", "--training.local_batch_size", "2"]
    expected = {}
    for name in ("qwen3_moe_debug.toml", "debug_model.toml"):
        cfg, _ = config.load(["--config", name, *shape])
        one = dry_run(cfg, 1)
        plan = one["_plan"]
        per_token = plan.spec.flops_per_token(plan.args, 64)
        # torch counts flash attention's backward as 2.5 forwards (it recomputes the scores),
        # the MFU formula as 2: its attention term (3 forwards) plus a sixth
        attention = per_token - plan.spec.flops_per_token(plan.args, 0)
        expected[name] = (per_token + attention / 6) * 2 * 64
        assert one["_roles"][0].flops == pytest.approx(expected[name], rel=0.01), name
    cfg, _ = config.load(["--config", "debug_model.toml", *shape, "--parallelism.tensor_parallel_degree", "2"])
    assert dry_run(cfg, 2)["_roles"][0].flops == pytest.approx(expected["debug_model.toml"] / 2, rel=0.01)


@pytest.mark.parametrize("family,config_name", [("llama3", "debug_model.toml"), ("qwen3", "qwen3_debug.toml"),
                                                 ("qwen3_moe", "qwen3_moe_debug.toml")])
def test_tensor_parallel_moves_the_textbook_bytes(family, config_name, monkeypatch):
    """One block's collectives over tp 8 with sequence parallel (a 3-block model's minus a 2-block
    one's, every block traced, bf16 under autocast): forward, an all-gather of the sequence in
    front of each split sub-layer (attention and the dense feed-forward; a MoE layer is not
    split over tp) and a reduce-scatter behind it, each B x S x dim in bf16; backward the same
    in reverse; no activation all-reduced: only the weight gradients of what runs whole on
    every rank (norms, QK-norms, the router), once each, in float32."""
    spec = get_model_spec(family)
    comms, args = {}, None
    for n in (2, 3):
        args = dataclasses.replace(spec.flavors["debugmodel"], n_kv_heads=8, n_layers=n)
        monkeypatch.setitem(spec.flavors, "tp8", args)
        cfg, _ = config.load(["--config", config_name, "--model.flavor", "tp8", "--training.seq_len", "64",
                              "--training.local_batch_size", "1", "--parallelism.tensor_parallel_degree", "8",
                              "--parallelism.expert_parallel_degree", "8" if family == "qwen3_moe" else "1",
                              "--activation_checkpoint.mode", "none"])
        (role,) = dry_run(cfg, 8, full=True)["_roles"]
        comms[n] = role.comms
    block = {(kind, phase): (c["count"] - comms[2].get((kind, g, phase), {}).get("count", 0),
                             c["bytes"] - comms[2].get((kind, g, phase), {}).get("bytes", 0))
             for (kind, g, phase), c in comms[3].items() if g == "tp"}
    split = 1 if family == "qwen3_moe" else 2
    activation = 64 * args.dim * 2
    for phase in ("forward", "backward"):
        assert block[("all_gather", phase)] == (split, split * activation), phase
        assert block[("reduce_scatter", phase)] == (split, split * activation), phase
    assert block.get(("all_reduce", "forward"), (0, 0)) == (0, 0)
    with torch.device("meta"):
        whole = [p for name, p in spec.build(args).layers["0"].named_parameters() if "norm" in name or "router" in name]
    assert block[("all_reduce", "backward")] == (len(whole), 4 * sum(p.numel() for p in whole))


def test_the_loss_holds_one_chunk_of_float32_logits(monkeypatch):
    """At 8,192 tokens and a 32,768 vocabulary the float32 logits are 1 GiB. The whole loss keeps
    their log-softmax for backward (in place of the 0.5 GiB bf16 logits) and, in backward, a
    float32 gradient of them beside the bf16 one; in chunks of 256 MiB the step holds no full
    float32 copy: its peak is lower by more than the 1 GiB (1.375 GiB when measured)."""
    cfg, _ = config.load(["--config", "debug_model.toml", "--model.vocab_size", "32768",
                          "--training.seq_len", "8192", "--training.local_batch_size", "1"])
    peaks = {}
    for chunk in (1 << 40, 1 << 28):
        monkeypatch.setattr("titanlite.loss.CHUNK_BYTES", chunk)
        (role,) = dry_run(cfg, 1)["_roles"]
        peaks[chunk] = role.peaks[role.peak_phase]["total"]
    assert peaks[1 << 40] - peaks[1 << 28] > 2**30, peaks


def _assert_same_trace(a, b, split: bool = True, peak_abs: int = 0) -> None:
    """The same peaks, collectives, FLOPs and time terms. `split` False (a hybrid stack): the same
    compute (every op's FLOPs and bytes), and the step time and kernel count to 1%: a block
    beside a change of kind carries the FSDP traffic of the blocks around it, which the replay
    takes from blocks of one kind (the sums match, each block's overlap with it differs), and an
    op over many blocks' tensors (the optimizer step, a stack of every layer's statistics) is one
    launch, which the replay shares among the repeats by bytes. `peak_abs`: bytes the peaks may
    differ by."""
    for phase in PHASES:
        assert a.peaks[phase] == pytest.approx(b.peaks[phase], rel=1e-9, abs=peak_abs), phase
    assert a.comms.keys() == b.comms.keys()
    for key, c in b.comms.items():
        assert a.comms[key]["count"] == c["count"] and a.comms[key]["bytes"] == pytest.approx(c["bytes"]), key
    assert a.flops == pytest.approx(b.flops, rel=1e-12)
    # the time terms, split into what each block adds and the rest, within 1e-6 of the step: an
    # op's share in a block's tensors (the optimizer's, say) is counted by the bytes it reads
    for gpu in hardware.GPUS.values():
        for compiled in (False, True):
            times = b.times(gpu, compiled)
            if split:
                assert dataclasses.asdict(a.times(gpu, compiled)) == pytest.approx(dataclasses.asdict(times),
                                                                                   abs=1e-6 * times.step()), gpu.name
            else:
                assert a.times(gpu, compiled).step() == pytest.approx(times.step(), rel=0.01), gpu.name
                no_gap = dataclasses.replace(timing.FITTED, kernel_gap_us=0.0)
                assert timing.compute_seconds(a.work.ops, gpu, no_gap) == pytest.approx(
                    timing.compute_seconds(b.work.ops, gpu, no_gap), rel=1e-5), gpu.name
    if not split:
        kernels = [sum(np.frombuffer(r.work.ops).reshape(-1, 5)[:, 4]) for r in (a, b)]
        assert kernels[0] == pytest.approx(kernels[1], rel=0.01), kernels


def test_pipeline_replay_equals_every_block_and_microbatch(monkeypatch):
    """Pipeline stages of 5 or more blocks and 6 micro-batches: traced with 4 blocks per stage
    and three micro-batches (the rest counted as copies: titanlite.dryrun.pptrace) and replayed, against
    every block and micro-batch traced: the same peaks per phase and category, collectives,
    FLOPs and time terms, on the first and the last pipeline rank. Interleaved1F1B at pp 2 x
    FSDP 2 x tp 2, two stages per rank (0 and 2, 1 and 3), whose FSDP parameters the schedule
    gathers and reduces itself, recomputed under full AC (1F1B, one stage a rank, replays the
    same way)."""
    spec = get_model_spec("llama3")
    monkeypatch.setitem(spec.flavors, "deep", dataclasses.replace(spec.flavors["debugmodel"], n_layers=22))
    cfg, _ = config.load(["--model.flavor", "deep", "--training.seq_len", "64", "--training.local_batch_size", "6",
                          "--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule",
                          "Interleaved1F1B", "--parallelism.pipeline_parallel_microbatch_size", "1",
                          "--parallelism.tensor_parallel_degree", "2", "--parallelism.pipeline_parallel_layers_per_stage",
                          "6", "--activation_checkpoint.mode", "full"])
    replayed = dry_run(cfg, 8)["_roles"]
    every = dry_run(cfg, 8, full=True)["_roles"]
    assert [r.rank for r in replayed] == [0, 4]
    # four blocks of each stage of 5-6 (its first two, one standing for the middle ones, its last)
    assert [r.traced_blocks for r in replayed] == [16, 16] and [r.traced_blocks for r in every] == [22] * 2
    # 3 of 6 micro-batches skipped on each of a rank's two stages: their forward and backward
    # calls (and the last stage's loss) counted as copies
    assert [r.copied_calls for r in replayed] == [3 * 2 * 2, 3 * (2 * 2 + 1)]
    assert [r.copied_calls for r in every] == [0, 0]
    for a, b in zip(replayed, every):
        _assert_same_trace(a, b)


def test_a_stack_of_different_blocks_is_traced_per_kind(monkeypatch):
    """Qwen3.5's hybrid stack (12 linear- and 4 full-attention blocks of 16, Qwen3.5 9B's pattern)
    over FSDP 2, traced with one linear block standing for six: its FLOPs are the sum of its
    blocks', 12/16 of an all-linear stack's and 4/16 of an all-full one's (everything else is the
    same). DeepSeek-V3's 3 dense and 9 MoE blocks with its MTP depth, one MoE block standing for
    six: its replay equals every block traced. (Replaying one block for every middle block counted
    the hybrid as 14 linear and 2 full, DeepSeek-V3's MoE blocks as dense.)"""
    spec = get_model_spec("qwen3_5")
    hybrid = tuple("full_attention" if i % 4 == 3 else "linear_attention" for i in range(16))
    stacks = {"hybrid": hybrid, "linear": ("linear_attention",) * 16, "full": ("full_attention",) * 16}
    flops = {}
    for name, kinds in stacks.items():
        monkeypatch.setitem(spec.flavors, name, dataclasses.replace(spec.flavors["debugmodel"], n_layers=16,
                                                                   layer_types=kinds))
        cfg, _ = config.load(["--config", "qwen3_5_debug.toml", "--model.flavor", name, "--training.seq_len", "64",
                              "--training.local_batch_size", "1"])
        result = dry_run(cfg, 2)
        flops[name] = result["_roles"][0].flops
        if name == "hybrid":
            # blocks 0, 1, the 3 middle full ones, 2 + 1 + 2 linear (the repeated one between
            # two of its kind on either side: the blocks FSDP gathers around it), the last
            assert sorted(result["block_kinds"].values()) == [4, 12] and result["_roles"][0].traced_blocks == 11
    assert flops["hybrid"] == pytest.approx((12 * flops["linear"] + 4 * flops["full"]) / 16, rel=1e-9)
    assert flops["full"] != pytest.approx(flops["linear"], rel=0.01)  # the kinds differ, so the sum tells
    spec = get_model_spec("deepseek_v3")
    monkeypatch.setitem(spec.flavors, "mixed", dataclasses.replace(spec.flavors["debugmodel"], n_layers=12,
                                                                  n_dense_layers=3))
    cfg, _ = config.load(["--config", "deepseek_v3_debug.toml", "--model.flavor", "mixed", "--training.seq_len", "64",
                          "--training.local_batch_size", "1"])
    result = dry_run(cfg, 2)
    assert sorted(result["block_kinds"].values()) == [3, 9] and result["_roles"][0].traced_blocks == 7
    # the optimizer phase's stack of every MoE layer's loads (the router-bias hook) has the traced
    # layers' rows only (4 of 9: a few hundred bytes)
    _assert_same_trace(result["_roles"][0], dry_run(cfg, 2, full=True)["_roles"][0], split=False, peak_abs=256)


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_shipped_config_fits_at_its_intended_scale(path):
    ngpu = _scale(path)
    cfg, _ = config.load(["--config", str(path)])
    result = dry_run(cfg, ngpu)
    rep = report(result, hardware.get_gpu("h100"))
    assert rep["world_size"] == ngpu
    pp = rep["layout"]["pp"]
    # one role per distinct pipeline rank: the first, a middle one, the last
    assert [r["rank"] for r in rep["roles"]] == sorted({0, min(1, pp - 1) * ngpu // pp, (pp - 1) * ngpu // pp})
    owned = _params_by_pp_rank(cfg, result["_plan"], pp)
    for role in rep["roles"]:
        mem = role["memory_gib"]
        assert 0 < mem["peak"] <= 80, f"{path.name} at {ngpu} GPUs, rank {role['rank']}: {mem}"
        # the sharded state is what the parameter count says: fp32 parameters of this rank's
        # stages over the FSDP x TP ranks of a stage
        lora = result["_plan"].lora
        if lora is not None:  # a LoRA job (dpo_debug): the adapters join the weights; only they have moments
            assert pp == 1 and mem["parameters"] == pytest.approx(4 * (lora.trained + lora.frozen) / ngpu / 2**30,
                                                                  rel=0.05)
            assert mem["optimizer"] == pytest.approx(2 * 4 * lora.trained / ngpu / 2**30, rel=0.05)
            continue
        n_params = owned[role["rank"] * pp // ngpu]
        assert mem["parameters"] == pytest.approx(4 * n_params / (ngpu // pp) / 2**30, rel=0.05), role["rank"]
        assert mem["optimizer"] == pytest.approx(2 * mem["parameters"], rel=0.01)  # parameters include buffers
        # the optimizer step holds the gradients too, as large as the fp32 parameters
        assert role["memory_gib_by_phase"]["optimizer"] >= 1.9 * mem["parameters"] + mem["optimizer"]
        if pp > 1:
            kinds = {name.split(" ")[0] for name in role["collectives"]}
            assert {"send[pp]", "recv[pp]"} <= kinds, kinds
    pred = rep["predicted"]
    assert pred["step_s"] > 0 and 0 < pred["mfu_pct"] < 100 and pred["tokens_per_sec_per_gpu"] > 0


def _params_by_pp_rank(cfg, plan, pp: int) -> list[int]:
    """Parameters each pipeline rank holds: its stages' blocks, the embedding on the first
    stage's rank, the final norm and output on the last one's."""
    model = _meta_model(cfg)
    if plan.stages is None:
        return [sum(p.numel() for p in model.parameters())]
    spec, stages = plan.spec, plan.stages
    owner = {s: r for r in range(pp) for s in stages.stages_of(r, pp)}
    held = [0] * pp
    for name, p in model.named_parameters():
        top, _, rest = name.partition(".")
        if top == spec.blocks:
            i = int(rest.split(".")[0])
            stage = next(s for s, (a, b) in enumerate(stages.blocks) if a <= i < b)
        else:
            stage = 0 if top in spec.pre else stages.n_stages - 1
        held[owner[stage]] += p.numel()
    return held


def _meta_model(cfg):
    import torch

    from titanlite.model_spec import model_args
    spec = get_model_spec(cfg.model.name)
    with torch.device("meta"):
        return spec.build(model_args(spec, cfg.model.flavor, cfg.model.vocab_size, cfg.training.seq_len))


def test_cli_writes_the_report(tmp_path, capsys):
    out = tmp_path / "r.json"
    main(["--config", "debug_model.toml", "--ngpu", "4", "--gpu", "a100", "--out", str(out),
          "--training.seq_len", "64", "--parallelism.tensor_parallel_degree", "2", "--compile.enable", "true"])
    rep = json.loads(out.read_text())
    assert rep["world_size"] == 4 and rep["layout"]["tp"] == 2 and rep["layout"]["dp_shard"] == 2
    (role,) = rep["roles"]
    assert role["rank"] == 0 and set(role["memory_gib"]) >= {"parameters", "gradients", "optimizer", "activations", "peak"}
    # FSDP gathers over dp_shard, TP's sequence-parallel all-gathers and reduce-scatters over tp
    kinds = {name.split(" ")[0] for name in role["collectives"]}
    assert {"all_gather[dp_shard_cp]", "reduce_scatter[dp_shard_cp]", "all_gather[tp]", "reduce_scatter[tp]"} <= kinds
    assert rep["predicted"]["gpu"] == "a100" and rep["predicted"]["mfu_pct"] > 0
    # the eager trace timed as compiled blocks (fused memory-bound ops), and eager beside it
    pred = rep["predicted"]
    assert rep["config"]["compile"] and pred["tokens_per_sec_per_gpu"] == pred["tokens_per_sec_per_gpu_compiled"]
    assert pred["tokens_per_sec_per_gpu_compiled"] > pred["tokens_per_sec_per_gpu_eager"] > 0
    printed = capsys.readouterr().out
    assert "predicted on a100" in printed and "the same step eager (compile.enable false)" in printed


@pytest.mark.parametrize("argv, expect", [
    (["--gpu", "v100"], "--gpu: unknown GPU 'v100'; known: h100, h100_500w, h200, a100, b200"),
    (["--ngpu", "6", "--parallelism.tensor_parallel_degree", "4"], "world size 6 is not divisible by dp_replicate 1"),
    (["--ngpu", "2", "--rank", "2"], "--rank 2 is outside the world of 2 ranks"),
    (["--ngpu", "0"], "--ngpu: expected a positive integer, got '0'"),
    (["--full=yes"], "--full takes no value, got '--full=yes'"),
    (["--power-limit", "many"], "--power-limit: expected watts (a positive number), got 'many'"),
    (["--power-limit", "0"], "--power-limit: expected a positive number of watts, got 0"),
    (["--float8.enable", "true", "--gpu", "a100"], "float8.enable: the a100 has no float8 matmuls"),
    (["--training.local_batch_size", "4096", "--training.seq_len", "1024"], "exceeds the h100's 79.6 GiB"),
])
def test_bad_input_is_one_line(argv, expect, capsys):
    with pytest.raises(SystemExit) as e:
        main(["--config", "debug_model.toml", *argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1, err
    assert err[0].startswith("titanlite: error: ") and expect in err[0], err


def test_the_dry_run_plans_a_job_larger_than_its_data(capsys):
    """A dry run reads no data, so it plans a global batch the embedded data cannot fill (as the
    Llama 3 paper's 2,048 x 8,192 on 8,192 GPUs); the launch preflight still refuses to train it."""
    big = ["--config", "debug_model.toml", "--ngpu", "2048", "--training.seq_len", "8192",
           "--training.local_batch_size", "1", "--training.global_batch_size", "2048"]
    main(big)
    assert "predicted on h100" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        main(["--check-memory", "1", *big])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and "need at least global_batch_size 2048" in err[0], err


class Unsendable(RuntimeError):
    """An exception that does not pickle (it holds a lock, as torch's data-dependent-shape errors
    hold a pybind11 object)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.lock = threading.Lock()


@pytest.mark.parametrize("where,error", [("check_memory", TypeError("cannot unpack non-iterable OpOverload object")),
                                         ("trace_step", Unsendable("data-dependent shape"))],
                         ids=["in_process", "in_a_traced_rank_unpicklable"])
def test_a_preflight_that_crashes_says_so_in_one_line(monkeypatch, capsys, where, error):
    """An internal error (a titanlite bug, a torch it does not know) ends the preflight with one
    line naming the exception, where it was raised, the torch version and how to launch without
    it, and exit 1; the traceback is kept in a file. Also when a traced rank's worker process
    raised it and it does not pickle. A bad config is still refused (exit 2, test above)."""
    def crash(*args, **kwargs):
        raise error
    monkeypatch.setattr(dryrun_module, where, crash)
    with pytest.raises(SystemExit) as e:
        main(["--check-memory", "1", "--config", "debug_model.toml"])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 1 and len(err) == 1, err
    assert re.match(rf"titanlite: error: the preflight failed inside titanlite \({type(error).__name__}: "
                    rf"{re.escape(str(error))}, at {re.escape(__file__)}:\d+\) on torch {re.escape(torch.__version__)}; "
                    "traceback in ", err[0]), err
    assert err[0].endswith("; ./run_train.sh --skip-preflight launches without it"), err
    trace = Path(re.search(r"traceback in (\S+);", err[0]).group(1))
    assert "in crash\n" in trace.read_text()
    trace.unlink()


def test_run_train_refuses_a_job_that_cannot_fit(tmp_path):
    """The launcher's memory preflight: one line naming estimate and limit, before any rank starts;
    job.memory_check = warn lets it through to the next check."""
    big = ["--training.local_batch_size", "4096", "--training.seq_len", "2048", "--training.steps", "20"]
    proc = subprocess.run([str(REPO / "run_train.sh"), "--job.dump_folder", str(tmp_path), *big], cwd=REPO,
                          capture_output=True, text=True, env=_env({"NGPU": "1"}), timeout=300)
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(err) == 1, proc.stderr
    assert "the estimated per-rank peak" in err[0] and "available host memory / 1 local rank(s)" in err[0]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(["python", "-m", "titanlite.dryrun", "--check-memory", "1", *big, "--job.memory_check", "warn",
                           "--job.dump_folder", str(tmp_path)], cwd=REPO, capture_output=True, text=True,
                          env=_env(None) | {k: env[k] for k in ("OMP_NUM_THREADS",)}, timeout=300)
    assert proc.returncode == 0 and proc.stderr.startswith("titanlite: warning: the estimated per-rank peak"), proc.stderr


def test_muon_moves_each_rank_its_shards_once_each_way():
    """dp 2 x tp 2: Muon's optimizer step sends its local shards of the block matrices (bf16) by one
    all-to-all over each mesh dim that cuts them and gets as much back by another; nothing is
    all-gathered."""
    cfg, _ = config.load(["--config", "debug_model.toml", "--training.seq_len", "64", "--optimizer.name", "Muon",
                          "--parallelism.tensor_parallel_degree", "2"])
    (role,) = dry_run(cfg, 4, full=True)["_roles"]
    spec = get_model_spec("llama3")
    with torch.device("meta"):
        matrices = [p for n, p in spec.build(spec.flavors["debugmodel"]).named_parameters()
                    if n.startswith("layers.") and p.ndim == 2]
    shard_bytes = sum(p.numel() for p in matrices) // 4 * 2
    optimizer = {(kind, g): c["bytes"] for (kind, g, phase), c in role.comms.items() if phase == "optimizer"}
    assert optimizer == {("all_to_all", "dp_shard_cp"): 2 * shard_bytes, ("all_to_all", "tp"): 2 * shard_bytes}


@pytest.fixture
def broken_fork(tmp_path, monkeypatch):
    """`edit(old, new)` -> a fork of llama3 named my_bad whose model.py has `old` replaced by `new`,
    registered for this test alone (titanlite.models' search path gets the temporary folder)."""
    import shutil
    import sys

    import titanlite.models

    folder = tmp_path / "my_bad"
    shutil.copytree(REPO / "models" / "llama3", folder, ignore=shutil.ignore_patterns("__pycache__"))
    (folder / "__init__.py").write_text((folder / "__init__.py").read_text().replace('name="llama3"', 'name="my_bad"'))
    monkeypatch.setattr(titanlite.models, "__path__", [*titanlite.models.__path__, str(tmp_path)])
    yield lambda old, new: (folder / "model.py").write_text((folder / "model.py").read_text().replace(old, new))
    for name in [m for m in sys.modules if m.startswith("titanlite.models.my_bad")]:
        del sys.modules[name]


@pytest.mark.parametrize("where", ["build", "forward", "transformers"])
def test_an_error_in_the_model_s_own_code_is_reported_as_the_user_s(broken_fork, capsys, where):
    """Raised by a fork's model.py in the preflight's build or the dry run's forward: one line with the file, line
    and exception, no --skip-preflight (launching without it fails alike); raised in transformers' code: its file."""
    argv = ["--model.name", "my_bad"]
    if where == "build":
        broken_fork("    return Block(", "    raise NotImplementedError('my idea')\n    return Block(")
    elif where == "forward":
        broken_fork("        super().__init__(args, lambda i: block(args, i), rope_frequencies(args))",
                    "        super().__init__(args, lambda i: block(args, i), rope_frequencies(args))\n\n"
                    "    def forward(self, tokens, ctx=None):\n        raise NotImplementedError('my idea')")
    else:  # a size transformers' MLP cannot build (the family's first import's torch warnings read away first)
        get_model_spec("transformers"), capsys.readouterr()
        argv = ["--model.name", "transformers", "--model.hf_config", "olmo", "--model.hf_overrides",
                "hidden_size=64,num_attention_heads=4,vocab_size=512,eos_token_id=2,intermediate_size=-1"]
    with pytest.raises(SystemExit) as e:
        main(["--check-memory", "1", "--config", "debug_model.toml", *argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 1 and len(err) == 1, err
    line = (r"transformers/models/olmo/modeling_olmo\.py line \d+ \(in __init__\): RuntimeError: Trying to create "
            r"tensor with negative dimension -1: \[-1, 64\]" if where == "transformers"
            else rf"models/my_bad/model\.py line \d+ \(in {where.replace('build', 'block')}\): NotImplementedError: my idea")
    assert re.fullmatch(rf"titanlite: error: the preflight failed in the model's code, {line}; traceback in \S+", err[0]), err
    Path(err[0].rpartition(" ")[2]).unlink()


def test_an_error_in_the_model_s_own_code_on_a_rank_is_reported_as_the_user_s(broken_fork, capsys):
    """The same on a rank launched without the preflight (its own preflight builds the model)."""
    from titanlite import train

    broken_fork("    return Block(", "    raise NotImplementedError('my idea')\n    return Block(")
    with pytest.raises(NotImplementedError):  # the traceback stays in the rank's output
        train.main(["--config", "debug_model.toml", "--model.name", "my_bad"])
    err = capsys.readouterr().err.strip().splitlines()
    assert re.fullmatch(r"titanlite: error: the model's code failed, models/my_bad/model\.py line \d+ \(in block\): "
                        r"NotImplementedError: my idea", err[-1]), err


def test_qwen3_5_memory_grows_at_most_linearly_with_the_sequence(monkeypatch):
    """Qwen3.5's debug flavor (9B's pattern in small: three Gated DeltaNet blocks, one full
    attention) over cp 8 with full AC and packed documents, the linear blocks passing their state
    along the ranks: at 32,768 and 65,536 tokens (4,096 and 8,192 per rank) what the batch brings
    to the step's peak (all but parameters, gradients and optimizer state) at most doubles, and
    grows. The flavor's max_seq_len (32,768) is lifted: the linear blocks have no positions and
    RoPE's table covers the trace. The 9B's own figures: docs/scaling.md."""
    spec = get_model_spec("qwen3_5")
    monkeypatch.setitem(spec.flavors, "debugmodel", dataclasses.replace(spec.flavors["debugmodel"], max_seq_len=65536))
    batch = {}
    for seq in (32768, 65536):
        cfg, _ = config.load(["--model.name", "qwen3_5", "--training.seq_len", str(seq), "--training.local_batch_size",
                              "1", "--parallelism.context_parallel_degree", "8", "--data.document_mask", "true",
                              "--activation_checkpoint.mode", "full"])
        (role,) = dry_run(cfg, 8, [0])["_roles"]
        peak = role.peaks[role.peak_phase]
        batch[seq] = peak["total"] - peak["parameters"] - peak["gradients"] - peak["optimizer"]
    assert 1.2 * batch[32768] < batch[65536] <= 2 * batch[32768], batch
