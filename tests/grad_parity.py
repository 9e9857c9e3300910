"""Per-parameter gradient parity of one parallelized step against the same model unsharded.

Run as N ranks (tests/harness.assert_grad_parity starts them; by hand: `python -m
torch.distributed.run --nproc_per_node N tests/grad_parity.py MODEL LAYOUT [+ LAYOUT ...]`), a
LAYOUT being `DP_SHARD TP [nosp] [ep=N] [rep=N] [cp=N] [muon]` (nosp: tensor parallel without sequence
parallel; ep=N: expert parallel; rep=N: N HSDP replicas; muon: also one Muon step, each parameter's
update compared; cp=N: N context-parallel ranks, on a batch of packed documents that cross their
chunks, the reference masked the same) or `pp PP DP_SHARD TP SCHEDULE [ep=N] [muon]` for pipeline stages, either with
`layers=N` to build the flavor with N blocks (two stages per rank need more blocks than a debug
flavor may have) and `model=NAME` to check another model than MODEL; several layouts share one launch. Every rank builds the single-device model too
and compares the loss (to 1e-6) and each full gradient; loss-curve parity alone can miss a small
parameter whose gradient is never reduced across ranks (e.g. a replicated norm weight under tensor parallelism).
"""

from __future__ import annotations


import contextlib
import dataclasses
import functools
import sys

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from titanlite.layers.attention import AttnContext, AttnSetup
from titanlite.config.job import ActivationCheckpoint, Compile, LRScheduler, Optimizer, Parallelism
from titanlite.parallel.mesh import ParallelDims, init_process_group
from titanlite.loss import ExtraLosses, cross_entropy_sum, loss_context
from titanlite.model_spec import get_model_spec, model_args
from titanlite.layers import init
from titanlite.parallel import pipeline
from titanlite.parallel.apply import ParallelizeOptions, parallelize
from titanlite.parallel.context import ContextParallel, shard_batch
from titanlite.parallel.grad_norm import local_grad_sq, reduce_partial_grads
from titanlite.optim import build_optimizers
from titanlite.optim import muon as muon_impl


def updates(parts: list[torch.nn.Module]) -> dict[str, torch.Tensor]:
    """Each parameter's whole change in one Muon (and AdamW) step, keyed by name."""
    def whole(p: torch.Tensor) -> torch.Tensor:  # a copy: a replicated DTensor's full_tensor() is its storage
        return (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()

    # tied names too: a pipeline's last stage holds its own copy of a weight tied on one device
    before = {n: whole(p) for part in parts for n, p in part.named_parameters(remove_duplicate=False)}
    build_optimizers(parts, Optimizer(name="Muon"), LRScheduler(warmup_steps=0), 10).step()
    return {n: whole(p) - before[n] for part in parts for n, p in part.named_parameters(remove_duplicate=False)}


def count_orthogonalised(fn):
    """Wrap Newton-Schulz to count the matrices this rank orthogonalises."""
    def counted(u: torch.Tensor, *args) -> torch.Tensor:
        count_orthogonalised.n += u.shape[0]
        return fn(u, *args)
    return counted


count_orthogonalised.n = 0
muon_impl.newton_schulz = count_orthogonalised(muon_impl.newton_schulz)


@functools.cache
def meshes_of(dims: ParallelDims):
    """One set of process groups per layout, shared by the launch's models."""
    return dims.build_meshes("cpu")


def main(name: str, dp_shard: int, tp: int, sequence_parallel: bool, pp: int = 1, schedule: str = "",
         ep: int = 1, rep: int = 1, muon: bool = False, layers: int = 0, cp: int = 1, compile: bool = False) -> bool:
    dims = ParallelDims(rep, dp_shard, cp, tp, pp=pp, ep=ep)
    meshes = meshes_of(dims)
    name, _, flavor = name.partition("/")  # MODEL or MODEL/FLAVOR
    spec = get_model_spec(name)
    args = model_args(spec, flavor or "debugmodel", 0, 32)
    if layers:
        args = dataclasses.replace(args, n_layers=layers)
    tokens = torch.randint(0, args.vocab_size, (4, 33), generator=torch.Generator().manual_seed(0))
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    # under cp: packed documents crossing the 8-token chunks (cp 2), one starting inside chunk 1
    # after a document that continues from chunk 0, one on chunk 2's first token
    docs = (torch.tensor([[0] * 5 + [1] * 7 + [2] * 4 + [3] * 16] * 4) if cp > 1 else None)

    ref = spec.build(args)
    ref.init_weights(0)
    # inside a step's extra-loss scope, as PipelineStep runs: a model's extra terms (multi-token
    # prediction) reach the gradients on every path
    n_targets = torch.tensor(float(labels.numel()))
    extra = ExtraLosses()
    extra.bind([ref])
    with extra.collect(n_targets):
        want_loss = cross_entropy_sum(ref(inputs, AttnContext(None, docs)), labels).div(n_targets)
        want_loss.backward()

    opts = ParallelizeOptions(torch.float32, torch.float32, "default", ActivationCheckpoint(), Compile(enable=compile),
                              loss_parallel=tp > 1, sequence_parallel=sequence_parallel)
    rows = inputs.shape[0] // dims.dp
    mine = slice(meshes.dp.get_local_rank() * rows, (meshes.dp.get_local_rank() + 1) * rows)
    if pp > 1:
        cfg = Parallelism(pipeline_parallel_degree=pp, pipeline_parallel_schedule=schedule,
                          pipeline_parallel_microbatch_size=1)
        plan = dataclasses.replace(pipeline.plan_stages(cfg, args.n_layers, rows), tied=pipeline.tied_names(ref))
        with torch.device("meta"):
            parts = pipeline.stage_modules(spec, args, plan, meshes)
        for part in parts:
            parallelize(part, spec, meshes, opts)
            init.materialize(part, torch.device("cpu"), 0)
        shapes = pipeline.stage_shapes(spec, args, 1, 32, dims, opts)
        step = pipeline.PipelineStep(parts, plan, schedule, meshes, cross_entropy_sum, opts, AttnSetup(),
                                     contextlib.nullcontext(), torch.device("cpu"), shapes)
        loss = step([{"input_ids": inputs[mine], "labels": labels[mine]}]).loss_sum / n_targets
        mirrors = step.mirrors
    else:
        with torch.device("meta"):
            parts = [spec.build(args)]
        parallelize(parts[0], spec, meshes, opts)
        init.materialize(parts[0], torch.device("cpu"), 0)
        batch = {"input_ids": inputs[mine], "labels": labels[mine]}
        setup = AttnSetup()
        if cp > 1:
            batch = shard_batch(batch, meshes.cp.get_local_rank(), cp)
            setup = AttnSetup(cp=ContextParallel.of(meshes.cp.get_group()))
        ctx = setup.context(batch.get("positions"), None if docs is None else docs[mine])
        extra.bind(parts)
        with loss_context(opts.loss_parallel), extra.collect(n_targets):
            loss = cross_entropy_sum(parts[0](batch["input_ids"], ctx), batch["labels"]).div(n_targets)
            loss.backward()
        mirrors = ()
    reduce_partial_grads([p for part in parts for p in part.parameters()])
    loss = loss.detach().clone()
    dist.all_reduce(loss)  # each row's loss once per tensor-parallel rank
    loss_diff = (abs(loss / tp - want_loss.detach()) / want_loss.detach()).item()

    worst, gathered = {}, {}
    expected = dict(ref.named_parameters(remove_duplicate=False))
    for pname, p in ((n, p) for part in parts for n, p in part.named_parameters()):
        g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        want = expected[pname].grad
        worst[pname] = ((g - want).abs().max() / want.abs().max().clamp_min(1e-12)).item()
        gathered[pname] = g
    # the global gradient norm, each shard counted once among the ranks of a stage
    sq = local_grad_sq([p for part in parts for p in part.parameters() if all(p is not m for m in mirrors)],
                       meshes.stage_ranks)
    dist.all_reduce(sq)
    # in float64: the reference is the exact norm, which float32 over a whole large tensor is not
    want_norm = sum(p.grad.double().square().sum() for p in ref.parameters()).sqrt()
    worst["grad_norm"] = (abs(sq.sqrt() - want_norm) / want_norm).item()
    if muon:
        # the single-device optimizer on the same (gathered) gradients: an update is as sensitive
        # as Newton-Schulz or Adam's first step make it to the gradients' rounding, checked above
        for pname, g in gathered.items():
            expected[pname].grad = g.clone()
        want_step = updates([ref])
        matrices = count_orthogonalised.n
        count_orthogonalised.n = 0
        got_step = updates(parts)
        # every matrix once over all ranks: a pipeline stage's ranks count their stage's matrices
        counts = torch.tensor([count_orthogonalised.n, matrices if dist.get_rank() == 0 else 0])
        count_orthogonalised.n = 0
        dist.all_reduce(counts)
        worst["matrices orthogonalised more than once"] = float(counts[0] != counts[1])
        for pname, got in got_step.items():
            want = want_step[pname]
            worst[f"update {pname}"] = ((got - want).abs().max() / want.abs().max().clamp_min(1e-12)).item()
    bad = {k: v for k, v in worst.items() if v > 1e-5}
    if loss_diff > 1e-6:  # the first step's loss, to 1e-6 as every parity test
        bad["loss"] = loss_diff
    print(f"rank {dist.get_rank()}: {len(worst)} gradients, worst relative diff {max(worst.values()):.2e}, loss "
          f"{loss_diff:.1e}"
          + (f"; MISMATCH {bad}" if bad else ""), flush=True)
    ok = torch.tensor([0 if bad else 1])
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    return bool(ok.item())


def run_layout(name: str, words: list[str]) -> bool:
    flags = [w for w in words if "=" in w or w in ("nosp", "muon")]
    name = next((f.partition("=")[2] for f in flags if f.startswith("model=")), name)
    ep, rep, layers, cp = (next((int(f.partition("=")[2]) for f in flags if f.startswith(k)), default)
                           for k, default in (("ep=", 1), ("rep=", 1), ("layers=", 0), ("cp=", 1)))
    if words[0] == "pp":
        return main(name, int(words[2]), int(words[3]), True, int(words[1]), words[4], ep=ep, muon="muon" in flags,
                    layers=layers)
    return main(name, int(words[0]), int(words[1]), "nosp" not in flags, ep=ep, rep=rep, muon="muon" in flags,
                layers=layers, cp=cp)


if __name__ == "__main__":
    init_process_group(torch.device("cpu"), 120)
    layouts = " ".join(sys.argv[2:]).split(" + ")
    ok = all([run_layout(sys.argv[1], layout.split()) for layout in layouts])  # every layout runs
    dist.destroy_process_group()
    sys.exit(0 if ok else 1)
