"""The sample order every map-style data set shares: global sample g is sample g % N of epoch
g // N, where N is the data set's sample count, permuted per epoch by (seed, epoch, source)
when shuffling. A pure function of g, so any layout reads the same samples for a step."""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import Dataset


class SampleOrder(Dataset):
    """Map-style: item g is global sample g (any epoch); subclasses read sample `position(g)`."""

    def __init__(self, num_samples: int, shuffle: bool, seed: int, source: tuple[int, ...] = ()) -> None:
        self.num_samples, self.shuffle, self.seed = num_samples, shuffle, seed
        self.source = source  # mixture members draw their own permutations
        self._perm: tuple[int, np.ndarray] | None = None

    def position(self, g: int) -> int:
        """Which of the data set's samples global sample g is."""
        epoch, pos = divmod(g, self.num_samples)
        if not self.shuffle:
            return pos
        if self._perm is None or self._perm[0] != epoch:
            rng = np.random.default_rng([self.seed, epoch, *self.source])
            # shuffling an arange draws the same order as rng.permutation(n), in half the memory
            order = np.arange(self.num_samples, dtype=np.uint32 if self.num_samples < 2**32 else np.int64)
            rng.shuffle(order)
            self._perm = (epoch, order)
        return int(self._perm[1][pos])

    def epoch(self, g: int) -> int:
        """Passes over the data completed before global sample g."""
        return g // self.num_samples


def row_of(sample: dict[str, torch.Tensor], length: int, k: int) -> dict[str, torch.Tensor]:
    """The k-th row of `length` tokens of a sample, read as a sample of its own (a sequence-length
    warm-up: titanlite.data.schedule): its tokens and labels, and with documents their ids from 0
    and positions from 0 for a document begun before the row (the part a row holds is all that
    attends), as titanlite.data.loader.document_spans gives a sample."""
    row = {key: v[k * length:(k + 1) * length] for key, v in sample.items()}
    if "document_ids" in row:
        docs, positions = row["document_ids"], row["positions"]
        row["positions"] = torch.where(docs == docs[0], positions - positions[0], positions)
        row["document_ids"] = docs - docs[0]
    return row
