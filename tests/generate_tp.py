"""Generation under tensor parallel equals one process: run by tests/attention_parity.py in its
gloo launch, on each tp group of its ranks. Each family whose attention keeps another kind of
past (windows and sinks, MLA's latent, Gated DeltaNet's state) is saved by FSDP over every rank
as a step folder, read back by `python -m titanlite.generate --tp`'s loader (load_model) split
by the training plan over the group, and generates a ragged batch: the tokens of the whole model
in one process, logits within 1e-5. The loader reads each rank's shards from the DCP files: the
state dict it reads into holds, for every split weight, this rank's share and no more. Each
rank's cache holds its share of the bytes of the formula the dry run reports (cache_bytes)."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard

import titanlite.generate.load as load
from titanlite.checkpoint.folder import commit
from titanlite.checkpoint.state import ModelState
from titanlite.generate import generate
from titanlite.layers.cache import Cache, cache_bytes
from titanlite.model_spec import get_model_spec

MODELS = {"llama3": ("debugmodel_swa", {}), "deepseek_v3": ("debugmodel", {}),
          "qwen3_5": ("debugmodel_moe", dict(dim=64))}


def save_fsdp(model: torch.nn.Module, family: str, args, folder: Path) -> None:
    """A model-only step folder written by every rank from its FSDP shard, as a run's seed is."""
    fully_shard(model, mesh=DeviceMesh("cpu", list(range(dist.get_world_size()))))
    tmp = folder.with_name(folder.name + ".tmp")
    dcp.save({"model": ModelState([model])}, checkpoint_id=str(tmp))
    if dist.get_rank() == 0:
        commit(tmp, folder, {"model": family, "args": dataclasses.asdict(args), "model_only": True})
    dist.barrier()


@contextlib.contextmanager
def sharded_reads(seen: list[dict[str, torch.Tensor]]) -> Iterator[None]:
    """Record the state dicts DCP reads into; refuse the whole-tensor read (read_dcp)."""
    real = dcp.load

    def spy(state, *a, **kw):
        seen.append(state["model"].state_dict())
        return real(state, *a, **kw)

    def whole(*_):
        raise AssertionError("a --tp load read the checkpoint's tensors whole")

    dcp.load, saved_read = spy, load.read_dcp
    load.read_dcp = whole
    try:
        yield
    finally:
        dcp.load, load.read_dcp = real, saved_read


@contextlib.contextmanager
def recorded_caches(made: list[Cache]) -> Iterator[None]:
    """Keep each generation cache made in `made`."""
    module = importlib.import_module("titanlite.generate")

    class Recorded(Cache):
        def __init__(self, *a, **kw) -> None:
            super().__init__(*a, **kw)
            made.append(self)

    module.Cache = Recorded
    try:
        yield
    finally:
        module.Cache = Cache


def local_share(state: dict[str, torch.Tensor], tp: int) -> tuple[bool, float]:
    """(every split weight's local shard is its whole size / tp, the rank's elements / the whole's)."""
    right, mine, total = True, 0, 0
    for v in state.values():
        local = v.to_local() if isinstance(v, DTensor) else v
        want = list(v.shape)
        for p in v.placements if isinstance(v, DTensor) else ():
            if isinstance(p, Shard):
                want[p.dim] //= tp
        right &= list(local.shape) == want
        mine, total = mine + local.numel(), total + v.numel()
    return right, mine / total


def run(group: dist.ProcessGroup, root: Path) -> int:
    """Compare every model on this rank's tp group; print one line each; return the mismatches."""
    torch.set_num_threads(1)
    mesh = DeviceMesh.from_group(group, "cpu", mesh_dim_names=("tp",))
    tp = group.size()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (5, 23, 12)]
    bad = 0
    for family, (flavor, changes) in MODELS.items():
        spec = get_model_spec(family)
        args = dataclasses.replace(spec.flavors[flavor], max_seq_len=64, **changes)
        model = spec.build(args)
        model.init_weights(0)
        whole = generate(model.eval(), prompts, 32, keep_logits=True)
        save_fsdp(model, family, args, root / family / "step-1")
        seen: list[dict[str, torch.Tensor]] = []
        with sharded_reads(seen):
            split_model, _, _ = load.load_model(root / family / "step-1", tp=tp, mesh=mesh)
        made: list[Cache] = []
        with recorded_caches(made):
            split = generate(split_model, prompts, 32, keep_logits=True)
        # this rank's cache: its share of the formula's (cache_bytes, the dry run's figure)
        cached = made[0].nbytes() == cache_bytes(args, len(prompts), 23 + 32, tp=tp)
        shards_only, share = local_share(seen[0], tp) if len(seen) == 1 else (False, 1.0)
        same = all(a.ids == b.ids for a, b in zip(whole, split))
        worst = max((a.logits - b.logits).abs().max().item() for a, b in zip(whole, split))
        ok = same and worst <= 1e-5 and shards_only and share < 1 and cached
        bad += not ok
        print(f"rank {dist.get_rank()} generate tp {family} (FSDP-saved, read {share:.0%} of the weights): tokens "
              f"equal {same}, worst logit diff {worst:.2e}, cache as its formula {cached}{'' if ok else ' MISMATCH'}",
              flush=True)
    return bad

