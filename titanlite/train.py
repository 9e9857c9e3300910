"""Training entry point: `python -m titanlite.train --config X.toml [--section.key value ...]`.

Setup builds the model parts (the whole model, or this rank's pipeline stages), applies the
parallel plan to each, picks the step (plain or pipelined) and the post-step hooks. The loop
then runs the same for every layout: the step's forward/backward, the global gradient norm,
clipping, the optimizer, the hooks, checkpoint, metrics and validation.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torchdata.stateful_dataloader import StatefulDataLoader

from titanlite import preference, rl
from titanlite.checkpoint import lora
from titanlite.checkpoint.dcp import CheckpointManager
from titanlite.checkpoint.merge import ModelMerge
from titanlite.checkpoint.resume import flat_config
from titanlite.config import load as config_load
from titanlite.config.job import JobConfig
from titanlite.data.loader import batches_of, build_dataloader, ignored_keys_note
from titanlite.data.packing import data_counts, data_notes
from titanlite.data.validation import Validator
from titanlite.errors import ConfigError, RunError
from titanlite.eval.score import Evaluator, by_whole_rows
from titanlite.layers import init
from titanlite.layers.attention import AttnSetup
from titanlite.loss import LossFn, logged_terms
from titanlite.loop import Update, one_step
from titanlite.metrics import MetricsLogger, Throughput, default_run_name, device_peak_flops
from titanlite.model_spec import in_model_code
from titanlite.optim import build_optimizers, warmup_note
from titanlite.layers.lora import DROPOUT_MASKS, LoRASetup
from titanlite.parallel import context, float8, pipeline
from titanlite.parallel.apply import ParallelizeOptions, parallelize
from titanlite.parallel.mesh import Meshes, init_process_group, pick_device
from titanlite.preflight import Plan, param_dtype, preflight
from titanlite.runtime import console, fault, gc_control, launch
from titanlite.runtime.determinism import set_determinism
from titanlite.runtime.fault import Guard, enable_flight_recorder
from titanlite.runtime.launch import last_word
from titanlite.runtime.profiling import Profiler
from titanlite.runtime.replicas import Replicas
from titanlite.runtime.restart import Restart
from titanlite.runtime.spikes import SpikeWindow, Stragglers
from titanlite.runtime.verdict import Counts
from titanlite.step import PlainStep
from titanlite.step_log import GuardReferee, StepLog, logged


def parallelize_options(cfg: JobConfig, dims, dtype: torch.dtype, lora: LoRASetup | None = None) -> ParallelizeOptions:
    reshard = cfg.parallelism.fsdp_reshard_after_forward
    # a stage's parameters serve every micro-batch of the step: gathering them once pays
    reshard = "never" if dims.pp > 1 and reshard == "default" else reshard
    return ParallelizeOptions(param_dtype=dtype, reduce_dtype=getattr(torch, cfg.training.mixed_precision_reduce),
                              reshard_after_forward=reshard,
                              activation_checkpoint=cfg.activation_checkpoint, compile=cfg.compile,
                              loss_parallel=cfg.parallelism.loss_parallel and dims.tp > 1,
                              sequence_parallel=cfg.parallelism.sequence_parallel, float8=cfg.float8, lora=lora)


def build_parts(plan: Plan, meshes: Meshes, opts: ParallelizeOptions) -> list[nn.Module]:
    """This rank's model parts, parallelized, on meta (one part: the whole model); train()
    materializes them, the dry run fills them with fake tensors."""
    with torch.device("meta"):
        if plan.stages is None:
            parts = [plan.spec.build(plan.args)]
        else:
            parts = pipeline.stage_modules(plan.spec, plan.args, plan.stages, meshes)
    for part in parts:
        parallelize(part, plan.spec, meshes, opts)
    return parts


def build_step(cfg: JobConfig, plan: Plan, parts: list[nn.Module], meshes: Meshes, opts: ParallelizeOptions,
               device: torch.device, loss_fn: LossFn, replicas: Replicas | None = None, reference=None
               ) -> PlainStep | pipeline.PipelineStep | preference.PreferenceStep:
    """The step object for this layout (train.py and the dry run pick it the same way);
    `loss_fn`: titanlite.preference.build_objective's, or that wrapped (fault injection);
    `reference`: titanlite.preference.reference_of's (a preference run's reference pass)."""
    # FSDP casts parameters itself; without it, autocast gives the same mixed precision
    autocast = (torch.autocast(device.type, dtype=opts.param_dtype)
                if opts.param_dtype != torch.float32 and not plan.dims.fsdp else contextlib.nullcontext())
    cp = context.ContextParallel.of(meshes.cp.get_group()) if plan.dims.cp > 1 else None
    attn = AttnSetup(cfg.model.attn_backend, tuple({plan.args.window(i) for i in range(plan.args.n_layers)}), cp)
    sft = cfg.data.format == "preference" and cfg.preference.sft_weight > 0
    if plan.stages is None:
        return preference.wrap(PlainStep(parts[0], loss_fn, opts.loss_parallel, attn, meshes.dp_cp.get_group(),
                                         autocast, across=None if replicas is None else replicas.count), parts,
                               reference, sft, meshes.dp_cp.get_group())
    shapes = pipeline.stage_shapes(plan.spec, plan.args, cfg.parallelism.pipeline_parallel_microbatch_size,
                                   cfg.training.seq_len, plan.dims, opts)
    return preference.wrap(pipeline.PipelineStep(parts, plan.stages, cfg.parallelism.pipeline_parallel_schedule,
                                                 meshes, loss_fn, opts, attn, autocast, device, shapes), parts,
                           reference, sft, meshes.dp_cp.get_group())


@dataclass(frozen=True)
class Prepare:
    """This rank's part of a loader micro-batch, on the device (training and validation)."""

    device: torch.device
    cp_rank: int
    cp: int

    def __call__(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        # pinned host memory on GPU: the copies overlap with compute
        batch = {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}
        return context.shard_batch(batch, self.cp_rank, self.cp) if self.cp > 1 else batch


def roll_back(ckpt: CheckpointManager, guard: Guard, loader: StatefulDataLoader, rank: int, streak: list[int]) -> int:
    """PaLM's recipe for a run of spikes (`streak`, its steps): back to the newest checkpoint,
    the spiking steps' data skipped from then on (recorded in the checkpoint), the verdicts'
    counts kept (the spikes happened). Returns the step it resumes after."""
    first, last, n = streak[0], streak[-1], len(streak)
    sampler = loader.batch_sampler  # the samples each step read, ranges skipped before counted
    start, end = sampler.sample_range(first, last)
    guard.phase("checkpoint save")  # loading takes a save's time
    if not ckpt.candidates():
        raise RunError(f"step {last}: {n} spikes in a row and no checkpoint to go back to yet (training.on_spike = "
                       "rollback); lower checkpoint.interval or set training.on_spike = skip")
    counts = guard.verdict.counts.state_dict()
    step = ckpt.maybe_load(say=False)
    guard.verdict.counts.load_state_dict(counts)
    ckpt.optional["skipped_samples"].add(start, end)
    guard.rolled_back(step)
    if rank == 0:
        print(f"titanlite: warning: step {last}: {n} spikes in a row (steps "
              f"{first}-{last}); rolled back to step {step}, samples {start}-{end} skipped from now on "
              "(training.on_spike = rollback)", file=sys.stderr, flush=True)
    return step


def start_process(cfg: JobConfig) -> torch.device:
    """This process's device, determinism, flight recorder, process group and seed."""
    device = pick_device(cfg.training.device)
    if cfg.training.deterministic:  # before the process group: NCCL's set-up may already run CUDA work
        set_determinism(device)
    enable_flight_recorder(cfg.job.dump_folder)
    init_process_group(device, cfg.comm.init_timeout_s)
    torch.manual_seed(cfg.training.seed)
    return device


def build_checkpointer(cfg: JobConfig, plan: Plan, parts: list[nn.Module], optimizers, loader, meshes: Meshes,
                       device: torch.device) -> tuple[CheckpointManager, SpikeWindow | None, Counts]:
    """The checkpoint manager, and what it saves and restores for the fault guard and the
    in-run merge: the spike window (training.on_spike), the step verdicts' counts and the
    running sum of checkpoint.merge_last, so that a resumed run judges, counts and merges as an
    uninterrupted one would."""
    t = cfg.training
    ckpt = CheckpointManager(cfg.checkpoint, cfg.job.dump_folder, parts=parts, optimizers=optimizers,
                             loader=loader, data=cfg.data, seq_len=t.seq_len,
                             global_batch_size=plan.global_batch_size, spec=plan.spec, args=plan.args,
                             final_step=t.steps, tied=() if plan.stages is None else plan.stages.tied,
                             writer_group=lambda: meshes.groups.own("gloo", cfg.comm.save_timeout_s),
                             transformed=None if plan.lora is None else lora.checkpointing(plan.lora, cfg, plan.spec,
                                                                                            plan.args),
                             config=flat_config(cfg), layout=plan.dims.layout)
    window = SpikeWindow(t.spike_window, t.spike_sigmas, device) if t.on_spike != "off" else None
    if window is not None:
        ckpt.optional["spike_window"] = window
    ckpt.optional["guard"] = counts = Counts()
    if cfg.checkpoint.merge_last:  # the running sum of the weights it averages at each scheduled save
        ckpt.optional["merge"] = ModelMerge(parts, cfg.checkpoint, t.steps)
    return ckpt, window, counts


def end_of_step(ckpt: CheckpointManager, step: int, stop: bool) -> None:
    """After a step's update: its weights join checkpoint.merge_last's running sum (the window's
    average is written with the save), then the save that is due (or forced by a stop)."""
    if merge := ckpt.optional.get("merge"):
        merge.add(step)
    ckpt.maybe_save(step, force=stop)


def end_of_run(cfg: JobConfig, ckpt: CheckpointManager, parts: list[nn.Module], step: int) -> None:
    """After the last step, on every rank: the exports the run asks for, the LoRA adapter as a
    PEFT folder (lora.export_folder) and the model in checkpoint.export_dtype."""
    if ckpt.transformed is not None and ckpt.transformed.final is not None:
        ckpt.transformed.final(parts)
    if cfg.checkpoint.export_dtype:
        ckpt.export(step, getattr(torch, cfg.checkpoint.export_dtype))


def build_validator(cfg: JobConfig, plan: Plan, meshes: Meshes) -> Validator:
    t, dims = cfg.training, plan.dims
    return Validator(cfg.validation, cfg.data, plan.tokenizer, t.seq_len, plan.global_batch_size, t.local_batch_size,
                     meshes.dp.get_local_rank(), dims.dp, meshes.loss_group,
                     meshes.dp_cp.get_group() if dims.pp > 1 else None)


def announce(cfg: JobConfig, plan: Plan, meshes: Meshes, device: torch.device, dtype: torch.dtype,
             loader: StatefulDataLoader, restart_line: str | None) -> None:
    """The run's first line (a restarted attempt's: what failed, and where it resumed), and the
    LoRA, warm-up and chat data notes, on rank 0."""
    t = cfg.training
    if dist.get_rank() == 0:
        if restart_line:
            print(restart_line, flush=True)
        accum = plan.global_batch_size // (t.local_batch_size * plan.dims.dp)
        print(f"titanlite: {cfg.model.name} {cfg.model.variant} ({plan.n_params / 1e6:.1f}M params), {plan.dims}, "
              f"global batch {plan.global_batch_size} x {t.seq_len} tokens, {accum} micro-batch(es), "
              f"{device.type}, {dtype}, {meshes.groups.count} process groups per rank", flush=True)
        if plan.lora is not None:
            print(f"titanlite: LoRA rank {plan.lora.rank} on {len(plan.lora.targets)} layers"
                  f"{f', {len(plan.lora.full)} modules trained whole' if plan.lora.full else ''}: "
                  f"{plan.lora.trained / 1e6:.3g}M parameters train, {plan.lora.frozen / 1e6:.3g}M are frozen", flush=True)
            if plan.lora.dropout > 0:
                print(f"titanlite: LoRA dropout {plan.lora.dropout}: {DROPOUT_MASKS}", flush=True)
        for note in plan.spec.notes(plan.args):
            print(note, flush=True)
        if warmup_note(cfg.lr_scheduler, t.steps):
            print(warmup_note(cfg.lr_scheduler, t.steps), flush=True)
        for phase in plan.schedule.phases if plan.schedule.warms_up else ():
            print(f"titanlite: warm-up {phase.describe()}", flush=True)
        if note := ignored_keys_note(cfg.data):
            print(note, file=sys.stderr, flush=True)
        for note in data_notes(loader.dataset):
            print(note, flush=True)


def open_metrics(cfg: JobConfig, plan: Plan, device: torch.device, start_step: int,
                 restarted: Restart | None) -> tuple[MetricsLogger, Throughput, Stragglers | None]:
    """The run's metrics (named by job.run_name), throughput clock and straggler report; a
    restarted attempt's restarts.jsonl row first."""
    t, rank = cfg.training, dist.get_rank()
    run_name = cfg.job.run_name or default_run_name(cfg.model.name, cfg.model.variant)
    metrics = MetricsLogger(cfg.job.dump_folder, run_name, cfg.metrics.enable_tensorboard, rank == 0, start_step,
                            config_load.to_toml(cfg))
    if rank == 0 and restarted is not None:  # torchrun restarted this job (fault_tolerance.max_restarts)
        restarted.record(cfg.job.dump_folder, start_step, metrics.writer)
    throughput = Throughput(start_step, t.steps, plan.global_batch_size * t.seq_len,
                            plan.spec.flops_per_token(plan.args, t.seq_len), device_peak_flops(device),
                            dist.get_world_size(), lambda step: plan.schedule.samples_before(step + 1) * t.seq_len)
    stragglers = (Stragglers(cfg.metrics.straggler_ratio, cfg.metrics.straggler_logs, device)
                  if cfg.metrics.straggler_ratio > 0 else None)
    return metrics, throughput, stragglers


def stop_cause(guard: Guard) -> str:
    if guard.vote.signal_name is None:
        return "a signal to another rank"
    return guard.vote.signal_name + ("" if guard.vote.users else " (torchrun ending the attempt: another rank failed)")


def finish(dump_folder: str, guard: Guard) -> None:
    """Proof this rank finished, for launchers and tests, written after the last collective."""
    done = Path(dump_folder) / "status"
    done.mkdir(parents=True, exist_ok=True)
    (done / f"rank-{dist.get_rank()}.done").write_text(json.dumps({"step": guard.step,
                                                                     "signal": guard.vote.signal_name}))
    # Every marker exists before any rank starts tearing down (gloo may abort there)
    dist.barrier()


def train(cfg: JobConfig, plan: Plan) -> str | None:
    """Returns the run's last line: how it stopped after a signal, or None."""
    t, dims = cfg.training, plan.dims
    console.quiet(cfg.job.dump_folder, config_load.world_rank())  # noise to logs/, titanlite's lines stay
    launch.register(config_load.world_rank())
    device = start_process(cfg)
    rank = dist.get_rank()
    meshes = dims.build_meshes(device.type, cfg.comm.init_timeout_s)
    dtype = param_dtype(t.mixed_precision_param, device)
    opts = parallelize_options(cfg, dims, dtype, plan.lora)
    parts = build_parts(plan, meshes, opts)
    for part in parts:  # the same values on every layout: f(seed, name, full shape)
        init.materialize(part, device, t.seed)
        part.train()
    optimizers = build_optimizers(parts, cfg.optimizer, cfg.lr_scheduler, t.steps, dtype, plan.schedule.lr_scale)
    dp_rank = meshes.dp.get_local_rank()
    loader = (rl.idle_loader(t.seq_len, plan.global_batch_size, t.local_batch_size, dp_rank, dims.dp) if cfg.rl.enable
              else build_dataloader(cfg.data, plan.tokenizer, seq_len=t.seq_len, global_batch_size=plan.global_batch_size,
                                    local_batch_size=t.local_batch_size, dp_rank=dp_rank, dp_degree=dims.dp,
                                    schedule=plan.schedule))
    ckpt, window, tally = build_checkpointer(cfg, plan, parts, optimizers, loader, meshes, device)
    validator = build_validator(cfg, plan, meshes)
    held = [] if validator.loader is None else [validator.loader.dataset]
    reference = preference.reference_of(cfg.preference, cfg.data.format, parts, ckpt.optional,  # before a resume
                                        [loader.dataset, *held])
    rl_reference = rl.reference_of(cfg, parts[0], ckpt.optional) if cfg.rl.enable else None  # before a resume too
    if cfg.checkpoint.create_seed_checkpoint:
        ckpt.save_seed()
        return None
    restarted = Restart.read()  # torchrun restarted this job: what failed (its line says, once resumed)
    start_step = ckpt.maybe_load(say=restarted is None)
    if start_step >= t.steps:
        ckpt.past_the_end(start_step)
    ft = (Replicas(cfg.fault_tolerance, parts, optimizers, loader, plan.global_batch_size, t.local_batch_size,
                   dims.dp, device, start_step, {"guard": tally},
                   cfg.comm.init_timeout_s) if cfg.fault_tolerance.enable else None)
    # the rerun's data on the next data-parallel rank: a fault that stays with a rank is its machine's
    moved = dims.dp > 1 and not cfg.data.streaming
    rerun = (restarted.rerun(cfg.job.dump_folder, moved) if restarted and cfg.fault_tolerance.rerun_on_nonfinite
             else None)
    guard = Guard(rank, cfg.job.dump_folder, cfg.comm, t, cfg.job.shutdown_timeout_s, start_step,
                  set_comm_timeout=meshes.groups.set_timeout, window=window, counts=tally, rerun=rerun)
    # each rank flags where a non-finite value first appears (not inside blocks compiled whole)
    if cfg.fault_tolerance.rerun_on_nonfinite and not (cfg.compile.enable and "model" in cfg.compile.components):
        guard.watch({k: b for part in parts for k, b in plan.spec.blocks_of(part).items()}, plan.args.n_layers)
    loss_fn = preference.build_objective(cfg, opts.loss_parallel, meshes.cp.get_group() if dims.cp > 1 else None)
    train_step = build_step(cfg, plan, parts, meshes, opts, device, guard.faulty_loss(loss_fn), ft, reference)
    train_step, rollouts = (rl.build(cfg, plan.tokenizer, train_step, meshes, plan.global_batch_size, device, lambda n:
                                     logged(n, cfg.metrics.log_freq, t.steps), rl_reference)
                            if cfg.rl.enable else (train_step, None))
    hooks = [*float8.post_step_hooks(cfg.float8, dims.fsdp, parts), *plan.spec.post_step_hooks(parts, meshes),
             *([rollouts.hook] if rollouts else [])]
    # after build_step, which may make the last process groups
    announce(cfg, plan, meshes, device, dtype, loader,
             restarted and restarted.line(start_step, ft is not None, rerun))
    update = Update.of(parts, train_step, meshes.stage_ranks, t.max_norm, optimizers, hooks,
                       None if ft is None else ft.sync)
    evaluator = Evaluator(cfg.eval, plan.tokenizer, t.seq_len, dp_rank, dims.dp, meshes.loss_group)
    whole_rows = by_whole_rows(dims.pp, dims.tp, dims.ep, cfg.parallelism.sequence_parallel)  # exact match's way
    prepare = Prepare(device, meshes.cp.get_local_rank(), dims.cp)
    once = meshes.tp.get_local_rank() == 0  # tp ranks hold the same loss sum: count it once
    if isinstance(precomputed := ckpt.optional.get("reference"), preference.Precomputed):  # before the loader's workers
        precomputed.compute(train_step, parts, prepare, t.local_batch_size, dp_rank, dims.dp, once, device)
    data_iter = iter(loader)
    metrics, throughput, stragglers = open_metrics(cfg, plan, device, start_step, restarted)
    profiler = Profiler(cfg.profiling, cfg.job.dump_folder, rank, device)
    gc_control.start(t.gc_freq)
    stop_line, verdict = None, guard.verdict
    referee = GuardReferee(guard, ckpt, cfg.optimizer.implementation == "fused", once, cfg.metrics.log_freq, t.steps)
    # streamed sources do not know their length; a GRPO run's idle loader has no epochs to count
    epoch = None if rollouts else getattr(loader.dataset, "epoch", None)
    epoch_of = None if epoch is None else lambda n: epoch(loader.batch_sampler.first_sample(n))
    log = StepLog(metrics, throughput, stragglers, guard, plan, device, once, epoch_of, data_counts(loader.dataset),
                  window is not None, logged_terms(plan.spec.extra_losses, plan.spec.tp_replicated_losses, t.z_loss,
                                                   preference.METRICS if cfg.data.format == "preference" else ()))

    step = start_step
    while step < t.steps:
        step = step if ft is None else ft.begin(step, throughput)  # the quorum; a group behind heals from a peer
        step += 1
        guard.start_step(step)
        profiler.step_begin(step)
        lr = optimizers.lr
        batches = (rollouts(step) if rollouts else ft.batches(step) if ft else
                   [next(data_iter) for _ in range(plan.schedule.phase(step).micro_batches)])
        if rerun is not None and rerun.moved and step == rerun.step:
            batches = batches_of(loader, step, (dp_rank + 1) % dims.dp)
        result = one_step(train_step, [prepare(b) for b in batches], update, referee)
        if result is None:  # replica groups: a group left or failed mid-step; the same batch again
            optimizers.zero_grad()
            step -= 1
            continue
        optimizers.step_schedule()
        optimizers.zero_grad()
        gc_control.maybe_collect(step, t.gc_freq)
        profiler.step_end(step)
        if t.on_spike == "rollback" and len(verdict.streak) >= t.spike_rollback_after:
            streak = list(verdict.streak)
            log(step, result, lr)  # the streak's last step too, read and recorded, then marked superseded
            step = roll_back(ckpt, guard, loader, rank, verdict.streak or streak)
            metrics.rewind(step)
            data_iter = iter(loader)
            throughput.last, throughput.last_step = time.perf_counter(), step
            continue
        guard.phase("checkpoint save")
        if ft is None or ft.writes_checkpoints():
            end_of_step(ckpt, step, verdict.stop)
        if logged(step, cfg.metrics.log_freq, t.steps) or verdict.stop:
            log(step, result, lr)
        if verdict.stop:
            stop_line = f"titanlite: stopped at step {step} after {stop_cause(guard)}"
            break
        if validator.due(step, t.steps):
            guard.phase("validation")
            val_start = time.perf_counter()
            metrics.log_validation(step, validator(parts, prepare, train_step.eval_loss_sum, device),
                                   preference.held_out(loss_fn, once, device))
            throughput.pause(time.perf_counter() - val_start)  # keep tokens_per_sec about training
        if evaluator.due(step, t.steps):  # downstream tasks (titanlite.eval.score)
            guard.phase("evaluation")
            metrics.log_eval(step, scores := evaluator(parts, prepare, train_step.eval_logprobs, device,
                                                        train_step.eval_rows if whole_rows else None))
            throughput.pause(scores["eval/seconds"])

    gc_control.stop(t.gc_freq)
    guard.phase("checkpoint save")  # the last save may still be writing
    if step >= t.steps and (ft is None or ft.writes_checkpoints()):  # a resume past the end exports too
        end_of_run(cfg, ckpt, parts, step)
    ckpt.close()
    guard.close()
    if ft is not None:
        ft.close()
    metrics.close()
    finish(cfg.job.dump_folder, guard)
    return stop_line


def main(argv: list[str] | None = None) -> None:
    try:
        cfg, flags = config_load.load(sys.argv[1:] if argv is None else argv)
        if flags & {"--help", "-h"}:
            print(config_load.help_text())
            return
        if "--print-config" in flags:
            print(config_load.to_toml(cfg))
            return
        plan = rl.checked(cfg, preflight(cfg, config_load.world_size()))
        if "--check" in flags:
            return
        line = train(cfg, plan)
        last_word(dist.get_rank(), 0, line, **fault.facts(None))
    except ConfigError as e:
        rank = dist.get_rank() if dist.is_initialized() else config_load.world_rank()
        last_word(rank, 2, f"titanlite: error: {e}" + (f" [rank {rank}]" if rank else ""))
        sys.exit(2)
    except KeyboardInterrupt:  # Ctrl-C before training started (the Guard handles it after)
        last_word(config_load.world_rank(), 130,
                  "titanlite: stopped by SIGINT before training started; nothing was saved")
        os._exit(130)
    except Exception as e:
        fault.defer_to_watchdog()
        err = e if isinstance(e, RunError) else fault.as_run_error(e)
        rank = dist.get_rank() if dist.is_initialized() else config_load.world_rank()
        where = f" [rank {rank}]" if rank else ""
        if err is None:  # a bug: its line is the run's (before a peer's consequence), its traceback stays
            mine = in_model_code(e)
            first = (str(e).strip().splitlines() or [""])[0]
            log = console.log_path()
            last_word(rank, 1, f"titanlite: error: the model's code failed, {mine}{where}" if mine else
                      f"titanlite: error: {type(e).__name__}: {first}{where} (unexpected; the traceback is in "
                      + (str(log) if log else f"rank {rank}'s output, LOG_RANK={rank}") + ")", **fault.facts(e))
            raise
        last_word(rank, 1, f"titanlite: error: {err}{where}", **fault.facts(err))
        # no process-group teardown: with a peer dead or diverged it can hang or abort
        os._exit(1)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
