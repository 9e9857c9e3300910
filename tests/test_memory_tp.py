"""FSDP x TP really divides memory: each of the 4 ranks of a dp_shard=2 x tp=2 layout
holds a quarter of the debug model's parameters and AdamW moments (plus its share of
the RMSNorm weights, which TP replicates and only FSDP shards), and, with loss parallel,
half of the logits; the loss in chunks equals the whole loss under loss parallel, and so does the
z-loss (its logsumexp over the sharded vocabulary) a dense one on the gathered logits."""

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.tensor import DTensor

import titanlite.models.llama3 as llama3
from titanlite.config.job import ActivationCheckpoint, Compile, Optimizer
from titanlite.parallel.mesh import ParallelDims
from titanlite import loss
from titanlite.loss import Z_LOSS, ExtraLosses, build_loss_fn, cross_entropy_sum, loss_context, token_logprobs
from titanlite.layers import init
from titanlite.config.job import LRScheduler
from titanlite.optim import build_optimizers
from titanlite.parallel.apply import ParallelizeOptions, parallelize
from titanlite.parallel.grad_norm import reduce_partial_grads

ARGS = dataclasses.replace(llama3.flavors["debugmodel"], max_seq_len=64)


def _local_bytes(t: torch.Tensor) -> int:
    local = t.to_local() if isinstance(t, DTensor) else t
    return local.numel() * local.element_size()


def _worker(rank: int, world: int, store: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    meshes = ParallelDims(dp_replicate=1, dp_shard=2, cp=1, tp=2).build_meshes("cpu")
    with torch.device("meta"):
        model = llama3.Transformer(ARGS)
    opts = ParallelizeOptions(torch.float32, torch.float32, "default", ActivationCheckpoint(), Compile(),
                              loss_parallel=True)
    parallelize(model, llama3.SPEC, meshes, opts)
    init.materialize(model, torch.device("cpu"), 0)
    (optimizer,) = build_optimizers([model], Optimizer(), LRScheduler(), 10).optimizers
    tokens = torch.randint(0, ARGS.vocab_size, (2, 64), generator=torch.Generator().manual_seed(1))
    with loss_context(True):
        logits = model(tokens)
        # loss parallel: each rank holds only its half of the vocabulary's logits
        assert isinstance(logits, DTensor) and logits.to_local().shape == (2, 64, ARGS.vocab_size // 2)
        _chunks_equal_the_whole(logits.detach())
        _z_loss_matches_dense(logits.detach())
        cross_entropy_sum(logits, tokens).backward()
    reduce_partial_grads(list(model.parameters()))
    optimizer.step()  # AdamW allocates its moments lazily, in the parameters' layout
    moments = [v for state in optimizer.state.values() for k, v in state.items() if k != "step"]
    Path(out, f"rank-{rank}.json").write_text(json.dumps({
        "params": sum(_local_bytes(p) for p in model.parameters()),
        "moments": sum(_local_bytes(m) for m in moments)}))
    dist.barrier()
    dist.destroy_process_group()


def _chunks_equal_the_whole(logits: DTensor) -> None:
    """Under loss parallel the loss in chunks of 10 tokens (each rank: 256 of the 512 logits per
    token) is the whole loss: the same sum, the same logits gradient; token_logprobs the same."""
    labels = torch.randint(0, ARGS.vocab_size, logits.shape[:2], generator=torch.Generator().manual_seed(2))
    results = []
    for chunk_bytes in (1 << 28, 4 * 256 * 10):
        loss.CHUNK_BYTES = chunk_bytes
        x = logits.clone().requires_grad_()
        total = cross_entropy_sum(x, labels)
        total.backward()
        results.append((total.item(), x.grad.to_local()))
    loss.CHUNK_BYTES = 1 << 28
    assert results[1][0] == pytest.approx(results[0][0], rel=1e-6)
    torch.testing.assert_close(results[1][1], results[0][1], rtol=1e-6, atol=1e-7)
    # each token's log-probability (evaluation, preference, RL) too: in chunks, to the bit
    results = []
    for chunk_bytes in (1 << 28, 4 * 256 * 10):
        loss.CHUNK_BYTES = chunk_bytes
        x = logits.clone().requires_grad_()
        lp = token_logprobs(x, labels)
        (lp * torch.arange(lp.numel()).view(lp.shape)).sum().backward()
        results.append((lp.detach(), x.grad.to_local()))
    loss.CHUNK_BYTES = 1 << 28
    assert results[0][0].shape == labels.shape
    torch.testing.assert_close(results[1], results[0], rtol=0, atol=0)


def _z_loss_matches_dense(logits: DTensor) -> None:
    """The z-loss on vocab-sharded logits, whole and in chunks of 10 tokens, against the dense
    z-loss on the gathered logits (tests/test_recipes.py writes the same reference): its sum and
    the logits gradient (cross-entropy included)."""
    labels = torch.randint(0, ARGS.vocab_size, logits.shape[:2], generator=torch.Generator().manual_seed(3))
    full = logits.full_tensor().requires_grad_()
    n = torch.tensor(labels.numel())
    ce = torch.nn.functional.cross_entropy(full.flatten(0, 1), labels.flatten(), reduction="sum")
    ref_z = 1e-2 * torch.logsumexp(full, -1).square().sum()
    ((ce + ref_z) / n).backward()
    for chunk_bytes in (1 << 28, 4 * 256 * 10):
        loss.CHUNK_BYTES = chunk_bytes
        x = logits.clone().requires_grad_()
        extra = ExtraLosses()
        with extra.collect(n) as sums:
            (build_loss_fn(Compile(), True, z_loss=1e-2)(x, labels, extra) / n).backward()
        assert sums[Z_LOSS].item() == pytest.approx(ref_z.item(), rel=1e-6)
        torch.testing.assert_close(x.grad.full_tensor(), full.grad, rtol=1e-6, atol=1e-9)
    loss.CHUNK_BYTES = 1 << 28


def test_fsdp2_x_tp2_holds_a_quarter_per_rank(tmp_path):
    with torch.device("meta"):
        full = llama3.Transformer(ARGS)
    total = sum(p.numel() * 4 for p in full.parameters())
    norms = sum(p.numel() * 4 for n, p in full.named_parameters() if "norm" in n)
    out = str(tmp_path)
    mp.spawn(_worker, args=(4, str(Path(out, "store")), out), nprocs=4, join=True)
    ranks = [json.loads(Path(out, f"rank-{r}.json").read_text()) for r in range(4)]
    # every debug-model dimension is even, so FSDP adds no padding: the split is exact
    per_rank = (total - norms) / 4 + norms / 2
    assert per_rank < total / 4 * 1.01
    for r in ranks:
        assert r["params"] == per_rank, (r, total)
        assert r["moments"] == 2 * per_rank, (r, total)
