"""Loss spikes and stragglers: rolling statistics judged on the device, step times compared on the host.

`SpikeWindow` keeps the global loss and gradient norm of the last `size` applied steps on the
device. A step is a spike when either value is more than `sigmas` standard deviations above its
window's mean (OLMo-core's rule; PaLM skipped such batches by hand). The verdict is a device
tensor computed from the all-reduced values, so every rank holds the same window and decides
the same, and the host reads it with the non-finite verdict (titanlite.runtime.fault.Guard),
one step late where that one is. A spike's values never enter the window: one spike does not
widen the band that the next one is judged against.

`Stragglers` compares each rank's own step time on logged steps (one all-gather of one float).
"""

from __future__ import annotations

import socket
import statistics
import sys
from typing import Any

import torch
import torch.distributed as dist

from titanlite.errors import ConfigError


class SpikeWindow:
    """The last `size` applied steps' (loss, grad norm), on the device; part of the checkpoint."""

    def __init__(self, size: int, sigmas: float, device: torch.device) -> None:
        self.size, self.sigmas = size, sigmas
        self.values = torch.zeros(size, 2, device=device, dtype=torch.float64)
        self.count = torch.zeros((), device=device, dtype=torch.int64)
        """Applied steps seen so far (the next slot is count % size)."""

    def judge(self, loss: torch.Tensor, norm: torch.Tensor, bad: torch.Tensor) -> torch.Tensor:
        """True (device bool) when this step is a spike; admits it to the window when it is
        neither a spike nor `bad` (non-finite: the step is skipped anyway)."""
        x = torch.stack([loss, norm]).double()
        full = self.count >= self.size  # too few steps make no band: judge nothing before
        mean, std = self.values.mean(0), self.values.std(0)
        spike = full & ~bad & ((x - mean) > self.sigmas * std).any()
        admit = ~(spike | bad)
        slot = (torch.arange(self.size, device=x.device) == self.count % self.size) & admit
        self.values.copy_(torch.where(slot[:, None], x, self.values))
        self.count += admit.long()
        return spike

    def state_dict(self) -> dict[str, Any]:
        return {"values": self.values.cpu(), "count": self.count.cpu()}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        if sd["values"].shape != self.values.shape:
            raise ConfigError(f"the checkpoint's spike window holds {sd['values'].shape[0]} steps, not "
                              f"training.spike_window {self.size}; keep the run's spike_window to resume it")
        self.values.copy_(sd["values"])
        self.count.copy_(sd["count"])


class Stragglers:
    """Every logged step: each rank's own step time gathered, the slowest named against the median."""

    def __init__(self, ratio: float, logs_in_row: int, device: torch.device) -> None:
        self.ratio, self.logs_in_row, self.device = ratio, logs_in_row, device
        hosts: list[str | None] = [None] * dist.get_world_size()
        dist.all_gather_object(hosts, socket.gethostname())  # once, at set-up
        self.hosts = hosts
        self._over: dict[int, int] = {}
        """rank -> logged steps in a row it was over `ratio`."""

    def report(self, step: int, own_s: float) -> dict[str, float | int | str]:
        """Collective (every rank, on logged steps only): the slowest rank, its host and its ratio
        to the median of every rank's own step time; warns once a rank stays over `ratio`."""
        mine = torch.full((1,), own_s, dtype=torch.float64, device=self.device)
        times = [torch.empty_like(mine) for _ in self.hosts]
        dist.all_gather(times, mine)
        seconds = torch.cat(times).tolist()  # one copy to the host, not one per rank
        median = statistics.median(seconds)
        slow = max(range(len(seconds)), key=seconds.__getitem__)
        ratio = seconds[slow] / median if median > 0 else 1.0
        for rank, s in enumerate(seconds):
            over = median > 0 and s / median > self.ratio
            self._over[rank] = self._over.get(rank, 0) + 1 if over else 0
            if self._over[rank] == self.logs_in_row and dist.get_rank() == 0:
                print(f"titanlite: warning: step {step}: rank {rank} on {self.hosts[rank]} is a straggler: its "
                      f"step takes {s / median:.2f}x the median for {self.logs_in_row} logs in a row "
                      f"(metrics.straggler_ratio {self.ratio:g})", file=sys.stderr, flush=True)
        return {"straggler_rank": slow, "straggler_host": self.hosts[slow], "straggler_ratio": ratio}
