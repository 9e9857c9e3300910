"""GRPO's prompts: rl.prompts (a .jsonl of "prompt" or "messages" rows with an "answer"), a chat
source's rows (data.format = "chat": data.path's chats, each ending in a user turn, with their
"answer" column) or the built-in task, each tokenized as the model will see it (a user turn through the tokenizer's chat
template with the generation prompt where it has one, else the text's own tokens), and the prompts
each rollout batch takes, in an order fixed by the seed."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from titanlite.config.data import Data
from titanlite.data.chat import check_messages
from titanlite.data.sources import iter_records, jsonl_rows
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
    for n, row in jsonl_rows(p, "rl.prompts"):
        if not isinstance(row, dict) or ("prompt" not in row and "messages" not in row):
            raise ConfigError(f"rl.prompts: {path} line {n} has no \"prompt\" or \"messages\"; each row needs one")
        rows.append(row)
    if not rows:
        raise ConfigError(f"rl.prompts: {path} has no rows")
    return rows


def _chat_rows(data: Data) -> tuple[list[dict], list[str]]:
    """data.path's chats (data.messages_field) as prompt rows {"messages", "answer"}, the answer
    from the rows' "answer" field (column) where they have one; and each row's name."""
    if data.mix or not data.path:
        raise ConfigError("data.path: rl.enable with data.format = \"chat\" takes its prompts from data.path's rows "
                          f"(chats ending in a user turn); {'data.mix' if data.mix else 'the built-in chat set'} "
                          "has none: set data.path to one source (or give rl.prompts)")
    chats = list(iter_records(data.path, data.messages_field, data.split, "data.messages_field"))
    answers = iter_records(data.path, "answer", data.split, "a GRPO chat source's 'answer' column")
    rows = [{"messages": m} if a is None else {"messages": m, "answer": a} for (_, m), (_, a) in zip(chats, answers)]
    return rows, [where for where, _ in chats]


def _chat(row: dict, where: str, key: str) -> list[dict]:
    if "messages" not in row:
        return [{"role": "user", "content": str(row["prompt"])}]
    try:
        chat = check_messages(row["messages"], where, "messages")
    except ConfigError as e:  # the data set's checks, named by this key
        raise ConfigError(f"{key}{str(e).removeprefix('data.path')}") from None
    if chat[-1]["role"] != "user":
        raise ConfigError(f"{key}: {where}: the chat's last message has role {chat[-1]['role']}; a prompt "
                          "ends in a user turn, which the completions answer")
    return chat


def load_prompts(path: str, tokenizer, seed: int, longest: int, data: Data | None = None) -> Prompts:
    """The prompts, tokenized; each at most `longest` tokens (seq_len - max_new_tokens): rl.prompts'
    (`path`), else a chat source's (`data`, data.format = "chat"), else the built-in task's."""
    key = "rl.prompts"
    if path:
        rows = _read_rows(path)
        wheres = [f"{path} row {n + 1}" for n in range(len(rows))]
    elif data is not None and data.format == "chat":
        (rows, wheres), key = _chat_rows(data), "data.path"
    else:
        rows = arithmetic_rows(seed=seed)
        wheres = [f"built-in task row {n + 1}" for n in range(len(rows))]
    hf = getattr(tokenizer, "hf", None)
    templated = hf is not None and getattr(hf, "chat_template", None)
    texts, ids = [], []
    for row, where in zip(rows, wheres):
        chat = _chat(row, where, key)
        texts.append(str(chat[-1]["content"]))
        if templated:
            text = hf.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
            ids.append(list(hf(text, add_special_tokens=False)["input_ids"]))
        else:
            ids.append(tokenizer.encode(texts[-1]))
        if len(ids[-1]) > longest:
            raise ConfigError(f"{key}: {where} has {len(ids[-1])} tokens, more than training.seq_len - "
                              f"rl.max_new_tokens = {longest}; raise training.seq_len, lower rl.max_new_tokens "
                              "or shorten the prompt")
        if not ids[-1]:
            raise ConfigError(f"{key}: {where} is empty; a prompt needs one token at least")
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
