"""The launcher behind run_train.sh: torchrun under supervision, so a run ends the way titanlite says.

    python -m titanlite.runtime.launch [torchrun options] -- [trainer options]

Run bare, torchrun turns a forwarded SIGTERM into a traceback and exit 1, and any rank's failure
into a 30-line report and exit 1, whatever the rank said. Here:

* torchrun (the agent) runs as a child in a session of its own, with its Python logging and
  failure report going to <dump_folder>/logs/torchrun.log; the ranks it starts still write to
  this terminal.
* Each rank leaves its outcome, an exit code and a last line, in a private folder named by
  TITANLITE_REPORT_DIR (`last_word`). Once everything has exited, the launcher prints the line
  (the earliest failure's, else the stop line) as the run's last, and exits with its code.
* SIGTERM and SIGINT go from the launcher straight to the ranks, never through torchrun (which
  would treat them as a failure): the ranks stop together at one step and save. A second SIGINT
  is passed on too, and the ranks exit at once (130).
* A rank that reported success and then died tearing down its process group (gloo sometimes
  aborts there) has finished: that exit status is ignored. A rank that failed without a report
  (a crash, the OOM killer) fails the run.
* With fault_tolerance.max_restarts, torchrun's elastic agent restarts every rank after a
  failure (`--max-restarts`); each attempt reports in a folder of its own (attempt-K, K from
  TORCHELASTIC_RESTART_COUNT) and the run ends with the last attempt's verdict. A bad config
  (exit 2), or a report marked `final` (a non-finite step that recurred on its rerun), would
  fail the same way again: at its report the launcher stops torchrun before it restarts
  anything. So does a stop signal (the ranks stop and save as above; torchrun must not restart a
  rank that then fails).
* So that a restarted attempt can name a rank that died without a word: each rank registers its
  process id in its attempt's folder, and the agent notes how each rank that exits non-zero
  ended (`exits/`, at SIGCHLD, before torchrun reaps it). The launcher notes each stop signal it
  passes on (`signalled`): a rank that gets a SIGTERM nobody noted is being stopped by torchrun
  after another rank failed, and does not report it as the user's.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPORT_DIR_ENV = "TITANLITE_REPORT_DIR"
RUN_STARTED_ENV = "TITANLITE_RUN_STARTED"  # one default run name for every attempt of a launch
SIGNALLED = "signalled"  # the launcher passed a stop signal on (titanlite.runtime.fault.StopVote)
EXITS = "exits"  # the agent's record of ranks that exited non-zero, by process id
KILL_AFTER_SECOND_SIGINT_S = 10  # a rank blocked in native code cannot run its handler


def attempt() -> int:
    """How many times torchrun has restarted this job's ranks (0: the first start)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def attempt_folder(k: int) -> Path | None:
    """Where the ranks of attempt k leave their reports; None outside the launcher."""
    folder = os.environ.get(REPORT_DIR_ENV)
    return Path(folder, f"attempt-{k}") if folder else None


def read_reports(folder: Path) -> dict[int, dict]:
    """{rank: {"code", "line", "time"}} of the ranks that reported in one attempt's folder."""
    return {int(p.stem[5:]): json.loads(p.read_text()) for p in folder.glob("rank-*.json")}


def last_word(rank: int, code: int, line: str | None, **facts: object) -> None:
    """A rank's outcome: its exit code and the line that should end the run's output (None:
    nothing to say), and `facts` for the attempt after a restart (titanlite.runtime.restart):
    the step, `final` (no restart can help: the launcher stops torchrun, as after exit 2).
    Under the launcher it is left for the launcher to print after torchrun's teardown;
    otherwise rank 0's line, and any rank's error, is printed now."""
    folder = attempt_folder(attempt())
    if folder:
        path = folder / f"rank-{rank}.json"
        tmp = path.with_suffix(".tmp")
        with contextlib.suppress(OSError):  # then say it here rather than not at all
            folder.mkdir(exist_ok=True)
            tmp.write_text(json.dumps({"code": code, "line": line, "time": time.time(), **facts}))
            os.replace(tmp, path)
            return
    if line is not None and (code or rank == 0):
        print(line, file=sys.stderr if code else sys.stdout, flush=True)


def register(rank: int) -> None:
    """A rank's first word under the launcher: its process id, by which the agent names the
    rank should it die without a word (a SIGKILL, a segfault)."""
    folder = attempt_folder(attempt())
    if folder:
        with contextlib.suppress(OSError):
            folder.mkdir(exist_ok=True)
            (folder / f"rank-{rank}.pid").write_text(str(os.getpid()))


def read_exits(folder: Path) -> dict[int, dict]:
    """{rank: {"signal" or "code", "time"}} of one attempt's ranks that the agent saw exit
    non-zero (those that had registered)."""
    exits = Path(folder.parent, EXITS)
    out = {}
    for p in folder.glob("rank-*.pid"):
        with contextlib.suppress(OSError, ValueError):
            out[int(p.name[5:-4])] = json.loads((exits / f"{int(p.read_text())}.json").read_text())
    return out


def users_signal(name: str) -> str | None:
    """The stop signal the user (or a scheduler) sent, for a SIGTERM or SIGINT this rank got as
    `name`: the one the launcher noted before passing it on, so torchrun's SIGTERM that follows a
    Ctrl-C (with restarts on, the launcher ends torchrun too) is named SIGINT whichever reaches the
    rank first; None when torchrun ended an attempt after another rank failed. Outside the
    launcher every signal is the user's."""
    folder = os.environ.get(REPORT_DIR_ENV)
    if not folder:
        return name
    with contextlib.suppress(OSError):
        return Path(folder, SIGNALLED).read_text() or name
    return None


# -- the launcher ------------------------------------------------------------------------

def _ranks_of(agent_pid: int) -> list[int]:
    """The agent's children: the rank processes torchrun started (Linux)."""
    pids = []
    for children in Path(f"/proc/{agent_pid}/task").glob("*/children"):
        with contextlib.suppress(OSError):
            pids += [int(p) for p in children.read_text().split()]
    return pids


def _forward(agent: subprocess.Popen, signum: int) -> None:
    """Signal the ranks; before they exist (or without /proc), torchrun, which stops them its own way."""
    for pid in _ranks_of(agent.pid) or [agent.pid]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)


def _end_agent(agent: subprocess.Popen) -> None:
    """Stop torchrun itself: it ends its ranks (SIGTERM, then SIGKILL 30 s later) and exits
    without restarting them."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(agent.pid, signal.SIGTERM)


def _die_with_parent() -> None:
    """In the agent before exec: if the launcher is killed outright, the agent gets SIGTERM and
    stops the ranks (it is in another session, so nothing else would reach it)."""
    with contextlib.suppress(Exception):  # Linux only; elsewhere the agent outlives a killed launcher
        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _option(args: list[str], name: str) -> str | None:
    return next((a.split("=", 1)[1] for a in args if a.startswith(f"{name}=")), None)


def _unranked(report: dict) -> str:
    return re.sub(r" \[rank \d+\]$", "", report["line"] or "")


def _verdict(reports: dict[int, dict], result: dict | None, signals: list[int], nproc: int,
             log: Path) -> tuple[int, str | None]:
    """The launcher's exit code and last line, from what the ranks and the agent reported."""
    if signals.count(signal.SIGINT) >= 2:
        return 130, "titanlite: stopped at once by a second SIGINT; the step in progress was not saved"
    see = f" (torchrun's report: {log})"
    failures = None if result is None else result.get("failures")
    # ranks that ended without a word (a failure after a success report is teardown noise)
    if failures is not None:
        silent = {int(rank): code for rank, code in failures.items() if int(rank) not in reports}
    else:  # torchrun itself was stopped (a signal, a failed rendezvous): only the reports tell
        silent = {-1: 0} if len(reports) < nproc else {}
    if signals and silent:  # the default action of our signal, before a rank handled it
        name = signal.Signals(signals[0]).name
        return 128 + signals[0], f"titanlite: stopped by {name} before training started; nothing was saved"
    # a rank killed by a signal torchrun does not send (the OOM killer, a segfault) is the cause;
    # its peers' errors (a failed collective) are the consequence
    crashed = sorted(rank for rank, code in silent.items() if code < 0 and -code not in (signal.SIGTERM, signal.SIGINT))
    errors = sorted((r["time"], rank) for rank, r in reports.items() if r["code"] != 0)
    if errors and not crashed:
        # the earliest failure; said by several ranks alike (a broadcast decision), the lowest's words
        same = [rank for _, rank in errors if _unranked(reports[rank]) == _unranked(reports[errors[0][1]])]
        first = reports[min(same)]
        return first["code"], first["line"] + see
    if silent:
        if result is not None and result.get("error"):
            return 1, f"titanlite: error: torchrun: {result['error']}{see}"
        rank = crashed[0] if crashed else min(silent)
        if rank < 0:
            return 1, f"titanlite: error: torchrun ended before every rank finished{see}"
        code = silent[rank]
        how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
        return 1, (f"titanlite: error: rank {rank} {how} without a titanlite message (a crash or a bug; "
                   f"LOG_RANK={rank} shows its output){see}")
    lines = [r["line"] for _, r in sorted(reports.items()) if r["line"]]
    return 0, lines[0] if lines else None


def _final(report: dict) -> bool:
    """A report no restart can change: a bad config (exit 2), or one that says so (`final`)."""
    return report["code"] == 2 or bool(report.get("final"))


def _final_attempt(folder: Path) -> tuple[int, dict[int, dict]]:
    """The attempt that decides the run and its reports: the one that refused the config (exit
    2) or said no restart would help, else the last that reported."""
    attempts = sorted((int(p.name[8:]), read_reports(p)) for p in folder.glob("attempt-*"))
    refused = [(k, reports) for k, reports in attempts if any(_final(r) for r in reports.values())]
    if refused:
        return refused[0]
    return attempts[-1] if attempts else (0, {})


def launch(torchrun_args: list[str], train_args: list[str]) -> int:
    from titanlite.config import load as config_load

    cfg, _ = config_load.load(train_args)  # run_train.sh has checked it already
    restarts = cfg.fault_tolerance.max_restarts
    if restarts and _option(torchrun_args, "--max-restarts") is None:
        torchrun_args = [f"--max-restarts={restarts}", *torchrun_args]
    node = _option(torchrun_args, "--node_rank")  # given only to multi-node launches
    log = Path(cfg.job.dump_folder, "logs", "torchrun.log" if node is None else f"torchrun-node{node}.log")
    log.parent.mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(prefix="titanlite-launch-"))
    signals: list[int] = []
    agent: subprocess.Popen | None = None

    def on_signal(signum: int, frame: object) -> None:
        signals.append(signum)
        with contextlib.suppress(OSError):  # before the ranks see it: they name the user's first signal
            if len(signals) == 1:
                (folder / SIGNALLED).write_text(signal.Signals(signum).name)
        # the first signal stops the run; a second SIGINT ends it now; repeated SIGTERMs (as
        # schedulers send) change nothing
        if agent is not None and (len(signals) == 1 or signals.count(signal.SIGINT) == 2 == len(signals)):
            _forward(agent, signum)
            if restarts and len(signals) == 1:
                _end_agent(agent)  # it stops the ranks its own way too, and restarts none

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        cmd = [sys.executable, "-m", "titanlite.runtime.launch", "--agent", str(folder / "agent.json"), str(log),
               *torchrun_args, "-m", "titanlite.train", *train_args]
        env = {**os.environ, REPORT_DIR_ENV: str(folder), RUN_STARTED_ENV: time.strftime("%Y%m%d-%H%M%S")}
        agent = subprocess.Popen(cmd, env=env, start_new_session=True, preexec_fn=_die_with_parent)
        if signals:  # arrived while it was starting
            _forward(agent, signals[0])
            if restarts:
                _end_agent(agent)
        killed_at, refused = None, False
        while agent.poll() is None:
            time.sleep(0.1)
            if restarts and not refused and any(_final(r) for p in folder.glob("attempt-*")
                                                for r in read_reports(p).values()):
                refused = True  # a bad config fails again on every attempt: no restart
                _end_agent(agent)
            if signals.count(signal.SIGINT) >= 2:
                killed_at = killed_at or time.monotonic() + KILL_AFTER_SECOND_SIGINT_S
                if time.monotonic() > killed_at:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(agent.pid, signal.SIGKILL)
        k, reports = _final_attempt(folder)
        result_path = folder / "agent.json"
        result = json.loads(result_path.read_text()) if result_path.exists() else None
        nproc = int(_option(torchrun_args, "--nproc_per_node") or 1)
        code, line = _verdict(reports, result, signals, nproc, log)
        if code and k:
            line += f" (after {k} restart{'s' if k > 1 else ''}; fault_tolerance.max_restarts {restarts})"
        if line:
            print(line, file=sys.stderr if code else sys.stdout, flush=True)
        return code
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        shutil.rmtree(folder, ignore_errors=True)


# -- the agent ---------------------------------------------------------------------------

def _note_exits(folder: Path) -> None:
    """In the agent: how each rank that exits non-zero ended, written to <folder>/exits/PID.json
    at once (SIGCHLD), before torchrun reaps it: waitid with WNOWAIT leaves the child to torchrun.
    A restarted attempt names a rank killed without a word by it (`rank 1 was killed by SIGKILL`)."""
    if not hasattr(os, "waitid"):
        return  # macOS: such a rank is named without its signal
    exits = folder / EXITS
    exits.mkdir(exist_ok=True)
    seen: set[int] = set()

    def on_child(signum: int, frame: object) -> None:
        for pid in set(_ranks_of(os.getpid())) - seen:
            with contextlib.suppress(ChildProcessError, OSError, ValueError):
                info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
                if info is None:
                    continue
                seen.add(pid)
                if info.si_code == os.CLD_EXITED:
                    how = {"code": info.si_status}
                else:
                    how = {"signal": signal.Signals(info.si_status).name}
                if how != {"code": 0}:
                    (exits / f"{pid}.json").write_text(json.dumps({**how, "time": time.time()}))

    signal.signal(signal.SIGCHLD, on_child)


def agent(result: str, log: str, torchrun_argv: list[str]) -> None:
    """torchrun in this process, its own output in `log`; what it saw goes to `result` as JSON:
    {"failures": {rank: exit code}} (empty when all succeeded; null when torchrun was stopped by
    a signal) and "error" when torchrun itself failed."""
    out = open(log, "w", buffering=1)
    # Python-level only, before torch sets up its logging: file descriptors 1 and 2, which the
    # ranks inherit, stay the terminal's
    sys.stdout = sys.stderr = out
    _note_exits(Path(result).parent)
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    outcome: dict = {"failures": {}}
    try:
        run(parse_args(torchrun_argv))
    except ChildFailedError as e:
        print(e.format_msg(), file=out)
        outcome["failures"] = {rank: failure.exitcode for rank, failure in e.failures.items()}
    except SignalException as e:
        print(f"torchrun stopped by {e.sigval.name}", file=out)
        outcome["failures"] = None
    except Exception as e:  # rendezvous and the like: one line for the launcher, the rest here
        import traceback

        traceback.print_exc(file=out)
        outcome = {"failures": None, "error": (str(e).strip().splitlines() or [type(e).__name__])[0]}
    Path(result).write_text(json.dumps(outcome))


def main(argv: list[str]) -> int:
    if argv[:1] == ["--agent"]:
        agent(argv[1], argv[2], argv[3:])
        return 0
    if "--" not in argv:
        print("usage: python -m titanlite.runtime.launch [torchrun options] -- [trainer options]", file=sys.stderr)
        return 2
    split = argv.index("--")
    return launch(argv[:split], argv[split + 1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
