"""Checkpoint merging: the average of several checkpoints' weights, in fp32.

Offline (titanlite.tools.merge): `average` reads one tensor at a time from every checkpoint
through DCP (a LoRA run's as the model it defines: `Member`) and `write_lazily` writes each
average as DCP's writer asks for it, so a host holds about one tensor (its fp32 sum and one
checkpoint's copy), never a model. In a run
(checkpoint.merge_last = N): `ModelMerge` sums the weights of the last N steps before each
scheduled save, sharded like the weights, and writes their average into that checkpoint's folder
(step-K/merged, a model-only checkpoint); a save between (a stop) keeps the partial sum in the
checkpoint, so a resumed run merges what an uninterrupted one would.

Both average the same way, sum then divide, in the order given (the steps' order), so the
in-run merge of steps equals the offline merge of their checkpoints bit for bit.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemWriter
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

from titanlite.checkpoint.dcp import IDENTITY
from titanlite.checkpoint.folder import INFO, single_process
from titanlite.layers.lora import LoRASetup
from titanlite.checkpoint.state import ModelState
from titanlite.config.job import Checkpoint
from titanlite.errors import ConfigError


def model_entries(path: Path) -> dict[str, TensorStorageMetadata]:
    """A checkpoint's model tensors (names without "model.") and their saved size and dtype."""
    try:
        meta = dcp.FileSystemReader(str(path)).read_metadata()
    except Exception as e:  # a missing, truncated or foreign .metadata file
        raise ConfigError(f"{path}: not a readable DCP checkpoint ({type(e).__name__}: {e})") from None
    return {k[len("model."):]: m for k, m in meta.state_dict_metadata.items()
            if k.startswith("model.") and isinstance(m, TensorStorageMetadata)}


def read_tensor(path: Path, name: str, entry: TensorStorageMetadata) -> torch.Tensor:
    """One model tensor of a checkpoint, whole, in one process (DCP reads only its bytes)."""
    out = torch.empty(entry.size, dtype=entry.properties.dtype)
    with single_process():
        dcp.load({"model": {name: out}}, checkpoint_id=str(path), no_dist=True)
    return out


@dataclass(frozen=True)
class Member:
    """One checkpoint as the model it defines, read one tensor at a time: a checkpoint's own
    tensors, or for a LoRA run's checkpoint (titanlite.json "transform") each base weight plus
    scale B A in fp32 and the modules it trains whole as saved: what convert dcp hf exports
    (titanlite.checkpoint.peft.merge, the same operations), never its A and B apart."""

    path: Path
    info: dict[str, Any]
    entries: dict[str, TensorStorageMetadata]
    """The checkpoint's own model tensors (a LoRA run's: what it trains)."""
    shapes: dict[str, tuple[torch.Size, torch.dtype]]
    """The model's tensors: size and dtype (a LoRA run's merged model: fp32, as convert's)."""
    lora: LoRASetup | None = None
    base: Callable[[str], torch.Tensor] | None = None
    """A LoRA run's base weight by name (its checkpoint.initial_load_path, or its seed)."""

    def tensor(self, name: str) -> torch.Tensor:
        if self.lora is None or name in self.entries:  # a plain checkpoint's, or a module trained whole
            return read_tensor(self.path, name, self.entries[name])
        weight = self.base(name).float()
        layer = name.removesuffix(".weight")
        if name.endswith(".weight") and layer in self.lora.targets:
            a = read_tensor(self.path, f"{layer}.lora_A.weight", self.entries[f"{layer}.lora_A.weight"]).float()
            b = read_tensor(self.path, f"{layer}.lora_B.weight", self.entries[f"{layer}.lora_B.weight"]).float()
            weight = weight + (b @ a) * self.lora.scale
        return weight


def plain_member(path: Path, info: dict[str, Any]) -> Member:
    entries = model_entries(path)
    return Member(path, info, entries, {k: (e.size, e.properties.dtype) for k, e in entries.items()})


def average(members: Sequence[Member], name: str, weights: Sequence[float]) -> torch.Tensor:
    """The fp32 weighted average of tensor `name` of the checkpoints' models: sum(w_i x t_i) /
    sum(w_i), summed in the order given; one checkpoint's copy in memory at a time."""
    total = torch.zeros(members[0].shapes[name][0], dtype=torch.float32)
    for member, w in zip(members, weights):
        total.add_(member.tensor(name).float(), alpha=w)
    return total / sum(weights)


class _LazyPlanner(DefaultSavePlanner):
    """Saves a state dict of meta placeholders, computing each tensor (`compute(name)`) only when
    DCP's writer asks for it. The writer keeps a reference to every tensor it wrote until its
    file is closed; the one before is written by then, so its memory is released here."""

    def __init__(self, compute: Callable[[str], torch.Tensor]) -> None:
        super().__init__()
        self.compute, self.last = compute, None

    def resolve_data(self, write_item: WriteItem) -> Any:
        if write_item.type == WriteItemType.BYTE_IO:
            return super().resolve_data(write_item)
        if self.last is not None:
            self.last.untyped_storage().resize_(0)
        self.last = self.compute(write_item.index.fqn[len("model."):])
        return self.last


def write_lazily(out: Path, shapes: dict[str, tuple[torch.Size, torch.dtype]],
                 compute: Callable[[str], torch.Tensor]) -> None:
    """A model-only DCP folder of tensors `compute(name)`, made one at a time while it is written;
    serially (no copy-ahead), so one is alive at a time."""
    placeholders = {k: torch.empty(size, dtype=dtype, device="meta") for k, (size, dtype) in shapes.items()}
    with single_process():
        dcp.save({"model": placeholders}, storage_writer=FileSystemWriter(str(out), per_thread_copy_ahead=0),
                 planner=_LazyPlanner(compute), no_dist=True)


def merge_window(step: int, cfg: Checkpoint, final_step: int) -> bool:
    """Whether step `step` is among the merge_last steps that end at the next scheduled save (the
    next multiple of checkpoint.interval, or the final step), after the scheduled save before it."""
    due = min(-(-step // cfg.interval) * cfg.interval, final_step)
    return step > max(due - cfg.merge_last, (step - 1) // cfg.interval * cfg.interval)


class ModelMerge:
    """checkpoint.merge_last in a run: the fp32 sum of the weights of each window's steps, sharded
    like the weights, saved with every checkpoint (a stop mid-window resumes it bit for bit)."""

    def __init__(self, parts: list[nn.Module], cfg: Checkpoint, final_step: int) -> None:
        self.model, self.cfg, self.final_step = ModelState(parts), cfg, final_step
        self.sums = {k: torch.zeros_like(v, dtype=torch.float32) for k, v in self.model.state_dict().items()}
        self.count, self.first, self.last = 0, 0, 0

    def __len__(self) -> int:  # saved with every checkpoint, an empty window too (CheckpointManager.optional)
        return 1

    @torch.no_grad()
    def add(self, step: int) -> None:
        """After step `step`'s update: its weights join the sum if it is in a window. A step that
        is not after the last one seen follows a rollback to a checkpoint saved without this state:
        what was summed since is forgotten (the window's steps are recorded with its average)."""
        if step <= self.last:
            self.count, self.first = 0, 0
        self.last = step
        if not merge_window(step, self.cfg, self.final_step):
            return
        if self.count == 0:
            for s in self.sums.values():
                s.zero_()
            self.first = step
        for k, v in self.model.state_dict().items():
            self.sums[k].add_(v.detach())
        self.count += 1

    def write(self, folder: Path, info: dict[str, Any]) -> None:
        """At a scheduled save: the window's average as a model-only checkpoint in `folder` (on
        every rank: DCP writes each shard), its steps in titanlite.json; then a new window."""
        if self.count == 0:
            return
        dtypes = {k: v.dtype for k, v in self.model.state_dict().items()}
        dcp.save({"model": {k: (s / self.count).to(dtypes[k]) for k, s in self.sums.items()}},
                 checkpoint_id=str(folder))
        if dist.get_rank() == 0:
            (folder / INFO).write_text(json.dumps({**info, "merged_steps": [self.first, self.last]}, indent=2))
        self.count, self.first = 0, 0

    def state_dict(self) -> dict[str, Any]:
        return {"count": self.count, "first": self.first, "last": self.last, "sums": self.sums}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.count, self.first, self.last = sd["count"], sd["first"], sd["last"]
        with torch.no_grad():
            for k, s in self.sums.items():
                if sd["sums"][k] is not s:
                    s.copy_(sd["sums"][k])


def check_mergeable(members: Sequence[Member]) -> None:
    """Refuse, in one line, checkpoints of different models as a resume would (family, the
    IDENTITY args, tensor names and shapes); a training knob such as max_seq_len may differ."""
    first, info0 = members[0].path, members[0].info
    for m in members[1:]:
        if m.info.get("model") != info0.get("model"):
            raise ConfigError(f"{m.path} holds a '{m.info.get('model')}' model, {first} a '{info0.get('model')}' "
                              "one; merge checkpoints of one model")
        mine, theirs = m.info.get("args", {}), info0.get("args", {})
        differ = [k for k in IDENTITY if mine.get(k) != theirs.get(k)]
        if differ:
            raise ConfigError(f"{m.path} and {first} are models with different {differ[0]} ({mine.get(differ[0])!r} "
                              f"vs {theirs.get(differ[0])!r}); merge checkpoints of one model")
        for name in sorted(m.shapes.keys() | members[0].shapes.keys()):
            a, b = m.shapes.get(name), members[0].shapes.get(name)
            if a is None or b is None or a[0] != b[0]:
                raise ConfigError(f"{m.path}: '{name}' is {'absent' if a is None else tuple(a[0])} but "
                                  f"{'absent' if b is None else tuple(b[0])} in {first}; merge checkpoints of "
                                  "one model")


def merged_info(infos: Sequence[dict[str, Any]], paths: Sequence[Path], weights: Sequence[float]) -> dict[str, Any]:
    """titanlite.json of a merge: the model's, model-only, and what was averaged."""
    return {**{k: infos[0][k] for k in ("model", "args") if k in infos[0]}, "model_only": True,
            "merged_from": [str(p) for p in paths], "merge_weights": list(weights)}
