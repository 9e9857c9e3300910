"""The seams pipeline and expert parallelism build on: per-parameter initialisation, extra
loss terms, the gradient norm over disjoint and partial meshes, the one parallelize order
(float8 for every family), per-phase watchdog deadlines, and an acyclic import graph."""

import ast
import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from harness import REPO, _env
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from titanlite.layers import init
from titanlite.config.job import ActivationCheckpoint, Compile, Float8
from titanlite.loss import ExtraLosses
from titanlite.model_spec import get_model_spec
from titanlite.parallel.apply import ParallelizeOptions, parallelize
from titanlite.parallel.grad_norm import local_grad_sq
from titanlite.parallel.mesh import ParallelDims


@pytest.mark.parametrize("family", ["llama3", "qwen3", "qwen3_moe"])
@pytest.mark.parametrize("flavor", ["debugmodel", "debugmodel_tied"])
def test_a_stage_with_some_layers_initialises_them_as_the_whole_model(family, flavor):
    spec = get_model_spec(family)
    if flavor not in spec.flavors:
        flavor = "debugmodel"  # qwen3's debug model is the tied one
    args = dataclasses.replace(spec.flavors[flavor], max_seq_len=32)
    whole = spec.build(args)
    whole.init_weights(7)
    for keep, pre, post in [({"1", "2"}, False, False), ({"0"}, True, False), ({"3"}, False, True)]:
        with torch.device("meta"):
            stage = spec.build(args)
        for name in [n for n in stage.layers if n not in keep]:
            del stage.layers[name]
        for name in [*(() if pre else spec.pre), *(() if post else spec.post)]:
            setattr(stage, name, nn.Identity())
        init.materialize(stage, torch.device("cpu"), 7)
        expected = dict(whole.named_parameters(remove_duplicate=False))
        got = dict(stage.named_parameters())
        assert got and all(torch.equal(p, expected[n]) for n, p in got.items()), (keep, pre, post)
    other = spec.build(args)
    other.init_weights(8)
    assert not torch.equal(other.layers["0"].attention.wq.weight, whole.layers["0"].attention.wq.weight)


def test_extra_loss_gets_the_gradient_of_its_share_of_the_loss():
    x = torch.randn(4, 3, requires_grad=True)
    w = torch.randn(3, requires_grad=True)
    n_targets = torch.tensor(8.0)
    extra = ExtraLosses()
    with extra.collect(n_targets) as sums:
        aux = (x @ w).square().sum()  # a sum over tokens
        y = extra.add(x * 2, "aux", aux)
        (y.sum() / n_targets).backward()
    assert torch.equal(sums["aux"], aux.detach())
    got = w.grad.clone()
    w.grad = None
    ((x * 2).sum() / n_targets + (x @ w).square().sum() / n_targets).backward()
    torch.testing.assert_close(got, w.grad, rtol=0, atol=0)
    assert extra.add(x, "aux", aux) is x  # outside a training step: nothing happens


def test_extra_loss_counts_once_when_activation_checkpointing_recomputes():
    """The forward runs again in backward under activation checkpointing; the term is logged
    once per micro-batch all the same, in forward order."""
    from torch.utils.checkpoint import checkpoint
    x, w, n_targets = torch.randn(4, 3, requires_grad=True), torch.randn(3), torch.tensor(8.0)
    extra = ExtraLosses()

    def block(h: torch.Tensor, k: float) -> torch.Tensor:
        return extra.add(h * 2, "aux", k * (h @ w).square().sum())

    with extra.collect(n_targets) as sums:
        for k in (1.0, 3.0):  # two micro-batches
            (checkpoint(block, x, k, use_reentrant=False).sum() / n_targets).backward()
    aux = (x @ w).square().sum().detach()
    assert extra.forwards == 4 and torch.equal(sums["aux"], 1.0 * aux + 3.0 * aux)


def test_activation_checkpointing_is_a_field_the_block_reads():
    """AC is the plan's Recompute on the block itself: names and gradients are the model's own."""
    from titanlite.parallel.apply import all_blocks, apply_ac
    spec = get_model_spec("qwen3_moe")
    args = dataclasses.replace(spec.flavors["debugmodel"], max_seq_len=32)
    tokens = torch.randint(0, args.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    grads = []
    for cfg in (ActivationCheckpoint(), ActivationCheckpoint(mode="selective", selective_every=2),
                ActivationCheckpoint(mode="selective", selective_type="op")):
        model = spec.build(args)
        model.init_weights(3)
        names = list(model.state_dict())
        apply_ac(all_blocks(model, spec), cfg)
        assert list(model.state_dict()) == names
        checkpointed = [b.recompute is not None for b in model.layers.values()]
        assert checkpointed == {"none": [False] * 4, "selective": [True, False, True, False] if
                                cfg.selective_type == "layer" else [True] * 4}[cfg.mode][:len(checkpointed)]
        calls = []
        model.layers["1"].attention.register_forward_hook(lambda *_: calls.append(1))
        model(tokens).float().square().mean().backward()
        assert len(calls) == (1 if cfg.mode == "none" or cfg.selective_type == "layer" else 2)  # recomputed
        grads.append([p.grad for p in model.parameters()])
    for other in grads[1:]:
        assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(grads[0], other))


def _norm_worker(rank: int, world: int, store: str, out: str) -> None:
    """Two pipeline stages on disjoint halves of the world, each with a sharded, a replicated
    and a plain gradient, plus one on a partial mesh (each rank alone, as copies of an expert
    shard are): every distinct value must count exactly once in the global norm."""
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    world_mesh = init_device_mesh("cpu", (2, 2, 1), mesh_dim_names=("pp", "dp", "one"))
    stage, alone = world_mesh["dp"], world_mesh["one"]  # stage: ranks {0, 1} or {2, 3}
    stage_ranks = stage.mesh.flatten().tolist()
    gen = torch.Generator().manual_seed(0)
    full = {f"s{s}.{k}": torch.randn(6, 4, generator=gen) for s in range(2) for k in ("shard", "rep")}
    full |= {f"s{s}.expert": torch.randn(4, 4, generator=gen) for s in range(2)}
    full |= {f"s{s}.plain": torch.randn(3, generator=gen) for s in range(2)}
    s = rank // 2
    grads = [distribute_tensor(full[f"s{s}.shard"], stage, [Shard(0)]),
             distribute_tensor(full[f"s{s}.rep"], stage, [Replicate()]),
             distribute_tensor(full[f"s{s}.expert"], alone, [Replicate()]),
             full[f"s{s}.plain"]]
    params = [nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(params, grads):
        p.grad = g
    sq = local_grad_sq(params, stage_ranks)
    dist.all_reduce(sq)
    expected = math.sqrt(sum(v.square().sum().item() for v in full.values()))
    Path(out, f"rank-{rank}.json").write_text(json.dumps({"norm": sq.sqrt().item(), "expected": expected}))
    dist.barrier()
    dist.destroy_process_group()


def test_grad_norm_over_disjoint_stage_meshes_and_partial_meshes(tmp_path):
    out = str(tmp_path)
    mp.spawn(_norm_worker, args=(4, str(Path(out) / "store"), out), nprocs=4)
    for rank in range(4):
        r = json.loads(Path(out, f"rank-{rank}.json").read_text())
        assert abs(r["norm"] - r["expected"]) <= 1e-6 * r["expected"], r


# layout -> world size, process groups per rank (the default one included): the world and the
# rank alone, then one group per further distinct set of ranks (docs/benchmarks.md)
GROUP_LAYOUTS = {"fsdp 8": (ParallelDims(1, 8, 1, 1), 8, 2), "fsdp 4 x tp 2": (ParallelDims(1, 4, 1, 2), 8, 4),
                 "fsdp 4 x tp 2, ep 4": (ParallelDims(1, 4, 1, 2, ep=4), 8, 6),
                 "hsdp 2x2 x cp 2 x tp 2 x pp 2": (ParallelDims(2, 2, 2, 2, pp=2), 32, 12)}


@pytest.mark.parametrize("layout", GROUP_LAYOUTS)
def test_each_set_of_ranks_gets_one_process_group(layout):
    from titanlite.dryrun import run  # noqa: F401  registers torch's "fake" backend, as the dry run does

    dims, world, expected = GROUP_LAYOUTS[layout]
    dist.init_process_group("fake", store=dist.HashStore(), rank=world - 1, world_size=world)
    try:
        meshes = dims.build_meshes("cpu")
        held = [tuple(dist.get_process_group_ranks(g)) for g in dist.distributed_c10d._world.pg_map]  # private: all of them
        assert len(set(held)) == len(held), f"duplicate process groups: {sorted(held)}"
        assert len(held) == meshes.groups.count == expected
        if layout.startswith("hsdp"):  # the last rank: coordinate 1 in every dimension
            assert dist.get_process_group_ranks(meshes.tp.get_group()) == [30, 31]
            assert dist.get_process_group_ranks(meshes.cp.get_group()) == [29, 31]
            assert meshes.fsdp.mesh.tolist() == [[17, 19, 21, 23], [25, 27, 29, 31]]
            assert dist.get_process_group_ranks(meshes.loss_group) == list(range(1, 32, 2))
            assert [meshes.dense.get_local_rank(d) for d in meshes.dense.mesh_dim_names] == [1, 1, 3, 1]
    finally:
        dist.destroy_process_group()


def _meta_parallelized(family: str, opts: ParallelizeOptions, **changes) -> nn.Module:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        spec = get_model_spec(family)
        with torch.device("meta"):
            model = spec.build(dataclasses.replace(spec.flavors["debugmodel"], max_seq_len=32, **changes))
        parallelize(model, spec, ParallelDims(1, 1, 1, 1).build_meshes("cpu"), opts)
        return model
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("family", ["llama3", "qwen3"])
def test_float8_converts_the_linear_layers_inside_blocks_of_every_family(family):
    pytest.importorskip("torchao", reason="installed with the test extras")
    from torchao.float8.float8_linear import Float8Linear

    opts = ParallelizeOptions(torch.float32, torch.float32, "default", ActivationCheckpoint(), Compile(),
                              float8=Float8(enable=True))
    model = _meta_parallelized(family, opts)
    linears = [m for b in model.layers.values() for m in b.modules() if isinstance(m, nn.Linear)]
    assert linears and all(isinstance(m, Float8Linear) for m in linears)
    assert not isinstance(model.output, Float8Linear)  # embeddings and output stay as they are


def test_float8_keeps_router_gates_in_high_precision():
    pytest.importorskip("torchao", reason="installed with the test extras")
    from torchao.float8.float8_linear import Float8Linear

    opts = ParallelizeOptions(torch.float32, torch.float32, "default", ActivationCheckpoint(), Compile(),
                              float8=Float8(enable=True))
    spec = get_model_spec("qwen3_moe")
    # 16 experts: a gate float8 matmuls could take (both dims multiples of 16), and a shared expert
    moe = dataclasses.replace(spec.flavors["debugmodel"].moe, num_experts=16, shared_hidden=128)
    model = _meta_parallelized("qwen3_moe", opts, moe=moe)
    gates = [b.moe.router.gate for b in model.layers.values()]
    others = [m for b in model.layers.values() for m in b.modules()
              if isinstance(m, nn.Linear) and all(m is not g for g in gates)]
    assert gates and all(type(g) is nn.Linear for g in gates)  # routing decisions stay exact
    assert others and all(isinstance(m, Float8Linear) for m in others)


def test_float8_converts_the_mtp_depths_block_as_the_others():
    pytest.importorskip("torchao", reason="installed with the test extras")
    from titanlite.parallel.apply import all_blocks

    opts = ParallelizeOptions(torch.float32, torch.float32, "default", ActivationCheckpoint(), Compile(),
                              float8=Float8(enable=True))
    model = _meta_parallelized("deepseek_v3", opts)

    def kinds(block: nn.Module) -> dict[str, str]:
        return {n: type(m).__name__ for n, m in block.named_modules() if isinstance(m, nn.Linear)}

    assert all_blocks(model, get_model_spec("deepseek_v3"))[-1] is model.mtp["0"].block
    assert kinds(model.mtp["0"].block) == kinds(model.layers["2"])
    assert "Float8Linear" in kinds(model.mtp["0"].block).values()


def test_deterministic_mode_sets_up_cuda_for_determinism(monkeypatch):
    # by construction only (it sets flags, no GPU needed): the suite has no GPU to run a CUDA
    # job twice and compare bits
    from titanlite.runtime.determinism import set_determinism

    b = torch.backends
    sdp = [b.cuda.flash_sdp_enabled, b.cuda.mem_efficient_sdp_enabled, b.cuda.cudnn_sdp_enabled, b.cuda.math_sdp_enabled]
    switches = [b.cuda.enable_flash_sdp, b.cuda.enable_mem_efficient_sdp, b.cuda.enable_cudnn_sdp, b.cuda.enable_math_sdp]
    before = (torch.are_deterministic_algorithms_enabled(), b.cudnn.deterministic, b.cudnn.benchmark, [f() for f in sdp])
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    try:
        set_determinism(torch.device("cuda"))
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
        assert torch.are_deterministic_algorithms_enabled() and b.cudnn.deterministic and not b.cudnn.benchmark
        assert [f() for f in sdp] == [False, False, False, True]  # math attention only
    finally:
        torch.use_deterministic_algorithms(before[0])
        b.cudnn.deterministic, b.cudnn.benchmark = before[1], before[2]
        for switch, on in zip(switches, before[3]):
            switch(on)


PHASE = """
import sys, time, torch
import torch.distributed as dist
from titanlite.config.job import Comm, Training
from titanlite.runtime.fault import Guard
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
guard = Guard(0, sys.argv[1], Comm(train_timeout_s=1, validation_timeout_s=3, eval_timeout_s=60), Training(), 60,
              start_step=1)
guard.start_step(2)
guard.phase("validation")
time.sleep(2)  # longer than a training step may take, inside validation's deadline
guard.phase("evaluation")
time.sleep(4)  # longer than a validation may take, well inside evaluation's deadline
guard.phase("logging")
time.sleep(30)
"""


def test_each_phase_has_its_own_deadline_and_the_report_names_it(tmp_path):
    proc = subprocess.run([sys.executable, "-c", PHASE, str(tmp_path)], capture_output=True, text=True,
                          env=_env(None), cwd=REPO, timeout=60)
    assert proc.returncode == 124, proc.stderr
    assert "step 2: exceeded comm.train_timeout_s (1 s) in logging" in proc.stderr, proc.stderr
    assert "in logging" in (tmp_path / "hang" / "rank-0.txt").read_text()


def _imports(path: Path, package: str) -> set[str]:
    """Every titanlite module `path` imports, at module level or inside functions."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            base = node.module if node.level == 0 else f"{package}.{node.module}"
            found |= {base} | {f"{base}.{a.name}" for a in node.names}
    return {m for m in found if m.startswith("titanlite")}


def test_titanlite_has_no_import_cycle_and_no_file_over_500_lines():
    modules = {}
    # titanlite/models and titanlite/tools link to the repo's models/ and tools/
    for root, package in [(REPO / "titanlite", "titanlite"), (REPO / "tools", "titanlite.tools")]:
        for path in root.rglob("*.py"):
            if {"models", "tools"} & set(path.relative_to(root).parts):
                continue  # model families sit outside the framework's import graph
            name = ".".join((package, *path.relative_to(root).with_suffix("").parts)).removesuffix(".__init__")
            modules[name] = path
            assert len(path.read_text().splitlines()) <= 500, path
    graph = {m: {d for d in _imports(p, m.rpartition(".")[0]) if d in modules and d != m}
             for m, p in modules.items()}
    assert "titanlite.errors" in graph and not graph["titanlite.errors"]
    state: dict[str, int] = {}

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for d in graph[m]:
            assert state.get(d) != 1, "import cycle: " + " -> ".join([*path, m, d])
            if d not in state:
                visit(d, [*path, m])
        state[m] = 2

    for m in graph:
        if m not in state:
            visit(m, [])


# Low to high: a package imports only from tiers below its own. config is a leaf (the checks
# that need checkpoint, data or parallel live in titanlite.preflight); layers know nothing of
# parallel (the static facts of a run reach them as objects: titanlite.layers.attention.AttnSetup).
TIERS = [{"errors"}, {"config"}, {"loss", "data", "optim", "runtime", "metrics", "model_spec"}, {"layers"},
         {"step", "preference"}, {"checkpoint", "parallel"}, {"__init__", "saved_model"}, {"generate"}, {"eval"},
         {"preflight", "loop"}, {"rl", "step_log"}, {"train"}, {"dryrun"}, {"plan"}]


def test_titanlite_packages_import_only_the_tiers_below_them():
    tier = {pkg: i for i, pkgs in enumerate(TIERS) for pkg in pkgs}
    upward = []
    for path in (REPO / "titanlite").rglob("*.py"):
        parts = path.relative_to(REPO / "titanlite").parts
        if parts[0] in ("models", "tools"):
            continue  # model families and tools sit outside the framework's import graph
        pkg = parts[0].removesuffix(".py")
        assert pkg in tier, f"titanlite/{pkg} has no tier in TIERS: place it"
        for dep in {m.split(".")[1] for m in _imports(path, "") if m.count(".")} - {pkg, "models"}:
            if tier[dep] >= tier[pkg]:
                upward.append(f"{path.relative_to(REPO)} imports titanlite.{dep}")
    assert not upward, upward
