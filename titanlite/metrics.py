"""Rank-0 metrics: one console line, TensorBoard scalars and metrics.jsonl per logged step.

Several runs may share a dump folder: each row of metrics.jsonl names its run (`run`), the
first row of a run or a resume says so (`begins`), and TensorBoard events go to tb/<run>/.

A run that goes back (a restart or resume from a checkpoint, a spike rollback) logs some steps
again. The rows of the steps it undid stay in metrics.jsonl, marked: every row is written with
`"superseded": false`, turned true in place when the run goes back past its step, so keeping
the rows of a run whose `superseded` is false keeps one row per step, the run's line.
TensorBoard is told the same way it is told of a restart (SummaryWriter's purge_step: a
SessionLog.START at the first step logged again hides the run's later events before it)."""

from __future__ import annotations

import json
import os
import resource
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

# Dense bf16 peak FLOP/s (no sparsity) by device-name fragment; unknown devices get no MFU.
PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 125e12}

TB_TAGS = {"loss": "loss/train", "grad_norm": "train/grad_norm", "lr": "train/lr",
           "tokens_per_sec": "perf/tokens_per_sec", "mfu_pct": "perf/mfu_pct", "peak_gib": "memory/peak_gib",
           "skipped_steps": "train/skipped_steps", "spike_steps": "train/spike_steps",
           "straggler_ratio": "perf/straggler_ratio", "straggler_rank": "perf/straggler_rank",
           "epoch": "data/epoch", "chats_truncated": "data/chats_truncated", "chats_dropped": "data/chats_dropped",
           "z_loss": "loss/z", "moe_aux_loss": "moe/aux_loss",
           "moe_load_max_over_mean_worst": "moe/tokens_per_expert_max_over_mean_worst_layer",
           "moe_load_max_over_mean_avg": "moe/tokens_per_expert_max_over_mean_avg_layers",
           "moe_router_bias_norm": "moe/router_bias_norm"}


def device_peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_FLOPS.items() if k in name), None)


def peak_memory_gib(device: torch.device) -> float:
    """Peak allocated CUDA memory, or this process's peak RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB


def default_run_name(model: str, flavor: str) -> str:
    """job.run_name when empty: the model, its flavor and the start time (the launch's, which
    every restarted attempt shares: one run)."""
    return f"{model}-{flavor}-{os.environ.get('TITANLITE_RUN_STARTED') or time.strftime('%Y%m%d-%H%M%S')}"


_LIVE, _DEAD = b'"superseded": false}', b'"superseded": true }'  # the same length: turned in place


def supersede(path: Path, run: str, after: int) -> int:
    """Mark `run`'s rows of steps after `after` superseded, in place; returns how many. Reads
    back from the end until that run's last live row of a step at or before `after`."""
    if not path.exists():
        return 0
    marked, mine = 0, b'"run": ' + json.dumps(run).encode()
    with open(path, "r+b") as f:
        end, chunk, tail = f.seek(0, os.SEEK_END), 1 << 20, b""
        while end > 0:
            start = max(0, end - chunk)
            f.seek(start)
            data = f.read(end - start) + tail
            end = start
            if start:  # the first piece may be the end of a line that began before the chunk
                tail, _, data = data.partition(b"\n")
                start += len(tail) + 1
            if mine not in data:
                continue  # no row of this run (found without parsing: a long file reads fast)
            places, offset = [], start
            for line in data.split(b"\n"):
                places.append((offset, line))
                offset += len(line) + 1
            for at, line in reversed(places):
                if mine not in line or not line.endswith(_LIVE):
                    continue
                try:
                    row = json.loads(line)
                except ValueError:
                    continue  # cut short by a crash
                if row.get("run") != run:
                    continue
                if row.get("step", 0) <= after:
                    return marked
                f.seek(at + len(line) - len(_LIVE))
                f.write(_DEAD)
                marked += 1
    return marked


def reduce_losses(loss_sum: torch.Tensor, extra: dict[str, torch.Tensor], n_targets: torch.Tensor,
                  names: tuple[str, ...], tp_replicated: tuple[str, ...], tp_first: bool) -> dict[str, float]:
    """The step's loss and each extra term `names` per target token, over all ranks in one
    all-reduce: tensor-parallel ranks hold the same loss sum (counted once, on the first) but
    extra terms over the tokens each rank routed (a MoE layer's tp ranks route different
    sequence shards), except those `tp_replicated` names."""
    zero = torch.zeros_like(loss_sum)
    sums = torch.stack([loss_sum if tp_first else zero,
                        *(extra.get(n, zero) if tp_first or n not in tp_replicated else zero for n in names)])
    dist.all_reduce(sums)
    values = (sums / n_targets).tolist()
    return {"loss": values[0], **dict(zip(names, values[1:]))}


class Throughput:
    """Tokens per second per device and MFU since the last logged step, and the time left."""

    def __init__(self, start_step: int, final_step: int, tokens_per_step: int, flops_per_token: float,
                 peak_flops: float | None, world_size: int, tokens_after: Callable[[int], int] | None = None):
        """`tokens_after(step)`: the tokens steps 1..step read, if not step x tokens_per_step (a warm-up)."""
        self.start_step, self.final_step = start_step, final_step
        self.tokens_after = tokens_after or (lambda step: step * tokens_per_step)
        self.flops_per_token = flops_per_token
        self.peak_flops, self.world_size = peak_flops, world_size
        self.start = self.last = time.perf_counter()
        self.last_step = start_step

    def __call__(self, step: int) -> tuple[dict[str, float | None], float]:
        """({tokens_per_sec, mfu_pct}, eta in seconds) at `step`, which becomes the last logged."""
        now = time.perf_counter()
        tokens = self.tokens_after(step) - self.tokens_after(self.last_step)
        tokens_per_sec = tokens / (now - self.last) / self.world_size
        mfu = None if self.peak_flops is None else 100 * tokens_per_sec * self.flops_per_token / self.peak_flops
        eta = (now - self.start) / (step - self.start_step) * (self.final_step - step)
        self.last, self.last_step = now, step
        return {"tokens_per_sec": tokens_per_sec, "mfu_pct": mfu}, eta

    def pause(self, seconds: float) -> None:
        """Leave `seconds` (validation) out of the next tokens_per_sec."""
        self.last += seconds


def _cut_short(path: Path) -> bool:
    """Whether the file's last line lacks its newline."""
    with open(path, "rb") as f:
        return f.seek(0, os.SEEK_END) > 0 and f.seek(-1, os.SEEK_END) >= 0 and f.read(1) != b"\n"


class MetricsLogger:
    """Writes only on rank 0; other ranks hold a disabled instance so call sites stay simple."""

    def __init__(self, dump_folder: str, run_name: str, enable_tensorboard: bool, enabled: bool,
                 start_step: int = 0, config_text: str = ""):
        """`start_step`: the step the run resumes after (0: a fresh start), past which its rows so
        far are superseded; `config_text`: the run's config, written to TensorBoard as text."""
        self.enabled = enabled
        self.writer = None
        self.run_name = run_name
        self.begins: str | None = "start" if start_step == 0 else f"resume after step {start_step}"
        if not enabled:
            return
        folder = Path(dump_folder)
        folder.mkdir(parents=True, exist_ok=True)
        self.path, self.tb = folder / "metrics.jsonl", folder / "tb" / run_name if enable_tensorboard else None
        supersede(self.path, run_name, start_step)
        self.jsonl = open(self.path, "a")
        if _cut_short(self.path):
            self.jsonl.write("\n")  # a row cut short by a crash stays a line of its own
        self._open_tensorboard(start_step)
        if self.writer is not None and config_text:
            # markdown: a code block keeps the TOML's lines and indentation
            self.writer.add_text("config", "```toml\n" + config_text + "\n```", start_step)

    def _open_tensorboard(self, after: int) -> None:
        """Events from step `after` + 1 on replace the run's earlier ones (purge_step)."""
        if self.tb is not None:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(self.tb), purge_step=after + 1)

    def rewind(self, step: int) -> None:
        """The run went back to `step` (a spike rollback): its rows after it are superseded, and
        TensorBoard shows the steps logged again as the run's line."""
        if not self.enabled:
            return
        self.jsonl.flush()
        supersede(self.path, self.run_name, step)
        self.begins = f"rollback to step {step}"
        if self.writer is not None:
            self.writer.close()
            self._open_tensorboard(step)

    def _row(self, row: dict) -> None:
        """One line of metrics.jsonl, named by the run; the run's first says where it begins."""
        row = {**row, "run": self.run_name}
        if self.begins is not None:
            row["begins"], self.begins = self.begins, None
        self.jsonl.write(json.dumps({**row, "superseded": False}) + "\n")
        self.jsonl.flush()

    def log(self, step: int, values: dict[str, float | str | None], eta_s: float) -> None:
        if not self.enabled:
            return
        self._row({"step": step, **values})
        if self.writer is not None:
            for key, value in values.items():
                if value is not None and not isinstance(value, str):  # a model's extra losses and hook scalars under train/
                    self.writer.add_scalar(TB_TAGS.get(key, f"train/{key}"), value, step)
        mfu = "-" if values["mfu_pct"] is None else f"{values['mfu_pct']:.1f}%"
        print(f"step {step:6d}  loss {values['loss']:.4f}  grad_norm {values['grad_norm']:.4f}  "
              f"lr {values['lr']:.2e}  tok/s/dev {values['tokens_per_sec']:,.0f}  mfu {mfu}  "
              f"peak_mem {values['peak_gib']:.2f}GiB  eta {eta_s / 60:.1f}min"
              + ("" if values.get("epoch") is None else f"  epoch {values['epoch']}")
              + ("" if "straggler_ratio" not in values else f"  slowest rank {values['straggler_rank']} "
                 f"({values['straggler_host']}) {values['straggler_ratio']:.2f}x median"), flush=True)

    def log_validation(self, step: int, loss: float, more: dict[str, float] | None = None) -> None:
        """A row of its own: {"step", "val_loss"} and `more` (a preference run's held-out rewards and
        log-probs, "val_rewards/accuracies", ...); TensorBoard tags loss/validation and validation/NAME."""
        if not self.enabled:
            return
        more = more or {}
        self._row({"step": step, "val_loss": loss, **more})
        if self.writer is not None:
            self.writer.add_scalar("loss/validation", loss, step)
            for key, value in more.items():
                self.writer.add_scalar(f"validation/{key.removeprefix('val_')}", value, step)
        print(f"step {step:6d}  val_loss {loss:.4f}" + "".join(f"  {k} {v:.4f}" for k, v in more.items()), flush=True)

    def log_eval(self, step: int, values: dict[str, float]) -> None:
        """A row of its own: {"step", "eval/<task>/<metric>", ..., "eval/seconds"}; the same TensorBoard
        tags; one console line."""
        if not self.enabled:
            return
        self._row({"step": step, **values})
        if self.writer is not None:
            for key, value in values.items():
                self.writer.add_scalar(key, value, step)
        print(f"step {step:6d}  eval " + "  ".join(f"{k.removeprefix('eval/')} {v:.4f}" for k, v in values.items()
                                                   if k != "eval/seconds") + f"  ({values['eval/seconds']:.1f}s)",
              flush=True)

    def close(self) -> None:
        if self.enabled:
            self.jsonl.close()
            if self.writer is not None:
                self.writer.close()
