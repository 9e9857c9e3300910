"""What a restarted attempt knows of the one before it (fault_tolerance.max_restarts).

torchrun's elastic agent restarts every rank after a failure and tells each how many times it
has (TORCHELASTIC_RESTART_COUNT). The failed attempt's ranks left their last words in the
launcher's report folder (titanlite.runtime.launch); rank 0 of the new attempt reads them, says
in one line why the job restarted and from which step it resumes, and records it in
<dump_folder>/restarts.jsonl and TensorBoard (train/restarts).

Injected faults (TITANLITE_FAULTS) fire once per launch, not once per attempt: a fault notes
itself in the report folder before it acts, and later attempts leave out what was noted.
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path
from typing import Any

from titanlite.runtime.launch import REPORT_DIR_ENV, attempt, attempt_folder, read_reports

FIRED = "faults-fired.txt"


def _node_ranks() -> range:
    """This node's global ranks (torchrun numbers a node's ranks consecutively)."""
    first = int(os.environ.get("RANK", "0")) - int(os.environ.get("LOCAL_RANK", "0"))
    return range(first, first + int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def _unranked(line: str) -> str:
    return re.sub(r" \[rank \d+\]$", "", line.removeprefix("titanlite: error: "))


def failure_cause(reports: dict[int, dict], ranks: range) -> tuple[int | None, str]:
    """(rank, why) of an attempt that failed, from this node's reports: the earliest error,
    unless it only says a peer failed and a rank here ended without a word (killed or crashed),
    which is then the cause."""
    errors = sorted((r["time"], rank) for rank, r in reports.items() if r["code"] not in (0, None))
    silent = [rank for rank in ranks if rank not in reports]
    if silent and (not errors or "a peer rank" in (reports[errors[0][1]]["line"] or "")):
        return silent[0], f"rank {silent[0]} ended without a titanlite message (killed or crashed)"
    if errors:
        rank = errors[0][1]
        return rank, _unranked(reports[rank]["line"] or f"rank {rank} failed")
    return None, "a rank on another node failed (its node's launcher output names it)"


def record(dump_folder: str, resumed_from: int, tensorboard: Any | None, heals: bool = False) -> None:
    """On rank 0 of a restarted attempt: the restart's line, its restarts.jsonl row and the
    train/restarts scalar (at the step it resumes from). `heals`: a replica group, which takes
    a live peer's state at its first step (titanlite.runtime.replicas)."""
    k = attempt()
    folder = attempt_folder(k - 1)
    rank, cause = failure_cause(read_reports(folder) if folder else {}, _node_ranks())
    limit = os.environ.get("TORCHELASTIC_MAX_RESTARTS", "?")
    start = (f"step {resumed_from}" if resumed_from else "step 0 (no checkpoint was complete)") + (
        ", then healing from a live replica group" if heals else "")
    print(f"titanlite: restart {k} of at most {limit} after {cause}; resuming from {start}", flush=True)
    row = {"restart": k, "max_restarts": int(limit) if limit.isdigit() else None, "rank": rank, "cause": cause,
           "resumed_from": resumed_from, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    with open(Path(dump_folder) / "restarts.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")
    if tensorboard is not None:
        tensorboard.add_scalar("train/restarts", k, resumed_from)


def fired_faults() -> set[str]:
    """The injected faults (`kind@step[:rank]`) that fired in an earlier attempt of this launch."""
    folder = os.environ.get(REPORT_DIR_ENV)
    path = Path(folder, FIRED) if folder else None
    return set(path.read_text().split()) if path is not None and path.exists() else set()


def note_fired(fault: str) -> None:
    """Called before a fault acts (a kill leaves no later moment): it fires no more this launch."""
    folder = os.environ.get(REPORT_DIR_ENV)
    if folder:
        with open(Path(folder, FIRED), "a") as f:
            f.write(fault + "\n")
