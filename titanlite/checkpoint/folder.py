"""A checkpoint folder read and written in one process: its titanlite.json, its DCP metadata,
its tensors whole (converters, generation, the merge tool) and the saved model args; and the
commit that makes a written folder appear whole (titanlite.checkpoint.dcp's saves use it too)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from titanlite.errors import ConfigError

INFO = "titanlite.json"


def read_metadata(path: Path) -> Metadata:
    try:
        return dcp.FileSystemReader(str(path)).read_metadata()
    except Exception as e:  # a missing, truncated or foreign .metadata file
        raise ConfigError(f"{path}: not a readable DCP checkpoint ({type(e).__name__}: {e})") from None


def read_info(path: Path) -> dict[str, Any]:
    try:
        return json.loads((Path(path) / INFO).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path}: missing or unreadable {INFO} ({e}); not a complete titanlite checkpoint") from None


def saved_args(templates: list[Any], values: dict[str, Any]) -> Any:
    """ModelArgs from their saved JSON form (titanlite.json's "args"): nested dataclasses (a MoE
    layer's args, YaRN) and tuples come back as dicts and lists. `templates`: the family's
    flavors; a nested field takes its type from the first that sets it (a flavor may leave it
    None, as DeepSeek-V3 16B's YaRN)."""
    fields = {}
    for f in dataclasses.fields(templates[0]):
        if f.name not in values:
            continue
        v, kinds = values[f.name], [getattr(t, f.name) for t in templates]
        nested = [k for k in kinds if dataclasses.is_dataclass(k)]
        if v is None or not (nested or isinstance(kinds[0], tuple)):
            fields[f.name] = v
        else:
            fields[f.name] = saved_args(nested, v) if nested else tuple(v)
    return dataclasses.replace(templates[0], **fields)


def saved_shapes(meta: Metadata, prefix: str) -> dict[str, torch.Size]:
    return {k[len(prefix):]: m.size for k, m in meta.state_dict_metadata.items()
            if k.startswith(prefix) and isinstance(m, TensorStorageMetadata)}


@contextlib.contextmanager
def single_process() -> Iterator[None]:
    """dcp.load and dcp.save with no_dist=True, without the warning torch gives even when asked for
    one process ("assuming the intent is to ... in a single process"): it is the intent, and a
    converter's user would read it as something gone wrong."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def load_tensors(path: str | Path, prefix: str = "model.") -> dict[str, torch.Tensor]:
    """Every tensor under `prefix` as a full CPU tensor, in one process (no process group)."""
    meta = read_metadata(Path(path))
    template = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.state_dict_metadata.items()
                if k.startswith(prefix) and isinstance(m, TensorStorageMetadata)}
    with single_process():
        dcp.load(template, checkpoint_id=str(path), no_dist=True)
    return {k[len(prefix):]: v for k, v in template.items()}


def write_model_checkpoint(path: str | Path, state_dict: dict[str, torch.Tensor], spec_name: str, args: Any) -> None:
    """A model-only checkpoint from full tensors in one process (converters, seed files)."""
    tmp = Path(f"{path}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    with single_process():
        dcp.save({"model": state_dict}, checkpoint_id=str(tmp), no_dist=True)
    commit(tmp, Path(path), {"model": spec_name, "args": dataclasses.asdict(args), "model_only": True})


def commit(tmp: Path, final: Path, info: dict[str, Any]) -> None:
    (tmp / INFO).write_text(json.dumps(info, indent=2))
    if final.exists():  # re-saving a step (after load_step went back): the old copy becomes litter
        old = final.with_name(final.name + ".old.tmp")
        final.rename(old)
        shutil.rmtree(old)
    tmp.rename(final)  # atomic on POSIX: the folder appears whole or not at all
