"""Dry run of one real training step at any scale, on one CPU process, allocating nothing:

    python -m titanlite.dryrun --config X --ngpu N [--gpu h100] [--power-limit W] [--rank R] [--out FILE] [--full]
                               [--section.key value ...]
    python -m titanlite.dryrun --check-memory LOCAL_RANKS --ngpu N ...   (run_train.sh's pre-launch check)
    python -m titanlite.dryrun --config X --ngpu N --generate BATCHxCONTEXT [--gpu h100] [--out FILE]
        (a generation job's memory per rank instead: titanlite.dryrun.generation)

One process plays rank R of an N-rank job on torch's fake process group (collectives do
nothing) with fake tensors (shapes, no storage): the real config loading and preflight, the
real model build and parallelize, and one real step (forward, backward, gradient norm,
clipping, AdamW). titanlite.dryrun.steptrace watches it: peak memory by category, collectives,
FLOPs. titanlite.dryrun.hardware turns that into a predicted step time for a named GPU.

The step is traced with a few of the model's blocks (per pipeline stage) and replayed as the
model's depth would run it, one block (or activation-checkpointing period, for `selective` layer
AC) of each kind repeated as often as the model has it (titanlite.dryrun.blocktrace); a pipeline stage runs three micro-batches and counts
the others as copies (titanlite.dryrun.pptrace). `--full` traces every block and micro-batch. See docs/scaling.md.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from functools import cache, partial
from pathlib import Path

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.optim.optimizer import register_optimizer_step_pre_hook

from titanlite import rl
from titanlite.config import load as config_load
from titanlite.config.job import JobConfig
from titanlite.dryrun import hardware, timing
from titanlite.dryrun.evaltrace import eval_transient
from titanlite.dryrun.generation import generation_memory, print_generation
from titanlite.dryrun.grpo import grpo_times, print_grpo
from titanlite.dryrun.blocktrace import BlockWatch, Selection, select, shallow_plan
from titanlite.dryrun.hardware import GIB
from titanlite.dryrun.phases import phase_times
from titanlite.dryrun.pptrace import skip_microbatches
from titanlite.dryrun.replay import Trace, result as replay
from titanlite.dryrun.report import print_table, report
from titanlite.dryrun.standins import TracedReferee, fake_routing, fused_norms
from titanlite.dryrun.steptrace import CATEGORIES, PHASES, StepTracer
from titanlite.errors import ConfigError, WorkerError
from titanlite.layers import init
from titanlite.loop import Update, one_step
from titanlite import preference
from titanlite.model_spec import in_model_code
from titanlite.optim import build_optimizers
from titanlite.parallel import context, float8
from titanlite.parallel.mesh import Meshes, ParallelDims
from titanlite.preflight import Plan, check_attention, make_plan, preflight


@cache
def throwaway_folder() -> str:
    """One empty dump folder for every dry run this process plans (the planner plans hundreds),
    removed at its exit; the roles' forked processes leave it alone."""
    folder, owner = tempfile.mkdtemp(prefix="titanlite-dryrun-"), os.getpid()
    atexit.register(lambda: os.getpid() == owner and shutil.rmtree(folder, ignore_errors=True))
    return folder


def dry_config(cfg: JobConfig, device: str = "cuda") -> JobConfig:
    """The job as `device` would run it, traced eagerly on CPU fake tensors: the parameter
    dtype that `auto` picks there, no compile (eager memory is an upper bound of compiled;
    timing.step_times times the compiled blocks from the same trace),
    and a throw-away dump folder (preflight checks it is writable). Attention is traced with
    the sdpa backend: flex's and varlen's kernels cannot run on fake CPU tensors, and sdpa's
    blocked path holds the same linear memory (the report says so)."""
    t = cfg.training
    param = t.mixed_precision_param
    if param == "auto":
        param = "bfloat16" if device == "cuda" else "float32"
    return dataclasses.replace(
        cfg, training=dataclasses.replace(t, device="cpu", mixed_precision_param=param),
        compile=dataclasses.replace(cfg.compile, enable=False),
        model=dataclasses.replace(cfg.model, attn_backend="sdpa"),
        job=dataclasses.replace(cfg.job, dump_folder=throwaway_folder()))


def default_roles(dims) -> list[int]:
    """One rank per distinct kind of work: the first rank of the first, of a middle and of the
    last pipeline rank (the first and the last hold the embedding, the output and the loss, and
    the schedule keeps a different number of micro-batches in flight on each). Within a stage
    every rank does the same work, and its first rank holds the largest FSDP shard (padding
    goes to the last ranks)."""
    per_stage = dims.dp_replicate * dims.dp_shard * dims.cp * dims.tp
    return [r * per_stage for r in sorted({0, min(1, dims.pp - 1), dims.pp - 1})]


def group_names(meshes) -> dict:
    names = {}
    for mesh in (meshes.dense, meshes.batch, meshes.loss, meshes.tokens, meshes.experts):
        for dim in mesh.mesh_dim_names:
            names.setdefault(mesh.get_group(dim).group_name, dim)
    # ep's group is often data parallel's too (ep = dp_shard); only expert parallelism all-to-alls
    names["all_to_all", meshes.ep.get_group().group_name] = "ep"
    return names


def trace_step(cfg: JobConfig, plan: Plan, meshes: Meshes, selection: Selection, fake: FakeTensorMode,
               device: str = "cuda", full: bool = False) -> Trace:
    """Set the model up with the selected blocks (titanlite.dryrun.blocktrace.select) as train.py
    does and trace one step, replayed as the model's full depth would run it: each unit (a block
    period of one kind) repeated as often as the stage runs its kind, in forward and backward,
    for each traced micro-batch (three per stage unless `full`: titanlite.dryrun.pptrace), with
    what those blocks hold and gather outside their own spans."""
    from titanlite.train import build_parts, build_step, parallelize_options

    t, dims = cfg.training, plan.dims
    plan = shallow_plan(plan, selection)
    opts = parallelize_options(cfg, dims, getattr(torch, t.mixed_precision_param), plan.lora)
    parts = build_parts(plan, meshes, opts)  # on meta, outside fake mode: mesh bookkeeping is real
    fake_routing(parts, device)
    if device == "cuda":
        fused_norms(parts)
    accum = plan.global_batch_size // (t.local_batch_size * dims.dp)
    tracer = StepTracer(group_names(meshes))
    with fake:
        # weights stay uninitialised: their values do not change what the step allocates or sends
        for part in parts:
            init.to_empty(part, "cpu")  # a tied weight counted once, as a real run holds it
            part.train()
        optimizers = build_optimizers(parts, cfg.optimizer, cfg.lr_scheduler, t.steps, opts.param_dtype)
        # a preference job: its pair loss, and its reference's forward before the policy's
        step = build_step(cfg, plan, parts, meshes, opts, torch.device("cpu"),
                          preference.build_objective(cfg, opts.loss_parallel, meshes.cp.get_group() if dims.cp > 1
                                                     else None),
                          reference=preference.reference_of(cfg.preference, cfg.data.format, parts, {}))
        if plan.stages is not None and not full:
            skip_microbatches(step.schedule, step.stages, tracer, plan.stages.n_microbatches)
        hooks = [*float8.post_step_hooks(cfg.float8, dims.fsdp, parts), *plan.spec.post_step_hooks(parts, meshes)]
        update = Update.of(parts, step, meshes.stage_ranks, t.max_norm, optimizers, hooks)
        params = update.params
        weights = [p for part in parts for p in part.parameters()]  # the frozen ones too (LoRA's base)
        # trace a steady-state step: AdamW creates its moments in the first step
        for p in params:
            p.grad = torch.zeros_like(p)
        optimizers.step(None)
        optimizers.zero_grad()
        batches = []
        for _ in range(accum):
            ids = torch.randint(0, plan.args.vocab_size, (t.local_batch_size, t.seq_len))
            batch = {"input_ids": ids, "labels": ids if cfg.data.format != "preference" else preference.fake_pairs(ids)}
            if dims.cp > 1:
                batch = context.shard_batch(batch, meshes.cp.get_local_rank(), dims.cp)
            batches.append(batch)
        state = [v for opt in optimizers.optimizers for s in opt.state.values() for k, v in s.items() if k != "step"]
        buffers = [b for part in parts for b in part.buffers()]  # counted with the parameters (RoPE tables)
        tracer.track([*weights, *buffers, *state, *(v for b in batches for v in b.values())])
        tracer.start()
        handles = [register_optimizer_step_pre_hook(lambda *_: tracer.set_phase("optimizer")),
                   *(part.register_forward_pre_hook(lambda *_: tracer.set_phase("forward")) for part in parts)]
        watch = BlockWatch(parts, plan.spec, tracer, selection)
        with tracer:  # train.py's loop body, less checkpointing and logging
            one_step(step, batches, update, TracedReferee(watch))
        for h in handles:
            h.remove()
        watch.close()
        grads = [p.grad for p in params if p.grad is not None]
        trace = replay(tracer, [*weights, *buffers], grads, state, **watch.replay(optimizers))
        if cfg.eval.tasks and plan.stages is None and hasattr(step, "eval_logprobs"):
            optimizers.zero_grad()  # the loop's, before it evaluates
            ids = torch.randint(0, plan.args.vocab_size, (cfg.eval.batch_size, t.seq_len))
            batch = {"input_ids": ids, "labels": ids}
            if dims.cp > 1:
                batch = context.shard_batch(batch, meshes.cp.get_local_rank(), dims.cp)
            trace = dataclasses.replace(trace, eval_transient=eval_transient(tracer, step, batch, parts))
        return trace


@dataclasses.dataclass
class Role:
    """One rank's step at the model's depth."""

    rank: int
    peaks: dict[str, dict[str, float]]
    comms: dict[tuple[str, str, str], dict]
    flops: float
    work: timing.Work
    """What the step computes and sends, for timing.step_times on any GPU."""
    traced_blocks: int
    copied_calls: int  # pipeline calls counted as copies (titanlite.dryrun.pptrace)
    compiled_peaks: dict[str, dict[str, float]]
    """The peaks as compiled blocks hold them (what their partitioner recomputes is not kept)."""
    eval_transient: float | None = None
    """An in-loop evaluation's forward beyond what stays between steps (titanlite.dryrun.evaltrace)."""

    @property
    def peak_phase(self) -> str:
        return max(PHASES, key=lambda p: self.peaks[p]["total"])

    def peaks_as(self, compiled: bool) -> tuple[dict[str, dict[str, float]], str]:
        """The peaks per phase, eager or compiled, and the phase of the largest."""
        peaks = self.compiled_peaks if compiled else self.peaks
        return peaks, max(PHASES, key=lambda p: peaks[p]["total"])

    @property
    def eval_peak(self) -> float | None:
        """An in-loop evaluation's peak in bytes: it runs between steps, where the weights and the
        optimizer state stay and the gradients are gone; None without [eval] tasks."""
        if self.eval_transient is None:
            return None
        return self.peaks["optimizer"]["parameters"] + self.peaks["optimizer"]["optimizer"] + self.eval_transient

    def times(self, gpu: hardware.GPU, compiled: bool, k: timing.Factors = timing.FITTED) -> timing.StepTimes:
        return timing.step_times(self.work, gpu, compiled, k)


def role_of(tr: Trace, selection: Selection, rank: int) -> Role:
    """The traced step's figures, its work compacted for timing."""
    comms = {(c.kind, c.group, c.phase): {"count": c.count, "bytes": c.bytes, "group_size": c.size,
                                          "ranks": c.ranks} for c in tr.comms}
    work = timing.Work(timing.compact(tr.ops), tuple(tr.comms),
                       tuple(timing.Unit(times, timing.compact(ops), timing.compact(fused), tuple(cs), selection.period)
                             for times, ops, fused, cs in tr.units),
                       timing.compact(tr.block_ops), timing.compact(tr.compiled_block_ops))
    return Role(rank, tr.peaks, comms, tr.flops, work, len(selection.chosen), tr.copied, tr.compiled_peaks,
                tr.eval_transient)


def trace_role(cfg: JobConfig, plan: Plan, world_size: int, selection: Selection, device: str, full: bool,
               rank: int) -> Role:
    """Trace rank `rank`'s step with the selected blocks, replayed to the real depth."""
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    # the fake backend exchanges nothing through its store: any in-process store serves
    dist.init_process_group("fake", store=dist.HashStore(), rank=rank, world_size=world_size)
    try:
        meshes = plan.dims.build_meshes("cpu")
        return role_of(trace_step(cfg, plan, meshes, selection, fake, device, full), selection, rank)
    except ConfigError:
        raise
    except Exception as e:  # sent back as text: whatever it holds, its type, message and place arrive
        raise WorkerError.of(e) from None
    finally:
        dist.destroy_process_group()


def dry_run(cfg: JobConfig, world_size: int, ranks: list[int] | None = None, full: bool = False,
            device: str = "cuda") -> dict:
    """Preflight the job as `world_size` ranks on `device`, trace each role's step."""
    backend = cfg.model.attn_backend
    compiled = cfg.compile.enable and "model" in cfg.compile.components
    cfg = dry_config(cfg, device)
    plan = make_plan(cfg, world_size, device)  # a dry run reads no data: it plans any size of job
    groups = cfg.fault_tolerance.group_size if cfg.fault_tolerance.enable else 1
    if groups > 1:  # one replica group's step: its share of the global batch when every group is in the quorum
        plan = dataclasses.replace(plan, global_batch_size=plan.global_batch_size // groups)
    check_attention(backend, plan.args, plan.dims.cp, device == "cuda")
    dims, ac = plan.dims, cfg.activation_checkpoint
    for r in ranks or []:
        if not 0 <= r < world_size:
            raise ConfigError(f"--rank {r} is outside the world of {world_size} ranks; use 0..{world_size - 1}")
    ranks = ranks or default_roles(dims)
    period = ac.selective_every if ac.mode == "selective" and ac.selective_type == "layer" else 1
    selection = select(plan, period, full)
    args = (cfg, plan, world_size, selection, device, full)
    # a fresh process per role, one role too: DTensor caches sharding decisions keyed by process
    # group, which would hand one fake world's groups to the next traced in the same process (or
    # forked from it); forked, the roles also run side by side
    with mp.get_context("fork").Pool(len(ranks), maxtasksperchild=1) as pool:
        roles = pool.map(partial(trace_role, *args), ranks, chunksize=1)
    t = cfg.training
    return {"config": {"model": cfg.model.name, "flavor": cfg.model.variant, "seq_len": t.seq_len,
                       "local_batch_size": t.local_batch_size, "global_batch_size": plan.global_batch_size,
                       "activation_checkpoint": ac.mode, "param_dtype": t.mixed_precision_param,
                       "attn_backend": backend, "compile": compiled, "replica_groups": groups,
                       "float8": cfg.float8.enable and cfg.float8.recipe, "eval_batch_size": cfg.eval.batch_size},
            "world_size": world_size,
            "layout": {"dp_replicate": dims.dp_replicate, "dp_shard": dims.dp_shard, "cp": dims.cp,
                       "tp": dims.tp, "pp": dims.pp, "ep": dims.ep},
            "pipeline": None if plan.stages is None else {
                "schedule": cfg.parallelism.pipeline_parallel_schedule, "stages": plan.stages.n_stages,
                "microbatches": plan.stages.n_microbatches,
                "blocks_per_stage": [b - a for a, b in plan.stages.blocks]},
            "block_kinds": selection.kinds, "_roles": roles, "_plan": plan}


@dataclass(frozen=True)
class Estimate:
    categories: dict[str, float]  # bytes per category live at the peak
    total: float  # the per-rank peak in bytes (the largest over the traced roles)
    phase: str  # the part of the step where the peak falls: forward, backward or optimizer
    eval_total: float | None = None  # an in-loop evaluation's per-rank peak in bytes (the largest); None: no [eval]


def train_device(cfg: JobConfig) -> str:
    t = cfg.training.device
    return "cuda" if t == "cuda" or (t == "auto" and torch.cuda.is_available()) else "cpu"


def estimate(cfg: JobConfig, world_size: int, device: str | None = None) -> tuple[Estimate, ParallelDims]:
    result = dry_run(cfg, world_size, device=device or train_device(cfg))
    compiled = result["config"]["compile"]
    role = max(result["_roles"], key=lambda r: (lambda p, ph: p[ph]["total"])(*r.peaks_as(compiled)))
    peaks, phase = role.peaks_as(compiled)
    evals = [r.eval_peak for r in result["_roles"] if r.eval_peak is not None]
    return (Estimate({c: peaks[phase][c] for c in CATEGORIES}, peaks[phase]["total"], phase, max(evals, default=None)),
            result["_plan"].dims)


def device_limit_gib(local_ranks: int) -> tuple[float, str]:
    """Memory one rank may use here: the GPU's, or the host's available memory shared by the local ranks."""
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory / GIB, torch.cuda.get_device_name(0)
    with open("/proc/meminfo") as f:
        avail = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    return avail / GIB / local_ranks, f"available host memory / {local_ranks} local rank(s)"


# fp32 weights, their gradients and at least one optimizer state (Muon's momentum; AdamW keeps two)
MIN_BYTES_PER_PARAM = 12


def check_memory(cfg: JobConfig, world_size: int, local_ranks: int, n_params: int) -> None:
    """run_train.sh's preflight: refuse (or warn about) a job whose per-rank peak estimate (its
    step's, or its in-loop evaluation's) exceeds what this machine has by more than 10%. A model
    whose parameters alone cannot fit, even sharded over every rank, is refused before the dry
    run, which would trace it for minutes (a 10^11-row vocabulary)."""
    if cfg.job.memory_check == "off":
        return
    limit, what = device_limit_gib(local_ranks)
    floor = n_params * MIN_BYTES_PER_PARAM / world_size / GIB
    if floor > 1.1 * limit and cfg.job.memory_check == "error":
        what_model = (f"model.vocab_size {cfg.model.vocab_size}" if cfg.model.vocab_size
                      else f"model.hf_config {cfg.model.hf_config}" if cfg.model.hf_config
                      else f"model.flavor {cfg.model.flavor}")
        raise ConfigError(f"{what_model} ({cfg.model.name} {cfg.model.variant}): {n_params:,} parameters need at "
                          f"least {floor:,.0f} GiB per rank "
                          f"(weights, gradients and one optimizer state, sharded over all {world_size} ranks), "
                          f"more than {limit:.2f} GiB ({what}); use a smaller model or more ranks")
    est, _ = estimate(cfg, world_size, train_device(cfg))
    if est.total / GIB > 1.1 * limit:
        msg = (f"the estimated per-rank peak {est.total / GIB:.2f} GiB (during {est.phase}) exceeds {limit:.2f} GiB "
               f"({what}) by more than 10%; use more ranks or a larger tensor_parallel_degree, "
               "activation_checkpoint.mode full or a smaller training.local_batch_size "
               "(job.memory_check = warn or off skips this check)")
    elif est.eval_total is not None and est.eval_total / GIB > 1.1 * limit:
        msg = (f"an evaluation's estimated per-rank peak {est.eval_total / GIB:.2f} GiB (eval.batch_size "
               f"{cfg.eval.batch_size} x training.seq_len {cfg.training.seq_len}) exceeds {limit:.2f} GiB ({what}) by "
               "more than 10%; use a smaller eval.batch_size (job.memory_check = warn or off skips this check)")
    else:
        return
    if cfg.job.memory_check == "error":
        raise ConfigError(msg)
    print(f"titanlite: warning: {msg}", file=sys.stderr)


def split_flags(argv: list[str], opts: dict, switches: tuple[str, ...] = ()) -> list[str]:
    """Set opts[key] from each `--key value` or `--key=value` whose key (dashes as underscores)
    `opts` has, and to True for each of `switches` (flags without a value); return the other
    arguments (the config's)."""
    rest, i = [], 0
    while i < len(argv):
        name, eq, value = argv[i].partition("=")
        key = name[2:].replace("-", "_")
        if name in switches:
            if eq:
                raise ConfigError(f"{name} takes no value, got '{argv[i]}'; write {name}")
            opts[key] = True
        elif name.startswith("--") and key in opts:
            if not eq:
                if i + 1 >= len(argv):
                    raise ConfigError(f"{name} needs a value")
                i, value = i + 1, argv[i + 1]
            opts[key] = value
        else:
            rest.append(argv[i])
        i += 1
    return rest


def _parse(argv: list[str]) -> tuple[dict, list[str]]:
    opts = {"ngpu": "1", "gpu": "h100", "power_limit": None, "rank": None, "out": None, "check_memory": None,
            "generate": None}
    rest = split_flags(argv, opts, ("--full",))
    if opts["power_limit"] is not None:
        try:
            opts["power_limit"] = float(opts["power_limit"])
        except ValueError:
            raise ConfigError(f"--power-limit: expected watts (a positive number), got '{opts['power_limit']}'") from None
    for key in ("ngpu", "rank", "check_memory"):
        if opts[key] is not None and not opts[key].isdigit():
            raise ConfigError(f"--{key.replace('_', '-')}: expected a non-negative integer, got '{opts[key]}'")
    if int(opts["ngpu"]) < 1:
        raise ConfigError(f"--ngpu: expected a positive integer, got '{opts['ngpu']}'")
    return opts, rest


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__)
        return
    start = time.perf_counter()
    what, skip = "the dry run", ""
    try:
        opts, rest = _parse(argv)
        if opts["check_memory"] is not None:
            what, skip = "the preflight", "; ./run_train.sh --skip-preflight launches without it"
        gpu = hardware.get_gpu(opts["gpu"], opts["power_limit"])
        cfg, _ = config_load.load(rest)
        if opts["check_memory"] is not None:
            # run_train.sh's whole pre-launch check in one process: the trainer's own preflight
            # of the job as given, then the memory estimate
            plan = rl.checked(cfg, preflight(cfg, int(opts["ngpu"])))
            check_memory(cfg, int(opts["ngpu"]), int(opts["check_memory"]), plan.n_params)
            return
        if opts["generate"] is not None:
            rep = generation_memory(cfg, int(opts["ngpu"]), opts["generate"], gpu)
            print_generation(rep)
            if opts["out"]:
                Path(opts["out"]).write_text(json.dumps(rep, indent=1))
            if not rep["fits"]:
                raise ConfigError(f"the generation job's {rep['bytes']['total'] / GIB:.1f} GiB per rank exceed the "
                                  f"{gpu.name}'s {gpu.memory_gib:.1f} GiB; a larger --ngpu splits the heads and "
                                  "feed-forward widths (not a MoE layer's experts), a smaller BATCHxCONTEXT the cache")
            return
        ranks = None if opts["rank"] is None else [int(opts["rank"])]
        result = dry_run(cfg, int(opts["ngpu"]), ranks, opts.get("full", False))
        rep = report(result, gpu)  # a warm-up's memory is its last phase's; each earlier one's step time:
        rep["phases"] = phase_times(cfg, result["_plan"], int(opts["ngpu"]),
                                    lambda job, n: report(dry_run(job, n), gpu))
        if cfg.rl.enable:  # a GRPO step: the rollout, then the update traced above
            plan = result["_plan"]
            rl.check_layout(cfg, plan.dims, plan.global_batch_size, plan.schedule.warms_up)
            rep["grpo"] = grpo_times(cfg, result["_plan"], gpu, rep["predicted"]["step_s"],
                                     rep["config"]["param_dtype"])
    except ConfigError as e:
        print(f"titanlite: error: {e}", file=sys.stderr)
        sys.exit(2)
    except Exception as e:  # a titanlite bug, or a torch it does not know: one line, the traceback kept
        path = Path(tempfile.gettempdir(), f"titanlite-dryrun-{os.getpid()}.txt")
        path.write_text(traceback.format_exc() + (f"\nraised in a traced rank's process:\n{e.tb}"
                                                  if isinstance(e, WorkerError) else ""))
        mine = in_model_code(e)
        if mine is not None:  # the model's own code: launching without the dry run fails the same way
            print(f"titanlite: error: {what} failed in the model's code, {mine}; traceback in {path}",
                  file=sys.stderr)
            sys.exit(1)
        said = e if isinstance(e, WorkerError) else WorkerError.of(e)  # type, message, file:line alike
        print(f"titanlite: error: {what} failed inside titanlite ({said}) on torch {torch.__version__}; traceback "
              f"in {path}{skip}", file=sys.stderr)
        sys.exit(1)
    print_table(rep)
    if "grpo" in rep:
        print_grpo(rep["grpo"])
    print(f"(dry run took {time.perf_counter() - start:.1f} s)")
    if opts["out"]:
        with open(opts["out"], "w") as f:
            json.dump(rep, f, indent=1)
    evals = [r["eval_peak_gib"] for r in rep["roles"] if r["eval_peak_gib"] is not None]
    if evals and max(evals) > gpu.memory_gib:
        print(f"titanlite: error: an evaluation's per-rank peak {max(evals):.1f} GiB (eval.batch_size "
              f"{rep['config']['eval_batch_size']} x training.seq_len {rep['config']['seq_len']}) exceeds the "
              f"{gpu.name}'s {gpu.memory_gib:.1f} GiB; use a smaller eval.batch_size", file=sys.stderr)
        sys.exit(2)
    if not rep["predicted"]["fits"]:
        peak = max(r["memory_gib"]["peak"] for r in rep["roles"])
        print(f"titanlite: error: the per-rank peak {peak:.1f} GiB exceeds the {gpu.name}'s "
              f"{gpu.memory_gib:.1f} GiB; use more GPUs (data_parallel_shard_degree), a larger "
              "tensor_parallel_degree, activation_checkpoint.mode full or a smaller training.local_batch_size",
              file=sys.stderr)
        sys.exit(2)

