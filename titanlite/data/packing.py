"""Chat samples: whole chats packed into samples of seq_len positions, each chat a document of its own.

A chat of n tokens takes n - 1 positions: its tokens but the last as inputs, its tokens but the
first as labels, a label IGNORE_INDEX where that token is no target (titanlite.data.chat). So no
label ever crosses from one chat into the next, and with data.document_mask each chat attends only
to itself from position 0: a packed sample computes what its chats would alone. The rest of a
sample is padding (pad id in, IGNORE_INDEX out, a document of its own).

The chats of a split are packed once, best fit decreasing (longest first, each into the sample
with the least room that holds it), and the packed samples are the data set: global sample g is
sample `position(g)` in the shared sample order (titanlite.data.order), so the order does not
depend on the layout and resuming needs only the sampler's cursor. A chat longer than
seq_len + 1 tokens is cut to its first seq_len + 1 (data.overlong truncate; dropped if that leaves
no target) or dropped (drop); the counts are logged with every step's metrics.
"""

from __future__ import annotations

import bisect
import functools

import numpy as np
import torch

from titanlite.config.data import Data
from titanlite.data.chat import Chat, render_chats
from titanlite.data.chat_set import stdlib_chats
from titanlite.data.order import SampleOrder, row_of
from titanlite.data.sources import iter_records, source_name
from titanlite.data.tokenizer import Tokenizer
from titanlite.errors import ConfigError

IGNORE_INDEX = -100  # titanlite.loss's: a label the loss skips (data imports nothing above config)


@functools.lru_cache(maxsize=8)  # the train and val loaders share one rendering pass
def read_chats(path: str, field: str, split: str, tokenizer: Tokenizer, name: str, train_on: str
               ) -> tuple[Chat, ...]:
    """Every chat of a source (the built-in set for an empty path), rendered and flagged."""
    rows = iter(stdlib_chats()) if not path else iter_records(path, field, split, "data.messages_field")
    chats = tuple(render_chats(tokenizer, name, rows, field, train_on))
    if not chats:
        raise ConfigError(f"data.path: no chats in {source_name(path)}")
    return chats


def split_chats(chats: tuple[Chat, ...], holdout_fraction: float, split: str) -> tuple[Chat, ...]:
    """Train is the head of the chats, val the last `holdout_fraction` of them."""
    cut = len(chats) - round(holdout_fraction * len(chats))
    return chats[:cut] if split == "train" else chats[cut:]


def pack(lengths: list[int], room: int) -> list[list[int]]:
    """Best fit decreasing: the indices of the items of each bin of size `room`, in index order."""
    bins: list[list[int]] = []
    by_room: dict[int, list[int]] = {}  # room left -> bins with that much, last opened last
    rooms: list[int] = []  # the keys of by_room, sorted
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        k = bisect.bisect_left(rooms, lengths[i])
        if k < len(rooms):
            left = rooms[k]
            b = by_room[left].pop()
            if not by_room[left]:
                del by_room[left], rooms[k]
        else:
            b, left = len(bins), room
            bins.append([])
        bins[b].append(i)
        left -= lengths[i]
        if left not in by_room:
            bisect.insort(rooms, left)
            by_room[left] = []
        by_room[left].append(b)
    return [sorted(b) for b in bins]


class ChatSamples(SampleOrder):
    """Map-style: item g is global sample g, a packed sample of whole chats:
    {"input_ids", "labels", "document_ids", "positions"}, each a LongTensor [seq_len]."""

    def __init__(self, chats: tuple[Chat, ...], seq_len: int, overlong: str, pad_id: int, shuffle: bool,
                 seed: int, source: tuple[int, ...] = ()) -> None:
        kept, self.truncated, self.dropped = [], 0, 0
        for ids, targets in chats:
            if len(ids) > seq_len + 1:
                if overlong == "drop" or not targets[1:seq_len + 1].any():
                    self.dropped += 1
                    continue
                ids, targets = ids[:seq_len + 1], targets[:seq_len + 1]
                self.truncated += 1
            kept.append((ids, targets))
        self.seq_len, self.pad_id, self.chats = seq_len, pad_id, kept
        self.rows = pack([len(ids) - 1 for ids, _ in kept], seq_len)
        super().__init__(len(self.rows), shuffle, seed, source)
        positions = sum(len(ids) - 1 for ids, _ in kept)
        self.filled = positions / max(1, len(self.rows) * seq_len)
        self.supervised = sum(int(t[1:].sum()) for _, t in kept) / max(1, positions)

    def __getitem__(self, g: int | tuple[int, int, int]) -> dict[str, torch.Tensor]:
        if isinstance(g, tuple):  # (g, length, k): a row of a sequence-length warm-up
            return row_of(self[g[0]], *g[1:])
        L = self.seq_len
        ids, labels = np.full(L, self.pad_id, dtype=np.int64), np.full(L, IGNORE_INDEX, dtype=np.int64)
        docs, positions, at = np.zeros(L, dtype=np.int64), np.zeros(L, dtype=np.int64), 0
        for doc, c in enumerate(self.rows[self.position(g)]):
            chat, targets = self.chats[c]
            chat, n = chat.astype(np.int64), len(chat) - 1
            ids[at:at + n] = chat[:-1]
            labels[at:at + n] = np.where(targets[1:], chat[1:], IGNORE_INDEX)
            docs[at:at + n], positions[at:at + n] = doc, np.arange(n)
            at += n
        docs[at:] = docs[at - 1] + 1  # the padding: a document of its own
        positions[at:] = np.arange(L - at)
        return {k: torch.from_numpy(v) for k, v in
                (("input_ids", ids), ("labels", labels), ("document_ids", docs), ("positions", positions))}

    def note(self) -> str:
        over = self.truncated + self.dropped
        return (f"{len(self.chats):,} chats in {self.num_samples:,} samples of {self.seq_len} tokens "
                f"({self.filled:.1%} filled, {self.supervised:.1%} of the chats' positions trained on); {over} "
                f"longer than seq_len + 1 tokens: {self.truncated} truncated, {self.dropped} dropped (data.overlong)")


def chat_samples(cfg: Data, tokenizer: Tokenizer, seq_len: int, split: str, source: tuple[int, ...] = ()
                 ) -> ChatSamples:
    """The packed samples of one split of a chat source."""
    chats = read_chats(cfg.path, cfg.messages_field, cfg.split, tokenizer, cfg.tokenizer, cfg.train_on)
    chats = split_chats(chats, cfg.holdout_fraction, split)
    pad = tokenizer.pad_id if tokenizer.pad_id is not None else tokenizer.eos_id
    return ChatSamples(chats, seq_len, cfg.overlong, pad, cfg.shuffle, cfg.seed, source)


def _chat_parts(dataset: object) -> list[ChatSamples]:
    return [p for p in getattr(dataset, "parts", [dataset]) if isinstance(p, ChatSamples)]


def data_counts(dataset: object) -> dict[str, int]:
    """What a step's metrics report about its data set: the chats that were longer than a sample,
    truncated or dropped (summed over a mixture's sources); nothing for text."""
    chats = _chat_parts(dataset)
    if not chats:
        return {}
    return {"chats_truncated": sum(p.truncated for p in chats), "chats_dropped": sum(p.dropped for p in chats)}


def data_notes(dataset: object) -> list[str]:
    """The start-up line of each chat source: chats, samples, how full, how much is trained on."""
    return [f"titanlite: chat data: {p.note()}" for p in _chat_parts(dataset)]
