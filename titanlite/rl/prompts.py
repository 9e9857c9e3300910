"""GRPO's prompts: rl.prompts (a .jsonl of "prompt" or "messages" rows with an "answer") or the
built-in task, each tokenized as the model will see it (a user turn through the tokenizer's chat
template with the generation prompt where it has one, else the text's own tokens), and the prompts
each rollout batch takes, in an order fixed by the seed."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from titanlite.data.chat import check_messages
from titanlite.errors import ConfigError
from titanlite.rl.task import arithmetic_rows

_STOP_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|endoftext|>", "<|end|>")
"""Tokens that end an assistant turn in common chat templates: a completion stops at them too."""


@dataclass(frozen=True)
class Prompts:
    rows: list[dict]
    texts: list[str]
    """What the reward is given as the prompt: the row's "prompt", or its last user turn."""
    ids: list[list[int]]


def _read_rows(path: str) -> list[dict]:
    p = Path(path)
    if p.suffix != ".jsonl" or not p.is_file():
        raise ConfigError(f"rl.prompts: '{path}' is not a .jsonl file; give one row per prompt with \"prompt\" "
                          "(or \"messages\") and \"answer\", or leave it empty for the built-in arithmetic task")
    rows = []
    for n, line in enumerate(p.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(f"rl.prompts: {path} line {n} is not JSON ({e.msg}); fix or drop it") from None
        if not isinstance(row, dict) or ("prompt" not in row and "messages" not in row):
            raise ConfigError(f"rl.prompts: {path} line {n} has no \"prompt\" or \"messages\"; each row needs one")
        rows.append(row)
    if not rows:
        raise ConfigError(f"rl.prompts: {path} has no rows")
    return rows


def _chat(row: dict, where: str) -> list[dict]:
    if "messages" not in row:
        return [{"role": "user", "content": str(row["prompt"])}]
    try:
        chat = check_messages(row["messages"], where, "messages")
    except ConfigError as e:  # the data set's checks, named by this key
        raise ConfigError(f"rl.prompts{str(e).removeprefix('data.path')}") from None
    if chat[-1]["role"] != "user":
        raise ConfigError(f"rl.prompts: {where}: the chat's last message has role {chat[-1]['role']}; a prompt "
                          "ends in a user turn, which the completions answer")
    return chat


def load_prompts(path: str, tokenizer, seed: int, longest: int) -> Prompts:
    """The prompts, tokenized; each at most `longest` tokens (seq_len - max_new_tokens)."""
    rows = _read_rows(path) if path else arithmetic_rows(seed=seed)
    hf = getattr(tokenizer, "hf", None)
    templated = hf is not None and getattr(hf, "chat_template", None)
    texts, ids = [], []
    for n, row in enumerate(rows):
        where = f"{path} row {n + 1}" if path else f"built-in task row {n + 1}"
        chat = _chat(row, where)
        texts.append(str(chat[-1]["content"]))
        if templated:
            text = hf.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
            ids.append(list(hf(text, add_special_tokens=False)["input_ids"]))
        else:
            ids.append(tokenizer.encode(texts[-1]))
        if len(ids[-1]) > longest:
            raise ConfigError(f"rl.prompts: {where} has {len(ids[-1])} tokens, more than training.seq_len - "
                              f"rl.max_new_tokens = {longest}; raise training.seq_len, lower rl.max_new_tokens "
                              "or shorten the prompt")
        if not ids[-1]:
            raise ConfigError(f"rl.prompts: {where} is empty; a prompt needs one token at least")
    return Prompts(rows, texts, ids)


def stop_ids(tokenizer) -> list[int]:
    """The ids that end a completion: the tokenizer's EOS and its template's end-of-turn token."""
    out = {tokenizer.eos_id}
    hf = getattr(tokenizer, "hf", None)
    vocab = hf.get_vocab() if hf is not None else {}
    out |= {vocab[t] for t in _STOP_TOKENS if t in vocab}
    return sorted(out)


def batch_prompts(n_rows: int, batch: int, per_batch: int, seed: int) -> list[int]:
    """The prompt indices rollout batch `batch` (0-based) takes: positions [batch * per_batch, ...)
    of the prompts in epochs, each epoch a permutation seeded by (seed, epoch)."""
    out, orders = [], {}
    for pos in range(batch * per_batch, (batch + 1) * per_batch):
        epoch, k = divmod(pos, n_rows)
        if epoch not in orders:
            orders[epoch] = torch.randperm(n_rows, generator=torch.Generator().manual_seed(seed * 100_003 + epoch))
        out.append(int(orders[epoch][k]))
    return out
