"""The dry run's stand-ins in the shared loop body (titanlite.loop): its referee, MoE routing, and
the CUDA kernels a CPU tensor would decompose. Fake tensors hold no values, so every MoE layer
routes a perfectly balanced load (docs/scaling.md), through its own `MoE.set_dispatch`; no step
is judged non-finite; and RMSNorm is traced as CUDA's fused kernel."""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.distributed.tensor import DTensor, Partial

from titanlite.dryrun.blocktrace import BlockWatch
from titanlite.errors import ConfigError
from titanlite.layers.moe import GroupedExperts, grouped_mm_supported, moe_layers
from titanlite.loop import Referee, Verdict
from titanlite.parallel.expert import ExpertParallelDispatch
from titanlite.parallel.grad_norm import local_grad_sq
from titanlite.step import StepOutput


def balanced(rows: int, n: int) -> list[int]:
    """`rows` spread evenly over `n` experts: the routing fake tensors stand in for (they hold none)."""
    q, r = divmod(rows, n)
    return [q + (i < r) for i in range(n)]


def balanced_local(experts: GroupedExperts, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """MoE.dispatch without expert parallelism, under a balanced load."""
    return experts(x, counts, sizes=balanced(x.shape[0], counts.numel()))


class BalancedExpertParallel(ExpertParallelDispatch):
    """Expert parallelism's dispatch (its counts exchange included) under a balanced load: each
    rank sends and receives x's rows spread evenly over the experts."""

    def __call__(self, experts: GroupedExperts, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        received = self.exchange(counts)
        sent = balanced(x.shape[0], counts.numel())
        return self.run(experts, x, received, sent, sent)


def _cuda_expert_path(experts: GroupedExperts, args: tuple) -> None:
    """The experts' path as a CUDA job picks it, which this host cannot probe."""
    if experts.use_grouped_mm is None:
        why = "moe.grouped_mm = off" if experts.mode == "off" else grouped_mm_supported(
            torch.device("cuda"), args[0].dtype, tuple(experts.w1.shape[1:]), probe=False)
        if why is not None and experts.mode == "on":
            raise ConfigError(f"moe.grouped_mm = on, but {why}; use auto or off")
        experts.use_grouped_mm = why is None


def fake_routing(parts: list[torch.nn.Module], device: str) -> None:
    """Route every MoE layer's tokens as a balanced load (docs/scaling.md says what imbalance
    costs), through the experts' path the job would take on `device`."""
    for moe in moe_layers(parts):
        ep = moe.dispatch
        moe.set_dispatch(BalancedExpertParallel(ep.group, ep.ep) if isinstance(ep, ExpertParallelDispatch)
                         else balanced_local)
        if device == "cuda":
            moe.experts.register_forward_pre_hook(_cuda_expert_path)


class TracedReferee(Referee):
    """The dry run's referee: the guard's two votes (stop, non-finite) on the norm's all-reduce,
    as a run without a spike window sends them; never a skip; the gradient reduction watched
    block by block (BlockWatch)."""

    def __init__(self, watch: BlockWatch) -> None:
        self.watch = watch

    def votes(self, out: StepOutput) -> torch.Tensor:
        return torch.stack([torch.zeros_like(out.loss_sum), out.loss_sum])

    def verdict(self, grad_norm: torch.Tensor, votes: torch.Tensor) -> Verdict:
        return Verdict(torch.zeros_like(grad_norm), skip=False)

    def reduce_grads(self, params: list[nn.Parameter]) -> None:
        self.watch.reduce_partial_grads(params)

    def local_grad_sq(self, params: list[nn.Parameter], stage_ranks: Sequence[int]) -> torch.Tensor:
        with unset_fake_temporarily():  # it reads the mesh's rank tensor, a real one
            return local_grad_sq(params, stage_ranks)


# CUDA runs nn.RMSNorm as one fused kernel (aten::_fused_rms_norm), which saves its input and the
# float32 reciprocal RMS for backward; a CPU tensor takes the composite path (pow, mean, rsqrt,
# two products), which saves a float32 copy of the normalised input as well and runs six kernels
# forward. The dry run of a CUDA job traces the fused kernel's shapes instead (custom ops with
# fake kernels only: the dry run never runs them on real tensors).
@torch.library.custom_op("titanlite_dryrun::fused_rms_norm", mutates_args=())
def _fused_rms_norm(x: torch.Tensor, weight: torch.Tensor | None, dims: int) -> tuple[torch.Tensor, torch.Tensor]:
    raise NotImplementedError("a dry-run stand-in: fake tensors only")


@_fused_rms_norm.register_fake
def _(x, weight, dims):
    return torch.empty_like(x), x.new_empty((*x.shape[:x.dim() - dims], *[1] * dims), dtype=torch.float32)


@torch.library.custom_op("titanlite_dryrun::fused_rms_norm_backward", mutates_args=())
def _fused_rms_norm_backward(grad: torch.Tensor, x: torch.Tensor, rstd: torch.Tensor,
                             weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    raise NotImplementedError("a dry-run stand-in: fake tensors only")


@_fused_rms_norm_backward.register_fake
def _(grad, x, rstd, weight):
    return torch.empty_like(x), torch.empty_like(weight)


def _setup(ctx, inputs, output):
    x, weight, _ = inputs
    ctx.save_for_backward(x, output[1], weight)


def _backward(ctx, grad, _):
    x, rstd, weight = ctx.saved_tensors
    if weight is None:
        weight = x.new_empty(x.shape[-1:])  # the kernel's gradient of a weight of ones, unused
    grad_x, grad_w = _fused_rms_norm_backward(grad, x, rstd, weight)
    return grad_x, grad_w if ctx.needs_input_grad[1] else None, None


_fused_rms_norm.register_autograd(_backward, setup_context=_setup)


def _fused_forward(norm: nn.RMSNorm, x: torch.Tensor) -> torch.Tensor:
    weight = norm.weight
    if isinstance(x, DTensor):  # sequence parallel: the kernel runs on each rank's rows
        local_w = None if weight is None else weight.to_local(grad_placements=[Partial()] * weight.device_mesh.ndim)
        out = _fused_rms_norm(x.to_local(), local_w, len(norm.normalized_shape))[0]
        return DTensor.from_local(out, x.device_mesh, x.placements, run_check=False)
    return _fused_rms_norm(x, weight, len(norm.normalized_shape))[0]


def fused_norms(parts: list[nn.Module]) -> None:
    """Trace every nn.RMSNorm as the fused kernel a CUDA job runs."""
    for part in parts:
        for m in part.modules():
            if isinstance(m, nn.RMSNorm):
                m.forward = partial(_fused_forward, m)
