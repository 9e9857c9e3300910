"""Every architecture of the transformers family's debug list, on 2 gloo ranks, in five layouts
(FSDP 2, HSDP 2 x 1, TP 2, CP 2, PP 2), one launch for all: each layout is either refused by the
preflight (the one line a user gets, `titanlite.preflight.make_plan`), or one step's loss and
every gradient equal one process's (tests/grad_parity.py's checks: loss to 1e-6, gradients to
1e-5). Three architectures run compiled too (COMPILED), on one layout each.

    python -m torch.distributed.run --nproc_per_node 2 tests/transformers_parity.py OUT.json

Rank 0 writes {flavor: {layout: "passed" | "refused: <line>" | "MISMATCH"}} (and the compiled
runs' "flavor layout": "passed" | "MISMATCH") to OUT.json;
tests/test_transformers.py turns it into docs/transformers_models.md's table.
"""

from __future__ import annotations

import json
import sys
import tempfile

import torch
import torch.distributed as dist

import grad_parity
from titanlite.config import load as config_load
from titanlite.errors import ConfigError
from titanlite.model_spec import get_model_spec
from titanlite.parallel.mesh import init_process_group
from titanlite.preflight import make_plan

LAYOUTS = {
    "FSDP 2": (["--parallelism.data_parallel_shard_degree", "2"], dict(dp_shard=2, tp=1)),  # HSDP 1 x 2's mesh
    "HSDP 2 x 1": (["--parallelism.data_parallel_replicate_degree", "2"], dict(dp_shard=1, tp=1, rep=2)),
    "TP 2": (["--parallelism.tensor_parallel_degree", "2"], dict(dp_shard=1, tp=2)),
    "CP 2": (["--parallelism.context_parallel_degree", "2"], dict(dp_shard=1, tp=1, cp=2)),
    "PP 2": (["--parallelism.pipeline_parallel_degree", "2"], dict(dp_shard=1, tp=1, pp=2, schedule="1F1B")),
}
"""Layout name -> (its preflight flags on 2 ranks, grad_parity.main's arguments)."""
COMPILED = {"debug_gemma3_text": "TP 2", "debug_qwen3": "FSDP 2", "debug_cohere2": "HSDP 2 x 1"}
"""Flavors also run compiled (each layer, fullgraph, activation checkpointing off), on one layout each."""


def refusal(flavor: str, flags: list[str]) -> str | None:
    """The preflight's one line for this layout, or None when it would launch."""
    with tempfile.TemporaryDirectory(prefix="titanlite-parity-") as dump:
        cfg, _ = config_load.load(["--model.name", "transformers", "--model.flavor", flavor, "--training.seq_len",
                                   "32", "--training.local_batch_size", "4", "--job.dump_folder", dump, *flags])
        try:
            make_plan(cfg, 2)
        except ConfigError as e:
            return str(e)
    return None


def main(out: str) -> bool:
    spec = get_model_spec("transformers")
    results = {}
    for flavor in (f for f in spec.flavors if f != "debugmodel"):
        results[flavor] = {}
        for layout, (flags, kwargs) in LAYOUTS.items():
            line = refusal(flavor, flags)
            if line is not None:
                results[flavor][layout] = f"refused: {line}"
                continue
            ok = grad_parity.main(f"transformers/{flavor}", sequence_parallel=True, **kwargs)
            results[flavor][layout] = "passed" if ok else "MISMATCH"
    compiled = {}
    for flavor, layout in COMPILED.items():
        torch._dynamo.reset()  # each model's layers compile afresh, within Dynamo's recompile limit
        ok = grad_parity.main(f"transformers/{flavor}", sequence_parallel=True, compile=True, **LAYOUTS[layout][1])
        compiled[f"{flavor} {layout}"] = "passed" if ok else "MISMATCH"
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump({"transformers": _version(), "results": results, "compiled": compiled}, f, indent=1)
    return all(r != "MISMATCH" for layouts in [*results.values(), compiled] for r in layouts.values())


def _version() -> str:
    import transformers

    return transformers.__version__


def _aot_eager(compile_module):
    """nn.Module.compile with the aot_eager backend: Dynamo traces each layer whole (fullgraph) and
    AOTAutograd splits its forward and backward, as under inductor, whose code generation (the
    same for every family, tested on the native ones) would take this launch minutes on CPU."""
    def compile(self, **kwargs):
        return compile_module(self, **{"backend": "aot_eager", **kwargs})
    return compile


if __name__ == "__main__":
    torch.nn.Module.compile = _aot_eager(torch.nn.Module.compile)
    init_process_group(torch.device("cpu"), 120)
    ok = main(sys.argv[1])
    dist.barrier()
    dist.destroy_process_group()
    sys.exit(0 if ok else 1)
