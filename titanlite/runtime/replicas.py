"""Replica groups through torchft (fault_tolerance.enable): the groups are the data-parallel
replicate dimension, each its own torchrun job, joined per step by torchft's Manager.

Each step (`begin`) asks the lighthouse for a quorum: the groups alive now. A group that is behind
(restarted, or new) heals first: it receives model, optimizer, schedule, step, data cursor and the
fault guard's counts from a live peer (`heal_state` / `load_heal_state`, through torchft's HTTP
checkpoint transport, each rank from the same rank of the peer, so FSDP shards match). The step's global batch is then split over the
groups of the quorum by their rank in it (`batches`), the target-token count and the gradients
are summed over the quorum (`count`, `sync`), and the optimizer steps only if every group of the
quorum still agrees (`should_commit`); otherwise the step is retried on the same batch. The loss
is a sum over target tokens divided by the global count, so a step trained by any quorum has the
gradient of one trained by all groups: no sample is lost or repeated.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.utils.data import default_collate

from titanlite.config.job import FaultTolerance
from titanlite.errors import ConfigError, RunError

Batch = dict[str, torch.Tensor]
PRIME = 2**31 - 1  # the parameter fingerprint's modulus
FINGERPRINT_BYTES = 1 << 24  # bytes fingerprinted at once: its int64 temporaries stay at a few hundred MiB
BUCKET = 1 << 26  # elements per cross-group all-reduce: bounds the flat copy a sum needs


def _local(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds (its shard of a DTensor); writes to it write to `t`."""
    return t.to_local() if isinstance(t, DTensor) else t


def check_split(f: FaultTolerance, schedule: Any, dp: int) -> None:
    """Every quorum from min_replica_size to group_size groups splits each step's rows (`schedule`:
    titanlite.data.schedule.DataSchedule, a warm-up's phases too) into whole micro-batches of the
    same count on each rank (FSDP runs one collective per micro-batch)."""
    for q in range(f.min_replica_size, f.group_size + 1):
        for p in schedule.phases:
            if p.samples * p.pieces % (q * dp * p.rows) == 0:
                continue
            if p is schedule.phases[-1]:
                raise ConfigError(f"training.global_batch_size {p.samples} does not split over a quorum of {q} "
                                  f"replica groups x {dp} data-parallel ranks x local_batch_size {p.rows}; make "
                                  f"it a multiple of each (or raise fault_tolerance.min_replica_size)")
            raise ConfigError(f"training.batch_warmup: steps {p.first_step}-{p.last_step} read {p.samples * p.pieces} "
                              f"rows, which do not split over a quorum of {q} replica groups x {dp} data-parallel "
                              f"ranks x {p.rows} rows per micro-batch; start the warm-up at a multiple of each (or "
                              "raise fault_tolerance.min_replica_size)")


def _buckets(tensors: list[torch.Tensor], limit: int) -> Iterator[list[torch.Tensor]]:
    """`tensors` in order, in runs of at most `limit` elements (a larger tensor alone)."""
    bucket, size = [], 0
    for t in tensors:
        if bucket and size + t.numel() > limit:
            yield bucket
            bucket, size = [], 0
        bucket.append(t)
        size += t.numel()
    if bucket:
        yield bucket


class Replicas:
    """This rank's view of the replica groups; every rank of a group makes the same calls.
    `optimizers`: titanlite.optim.Optimizers (runtime sits beside optim, not above it);
    `loader`: the training StatefulDataLoader (its data set and skipped ranges)."""

    def __init__(self, f: FaultTolerance, parts: list[nn.Module], optimizers: Any, loader: Any,
                 global_batch_size: int, local_batch_size: int, dp: int, device: torch.device,
                 start_step: int, extra: dict[str, Any] | None = None, init_timeout_s: float = 300) -> None:
        """`extra`: more state a healing group takes from its peer ({name: a state_dict()/
        load_state_dict() object}: the fault guard's counts); `init_timeout_s`: how long the
        attempt's first quorum waits for the other groups to start (comm.init_timeout_s)."""
        # torchft's Rust side logs about 8 INFO lines a step to the terminal; RUST_LOG=info brings them back
        os.environ.setdefault("RUST_LOG", "warn")
        from torchft import Manager
        from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL

        check_split(f, loader.batch_sampler.schedule, dp)
        self.parts, self.optimizers, self.loader, self.extra = parts, optimizers, loader, extra or {}
        self.global_batch_size, self.local_batch_size, self.dp = global_batch_size, local_batch_size, dp
        self.device, self.replica_id, self.group_size = device, f.replica_id, f.group_size
        self.step, self.first_timeout = start_step, timedelta(seconds=init_timeout_s)
        self.healed_to: int | None = None
        self.rank, self.size = 0, 0  # this group's rank in the step's quorum, and the quorum's size
        timeout = timedelta(seconds=f.timeout_s)
        pg = ProcessGroupNCCL(timeout=timeout) if device.type == "cuda" else ProcessGroupGloo(timeout=timeout)

        def make() -> Any:
            # synchronous quorum: a healing group loads its peer's state before the step's forward,
            # and takes part in that very step
            return Manager(pg=pg, load_state_dict=self._load, state_dict=self._state,
                           min_replica_size=f.min_replica_size, use_async_quorum=False, init_sync=False,
                           timeout=timeout, quorum_timeout=timeout, connect_timeout=timeout,
                           rank=dist.get_rank(), world_size=dist.get_world_size(),
                           lighthouse_addr=f.lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE"),
                           replica_id=f"titanlite_{f.replica_id}")

        # rank 0 publishes its manager's address in torchrun's store, which outlives a restarted
        # attempt: the others read it only once this attempt's is there
        self.manager = make() if dist.get_rank() == 0 else None
        dist.barrier()
        self.manager = self.manager or make()
        self.manager.load_state_dict({"step": start_step, "batches_committed": 0})

    # -- one step --

    def begin(self, step: int, throughput: Any) -> int:
        """The quorum for the step after `step`; returns the step to continue from (a peer's, if
        this group healed). `throughput` (titanlite.metrics.Throughput) counts the devices of
        the quorum, which share the global batch, and restarts its clock at a heal."""
        self.step, self.healed_to = step, None
        # the first quorum waits for groups still starting (a scheduler starts them one by one)
        self.manager.start_quorum(timeout=None if self.size else self.first_timeout)
        rank, before = self.manager.participating_rank(), self.size
        self.rank, self.size = (0 if rank is None else rank), self.manager.num_participants()
        step = self.step if self.healed_to is None else self.healed_to
        if self.size > self.group_size:  # check_split vouched for quorums up to group_size only
            raise RunError(f"step {step + 1}: {self.size} replica groups joined the quorum, but "
                           f"fault_tolerance.group_size is {self.group_size}; give every group the same group_size "
                           f"and its own replica_id below it")
        if self.size > before:  # a group joined (or this one did): every group must hold the same model
            self._check_same(step)
        if self.size != before and before and dist.get_rank() == 0:
            print(f"titanlite: step {step + 1}: {self.size} replica group(s) in the quorum (was {before})", flush=True)
        throughput.world_size = dist.get_world_size() * self.size
        if self.healed_to is not None:
            throughput.start_step = throughput.last_step = step
            throughput.start = throughput.last = time.perf_counter()
        return step

    def batches(self, step: int) -> list[Batch]:
        """This rank's micro-batches of global batch `step`: its group's share by quorum rank, then
        its own share within the group."""
        data = self.loader.dataset
        return [default_collate([data[g] for g in rows])
                for rows in self.loader.batch_sampler.micro_batches(self.loader.batch_sampler.offset + step - 1, self.rank, self.size)]

    def count(self, n_targets: torch.Tensor) -> None:
        """The target-token count summed over the quorum, in place (the group's is summed already)."""
        self._sum([n_targets])

    def sync(self, params: list[torch.Tensor], sums: list[torch.Tensor]) -> bool:
        """Sum the gradients and `sums` (loss sums, for logging) over the quorum; True if the step
        may be applied, False if it must be retried on the same batch (a group left or failed)."""
        for p in params:
            if p.grad is None:  # unused by this group's rows: every group must send the same tensors
                p.grad = torch.zeros_like(p)
        self._sum([p.grad for p in params] + sums)
        return self.manager.should_commit()

    def _sum(self, tensors: list[torch.Tensor]) -> None:
        from torch.distributed import ReduceOp

        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for t in tensors:
            by_dtype.setdefault(t.dtype, []).append(_local(t))
        for group in by_dtype.values():  # one collective per dtype and bucket (the same on every group)
            for bucket in _buckets(group, BUCKET):
                flat = torch.cat([t.reshape(-1) for t in bucket])
                self.manager.allreduce(flat, reduce_op=ReduceOp.SUM).wait()
                offset = 0
                for t in bucket:
                    t.copy_(flat[offset:offset + t.numel()].view_as(t))
                    offset += t.numel()

    def _check_same(self, step: int) -> None:
        """Refuse to train on if the groups of the quorum hold different parameters (a heal that
        went wrong would silently average two models): a position-weighted sum of every local
        parameter's bytes, exact in integers, compared over the quorum through MAX of h and -h."""
        from torch.distributed import ReduceOp

        h = torch.zeros((), dtype=torch.int64, device=self.device)
        for part in self.parts:
            for _, p in sorted(part.named_parameters()):
                b = _local(p).detach().contiguous().reshape(-1).view(torch.uint8)
                term = torch.zeros((), dtype=torch.int64, device=self.device)
                for start in range(0, b.numel(), FINGERPRINT_BYTES):
                    chunk = b[start:start + FINGERPRINT_BYTES].long()
                    weight = torch.arange(start, start + chunk.numel(), device=b.device) % 65_521 + 1
                    term += (chunk * weight).sum()
                # every term stays below 2**63: h < 2**31, a byte times a weight < 2**24 each
                h = (h * 1_000_003 + term) % PRIME
        both = torch.stack([h, -h])
        self.manager.allreduce(both, reduce_op=ReduceOp.MAX).wait()
        if self.manager.errored() is None and int(both[0]) != -int(both[1]):
            raise RunError(f"step {step}: the replica groups' parameters differ after {self.size} groups formed a "
                           f"quorum (fault_tolerance); a heal or a start from different weights: restart every group "
                           f"from one checkpoint")
        if self.healed_to is not None and dist.get_rank() == 0:
            print(f"titanlite: replica group {self.replica_id} healed from a live peer at step {step} (model, "
                  f"optimizer, schedule, data cursor); its parameters equal the quorum's", flush=True)

    def writes_checkpoints(self) -> bool:
        """One group saves: the first of the quorum."""
        return self.rank == 0

    def close(self) -> None:
        self.manager.shutdown(wait=False)

    # -- healing --

    def _state(self) -> dict[str, Any]:
        return heal_state(self.parts, self.optimizers, self.loader, self.step, self.extra)

    def _load(self, sd: dict[str, Any]) -> None:
        self.healed_to = load_heal_state(sd, self.parts, self.optimizers, self.loader, self.extra)


def _named(optimizers: Any) -> list[tuple[int, tuple[nn.Module, torch.optim.Optimizer]]]:
    return list(enumerate(zip(optimizers.parts, optimizers.optimizers)))


def heal_state(parts: list[nn.Module], optimizers: Any, loader: Any, step: int,
               extra: dict[str, Any]) -> dict[str, Any]:
    """What a healing peer's same rank needs, as plain local tensors (its shards match ours):
    parameters, optimizer state (AdamW's moments, Muon's momentum) and param groups, schedules,
    step, skipped sample ranges, RNG, and each `extra` object's state_dict()."""
    model = {n: _local(p).detach() for part in parts for n, p in part.named_parameters()}
    optim, groups = {}, []
    for i, (part, opt) in _named(optimizers):
        names = {p: n for n, p in part.named_parameters()}
        for p, st in opt.state.items():
            optim[f"{i}/{names[p]}"] = {k: (_local(v).detach(), isinstance(v, DTensor), str(v.device))
                                        if isinstance(v, torch.Tensor) else v for k, v in st.items()}
        groups.append([{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups])
    sched = [s.state_dict() for s in optimizers.schedulers]
    for s in sched:
        s.pop("lr_lambdas", None)  # rebuilt from the config
    return {"model": model, "optim": optim, "param_groups": groups, "schedulers": sched, "step": step,
            "skip": loader.batch_sampler.skip, "rng": torch.get_rng_state(),
            "extra": {k: v.state_dict() for k, v in extra.items()}}


def load_heal_state(sd: dict[str, Any], parts: list[nn.Module], optimizers: Any, loader: Any,
                    extra: dict[str, Any]) -> int:
    """heal_state's dict into this rank's objects; returns the peer's step."""
    with torch.no_grad():
        for part in parts:
            for n, p in part.named_parameters():
                _local(p).copy_(sd["model"][n])
        for i, (part, opt) in _named(optimizers):
            for n, p in part.named_parameters():
                if (st := sd["optim"].get(f"{i}/{n}")) is not None:
                    opt.state[p] = {k: _restored(p, v) if isinstance(v, tuple) else v for k, v in st.items()}
            for g, saved in zip(opt.param_groups, sd["param_groups"][i]):
                g.update(saved)
    for s, saved in zip(optimizers.schedulers, sd["schedulers"]):
        s.load_state_dict({**s.state_dict(), **saved})
    loader.batch_sampler.set_skip(sd["skip"])
    torch.set_rng_state(sd["rng"])
    for k, v in extra.items():
        v.load_state_dict(sd["extra"][k])
    return sd["step"]


def _restored(p: torch.Tensor, saved: tuple[torch.Tensor, bool, str]) -> torch.Tensor:
    """An optimizer state tensor as heal_state sent it, back on its device (and mesh, if sharded)."""
    local, sharded, device = saved
    local = local.to(device)
    if not sharded:
        return local
    return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())
