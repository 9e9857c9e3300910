"""Reinforcement learning with verifiable rewards (GRPO, with DAPO's and Dr. GRPO's variants): a
data source of rollouts (titanlite.rl.rollout) and a loss (titanlite.rl.loss) run by the plain
step; train.py's loop is unchanged. docs/post_training.md."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.nn as nn
from torchdata.stateful_dataloader import StatefulDataLoader

from titanlite.config.job import JobConfig
from titanlite.data.loader import GlobalBatchSampler, TokenSamples
from titanlite.data.tokens import TokenStream
from titanlite.errors import ConfigError
from titanlite.layers.lora import adapters_off
from titanlite.preference import FrozenCopy
from titanlite.preflight import Plan
from titanlite.rl.loss import PolicyLoss
from titanlite.rl.prompts import load_prompts, stop_ids
from titanlite.rl.rewards import load_reward
from titanlite.rl.rollout import Rollouts
from titanlite.rl.step import RLStep
from titanlite.step import PlainStep


def check(cfg: JobConfig, dims, gbs: int, warms_up: bool, tokenizer) -> None:
    """What a GRPO run needs of the layout, the batch, the reward and the prompts; one line each,
    before launch."""
    check_layout(cfg, dims, gbs, warms_up)
    load_reward(cfg.rl.reward)
    load_prompts(cfg.rl.prompts, tokenizer, cfg.data.seed, cfg.training.seq_len - cfg.rl.max_new_tokens, cfg.data)


def check_layout(cfg: JobConfig, dims, gbs: int, warms_up: bool) -> None:
    """What a GRPO run needs of the layout and the batch (the dry run's check: it reads no data)."""
    r, t = cfg.rl, cfg.training
    if dims.pp > 1 or dims.cp > 1:
        key = "pipeline_parallel_degree" if dims.pp > 1 else "context_parallel_degree"
        raise ConfigError(f"parallelism.{key}: rl.enable generates on the training layout, which pipeline and "
                          "context parallel do not run token by token; set it to 1 (FSDP, HSDP and TP generate)")
    if dims.tp > 1 and cfg.parallelism.sequence_parallel:
        raise ConfigError("parallelism.sequence_parallel: rl.enable generates one token at a time on the "
                          "tensor-parallel ranks, which cannot split it over the sequence; set "
                          "parallelism.sequence_parallel = false")
    if dims.tp > 1 and dims.ep > 1:  # each tp rank routes its own share of the sequence, which a decode step lacks
        raise ConfigError("parallelism.expert_parallel_degree: rl.enable generates one token at a time, which MoE "
                          "blocks under tensor parallel cannot split (the generation would hang); set "
                          "parallelism.tensor_parallel_degree = 1 or parallelism.expert_parallel_degree = 1")
    if cfg.fault_tolerance.enable or t.on_spike == "rollback" or warms_up:
        raise ConfigError("rl.enable: replica groups, training.on_spike = rollback and a batch-size warm-up change "
                          "which rollouts a step takes; turn them off for a GRPO run")
    if gbs % r.group_size or (gbs // r.group_size) % dims.dp:
        raise ConfigError(f"training.global_batch_size {gbs} must be rl.group_size {r.group_size} x a multiple of "
                          f"the data-parallel degree {dims.dp} (each rank generates whole groups)")


def checked(cfg: JobConfig, plan: Plan) -> Plan:
    """The preflight's plan, once a GRPO run's own checks (`check`) pass: run after
    titanlite.preflight.preflight wherever it runs before launch (which cannot import this
    package: generation sits above it)."""
    if cfg.rl.enable:
        check(cfg, plan.dims, plan.global_batch_size, plan.schedule.warms_up, plan.tokenizer)
    return plan


def idle_loader(seq_len: int, gbs: int, local_batch: int, dp_rank: int, dp: int) -> StatefulDataLoader:
    """The loader a GRPO run hands the loop and the checkpoint (its sample cursor), never read: the
    rollouts are its data, and data.path's source (a chat source's prompts included) is not
    tokenized or packed as training data."""
    stream = TokenStream(np.zeros(gbs * seq_len + 1, dtype=np.int64), np.zeros(1, dtype=np.int64))
    return StatefulDataLoader(TokenSamples(stream, seq_len, False, 0),
                              batch_sampler=GlobalBatchSampler(gbs, local_batch, dp_rank, dp))


def reference_of(cfg: JobConfig, model: nn.Module, optional: dict[str, Any]
                 ) -> Callable[[], contextlib.AbstractContextManager] | None:
    """What turns the policy into rl.kl_coef's reference for a forward, or None (no KL term): with
    LoRA the model with its adapters off; a full fine-tune a frozen copy of its starting weights
    (titanlite.preference.FrozenCopy, sharded as the policy), registered in `optional` to be
    checkpointed. Called before a resume, which restores the copy."""
    if not cfg.rl.kl_coef:
        return None
    if cfg.lora.rank:
        return lambda: adapters_off(model)
    optional["reference"] = copy = FrozenCopy([model])
    return copy.swapped_in


def build(cfg: JobConfig, tokenizer, step: PlainStep, meshes, gbs: int, device: torch.device,
          due: Callable[[int], bool], reference: Callable[[], contextlib.AbstractContextManager] | None
          ) -> tuple[RLStep, Rollouts]:
    """The RL step (the plain step's loss swapped) and the rollouts that feed it; `reference`:
    reference_of's."""
    r, t = cfg.rl, cfg.training
    rl_step = RLStep.of(step, PolicyLoss(r.clip_eps, r.clip_high, r.kl_coef, r.temperature), reference)
    prompts = load_prompts(r.prompts, tokenizer, cfg.data.seed, t.seq_len - r.max_new_tokens, cfg.data)
    rollouts = Rollouts(r, prompts, tokenizer.decode, stop_ids(tokenizer), load_reward(r.reward), rl_step,
                        t.seed, t.seq_len, gbs, t.local_batch_size, meshes.dp.get_local_rank(),
                        meshes.dp.size(), meshes.dp.get_group(), device, cfg.job.dump_folder, due)
    return rl_step, rollouts
