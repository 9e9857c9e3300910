"""The [rl] section (GRPO: docs/post_training.md) and its checks that read no file.

Part of titanlite.config: a leaf (errors only), importable without torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from titanlite.errors import ConfigError

LOSS_NORMS = ("token", "sequence", "group")
"""rl.loss_norm's values (titanlite.config.job.CHOICES)."""


@dataclass(frozen=True)
class RL:
    """Reinforcement learning with verifiable rewards (GRPO): each step samples rl.group_size
    completions per prompt from the current policy, scores them, and updates on the clipped
    policy gradient of their group-relative advantages. training.global_batch_size counts
    completions: global_batch_size / group_size prompts per step."""

    enable: bool = False
    """Train with GRPO instead of on data.path's tokens."""
    prompts: str = ""
    """A .jsonl of prompts: each row a "prompt" (text, sent as a user turn where the tokenizer has a
    chat template) or "messages" (a chat ending in a user turn), and an "answer" the reward may
    read. Empty: with data.format = "chat", data.path's rows (chats ending in a user turn, with their
    "answer" field); else the built-in arithmetic task (titanlite.rl.task)."""
    group_size: int = 4
    """Completions sampled per prompt (>= 2: advantages compare them)."""
    temperature: float = 1.0
    """Sampling temperature (> 0); the loss's log-probabilities are of logits / temperature."""
    max_new_tokens: int = 32
    """The longest completion; prompts may take training.seq_len - max_new_tokens tokens."""
    reward: str = "titanlite.rl.rewards:exact_answer"
    """"module:function" called as f(prompt, completion, row) -> a number; built in:
    titanlite.rl.rewards:exact_answer (1 where the completion's last number or last line is the
    row's answer) and titanlite.rl.rewards:format_answer (1 where it ends in "answer: ...")."""
    clip_eps: float = 0.2
    """The ratio to the sampling policy is clipped to [1 - clip_eps, 1 + clip_eps_high]."""
    clip_eps_high: float = -1.0
    """The upper clip (DAPO's clip-higher); -1: clip_eps."""
    kl_coef: float = 0.0
    """Weight of the k3 KL to the reference (LoRA: the model with its adapters off; a full fine-tune:
    a frozen copy of its starting weights, saved with each checkpoint); 0: no reference."""
    loss_norm: str = "token"
    """token (DAPO: mean over the step's completion tokens), sequence (GRPO: mean of each
    completion's token mean) or group (Dr. GRPO: sum over tokens / (completions x max_new_tokens))."""
    updates_per_batch: int = 1
    """Optimizer steps on each batch of rollouts (> 1: the ratio is to the log-probs they were sampled with)."""

    @property
    def clip_high(self) -> float:
        return self.clip_eps if self.clip_eps_high == -1 else self.clip_eps_high


def check_rl(r: RL, checkpoint_interval: int, validation_freq: int) -> None:
    """[rl]'s own values, and what a GRPO run cannot do; one line each."""
    if not r.enable:
        return
    if r.group_size < 2:
        raise ConfigError(f"rl.group_size must be >= 2 (advantages compare a prompt's completions), got {r.group_size}")
    if not r.temperature > 0:
        raise ConfigError(f"rl.temperature must be > 0 (GRPO samples), got {r.temperature}")
    if r.max_new_tokens < 1:
        raise ConfigError(f"rl.max_new_tokens must be >= 1, got {r.max_new_tokens}")
    if not 0 < r.clip_eps < 1 or (r.clip_eps_high != -1 and not r.clip_eps_high > 0):
        raise ConfigError(f"rl.clip_eps must be in (0, 1) and rl.clip_eps_high > 0 or -1, got {r.clip_eps} and "
                          f"{r.clip_eps_high}")
    if r.kl_coef < 0:
        raise ConfigError(f"rl.kl_coef must be >= 0, got {r.kl_coef}")
    if r.updates_per_batch < 1:
        raise ConfigError(f"rl.updates_per_batch must be >= 1, got {r.updates_per_batch}")
    if ":" not in r.reward:
        raise ConfigError(f"rl.reward: '{r.reward}' is not 'module:function' (e.g. titanlite.rl.rewards:exact_answer)")
    if checkpoint_interval % r.updates_per_batch:
        raise ConfigError(f"checkpoint.interval {checkpoint_interval} is not a multiple of rl.updates_per_batch "
                          f"{r.updates_per_batch}: a resume must start a new batch of rollouts")
    if validation_freq:
        raise ConfigError("validation.freq: a GRPO run has no validation data; set validation.freq = 0 "
                          "(its rewards are logged as rl/reward_mean)")
