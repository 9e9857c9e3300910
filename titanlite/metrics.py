"""Rank-0 metrics: one console line, TensorBoard scalars and metrics.jsonl per logged step."""

from __future__ import annotations

import json
import resource
import time
from pathlib import Path

import torch

# Dense bf16 peak FLOP/s (no sparsity) by device-name fragment; unknown devices get no MFU.
PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 125e12}

TB_TAGS = {"loss": "loss/train", "grad_norm": "train/grad_norm", "lr": "train/lr",
           "tokens_per_sec": "perf/tokens_per_sec", "mfu_pct": "perf/mfu_pct", "peak_gib": "memory/peak_gib",
           "skipped_steps": "train/skipped_steps", "spike_steps": "train/spike_steps",
           "straggler_ratio": "perf/straggler_ratio", "straggler_rank": "perf/straggler_rank",
           "epoch": "data/epoch", "moe_aux_loss": "moe/aux_loss",
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


class MetricsLogger:
    """Writes only on rank 0; other ranks hold a disabled instance so call sites stay simple."""

    def __init__(self, dump_folder: str, run_name: str, enable_tensorboard: bool, enabled: bool):
        self.enabled = enabled
        self.writer = None
        if not enabled:
            return
        folder = Path(dump_folder)
        folder.mkdir(parents=True, exist_ok=True)
        self.jsonl = open(folder / "metrics.jsonl", "a")
        if enable_tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(folder / "tb" / (run_name or time.strftime("%Y%m%d-%H%M%S"))))

    def log(self, step: int, values: dict[str, float | str | None], eta_s: float) -> None:
        if not self.enabled:
            return
        row = {"step": step, **values}
        self.jsonl.write(json.dumps(row) + "\n")
        self.jsonl.flush()
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

    def log_validation(self, step: int, loss: float) -> None:
        """A row of its own: {"step", "val_loss"}; TensorBoard tag loss/validation."""
        if not self.enabled:
            return
        self.jsonl.write(json.dumps({"step": step, "val_loss": loss}) + "\n")
        self.jsonl.flush()
        if self.writer is not None:
            self.writer.add_scalar("loss/validation", loss, step)
        print(f"step {step:6d}  val_loss {loss:.4f}", flush=True)

    def close(self) -> None:
        if self.enabled:
            self.jsonl.close()
            if self.writer is not None:
                self.writer.close()
