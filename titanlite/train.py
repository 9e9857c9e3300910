"""Training entry point: `python -m titanlite.train --config X.toml [--section.key value ...]`.

One step: pull this rank's micro-batches of the global batch, count the global target
tokens, run forward/backward on each micro-batch with the loss summed over tokens and
divided by that count, clip by the global norm, step.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from titanlite import config, float8, gc_control
from titanlite.attention import AttnContext
from titanlite.config import ConfigError, JobConfig
from titanlite.data import build_dataloader, probe_data
from titanlite.dist import ParallelDims, init_process_group, pick_device
from titanlite.loss import IGNORE_INDEX, build_loss_fn, loss_context
from titanlite.metrics import MetricsLogger, device_peak_flops, peak_memory_gib
from titanlite.model_spec import ModelSpec, get_model_spec, model_args
from titanlite.optim import build_lr_scheduler, build_optimizer
from titanlite.parallel import ParallelizeOptions, check_compile, clip_grad_norm_, reduce_partial_grads
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
    if cfg.parallelism.sequence_parallel and cfg.training.seq_len % dims.tp:
        raise ConfigError(f"training.seq_len {cfg.training.seq_len} is not divisible by "
                          f"parallelism.tensor_parallel_degree {dims.tp}, as sequence parallel needs; "
                          "change one or set parallelism.sequence_parallel = false")
    float8.preflight(cfg.float8, cfg.training.device, dims.tp)
    check_compile(cfg.compile, dims.tp)
    tokenizer = build_tokenizer(cfg.data.tokenizer)
    probe_data(cfg.data, cfg.validation)
    if tokenizer.vocab_size > args.vocab_size:
        raise ConfigError(f"data.tokenizer has {tokenizer.vocab_size} ids but the model embeds only "
                          f"{args.vocab_size}; set model.vocab_size >= {tokenizer.vocab_size}")
    t = cfg.training
    gbs = t.local_batch_size * dims.dp if t.global_batch_size == -1 else t.global_batch_size
    if gbs % (t.local_batch_size * dims.dp):
        raise ConfigError(f"training.global_batch_size {gbs} is not divisible by local_batch_size "
                          f"{t.local_batch_size} x dp degree {dims.dp} = {t.local_batch_size * dims.dp}")
    return Plan(dims, spec, args, tokenizer, gbs)


def _dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


def train(cfg: JobConfig, plan: Plan) -> None:
    t = cfg.training
    device = pick_device(t.device)
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
    scheduler = build_lr_scheduler(optimizer, cfg.lr_scheduler, t.steps)
    dp_rank = meshes.dp.get_local_rank()
    loader = build_dataloader(cfg.data, plan.tokenizer, seq_len=t.seq_len, global_batch_size=plan.global_batch_size,
                              local_batch_size=t.local_batch_size, dp_rank=dp_rank, dp_degree=dims.dp)
    accum = plan.global_batch_size // (t.local_batch_size * dims.dp)
    loss_group = meshes.dp_cp.get_group()
    # FSDP casts parameters itself; without it, autocast gives the same mixed precision
    autocast = (torch.autocast(device.type, dtype=param_dtype)
                if param_dtype != torch.float32 and not dims.fsdp else contextlib.nullcontext())

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
        return {k: v.to(device, non_blocking=True) for k, v in batch.items()}

    def loss_sum_of(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Cross-entropy summed over the target tokens of a prepared micro-batch.
        Call inside loss_context(): loss parallel must also cover the backward."""
        with autocast:
            logits = model(batch["input_ids"], AttnContext())
        return loss_fn(logits, batch["labels"])

    def eval_loss_sum(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        with loss_context(opts.loss_parallel):
            return loss_sum_of(batch)

    gc_control.start(t.gc_freq)
    start = last_log = time.perf_counter()
    last_log_step = 0

    for step in range(1, t.steps + 1):
        batches = [prepare(next(data_iter)) for _ in range(accum)]
        n_targets = sum((b["labels"] != IGNORE_INDEX).sum() for b in batches)
        dist.all_reduce(n_targets, group=loss_group)
        loss_sum = torch.zeros((), device=device)
        for batch in batches:
            with loss_context(opts.loss_parallel):
                loss = loss_sum_of(batch)
                (loss / n_targets).backward()
            loss_sum += loss.detach()
        params = list(model.parameters())
        reduce_partial_grads(params)
        grad_norm = clip_grad_norm_(params, t.max_norm)
        lr = scheduler.get_last_lr()[0]
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if float8_scales:
            float8.precompute_scales(model)
        gc_control.maybe_collect(step, t.gc_freq)

        if step == 1 or step % cfg.metrics.log_freq == 0 or step == t.steps:
            dist.all_reduce(loss_sum, group=loss_group)
            now = time.perf_counter()
            tokens_per_sec = (step - last_log_step) * plan.global_batch_size * t.seq_len / (now - last_log) / dist.get_world_size()
            mfu = None if peak_flops is None else 100 * tokens_per_sec * flops_per_token / peak_flops
            eta = (now - start) / step * (t.steps - step)
            metrics.log(step, {"loss": (loss_sum / n_targets).item(), "grad_norm": grad_norm.item(), "lr": lr,
                               "tokens_per_sec": tokens_per_sec, "mfu_pct": mfu,
                               "peak_gib": peak_memory_gib(device),
                               "epoch": epoch_of((step - 1) * plan.global_batch_size) if epoch_of else None},
                        eta)
            last_log, last_log_step = now, step
        if validator.due(step, t.steps):
            val_start = time.perf_counter()
            metrics.log_validation(step, validator(model, prepare, eval_loss_sum, device))
            last_log += time.perf_counter() - val_start  # keep tokens_per_sec about training

    gc_control.stop(t.gc_freq)
    metrics.close()
    # Written after the last collective: proof this rank finished, for launchers and tests
    done = Path(cfg.job.dump_folder) / "status"
    done.mkdir(parents=True, exist_ok=True)
    (done / f"rank-{rank}.done").write_text(json.dumps({"step": t.steps}))
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
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
