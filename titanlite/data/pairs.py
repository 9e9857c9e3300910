"""Preference pairs (data.format preference): rows of `prompt`, `chosen` and `rejected` messages
(TRL's conversational form), rendered with the tokenizer's chat template, packed into samples with
both responses of a pair in the same sample.

A response is prompt + chosen (or + rejected) rendered whole; its targets are the tokens after the
prompt rendered with the generation prompt, as TRL's completion is: the prompt's tokens are never
targets. Each response is a document of its own (data.document_mask), so a packed sample computes
what each response would alone; whole pairs are packed best fit decreasing, several per sample.

A preference sample's labels are [seq_len, LABEL_CHANNELS], not [seq_len]: the loss
(titanlite.preference) sees only logits and labels, and a pipeline stage or a context-parallel shard
gets a sample's labels split as its tokens are, so what the pair loss needs per position travels in
them: TOKEN (the label, IGNORE_INDEX outside responses), RESPONSE (2 p for the chosen response of
the sample's pair p, 2 p + 1 for its rejected, -1 outside responses), PAIR (1 at the first target of
each chosen response: the sum over a step's labels is its pair count, whatever the split),
REFERENCE (the reference model's log-prob of the label, float32 bits, filled by the step) and SFT
(with preference.sft_weight, at each chosen response's targets: the step's pair count over its
chosen target count, float32 bits, filled by the step: the SFT term's weight, whatever the split).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterator

import numpy as np
import torch

from titanlite.config.data import Data
from titanlite.data.chat import Chat, check_messages, check_template
from titanlite.data.chat_set import stdlib_chats
from titanlite.data.order import SampleOrder
from titanlite.data.packing import IGNORE_INDEX, ChatSamples, pack, split_chats
from titanlite.data.sources import iter_records, source_name
from titanlite.data.tokenizer import Tokenizer
from titanlite.errors import ConfigError

TOKEN, RESPONSE, PAIR, REFERENCE, SFT = range(5)
LABEL_CHANNELS = 5
FIELDS = ("prompt", "chosen", "rejected")
Pair = tuple[Chat, Chat]


def target_count(labels: torch.Tensor) -> torch.Tensor:
    """What a step divides its loss sum by: the target tokens of token labels [B, S], the pairs of
    preference labels [B, S, LABEL_CHANNELS]."""
    return labels[..., PAIR].sum() if labels.ndim == 3 else (labels != IGNORE_INDEX).sum()


def _messages(value: object, where: str, field: str) -> list[dict]:
    """A response may be one message or a list of them (TRL accepts both)."""
    return check_messages([value] if isinstance(value, dict) else value, where, field)


def name_words(text: str) -> set[str]:
    """The words of three or more letters or digits of a text, lowercased, a CamelCase name split:
    what an answer must repeat of a question's function name to fit it (builtin_pairs)."""
    return {w for w in re.split(r"[^a-z0-9]+", re.sub(r"([a-z])([A-Z])", r"\1 \2", text).lower()) if len(w) > 2}


GUI_MODULES = ("tkinter", "idlelib", "turtle", "turtledemo")
"""The built-in preference set's rejected answers come from these modules' functions (of the same split)."""


def builtin_pairs(holdout_fraction: float, split: str) -> list[tuple[str, dict]]:
    """The built-in preference set's `split` (split_chats of the built-in chat set): each chat of a
    function outside GUI_MODULES whose first answer repeats a word of its qualified name becomes a
    pair whose prompt is its first question, chosen that answer, and rejected the first answer of a
    GUI_MODULES function of the split (starting at the same relative place) that repeats no word of
    the name and is within 10% of its length. A rejected answer is so both another function's and
    of another kind (widgets, windows, canvases), a preference a small model learns in 100 steps and
    that carries to held-out pairs, whose rejected answers it never saw; paired among all answers,
    each one the chosen of its pair and the rejected of another, what an answer is like cancels out
    and only its fit to the question is left to learn, which the 3.2M debug model did not (held-out
    accuracy at chance: docs/post_training.md). The lengths match because a reward is a sum over
    tokens: where DPO lowers both responses, a longer chosen one would read as a wrong preference.
    Paired within a split: held-out pairs share no answer with training pairs."""
    chats = split_chats(tuple(stdlib_chats()), holdout_fraction, split)
    answers = [next(m for m in chat if m["role"] == "assistant") for _, chat in chats]
    names = [where.rsplit(", ", 1)[1] for where, _ in chats]  # stdlib_chats' "the built-in chat set, <qualname>"
    gui = [name.split(".")[0] in GUI_MODULES for name in names]
    pool = [k for k in range(len(chats)) if gui[k]]
    out = []
    for k, (where, chat) in enumerate(chats):
        if gui[k]:
            continue
        first = chat.index(answers[k])
        words = name_words(names[k])
        if not words & name_words(answers[k]["content"]):
            continue
        size = len(answers[k]["content"])
        start = k * len(pool) // len(chats)
        others = (answers[pool[(start + i) % len(pool)]] for i in range(len(pool)))
        wrong = next((a for a in others if abs(len(a["content"]) - size) <= size // 10
                      and not words & name_words(a["content"])), None)
        if wrong is None:
            continue
        out.append((where.replace("chat set", "preference set"),
                    {"prompt": chat[:first], "chosen": [chat[first]], "rejected": [wrong]}))
    return out


def _rows(path: str, split: str) -> Iterator[tuple[str, dict]]:
    """(where, {prompt, chosen, rejected}) of every row, read one column at a time."""
    columns = [iter_records(path, f, split, f"data.format preference's '{f}' column") for f in FIELDS]
    for cells in zip(*columns):
        yield cells[0][0], dict(zip(FIELDS, (v for _, v in cells)))


def _render(hf, row: dict, where: str) -> Pair:
    for f in ("chosen", "rejected"):
        if row.get(f) is None:
            raise ConfigError(f"data.path: {where}: no '{f}'; a preference row needs prompt, chosen and rejected "
                              "messages: fill it in or drop the row")
    prompt = check_messages(row.get("prompt"), where, "prompt")
    chosen, rejected = _messages(row["chosen"], where, "chosen"), _messages(row["rejected"], where, "rejected")
    if chosen == rejected:
        raise ConfigError(f"data.path: {where}: chosen equals rejected, so the pair prefers nothing; fix or drop "
                          "the row")
    before = hf.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    out = []
    for response in (chosen, rejected):
        text = hf.apply_chat_template(prompt + response, tokenize=False)
        if not text.startswith(before):
            raise ConfigError(f"data.path: {where}: the chat template renders the prompt differently once a "
                              "response follows, so the response's tokens cannot be told apart; use a template "
                              "that renders each turn the same whatever follows")
        enc = hf(text, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
        flags = np.array([end > len(before) for _, end in enc["offset_mapping"]], dtype=bool)
        if not flags[1:].any():
            raise ConfigError(f"data.path: {where}: a response renders to no token after the prompt; fill it in "
                              "or drop the row")
        out.append((np.asarray(enc["input_ids"], dtype=np.uint32), flags))
    return out[0], out[1]


@functools.lru_cache(maxsize=8)  # the train and val loaders share one rendering pass
def read_pairs(path: str, split: str, tokenizer: Tokenizer, name: str, builtin: tuple[float, str] = (0.0, "train")
               ) -> tuple[Pair, ...]:
    """Every pair of a source (for an empty path, the built-in set's split `builtin`: holdout
    fraction, train or val), checked and rendered."""
    check_template(tokenizer, name)
    rows = builtin_pairs(*builtin) if not path else _rows(path, split)
    pairs = tuple(_render(tokenizer.hf, row, where) for where, row in rows)
    if not pairs:
        raise ConfigError(f"data.path: no preference pairs in {source_name(path)}")
    return pairs


class PairSamples(ChatSamples):
    """Map-style: item g is global sample g, whole pairs packed: {"input_ids", "document_ids",
    "positions"} [seq_len] and "labels" [seq_len, LABEL_CHANNELS]. A ChatSamples for the notes and
    counts (a pair that does not fit in one sample is dropped and counted)."""

    def __init__(self, pairs: tuple[Pair, ...], seq_len: int, pad_id: int, shuffle: bool, seed: int,
                 source: tuple[int, ...] = ()) -> None:
        kept, self.truncated, self.dropped = [], 0, 0
        for pair in pairs:
            prompt = int(np.argmax(pair[0][1]))  # the tokens before the first target
            if prompt >= seq_len:
                raise ConfigError(f"training.seq_len {seq_len}: a pair's prompt alone is {prompt} tokens, so "
                                  "neither response fits; raise training.seq_len or drop long prompts")
            if sum(len(ids) - 1 for ids, _ in pair) > seq_len:
                self.dropped += 1
                continue
            kept.append(pair)
        if not kept:
            raise ConfigError(f"training.seq_len {seq_len}: no pair fits in one sample (both responses together); "
                              "raise training.seq_len")
        self.seq_len, self.pad_id, self.pairs = seq_len, pad_id, kept
        self.reference: torch.Tensor | None = None
        """preference.reference = precomputed: each kept pair's reference log-prob sums [pairs, 2],
        written into the REFERENCE channel at each response's first target (titanlite.preference)."""
        self.chats = [c for pair in kept for c in pair]  # pair k's responses: chats 2 k and 2 k + 1
        self.rows = [[2 * k + r for k in row for r in (0, 1)]
                     for row in pack([sum(len(ids) - 1 for ids, _ in pair) for pair in kept], seq_len)]
        SampleOrder.__init__(self, len(self.rows), shuffle, seed, source)
        positions = sum(len(ids) - 1 for ids, _ in self.chats)
        self.filled = positions / max(1, len(self.rows) * seq_len)
        self.supervised = sum(int(t[1:].sum()) for _, t in self.chats) / max(1, positions)

    def __getitem__(self, g: int) -> dict[str, torch.Tensor]:
        # ChatSamples's sample of the row's responses (pair p's: documents 2 p and 2 p + 1), its labels
        # given their channels; never a row of a sequence-length warm-up (refused before launch)
        x = super().__getitem__(g)
        tokens = x["labels"]
        response = torch.where(tokens != IGNORE_INDEX, x["document_ids"], -1)
        # a response's targets are its last tokens, in one run: a chosen one's first starts a run
        first = (response >= 0) & (response % 2 == 0) & (response != response.roll(1))
        zero = torch.zeros_like(tokens)
        x["labels"] = torch.stack([tokens, response, first.long(), zero, zero], -1)
        if self.reference is not None:  # a response's sum at its first target: the loss sums the channel
            starts = (response >= 0) & (response != response.roll(1))
            ids = torch.tensor(self.pair_ids(g), dtype=torch.long)[response[starts] // 2]
            x["labels"][starts, REFERENCE] = self.reference[ids, response[starts] % 2].view(torch.int32).long()
        return x

    def pair_ids(self, g: int) -> list[int]:
        """The kept pairs global sample g holds, in their order there."""
        return [c // 2 for c in self.rows[self.position(g)][::2]]

    def note(self) -> str:
        return (f"{len(self.pairs):,} preference pairs in {self.num_samples:,} samples of {self.seq_len} tokens "
                f"({self.filled:.1%} filled, {self.supervised:.1%} of the positions are response targets); "
                f"{self.dropped} pairs longer than one sample dropped")


def pair_samples(cfg: Data, tokenizer: Tokenizer, seq_len: int, split: str, source: tuple[int, ...] = ()
                 ) -> PairSamples:
    """The packed samples of one split of a preference source (data.holdout_fraction: the last pairs)."""
    if cfg.path:
        pairs = split_chats(read_pairs(cfg.path, cfg.split, tokenizer, cfg.tokenizer), cfg.holdout_fraction, split)
    else:  # split before pairing (builtin_pairs)
        pairs = read_pairs("", cfg.split, tokenizer, cfg.tokenizer, (cfg.holdout_fraction, split))
    pad = tokenizer.pad_id if tokenizer.pad_id is not None else tokenizer.eos_id
    return PairSamples(pairs, seq_len, pad, cfg.shuffle, cfg.seed, source)
