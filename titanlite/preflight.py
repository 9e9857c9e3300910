"""Everything checked before any process group or weight exists, so bad input fails fast,
in one line, on every rank (and once, before launch, through `python -m titanlite.train --check`)."""

from __future__ import annotations

import dataclasses
import importlib.util
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from titanlite.checkpoint.dcp import check_saved_model, complete_steps, model_shapes, resume_step
from titanlite.checkpoint.folder import INFO, read_info, read_metadata
from titanlite.checkpoint.lora import setup_lora
from titanlite.checkpoint.state import check_run_kind
from titanlite.checkpoint.weights import check_shapes
from titanlite.config.job import Checkpoint, JobConfig, Training
from titanlite.data import schedule as data_schedule
from titanlite.data.loader import probe_data
from titanlite.data.schedule import DataSchedule
from titanlite.errors import ConfigError
from titanlite.checkpoint.hf import check_hf_config, fresh_names, read_safetensors
from titanlite.model_spec import ModelSpec, get_model_spec, model_args
from titanlite.layers.lora import LoRASetup, apply_lora
from titanlite.optim.muon import split_params
from titanlite.layers.moe import grouped_mm_supported
from titanlite.parallel import context, float8
from titanlite.parallel.mesh import ParallelDims, pick_device
from titanlite.parallel.pipeline import (SPLIT_BACKWARD, StagePlan, plan_stages, split_backward_through_custom_functions,
                                         tied_names)
from titanlite.parallel.tensor import check_decoder_tp
from titanlite.runtime.replicas import check_split
from titanlite.data.tokenizer import Tokenizer, build_tokenizer
from titanlite.data.validation import preflight_data
from titanlite.eval.score import check_layout, load_tasks


@dataclass
class Plan:
    """Everything decided before any process group or weight exists."""

    dims: ParallelDims
    spec: ModelSpec
    args: Any
    tokenizer: Tokenizer
    global_batch_size: int
    n_params: int
    """Parameters of the whole model (counted on meta, before any sharding or pipeline cut)."""
    stages: StagePlan | None = None
    """The pipeline stages (None without pipelining)."""
    lora: LoRASetup | None = None
    """The LoRA adapters' targets and settings (None: every weight trains)."""
    schedule: DataSchedule | None = None
    """What each step reads, in which shape (batch-size and sequence-length warm-up)."""


def preflight(cfg: JobConfig, world_size: int) -> Plan:
    """All checks that need no process group, so bad input fails fast on every rank: the plan,
    then the data (its sources, and enough of it for a batch and for validation)."""
    plan = make_plan(cfg, world_size)
    t = cfg.training
    if not cfg.rl.enable:  # a GRPO run's data are its rollouts (its prompts: titanlite.rl.checked)
        probe_data(cfg.data, cfg.validation)
        preflight_data(cfg.data, cfg.validation, plan.tokenizer, t.seq_len, plan.global_batch_size,
                       t.local_batch_size, plan.dims.dp)
    if cfg.fault_tolerance.enable:
        check_split(cfg.fault_tolerance, plan.schedule, plan.dims.dp)
    if cfg.eval.tasks:  # every task's rows read and checked here, before launch
        d = plan.dims
        check_layout(cfg.eval, load_tasks(cfg.eval), t.seq_len, d.pp, d.tp, d.ep)
    return plan


def make_plan(cfg: JobConfig, world_size: int, target: str | None = None) -> Plan:
    """The Plan, and every check of it that reads no data (the dry run and the planner plan any
    size of job without it). `target`: the device the job is planned for when it is not this
    machine's (the dry run of a CUDA job on a CPU)."""
    dims = ParallelDims.from_config(cfg.parallelism, world_size)
    spec = get_model_spec(cfg.model.name)
    args = model_args(spec, cfg.model.flavor, cfg.model.vocab_size, cfg.training.seq_len, cfg.moe,
                      cfg.model.hf_config, cfg.model.hf_overrides)
    check_decoder_tp(args, dims.tp)  # every family, before its own checks
    spec.check_layout(args, dims)
    if dims.ep > 1 and getattr(args, "moe", None) is None:
        raise ConfigError(f"parallelism.expert_parallel_degree {dims.ep}: {cfg.model.name} {cfg.model.variant} "
                          "has no experts; set it to 1")
    check_attention(cfg.model.attn_backend, args, dims.cp, _on_cuda(cfg.training.device))
    if getattr(args, "moe", None) is not None and cfg.moe.grouped_mm == "on":
        check_grouped_mm((args.moe.hidden, args.dim), cfg.training)
    context.check_seq_len(cfg.training.seq_len, dims.cp)
    # sequence parallel splits each rank's (context-parallel) share of the sequence over tp
    if cfg.parallelism.sequence_parallel and cfg.training.seq_len % (dims.tp * dims.cp):
        cp = f" x context_parallel_degree {dims.cp}" if dims.cp > 1 else ""
        raise ConfigError(f"training.seq_len {cfg.training.seq_len} is not divisible by "
                          f"parallelism.tensor_parallel_degree {dims.tp}{cp}, as sequence parallel needs; "
                          "change one or set parallelism.sequence_parallel = false")
    float8.preflight(cfg.float8, target or cfg.training.device, dims.tp, here=target is None)
    if cfg.fault_tolerance.rerun_on_nonfinite and not cfg.training.deterministic and _on_cuda(target or cfg.training.device):
        # a rerun tells the machine from the data only if the step itself repeats
        raise ConfigError("fault_tolerance.rerun_on_nonfinite reruns a non-finite step to tell a machine's fault from "
                          "the data's, and a GPU repeats a step only with deterministic kernels: set "
                          "training.deterministic = true, or rerun_on_nonfinite = false")
    tokenizer = build_tokenizer(cfg.data.tokenizer)
    if cfg.checkpoint.create_seed_checkpoint and world_size != 1:
        raise ConfigError(f"checkpoint.create_seed_checkpoint runs on one process, not {world_size}; "
                          "launch it without torchrun or with --nproc_per_node=1")
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
    lora = setup_lora(cfg.lora, spec, args)
    check_checkpoint(cfg.checkpoint, cfg.job.dump_folder, spec, args, lora)
    with torch.device("meta"):
        model = spec.build(args)
    if cfg.optimizer.name == "Muon" and not split_params(model, cfg.optimizer.muon_groups)[0]:
        raise ConfigError(f"optimizer.name Muon: no matrix of {cfg.model.name}'s blocks is in optimizer.muon_groups "
                          f"{cfg.optimizer.muon_groups} (Muon reads titanlite's block layouts: layers.<i>.attention, "
                          "feed_forward, experts); use AdamW")
    stages = check_pipeline(cfg, dims, spec, model) if dims.pp > 1 else None
    sp = dims.tp * dims.cp if cfg.parallelism.sequence_parallel else 1  # what sequence parallel splits
    schedule = data_schedule.build(t, gbs, dims.dp, dims.cp, sp, dims.pp > 1, cfg.data.streaming)
    return Plan(dims, spec, args, tokenizer, gbs, sum(p.numel() for p in model.parameters()), stages, lora, schedule)


def check_pipeline(cfg: JobConfig, dims: ParallelDims, spec: ModelSpec, model: nn.Module) -> StagePlan:
    """The stage plan, or the one-line reason the pipeline layout cannot run this model."""
    name = cfg.parallelism.pipeline_parallel_schedule
    if name in SPLIT_BACKWARD:
        # both found wrong by per-parameter gradient checks: under expert parallel some expert
        # weights get no gradient in the weight-gradient pass; an MTP depth's pass fails outright
        key = "parallelism.pipeline_parallel_schedule"
        if dims.ep > 1:
            raise ConfigError(f"{key} {name} splits each backward into input- and weight-gradient passes, which "
                              f"expert_parallel_degree {dims.ep} does not survive (expert weights lose their "
                              "gradients); use 1F1B or Interleaved1F1B, or expert_parallel_degree 1")
        if len(getattr(model, "mtp", ())):
            raise ConfigError(f"{key} {name} splits each backward into input- and weight-gradient passes, which "
                              "the multi-token prediction depth on the last stage does not survive; use 1F1B or "
                              "Interleaved1F1B")
        if cfg.compile.enable and not split_backward_through_custom_functions():
            raise ConfigError(f"{key} {name} with compile.enable: torch {torch.__version__}'s split backward "
                              "loses a compiled block's graph between its input- and weight-gradient passes; "
                              "use 1F1B or Interleaved1F1B, compile.enable false, or torch >= 2.13")
    stages = plan_stages(cfg.parallelism, len(spec.blocks_of(model)), cfg.training.local_batch_size)
    return dataclasses.replace(stages, tied=tied_names(model))


def check_checkpoint(cfg: Checkpoint, dump_folder: str, spec: ModelSpec, args: Any,
                     lora: LoRASetup | None = None) -> None:
    """The checkpoint the run would resume from, or else its initial weights, can be read and
    are this model's (family, IDENTITY args, names and shapes both ways). A LoRA run's checkpoint
    holds what trains, and its base weights load from the initial weights on every start."""
    root = Path(dump_folder) / cfg.folder
    step = resume_step(cfg, root, warn=False) if cfg.enable else None
    if step is not None:
        check_run_kind(root / f"step-{step}", read_info(root / f"step-{step}"), lora is not None)
    if step is not None and lora is not None:
        with torch.device("meta"):
            model = spec.build(args)
            apply_lora(model, lora)
        path = root / f"step-{step}"
        trained = {n: p.shape for n, p in model.named_parameters() if p.requires_grad}
        whole = {k: v.shape for k, v in model.state_dict().items()}
        check_saved_model(path, read_info(path), read_metadata(path), spec, args, trained, whole)
        step = None  # and the base weights, as a fresh start reads them
    if step is None and not cfg.initial_load_path:
        return
    if step is not None:
        path = root / f"step-{step}"
    elif cfg.initial_load_format == "hf":
        if spec.hf is None:
            raise ConfigError(f"checkpoint.initial_load_format hf: model '{spec.name}' has no Hugging Face adapter")
        check_hf_config(spec.hf, cfg.initial_load_path, args)
        # names and shapes from the files' headers, as the ranks' load_hf_weights checks them
        whole = model_shapes(spec, args)
        found = {k: v.shape for k, v in spec.hf.from_hf(read_safetensors(cfg.initial_load_path, meta=True), args).items()}
        fresh = fresh_names(spec.hf, whole, found)
        check_shapes({k: v for k, v in whole.items() if k not in fresh}, found, cfg.initial_load_path)
        return
    else:
        path = Path(cfg.initial_load_path)
        held = complete_steps(path, warn=False) if not (path / INFO).is_file() else []
        if held:  # a run's checkpoint folder: which of its steps is the user's choice, not ours
            raise ConfigError(f"checkpoint.initial_load_path: '{path}' holds the checkpoints "
                              f"{', '.join(f'step-{n}' for n in sorted(held))}, not one checkpoint; name the one to "
                              f"start from, e.g. {path / f'step-{held[0]}'}")
    whole = model_shapes(spec, args)
    check_saved_model(path, read_info(path), read_metadata(path), spec, args, whole, whole)


def check_attention(backend: str, args: Any, cp: int, cuda: bool) -> None:
    """The model's attention (windows, sinks) and the backend that is to run it, before launch."""
    window, context = args.sliding_window, args.context_len or args.max_seq_len
    if isinstance(window, bool) or not isinstance(window, int) or window < 0:
        raise ConfigError(f"the flavor's sliding_window must be a positive integer (0: none), got {window!r}")
    if window > context:
        raise ConfigError(f"the flavor's sliding_window {window} is larger than the model's context ({context} "
                          "tokens); a window that sees everything is no window: set 0")
    kinds = args.layer_kinds
    if args.layer_types and (len(args.layer_types) != args.n_layers or set(args.layer_types) - set(kinds)):
        raise ConfigError(f"the flavor's layer_types must name each of its {args.n_layers} layers "
                          f"{' or '.join(repr(k) for k in kinds)}, got {args.layer_types}")
    if backend == "flex":
        try:
            from torch.nn.attention import flex_attention  # noqa: F401
        except ImportError:
            raise ConfigError(f"model.attn_backend flex: torch {torch.__version__} has no FlexAttention; "
                              "use sdpa") from None
        if not cuda:
            raise ConfigError(f"model.attn_backend flex: torch {torch.__version__} has no FlexAttention "
                              "backward on CPU; train on CUDA or use sdpa")
    if backend == "varlen":
        if importlib.util.find_spec("torch.nn.attention.varlen") is None:
            raise ConfigError(f"model.attn_backend varlen: torch {torch.__version__} has no "
                              "torch.nn.attention.varlen; use sdpa or flex, or a newer torch")
        if not cuda:
            raise ConfigError("model.attn_backend varlen runs on CUDA only; use sdpa or flex")
        if cp > 1:
            raise ConfigError("model.attn_backend varlen does not split documents over context parallel; "
                              "use sdpa or flex with parallelism.context_parallel_degree > 1")
        if args.attn_sinks:
            raise ConfigError("model.attn_backend varlen cannot apply attention sinks; use sdpa or flex")


def _on_cuda(device: str) -> bool:
    return device == "cuda" or (device == "auto" and torch.cuda.is_available())


def check_grouped_mm(widths: tuple[int, int], t: Training) -> None:
    """moe.grouped_mm = on where it cannot run: say so before launch. CPU is probed; on CUDA only
    what needs no device (the kernel's presence, stride alignment) is checked here."""
    cuda = _on_cuda(t.device)
    dtype = param_dtype(t.mixed_precision_param, torch.device("cuda" if cuda else "cpu"))
    why = grouped_mm_supported(torch.device("meta" if cuda else "cpu"), dtype, widths)
    if why is not None:
        raise ConfigError(f"moe.grouped_mm = on, but {why}; use auto or off")


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


def param_dtype(name: str, device: torch.device) -> torch.dtype:
    """training.mixed_precision_param on this device."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)
