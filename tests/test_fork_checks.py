"""A fork is checked, not trusted: applying parallelism refuses, in one line naming the parameter
and what to add, any parameter a plan would silently mishandle. In-process, on meta, on torch's
fake process group (as the dry run, which run_train.sh runs before launching, applies them)."""

import dataclasses
import re

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

from titanlite.config.job import ActivationCheckpoint, Compile
from titanlite.errors import ConfigError
from titanlite.model_spec import get_model_spec
from titanlite.parallel import pipeline
from titanlite.parallel.apply import ParallelizeOptions, parallelize
from titanlite.parallel.mesh import ParallelDims


def _add_qk_norm(model: nn.Module) -> None:
    for block in model.layers.values():
        block.attention.q_norm = nn.RMSNorm(block.attention.head_dim)
        block.attention.k_norm = nn.RMSNorm(block.attention.head_dim)


def _add_residual_scale(model: nn.Module) -> None:
    model.residual_scale = nn.Parameter(torch.ones(model.args.dim))


def _drop_ffn_norm(model: nn.Module) -> None:
    for block in model.layers.values():
        del block.ffn_norm
        block.ffn_norm = None


def _nest_expert_parameter(model: nn.Module) -> None:
    for block in model.layers.values():
        block.moe.experts.scale = nn.Module()
        block.moe.experts.scale.weight = nn.Parameter(torch.ones(block.moe.args.num_experts))


# name -> (family, (dp_shard, tp, ep), the fork's edit, sequence parallel)
FORKS = {"qk_norm": ("llama3", (1, 2, 1), _add_qk_norm, True),
         "qk_norm_nosp": ("llama3", (1, 2, 1), _add_qk_norm, False),
         "qwen3": ("qwen3", (1, 2, 1), None, True), "qwen3_nosp": ("qwen3", (1, 2, 1), None, False),
         "residual_scale": ("llama3", (1, 2, 1), _add_residual_scale, True),
         "no_ffn_norm_nosp": ("llama3", (1, 2, 1), _drop_ffn_norm, False),
         "nested_expert": ("qwen3_moe", (2, 1, 2), _nest_expert_parameter, True)}


def _apply(name: str) -> str:
    """FORKS[name]'s family built on meta, edited as the fork does, parallelized as rank 0 of a fake
    world: the ConfigError's message, or "ok" and a note on the result."""
    from titanlite.dryrun import run  # noqa: F401  registers torch's "fake" backend, as the dry run does

    family, (dp_shard, tp, ep), edit, sequence_parallel = FORKS[name]
    dist.init_process_group("fake", store=dist.HashStore(), rank=0, world_size=dp_shard * tp)
    try:
        spec = get_model_spec(family)
        with torch.device("meta"):
            model = spec.build(dataclasses.replace(spec.flavors["debugmodel"], max_seq_len=32))
            if edit is not None:
                edit(model)
        opts = ParallelizeOptions(torch.float32, torch.float32, "default", ActivationCheckpoint(), Compile(),
                                  sequence_parallel=sequence_parallel)
        parallelize(model, spec, ParallelDims(1, dp_shard, 1, tp, ep=ep).build_meshes("cpu"), opts)
        return f"ok: ffn_norm {model.layers['0'].ffn_norm is not None}, attention_norm " \
               f"{type(model.layers['0'].attention_norm.weight).__name__}"
    except ConfigError as e:
        return str(e)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def applied() -> dict[str, str]:
    """Every FORKS entry, applied in one fresh process: a fake world and the DTensors built on it
    would otherwise stay cached in this one (DTensor keys its sharding cache by process group),
    where later tests fork the dry run's workers."""
    with mp.get_context("spawn").Pool(1) as pool:
        return dict(zip(FORKS, pool.map(_apply, FORKS)))


@pytest.mark.parametrize("sp", ["", "_nosp"])
def test_a_parameter_the_tp_plan_leaves_plain_is_refused(applied, sp):
    """Llama 3 given QK-norm without the plan entry (the guide's fork before its parallelize.py
    edit): each rank's q_norm gradient would cover its own heads only (>100% off), silently."""
    message = applied[f"qk_norm{sp}"]
    assert "\n" not in message
    assert re.fullmatch(r"parallelism\.tensor_parallel_degree 2: parameter layers\.0\.attention\.q_norm\.weight "
                        r"is not covered by llama3's TP plan \(models/llama3/parallelize\.py tp_plan\); add "
                        r"'attention\.q_norm' to TPPlan\.block \(QK-norm: decoder_plan\(\.\.\., qk_norm=True\)\).*",
                        message), message
    # qwen3's plan has the entry: the same parameters are covered
    assert applied[f"qwen3{sp}"].startswith("ok"), applied[f"qwen3{sp}"]


def test_a_top_level_parameter_outside_the_plan_is_refused(applied):
    assert re.fullmatch(r"parallelism\.tensor_parallel_degree 2: parameter residual_scale is not covered by llama3's "
                        r"TP plan .*; add 'residual_scale' to a module of its own in TPPlan\.root",
                        applied["residual_scale"]), applied["residual_scale"]


def test_a_block_without_ffn_norm_runs_without_sequence_parallel(applied):
    """block_norms entries a block does not have are skipped with sequence parallel off too (they
    were looked up unfiltered there: AttributeError for a fork that drops ffn_norm)."""
    assert applied["no_ffn_norm_nosp"] == "ok: ffn_norm False, attention_norm DTensor", applied["no_ffn_norm_nosp"]


def test_an_expert_parameter_expert_parallel_does_not_shard_is_refused(applied):
    assert re.match(r"parallelism\.expert_parallel_degree 2: the experts' parameter scale\.weight is not sharded by "
                    r"expert parallel", applied["nested_expert"]), applied["nested_expert"]


def test_a_top_level_module_no_pipeline_stage_lists_is_refused():
    """Every stage would keep its own untied copy of it, trained on that stage's gradients alone."""
    spec = get_model_spec("llama3")
    with torch.device("meta"):
        model = spec.build(dataclasses.replace(spec.flavors["debugmodel"], max_seq_len=32))
    model.adapter = nn.Linear(4, 4)
    with pytest.raises(ConfigError, match=r"llama3's module 'adapter' is in no pipeline stage's list; add "
                                          r"it to ModelSpec\.pre .* or post .* in models/llama3/__init__\.py"):
        pipeline.cut(model, spec, 0, 1, True, False)
    del model.adapter
    model.residual_scale = nn.Parameter(torch.ones(4))
    with pytest.raises(ConfigError, match=r"parameter 'residual_scale' \(hold it in a module of its own\) "
                                          r"is in no pipeline stage's list"):
        pipeline.cut(model, spec, 0, 1, True, False)


@pytest.mark.parametrize("family", ["gpt_oss", "qwen3_moe", "llama3", "qwen3", "deepseek_v3"])
def test_every_family_gets_the_tensor_parallel_shape_checks(family):
    """Through shared code (gpt_oss and qwen3_moe never called check_tp): a degree above the
    key/value heads is refused before launch, for every family alike."""
    from titanlite.config import load as config_load
    from titanlite.preflight import make_plan

    kv = get_model_spec(family).flavors["debugmodel"].n_kv_heads
    cfg, _ = config_load.load(["--model.name", family, "--model.flavor", "debugmodel",
                               "--parallelism.tensor_parallel_degree", str(2 * kv)])
    with pytest.raises(ConfigError, match=rf"tensor_parallel_degree {2 * kv} exceeds n_kv_heads {kv}"):
        make_plan(cfg, 2 * kv)
