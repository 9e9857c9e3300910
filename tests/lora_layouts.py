"""Several LoRA runs of the real trainer in one gloo launch, one layout after another.

    python -m torch.distributed.run --nproc_per_node N tests/lora_layouts.py ARGS [+ ARGS ...]

Each ARGS is a `python -m titanlite.train` command line (its own job.dump_folder), run by
titanlite.train.train in this one process group. After each run every rank checks, and prints
on one line, that the optimizers held exactly the parameters that train (each adapter of the
layers this rank's parts hold, and the modules trained whole) and that every frozen weight is
bitwise what the initial load left (the local shards of this rank); the test reads each run's
metrics.jsonl and those lines.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import titanlite.train as trainer
from titanlite.checkpoint.dcp import CheckpointManager
from titanlite.config import load as config_load
from titanlite.parallel.mesh import init_process_group
from titanlite.preflight import preflight

seen: dict[str, object] = {}


def _local(p: torch.Tensor) -> torch.Tensor:
    return (p.to_local() if isinstance(p, DTensor) else p).detach()


def _after_initial_load(load):
    def maybe_load(self: CheckpointManager, *args, **kwargs) -> int:
        step = load(self, *args, **kwargs)
        seen["parts"], seen["optimizers"] = self.parts, self.states["optimizer"].optimizers
        seen["frozen"] = {n: _local(p).clone() for part in self.parts for n, p in part.named_parameters()
                          if not p.requires_grad}
        return step
    return maybe_load


def check(plan) -> str:
    if plan.lora is None:  # a full fine-tuning run among them: every weight trains
        return "full fine-tuning"
    parts, optimizers, frozen = seen["parts"], seen["optimizers"], seen["frozen"]
    trains = {n: p for part in parts for n, p in part.named_parameters() if p.requires_grad}
    held = {id(p) for opt in optimizers.optimizers for g in opt.param_groups for p in g["params"]}
    lora = plan.lora
    expected = {n for n in trains if n.removesuffix(".lora_A.weight").removesuffix(".lora_B.weight") in lora.targets
                or any(n.startswith(f + ".") for f in lora.full)}
    exact = held == {id(p) for p in trains.values()} and set(trains) == expected and len(expected) > 0
    now = {n: _local(p) for part in parts for n, p in part.named_parameters() if not p.requires_grad}
    unchanged = now.keys() == frozen.keys() and all(torch.equal(now[n], frozen[n]) for n in now)
    return (f"optimizer exact: {exact} ({len(held)} tensors); frozen unchanged: {unchanged} ({len(now)} tensors, "
            f"{sum(t.numel() for t in now.values())} values)")


def main(argv: list[str]) -> None:
    init_process_group(torch.device("cpu"), 120)
    trainer.init_process_group = lambda *args: None  # one process group for every run
    CheckpointManager.maybe_load = _after_initial_load(CheckpointManager.maybe_load)
    for i, args in enumerate(" ".join(argv).split(" + ")):
        cfg, _ = config_load.load(args.split())
        plan = preflight(cfg, dist.get_world_size())
        trainer.train(cfg, plan)
        print(f"rank {dist.get_rank()} run {i}: {check(plan)}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
