"""Profiler traces for a window of steps, and CUDA memory snapshots (window and out-of-memory).

Traces: <dump_folder>/profile/step-N/rankR.pt.trace.json, N being the window's last step;
open in Perfetto (ui.perfetto.dev) or `tensorboard --logdir <dump_folder>/profile/step-N`
with the torch-tb-profiler plugin. Snapshots: memory_snapshot/step-N/rankR.pickle and
memory_snapshot/oom/rankR.pickle, for pytorch.org/memory_viz. On CPU there are no
snapshots; the metrics' peak_gib is then the process's peak RSS.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, schedule

from titanlite.config.job import Profiling


class Profiler:
    """Call `step_begin(step)` before and `step_end(step)` after every training step."""

    def __init__(self, cfg: Profiling, dump_folder: str, rank: int, device: torch.device) -> None:
        self.cfg, self.rank, self.device = cfg, rank, device
        self.folder = Path(dump_folder)
        self.last = cfg.start_step + cfg.num_steps - 1
        self.snapshots = cfg.memory_snapshot and device.type == "cuda"
        self._prof: profile | None = None
        if cfg.memory_snapshot and not self.snapshots and rank == 0:
            print("titanlite: profiling.memory_snapshot needs CUDA; on CPU the metrics report peak RSS "
                  "as peak_gib", file=sys.stderr, flush=True)
        if self.snapshots:
            # from the start, so an out-of-memory snapshot shows how memory got there
            torch.cuda.memory._record_memory_history(max_entries=200_000)
            torch._C._cuda_attach_out_of_memory_observer(self._on_oom)

    def step_begin(self, step: int) -> None:
        # one unrecorded warm-up step before the window, as the profiler docs advise
        warmup = 1 if self.cfg.start_step > 1 else 0
        if self.cfg.enable and step == self.cfg.start_step - warmup:
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
            self._prof = profile(activities=activities, record_shapes=True, profile_memory=True,
                                 schedule=schedule(skip_first=step, wait=0, warmup=warmup,
                                                   active=self.cfg.num_steps, repeat=1),
                                 on_trace_ready=self._write_trace)
            self._prof.step_num = step  # so ProfilerStep#N in the trace is training step N
            self._prof.start()

    def step_end(self, step: int) -> None:
        if self._prof is not None:
            self._prof.step()
            if step == self.last:
                self._prof.stop()
                self._prof = None
        if self.snapshots and step == self.last:
            self._snapshot(self.folder / "memory_snapshot" / f"step-{step}")

    def _write_trace(self, prof: profile) -> None:
        folder = self.folder / "profile" / f"step-{self.last}"
        folder.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(folder / f"rank{self.rank}.pt.trace.json"))

    def _on_oom(self, device: int, alloc: int, device_alloc: int, device_free: int) -> None:
        path = self._snapshot(self.folder / "memory_snapshot" / "oom")
        print(f"titanlite: out of memory on rank {self.rank} ({alloc / 2**30:.2f} GiB requested, "
              f"{device_free / 2**30:.2f} GiB free); snapshot in {path}", file=sys.stderr, flush=True)

    def _snapshot(self, folder: Path) -> Path:
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"rank{self.rank}.pickle"
        torch.cuda.memory._dump_snapshot(str(path))
        return path
