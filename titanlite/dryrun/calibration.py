"""Measured training runs the step-time model is held against, its fit, and each run's
leave-one-out error:

    python -m titanlite.dryrun.calibration [--fit] [NAME ...]

Each run (TorchTitan's published ones, titanlite's own on a lent GPU) is dry-run with titanlite's
own step at the run's layout. `fit` chooses titanlite.dryrun.timing's five factors by least
squares on the log of predicted over measured tokens/s of every run marked `fit`; a run's
leave-one-out error is its error when the factors are fitted without it. The float8 runs are
fitted on by none: they are predictions of the bf16 fit. This is the only code that reads a
measured figure; the dry run itself reads timing.FITTED alone. docs/scaling.md has the table.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import sys
from dataclasses import dataclass

from titanlite.config import load as config_load
from titanlite.dryrun import hardware, timing
from titanlite.dryrun.report import report, step_seconds
from titanlite.dryrun.run import dry_run

PERF = "TorchTitan docs/performance.md"
ASYNC_TP = "TorchTitan benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md"
TORCHAO = "torchao torchao/float8/README.md, Training benchmarks (NVIDIA H100)"
SESSION = "titanlite tools/gpu_session.sh, 2026-11-27, one H100 80GB HBM3, torch 2.11.0+cu130 (docs/benchmarks.md)"
# TorchTitan's per-op AC keeps every second matmul's output in a block and recomputes the others
_SEL_OP = ("--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_type", "op",
           "--activation_checkpoint.selective_op_matmuls", "alternate")
_FSDP_ONLY = ("--parallelism.pipeline_parallel_degree", "1", "--parallelism.tensor_parallel_degree", "1",
              "--training.local_batch_size", "1")
_8B = ("--config", "llama_8b.toml", "--training.local_batch_size", "2", *_SEL_OP)
_1B = ("--config", "llama_1b.toml", "--activation_checkpoint.mode", "selective")
_3B = ("--config", "llama_3b.toml", "--activation_checkpoint.mode", "selective", "--training.local_batch_size", "1")
_F8 = ("--float8.enable", "true")
_F8_ROWWISE = ("--float8.enable", "true", "--float8.recipe", "rowwise")


@dataclass(frozen=True)
class Run:
    name: str
    argv: tuple[str, ...]
    """The config and overrides that give the run's layout, batch and AC."""
    ngpu: int
    gpu: str
    tokens_per_sec_per_gpu: float
    mfu_pct: float | None
    fit: bool
    """Whether the factors are fitted on it (the float8 runs are predictions of the bf16 fit)."""
    source: str
    compiled: bool = False
    """Whether the run compiled its blocks (the dry run traces eager and times both)."""
    own: bool = False
    """titanlite's own run on a lent GPU (held to 10% in tokens/s and peak memory), else published (15%)."""
    peak_gib: float | None = None
    """The measured peak (torch.cuda.max_memory_allocated), own runs."""

    @property
    def bound(self) -> float:
        return 0.10 if self.own else 0.15


RUNS = [
    Run("llama3_8b_a100_sel_op", ("--config", "llama_8b.toml", *_FSDP_ONLY, *_SEL_OP), 64, "a100", 2973, 58.2, True,
        f"{PERF} (2024, 64 A100 80GB, FSDP, batch 1 x 8192)"),
    Run("llama3_8b_a100_sel_layer", ("--config", "llama_8b.toml", *_FSDP_ONLY, "--activation_checkpoint.mode",
        "selective", "--activation_checkpoint.selective_type", "layer"), 64, "a100", 2876, 56.3, True,
        f"{PERF} (2024, 64 A100 80GB, FSDP, batch 1 x 8192)"),
    Run("llama3_70b_a100_full", ("--config", "llama_70b.toml", *_FSDP_ONLY), 64, "a100", 323, 50.5, True,
        f"{PERF} (2024, 64 A100 80GB, FSDP, batch 1 x 8192)"),
    Run("llama3_405b_h100_fsdp_tp", ("--config", "llama_405b.toml", "--parallelism.pipeline_parallel_degree", "1",
        "--training.local_batch_size", "2", "--activation_checkpoint.mode", "full"), 128, "h100_500w", 109, 29.0,
        True, f"{PERF} (2024, 128 H100 Grand Teton, FSDP 16 x TP 8, batch 2 x 8192)"),
    Run("llama3_8b_h100_8gpu", _8B, 8, "h100_500w", 5762, None, True,
        f"{PERF} (2025, Table 1: 8 H100 Grand Teton, FSDP, eager)"),
    Run("llama3_8b_h100_128gpu", _8B, 128, "h100_500w", 5605, None, True,
        f"{PERF} (2025, Table 3: 128 H100 Grand Teton, FSDP, eager)"),
    Run("llama3_8b_h100_8gpu_compiled", _8B, 8, "h100_500w", 6667, None, True,
        f"{PERF} (2025, Table 1: 8 H100 Grand Teton, FSDP + torch.compile)", compiled=True),
    Run("llama3_8b_h100_128gpu_compiled", _8B, 128, "h100_500w", 6514, None, True,
        f"{PERF} (2025, Table 3: 128 H100 Grand Teton, FSDP + torch.compile)", compiled=True),
    Run("llama3_8b_h100_fsdp_tp_compiled", ("--config", "llama_8b.toml", "--training.local_batch_size", "12",
        "--parallelism.data_parallel_shard_degree", "8", "--parallelism.tensor_parallel_degree", "8", *_SEL_OP), 64,
        "h100_500w", 4378, None, True,
        f"{ASYNC_TP} (June 2025, 64 H100 Grand Teton, FSDP 8 x TP 8, torch.compile, vanilla TP, bf16)", compiled=True),
    Run("llama3_70b_h100_fsdp_tp_compiled", ("--config", "llama_70b.toml", "--training.local_batch_size", "16",
        "--parallelism.pipeline_parallel_degree", "1", "--parallelism.data_parallel_shard_degree", "32",
        "--activation_checkpoint.mode", "full"), 256, "h100_500w", 597.3, None, True,
        f"{ASYNC_TP} (June 2025, 256 H100 Grand Teton, FSDP 32 x TP 8, torch.compile, vanilla TP, bf16)",
        compiled=True),
    Run("llama3_8b_h100_bs1_compiled", ("--config", "llama_8b.toml", "--training.local_batch_size", "1", *_SEL_OP), 8,
        "h100_500w", 6150, None, True, f"{TORCHAO} (8 H100, FSDP, batch 1 x 8192, per-op SAC, torch.compile, bf16)",
        compiled=True),
    # titanlite's own, on the GPUs the device tool lent (one GPU each: no FSDP, autocast bf16)
    Run("own_llama3_1b_h100", _1B, 1, "h100", 35032, 37.7, True, f"{SESSION}: 1b_eager, batch 2 x 8192", own=True,
        peak_gib=38.68),
    Run("own_llama3_1b_h100_compiled", _1B, 1, "h100", 42586, 45.8, True, f"{SESSION}: 1b_compiled", compiled=True,
        own=True, peak_gib=34.68),
    Run("own_llama3_3b_h100", _3B, 1, "h100", 14255, 40.0, True, f"{SESSION}: 3b_eager, batch 1 x 8192", own=True,
        peak_gib=60.13),
    Run("own_llama3_3b_h100_compiled", _3B, 1, "h100", 17432, 48.9, True, f"{SESSION}: 3b_compiled", compiled=True,
        own=True, peak_gib=55.62),
    Run("own_llama3_1b_h200", ("--config", "llama_1b.toml", "--training.local_batch_size", "1"), 1, "h200", 39113, 42.1,
        True, "titanlite tools/bench.py, 2026-11-26, one H200, torch 2.11.0+cu130: batch 1 x 8192, no AC, eager",
        own=True, peak_gib=34.6),
    # float8: predicted by the bf16 fit, fitted on by none
    Run("llama3_8b_h100_8gpu_float8", (*_8B, *_F8), 8, "h100_500w", 8532, None, False,
        f"{PERF} (2025, Table 1: 8 H100 Grand Teton, FSDP + torch.compile + Float8 tensorwise)", compiled=True),
    Run("llama3_8b_h100_128gpu_float8", (*_8B, *_F8), 128, "h100_500w", 8380, None, False,
        f"{PERF} (2025, Table 3: 128 H100 Grand Teton, FSDP + torch.compile + Float8 tensorwise)", compiled=True),
    Run("llama3_8b_h100_bs1_float8", ("--config", "llama_8b.toml", "--training.local_batch_size", "1", *_SEL_OP,
        *_F8), 8, "h100_500w", 7689.5, None, False, f"{TORCHAO} (tensorwise with float8 all-gather)",
        compiled=True),
    Run("llama3_8b_h100_bs1_float8_rowwise", ("--config", "llama_8b.toml", "--training.local_batch_size", "1",
        *_SEL_OP, *_F8_ROWWISE), 8, "h100_500w", 6768, None, False, f"{TORCHAO} (rowwise with bf16 all-gather)",
        compiled=True),
    Run("own_llama3_1b_h100_float8", (*_1B, *_F8), 1, "h100", 46753, 50.3, False,
        f"{SESSION}: 1b_float8 (torchao tensorwise), compiled", compiled=True, own=True, peak_gib=30.78),
]


@functools.lru_cache(maxsize=None)
def traced(argv: tuple[str, ...], ngpu: int) -> dict:
    """The dry run's trace of a run's step (a run and its compiled twin share it)."""
    cfg, _ = config_load.load(list(argv))
    return dry_run(cfg, ngpu)


def predict(run: Run, k: timing.Factors = timing.FITTED) -> float:
    """The run's predicted tokens/s per GPU with factors `k`."""
    result = traced(run.argv, run.ngpu)
    tokens = result["config"]["global_batch_size"] * result["config"]["seq_len"]
    return tokens / step_seconds(result, hardware.get_gpu(run.gpu), run.compiled, k) / run.ngpu


def predicted_peak_gib(run: Run) -> float:
    """The largest role's predicted tensor peak (eager or compiled, as the run): no factor is fitted."""
    result = traced(run.argv, run.ngpu)
    rep = report({**result, "config": {**result["config"], "compile": run.compiled}}, hardware.get_gpu(run.gpu))
    return max(r["memory_gib"]["peak"] for r in rep["roles"])


def _loss(runs: list[Run], k: timing.Factors) -> float:
    return sum(math.log(predict(r, k) / r.tokens_per_sec_per_gpu) ** 2 for r in runs)


# Each factor's range. Two are physical caps: GEMMs cannot beat the best measured matmul rate
# (matmul 1), and eager kernels not a large device copy, which reached 86-87% of the H100's
# datasheet bandwidth (hbm 0.87: the health check on the lent H100, docs/benchmarks.md).
BOUNDS = {"matmul": (0.5, 1.0), "hbm": (0.2, 0.87), "contention": (0.0, 1.0), "fixed_power": (0.0, 0.9),
          "kernel_gap_us": (1.0, 20.0)}


def fit(runs: list[Run], start: timing.Factors = timing.FITTED, step: float = 0.08) -> timing.Factors:
    """Least squares on log(predicted / measured) tokens/s over `runs`, each factor within its
    BOUNDS: a pattern search from `start`, its steps (`step` of each factor's range) halved down
    to 1/400 of it, the result rounded to 0.01."""
    k, best = start, _loss(runs, start)
    while step >= 0.0025:
        moved = False
        for name, (lo, hi) in BOUNDS.items():
            for sign in (1, -1):
                value = min(hi, max(lo, getattr(k, name) + sign * step * (hi - lo)))
                trial = dataclasses.replace(k, **{name: value})
                loss = _loss(runs, trial)
                if loss < best - 1e-12:
                    k, best, moved = trial, loss, True
        if not moved:
            step /= 2
    return timing.Factors(**{n: round(getattr(k, n), 2) for n in BOUNDS})


@dataclass(frozen=True)
class Row:
    run: Run
    fitted: float
    """Predicted tokens/s per GPU with every fitted run in the fit."""
    held_out: float
    """The same with this run left out of the fit (its leave-one-out prediction)."""
    factors: timing.Factors
    """The factors of that leave-one-out fit."""
    peak_gib: float

    @property
    def error(self) -> float:
        return self.held_out / self.run.tokens_per_sec_per_gpu - 1

    @property
    def peak_error(self) -> float | None:
        return None if self.run.peak_gib is None else self.peak_gib / self.run.peak_gib - 1


def leave_one_out(runs: list[Run] = RUNS, k: timing.Factors = timing.FITTED) -> list[Row]:
    """Each run's prediction by `k` (the factors of the whole fit) and by the fit without it
    (started from `k`: one run moves the optimum a little)."""
    fitted = [r for r in runs if r.fit]
    rows = []
    for run in runs:
        alone = fit([r for r in fitted if r is not run], k, step=0.01) if run.fit else k
        rows.append(Row(run, predict(run, k), predict(run, alone), alone, predicted_peak_gib(run)))
    return rows


def main(argv: list[str]) -> None:
    refit = "--fit" in argv
    names = [a for a in argv if a != "--fit"]
    k = timing.FITTED
    if refit:
        k = fit([r for r in RUNS if r.fit])
        print(f"fit over {sum(r.fit for r in RUNS)} runs, {len(BOUNDS)} factors: {k}")
    rows = leave_one_out([r for r in RUNS if not names or r.name in names], k)
    print("| run | GPUs | in the fit | measured tokens/s/GPU | predicted, fitted | leave-one-out | error | "
          "peak GiB measured / predicted |")
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        r = row.run
        peak = "" if r.peak_gib is None else f"{r.peak_gib:.2f} / {row.peak_gib:.2f} ({row.peak_error:+.1%})"
        print(f"| {r.name} | {r.ngpu} {r.gpu} | {'yes' if r.fit else 'no (float8)'} | {r.tokens_per_sec_per_gpu:,.0f} | "
              f"{row.fitted:,.0f} | {row.held_out:,.0f} | {row.error:+.1%} | {peak} |", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
