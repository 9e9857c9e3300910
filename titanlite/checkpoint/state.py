"""The pieces of a checkpoint, as DCP Stateful objects: model, optimizer, LR schedule, data
cursor, train state and RNG (titanlite.checkpoint.dcp saves and loads them)."""

from __future__ import annotations

import dataclasses
import json
import warnings
from collections.abc import Callable, Collection, Iterable
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)
from torchdata.stateful_dataloader import StatefulDataLoader

from titanlite.config.data import Data
from titanlite.errors import ConfigError
from titanlite.optim import Optimizers


class ModelState:
    """The union of the parts' state dicts, keyed by whole-model parameter names; with `keys`, only
    those (a run with frozen weights saves what trains, and loads its base's names apart)."""

    def __init__(self, parts: list[nn.Module], keys: Collection[str] | None = None) -> None:
        self.parts, self.keys = parts, keys

    def _of(self, part: nn.Module) -> dict[str, Any]:
        return {k: v for k, v in get_model_state_dict(part).items() if self.keys is None or k in self.keys}

    def state_dict(self) -> dict[str, Any]:
        return {k: v for part in self.parts for k, v in self._of(part).items()}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        for part in self.parts:
            mine = self._of(part).keys()
            set_model_state_dict(part, {k: v for k, v in sd.items() if k in mine},
                                 options=StateDictOptions(strict=self.keys is None))


@dataclasses.dataclass(frozen=True)
class Transformed:
    """What a model transform applied before the parallel plan asks of checkpoints (LoRA's:
    titanlite.checkpoint.lora.checkpointing), beside what frozen weights ask of any run: a
    checkpoint holds what trains, and the frozen weights come from checkpoint.initial_load_path
    on every start."""

    apply: Callable[[nn.Module], None]
    """The transform, applied to the whole model built on meta: the names a checkpoint may hold."""
    record: dict[str, Any]
    """Saved in titanlite.json; a checkpoint saved with another record is not resumed."""
    initial: Callable[[list[nn.Module]], None] | None = None
    """Loads the transform's own initial weights (a PEFT adapter) on a fresh start, after the model's."""
    final: Callable[[list[nn.Module]], None] | None = None
    """Runs on every rank after the last step, given the parts (the PEFT export)."""


def check_run_kind(path: Path | str, info: dict[str, Any], lora: bool) -> None:
    """Refuse, in one line, to resume a LoRA run's checkpoint in a run that trains every weight or the
    reverse: their checkpoints hold other parameters, and a shape check would name a missing one
    without saying that a resume into a folder of another kind of run caused it."""
    saved = "lora" in info.get("transform", {})
    if saved != lora:
        theirs = "a LoRA run's (it holds the adapters only)" if saved else "a run's that trains every weight"
        mine = "is a LoRA run" if lora else "trains every weight (lora.rank 0)"
        raise ConfigError(f"resuming {path}: that checkpoint is {theirs}, and this run {mine}; give this run its "
                          "own job.dump_folder (or checkpoint.folder), or resume it with the lora settings it was "
                          "saved with")


# Flattened: keyed by parameter names, not by positions in one optimizer, so the state of
# a layer loads whichever pipeline stage holds it
_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


class OptimizerState:
    """A shared (tied) weight's state is saved once, under the first of its names, as one process
    keys it: a pipeline stage that holds the weight under another name (the output layer's copy
    of a tied embedding) reads and writes it under that first name, so the state loads on every
    layout."""

    def __init__(self, optimizers: Optimizers, tied: tuple[tuple[str, ...], ...]) -> None:
        self.optimizers = optimizers
        self.first = {name: names[0] for names in tied for name in names[1:]}

    def _renames(self, part: nn.Module) -> dict[str, str]:
        """This part's key prefixes for the names it holds a shared weight under -> the saved ones."""
        mine = dict(part.named_parameters())
        return {f"{section}.{name}.": f"{section}.{first}." for name, first in self.first.items()
                if name in mine and first not in mine for section in ("state", "param_groups")}

    def state_dict(self) -> dict[str, Any]:
        o, out = self.optimizers, {}
        for part, opt in zip(o.parts, o.optimizers):
            renames = self._renames(part)
            for k, v in get_optimizer_state_dict(part, opt, options=_FLAT).items():
                prefix = next((p for p in renames if k.startswith(p)), None)
                out[k if prefix is None else renames[prefix] + k[len(prefix):]] = v
        return out

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """The saved moments, under this run's settings: every param group's hyperparameters (lr,
        betas, eps, weight decay, Muon's momentum) stay the config's, as built (the saved ones
        would overwrite them); SchedulerState sets the lr of the step to come."""
        o = self.optimizers
        for part, opt in zip(o.parts, o.optimizers):
            renames = self._renames(part)
            view = {**sd, **{mine + k[len(saved):]: v for mine, saved in renames.items()
                             for k, v in sd.items() if k.startswith(saved)}}
            config = [{k: v for k, v in group.items() if k != "params"} for group in opt.param_groups]
            set_optimizer_state_dict(part, opt, view, options=_FLAT)
            for group, settings in zip(opt.param_groups, config):
                group.update(settings)


class SchedulerState:
    """LambdaLR's counters (the same for every part); the lambda itself is rebuilt from the config,
    and loading sets the lr of the step to come from it: a run resumed with another schedule
    (training.steps, optimizer.lr, lr_scheduler.*, a warm-up) runs the new one from its first step.
    Every param group of every part follows one schedule, so the per-group lists are saved as one
    value: the number of groups depends on the layout (one per mesh, see optim.by_mesh)."""

    _PER_GROUP = ("lr_lambdas", "base_lrs", "_last_lr")

    def __init__(self, schedulers: list[torch.optim.lr_scheduler.LRScheduler]) -> None:
        self.schedulers = schedulers
        self.saved_lr: float | None = None
        """The lr the checkpoint's schedule gave the step to come."""

    def state_dict(self) -> dict[str, Any]:
        sd = {k: v for k, v in self.schedulers[0].state_dict().items() if k not in self._PER_GROUP}
        return {**sd, "last_lr": self.schedulers[0].get_last_lr()[0]}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        sd = dict(sd)
        self.saved_lr = sd.pop("last_lr", None)
        if "_last_lr" in sd:  # written before the lists were folded
            self.saved_lr = sd["_last_lr"][0]
        sd = {k: v for k, v in sd.items() if k not in self._PER_GROUP}
        for sched in self.schedulers:
            # one count back, then step(): LambdaLR sets each group's lr from the config's
            # schedule, as an uninterrupted run's step() does (the saved lr was the old schedule's)
            sched.load_state_dict({**sched.state_dict(), **sd, "last_epoch": sd["last_epoch"] - 1,
                                   "_step_count": sd["_step_count"] - 1})
            with warnings.catch_warnings():  # no optimizer step yet in this process, rightly
                warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step()`")
                sched.step()


class DataState:
    """The global sample cursor, the same on every rank. A streamed source adds each dp rank's
    position in its own share of the stream, under a key naming the rank and the layout."""

    def __init__(self, loader: StatefulDataLoader, cfg: Data, seq_len: int, global_batch_size: int) -> None:
        self.loader, self.global_batch_size = loader, global_batch_size
        streamed = getattr(loader, "batch_sampler", None) is None
        # what each step reads: a warm-up's phases, else global_batch_size samples
        self.schedule = None if streamed else loader.batch_sampler.schedule
        # every data setting but the worker count shapes the global sample order; skipped
        # ranges are kept apart (SkippedSamples), so a run may add some and resume
        order = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("num_workers", "skip_samples")}
        if self.schedule is not None and self.schedule.warms_up:  # which samples each step reads
            order["warmup"] = [[p.first_step, p.samples, p.seq_len] for p in self.schedule.phases]
        self.order = json.dumps({**order, "seq_len": seq_len}, sort_keys=True)
        self.samples_seen = 0
        self.stream_key = f"stream_{loader.dataset.layout}_rank{loader.dataset.dp_rank}" if streamed else None

    def samples_read(self, after: int, step: int) -> int:
        """The samples steps after + 1 .. step read."""
        if self.schedule is None or not self.schedule.warms_up:
            return (step - after) * self.global_batch_size
        return self.schedule.samples_before(step + 1) - self.schedule.samples_before(after + 1)

    def align(self, step: int) -> None:
        """After loading step `step`: the sampler's count of steps read (the cursor over this run's
        global batch) against the trainer's steps, which differ after a change of batch size."""
        if self.schedule is not None:
            self.loader.batch_sampler.offset = self.loader.batch_sampler.global_batch - step

    def state_dict(self) -> dict[str, Any]:
        sd: dict[str, Any] = {"samples_seen": self.samples_seen, "order": self.order}
        if self.stream_key:
            sd[self.stream_key] = json.dumps(self.loader.state_dict())
        return sd

    def check_saved(self, saved: Iterable[str]) -> None:
        """Before loading: a streamed position exists only for the layout it was saved on."""
        if not self.stream_key or f"dataloader.{self.stream_key}" in saved:
            return
        layouts = sorted({k.split(".")[1].rsplit("_rank", 1)[0][len("stream_"):] for k in saved
                          if k.startswith("dataloader.stream_")})
        if not layouts:
            raise ConfigError("the checkpoint was not saved from a streamed source; restore the data "
                              "settings it was saved with or start a new dump_folder")
        raise ConfigError(f"data.streaming: the checkpoint holds stream positions for {layouts[0]}, this run "
                          f"reads the stream as {self.loader.dataset.layout} (each dp rank and loader worker "
                          "streams its own share); resume with the dp degree and data.num_workers it was saved with")

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        saved, now = json.loads(sd["order"]), json.loads(self.order)
        default = dataclasses.asdict(Data())  # a key added to Data since the save held its default then
        keys = [k for k in now if saved.get(k, default.get(k)) != now[k]]
        if keys:
            raise ConfigError(f"the checkpoint's data order differs in {', '.join(keys)} (saved "
                              f"{', '.join(f'{k}={saved.get(k, default.get(k))!r}' for k in keys)}); resuming would "
                              "repeat or skip samples. Restore those settings or start a new dump_folder")
        n, G = sd["samples_seen"], self.global_batch_size
        warm = self.schedule is not None and self.schedule.warms_up  # its schedule is a part of the order
        steps = self.schedule.steps_for(n) if warm else None if n % G else n // G
        if steps is None:
            raise ConfigError(f"the checkpoint consumed {n} samples, not a multiple of training.global_batch_size "
                              f"{G}; resuming would repeat or skip samples. Use a global batch size that divides it")
        self.samples_seen = sd["samples_seen"]
        if self.stream_key:
            self.loader.load_state_dict(json.loads(sd[self.stream_key]))  # this rank's own position
            return
        # The sampler is the loader's only state and is kept in the main process, so setting
        # it before iter() resumes with or without workers.
        self.loader.batch_sampler.load_state_dict({"global_batch": steps, "micro_batch": 0})


class SkippedSamples:
    """The sample ranges the loader passes over (data.skip_samples and every spike rollback's),
    saved so that a resumed run skips them too; on load, the saved ones join the config's."""

    def __init__(self, loader: StatefulDataLoader) -> None:
        self.sampler = getattr(loader, "batch_sampler", None)  # None: a stream (refused with ranges)

    @property
    def ranges(self) -> tuple[tuple[int, int], ...]:
        return () if self.sampler is None else self.sampler.skip

    def __len__(self) -> int:  # none: not saved (CheckpointManager.optional)
        return len(self.ranges)

    def add(self, start: int, end: int) -> None:
        self.sampler.set_skip((*self.sampler.skip, (start, end)))

    def state_dict(self) -> dict[str, Any]:
        return {"ranges": json.dumps(self.ranges)}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.sampler.set_skip((*self.sampler.skip, *(tuple(r) for r in json.loads(sd["ranges"]))))


@dataclasses.dataclass
class TrainState:
    step: int = 0
    tokens_seen: int = 0

    def state_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.step, self.tokens_seen = sd["step"], sd["tokens_seen"]


class RngState:
    """This rank's generator states (CPU, and CUDA where there is one) under keys naming `key` (the
    layout and the rank): ranks draw different amounts (dropout in unequal pipeline stages), so
    each restores its own, not one copy for all."""

    def __init__(self, cuda: bool, key: str) -> None:
        self.cuda, self.key = cuda, key

    def _name(self, device: str) -> str:
        return f"{device}_{self.key}" if self.key else device  # no key: one copy (older checkpoints)

    def state_dict(self) -> dict[str, torch.Tensor]:
        sd = {self._name("cpu"): torch.get_rng_state()}
        if self.cuda:
            sd[self._name("cuda")] = torch.cuda.get_rng_state()
        return sd

    def load_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        torch.set_rng_state(sd[self._name("cpu")])
        if self.cuda:
            torch.cuda.set_rng_state(sd[self._name("cuda")])

    def fitting(self, saved: Collection[str]) -> RngState | None:
        """What this rank restores of a checkpoint's generators (`saved`: its keys): its own, or the
        one copy of a checkpoint written before ranks kept their own; None: another layout's. Saved
        without CUDA, the CUDA generator keeps this run's seeded state."""
        for key in (self.key, ""):
            if f"rng.{RngState(False, key)._name('cpu')}" in saved:
                return RngState(self.cuda and f"rng.{RngState(False, key)._name('cuda')}" in saved, key)
        return None
