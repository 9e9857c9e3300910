"""What a resume may change and what it may not, said before anything is read: the config keys
that differ from the checkpoint's (one line, with the lr of the first resumed step), and the
state whose shape the config sets (the optimizer's kind, the spike window), so that a read that
would fail because of the config is refused as that config difference, not as a broken
checkpoint (titanlite.checkpoint.dcp reads; this module only compares)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Collection
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from titanlite.errors import ConfigError

KINDS = {"exp_avg": "AdamW", "momentum_buffer": "Muon"}
"""A state field each optimizer alone keeps, and the optimizer it names."""

OWNERS = {"spike_window": "training.spike_window", "merge": "checkpoint.merge_last"}
"""Optional checkpoint pieces -> the config key that sets their shapes."""


def flat_config(cfg: Any) -> dict[str, Any]:
    """The job config as {"section.key": value}, JSON values (what titanlite.json records)."""
    return {f"{f.name}.{k}": v for f in dataclasses.fields(cfg)
            for k, v in json.loads(json.dumps(dataclasses.asdict(getattr(cfg, f.name)))).items()}


UNSAID = ("job.dump_folder", "checkpoint.load_step")
"""Keys that say where a checkpoint is, not what the run does."""


def changes(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """'key old -> new' for each key both record with different values (a checkpoint written
    before the config was recorded: none)."""
    return [f"{k} {saved[k]!r} -> {now[k]!r}" for k in now if k in saved and saved[k] != now[k] and k not in UNSAID]


def resumed_line(path: Path, tokens: int, step: int, lr: float, saved_lr: float | None, changed: list[str]) -> str:
    old = f" (the checkpoint's schedule: {saved_lr:.2e})" if saved_lr is not None and saved_lr != lr else ""
    what = f"; changed since the save: {', '.join(changed)}" if changed else ""
    return f"titanlite: resumed from {path} ({tokens:,} tokens seen); step {step + 1} runs at lr {lr:.2e}{old}{what}"


def _fields(keys: list[str], prefix: str) -> set[str]:
    return {k[len(prefix):] for k in keys if k.startswith(prefix) and "." not in k[len(prefix):]}


def check_state_fits(path: Path, meta: Metadata, states: dict[str, Any], saved: dict[str, Any],
                     now: dict[str, Any]) -> None:
    """Refuse in one line a checkpoint whose optimizer or optional pieces this run's config shapes
    otherwise (`saved`, `now`: the flat configs, `saved` empty for a checkpoint that predates
    the record). Call on every rank before reading; the model is checked apart (check_saved_model)."""
    held = meta.state_dict_metadata
    for name, state in states.items():
        if name in ("model", "rng", "dataloader"):  # checked by check_saved_model, RngState, DataState
            continue
        for key, value in state.state_dict().items():
            if not isinstance(value, torch.Tensor):
                continue
            full, m = f"{name}.{key}", held.get(f"{name}.{key}")
            if isinstance(m, TensorStorageMetadata) and m.size == value.shape:
                continue
            if name == "optimizer":
                _optimizer_differs(path, list(held), key, saved, now)
            config = OWNERS.get(name, f"the [{name.split('_')[0]}] settings")
            was = (f"'{full}' of shape {tuple(m.size)}" if isinstance(m, TensorStorageMetadata) else f"no '{full}'")
            values = f" ({config} {saved[config]!r} then, {now[config]!r} now)" if config in saved else ""
            raise ConfigError(f"{path} holds {was}, this run's {config} makes it {tuple(value.shape)}{values}: the "
                              f"checkpoint is sound, another {config} cannot resume it; restore {config}, or give "
                              "this run its own job.dump_folder")


def _optimizer_differs(path: Path, held: list[str], key: str, saved: dict[str, Any], now: dict[str, Any]) -> None:
    """A parameter's optimizer state that this run's optimizer does not keep: a changed optimizer."""
    fqn = key[len("state."):].rsplit(".", 1)[0]
    mine = KINDS.get(key.rsplit(".", 1)[1], "this run's optimizer")
    theirs = next((KINDS[f] for f in _fields(held, f"optimizer.state.{fqn}.") if f in KINDS), None)
    name = f"optimizer.name {now.get('optimizer.name')!r}"
    was = f" (saved with {saved['optimizer.name']!r})" if saved.get("optimizer.name", now.get("optimizer.name")) != \
        now.get("optimizer.name") else " (optimizer.muon_groups decides which weights Muon trains)"
    raise ConfigError(f"{path} holds {theirs or 'no'} optimizer state for '{fqn}', which this run trains with {mine}, "
                      f"{name}{was}: a changed optimizer cannot resume the saved one's moments; to keep the weights "
                      f"and start the optimizer afresh, give a new job.dump_folder --checkpoint.initial_load_path "
                      f"{path} (it loads the weights only), or resume with the optimizer it was saved with")


def adapters_only(path: Path, info: dict[str, Any], mine: dict[str, Any], saved: dict[str, Any]) -> None:
    """Refuse in one line a LoRA run's checkpoint (its adapters) where a whole model's weights are
    expected (`mine`: the names this process loads; `saved`: the checkpoint's)."""
    lora = info.get("transform", {}).get("lora")
    if lora and mine.keys() - saved.keys():
        raise ConfigError(f"{path} is a LoRA run's checkpoint (lora.rank {lora['rank']}, {len(lora['targets'])} "
                          "adapted layers): it holds the adapters, not the model's weights; resume it with the lora "
                          "settings and checkpoint.initial_load_path it was saved with, or merge it into its base "
                          f"(python -m titanlite.tools.convert dcp hf {path} OUT) and start from OUT with "
                          "checkpoint.initial_load_format hf")


def same_model(what: str, differ: list[tuple[str, Any, Any]]) -> None:
    """Refuse a checkpoint whose model computes otherwise (ModelSpec.compare_saved's differences)."""
    if differ:
        (key, old, new), more = differ[0], f" ({len(differ) - 1} more differ)" if len(differ) > 1 else ""
        raise ConfigError(f"{what} with {key} {old!r}, but this run has {new!r}{more}: it would resume as another "
                          f"model; restore {key}, or give this run its own job.dump_folder")


def another_layout(path: Path, saved: Collection[str], layout: str) -> str:
    """The line for a checkpoint whose ranks' generators are another layout's (`saved`: its keys)."""
    layouts = sorted({k[len("rng.cpu_"):].rsplit("_rank", 1)[0] for k in saved if k.startswith("rng.cpu_")})
    return (f"titanlite: {path} was saved on another layout ({', '.join(layouts) or 'one copy for every rank'}; this "
            f"run: {layout}): each rank's random generators restart from training.seed, so dropout masks differ "
            "from an uninterrupted run's")
