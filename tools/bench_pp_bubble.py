"""Measure the pipeline bubble on CPU: GPipe and 1F1B at pp 2 with m micro-batches, against the
same work on one process, next to the textbook bubble fraction (p-1)/(m+p-1).

    OMP_NUM_THREADS=1 python -m titanlite.tools.bench_pp_bubble

Each pp 2 rank does half the blocks; if the stages never waited, a step would take T1/p (T1: the
same micro-batches through the whole model on one process). The measured bubble is
1 - T1 / (p x Tp). The embedding and the output layer sit on the first and last stage, so the
two stages are balanced by giving each one block-equivalent less (the default). Prints a
markdown table (docs/benchmarks.md).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from titanlite.layers import init
from titanlite.config.job import ActivationCheckpoint, Compile, Parallelism
from titanlite.loss import cross_entropy_sum
from titanlite.model_spec import get_model_spec, model_args
from titanlite.layers.attention import AttnSetup
from titanlite.parallel import pipeline
from titanlite.parallel.apply import ParallelizeOptions
from titanlite.parallel.mesh import ParallelDims, init_process_group

SEQ, MICRO, STEPS = 128, 1, 6
OPTS = ParallelizeOptions(torch.float32, torch.float32, "default", ActivationCheckpoint(), Compile())


def batch(args, rows: int) -> dict[str, torch.Tensor]:
    tokens = torch.randint(0, args.vocab_size, (rows, SEQ + 1), generator=torch.Generator().manual_seed(0))
    return {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:]}


def model_args_for_bench():
    spec = get_model_spec("llama3")
    # the 100M flavor's width, 6 blocks, small vocab: matmul-bound, so stages balance by block count
    return spec, dataclasses.replace(model_args(spec, "100M", 2048, SEQ), n_layers=6)


def fastest_step(fn) -> float:
    """The fastest of STEPS steps after one warm-up: on a shared machine the slower ones are
    the slices where other processes took the cores."""
    times = []
    for _ in range(STEPS + 1):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times[1:])


def run_pipeline(schedule: str, m: int) -> None:
    """One torchrun rank of a pp run; rank 0 prints the fastest step time as JSON."""
    init_process_group(torch.device("cpu"), 300)
    pp = dist.get_world_size()
    dims = ParallelDims(1, 1, 1, 1, pp)
    meshes = dims.build_meshes("cpu")
    spec, args = model_args_for_bench()
    cfg = Parallelism(pipeline_parallel_degree=pp, pipeline_parallel_schedule=schedule,
                      pipeline_parallel_microbatch_size=MICRO)
    plan = pipeline.plan_stages(cfg, args.n_layers, m * MICRO)
    with torch.device("meta"):
        parts = pipeline.stage_modules(spec, args, plan, meshes)
    for part in parts:
        init.materialize(part, torch.device("cpu"), 0)
    step = pipeline.PipelineStep(parts, plan, schedule, meshes, cross_entropy_sum, OPTS, AttnSetup(),
                                 contextlib.nullcontext(), torch.device("cpu"),
                                 pipeline.stage_shapes(spec, args, MICRO, SEQ, dims, OPTS))
    b = batch(args, m * MICRO)

    def one() -> None:
        step([b])
        dist.barrier()
        for part in parts:
            part.zero_grad(set_to_none=True)

    t = fastest_step(one)
    if dist.get_rank() == 0:
        print(json.dumps({"t": t}), flush=True)
    dist.destroy_process_group()


def run_single(m: int) -> float:
    spec, args = model_args_for_bench()
    model = spec.build(args)
    model.init_weights(0)
    b = batch(args, MICRO)

    def one() -> None:
        for _ in range(m):
            cross_entropy_sum(model(b["input_ids"]), b["labels"]).div(m * MICRO * SEQ).backward()
        model.zero_grad(set_to_none=True)

    return fastest_step(one)


def main() -> None:
    rows = ["| schedule | p | m | T1 (s) | Tp (s) | measured bubble | (p-1)/(m+p-1) |",
            "|---|---|---|---|---|---|---|"]
    p = 2
    for m in (2, 4, 8):
        t1 = run_single(m)
        for schedule in ("GPipe", "1F1B"):
            out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                  f"--nproc_per_node={p}", "-m", __spec__.name, schedule, str(m)],
                                 capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
                                 cwd=Path(__file__).resolve().parent.parent, timeout=600)
            line = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
            if not line:
                raise SystemExit(out.stdout[-2000:] + out.stderr[-2000:])
            tp = json.loads(line[0])["t"]
            rows.append(f"| {schedule} | {p} | {m} | {t1:.3f} | {tp:.3f} | {1 - t1 / (p * tp):.2f} | "
                        f"{(p - 1) / (m + p - 1):.2f} |")
            print(rows[-1], flush=True)
    print("\n".join(rows))


if __name__ == "__main__":
    if "WORLD_SIZE" in os.environ:
        run_pipeline(sys.argv[1], int(sys.argv[2]))
    else:
        main()
