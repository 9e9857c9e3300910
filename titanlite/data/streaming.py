"""Streamed sources: documents are read, tokenized and packed on the fly, never held whole.

The token stream is every epoch's documents back to back ([BOS] + tokens + [EOS] each,
epochs reshuffled within a buffer by (seed, epoch) when data.shuffle is on), and global
sample g is stream[g*L : g*L + L + 1], the same packing as the map-style loader but without
epoch boundaries. Every dp rank (and every worker) reads the whole stream and keeps only
its own micro-batches, so the global batches do not depend on the layout as long as the
source yields the same documents in the same order on every read. Resuming replays the
stream up to the saved cursor: exact, but its cost grows with the position.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info
from torchdata.stateful_dataloader import StatefulDataLoader

from titanlite.config.job import Data
from titanlite.errors import ConfigError
from titanlite.data.sources import source_name, stream_documents
from titanlite.data.tokenizer import Tokenizer

_ENCODE_CHUNK = 64  # documents per batched tokenizer call


class StreamingSamples(IterableDataset):
    """This rank's micro-batches of a streamed source; a worker w of W yields this rank's
    micro-batches w, w+W, ... so StatefulDataLoader's round-robin restores the order.
    State: the index of the next micro-batch this copy yields (None: not started)."""

    def __init__(self, cfg: Data, tokenizer: Tokenizer, seq_len: int, global_batch_size: int,
                 local_batch_size: int, dp_rank: int, dp_degree: int) -> None:
        self.cfg, self.tokenizer, self.seq_len = cfg, tokenizer, seq_len
        self.G, self.L = global_batch_size, local_batch_size
        self.row0 = dp_rank * (global_batch_size // dp_degree)
        self.accum = global_batch_size // (local_batch_size * dp_degree)
        self.next_micro: int | None = None
        self.start_micro = 0

    def resume_at(self, global_batch: int) -> None:
        """Start at this global batch: the stream is replayed from its beginning up to there
        (exact, at a cost that grows with the position). Call before iter()."""
        self.start_micro = global_batch * self.accum

    def _documents(self, epoch: int) -> Iterator[np.ndarray]:
        tok, c = self.tokenizer, self.cfg
        head = np.array([tok.bos_id] if tok.bos_id != tok.eos_id else [], dtype=np.uint32)
        tail = np.array([tok.eos_id], dtype=np.uint32)
        texts = (t for t in stream_documents(c.path, c.text_field, c.split, c.seed, c.shuffle,
                                             epoch, c.shuffle_buffer) if t)
        encode = getattr(tok, "encode_batch", None) or (lambda ts: [tok.encode(t) for t in ts])
        while chunk := [t for _, t in zip(range(_ENCODE_CHUNK), texts)]:
            for ids in encode(chunk):
                yield np.concatenate([head, ids, tail], dtype=np.uint32, casting="unsafe")

    def samples(self) -> Iterator[np.ndarray]:
        """Global samples 0, 1, 2, ... (seq_len + 1 tokens each), over epochs without end."""
        buf, epoch, L = np.empty(0, np.uint32), 0, self.seq_len
        while True:
            empty = True
            for doc in self._documents(epoch):
                empty = False
                buf = np.concatenate([buf, doc])
                n = (len(buf) - 1) // L
                for i in range(n):
                    yield buf[i * L:i * L + L + 1]
                buf = buf[n * L:]
            if empty:
                raise ConfigError(f"data.path: no documents with text in {source_name(self.cfg.path)}")
            epoch += 1

    def _first_sample(self, micro: int) -> int:
        step, mb = divmod(micro, self.accum)
        return step * self.G + self.row0 + mb * self.L

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        info = get_worker_info()
        stride = info.num_workers if info else 1
        if self.next_micro is None:
            self.next_micro = self.start_micro + (info.id if info else 0)
        first, rows = self._first_sample(self.next_micro), []
        for g, sample in enumerate(self.samples()):
            if g < first:
                continue
            rows.append(torch.from_numpy(sample.astype(np.int64)))
            if len(rows) == self.L:
                s = torch.stack(rows)
                self.next_micro += stride
                first, rows = self._first_sample(self.next_micro), []
                yield {"input_ids": s[:, :-1], "labels": s[:, 1:]}

    def state_dict(self) -> dict[str, int | None]:
        return {"next_micro": self.next_micro}

    def load_state_dict(self, state: dict[str, int | None]) -> None:
        self.next_micro = state["next_micro"]


def build_streaming_loader(cfg: Data, tokenizer: Tokenizer, seq_len: int, global_batch_size: int,
                           local_batch_size: int, dp_rank: int, dp_degree: int) -> StatefulDataLoader:
    dataset = StreamingSamples(cfg, tokenizer, seq_len, global_batch_size, local_batch_size,
                               dp_rank, dp_degree)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="'set_vital' is deprecated")
        return StatefulDataLoader(dataset, batch_size=None, num_workers=cfg.num_workers,
                                  pin_memory=torch.cuda.is_available())
