"""What a restarted attempt knows of the one before it (fault_tolerance.max_restarts).

torchrun's elastic agent restarts every rank after a failure and tells each how many times it
has (TORCHELASTIC_RESTART_COUNT). The failed attempt's ranks left their last words in the
launcher's report folder, and the agent noted how each rank that died without one ended
(titanlite.runtime.launch); rank 0 of the new attempt says in one line what failed, at which
step, and where it resumes (`rank 1 was killed by SIGKILL at step 5; restart 1 of at most 2,
resuming from step 3`), and records it in <dump_folder>/restarts.jsonl and TensorBoard
(train/restarts).

With fault_tolerance.rerun_on_nonfinite, an attempt that stopped on a non-finite step S is
rerun: the next attempt resumes from the newest checkpoint, before S, with the same data and
weights (resume is bitwise). Non-finite at S again, it is the data or the model, and the run
stops for good (titanlite.runtime.fault.StepVerdict); finite, it was transient: a suspected
hardware fault, a restarts.jsonl row with the ranks and hosts it happened on (`Rerun.transient`).

Injected faults (TITANLITE_FAULTS) fire once per launch, not once per attempt: a fault notes
itself in the report folder before it acts, and later attempts leave out what was noted
(`/every` faults excepted: titanlite.runtime.fault).
"""

from __future__ import annotations

import json
import os
import re
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from titanlite.runtime.launch import REPORT_DIR_ENV, attempt, attempt_folder, read_exits, read_reports

FIRED = "faults-fired.txt"


def _node_ranks() -> range:
    """This node's global ranks (torchrun numbers a node's ranks consecutively)."""
    first = int(os.environ.get("RANK", "0")) - int(os.environ.get("LOCAL_RANK", "0"))
    return range(first, first + int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def _unranked(line: str) -> str:
    return re.sub(r" \[rank \d+\]$", "", line.removeprefix("titanlite: error: "))


def failure_cause(reports: dict[int, dict], ranks: range, exits: dict[int, dict] | None = None
                  ) -> tuple[int | None, str]:
    """(rank, why) of an attempt that failed, from this node's reports and `exits` (how ranks
    that said nothing ended): the earliest error, unless it only says a peer failed and a rank
    here ended without a word (killed or crashed), which is then the cause, at the step its
    peers were in. torchrun's SIGTERM to the other ranks, after the failure, is no cause."""
    exits = exits or {}
    errors = sorted((r["time"], rank) for rank, r in reports.items() if r["code"] not in (0, None))
    silent = [rank for rank in ranks if rank not in reports]
    if silent and (not errors or "a peer rank" in (reports[errors[0][1]]["line"] or "")):
        dead = sorted((exits[r]["time"], r) for r in silent if r in exits and exits[r].get("signal") != "SIGTERM")
        rank = dead[0][1] if dead else silent[0]
        how = exits.get(rank, {})
        steps = [r["step"] for r in reports.values() if r.get("step")]
        at = f" at step {max(steps)}" if steps else ""
        if "signal" in how:
            return rank, f"rank {rank} was killed by {how['signal']}{at}"
        if "code" in how:
            return rank, f"rank {rank} exited with code {how['code']}{at} without a titanlite message"
        return rank, f"rank {rank} ended{at} without a titanlite message (killed or crashed)"
    stops = [(rank, r["nonfinite"]) for rank, r in sorted(reports.items()) if r.get("nonfinite")]
    if stops:  # every rank says it: name the ranks whose own loss it was
        own = [rank for rank, n in stops if n["own"]]
        return (own or [None])[0], f"step {stops[0][1]['step']}: non-finite {stops[0][1]['what']}" + (
            f" on rank {', '.join(map(str, own))}" if own else "")
    if errors:
        rank = errors[0][1]
        return rank, _unranked(reports[rank]["line"] or f"rank {rank} failed")
    return None, "a rank on another node failed (its node's launcher output names it)"


@dataclass(frozen=True)
class Restart:
    """What attempt k (> 0) knows of attempt k - 1, from this node's reports."""

    k: int
    limit: str
    rank: int | None
    cause: str
    nonfinite_step: int | None
    """The step attempt k - 1 stopped at as non-finite, if it did."""
    nonfinite_here: bool
    """This rank's own loss was the non-finite one."""

    @classmethod
    def read(cls) -> Restart | None:
        """None in the first attempt (or outside the launcher's restarts)."""
        k = attempt()
        folder = attempt_folder(k - 1) if k else None
        if folder is None:
            return None
        reports = read_reports(folder) if folder.is_dir() else {}
        rank, cause = failure_cause(reports, _node_ranks(), read_exits(folder) if folder.is_dir() else {})
        mine = reports.get(int(os.environ.get("RANK", "0")), {}).get("nonfinite") or {}
        step = next((r["nonfinite"]["step"] for r in reports.values() if r.get("nonfinite")), None)
        return cls(k, os.environ.get("TORCHELASTIC_MAX_RESTARTS", "?"), rank, cause, step, bool(mine.get("own")))

    def line(self, resumed_from: int, heals: bool, rerun: Rerun | None) -> str:
        """The restart's one line, said once the attempt has resumed."""
        start = f"step {resumed_from}" if resumed_from else "step 0 (no checkpoint was complete)"
        return (f"titanlite: {self.cause}; restart {self.k} of at most {self.limit}, resuming from {start}"
                + (", then healing from a live replica group" if heals else "")
                + (f", to rerun step {self.nonfinite_step} {rerun.how} (fault_tolerance.rerun_on_nonfinite)"
                   if rerun is not None and self.nonfinite_step else ""))

    def rerun(self, dump_folder: str, moved: bool) -> Rerun | None:
        """The rerun of the step attempt k - 1 stopped at as non-finite, if it did; `moved`: its
        data goes to other ranks (more than one data-parallel rank)."""
        return (None if self.nonfinite_step is None else
                Rerun(self.nonfinite_step, self.nonfinite_here, dump_folder, moved))

    def record(self, dump_folder: str, resumed_from: int, tensorboard: Any | None) -> None:
        """Rank 0: the restart's restarts.jsonl row and the train/restarts scalar (at the step it
        resumes from)."""
        _append(dump_folder, {"restart": self.k, "max_restarts": int(self.limit) if self.limit.isdigit() else None,
                              "rank": self.rank, "cause": self.cause, "resumed_from": resumed_from})
        if tensorboard is not None:
            tensorboard.add_scalar("train/restarts", self.k, resumed_from)


def _append(dump_folder: str, row: dict) -> None:
    with open(Path(dump_folder) / "restarts.jsonl", "a") as f:
        f.write(json.dumps({**row, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}) + "\n")


@dataclass
class Rerun:
    """A restarted attempt's rerun of the step its predecessor stopped at as non-finite
    (fault_tolerance.rerun_on_nonfinite); titanlite.runtime.fault.StepVerdict judges it."""

    step: int
    here: bool
    """This rank's loss was the non-finite one last time."""
    dump_folder: str
    moved: bool = False
    """The rerun's data is on other ranks (the data-parallel order shifted by one)."""

    @property
    def how(self) -> str:
        return "with its data on other ranks" if self.moved else "with the same data"

    def _who(self, now: bool = False) -> list[tuple[bool, bool, str]]:
        who: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(who, (self.here, now, socket.gethostname()))
        return who

    def again(self, now: bool) -> tuple[str, str]:
        """Collective: the step is non-finite again; `now`: on this rank first. (Why, what to do):
        a value that stayed with its ranks although their data moved is those machines' (a
        restarts.jsonl row names them with their hosts); one that followed the data, the data's
        or the model's; without a move (one data-parallel rank) neither can be told."""
        who = self._who(now)
        before, after = [r for r, w in enumerate(who) if w[0]], [r for r, w in enumerate(who) if w[1]]
        where = ", ".join(f"{r} ({who[r][2]})" for r in after) or "?"
        tail = " no more restarts (fault_tolerance.rerun_on_nonfinite). "
        if not (self.moved and before and after):
            why = ("the rerun could not move its data (one data-parallel rank, or streamed data)" if not self.moved
                   else "no rank could be named both times")
            return (f"again on rank {where}, rerun after a restart {self.how} and the same weights, but {why}: the "
                    "data's or the machine's, which this run cannot tell;" + tail,
                    "Lower optimizer.lr, check the data, or set training.on_nonfinite = skip")
        if after == before:
            hosts = sorted({who[r][2] for r in after})
            if dist.get_rank() == 0:
                _append(self.dump_folder, {"hardware_fault": True, "step": self.step, "ranks": after, "hosts": hosts})
            return (f"again on rank {where}, rerun after a restart with the same weights and its data on other ranks: "
                    "a fault of that machine, not of the data;" + tail,
                    f"Run without {', '.join(hosts)} (recorded in {Path(self.dump_folder) / 'restarts.jsonl'})")
        return (f"again, on rank {where} where the rerun moved its data (from rank {', '.join(map(str, before))}): "
                "the data or the model, not the machine;" + tail,
                "Lower optimizer.lr, check the data, or set training.on_nonfinite = skip")

    def transient(self) -> None:
        """Collective (every rank reads the same verdict): the step is finite this time. Rank 0
        names the ranks and hosts it was non-finite on, in a warning and a restarts.jsonl row."""
        who = self._who()
        if dist.get_rank() != 0:
            return
        ranks = [r for r, w in enumerate(who) if w[0]]
        hosts = sorted({who[r][2] for r in ranks})
        where = ", ".join(f"{r} ({who[r][2]})" for r in ranks) or "?"
        _append(self.dump_folder, {"suspected_hardware_fault": True, "step": self.step, "ranks": ranks,
                                   "hosts": hosts})
        print(f"titanlite: warning: step {self.step} is finite when rerun {self.how} and the same weights: its "
              f"non-finite result on rank {where} was transient, a suspected hardware fault (recorded in "
              f"{Path(self.dump_folder) / 'restarts.jsonl'}); training on", file=sys.stderr, flush=True)


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
