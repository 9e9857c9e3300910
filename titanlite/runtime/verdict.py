"""A step's verdict: what the votes the step's all-reduce summed (titanlite.runtime.fault.Guard)
decide, read on the host a step late unless asked, and the counts it keeps (skipped steps,
spikes, the current streak of them), which checkpoints save and replica groups heal."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from typing import Any

import torch

from titanlite.config.job import Training
from titanlite.errors import RunError
from titanlite.runtime.restart import Rerun
from titanlite.runtime.spikes import SpikeWindow


@dataclass
class Counts:
    """What the step verdicts counted so far: part of the checkpoint (a resumed run counts on as
    an uninterrupted one would) and of a replica group's heal."""

    skipped: int = 0
    """Steps whose update was skipped: non-finite, or spikes."""
    spikes: int = 0
    """Steps skipped as loss or gradient-norm spikes (training.on_spike skip or rollback)."""
    streak: list[int] = field(default_factory=list)
    """The steps of the current run of spikes in a row, as read (training.on_spike = rollback)."""

    def state_dict(self) -> dict[str, Any]:
        return {"skipped": self.skipped, "spikes": self.spikes, "streak": json.dumps(self.streak)}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.skipped, self.spikes, self.streak = int(sd["skipped"]), int(sd["spikes"]), json.loads(sd["streak"])


class NonFiniteStop(RunError):
    """A non-finite step under training.on_nonfinite = stop; `own`: this rank's loss was the
    non-finite one; `final`: it was the rerun of the same step (fault_tolerance.rerun_on_nonfinite),
    no restart can help."""

    def __init__(self, message: str, step: int, what: str, own: bool, final: bool) -> None:
        super().__init__(message)
        self.step, self.what, self.own, self.final = step, what, own, final


class StepVerdict:
    """What a step's summed votes decide: stop after it, skip its update (non-finite loss or
    gradient norm under on_nonfinite = skip), or end the run with a RunError. Read on the host
    one step late unless asked (see the module doc)."""

    def __init__(self, rank: int, training: Training, window: SpikeWindow | None = None,
                 counts: Counts | None = None, rerun: Rerun | None = None) -> None:
        """`window`: the spike statistics when training.on_spike is on, `counts` the counts so
        far (both checkpointed by the caller); `rerun`: the step a restart reruns
        (fault_tolerance.rerun_on_nonfinite)."""
        self.rank, self.training, self.window, self.rerun = rank, training, window, rerun
        self.counts = counts or Counts()
        self.stop = False
        """All ranks stop after this step: a signal reached one of them (a read verdict)."""
        self.skip = False
        """This step's verdict was read at once and its update is skipped (non-finite)."""
        self._pending: tuple[int, torch.Tensor, torch.cuda.Event | None] | None = None

    @property
    def skipped(self) -> int:
        return self.counts.skipped

    @property
    def spikes(self) -> int:
        return self.counts.spikes

    @property
    def streak(self) -> list[int]:
        return self.counts.streak

    def __call__(self, step: int, norm: torch.Tensor, votes: torch.Tensor, read_now: bool,
                 own: torch.Tensor | None = None) -> torch.Tensor:
        """`votes`: (ranks signalled, ranks with a non-finite loss[, the mean loss with a spike
        window]), summed over the world; `own`: this rank's own non-finite-loss vote. Returns a
        device flag, 1.0 when this step must not update (the fused optimizer's `found_inf`):
        non-finite, or a spike. Reads the previous step's verdict if still unread, and this
        step's too when `read_now` or when the run stops after this step (nothing may be saved
        unread)."""
        bad_loss, bad_grad = votes[1] > 0, ~torch.isfinite(norm)
        spike = (self.window.judge(votes[2], norm, bad_loss | bad_grad) if self.window is not None
                 else torch.zeros((), dtype=torch.bool, device=norm.device))
        mine = torch.zeros_like(spike) if own is None else own > 0
        verdict = torch.stack([votes[0] > 0, bad_loss, bad_grad, spike, mine])
        if self._pending is not None:
            self._read(*self._pending, step)
        self._pending = (step, *_start_host_copy(verdict))
        self.skip = False
        if read_now or self.stop:  # a stopping step saves and logs: it syncs anyway
            self._read(*self._pending, step)
        return (verdict[1] | verdict[2] | verdict[3]).float()

    def flush(self) -> None:
        """Read the verdict still unread, if any (before a rollback undoes its step)."""
        if self._pending is not None:
            self._read(*self._pending, self._pending[0])

    def _read(self, step: int, host: torch.Tensor, copied: torch.cuda.Event | None, now: int) -> None:
        self._pending = None
        if copied is not None:
            copied.synchronize()
        stop, bad_loss, bad_grad, spike, own = host.tolist()
        self.stop = self.stop or stop
        c = self.counts
        c.streak = [*c.streak, step] if spike else []
        again = self.rerun is not None and step == self.rerun.step
        if not (bad_loss or bad_grad or spike):
            if again:
                self.rerun.transient()
                self.rerun = None
            return
        what = "loss" if bad_loss else "gradient norm"
        if spike:
            c.spikes += 1
            t = self.training
            what = (f"loss or gradient norm over training.spike_sigmas ({t.spike_sigmas:g}) standard deviations "
                    f"above the last {t.spike_window} steps' mean (training.on_spike = {t.on_spike})")
        elif self.training.on_nonfinite == "stop":
            why, fix = (self.rerun.again(bool(own)) if again else
                        ("(training.on_nonfinite = stop); no update was applied and the last checkpoint is kept. ",
                         "Lower optimizer.lr, check the data, or set training.on_nonfinite = skip"))
            raise NonFiniteStop(f"step {step}: non-finite {what} {why}{fix}", step, what, bool(own), again)
        self.skip = step == now
        c.skipped += 1
        if c.skipped > self.training.max_skipped_steps:
            raise RunError(f"step {step}: {c.skipped} steps with non-finite loss or gradients, more "
                           f"than training.max_skipped_steps ({self.training.max_skipped_steps}); stopping")
        if self.rank == 0:
            print(f"titanlite: warning: step {step}: {'' if spike else 'non-finite '}{what}; optimizer step skipped "
                  f"({c.skipped} of at most {self.training.max_skipped_steps})", file=sys.stderr, flush=True)


def _start_host_copy(t: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    """A host copy of a small device tensor, and the event that marks it complete; waiting
    on that event later waits only for the work queued before it, not for later steps."""
    if t.device.type != "cuda":
        return t, None
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record()
    return host, copied
