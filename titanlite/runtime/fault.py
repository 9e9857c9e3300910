"""Surviving faults: preemption signals, hung or dead peers, non-finite steps.

Every rank holds one `Guard`: a `Watchdog`, a `StopVote` and a `StepVerdict`. Once per step
the global gradient norm's all-reduce (titanlite.parallel.grad_norm.global_norm: SUM, over the
world) carries two counts with it: ranks asked to stop by SIGTERM/SIGINT, ranks whose loss is
non-finite. So every rank takes the same decision at
the same step, even when only one rank was signalled, and clipping needs no second
collective.

The host reads that verdict without stalling the device: a step that logs, saves or ends
the run reads its own at once (it syncs anyway); any other step's is read one step later,
from a copy started when it was made. Meanwhile a non-finite step is kept out of the
weights on the device, by the fused optimizer's `found_inf`; the foreach optimizer has no
such input, so with it every verdict is read at once.

A watchdog thread bounds each phase of a step: past its deadline the rank writes the stacks
of all its threads (and the collective flight recorder) to <dump_folder>/hang/ and exits,
because a rank blocked in a collective cannot raise. The process groups' own timeout follows
the same phases (set-up and the first step long, steady steps short, saves and validation their
own), a little past the watchdog's deadline: the backend (NCCL's watchdog, a gloo timeout) is
the backstop and never ends a save or a validation that is within its deadline.

Tests inject faults with TITANLITE_FAULTS="kind@step[:rank][/every],...": `nan` makes the loss
NaN, `hang` blocks the rank before the step's collectives, `kill` SIGKILLs the rank,
`slowsave` holds the rank at the start of the step's checkpoint save for 2 s longer than
comm.init_timeout_s (a save slower than set-up may take), `spike` multiplies the loss by
SPIKE_FACTOR (finite: the spike detector must find it as it would a real one), `slow` sleeps
SLOW_S in the rank's step from that step on, before its votes (a straggler), `term` sends the
rank SIGTERM at the start of the step (a preemption that lands in a known step); under
Guard.watch, `nanact` makes the output of the rank's first block NaN (its activations, say on
pipeline stage 0) and `nangrad` the gradient into its last block's output (backward only: the
loss stays finite). A fault fires once
per run: not again in an attempt that torchrun restarted (titanlite.runtime.restart), nor after
a spike rollback; with `/every` it fires once in every attempt (a fault that is the data's, not
the machine's: fault_tolerance.rerun_on_nonfinite must find it again).
"""

from __future__ import annotations

import contextlib
import faulthandler
import functools
import os
import signal
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from titanlite.config.job import Comm, Training
from titanlite.errors import RunError
from titanlite.runtime.launch import last_word, users_signal
from titanlite.runtime.restart import Rerun, fired_faults, note_fired
from titanlite.runtime.spikes import SpikeWindow
from titanlite.runtime.verdict import Counts, NonFiniteStop, StepVerdict

HANG_EXIT_CODE = 124  # as timeout(1): the run was stopped for taking too long
# A rank that reports a hang stays alive this long before exiting: its peers blocked in a
# collective with it reach their own deadlines (the same timeout, armed within a step's
# skew) and write their own reports, instead of failing on its closed connection.
HANG_EXIT_GRACE_S = 5.0


FAULT_KINDS = ("nan", "nanact", "nangrad", "hang", "kill", "slowsave", "spike", "slow", "term")
SPIKE_FACTOR = 1000.0
SLOW_S = 0.5


Fault = tuple[str, int, int | None, bool]
"""(kind, step, rank or None for every rank, whether it fires in every attempt)."""


def parse_faults(spec: str) -> set[Fault]:
    """TITANLITE_FAULTS text -> {(kind, step, rank or None, every attempt)}."""
    faults = set()
    for item in filter(None, (s.strip() for s in spec.split(","))):
        where, slash, when = item.partition("/")
        kind, _, where = where.partition("@")
        step, _, rank = where.partition(":")
        if kind not in FAULT_KINDS or not step.isdigit() or (rank and not rank.isdigit()) or \
                (slash and when != "every"):
            raise ValueError(f"TITANLITE_FAULTS: bad item '{item}'; expected "
                             f"{'|'.join(FAULT_KINDS)}@STEP[:RANK][/every]")
        faults.add((kind, int(step), int(rank) if rank else None, bool(slash)))
    return faults


def _spec(fault: Fault) -> str:
    kind, step, rank, every = fault
    return f"{kind}@{step}" + ("" if rank is None else f":{rank}") + ("/every" if every else "")


def enable_flight_recorder(dump_folder: str) -> None:
    """Keep a ring buffer of recent collectives, dumped on NCCL timeouts; set before the process
    group exists. Values the user already exported win."""
    prefix = str(Path(dump_folder, "hang").resolve() / "nccl-trace-rank-")
    for key, value in [("TORCH_FR_BUFFER_SIZE", "2000"), ("TORCH_NCCL_DUMP_ON_TIMEOUT", "1"), ("TORCH_FR_DUMP_TEMP_FILE", prefix),
                       ("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", prefix)]:
        os.environ.setdefault(key, value)


def dump_hang_report(folder: Path, rank: int, reason: str, exc: BaseException | None = None) -> Path:
    """Write why, the exception if any, and every thread's Python stack to hang/rank-R.txt."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"rank-{rank}.txt"
    with open(path, "w") as f:
        f.write(f"rank {rank}: {reason}\n\n")
        if exc is not None:
            f.write("".join(traceback.format_exception(exc)) + "\n")
        f.flush()
        faulthandler.dump_traceback(file=f, all_threads=True)
    dump_fr = getattr(torch._C._distributed_c10d, "_dump_fr_trace", None)
    if dump_fr is not None:
        with contextlib.suppress(Exception):  # best effort: the recorder may be off or empty
            (folder / f"flight-recorder-rank-{rank}.pkl").write_bytes(dump_fr())
    return path


# The config key that bounds each phase of a step (comm.<key>)
_PHASE_DEADLINES = {"compute": "train_timeout_s", "logging": "train_timeout_s",
                    "checkpoint save": "save_timeout_s", "validation": "validation_timeout_s",
                    "evaluation": "eval_timeout_s"}

_active: Guard | None = None
"""This process's guard while training runs, for as_run_error()."""
_last_step: int | None = None
"""The step the last guard closed at (facts())."""


class Watchdog:
    """Bounds each phase of a step: past its deadline the rank writes every thread's stack to
    hang/ and exits (a rank blocked in a collective cannot raise)."""

    def __init__(self, rank: int, hang_folder: Path, comm: Comm, first_step: int,
                 set_comm_timeout: Callable[[float], None]) -> None:
        self.rank, self.comm, self.hang_folder, self.first_step = rank, comm, hang_folder, first_step
        self.set_comm_timeout = set_comm_timeout
        self.step = first_step - 1
        """The step running now, or the last one completed."""
        self._comm_key: str | None = None
        self._final = False  # a shutdown deadline stands: no later phase moves it
        self._deadline = float("inf")
        self._what = ""
        self._phase = "start-up"
        self._lock = threading.RLock()  # re-entered by the signal handler on the main thread
        self._closed = threading.Event()
        self.fired = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="titanlite-watchdog", daemon=True)
        self._thread.start()

    def arm(self, seconds: float, what: str) -> None:
        """Exit with a hang report unless the next arm() comes within `seconds`."""
        with self._lock:
            if not self._final:
                self._deadline, self._what = time.monotonic() + seconds, f"{what} ({seconds:g} s)"

    def shutdown(self, seconds: float, what: str) -> None:
        """The last deadline: the run must be done within `seconds`, whatever phase follows."""
        with self._lock:
            self.arm(seconds, what)
            self._final = True

    def phase(self, name: str) -> None:
        """Start a phase of the step: compute, checkpoint save, logging, validation or evaluation.
        Each has its own deadline, and a hang report names the phase it stopped in."""
        key = _PHASE_DEADLINES[name]
        if name == "compute" and self.step == self.first_step:
            key = "init_timeout_s"  # this process's first step also compiles and warms up
        self.arm(getattr(self.comm, key), f"comm.{key}")
        if key != self._comm_key:
            # the watchdog first: its report names the phase and holds every thread's stack
            self.set_comm_timeout(getattr(self.comm, key) + HANG_EXIT_GRACE_S)
            self._comm_key = key
        with self._lock:
            self._phase = name

    def _watch(self) -> None:
        while not self._closed.wait(0.2):
            with self._lock:
                expired, what = time.monotonic() > self._deadline, f"{self._what} in {self._phase}"
            if expired:
                self.fired.set()
                path = dump_hang_report(self.hang_folder, self.rank, f"step {self.step}: exceeded {what}")
                last_word(self.rank, HANG_EXIT_CODE, f"titanlite: error: step {self.step}: exceeded {what} on rank "
                          f"{self.rank} (a peer rank may be hung or dead); stacks written to {path}")
                time.sleep(HANG_EXIT_GRACE_S)
                os._exit(HANG_EXIT_CODE)

    def close(self) -> None:
        self._closed.set()
        self._thread.join()


class StopVote:
    """SIGTERM or SIGINT on any rank stops every rank after the same step: this rank's vote
    rides on the step's one all-reduce (titanlite.parallel.grad_norm.global_norm)."""

    def __init__(self, rank: int, shutdown_timeout_s: int, watchdog: Watchdog) -> None:
        self.rank, self.shutdown_timeout_s, self.watchdog = rank, shutdown_timeout_s, watchdog
        self.signal_name: str | None = None
        self.sigints = 0
        self.users = True
        """Whether the signal was the user's, not torchrun ending an attempt (launch.users_signal,
        which also names it: the user's, not the SIGTERM torchrun sends on)."""
        self._previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}

    def _on_signal(self, signum: int, frame: object) -> None:
        name = signal.Signals(signum).name
        self.sigints += name == "SIGINT"
        if self.signal_name is not None:
            # Launchers repeat SIGTERM (scancel signals torchrun, which forwards it), and Ctrl-C
            # reaches torchrun too, which then sends SIGTERM: only a second Ctrl-C means "now".
            if self.sigints >= 2:
                last_word(self.rank, 128 + signum, f"titanlite: second SIGINT on rank {self.rank}; exiting now")
                os._exit(128 + signum)
            return
        users = users_signal(name)
        self.signal_name, self.users = users or name, users is not None
        # torchrun's SIGTERM after another rank failed is not news: the restart's line names the cause
        if self.rank == 0 and self.users:
            print(f"titanlite: {self.signal_name} received at step {self.watchdog.step}; stopping once every rank "
                  "has seen it", flush=True)
        self.watchdog.shutdown(self.shutdown_timeout_s, f"job.shutdown_timeout_s after {self.signal_name}")

    def vote(self, device: torch.device) -> torch.Tensor:
        # torch.full fills on the device; torch.tensor(x, device=cuda) would copy from pageable
        # host memory and synchronize the stream every step
        return torch.full((), float(self.signal_name is not None), device=device)

    def close(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)


class Guard:
    """One rank's watchdog, stop vote and step verdict, and the faults TITANLITE_FAULTS injects."""

    def __init__(self, rank: int, dump_folder: str, comm: Comm, training: Training, shutdown_timeout_s: int,
                 start_step: int = 0, set_comm_timeout: Callable[[float], None] = lambda seconds: None,
                 window: SpikeWindow | None = None, counts: Counts | None = None, rerun: Rerun | None = None) -> None:
        """`set_comm_timeout(seconds)`: the timeout of the process groups' collectives from now on
        (titanlite.parallel.mesh.Groups.set_timeout); `window`, `counts`, `rerun`: StepVerdict's."""
        self.rank, self.comm = rank, comm
        self.hang_folder = Path(dump_folder) / "hang"
        # once per launch: not again in an attempt torchrun restarted (titanlite.runtime.restart)
        fired = fired_faults()
        self.faults = {f for f in parse_faults(os.environ.get("TITANLITE_FAULTS", "")) if f[3] or _spec(f) not in fired}
        self.watchdog = Watchdog(rank, self.hang_folder, comm, start_step + 1, set_comm_timeout)
        self.vote = StopVote(rank, shutdown_timeout_s, self.watchdog)
        self.verdict = StepVerdict(rank, training, window, counts, rerun)
        self._slow = min((f for f in self.faults if f[0] == "slow" and f[2] in (None, rank)), key=lambda f: f[1],
                         default=None)
        self._own: torch.Tensor | None = None
        self._blocks: list[int] = []  # this rank's blocks, by whole-model index (Guard.watch)
        self._n = 0
        self._where: torch.Tensor | None = None
        self._step_start = time.perf_counter()
        self._host_s = 0.0
        self._events: list[torch.cuda.Event] = []
        global _active
        _active = self

    @property
    def step(self) -> int:
        """The step running now, or the last one completed."""
        return self.watchdog.step

    def start_step(self, step: int) -> None:
        """Arm the watchdog for this step: this process's first also covers compilation and warm-up."""
        self.watchdog.step = step
        self._where = None
        self._step_start = time.perf_counter()
        # on a GPU the host runs ahead of the device: time the step with the stream's own events
        self._events = [torch.cuda.Event(enable_timing=True)] if torch.cuda.is_initialized() else []
        for event in self._events:
            event.record()
        self.phase("compute")
        if self._injected("kill"):
            os.kill(os.getpid(), signal.SIGKILL)
        if self._injected("term"):
            os.kill(os.getpid(), signal.SIGTERM)
        if self._injected("hang"):
            threading.Event().wait()

    def phase(self, name: str) -> None:
        self.watchdog.phase(name)
        if name == "checkpoint save" and self._injected("slowsave"):
            time.sleep(self.comm.init_timeout_s + 2)

    def votes(self, loss_sum: torch.Tensor, loss_share: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's votes for the step's all-reduce: signalled, non-finite loss, and with a
        spike window `loss_share`, this rank's share of the step's mean loss (summed over the
        world, the loss the window judges). The rank's own step time ends here."""
        if self._slow is not None and self.step >= self._slow[1]:
            if self.step == self._slow[1]:
                note_fired(_spec(self._slow))
            time.sleep(SLOW_S)  # before the step's closing all-reduce: this rank's own time grows
        self._host_s = time.perf_counter() - self._step_start
        if self._events:
            self._events.append(torch.cuda.Event(enable_timing=True))
            self._events[-1].record()
        votes = [self.vote.vote(loss_sum.device), (~torch.isfinite(loss_sum)).float()]
        self._own = votes[1]  # which rank it was, should the run stop on it
        votes = torch.stack(votes if self.verdict.window is None else [*votes, loss_share])
        if not self._n:
            return votes
        self._mark(self._n, loss_sum)
        return torch.cat([votes, self._where])

    def watch(self, blocks: dict[str, nn.Module], n_blocks: int) -> None:
        """Find where a non-finite value first appears (fault_tolerance.rerun_on_nonfinite), so
        that the rank named is its origin, not a later pipeline stage it flowed into nor a rank
        its reduced gradients reached: this rank's `blocks` (by whole-model index, of
        `n_blocks`) flag a non-finite output (forward, in block order), then the loss, then a
        non-finite gradient of a block's output (backward, in reverse order). The flags join
        the step's votes; the first place flagged on any rank names the ranks that flagged it."""
        self._blocks, self._n = sorted(int(k) for k in blocks), n_blocks
        for name, block in blocks.items():
            block.register_forward_hook(functools.partial(self._forward, int(name)))

    def _mark(self, place: int, t: torch.Tensor) -> None:
        if self._where is None:  # no sync: a device flag per place, read with the verdict
            self._where = torch.zeros(2 * self._n + 1, device=t.device)
        self._where[place] = torch.maximum(self._where[place], (~torch.isfinite(t).all()).float())

    def _forward(self, index: int, module: nn.Module, args: Any, output: Any) -> Any:
        out = output if isinstance(output, torch.Tensor) else output[0] if isinstance(output, tuple) else None
        if not isinstance(out, torch.Tensor):  # a block that returns no hidden state to watch
            return None
        if index == self._blocks[0] and torch.is_grad_enabled() and self._injected("nanact"):
            out = out * float("nan")
        self._mark(index, out)
        if out.requires_grad:
            out.register_hook(functools.partial(self._backward, index))
        return out if isinstance(output, torch.Tensor) else (out, *output[1:])

    def _backward(self, index: int, grad: torch.Tensor) -> torch.Tensor:
        if index == self._blocks[-1] and self._injected("nangrad"):
            grad = grad * float("nan")
        self._mark(2 * self._n - index, grad)  # block n-1's first: backward runs in reverse
        return grad

    @property
    def own_s(self) -> float:
        """This rank's own time in the step, up to its votes (the straggler report): CUDA events
        on a GPU, else the host timer; a wait inside an earlier collective counts as the waiting
        rank's. Read on logged steps, whose host already waits for the step's all-reduce, which
        comes after the end event: no sync of its own."""
        if len(self._events) < 2:
            return self._host_s
        self._events[1].synchronize()
        return self._events[0].elapsed_time(self._events[1]) / 1e3

    def decide(self, norm: torch.Tensor, votes: torch.Tensor, read_now: bool) -> torch.Tensor:
        """The step's verdict from the global norm and the summed votes (StepVerdict); under
        `watch`, this rank's own vote is whether it flagged the first place any rank flagged."""
        own = self._own
        if self._n:
            votes, flagged = votes[:-len(self._where)], votes[-len(self._where):]
            first = (flagged > 0).float().argmax()  # the first maximum: the earliest place
            own = ((flagged[first] > 0) & (self._where[first] > 0)).float()
        return self.verdict(self.step, norm, votes, read_now, own)

    def rolled_back(self, step: int) -> None:
        """The run went back to `step` (a spike rollback; the verdicts were read, StepVerdict.flush):
        each injected fault up to now has fired (once per run, as after a restart)."""
        self.faults = {f for f in self.faults if f[1] > self.step}
        self.verdict.counts.streak, self.watchdog.step = [], step

    def _injected(self, kind: str) -> bool:
        fault = next((f for f in sorted(self.faults, key=str) if f[:2] == (kind, self.step) and f[2] in (None, self.rank)),
                     None)
        if fault is not None:
            note_fired(_spec(fault))
        return fault is not None

    def faulty_loss(self, loss_fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        """`loss_fn` (titanlite.loss.LossFn), non-finite in the training step that a `nan` fault names,
        SPIKE_FACTOR times larger in one a `spike` fault names (validation, under no_grad, is left alone)."""
        def loss(logits: torch.Tensor, labels: torch.Tensor, extra=None) -> torch.Tensor:
            out = loss_fn(logits, labels, extra)
            if not torch.is_grad_enabled():
                return out
            if self._injected("nan"):
                return out * float("nan")
            return out * SPIKE_FACTOR if self._injected("spike") else out
        return loss

    def close(self) -> None:
        self.watchdog.close()
        self.vote.close()
        global _active, _last_step
        _active, _last_step = None, self.step


def facts(err: BaseException | None) -> dict[str, Any]:
    """What this rank's report adds for a restarted attempt (titanlite.runtime.restart): the step
    it was in, and for a non-finite stop, which step and whether this rank's loss it was."""
    step = _last_step if _active is None else _active.step
    out: dict[str, Any] = {} if step is None else {"step": step}
    if isinstance(err, NonFiniteStop):
        out |= {"nonfinite": {"step": err.step, "what": err.what, "own": err.own}, "final": err.final}
    return out


def defer_to_watchdog() -> None:
    """Once the watchdog has reported a hang, a failing collective is its consequence (a peer
    that reported first has exited): let the watchdog finish and exit with the hang code."""
    if _active is not None and _active.watchdog.fired.is_set():
        _active.watchdog.close()


def as_run_error(e: BaseException) -> RunError | None:
    """A failed collective (dead or hung peer) or out-of-memory as a one-line RunError, with
    a report in hang/ for the former; None for anything else (a bug keeps its traceback)."""
    guard = _active
    if guard is None:
        return None
    if isinstance(e, torch.OutOfMemoryError):
        return RunError(f"step {guard.step}: out of memory on rank {guard.rank}; lower "
                        "training.local_batch_size (raise global_batch_size's accumulation instead) or set "
                        "activation_checkpoint.mode = full")
    if not (isinstance(e, dist.DistError) or (isinstance(e, RuntimeError) and "gloo" in str(e).lower())):
        return None
    path = dump_hang_report(guard.hang_folder, guard.rank, f"step {guard.step}: collective failed", e)
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return RunError(f"step {guard.step}: a collective failed on rank {guard.rank}; a peer rank probably "
                    f"died or hung ({first}); report in {path}")
