"""MoE and expert-parallel mistakes are one-line ConfigErrors before launch (preflight)."""

import dataclasses

import pytest

from titanlite.config import load as config_load

from titanlite.layers import moe
from titanlite.errors import ConfigError
from titanlite.models.qwen3_moe import SPEC, flavors
from titanlite.parallel.mesh import ParallelDims
from titanlite.preflight import preflight

MOE = ["--model.name", "qwen3_moe", "--training.seq_len", "64"]


def _preflight(args: list[str], world: int):
    cfg, _ = config_load.load(args)
    return preflight(cfg, world)


@pytest.mark.parametrize("args,world,match", [
    ([*MOE, "--parallelism.expert_parallel_degree", "3"], 3,
     "expert_parallel_degree 3 does not divide the model's 8 experts"),
    ([*MOE, "--parallelism.expert_parallel_degree", "4", "--parallelism.data_parallel_replicate_degree", "2"], 4,
     r"expert_parallel_degree 4 must divide data_parallel_shard_degree 2 x context_parallel_degree 1"),
    (["--model.name", "llama3", "--parallelism.expert_parallel_degree", "2"], 2, "llama3 debugmodel has no experts"),
    (["--model.name", "llama3", "--moe.aux_loss_coeff", "0.1"], 1, r"\[moe\] keys apply to mixture-of-experts"),
    ([*MOE, "--parallelism.tensor_parallel_degree", "2"], 2,
     "MoE blocks under tensor_parallel_degree 2 need an expert-parallel degree that is a multiple of it; use 2"),
    ([*MOE, "--parallelism.tensor_parallel_degree", "4", "--parallelism.expert_parallel_degree", "2"], 8,
     "expert_parallel_degree 2 must divide .* = 8 and be a multiple of tensor_parallel_degree 4"),
    ([*MOE, "--moe.grouped_mm", "sometimes"], 1, "moe.grouped_mm: 'sometimes' is not one of auto, on, off"),
    ([*MOE, "--moe.bias_update_rate", "-1"], 1, "moe.bias_update_rate must be >= 0"),
    ([*MOE, "--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule", "ZBVZeroBubble",
      "--parallelism.expert_parallel_degree", "2"], 4,
     "ZBVZeroBubble splits each backward .* expert_parallel_degree 2 does not survive"),
    (["--model.name", "deepseek_v3", "--training.seq_len", "64", "--parallelism.pipeline_parallel_degree", "2",
      "--parallelism.pipeline_parallel_schedule", "InterleavedZeroBubble", "--training.local_batch_size", "8"], 2, "the multi-token prediction depth on the last stage does not survive"),
], ids=["experts_not_divisible_by_ep", "ep_not_dividing_dp_shard_x_cp", "dense_model_with_ep",
        "moe_keys_on_dense_model", "tp_without_ep", "ep_not_multiple_of_tp", "grouped_mm_choice", "negative_bias_rate",
        "split_backward_schedule_with_ep", "split_backward_schedule_with_mtp"])
def test_refused_before_launch(args, world, match):
    with pytest.raises(ConfigError, match=match) as err:
        _preflight(args, world)
    assert "\n" not in str(err.value)


def test_top_k_larger_than_experts():
    args = dataclasses.replace(flavors["debugmodel"], moe=dataclasses.replace(flavors["debugmodel"].moe, top_k=9))
    with pytest.raises(ConfigError, match="top_k 9 must be between 1 and its 8 experts"):
        SPEC.check_layout(args, ParallelDims(1, 1, 1, 1))


def test_grouped_mm_forced_where_unsupported(monkeypatch):
    assert _preflight([*MOE, "--moe.grouped_mm", "on"], 1).args.moe.grouped_mm == "on"  # runs here
    def unsupported(*args, **kwargs):
        raise NotImplementedError("no grouped GEMM kernel for this device")
    monkeypatch.setattr(moe.F, "grouped_mm", unsupported)
    monkeypatch.setattr(moe, "_PROBED", {})
    with pytest.raises(ConfigError, match="moe.grouped_mm = on, but grouped_mm does not run on cpu in torch.float32 "
                                          r"\(no grouped GEMM kernel for this device\); use auto"):
        _preflight([*MOE, "--moe.grouped_mm", "on"], 1)
    assert _preflight([*MOE, "--moe.grouped_mm", "auto"], 1).args.moe.grouped_mm == "auto"  # falls back to the loop
