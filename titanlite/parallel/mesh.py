"""Process group, device and the one DeviceMesh over [pp, dp_replicate, dp_shard, cp, tp], with its named views.

The views name the same ranks many times over (dp_shard_cp, dp, dp_cp and efsdp are one set of
ranks when cp = tp = ep = 1; every size-1 dimension is the rank alone). `Groups` makes one
process group per distinct set of ranks, and each view is assembled from those groups with the
public `DeviceMesh.from_group`, so a rank holds a handful of groups rather than one per view
dimension (docs/benchmarks.md has the counts), and their timeouts can follow the step's phase.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from titanlite.config.job import Parallelism
from titanlite.errors import ConfigError

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


@dataclass(frozen=True)
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    pp: int = 1
    ep: int = 1
    """Expert parallel: experts split over ep ranks taken from dp_shard x cp x tp (whole tp groups:
    under tensor parallel each tp rank routes its own tokens, so experts are not split over tp)."""

    @staticmethod
    def from_config(cfg: Parallelism, world_size: int) -> "ParallelDims":
        p, r, s, c, t = (cfg.pipeline_parallel_degree, cfg.data_parallel_replicate_degree,
                         cfg.data_parallel_shard_degree, cfg.context_parallel_degree, cfg.tensor_parallel_degree)
        if p < 1:
            raise ConfigError(f"parallelism.pipeline_parallel_degree must be >= 1, got {p}")
        pp = f"pp {p} x " if p > 1 else ""
        if s == -1:
            if world_size % (p * r * c * t):
                raise ConfigError(f"world size {world_size} is not divisible by {pp}dp_replicate {r} x "
                                  f"cp {c} x tp {t} = {p * r * c * t}; change the parallelism degrees or NGPU")
            s = world_size // (p * r * c * t)
        if p * r * s * c * t != world_size:
            raise ConfigError(f"parallelism degrees {pp}dp_replicate {r} x dp_shard {s} x cp {c} x tp {t} = "
                              f"{p * r * s * c * t} differ from the world size {world_size}; "
                              "make their product equal the number of ranks")
        e = cfg.expert_parallel_degree
        if e < 1 or (s * c * t) % e or (e > 1 and e % t):
            raise ConfigError(f"parallelism.expert_parallel_degree {e} must divide data_parallel_shard_degree {s} "
                              f"x context_parallel_degree {c} x tensor_parallel_degree {t} = {s * c * t} and be "
                              f"a multiple of tensor_parallel_degree {t} (expert parallel takes its ranks from them)")
        return ParallelDims(r, s, c, t, pp=p, ep=e)

    @property
    def layout(self) -> str:
        """The degrees as a name (a checkpoint keys each rank's random generators by it)."""
        return f"pp{self.pp}_dpr{self.dp_replicate}_dps{self.dp_shard}_cp{self.cp}_tp{self.tp}_ep{self.ep}"

    @property
    def dp(self) -> int:
        """Data-parallel degree: how many different slices of each global batch exist."""
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp(self) -> bool:
        return self.dp_replicate * self.dp_shard * self.cp > 1

    def build_meshes(self, device_type: str, timeout_s: float | None = None) -> "Meshes":
        """The named views, from process groups made here (`timeout_s`: theirs at creation; None:
        torch's default for new groups)."""
        p = self.pp
        groups = Groups(None if timeout_s is None else datetime.timedelta(seconds=timeout_s))

        def view(shape: tuple[int, ...], names: tuple[str, ...]) -> DeviceMesh:
            return groups.mesh(device_type, shape, names)

        # Views of one world in row-major [pp, dp_replicate, dp_shard, cp, tp] order, so a rank
        # has the same coordinates in each and DTensors from any of them compose. Pipeline
        # stages are outermost: every other view is taken within this rank's stage.
        return Meshes(
            dims=self,
            dense=view((p, self.dp_replicate, self.dp_shard * self.cp, self.tp), ("pp", "dp_replicate", "dp_shard_cp", "tp")),
            batch=view((p, self.dp, self.cp, self.tp), ("pp", "dp", "cp", "tp")),
            loss=view((p * self.dp * self.cp, self.tp), ("pp_dp_cp", "tp")),
            tokens=view((p, self.dp * self.cp, self.tp), ("pp", "dp_cp", "tp")),
            routed=view((p, self.dp * self.cp * self.tp), ("pp", "dp_cp_tp")),
            # ep innermost within dp_shard x cp x tp: an expert-parallel group is ep neighbouring
            # ranks, whole tp groups (TorchTitan's layout for experts not split over tp)
            experts=view((p, self.dp_replicate, self.dp_shard * self.cp * self.tp // self.ep, self.ep),
                         ("pp", "dp_replicate", "efsdp", "ep")),
            groups=groups,
        )


Partition = tuple[tuple[int, ...], ...]
"""Disjoint sets of ranks, each in increasing order (a view dimension's cover the world)."""


@dataclass
class Groups:
    """This rank's process groups: one per partition of the world it was asked for (the group
    holding this rank), made once, in the same order on every rank; the whole world is the
    default group. Counted for the run's first log line; `set_timeout` moves them all."""

    timeout: datetime.timedelta | None
    """At creation (the set-up timeout); None: torch's default."""
    made: dict[Partition, dist.ProcessGroup | None] = field(default_factory=dict)
    apart: list[dist.ProcessGroup] = field(default_factory=list)
    """Groups of their own whose timeout stays (an async writer's, which runs beside the steps)."""

    def of(self, partition: Partition) -> dist.ProcessGroup | None:
        """The group of this rank's part of `partition` (None if no part holds it). Every rank
        must ask for the same partitions in the same order (group creation is collective)."""
        if partition not in self.made:
            if len(partition) == 1:
                self.made[partition] = dist.group.WORLD
            else:
                mine, _ = dist.new_subgroups_by_enumeration([list(r) for r in partition], timeout=self.timeout)
                self.made[partition] = mine
        return self.made[partition]

    def mesh(self, device_type: str, shape: tuple[int, ...], names: tuple[str, ...]) -> DeviceMesh:
        """A view of the world as `shape` (row-major over global ranks), each dimension the group
        of the ranks that differ only in it."""
        ranks = torch.arange(dist.get_world_size()).view(shape)
        dims = [self.of(tuple(sorted(tuple(r) for r in ranks.movedim(d, -1).reshape(-1, n).tolist())))
                for d, n in enumerate(shape)]
        return DeviceMesh.from_group(dims, device_type, mesh=ranks, mesh_dim_names=names)

    def own(self, backend: str, timeout_s: float) -> dist.ProcessGroup:
        """A whole-world group of its own, for collectives that must not interleave with the
        steps' (they run in another thread); its timeout stays `timeout_s`."""
        group = dist.new_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s))
        self.apart.append(group)
        return group

    @property
    def count(self) -> int:
        """Process groups this rank holds, the default one included."""
        return len({id(g) for g in (dist.group.WORLD, *self.made.values(), *self.apart) if g is not None})

    def set_timeout(self, seconds: float) -> None:
        """Every group's timeout for the collectives issued from now on (the default group
        included), except the groups made apart."""
        timeout = datetime.timedelta(seconds=seconds)
        for group in {id(g): g for g in (dist.group.WORLD, *self.made.values()) if g is not None}.values():
            _set_group_timeout(timeout, group)


def _set_group_timeout(timeout: datetime.timedelta, group: dist.ProcessGroup) -> None:
    # public as dist.set_timeout from torch 2.15; torch 2.13 and 2.14 spell it privately
    setter = getattr(dist, "set_timeout", None) or dist.distributed_c10d._set_pg_timeout
    setter(timeout, group)


@dataclass(frozen=True)
class Meshes:
    """Named views of the world as [pp, dp_replicate, dp_shard, cp, tp] (row-major over global ranks)."""

    dims: ParallelDims
    dense: DeviceMesh
    """[pp, dp_replicate, dp_shard_cp, tp]: FSDP/HSDP and TP (within a pipeline stage)."""
    batch: DeviceMesh
    """[pp, dp, cp, tp]: which slice of the global batch, and of the sequence, a rank holds."""
    loss: DeviceMesh
    """[pp_dp_cp, tp]: the ranks whose token sums make up the global loss."""
    tokens: DeviceMesh
    """[pp, dp_cp, tp]: the ranks that hold different tokens of one pipeline stage."""
    routed: DeviceMesh
    """[pp, dp_cp_tp]: the ranks that route different tokens through a stage's MoE layers (under
    tensor parallel each tp rank routes its own sequence shard)."""
    experts: DeviceMesh
    """[pp, dp_replicate, efsdp, ep]: experts split over ep (ep neighbouring ranks of dp_shard x cp x
    tp), each part FSDP-sharded over efsdp = dp_shard x cp x tp / ep and replicated over dp_replicate."""
    groups: Groups
    """The process groups behind every view, one per distinct set of ranks."""

    @property
    def fsdp(self) -> DeviceMesh:
        """1-D mesh for FSDP, or 2-D (replicate, shard) for HSDP."""
        if self.dims.dp_replicate > 1:
            return self.dense["dp_replicate", "dp_shard_cp"]
        return self.dense["dp_shard_cp"]

    @property
    def tp(self) -> DeviceMesh:
        return self.dense["tp"]

    @property
    def ep(self) -> DeviceMesh:
        return self.experts["ep"]

    @property
    def expert_fsdp(self) -> DeviceMesh:
        """Where each expert-parallel part of the experts is FSDP-sharded (HSDP with replicas)."""
        if self.dims.dp_replicate > 1:
            return self.experts["dp_replicate", "efsdp"]
        return self.experts["efsdp"]

    @property
    def dp(self) -> DeviceMesh:
        return self.batch["dp"]

    @property
    def cp(self) -> DeviceMesh:
        return self.batch["cp"]

    @property
    def pp(self) -> DeviceMesh:
        """The ranks of this rank's pipeline: one per stage group, the same dp, cp and tp coordinates."""
        return self.batch["pp"]

    @property
    def dp_cp(self) -> DeviceMesh:
        """The ranks that hold different tokens: target counts are summed over it."""
        return self.tokens["dp_cp"]

    @property
    def loss_group(self) -> dist.ProcessGroup:
        """The ranks whose loss sums add up to the global loss (tp ranks hold the same sum; only
        the last pipeline stage holds a nonzero one)."""
        return self.loss["pp_dp_cp"].get_group()

    @property
    def stage_ranks(self) -> list[int]:
        """The ranks that hold the same model parts as this one (all of them without pipeline
        stages): titanlite.parallel.grad_norm counts each parameter once among them."""
        per_stage = dist.get_world_size() // self.dims.pp
        first = dist.get_rank() // per_stage * per_stage
        return list(range(first, first + per_stage))


def pick_device(choice: str) -> torch.device:
    if choice == "cuda" and not torch.cuda.is_available():
        raise ConfigError("training.device: cuda requested but no CUDA device is visible; use auto or cpu")
    if choice == "cpu" or (choice == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def init_process_group(device: torch.device, timeout_s: int) -> None:
    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    if "WORLD_SIZE" not in os.environ:
        # a lone `python -m titanlite.train` (no torchrun) is a world of one; an in-memory
        # store, so that two such runs on one machine never race for a port
        kwargs |= {"store": dist.HashStore(), "rank": 0, "world_size": 1}
    elif int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")):
        # torchrun restarted the ranks, and its store still holds the failed attempt's keys
        # (the dead ranks' addresses, which gloo would dial): a namespace per attempt
        store, rank, world_size = next(dist.rendezvous("env://", timeout=datetime.timedelta(seconds=timeout_s)))
        attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
        kwargs |= {"store": dist.PrefixStore(f"titanlite-attempt-{attempt}", store), "rank": rank,
                   "world_size": world_size}
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s), **kwargs)
