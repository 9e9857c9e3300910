"""Process group, device and the one DeviceMesh over [pp, dp_replicate, dp_shard, cp, tp], with its named views."""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

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
    def dp(self) -> int:
        """Data-parallel degree: how many different slices of each global batch exist."""
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp(self) -> bool:
        return self.dp_replicate * self.dp_shard * self.cp > 1

    def build_meshes(self, device_type: str) -> "Meshes":
        p = self.pp
        world = init_device_mesh(device_type, (p * self.dp_replicate * self.dp_shard * self.cp * self.tp,),
                                 mesh_dim_names=("world",))
        # Views of one world mesh in row-major [pp, dp_replicate, dp_shard, cp, tp] order, so a
        # rank has the same coordinates in each and DTensors from any of them compose. Pipeline
        # stages are outermost: every other view is taken within this rank's stage.
        return Meshes(
            dims=self,
            dense=world._unflatten(0, (p, self.dp_replicate, self.dp_shard * self.cp, self.tp),
                                   ("pp", "dp_replicate", "dp_shard_cp", "tp")),
            batch=world._unflatten(0, (p, self.dp, self.cp, self.tp), ("pp", "dp", "cp", "tp")),
            loss=world._unflatten(0, (p * self.dp * self.cp, self.tp), ("pp_dp_cp", "tp")),
            tokens=world._unflatten(0, (p, self.dp * self.cp, self.tp), ("pp", "dp_cp", "tp")),
            routed=world._unflatten(0, (p, self.dp * self.cp * self.tp), ("pp", "dp_cp_tp")),
            # ep innermost within dp_shard x cp x tp: an expert-parallel group is ep neighbouring
            # ranks, whole tp groups (TorchTitan's layout for experts not split over tp)
            experts=world._unflatten(0, (p, self.dp_replicate, self.dp_shard * self.cp * self.tp // self.ep, self.ep),
                                     ("pp", "dp_replicate", "efsdp", "ep")),
        )


@dataclass(frozen=True)
class Meshes:
    """Named sub-meshes of the world mesh [pp, dp_replicate, dp_shard, cp, tp]."""

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
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s), **kwargs)
