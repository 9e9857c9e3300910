"""Expert parallelism: each rank of an ep group holds num_experts / ep of every MoE layer's experts.

Tokens are routed on the rank that holds them, sent to the rank holding their expert with one
all-to-all (uneven splits), computed there with the grouped GEMM, and sent back with a second.
Both are differentiable (backward is the reverse all-to-all), and both run on gloo.

The split sizes must be on the host: each MoE layer exchanges its per-expert token counts
(one small all-to-all) and copies them to the host once, together with the counts it sends,
the only device-to-host copy the layer makes. Nothing else
in the step waits on the device.

Expert weights stay the stacked [num_experts, ...] tensors, as DTensors sharded on dim 0 over
the ep mesh (so checkpoints hold the full, layout-independent stack), and are FSDP-sharded
over the remaining data-parallel ranks (efsdp, and dp_replicate for HSDP).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from titanlite.errors import ConfigError
from titanlite.layers.moe import GroupedExperts, MoE, MoEArgs
from titanlite.parallel.mesh import ParallelDims


def check_expert_layout(moe: MoEArgs, dims: ParallelDims) -> None:
    """What every MoE family refuses before launch: an ep degree its experts or tp cannot serve."""
    if dims.tp > 1 and dims.ep % dims.tp:
        # each tp rank routes its own tokens; experts are split over ep groups of whole tp groups
        raise ConfigError(f"parallelism.expert_parallel_degree {dims.ep}: MoE blocks under tensor_parallel_degree "
                          f"{dims.tp} need an expert-parallel degree that is a multiple of it; use {dims.tp}")
    if moe.num_experts % dims.ep:
        raise ConfigError(f"parallelism.expert_parallel_degree {dims.ep} does not divide the model's "
                          f"{moe.num_experts} experts; pick a degree that divides it")
    if not 1 <= moe.top_k <= moe.num_experts:
        raise ConfigError(f"the model's top_k {moe.top_k} must be between 1 and its {moe.num_experts} experts")


def _reorder(x: torch.Tensor, sizes: list[int], rows: int, cols: int) -> torch.Tensor:
    """x holds rows x cols chunks of `sizes` in row-major order; return them column-major."""
    chunks = torch.split(x, sizes)
    return torch.cat([chunks[r * cols + c] for c in range(cols) for r in range(rows)])


@dataclass(frozen=True)
class ExpertParallelDispatch:
    """MoE.dispatch under expert parallelism over `group` (`ep` ranks): x [N, dim] grouped by
    global expert id, counts[e] rows each. Runs every row on the rank holding its expert and
    returns the results in x's order."""

    group: dist.ProcessGroup
    ep: int

    def __call__(self, experts: GroupedExperts, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        received = self.exchange(counts)
        sent, got = torch.stack([counts, received]).tolist()  # the layer's one device-to-host copy
        return self.run(experts, x, received, sent, got)

    def exchange(self, counts: torch.Tensor) -> torch.Tensor:
        """received[r * n_local + e]: the rows rank r sends for this rank's local expert e."""
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=self.group)
        return received

    def run(self, experts: GroupedExperts, x: torch.Tensor, received: torch.Tensor, sent: list[int],
            got: list[int]) -> torch.Tensor:
        """The token all-to-all, the local experts and the way back, with the rows this rank
        sends per global expert (`sent`) and receives per (source rank, local expert) (`got`)
        on the host."""
        ep, group = self.ep, self.group
        n_local = len(sent) // ep
        sent, got = ([c[r * n_local:(r + 1) * n_local] for r in range(ep)] for c in (sent, got))
        in_splits, out_splits = [sum(s) for s in sent], [sum(g) for g in got]
        y = all_to_all_single_autograd(x, out_splits, in_splits, group)
        # arrives grouped by (source rank, local expert); the grouped GEMM wants (local expert, source)
        y = _reorder(y, [n for g in got for n in g], ep, n_local)
        y = experts(y, received.view(ep, n_local).sum(0), sizes=[sum(g[e] for g in got) for e in range(n_local)])
        y = _reorder(y, [g[e] for e in range(n_local) for g in got], n_local, ep)
        return all_to_all_single_autograd(y, in_splits, out_splits, group)


def apply_ep(model: nn.Module, ep_mesh: DeviceMesh) -> None:
    """Shard every MoE layer's experts over ep_mesh (dim 0) and route through all-to-all."""
    ep = ep_mesh.size()
    for moe in (m for m in model.modules() if isinstance(m, MoE)):
        for name, p in list(moe.experts.named_parameters(recurse=False)):
            moe.experts.register_parameter(
                name, nn.Parameter(distribute_tensor(p.data, ep_mesh, [Shard(0)], src_data_rank=None),
                                   requires_grad=p.requires_grad))
        moe.set_dispatch(ExpertParallelDispatch(ep_mesh.get_group(), ep))
        for name, p in moe.experts.named_parameters():
            if not isinstance(p, DTensor):
                # the dispatch runs each rank's experts on its own shard: a whole copy would be
                # trained by some experts' tokens only on each rank, and drift apart
                raise ConfigError(f"parallelism.expert_parallel_degree {ep}: the experts' parameter {name} is not "
                                  "sharded by expert parallel, which shards GroupedExperts' own [num_experts, ...] "
                                  "parameters only; hold it there")


def shard_experts(model: nn.Module, mesh: DeviceMesh, mp: MixedPrecisionPolicy, reshard: bool) -> None:
    """FSDP-shard each MoE layer's experts on their own mesh (before the blocks are wrapped,
    so the blocks' FSDP leaves them alone)."""
    for moe in (m for m in model.modules() if isinstance(m, MoE)):
        fully_shard(moe.experts, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard)


def set_stats_group(model: nn.Module, group: dist.ProcessGroup | None) -> None:
    """The ranks over which MoE layers (and any module declaring `stats_group`: a transformers
    model's load-balancing loss) count loads for the auxiliary loss."""
    for module in (m for m in model.modules() if isinstance(m, MoE) or hasattr(m, "stats_group")):
        module.stats_group = group
