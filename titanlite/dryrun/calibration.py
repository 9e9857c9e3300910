"""Published training runs the step-time model is held against, and the table of its predictions:

    python -m titanlite.dryrun.calibration [NAME ...]

Each run is dry-run with titanlite's own step at the published layout; docs/scaling.md says
which runs fitted the two factors of titanlite.dryrun.timing and which are held out.
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass

from titanlite.config import load as config_load
from titanlite.dryrun import hardware
from titanlite.dryrun.run import dry_run, report

PERF = "TorchTitan docs/performance.md"
ASYNC_TP = "TorchTitan benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md"
_SEL_OP = ("--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_type", "op")
_FSDP_ONLY = ["--parallelism.pipeline_parallel_degree", "1", "--parallelism.tensor_parallel_degree", "1",
              "--training.local_batch_size", "1"]


@dataclass(frozen=True)
class Published:
    name: str
    argv: tuple[str, ...]
    """The config and overrides that give the published layout, batch and AC."""
    ngpu: int
    gpu: str
    tokens_per_sec_per_gpu: float
    mfu_pct: float | None
    fitted: bool
    """Whether the run was used to fit timing's factors (the others are held out)."""
    source: str
    compiled: bool = False
    """Whether the published run compiled its blocks (the dry run traces eager and times both)."""


RUNS = [
    Published("llama3_8b_a100_sel_op", ("--config", "llama_8b.toml", *_FSDP_ONLY, "--activation_checkpoint.mode",
              "selective", "--activation_checkpoint.selective_type", "op"), 64, "a100", 2973, 58.2, True,
              f"{PERF} (2024, 64 A100 80GB, FSDP, batch 1 x 8192)"),
    Published("llama3_8b_a100_sel_layer", ("--config", "llama_8b.toml", *_FSDP_ONLY, "--activation_checkpoint.mode",
              "selective", "--activation_checkpoint.selective_type", "layer"), 64, "a100", 2876, 56.3, False,
              f"{PERF} (2024, 64 A100 80GB, FSDP, batch 1 x 8192)"),
    Published("llama3_70b_a100_full", ("--config", "llama_70b.toml", *_FSDP_ONLY), 64, "a100", 323, 50.5, False,
              f"{PERF} (2024, 64 A100 80GB, FSDP, batch 1 x 8192)"),
    Published("llama3_405b_h100_fsdp_tp", ("--config", "llama_405b.toml", "--parallelism.pipeline_parallel_degree",
              "1", "--training.local_batch_size", "2", "--activation_checkpoint.mode", "full"), 128, "h100_500w",
              109, 29.0, True, f"{PERF} (2024, 128 H100 Grand Teton, FSDP 16 x TP 8, batch 2 x 8192)"),
    Published("llama3_8b_h100_8gpu", ("--config", "llama_8b.toml", "--training.local_batch_size", "2", *_SEL_OP), 8,
              "h100_500w", 5762, None, False, f"{PERF} (2025, Table 1: 8 H100 Grand Teton, FSDP, eager)"),
    Published("llama3_8b_h100_128gpu", ("--config", "llama_8b.toml", "--training.local_batch_size", "2", *_SEL_OP), 128,
              "h100_500w", 5605, None, False, f"{PERF} (2025, Table 3: 128 H100 Grand Teton, FSDP, eager)"),
    Published("llama3_8b_h100_8gpu_compiled", ("--config", "llama_8b.toml", "--training.local_batch_size", "2",
              *_SEL_OP), 8, "h100_500w", 6667, None, True,
              f"{PERF} (2025, Table 1: 8 H100 Grand Teton, FSDP + torch.compile)", compiled=True),
    Published("llama3_8b_h100_128gpu_compiled", ("--config", "llama_8b.toml", "--training.local_batch_size", "2",
              *_SEL_OP), 128, "h100_500w", 6514, None, False,
              f"{PERF} (2025, Table 3: 128 H100 Grand Teton, FSDP + torch.compile)", compiled=True),
    Published("llama3_8b_h100_fsdp_tp_compiled", ("--config", "llama_8b.toml", "--training.local_batch_size", "12",
              "--parallelism.data_parallel_shard_degree", "8", "--parallelism.tensor_parallel_degree", "8",
              *_SEL_OP), 64, "h100_500w", 4378, None, False,
              f"{ASYNC_TP} (June 2025, 64 H100 Grand Teton, FSDP 8 x TP 8, torch.compile, vanilla TP, bf16)",
              compiled=True),
    Published("llama3_70b_h100_fsdp_tp_compiled", ("--config", "llama_70b.toml", "--training.local_batch_size", "16",
              "--parallelism.pipeline_parallel_degree", "1", "--parallelism.data_parallel_shard_degree", "32",
              "--activation_checkpoint.mode", "full"), 256, "h100_500w", 597.3, None, False,
              f"{ASYNC_TP} (June 2025, 256 H100 Grand Teton, FSDP 32 x TP 8, torch.compile, vanilla TP, bf16)",
              compiled=True),
]


@functools.lru_cache(maxsize=None)
def _traced(argv: tuple[str, ...], ngpu: int) -> dict:
    cfg, _ = config_load.load(list(argv))
    return dry_run(cfg, ngpu)


def predict(run: Published) -> dict:
    """The dry run's report of `run` on its GPU. One eager trace times a step both eager and
    compiled, so a run and its compiled twin share it."""
    result = _traced(run.argv, run.ngpu)
    return report({**result, "config": {**result["config"], "compile": run.compiled}}, hardware.get_gpu(run.gpu))


def main(argv: list[str]) -> None:
    runs = [r for r in RUNS if not argv or r.name in argv]
    print("| run | GPUs | fitted | published tokens/s/GPU (MFU %) | predicted (MFU %) | error |")
    print("|---|---|---|---|---|---|")
    for run in runs:
        pred = predict(run)["predicted"]
        tps, mfu = pred["tokens_per_sec_per_gpu"], pred["mfu_pct"]
        published = f"{run.tokens_per_sec_per_gpu:,.0f}" + (f" ({run.mfu_pct})" if run.mfu_pct else "")
        print(f"| {run.name} | {run.ngpu} {run.gpu} | {'yes' if run.fitted else 'held out'} | {published} | "
              f"{tps:,.0f} ({mfu:.1f}) | {100 * (tps / run.tokens_per_sec_per_gpu - 1):+.1f}% |", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
