"""Token streams: documents encoded back to back, in memory or as a token folder on disk.

A token folder is a corpus tokenized once (`python -m titanlite.tools.tokenize`):

  tokens-00000.bin, ...  the token stream, shard after shard, little-endian uint16 when every id
                         fits (vocab <= 65536), else uint32
  doc_starts.bin         int64: where each document starts in the whole stream
  index.json             format and version, dtype, vocab size, tokenizer and its fingerprint,
                         token and document counts, each shard's token count, the source; written
                         last and atomically, so a folder without it is an unfinished one

Opening one reads the index and maps doc_starts (np.memmap); samples are read by offset, so
a rank's memory and start-up do not depend on the corpus size.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from titanlite.data.sources import TOKEN_INDEX
from titanlite.data.tokenizer import Tokenizer
from titanlite.errors import ConfigError

FORMAT, VERSION = "titanlite-tokens", 1
DOC_STARTS = "doc_starts.bin"
_FINGERPRINT_TEXT = "Fingerprint: héllo wörld ✓ 123 <s></s>\n\tdef f(x): return x ** 2  # 数据"


@dataclass(frozen=True)
class TokenStream:
    tokens: np.ndarray | TokenShards  # all documents back to back
    doc_starts: np.ndarray  # int64 offset of each document (kept for document masking)


class TokenShards:
    """A token folder's shards read as one array: len(), slicing (a view that reads nothing)
    and np.asarray (reads the view's tokens). Reads are pread calls, not a memory map, so the
    page cache they go through never counts in the process's resident memory however much of
    the corpus training has touched."""

    def __init__(self, paths: list[str], counts: list[int], dtype: np.dtype, start: int = 0,
                 stop: int | None = None) -> None:
        self.paths, self.counts, self.dtype = paths, counts, dtype
        self.ends = np.cumsum(counts)
        self.start, self.stop = start, int(self.ends[-1]) if stop is None else stop

    def __len__(self) -> int:
        return self.stop - self.start

    def __getitem__(self, key: slice) -> TokenShards:
        start, stop, step = key.indices(len(self))
        if step != 1:
            raise IndexError("TokenShards takes contiguous slices only")
        return TokenShards(self.paths, self.counts, self.dtype, self.start + start,
                           self.start + max(start, stop))

    def __array__(self, dtype: np.dtype | None = None, copy: bool | None = None) -> np.ndarray:
        pieces, size = [], self.dtype.itemsize
        for k in range(int(np.searchsorted(self.ends, self.start, side="right")), len(self.paths)):
            base = int(self.ends[k]) - self.counts[k]
            if base >= self.stop:
                break
            lo, hi = max(self.start - base, 0), min(self.stop - base, self.counts[k])
            pieces.append(np.frombuffer(os.pread(_fd(self.paths[k]), (hi - lo) * size, lo * size), self.dtype))
        out = np.concatenate(pieces) if pieces else np.empty(0, self.dtype)
        return out.astype(dtype or self.dtype)


@functools.lru_cache(maxsize=None)
def _fd(path: str) -> int:
    """One descriptor per shard for the process's life; pread keeps no offset, so forked
    loader workers share it safely."""
    return os.open(path, os.O_RDONLY)


def encode_documents(texts: list[str], tokenizer: Tokenizer) -> tuple[np.ndarray, np.ndarray]:
    """Non-empty texts as [BOS] + tokens + [EOS] each, back to back (uint32), and each
    document's length. The in-memory stream and token folders share it, so both are equal."""
    encode_batch = getattr(tokenizer, "encode_batch", None)
    docs = encode_batch(texts) if encode_batch else [np.asarray(tokenizer.encode(t)) for t in texts]
    tail = np.array([tokenizer.eos_id], dtype=np.uint32)
    # Without a distinct BOS, EOS alone separates documents (no doubled separator).
    head = np.array([tokenizer.bos_id] if tokenizer.bos_id != tokenizer.eos_id else [], dtype=np.uint32)
    parts = [a for d in docs for a in (head, d, tail)]
    tokens = np.concatenate(parts, dtype=np.uint32, casting="unsafe") if parts else np.empty(0, np.uint32)
    return tokens, np.array([len(d) + len(head) + 1 for d in docs], dtype=np.int64)


def tokenizer_fingerprint(tokenizer: Tokenizer) -> str:
    """Changes when the ids a text gets can change: special ids, vocabulary and rules (the
    whole tokenizer.json of a fast HF tokenizer) and the ids of a fixed sample text."""
    h = hashlib.sha256(json.dumps([type(tokenizer).__name__, tokenizer.vocab_size, tokenizer.bos_id,
                                   tokenizer.eos_id]).encode())
    hf = getattr(tokenizer, "hf", None)
    if hf is not None:
        backend = getattr(hf, "backend_tokenizer", None)
        h.update((backend.to_str() if backend is not None else json.dumps(sorted(hf.get_vocab().items()))).encode())
    h.update(json.dumps([int(i) for i in tokenizer.encode(_FINGERPRINT_TEXT)]).encode())
    return h.hexdigest()[:16]


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


class TokenFolderWriter:
    """Appends encoded documents to a new token folder; `finish` makes it visible."""

    def __init__(self, folder: Path, tokenizer: Tokenizer, tokenizer_name: str, shard_tokens: int) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        if any(folder.iterdir()):
            raise ConfigError(f"--out: '{folder}' is not empty; name a new folder")
        self.folder, self.tokenizer, self.tokenizer_name = folder, tokenizer, tokenizer_name
        self.dtype, self.shard_tokens = token_dtype(tokenizer.vocab_size), shard_tokens
        self.shards: list[int] = []  # tokens per shard
        self.num_tokens = self.num_docs = 0
        self.starts = open(folder / DOC_STARTS, "wb")

    def write(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        if not len(lengths):
            return
        if not self.shards or self.shards[-1] >= self.shard_tokens:
            self.shards.append(0)
        with open(self.folder / f"tokens-{len(self.shards) - 1:05d}.bin", "ab") as f:
            f.write(tokens.astype(self.dtype.newbyteorder("<")).tobytes())
        starts = self.num_tokens + np.concatenate([[0], np.cumsum(lengths)[:-1]])
        self.starts.write(starts.astype("<i8").tobytes())
        self.shards[-1] += len(tokens)
        self.num_tokens += len(tokens)
        self.num_docs += len(lengths)

    def finish(self, source: dict) -> None:
        self.starts.close()
        if not self.num_docs:
            raise ConfigError(f"data.path: no documents with text in {source['path'] or 'the embedded source'}")
        index = {"format": FORMAT, "version": VERSION, "dtype": self.dtype.name,
                 "vocab_size": self.tokenizer.vocab_size, "tokenizer": self.tokenizer_name,
                 "tokenizer_fingerprint": tokenizer_fingerprint(self.tokenizer),
                 "num_tokens": self.num_tokens, "num_documents": self.num_docs,
                 "shards": [{"file": f"tokens-{k:05d}.bin", "tokens": n} for k, n in enumerate(self.shards)],
                 "source": source}
        tmp = self.folder / (TOKEN_INDEX + ".tmp")
        tmp.write_text(json.dumps(index, indent=1))
        os.replace(tmp, self.folder / TOKEN_INDEX)


def read_index(path: str) -> dict:
    """A token folder's index, after checking that every file is there at its full size."""
    folder = Path(path)
    if not (folder / TOKEN_INDEX).is_file():
        raise ConfigError(f"data.path: '{path}' is an unfinished token folder (no {TOKEN_INDEX}); "
                          f"run python -m titanlite.tools.tokenize again with --out to a new folder")
    try:
        index = json.loads((folder / TOKEN_INDEX).read_text())
        ok = index["format"] == FORMAT
    except (ValueError, KeyError, TypeError):
        ok = False
    if not ok or index.get("version") != VERSION:
        raise ConfigError(f"data.path: {folder / TOKEN_INDEX} is not a {FORMAT} v{VERSION} index; "
                          "tokenize the source again with python -m titanlite.tools.tokenize")
    itemsize = np.dtype(index["dtype"]).itemsize
    files = [(s["file"], s["tokens"] * itemsize) for s in index["shards"]]
    for name, size in files + [(DOC_STARTS, index["num_documents"] * 8)]:
        have = (folder / name).stat().st_size if (folder / name).is_file() else None
        if have != size:
            raise ConfigError(f"data.path: {folder / name} holds {have} bytes, not the {size} that "
                              f"{TOKEN_INDEX} says; the folder is damaged, tokenize the source again")
    return index


def open_token_folder(path: str, tokenizer: Tokenizer) -> TokenStream:
    """The folder's stream, memory-mapped; refused if this run's tokenizer is not the folder's."""
    index, folder = read_index(path), Path(path)
    if index["tokenizer_fingerprint"] != tokenizer_fingerprint(tokenizer):
        raise ConfigError(f"data.path: '{path}' was tokenized with data.tokenizer '{index['tokenizer']}', "
                          "which is not this run's tokenizer; set data.tokenizer to that one or "
                          "tokenize the source again with this one")
    shards = [s for s in index["shards"] if s["tokens"]]
    tokens = TokenShards([str(folder / s["file"]) for s in shards], [s["tokens"] for s in shards],
                         np.dtype(index["dtype"]).newbyteorder("<"))
    # binary searches touch a few of its pages per sample
    doc_starts = np.memmap(folder / DOC_STARTS, dtype="<i8", mode="r")
    return TokenStream(tokens, doc_starts)
