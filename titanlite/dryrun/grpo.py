"""A GRPO step's time (rl.enable: titanlite.rl), predicted by the dry run: the rollout, then the
update step(s) the dry run traces.

Each data-parallel rank generates its global_batch_size / group_size / dp prompts one after
another, each prompt's group_size completions as one batch (titanlite.rl.rollout), on the
training layout. Per prompt, with P = training.seq_len - rl.max_new_tokens (the longest prompt
the run accepts: a bound) and N = rl.max_new_tokens (every completion runs to the end: a bound):

  prefill  group_size x P tokens' forward FLOPs (a third of the spec's training FLOPs per token,
           split over tp) at the step-time model's matmul rate (timing.matmul_bound)
  decode   N steps; step j reads this rank's weights (titanlite.dryrun.generation.weights_per_rank)
           and its share of the cache at P + j tokens (titanlite.layers.cache.cache_bytes) at the
           HBM bandwidth the step-time model's memory-bound ops reach (hbm x timing.FITTED.hbm);
           under FSDP each step also all-gathers every layer's weights over the shard group
           (timing.comm_seconds; FSDP prefetches the next layer's during this one's, so a step
           takes the longer of the two), and a step whose FLOPs take longer is compute-bound

Weights and cache are in the parameter dtype under FSDP (it casts the weights it gathers); without
FSDP the rollout runs outside the step's autocast, in the weights' float32. Every weight is read
each step (a MoE layer's unrouted experts too: a bound). Not counted: kernel launch gaps (an
eager decode step launches a few kernels per layer), the reward, and the extra log-prob forwards
of rl.kl_coef > 0 or rl.updates_per_batch > 1. A rollout batch trains rl.updates_per_batch steps:
it takes the rollout once and the traced step updates_per_batch times.
"""

from __future__ import annotations

from typing import Any

import torch

from titanlite.config.job import JobConfig
from titanlite.dryrun import timing
from titanlite.dryrun.generation import weights_per_rank
from titanlite.dryrun.hardware import GPU
from titanlite.layers.cache import cache_bytes


def grpo_times(cfg: JobConfig, plan: Any, gpu: GPU, update_s: float, param_dtype: str) -> dict[str, Any]:
    """The rollout's and the update's seconds per rollout batch on `gpu` (the module doc), the
    update step taking `update_s` and FSDP casting to `param_dtype` (the name the dry run resolved)."""
    r, t, dims, args = cfg.rl, cfg.training, plan.dims, plan.args
    if plan.spec.from_hf_config is not None:  # transformers' attention and cache: no formula here
        return {"untimed": f"model.name {plan.spec.name} generates with transformers' own attention and cache, "
                           "which have no formula here"}
    dtype = getattr(torch, param_dtype) if dims.fsdp else torch.float32
    weights, _ = weights_per_rank(plan.spec, args, dims.tp, dtype)
    g, n, prompt = r.group_size, r.max_new_tokens, t.seq_len - r.max_new_tokens
    prompts = plan.global_batch_size // g // dims.dp
    bandwidth = gpu.hbm_bytes_per_s * timing.FITTED.hbm
    matmul = timing.matmul_bound(gpu)
    shard = dims.dp_shard * dims.cp  # FSDP's shard group: a rank's weights, gathered each forward
    gather = (timing.comm_seconds("all_gather", weights, args.n_layers + 1, tuple(range(0, shard * dims.tp, dims.tp)),
                                  gpu) if shard > 1 else 0.0)

    def forward_flops(tokens: int, length: int) -> float:
        return tokens * plan.spec.flops_per_token(args, length) / 3 / dims.tp

    prefill = max(forward_flops(g * prompt, prompt) / matmul, gather)
    read = [(weights + cache_bytes(args, g, prompt + j, dtype.itemsize, dims.tp)) / bandwidth for j in range(1, n + 1)]
    decode = sum(max(s, gather, forward_flops(g, prompt + j) / matmul) for j, s in enumerate(read, 1))
    rollout = prompts * (prefill + decode)
    update = r.updates_per_batch * update_s
    return {"prompts_per_rank": prompts, "group_size": g, "prompt_tokens": prompt, "new_tokens": n,
            "dtype": str(dtype).removeprefix("torch."), "weights_bytes": weights,
            "decode_read_s": prompts * sum(read), "decode_gather_s": prompts * n * gather,
            "prefill_s": prompts * prefill, "decode_s": prompts * decode, "rollout_s": rollout,
            "updates": r.updates_per_batch, "update_s": update, "step_s": rollout + update}


def print_grpo(p: dict[str, Any]) -> None:
    if "untimed" in p:
        print(f"GRPO: the rollout is not timed: {p['untimed']}")
        return
    print(f"GRPO, per rollout batch on each rank: {p['prompts_per_rank']} prompt(s) x {p['group_size']} completions, "
          f"prompts of {p['prompt_tokens']} tokens (seq_len - max_new_tokens: a bound) + {p['new_tokens']} new, "
          f"generated in {p['dtype']} ({p['weights_bytes'] / 2**30:.2f} GiB of weights read per decode step)")
    print(f"  rollout {p['rollout_s']:9.4g} s  (prefill {p['prefill_s']:.4g} s, decode {p['decode_s']:.4g} s: "
          f"weights + cache read {p['decode_read_s']:.4g} s, FSDP gathers {p['decode_gather_s']:.4g} s)")
    print(f"  update  {p['update_s']:9.4g} s  ({p['updates']} x the step above)")
    print(f"  total   {p['step_s']:9.4g} s  (rollout {100 * p['rollout_s'] / p['step_s']:.0f}%; launch gaps, rewards "
          "and log-prob forwards not counted)")
