"""Data pipeline: corpus -> one token stream -> fixed-length samples in a layout-independent order.

The stream is the documents in a fixed order, each written as [BOS] + tokens + [EOS]. Sample
i is stream[i*L : i*L + L + 1]. Global sample index g lives in epoch g // N at position
g % N (permuted per epoch when shuffling). Global batch b holds global samples
[b*G, (b+1)*G); dp rank r takes rows [r*G/D, (r+1)*G/D) in micro-batches. The order of
global batches thus depends only on the data config, never on the world size, and the
only loader state is a global cursor.
"""

from __future__ import annotations

import functools
import json
import os
import sysconfig
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset
from torchdata.stateful_dataloader import StatefulDataLoader

from titanlite.config import ConfigError, Data
from titanlite.tokenizer import Tokenizer

STDLIB_MAX_CHARS = 16_000_000  # keeps start-up around a second with the byte tokenizer
_STDLIB_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


@dataclass(frozen=True)
class TokenStream:
    tokens: np.ndarray  # uint32, all documents back to back
    doc_starts: np.ndarray  # int64 offset of each document (kept for document masking)


def _stdlib_documents() -> list[str]:
    """The running interpreter's own standard-library sources, minus tests and packages."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in _STDLIB_SKIP_DIRS]
        files += [Path(folder, n) for n in names if n.endswith(".py")]
    files.sort(key=lambda p: p.relative_to(root).as_posix())
    docs, total = [], 0
    for f in files:
        if total >= STDLIB_MAX_CHARS:
            break
        docs.append(f.read_text(encoding="utf-8", errors="replace"))
        total += len(docs[-1])
    return docs


def _jsonl_documents(path: Path, field: str) -> list[str]:
    docs = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"data.path: {path} line {lineno}: invalid JSON ({e})") from None
            if not isinstance(record, dict) or not isinstance(record.get(field), str):
                raise ConfigError(f"data.path: {path} line {lineno}: no text field '{field}'; "
                                  "set data.text_field to the field holding the text")
            docs.append(record[field])
    return docs


def _file_documents(path: Path, field: str) -> list[str]:
    if path.suffix == ".jsonl":
        return _jsonl_documents(path, field)
    return [path.read_text(encoding="utf-8", errors="replace")]


def _read_documents(path: str, field: str) -> list[str]:
    if not path:
        return _stdlib_documents()
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"data.path: '{path}' does not exist")
    if p.is_dir():
        files = sorted((f for f in p.rglob("*") if f.suffix in (".txt", ".jsonl") and f.is_file()),
                       key=lambda f: f.relative_to(p).as_posix())
    elif p.suffix in (".txt", ".jsonl"):
        files = [p]
    else:
        raise ConfigError(f"data.path: '{path}' must be a .txt or .jsonl file or a folder of them")
    return [doc for f in files for doc in _file_documents(f, field)]


def _source_name(path: str) -> str:
    return f"'{path}'" if path else f"the Python standard library ({sysconfig.get_paths()['stdlib']})"


@functools.lru_cache(maxsize=1)  # the train and val loaders share one tokenization pass
def token_stream(path: str, field: str, tokenizer: Tokenizer) -> TokenStream:
    """The whole corpus as one read-only token stream (both splits)."""
    texts = [t for t in _read_documents(path, field) if t]
    if not texts:
        raise ConfigError(f"data.path: no documents with text in {_source_name(path)}")
    encode_batch = getattr(tokenizer, "encode_batch", None)
    docs = encode_batch(texts) if encode_batch else [np.asarray(tokenizer.encode(t)) for t in texts]
    tail = np.array([tokenizer.eos_id], dtype=np.uint32)
    # Without a distinct BOS, EOS alone separates documents (no doubled separator).
    head = np.array([tokenizer.bos_id] if tokenizer.bos_id != tokenizer.eos_id else [], dtype=np.uint32)
    parts = [a for d in docs for a in (head, d, tail)]
    tokens = np.concatenate(parts, dtype=np.uint32, casting="unsafe")
    lengths = np.array([len(d) + len(head) + 1 for d in docs], dtype=np.int64)
    doc_starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    tokens.flags.writeable = doc_starts.flags.writeable = False  # shared through the cache
    return TokenStream(tokens, doc_starts)


def split_stream(stream: TokenStream, holdout_fraction: float, split: str) -> TokenStream:
    """Train is the head of the stream, val the last `holdout_fraction` of it. The cut snaps
    to the nearest document start unless that moves it by more than half the holdout."""
    n = len(stream.tokens)
    target = n - round(holdout_fraction * n)
    i = int(np.abs(stream.doc_starts - target).argmin())
    nearest = int(stream.doc_starts[i])
    cut = nearest if 0 < nearest and abs(nearest - target) <= (n - target) / 2 else target
    if split == "train":
        return TokenStream(stream.tokens[:cut], stream.doc_starts[stream.doc_starts < cut])
    if split != "val":
        raise ValueError(f"split must be 'train' or 'val', got '{split}'")
    starts = stream.doc_starts[stream.doc_starts >= cut] - cut
    if len(starts) == 0 or starts[0] != 0:
        starts = np.concatenate([[0], starts])  # the tail begins mid-document
    return TokenStream(stream.tokens[cut:], starts)


class TokenSamples(Dataset):
    """Map-style: item g is global sample g (any epoch), sliced straight out of the stream."""

    def __init__(self, stream: TokenStream, seq_len: int, shuffle: bool, seed: int) -> None:
        self.stream, self.seq_len, self.shuffle, self.seed = stream, seq_len, shuffle, seed
        self.num_samples = max(0, len(stream.tokens) - 1) // seq_len
        self._perm: tuple[int, np.ndarray] | None = None

    def position(self, g: int) -> int:
        """Position in the stream (in samples) of global sample g."""
        epoch, pos = divmod(g, self.num_samples)
        if not self.shuffle:
            return pos
        if self._perm is None or self._perm[0] != epoch:
            self._perm = (epoch, np.random.default_rng([self.seed, epoch]).permutation(self.num_samples))
        return int(self._perm[1][pos])

    def __getitem__(self, g: int) -> dict[str, torch.Tensor]:
        start = self.position(g) * self.seq_len
        s = torch.from_numpy(self.stream.tokens[start:start + self.seq_len + 1].astype(np.int64))
        return {"input_ids": s[:-1], "labels": s[1:]}


class GlobalBatchSampler:
    """Infinite iterator of this rank's micro-batches (lists of global sample indices).

    Its state is a global cursor (next global batch, next micro-batch within this rank's
    share), which StatefulDataLoader saves and restores, with or without workers. At a step
    boundary (micro_batch == 0) the state means the same for any dp layout.
    """

    def __init__(self, global_batch_size: int, local_batch_size: int, dp_rank: int, dp_degree: int) -> None:
        self.global_batch_size, self.local_batch_size = global_batch_size, local_batch_size
        self.row0 = dp_rank * (global_batch_size // dp_degree)
        self.accum = global_batch_size // (local_batch_size * dp_degree)
        self.global_batch, self.micro_batch = 0, 0

    def __iter__(self) -> GlobalBatchSampler:
        return self

    def __next__(self) -> list[int]:
        first = (self.global_batch * self.global_batch_size + self.row0
                 + self.micro_batch * self.local_batch_size)
        self.micro_batch += 1
        if self.micro_batch == self.accum:
            self.global_batch, self.micro_batch = self.global_batch + 1, 0
        return list(range(first, first + self.local_batch_size))

    def state_dict(self) -> dict[str, int]:
        return {"global_batch": self.global_batch, "micro_batch": self.micro_batch}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if not 0 <= state["micro_batch"] < self.accum:
            raise ValueError(f"data loader state has micro_batch {state['micro_batch']}, but this "
                             f"layout takes {self.accum} micro-batches per step")
        self.global_batch, self.micro_batch = state["global_batch"], state["micro_batch"]


def build_dataloader(cfg: Data, tokenizer: Tokenizer, *, seq_len: int, global_batch_size: int,
                     local_batch_size: int, dp_rank: int, dp_degree: int, split: str = "train"
                     ) -> StatefulDataLoader:
    """Infinite loader of this dp rank's micro-batches: {"input_ids", "labels"}, each a
    LongTensor [local_batch_size, seq_len]. The trainer takes
    global_batch_size // (local_batch_size * dp_degree) of them per optimizer step."""
    G, L, D = global_batch_size, local_batch_size, dp_degree
    if G < 1 or L < 1 or D < 1 or G % (L * D):
        raise ConfigError(f"training.global_batch_size ({G}) must be divisible by "
                          f"local_batch_size ({L}) x dp degree ({D})")
    if not 0 <= dp_rank < D:
        raise ValueError(f"dp_rank {dp_rank} out of range for dp degree {D}")
    if cfg.shuffle and cfg.seed < 0:
        raise ConfigError(f"data.seed must be >= 0 to shuffle, got {cfg.seed}")
    if split == "val" and cfg.holdout_fraction == 0:
        raise ConfigError("data.holdout_fraction is 0, so there is no validation split")
    stream = split_stream(token_stream(cfg.path, cfg.text_field, tokenizer), cfg.holdout_fraction, split)
    dataset = TokenSamples(stream, seq_len, cfg.shuffle, cfg.seed)
    if dataset.num_samples < G:
        raise ConfigError(f"data: only {dataset.num_samples} samples of seq_len {seq_len} in the "
                          f"{split} split of {_source_name(cfg.path)}; need at least "
                          f"global_batch_size {G} (use more data, a shorter seq_len or a "
                          "smaller batch)")
    with warnings.catch_warnings():
        # torchdata 0.11 calls an API that newer torch deprecates; nothing a user can act on.
        warnings.filterwarnings("ignore", message="'set_vital' is deprecated")
        # Its own generator: iter() would otherwise draw worker seeds from the global RNG,
        # which a resumed run (one more iter() call) could then not reproduce bitwise.
        return StatefulDataLoader(dataset, batch_sampler=GlobalBatchSampler(G, L, dp_rank, D),
                                  num_workers=cfg.num_workers, pin_memory=torch.cuda.is_available(),
                                  generator=torch.Generator().manual_seed(max(cfg.seed, 0)))
