"""Streamed sources: documents are read, tokenized and packed on the fly, never held whole.

The data-parallel group reads the stream once between all its ranks and loader workers: part
p = dp_rank * W + worker of P = dp_degree * W (W = max(data.num_workers, 1)) reads and
tokenizes only its share of each epoch's documents (whole files or shards when their count is
a multiple of P, else every P-th document; `datasets.distributed.split_dataset_by_node`),
shuffled within a buffer by (seed, epoch) when data.shuffle is on. A part packs its documents
([BOS] + tokens + [EOS] each, epochs back to back) into samples of seq_len + 1 tokens and yields
local_batch_size of them per micro-batch; StatefulDataLoader takes micro-batches from the
workers in turn. So which samples a rank sees depends on the dp degree and the worker count,
and resuming needs the same ones. A part's state is its position, (epoch, document, token
offset) of the next sample's first token: resuming re-reads, without tokenizing, the part's
documents of that epoch before it, and tokenizes again only the document it starts in.
"""

from __future__ import annotations

import itertools
import warnings
from collections import deque
from collections.abc import Iterator

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info
from torchdata.stateful_dataloader import StatefulDataLoader

from titanlite.config.data import Data
from titanlite.errors import ConfigError
from titanlite.data.sources import source_name, stream_documents
from titanlite.data.tokenizer import Tokenizer

_ENCODE_CHUNK = 64  # documents per batched tokenizer call


class StreamingSamples(IterableDataset):
    """This rank's micro-batches of a streamed source; each loader worker (or the main
    process, without workers) streams its own part. State: the part's position (None: not
    started), saved and restored per worker by StatefulDataLoader."""

    def __init__(self, cfg: Data, tokenizer: Tokenizer, seq_len: int, local_batch_size: int,
                 dp_rank: int, dp_degree: int) -> None:
        self.cfg, self.tokenizer, self.seq_len, self.L = cfg, tokenizer, seq_len, local_batch_size
        self.dp_rank, self.workers = dp_rank, max(cfg.num_workers, 1)
        self.shares = dp_degree * self.workers
        self.layout = f"dp{dp_degree}_workers{self.workers}"  # what a saved position is valid for
        self.position: dict[str, int] | None = None

    def _documents(self, epoch: int, part: int = 0, skip: int = 0) -> Iterator[np.ndarray]:
        """This part's documents of one epoch, from the `skip`-th on, as token arrays."""
        tok, c = self.tokenizer, self.cfg
        head = np.array([tok.bos_id] if tok.bos_id != tok.eos_id else [], dtype=np.uint32)
        tail = np.array([tok.eos_id], dtype=np.uint32)
        texts = (t for t in stream_documents(c.path, c.text_field, c.split, c.seed, c.shuffle, epoch,
                                             c.shuffle_buffer, part, self.shares) if t)
        texts = itertools.islice(texts, skip, None)  # read, not tokenized
        encode = getattr(tok, "encode_batch", None) or (lambda ts: [tok.encode(t) for t in ts])
        while chunk := [t for _, t in zip(range(_ENCODE_CHUNK), texts)]:
            for ids in encode(chunk):
                yield np.concatenate([head, ids, tail], dtype=np.uint32, casting="unsafe")

    def _part_documents(self, part: int, epoch: int, doc: int) -> Iterator[tuple[int, int, np.ndarray]]:
        """(epoch, index in the epoch, tokens) of the part's documents from (epoch, doc) on,
        over epochs without end."""
        while True:
            n = doc
            for ids in self._documents(epoch, part, doc):
                yield epoch, n, ids
                n += 1
            if n == 0:
                shared = (f" for part {part} of {self.shares} (dp degree x loader workers); use more documents "
                          "or files, fewer ranks or fewer data.num_workers") if self.shares > 1 else ""
                raise ConfigError(f"data.path: no documents with text in {source_name(self.cfg.path)}{shared}")
            epoch, doc = epoch + 1, 0

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        info = get_worker_info()
        part = self.dp_rank * self.workers + (info.id if info else 0)
        pos = self.position or {"epoch": 0, "doc": 0, "offset": 0}
        # buf[0] is token `offset` of document held[0]; held lists (epoch, doc, length) of
        # every document buf overlaps, so the position is known at every sample
        buf, held, rows, offset = np.empty(0, np.uint32), deque(), [], pos["offset"]
        for epoch, doc, ids in self._part_documents(part, pos["epoch"], pos["doc"]):
            held.append((epoch, doc, len(ids)))
            buf = np.concatenate([buf, ids[offset:] if len(held) == 1 else ids])
            while len(buf) > self.seq_len:
                rows.append(torch.from_numpy(buf[:self.seq_len + 1].astype(np.int64)))
                buf, offset = buf[self.seq_len:], offset + self.seq_len
                while offset >= held[0][2]:
                    offset -= held.popleft()[2]
                if len(rows) == self.L:
                    self.position = {"epoch": held[0][0], "doc": held[0][1], "offset": offset}
                    s, rows = torch.stack(rows), []
                    yield {"input_ids": s[:, :-1], "labels": s[:, 1:]}

    def state_dict(self) -> dict[str, object]:
        return {"layout": self.layout, "position": self.position}

    def load_state_dict(self, state: dict[str, object]) -> None:
        if state["layout"] != self.layout:
            raise ConfigError(f"data.streaming: the saved stream position is for {state['layout']}, this "
                              f"run reads the stream as {self.layout} (each rank and loader worker "
                              "streams its own share); resume with that dp degree and data.num_workers")
        self.position = state["position"]


def build_streaming_loader(cfg: Data, tokenizer: Tokenizer, seq_len: int, local_batch_size: int,
                           dp_rank: int, dp_degree: int) -> StatefulDataLoader:
    dataset = StreamingSamples(cfg, tokenizer, seq_len, local_batch_size, dp_rank, dp_degree)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="'set_vital' is deprecated")
        return StatefulDataLoader(dataset, batch_size=None, num_workers=cfg.num_workers,
                                  pin_memory=torch.cuda.is_available())
