"""A warm-up's phases in the dry run and the planner (training.batch_warmup, seq_warmup).

The memory a run needs is its largest phase's: the last, at the full batch and sequence (a
warm-up's micro-batch holds as many tokens or fewer, its attention over shorter sequences; more
micro-batches add no peak). The report's memory is that step's, as without a warm-up. Each
earlier phase's step is another shape, traced as a job of its own (its rows per micro-batch, its
sequence length, its micro-batches), for its step time.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from titanlite.config.job import JobConfig
from titanlite.data.schedule import Phase
from titanlite.preflight import Plan


def phase_job(cfg: JobConfig, phase: Phase, dp: int) -> JobConfig:
    """The job that runs `phase`'s step at every step: its micro-batch shape and count."""
    t = dataclasses.replace(cfg.training, seq_len=phase.seq_len, local_batch_size=phase.rows,
                            global_batch_size=phase.rows * dp * phase.micro_batches, batch_warmup=[], seq_warmup=[])
    return dataclasses.replace(cfg, training=t)


def phase_times(cfg: JobConfig, plan: Plan, world_size: int, trace: Callable[[JobConfig, int], dict]) -> list[dict]:
    """Each warm-up phase's steps, shape, predicted step time and peak (none without a warm-up);
    `plan`: the job's; `trace(job, world_size)`: the dry run's report of a job (titanlite.dryrun.run)."""
    out = []
    for phase in plan.schedule.phases[:-1] if plan.schedule.warms_up else ():
        rep = trace(phase_job(cfg, phase, plan.dims.dp), world_size)
        out.append({"steps": [phase.first_step, phase.last_step], "describe": phase.describe(),
                    "step_s": rep["predicted"]["step_s"],
                    "peak_gib": max(r["memory_gib"]["peak"] for r in rep["roles"])})
    return out
