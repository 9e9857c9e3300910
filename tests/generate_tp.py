"""Generation under tensor parallel equals one process: run by tests/attention_parity.py in its
gloo launch, on each tp group of its ranks. Each family whose attention keeps another kind of
past (windows and sinks, MLA's latent, Gated DeltaNet's state) generates a ragged batch once
whole and once split by the training plan over the group: the same tokens, logits within 1e-5."""

from __future__ import annotations

import copy
import dataclasses

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from titanlite.generate import generate
from titanlite.generate.load import shard
from titanlite.model_spec import get_model_spec

MODELS = {"llama3": ("debugmodel_swa", {}), "deepseek_v3": ("debugmodel", {}),
          "qwen3_5": ("debugmodel_moe", dict(dim=64))}


def run(group: dist.ProcessGroup) -> int:
    """Compare every model on this rank's tp group; print one line each; return the mismatches."""
    torch.set_num_threads(1)
    mesh = DeviceMesh.from_group(group, "cpu", mesh_dim_names=("tp",))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (5, 23, 12)]
    bad = 0
    for family, (flavor, changes) in MODELS.items():
        spec = get_model_spec(family)
        model = spec.build(dataclasses.replace(spec.flavors[flavor], max_seq_len=64, **changes))
        model.init_weights(0)
        whole = generate(copy.deepcopy(model).eval(), prompts, 32, keep_logits=True)
        shard(model.eval(), spec, mesh)
        split = generate(model, prompts, 32, keep_logits=True)
        same = all(a.ids == b.ids for a, b in zip(whole, split))
        worst = max((a.logits - b.logits).abs().max().item() for a, b in zip(whole, split))
        ok = same and worst <= 1e-5
        bad += not ok
        print(f"rank {dist.get_rank()} generate tp {family}: tokens equal {same}, worst logit diff {worst:.2e}"
              f"{'' if ok else ' MISMATCH'}", flush=True)
    return bad
