"""Distributed checkpoints: periodic saves, atomic commit, exact resume on any layout, initial weights.

A checkpoint is a torch.distributed.checkpoint (DCP) folder <dump_folder>/<folder>/step-N with
  model, optimizer  the sharded DTensors of get_state_dict, so any layout can load them
  lr_scheduler      the LambdaLR counters
  dataloader        samples consumed so far and what defines the sample order; the order
                    is global (titanlite.data.loader), so this cursor means the same on any layout
  train_state       step and tokens seen
  rng               each rank's generator states (CPU, CUDA), under keys naming the rank and the
                    layout: ranks draw different amounts (dropout in unequal pipeline stages)
(each a Stateful in titanlite.checkpoint.state), plus titanlite.json (model family and args, for
titanlite.tools.convert, and the job's config, which a resume compares with its own). It is written as step-N.tmp and renamed when whole: a folder named
step-N is always complete.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import re
import shutil
import sys
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torchdata.stateful_dataloader import StatefulDataLoader

from titanlite.config.data import Data
from titanlite.config.job import Checkpoint
from titanlite.errors import ConfigError, RunError
from titanlite.checkpoint.folder import read_metadata, read_info, saved_shapes, commit
from titanlite.checkpoint.hf import check_hf_config, fresh_line
from titanlite.checkpoint.weights import check_shapes, load_hf_weights
from titanlite.model_spec import ModelSpec
from titanlite.checkpoint.resume import (adapters_only, another_layout, changes, check_state_fits, resumed_line,
                                         same_model)
from titanlite.checkpoint.state import (DataState, ModelState, OptimizerState, RngState, SchedulerState, check_run_kind,
                                        SkippedSamples, Transformed, TrainState)
from titanlite.optim import Optimizers

_STEP_DIR = re.compile(r"step-(\d+)")


def _warn(msg: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"titanlite: warning: {msg}", file=sys.stderr, flush=True)


IDENTITY = ("norm_eps", "rope_theta", "tie_embeddings", "sliding_window", "layer_types", "attn_sinks")
"""DecoderArgs fields that change what a model computes, or which weights it shares, without
changing any parameter's shape (shapes are compared apart): saved with other values, a
checkpoint is another model's. The rest of ModelArgs either sets shapes (checked through them)
or is a training knob (max_seq_len, a MoE's loss coefficient) that may change on resume."""


def model_shapes(spec: ModelSpec, args: Any, transform: Callable[[nn.Module], None] | None = None
                 ) -> dict[str, torch.Size]:
    """The whole single-device model's state-dict names and shapes (built on meta, `transform`ed):
    the names a checkpoint holds on every layout."""
    with torch.device("meta"):
        model = spec.build(args)
        if transform is not None:
            transform(model)
        return {k: v.shape for k, v in get_model_state_dict(model).items()}


def check_saved_model(path: Path, info: dict[str, Any], meta: Metadata, spec: ModelSpec, args: Any,
                      mine: dict[str, torch.Size], whole: dict[str, torch.Size]) -> None:
    """Refuse, in one line, a checkpoint of another model: another family, other IDENTITY args,
    or another parameter set (names and shapes, both ways). `mine`: the names and shapes this
    process loads (its pipeline stage); `whole`: the whole model's (model_shapes)."""
    family = info.get("model")
    what = f"{path} holds a checkpoint of model '{family}'"
    if family != spec.name:
        raise ConfigError(f"{what}, not of '{spec.name}' (model.name): another model's weights would load into it; "
                          f"resume it with --model.name {family}, or give this run its own job.dump_folder "
                          "(or checkpoint.folder / checkpoint.initial_load_path)")
    saved, now = info.get("args", {}), json.loads(json.dumps(dataclasses.asdict(args)))
    if spec.compare_saved is not None:  # first: it names the keys the user sets (rms_norm_eps), not ModelArgs'
        same_model(what, spec.compare_saved(saved, args))
    differ = [k for k in IDENTITY if k in saved and k in now and saved[k] != now[k]]
    if differ:
        # the transformers family has no flavor: its args come from model.hf_config and model.hf_overrides
        source = "model.hf_config and model.hf_overrides" if spec.from_hf_config else "flavor"
        run = "model.hf_config and model.hf_overrides give" if spec.from_hf_config else f"{spec.name} flavor has"
        raise ConfigError(f"{what} with {', '.join(f'{k}={saved[k]!r}' for k in differ)}, but this run's "
                          f"{run} {', '.join(f'{k}={now[k]!r}' for k in differ)}; resume it with "
                          f"the {source} it was saved with, or give this run its own job.dump_folder")
    shapes = saved_shapes(meta, "model.")
    adapters_only(path, info, mine, shapes)
    check_shapes(mine, shapes, str(path))
    extra = sorted(shapes.keys() - whole.keys())
    if extra:
        more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        raise ConfigError(f"{what} with '{extra[0]}'{more}, which this run's {spec.name} lacks: it was saved from "
                          "another model; resume it with the model that saved it, or give this run its own "
                          "job.dump_folder")


def _reason(e: BaseException) -> str:
    """The first OS error under a (DCP-wrapped, per-rank) exception, else the innermost one's
    first line."""
    seen, stack = [], [e]
    while stack:
        err = stack.pop(0)
        if isinstance(err, OSError):
            return f"{err.strerror or err}" + (f": {err.filename}" if err.filename else "")
        seen.append(err)
        failures = getattr(err, "failures", None) or {}
        stack += [f[0] if isinstance(f, tuple) else f for f in failures.values()]  # (exception, traceback)
        stack += [x for x in (err.__cause__, err.__context__) if x is not None and x not in seen]
    text = str(seen[-1]).strip()
    return text.splitlines()[0] if text else type(seen[-1]).__name__


def complete_steps(root: Path, warn: bool = True) -> list[int]:
    """Committed step folders, newest first, skipping (with a warning) any that cannot be read."""
    steps = []
    candidates = [p for p in root.glob("step-*") if _STEP_DIR.fullmatch(p.name)] if root.is_dir() else []
    for path in sorted(candidates, key=lambda p: -int(p.name[5:])):
        try:
            read_metadata(path)
            read_info(path)
            steps.append(int(path.name[5:]))
        except ConfigError as e:
            if warn:
                _warn(f"skipping checkpoint: {e}")
    return steps


def resume_step(cfg: Checkpoint, root: Path, warn: bool = True) -> int | None:
    """The step a run resumes from: checkpoint.load_step, else the newest complete one, else None."""
    steps = complete_steps(root, warn)
    if cfg.load_step == -1:
        return steps[0] if steps else None
    if cfg.load_step not in steps:
        raise ConfigError(f"checkpoint.load_step {cfg.load_step}: no complete checkpoint "
                          f"{root}/step-{cfg.load_step}; complete ones: {steps or 'none'}")
    return cfg.load_step


class _ReadError(Exception):
    """A checkpoint's files failed to read (every rank raises it: DCP gathers the failures)."""


def _read(states: dict[str, Any], path: Path) -> None:
    """dcp.load, its failures (a truncated or missing shard) as one _ReadError. Stateful pieces
    change only once everything was read; tensors read in place are all overwritten by the next
    checkpoint that loads."""
    try:
        dcp.load(states, checkpoint_id=str(path))
    except ConfigError:  # a piece refused what it read (another data order): no fallback
        raise
    except (Exception, dcp.CheckpointException) as e:  # the latter is a BaseException
        raise _ReadError(_reason(e).split(". ")[0]) from None  # torch's advice after the first sentence


def check_model_only(path: Path, model: ModelState, spec: ModelSpec, args: Any,
                     transform: Callable[[nn.Module], None] | None = None) -> Metadata:
    """check_saved_model of `path` against the weights `model` loads (this rank's)."""
    meta = read_metadata(path)
    mine = {k: v.shape for k, v in model.state_dict().items()}
    check_saved_model(path, read_info(path), meta, spec, args, mine, model_shapes(spec, args, transform))
    return meta


def load_initial(parts: list[nn.Module], path: Path, fmt: str, spec: ModelSpec, args: Any,
                 model: ModelState | None = None) -> list[str]:
    """checkpoint.initial_load_path into the parts, seeded before (a run's on its ranks, or one
    process's whole model): a titanlite checkpoint (dcp) checked as a resume checks it, or a
    transformers folder checked against `args`. `model`: the weights it loads (default: all of
    the parts'). Returns the names a transformers folder left to their initial values."""
    if fmt == "dcp":
        model = model if model is not None else ModelState(parts)
        check_model_only(path, model, spec, args)
        try:
            _read({"model": model}, path)
        except _ReadError as e:
            raise ConfigError(f"checkpoint.initial_load_path: {path} failed to load ({e})") from None
        return []
    if spec.hf is None:
        raise ConfigError(f"checkpoint.initial_load_format hf: model '{spec.name}' has no Hugging Face adapter")
    check_hf_config(spec.hf, path, args)
    return load_hf_weights(parts, path, spec.hf, args, model_shapes(spec, args))


# ---- the manager -------------------------------------------------------------------

class CheckpointManager:
    """Saves every `interval` steps and at `final_step`; restores on start. Call from every rank."""

    def __init__(self, cfg: Checkpoint, dump_folder: str, *, parts: list[nn.Module], optimizers: Optimizers,
                 loader: StatefulDataLoader, data: Data, seq_len: int, global_batch_size: int, spec: ModelSpec,
                 args: Any, final_step: int, tied: tuple[tuple[str, ...], ...] = (),
                 writer_group: Callable[[], dist.ProcessGroup] = lambda: dist.new_group(backend="gloo"),
                 transformed: Transformed | None = None, config: dict[str, Any] | None = None,
                 layout: str = "") -> None:
        """`config`: the job's (titanlite.checkpoint.resume.flat_config), recorded and compared on
        resume; `layout`: names what each rank's random draws depend on (the parallel degrees)."""
        self.cfg, self.parts, self.spec, self.args, self.final_step = cfg, parts, spec, args, final_step
        self.config, self.layout = config or {}, layout
        self.transformed = transformed
        # with frozen weights (LoRA) a checkpoint holds what trains; the initial weights give the rest
        self.frozen = any(not p.requires_grad for part in parts for p in part.parameters())
        trained = {n for part in parts for n, p in part.named_parameters() if p.requires_grad}
        self.initial = ModelState(parts, model_shapes(spec, args).keys() if transformed else None)
        self.root = Path(dump_folder) / cfg.folder
        self.train_state = TrainState()
        self.data = DataState(loader, data, seq_len, global_batch_size)
        self.optional = {"skipped_samples": SkippedSamples(loader)}  # saved by some runs only (see maybe_save)
        self.seq_len = seq_len
        self.rank = dist.get_rank()
        # loaded in this order: the optimizer's settings first, then the schedule sets their lr
        self.states = {"model": ModelState(parts, trained if self.frozen else None), "optimizer": OptimizerState(optimizers, tied),
                       "lr_scheduler": SchedulerState(optimizers.schedulers), "dataloader": self.data,
                       "train_state": self.train_state,
                       "rng": RngState(torch.cuda.is_available(), f"{layout}_rank{self.rank}")}
        self.pending: tuple[Path, Path, dict, Any] | None = None
        self._loaded_step = self._loaded_tokens = self._loaded_samples = 0
        self.pg = self.stager = None
        if cfg.enable and cfg.async_mode == "async":
            # the writer thread runs its own collectives; they must not interleave with training's
            self.pg = writer_group()
            cuda = torch.cuda.is_available()
            self.stager = DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=False,
                                                       use_async_staging=True, use_non_blocking_copy=cuda))
        if cfg.enable:
            if self.rank == 0 and self.root.is_dir():
                for tmp in self.root.glob("*.tmp"):
                    _warn(f"removing {tmp}, left by a save that did not finish")
                    shutil.rmtree(tmp)
            dist.barrier()

    # -- loading --

    def candidates(self) -> list[int]:
        """The steps to try, newest first: checkpoint.load_step alone, else every complete one.
        Rank 0 decides for all, even if the folder changes under us."""
        choice: list[Any] = [None]
        if self.rank == 0:
            try:
                choice = [[resume_step(self.cfg, self.root)] if self.cfg.load_step != -1 else complete_steps(self.root)]
            except ConfigError as e:
                choice = [e]
        dist.broadcast_object_list(choice, src=0)
        if isinstance(choice[0], ConfigError):
            raise choice[0]
        return choice[0]

    def maybe_load(self, say: bool = True) -> int:
        """Restore the chosen checkpoint, or the initial weights; returns the last completed step.
        `say`: print the `resumed from` line (a restart or a rollback says it in its own)."""
        step = self._load(say)
        # what the loaded checkpoint had consumed; maybe_save adds this run's steps to it
        self._loaded_step, self._loaded_tokens = step, self.train_state.tokens_seen
        self._loaded_samples = self.data.samples_seen
        return step

    def _load(self, say: bool) -> int:
        """The newest checkpoint that loads. One whose files fail to read (a truncated or missing
        shard) is passed over with a warning for the one before it, unless checkpoint.load_step
        names it: a step asked for is never swapped for another."""
        candidates = self.candidates() if self.cfg.enable else []
        if self.cfg.initial_load_path and (self.frozen or not candidates):  # frozen weights: on every start
            self._initial_load(Path(self.cfg.initial_load_path), self.cfg.initial_load_format)
        if not candidates:
            if self.transformed is not None and self.transformed.initial is not None:
                self.transformed.initial(self.parts)
            return 0
        failed = []
        for i, step in enumerate(candidates):
            path = self.root / f"step-{step}"
            try:
                loaded = self._load_step(path, say)
            except _ReadError as e:
                failed.append(f"{path.name} ({e})")
                if self.cfg.load_step != -1:
                    raise ConfigError(f"checkpoint.load_step {step}: {path} failed to load ({e}); pick another "
                                      "step, or leave load_step at -1 to resume from the newest that loads") from None
                if i + 1 < len(candidates):
                    _warn(f"checkpoint {path} failed to load ({e}); falling back to "
                          f"{self.root}/step-{candidates[i + 1]}")
                continue
            return loaded
        raise ConfigError(f"checkpoint: no checkpoint in {self.root} loads: {'; '.join(failed)}; move the broken "
                          "ones away to start afresh")

    def _load_step(self, path: Path, say: bool) -> int:
        """Load one step folder; its reading failures (files, not config) raise _ReadError."""
        if read_info(path).get("model_only"):
            self._load_model_only(path)
            if self.rank == 0:
                print(f"titanlite: initial weights from {path} (model only)", flush=True)
            return 0
        info = read_info(path)
        check_run_kind(path, info, self.transformed is not None and "lora" in self.transformed.record)
        meta = self._check_saved(path, self.states["model"])
        saved, mine = info.get("transform", {}), {} if self.transformed is None else self.transformed.record
        for key in sorted(k for k in saved.keys() | mine.keys() if saved.get(k) != mine.get(k)):
            raise ConfigError(f"{path} was saved with {key} {saved.get(key)}, but this run has {mine.get(key)}: it would "
                              "resume another run's training; restore those settings, or give this run its own "
                              "job.dump_folder")
        self.data.check_saved(meta.state_dict_metadata)
        rng = self.states["rng"].fitting(meta.state_dict_metadata)  # None: another layout's generators
        states = {k: v for k, v in self.states.items() if k not in self.optional and k != "rng"}
        # absent (a run without ranges, on_spike off): no ranges, a spike window that fills anew
        states |= {k: v for k, v in self.optional.items() if any(n.startswith(f"{k}.") for n in meta.state_dict_metadata)}
        for key in [k for k, v in self.optional.items() if getattr(v, "resumed_only_from_itself", False) and k not in states]:
            raise ConfigError(f"{path} holds no {key} state, which this run must resume with (a preference or GRPO "
                              "run's frozen reference, or its precomputed log-probs, is its own starting weights', not "
                              "the weights it resumes); start from the checkpoint with checkpoint.initial_load_path "
                              "instead, or give this run its own job.dump_folder")
        check_state_fits(path, meta, states, info.get("config", {}), self.config)  # a config's difference, not a break
        _read({**states, **({"rng": rng} if rng is not None else {})}, path)
        self.data.align(self.train_state.step)
        if self.rank == 0 and say:
            print(resumed_line(path, self.train_state.tokens_seen, self.train_state.step,
                               self.states["optimizer"].optimizers.lr, self.states["lr_scheduler"].saved_lr,
                               changes(info.get("config", {}), self.config)), flush=True)
        if self.rank == 0 and rng is None:
            print(another_layout(path, meta.state_dict_metadata, self.layout), flush=True)
        return self.train_state.step

    def _check_saved(self, path: Path, model: ModelState) -> Metadata:
        """The preflight's check_saved_model again, on the ranks: the last line of defence."""
        transform = None if self.transformed is None else self.transformed.apply
        return check_model_only(path, model, self.spec, self.args, transform)

    def _load_model_only(self, path: Path) -> None:
        self._check_saved(path, self.initial)
        _read({"model": self.initial}, path)

    def _initial_load(self, path: Path, fmt: str) -> None:
        fresh = load_initial(self.parts, path, fmt, self.spec, self.args, self.initial)
        if fresh and self.rank == 0:
            print(fresh_line(fresh, path), flush=True)
        if self.rank == 0:
            print(f"titanlite: initial weights from {path} ({fmt})", flush=True)

    # -- saving --

    def _info(self, step: int, model_only: bool, **extra: Any) -> dict[str, Any]:
        record = {} if self.transformed is None else {"transform": self.transformed.record}
        return {"step": step, "model": self.spec.name, "args": dataclasses.asdict(self.args),
                "model_only": model_only, **record, **({} if model_only else {"config": self.config}), **extra}

    def wait_for_staging(self) -> None:
        """Call before optimizer.step(): an async save must have copied the weights it writes."""
        if self.pending is not None and hasattr(self.pending[3], "staging_completion"):
            self.pending[3].staging_completion.result()

    def _finish_pending(self, block: bool) -> None:
        if self.pending is None:
            return
        tmp, final, info, handle = self.pending
        upload: Future = getattr(handle, "upload_completion", handle)
        if not block and not upload.done():
            return
        self.pending = None
        try:
            upload.result()  # re-raises a failed write
            if self.rank == 0:
                commit(tmp, final, info)
                self._prune()
        except (Exception, dcp.CheckpointException) as e:  # the latter is a BaseException
            self._save_failed(tmp, final, e)

    def due(self, step: int) -> bool:
        """Whether `maybe_save(step)` saves without being forced."""
        return self.cfg.enable and (step % self.cfg.interval == 0 or step == self.final_step)

    def maybe_save(self, step: int, force: bool = False) -> None:
        """Call after every optimizer step; saves when `step` is due (always the final step) or `force`d (a stop)."""
        self._finish_pending(block=False)
        if not self.cfg.enable:
            return
        self.train_state.step = step
        done = self.data.samples_read(self._loaded_step, step)  # a warm-up's steps read fewer
        self.train_state.tokens_seen = self._loaded_tokens + done * self.seq_len
        self.data.samples_seen = self._loaded_samples + done
        self.states |= {k: v for k, v in self.optional.items() if v}  # other checkpoints stay as they were
        if self.due(step) or force:
            self._save(step)

    def past_the_end(self, step: int) -> None:
        """Says that a resumed checkpoint is at or past the last step (training.steps): nothing to
        train; the run's end (titanlite.train.end_of_run) still writes the exports it asks for."""
        asked = [what for what, on in (("the PEFT adapter", self.transformed and self.transformed.final),
                                       (f"export-step-{step}", self.cfg.export_dtype)) if on]
        writing = f"; writing {' and '.join(asked)}" if asked else ""
        if self.rank == 0:
            print(f"titanlite: the checkpoint of step {step} is at or past training.steps {self.final_step}: nothing "
                  f"to train (raise training.steps to train on){writing}", flush=True)

    def _save(self, step: int) -> None:
        self._finish_pending(block=True)  # one save in flight at a time
        tmp, final = self.root / f"step-{step}.tmp", self.root / f"step-{step}"
        info = self._info(step, model_only=False)
        try:
            if self.due(step) and (merge := self.optional.get("merge")):  # the window's average, saved inside
                merge.write(tmp / "merged", self._info(step, model_only=True))
            if self.stager is not None:
                handle = dcp.async_save(self.states, checkpoint_id=str(tmp), process_group=self.pg,
                                        async_stager=self.stager)
                self.pending = (tmp, final, info, handle)
            else:
                dcp.save(self.states, checkpoint_id=str(tmp))
                if self.rank == 0:
                    commit(tmp, final, info)
                    self._prune()
        except (Exception, dcp.CheckpointException) as e:  # the latter is a BaseException
            self._save_failed(tmp, final, e)

    def _save_failed(self, tmp: Path, final: Path, e: BaseException) -> None:
        """Drop the partial save; stop or warn per checkpoint.on_save_error (DCP fails a write on every rank)."""
        reason = _reason(e)
        with contextlib.suppress(OSError):
            reason += f"; {shutil.disk_usage(self.root).free / 2**20:.0f} MiB free in {self.root}"
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        done = [int(p.name[5:]) for p in self.root.glob("step-*") if _STEP_DIR.fullmatch(p.name)]
        previous = f"{self.root}/step-{max(done)}" if done else "(none yet)"
        msg = f"checkpoint: saving {final} failed ({reason}); the previous checkpoint {previous} is intact"
        if self.cfg.on_save_error == "stop":
            raise RunError(f"{msg}; stopping (checkpoint.on_save_error = stop). Free space or fix "
                           "job.dump_folder, then restart to resume")
        _warn(f"{msg}; training continues (checkpoint.on_save_error = continue)")

    def export(self, step: int, dtype: torch.dtype) -> None:
        """The model alone in `dtype`, as export-step-N (checkpoint.export_dtype); call from every rank."""
        sd = {k: v.to(dtype) for k, v in self.states["model"].state_dict().items()}
        tmp, final = self.root / f"export-step-{step}.tmp", self.root / f"export-step-{step}"
        dcp.save({"model": sd}, checkpoint_id=str(tmp))
        if self.rank == 0:
            commit(tmp, final, self._info(step, model_only=True, dtype=str(dtype).removeprefix("torch.")))

    def save_seed(self) -> None:
        """Step 0, model only: the initial weights for runs on any layout."""
        tmp, final = self.root / "step-0.tmp", self.root / "step-0"
        dcp.save({"model": self.states["model"]}, checkpoint_id=str(tmp))
        if self.rank == 0:
            commit(tmp, final, self._info(0, model_only=True))
            print(f"titanlite: seed checkpoint written to {final}", flush=True)

    def _prune(self) -> None:
        if not self.cfg.keep_latest_k:
            return
        steps = sorted((int(p.name[5:]) for p in self.root.glob("step-*") if _STEP_DIR.fullmatch(p.name)), reverse=True)
        for step in steps[self.cfg.keep_latest_k:]:
            shutil.rmtree(self.root / f"step-{step}", ignore_errors=True)

    def close(self) -> None:
        """Wait until the last save is written and committed, on every rank."""
        self._finish_pending(block=True)
        if self.stager is not None:
            self.stager.close()
        if self.cfg.enable:
            dist.barrier()  # rank 0 commits; no rank should report the run finished before that
