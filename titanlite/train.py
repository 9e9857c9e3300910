"""Training entry point: `python -m titanlite.train --config X.toml [--section.key value ...]`.

One step: pull this rank's micro-batches of the global batch, count the global target
tokens, run forward/backward on each micro-batch with the loss summed over tokens and
divided by that count, clip by the global norm, step.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from titanlite import config, context_parallel, fault, float8, gc_control
from titanlite.attention import AttnContext
from titanlite.checkpoint import CheckpointManager
from titanlite.config import ConfigError, JobConfig
from titanlite.data import build_dataloader, probe_data
from titanlite.dist import ParallelDims, init_process_group, pick_device
from titanlite.fault import Guard, RunError, enable_flight_recorder
from titanlite.loss import IGNORE_INDEX, build_loss_fn, loss_context
from titanlite.metrics import MetricsLogger, device_peak_flops, peak_memory_gib
from titanlite.model_spec import ModelSpec, get_model_spec, model_args
from titanlite.optim import build_lr_scheduler, build_optimizer
from titanlite.parallel import ParallelizeOptions, local_grad_sq, reduce_partial_grads
from titanlite.profiling import Profiler
from titanlite.tokenizer import Tokenizer, build_tokenizer
from titanlite.validate import Validator


@dataclass
class Plan:
    """Everything decided before any process group or weight exists."""

    dims: ParallelDims
    spec: ModelSpec
    args: Any
    tokenizer: Tokenizer
    global_batch_size: int


def preflight(cfg: JobConfig, world_size: int) -> Plan:
    """All checks that need no process group, so bad input fails fast on every rank."""
    dims = ParallelDims.from_config(cfg.parallelism, world_size)
    spec = get_model_spec(cfg.model.name)
    args = model_args(spec, cfg.model.flavor, cfg.model.vocab_size, cfg.training.seq_len)
    spec.validate(args, dims)
    context_parallel.validate(cfg.training.seq_len, dims.cp)
    # sequence parallel splits each rank's (context-parallel) share of the sequence over tp
    if cfg.parallelism.sequence_parallel and cfg.training.seq_len % (dims.tp * dims.cp):
        cp = f" x context_parallel_degree {dims.cp}" if dims.cp > 1 else ""
        raise ConfigError(f"training.seq_len {cfg.training.seq_len} is not divisible by "
                          f"parallelism.tensor_parallel_degree {dims.tp}{cp}, as sequence parallel needs; "
                          "change one or set parallelism.sequence_parallel = false")
    float8.preflight(cfg.float8, cfg.training.device, dims.tp)
    tokenizer = build_tokenizer(cfg.data.tokenizer)
    if cfg.checkpoint.create_seed_checkpoint and world_size != 1:
        raise ConfigError(f"checkpoint.create_seed_checkpoint runs on one process, not {world_size}; "
                          "launch it without torchrun or with --nproc_per_node=1")
    probe_data(cfg.data, cfg.validation)
    if tokenizer.vocab_size > args.vocab_size:
        raise ConfigError(f"data.tokenizer has {tokenizer.vocab_size} ids but the model embeds only "
                          f"{args.vocab_size}; set model.vocab_size >= {tokenizer.vocab_size}")
    t = cfg.training
    if t.device == "cuda":
        pick_device("cuda")
    check_writable(cfg.job.dump_folder)
    gbs = t.local_batch_size * dims.dp if t.global_batch_size == -1 else t.global_batch_size
    if gbs % (t.local_batch_size * dims.dp):
        raise ConfigError(f"training.global_batch_size {gbs} is not divisible by local_batch_size "
                          f"{t.local_batch_size} x dp degree {dims.dp} = {t.local_batch_size * dims.dp}")
    return Plan(dims, spec, args, tokenizer, gbs)


def check_writable(folder: str) -> None:
    """Refuse a dump folder that cannot be created or written, before any rank starts."""
    path = Path(folder)
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".write-test-"):
            pass
    except OSError as e:
        raise ConfigError(f"job.dump_folder: cannot write to '{folder}' ({e.strerror}); "
                          "pick a writable folder") from None


def _dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


def train(cfg: JobConfig, plan: Plan) -> None:
    t = cfg.training
    device = pick_device(t.device)
    enable_flight_recorder(cfg.job.dump_folder)
    init_process_group(device, cfg.comm.init_timeout_s)
    rank = dist.get_rank()
    torch.manual_seed(t.seed)
    if t.deterministic:
        torch.use_deterministic_algorithms(True)
    dims = plan.dims
    meshes = dims.build_meshes(device.type)
    param_dtype = _dtype(t.mixed_precision_param, device)

    with torch.device("meta"):
        model = plan.spec.build(plan.args)
    opts = ParallelizeOptions(param_dtype=param_dtype, reduce_dtype=getattr(torch, t.mixed_precision_reduce),
                              reshard_after_forward=cfg.parallelism.fsdp_reshard_after_forward,
                              activation_checkpoint=cfg.activation_checkpoint, compile=cfg.compile,
                              loss_parallel=cfg.parallelism.loss_parallel and dims.tp > 1,
                              sequence_parallel=cfg.parallelism.sequence_parallel,
                              float8=cfg.float8)
    plan.spec.parallelize(model, meshes, opts)
    model.to_empty(device=device)
    model.init_weights(torch.Generator(device).manual_seed(t.seed))
    model.train()

    optimizer = build_optimizer(model, cfg.optimizer)
    fused_optimizer = cfg.optimizer.implementation == "fused"
    scheduler = build_lr_scheduler(optimizer, cfg.lr_scheduler, t.steps)
    dp_rank = meshes.dp.get_local_rank()
    loader = build_dataloader(cfg.data, plan.tokenizer, seq_len=t.seq_len, global_batch_size=plan.global_batch_size,
                              local_batch_size=t.local_batch_size, dp_rank=dp_rank, dp_degree=dims.dp)
    accum = plan.global_batch_size // (t.local_batch_size * dims.dp)
    loss_group = meshes.dp_cp.get_group()
    cp_group = meshes.cp.get_group() if dims.cp > 1 else None
    cp_rank = meshes.cp.get_local_rank()
    # FSDP casts parameters itself; without it, autocast gives the same mixed precision
    autocast = (torch.autocast(device.type, dtype=param_dtype)
                if param_dtype != torch.float32 and not dims.fsdp else contextlib.nullcontext())

    ckpt = CheckpointManager(cfg.checkpoint, cfg.job.dump_folder, model=model, optimizer=optimizer,
                             scheduler=scheduler, loader=loader, data=cfg.data, seq_len=t.seq_len,
                             global_batch_size=plan.global_batch_size, spec=plan.spec, args=plan.args,
                             final_step=t.steps)
    if cfg.checkpoint.create_seed_checkpoint:
        ckpt.save_seed()
        return
    start_step = ckpt.maybe_load()

    metrics = MetricsLogger(cfg.job.dump_folder, cfg.job.run_name, cfg.metrics.enable_tensorboard, rank == 0)
    n_params = sum(p.numel() for p in model.parameters())
    if rank == 0:
        print(f"titanlite: {cfg.model.name} {cfg.model.flavor} ({n_params / 1e6:.1f}M params), {dims}, "
              f"global batch {plan.global_batch_size} x {t.seq_len} tokens, {accum} micro-batch(es), "
              f"{device.type}, {param_dtype}", flush=True)
    flops_per_token = plan.spec.flops_per_token(plan.args, t.seq_len)
    peak_flops = device_peak_flops(device)
    loss_fn = build_loss_fn(cfg.compile, opts.loss_parallel)
    float8_scales = float8.needs_scale_precompute(cfg.float8, dims.fsdp)
    data_iter = iter(loader)
    epoch_of = getattr(loader.dataset, "epoch", None)  # streamed sources do not know their length
    validator = Validator(cfg.validation, cfg.data, plan.tokenizer, t.seq_len, plan.global_batch_size,
                          t.local_batch_size, dp_rank, dims.dp, loss_group)

    def prepare(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's part of a loader micro-batch, on the device (training and validation)."""
        # pinned host memory on GPU: the copies overlap with compute
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        return context_parallel.shard_batch(batch, cp_rank, dims.cp) if cp_group is not None else batch

    def loss_sum_of(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Cross-entropy summed over the target tokens of a prepared micro-batch.
        Call inside loss_context(): loss parallel must also cover the backward."""
        ctx = AttnContext(batch.get("positions"), batch.get("document_ids"), cp_group, param_dtype)
        with autocast:
            logits = model(batch["input_ids"], ctx)
        return loss_fn(logits, batch["labels"])

    def eval_loss_sum(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        with loss_context(opts.loss_parallel):
            return loss_sum_of(batch)

    gc_control.start(t.gc_freq)
    start = last_log = time.perf_counter()
    last_log_step = start_step
    guard = Guard(rank, cfg.job.dump_folder, cfg.comm, t, cfg.job.shutdown_timeout_s, start_step)
    profiler = Profiler(cfg.profiling, cfg.job.dump_folder, rank, device)

    for step in range(start_step + 1, t.steps + 1):
        guard.start_step(step)
        profiler.step_begin(step)
        batches = [prepare(next(data_iter)) for _ in range(accum)]
        # local (cp-sharded) labels: the all-reduce over dp_cp makes the global count
        n_targets = sum((b["labels"] != IGNORE_INDEX).sum() for b in batches)
        dist.all_reduce(n_targets, group=loss_group)
        loss_sum = torch.zeros((), device=device)
        for batch in batches:
            with loss_context(opts.loss_parallel):
                loss = guard.inject_loss(loss_sum_of(batch))
                (loss / n_targets).backward()
            loss_sum += loss.detach()
        params = list(model.parameters())
        reduce_partial_grads(params)
        logs = step == 1 or step % cfg.metrics.log_freq == 0 or step == t.steps
        # the host reads a step's verdict late unless it syncs anyway (log, save) or must
        grad_norm, bad = guard.end_step(loss_sum, local_grad_sq(params),
                                        read_now=logs or ckpt.due(step) or not fused_optimizer)
        if t.max_norm > 0:
            torch.nn.utils.clip_grads_with_norm_(params, t.max_norm, grad_norm, foreach=True)
        lr = scheduler.get_last_lr()[0]
        ckpt.wait_for_staging()
        if fused_optimizer:
            optimizer.found_inf = bad  # a non-finite step updates nothing, decided on the device
        if not guard.skip:
            optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if float8_scales:
            float8.precompute_scales(model)
        gc_control.maybe_collect(step, t.gc_freq)
        profiler.step_end(step)
        guard.start_save()
        ckpt.maybe_save(step, force=guard.stop)

        if logs or guard.stop:
            dist.all_reduce(loss_sum, group=loss_group)
            now = time.perf_counter()
            tokens_per_sec = (step - last_log_step) * plan.global_batch_size * t.seq_len / (now - last_log) / dist.get_world_size()
            mfu = None if peak_flops is None else 100 * tokens_per_sec * flops_per_token / peak_flops
            eta = (now - start) / (step - start_step) * (t.steps - step)
            metrics.log(step, {"loss": (loss_sum / n_targets).item(), "grad_norm": grad_norm.item(), "lr": lr,
                               "tokens_per_sec": tokens_per_sec, "mfu_pct": mfu,
                               "peak_gib": peak_memory_gib(device), "skipped_steps": guard.skipped,
                               "epoch": epoch_of((step - 1) * plan.global_batch_size) if epoch_of else None},
                        eta)
            last_log, last_log_step = now, step
        if guard.stop:
            if rank == 0:
                print(f"titanlite: stopped at step {step} after {guard.signal_name or 'a signal to another rank'}",
                      flush=True)
            break
        if validator.due(step, t.steps):
            val_start = time.perf_counter()
            metrics.log_validation(step, validator(model, prepare, eval_loss_sum, device))
            last_log += time.perf_counter() - val_start  # keep tokens_per_sec about training

    gc_control.stop(t.gc_freq)
    ckpt.close()
    guard.close()
    metrics.close()
    # Written after the last collective: proof this rank finished, for launchers and tests
    done = Path(cfg.job.dump_folder) / "status"
    done.mkdir(parents=True, exist_ok=True)
    (done / f"rank-{rank}.done").write_text(json.dumps({"step": guard.step, "signal": guard.signal_name}))
    # Every marker exists before any rank starts tearing down (gloo may abort there)
    dist.barrier()


def main(argv: list[str] | None = None) -> None:
    try:
        cfg, flags = config.load(sys.argv[1:] if argv is None else argv)
        if flags & {"--help", "-h"}:
            print(config.help_text())
            return
        if "--print-config" in flags:
            print(config.to_toml(cfg))
            return
        plan = preflight(cfg, config.world_size())
        if "--check" in flags:
            return
        train(cfg, plan)
    except ConfigError as e:
        rank = dist.get_rank() if dist.is_initialized() else config.world_rank()
        print(f"titanlite: error: {e}" + (f" [rank {rank}]" if rank else ""), file=sys.stderr, flush=True)
        sys.exit(2)
    except Exception as e:
        fault.defer_to_watchdog()
        err = e if isinstance(e, RunError) else fault.as_run_error(e)
        if err is None:
            raise
        rank = dist.get_rank() if dist.is_initialized() else config.world_rank()
        print(f"titanlite: error: {err}" + (f" [rank {rank}]" if rank else ""), file=sys.stderr, flush=True)
        # no process-group teardown: with a peer dead or diverged it can hang or abort
        os._exit(1)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
