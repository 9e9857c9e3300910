"""Several GRPO runs of the real trainer in one gloo launch, one layout after another.

    python -m torch.distributed.run --nproc_per_node N tests/rl_layouts.py ARGS [+ ARGS ...]

Each ARGS is a `python -m titanlite.train` command line (its own job.dump_folder), run by
titanlite.train.train in this one process group; the test reads each run's metrics.jsonl and
rollouts.jsonl. `varied` is the runs' reward (rl.reward = "__main__:varied"): a random model
rarely earns a task's reward, and equal rewards give no gradient to compare. A run that fails with
a ConfigError prints its line as titanlite.train does and the launch goes on.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

import titanlite.train as trainer
from titanlite import rl
from titanlite.config import load as config_load
from titanlite.errors import ConfigError
from titanlite.parallel.mesh import init_process_group
from titanlite.preflight import preflight


def varied(prompt: str, completion: str, row: dict) -> float:
    """A reward that differs between completions: their bytes' sum modulo 5."""
    return float(sum(completion.encode()) % 5)


def not_a_number(prompt: str, completion: str, row: dict) -> str:
    return "1"


def main(argv: list[str]) -> None:
    init_process_group(torch.device("cpu"), 120)
    trainer.init_process_group = lambda *args: None  # one process group for every run
    for i, args in enumerate(" ".join(argv).split(" + ")):
        cfg, _ = config_load.load(args.split())
        try:
            trainer.train(cfg, rl.checked(cfg, preflight(cfg, dist.get_world_size())))
        except ConfigError as e:  # what titanlite.train.main prints
            print(f"titanlite: error: {e}", flush=True)
        print(f"rank {dist.get_rank()} run {i}: done", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
