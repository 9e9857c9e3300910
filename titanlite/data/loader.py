"""Data pipeline: corpus -> one token stream -> fixed-length samples in a layout-independent order.

The stream is the documents in a fixed order, each written as [BOS] + tokens + [EOS]. Sample
i is stream[i*L : i*L + L + 1]. Global sample index g lives in epoch g // N at position
g % N (permuted per epoch when shuffling). Global batch b holds global samples
[b*G, (b+1)*G); dp rank r takes rows [r*G/D, (r+1)*G/D) in micro-batches. The order of
global batches thus depends only on the data config, never on the world size, and the
only loader state is a global cursor. A mixture interleaves several such sources by a fixed
per-period schedule (MixedSamples). Sources are read in sources.py, streamed in streaming.py;
token folders (a source tokenized once) are read by offset in tokens.py.
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import replace

import numpy as np
import torch
from torch.utils.data import Dataset, default_collate
from torchdata.stateful_dataloader import StatefulDataLoader

from titanlite.config.data import Data, Validation
from titanlite.config.data import parse_mix, parse_ranges
from titanlite.errors import ConfigError
from titanlite.data.packing import ChatSamples, chat_samples
from titanlite.data.pairs import pair_samples
from titanlite.data.schedule import DataSchedule
from titanlite.data.sources import (is_token_folder, iter_records, probe_source, read_documents, source_name,
                                    unread_keys)
from titanlite.data.tokenizer import Tokenizer
from titanlite.data.order import SampleOrder
from titanlite.data.tokens import TokenStream, encode_documents, open_token_folder, read_index

MIX_RESOLUTION = 1000  # mixture weights become integer counts per period of about this many samples


@functools.lru_cache(maxsize=8)  # the train and val loaders share one tokenization pass
def token_stream(path: str, field: str, tokenizer: Tokenizer, split: str = "train") -> TokenStream:
    """The whole corpus as one read-only token stream (both holdout splits); `split` names
    the split of a Hugging Face data set. A token folder is opened, not read or tokenized."""
    if is_token_folder(path):
        return open_token_folder(path, tokenizer)
    texts = [t for t in read_documents(path, field, split) if t]
    if not texts:
        raise ConfigError(f"data.path: no documents with text in {source_name(path)}")
    tokens, lengths = encode_documents(texts, tokenizer)
    doc_starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    tokens.flags.writeable = doc_starts.flags.writeable = False  # shared through the cache
    return TokenStream(tokens, doc_starts)


def split_stream(stream: TokenStream, holdout_fraction: float, split: str) -> TokenStream:
    """Train is the head of the stream, val the last `holdout_fraction` of it. The cut snaps
    to the nearest document start unless that moves it by more than half the holdout.
    Binary searches only, so a token folder's stream stays unread."""
    n, starts = len(stream.tokens), stream.doc_starts
    target = n - round(holdout_fraction * n)
    i = int(np.searchsorted(starts, target))  # starts[i - 1] < target <= starts[i]
    if i == len(starts) or (i > 0 and target - starts[i - 1] <= starts[i] - target):
        i -= 1  # the nearer start; the earlier one on a tie
    nearest = int(starts[i])
    cut = nearest if 0 < nearest and abs(nearest - target) <= (n - target) / 2 else target
    first_val = int(np.searchsorted(starts, cut))
    if split == "train":
        return TokenStream(stream.tokens[:cut], starts[:first_val])
    if split != "val":
        raise ValueError(f"split must be 'train' or 'val', got '{split}'")
    val_starts = np.asarray(starts[first_val:]) - cut
    if len(val_starts) == 0 or val_starts[0] != 0:
        val_starts = np.concatenate([[0], val_starts])  # the tail begins mid-document
    return TokenStream(stream.tokens[cut:], val_starts)


class TokenSamples(SampleOrder):
    """Map-style: item g is global sample g (any epoch), sliced straight out of the stream."""

    def __init__(self, stream: TokenStream, seq_len: int, shuffle: bool, seed: int,
                 source: tuple[int, ...] = (), document_mask: bool = False) -> None:
        super().__init__(max(0, len(stream.tokens) - 1) // seq_len, shuffle, seed, source)
        self.stream, self.seq_len, self.document_mask = stream, seq_len, document_mask

    def __getitem__(self, g: int | tuple[int, int, int]) -> dict[str, torch.Tensor]:
        """Global sample g, or (g, length, k): its k-th piece of `length` tokens (a shorter
        sequence in a warm-up, titanlite.data.schedule), a sample of its own."""
        g, length, piece = g if isinstance(g, tuple) else (g, self.seq_len, 0)
        start = self.position(g) * self.seq_len + piece * length
        s = torch.from_numpy(np.asarray(self.stream.tokens[start:start + length + 1], dtype=np.int64))
        sample = {"input_ids": s[:-1], "labels": s[1:]}
        if self.document_mask:
            sample.update(document_spans(self.stream.doc_starts, start, length))
        return sample


def document_spans(doc_starts: np.ndarray, start: int, length: int) -> dict[str, torch.Tensor]:
    """For stream[start : start + length]: which document each token is in (numbered from 0
    within the sample) and its position in that document, counted from the sample start
    for a document that began earlier (the part a sample holds is all that attends)."""
    idx = np.arange(start, start + length)
    doc = np.searchsorted(doc_starts, idx, side="right") - 1
    first = np.maximum(doc_starts[doc], start)  # doc_starts[0] == 0, so doc >= 0
    return {"document_ids": torch.from_numpy(doc - doc[0]), "positions": torch.from_numpy(idx - first)}


def mix_schedule(counts: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """One period of a weighted interleave: slot o of the period takes source `which[o]`, its
    `nth[o]`-th sample of the period. Smooth weighted round-robin spreads each source evenly."""
    credit = np.zeros(len(counts), dtype=np.int64)
    which, nth, taken = [], [], [0] * len(counts)
    for _ in range(sum(counts)):
        credit += counts
        k = int(credit.argmax())  # lowest index on ties
        credit[k] -= sum(counts)
        which.append(k)
        nth.append(taken[k])
        taken[k] += 1
    return np.array(which), np.array(nth)


class MixedSamples(Dataset):
    """Global sample g of a mixture: period g // P, slot g % P of a fixed schedule in which
    source k fills counts[k] of the P slots. Source k's own global samples are taken in order,
    so each source keeps its own epochs and permutations, and the mixture stays a pure
    function of g (layout-independent)."""

    def __init__(self, parts: list[TokenSamples], counts: list[int]) -> None:
        self.parts, self.counts, self.period = parts, counts, sum(counts)
        self.which, self.nth = mix_schedule(counts)

    def locate(self, g: int) -> tuple[int, int]:
        """(source, that source's global sample index) of global sample g."""
        period, slot = divmod(g, self.period)
        k = int(self.which[slot])
        return k, period * self.counts[k] + int(self.nth[slot])

    def __getitem__(self, g: int | tuple[int, int, int]) -> dict[str, torch.Tensor]:
        k, j = self.locate(g[0] if isinstance(g, tuple) else g)
        return self.parts[k][(j, *g[1:]) if isinstance(g, tuple) else j]

    def epoch(self, g: int) -> int:
        """Passes completed by the most-repeated source before global sample g."""
        period, slot = divmod(g, self.period)
        seen = [period * c + int(np.sum(self.which[:slot] == k)) for k, c in enumerate(self.counts)]
        return max(p.epoch(n) for p, n in zip(self.parts, seen))


class GlobalBatchSampler:
    """Infinite iterator of this rank's micro-batches (lists of global sample indices; in a
    sequence-length warm-up phase, (sample, length, piece) triples: titanlite.data.schedule).

    Step n (0-based) reads the `schedule`'s samples [samples_before(n + 1), samples_before(n + 2))
    of the trained order, rank r its rows [r * R / D, (r + 1) * R / D) of the step's R, in
    micro-batches. Its state is a global cursor (steps read, next micro-batch within this rank's
    share), which StatefulDataLoader saves and restores, with or without workers. At a step
    boundary (micro_batch == 0) the state means the same for any dp layout.

    `skip` holds sample ranges [start, end) never read (data.skip_samples, a spike rollback):
    every global batch that overlaps one is passed over, the trained order going on after it. The
    cursor counts what was read, so a checkpoint's position means the same with the same ranges.
    In a warm-up, whose steps need not start on a multiple of the global batch, the configured
    ranges are widened to whole global batches at the start and a rollback's (its steps' samples)
    is skipped as it is: a range widened below a step already read would move what that step read.
    """

    def __init__(self, global_batch_size: int, local_batch_size: int, dp_rank: int, dp_degree: int,
                 skip: tuple[tuple[int, int], ...] = (), schedule: DataSchedule | None = None) -> None:
        self.schedule = schedule or DataSchedule.constant(global_batch_size, local_batch_size, dp_degree, 0)
        G = self.global_batch_size = self.schedule.final.samples
        self.dp_rank, self.dp_degree = dp_rank, dp_degree
        self.global_batch, self.micro_batch = 0, 0
        self.offset = 0
        """The steps read less the trainer's: a run resumed with another global batch size goes on
        from the saved sample cursor, so its step n is not the n-th step of this batch size."""
        self.skip: tuple[tuple[int, int], ...] = ()
        self.grid = 1 if self.schedule.warms_up else G  # what a range is widened to, when it is set
        self.set_skip(tuple((a // G * G, -(-b // G) * G) for a, b in skip) if self.schedule.warms_up else skip)

    def set_skip(self, ranges: tuple[tuple[int, int], ...]) -> None:
        """The sample ranges to pass over, as merged, sorted intervals [a, b)."""
        self.skip = tuple(sorted(set(ranges)))
        grid, merged = self.grid, []
        for a, b in sorted((start // grid * grid, -(-end // grid) * grid) for start, end in self.skip):
            if merged and a <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], b)
            else:
                merged.append([a, b])
        self._skip_samples = merged

    def position(self, n: int) -> int:
        """The global sample that the n-th one read is (ranges passed over)."""
        for a, b in self._skip_samples:
            if n < a:
                break
            n += b - a
        return n

    def first_sample(self, step: int) -> int:
        """The global sample the trainer's step `step` (1-based) reads first."""
        return self.position(self.schedule.samples_before(step + self.offset))

    def sample_range(self, first: int, last: int) -> tuple[int, int]:
        """[start, end) of the global samples that the trainer's steps first..last read."""
        return (self.first_sample(first),
                self.position(self.schedule.samples_before(last + 1 + self.offset) - 1) + 1)

    def micro_batches(self, n: int, part: int = 0, parts: int = 1, dp_rank: int | None = None) -> list[list]:
        """This rank's (or data-parallel rank `dp_rank`'s) micro-batches of the n-th step read
        (0-based), the step's rows split into `parts` equal shares (the replica groups of a
        quorum), this rank's group holding `part`."""
        p = self.schedule.phase(n + 1)
        share = p.samples * p.pieces // parts
        rows = share // self.dp_degree
        first = part * share + (self.dp_rank if dp_rank is None else dp_rank) * rows
        start = self.schedule.samples_before(n + 1)
        def item(j: int):  # row j of the step
            sample = self.position(start + j // p.pieces)
            return sample if p.pieces == 1 else (sample, p.seq_len, j % p.pieces)
        return [[item(j) for j in range(a, a + p.rows)] for a in range(first, first + rows, p.rows)]

    def __iter__(self) -> GlobalBatchSampler:
        return self

    def __next__(self) -> list:
        mine = self.micro_batches(self.global_batch)[self.micro_batch]
        self.micro_batch += 1
        if self.micro_batch == self.schedule.phase(self.global_batch + 1).micro_batches:
            self.global_batch, self.micro_batch = self.global_batch + 1, 0
        return mine

    def state_dict(self) -> dict[str, int]:
        return {"global_batch": self.global_batch, "micro_batch": self.micro_batch}

    def load_state_dict(self, state: dict[str, int]) -> None:
        accum = self.schedule.phase(state["global_batch"] + 1).micro_batches
        if not 0 <= state["micro_batch"] < accum:
            raise ValueError(f"data loader state has micro_batch {state['micro_batch']}, but this "
                             f"layout takes {accum} micro-batches per step")
        self.global_batch, self.micro_batch = state["global_batch"], state["micro_batch"]


def mix_counts(weights: list[float]) -> list[int]:
    """Relative weights -> integer samples per period (MIX_RESOLUTION in all, about)."""
    total = sum(weights)
    counts = [round(MIX_RESOLUTION * w / total) for w in weights]
    if min(counts) < 1:
        raise ConfigError(f"data.mix: weight {weights[counts.index(0)]} is below 1/{MIX_RESOLUTION} "
                          "of the total; raise it or drop that source")
    return counts


def _samples(cfg: Data, tokenizer: Tokenizer, seq_len: int, split: str, source: tuple[int, ...] = ()
             ) -> TokenSamples | ChatSamples:
    if cfg.format == "preference":
        samples = pair_samples(cfg, tokenizer, seq_len, split, source)
        size = f"{len(samples.pairs)} pairs"
    elif cfg.format == "chat":
        samples = chat_samples(cfg, tokenizer, seq_len, split, source)
        size = f"{len(samples.chats)} chats"
    else:
        stream = split_stream(token_stream(cfg.path, cfg.text_field, tokenizer, cfg.split),
                              cfg.holdout_fraction, split)
        samples = TokenSamples(stream, seq_len, cfg.shuffle, cfg.seed, source, cfg.document_mask)
        size = f"{len(stream.tokens)} tokens"
    if source and samples.num_samples < 1:  # a single source gets the batch-size check instead
        raise ConfigError(f"data: no sample of seq_len {seq_len} fits in the {split} split of "
                          f"{source_name(cfg.path)} ({size}); use more data or a shorter seq_len")
    return samples


def build_dataset(cfg: Data, tokenizer: Tokenizer, seq_len: int, split: str = "train"
                  ) -> TokenSamples | ChatSamples | MixedSamples:
    """Map-style data set whose item g is global sample g; `split` is "train" or "val" (the
    held-out tail of every source)."""
    if cfg.shuffle and cfg.seed < 0:
        raise ConfigError(f"data.seed must be >= 0 to shuffle, got {cfg.seed}")
    if split == "val" and cfg.holdout_fraction == 0:
        raise ConfigError("data.holdout_fraction is 0, so there is no validation split")
    if not cfg.mix:
        return _samples(cfg, tokenizer, seq_len, split)
    mix = parse_mix(cfg.mix)
    counts = mix_counts([w for _, w in mix])
    parts = [_samples(replace(cfg, path=path, mix=[]), tokenizer, seq_len, split, (k,))
             for k, (path, _) in enumerate(mix)]
    return MixedSamples(parts, counts)


def probe_data(data: Data, val: Validation) -> None:
    """Check every configured source (training, mixture, validation) before starting."""
    sources = [(p, data.split) for p in ([data.path] if not data.mix else [p for p, _ in parse_mix(data.mix)])]
    for path, split in sources + ([(val.path, val.split)] if val.freq and val.path else []):
        if data.format == "chat":
            if path:  # its first row (the built-in set needs no check)
                next(iter_records(path, data.messages_field, split, "data.messages_field"), None)
        elif data.format == "preference":
            if path:  # its first row's chosen column
                next(iter_records(path, "chosen", split, "data.format preference's 'chosen' column"), None)
        elif is_token_folder(path):
            read_index(path)  # finished and whole; the tokenizer is checked where it is opened
        else:
            probe_source(path, data.text_field, split)


def ignored_keys_note(data: Data) -> str | None:
    """A warning naming each data key set away from its default that no source of the run reads
    (a token folder has no split or text field, text has no messages, chats no text field), or None."""
    paths = [data.path] if not data.mix else [p for p, _ in parse_mix(data.mix)]
    unread = set.intersection(*(unread_keys(p) for p in paths))
    if data.format == "chat":  # the built-in chat set has no fields
        unread |= {"text_field"} | ({"messages_field"} if paths == [""] else set())
    else:  # preference rows have fixed fields and their own targets
        unread |= {"messages_field", "train_on", "overlong"} | ({"text_field"} if data.format != "text" else set())
    keys = [k for k in ("split", "text_field", "messages_field", "train_on", "overlong")
            if k in unread and getattr(data, k) != getattr(Data(), k)]
    if not keys:
        return None
    what = "any source of data.mix" if data.mix else f"this run's data source, {source_name(data.path)}"
    return (f"titanlite: warning: {', '.join(f'data.{k} = {getattr(data, k)!r}' for k in keys)}: ignored by "
            f"{what}; leave {'them' if len(keys) > 1 else 'it'} out or check data.path")


def build_dataloader(cfg: Data, tokenizer: Tokenizer, *, seq_len: int, global_batch_size: int,
                     local_batch_size: int, dp_rank: int, dp_degree: int, split: str = "train",
                     schedule: DataSchedule | None = None) -> StatefulDataLoader:
    """Infinite loader of this dp rank's micro-batches: {"input_ids", "labels"}, each a
    LongTensor [local_batch_size, seq_len], and with data.document_mask also
    {"document_ids", "positions"} of the input tokens (see `document_spans`; chats: packing.py). The
    trainer takes global_batch_size // (local_batch_size * dp_degree) of them per optimizer step, or in
    a warm-up what `schedule` says (titanlite.data.schedule, read by the loader's batch_sampler).
    `loader.dataset.epoch(g)` is the epoch count at global sample g."""
    G, L, D = global_batch_size, local_batch_size, dp_degree
    if G < 1 or L < 1 or D < 1 or G % (L * D):
        raise ConfigError(f"training.global_batch_size ({G}) must be divisible by "
                          f"local_batch_size ({L}) x dp degree ({D})")
    if not 0 <= dp_rank < D:
        raise ValueError(f"dp_rank {dp_rank} out of range for dp degree {D}")
    if cfg.streaming:
        from titanlite.data.streaming import build_streaming_loader

        return build_streaming_loader(cfg, tokenizer, seq_len, L, dp_rank, D)
    dataset = build_dataset(cfg, tokenizer, seq_len, split)
    if isinstance(dataset, SampleOrder) and dataset.num_samples < G:
        raise ConfigError(f"data: only {dataset.num_samples} samples of seq_len {seq_len} in the "
                          f"{split} split of {source_name(cfg.path)}; need at least "
                          f"global_batch_size {G} (use more data, a shorter seq_len or a "
                          "smaller batch)")
    with warnings.catch_warnings():
        # torchdata 0.11 calls an API that newer torch deprecates; nothing a user can act on.
        warnings.filterwarnings("ignore", message="'set_vital' is deprecated")
        # Its own generator: iter() would otherwise draw worker seeds from the global RNG,
        # which a resumed run (one more iter() call) could then not reproduce bitwise.
        sampler = GlobalBatchSampler(G, L, dp_rank, D, parse_ranges(cfg.skip_samples) if split == "train" else (),
                                     schedule)
        return StatefulDataLoader(dataset, batch_sampler=sampler,
                                  num_workers=cfg.num_workers, pin_memory=torch.cuda.is_available(),
                                  generator=torch.Generator().manual_seed(max(cfg.seed, 0)))


def batches_of(loader: StatefulDataLoader, step: int, dp_rank: int) -> list[dict[str, torch.Tensor]]:
    """Data-parallel rank `dp_rank`'s micro-batches of `step` (1-based), read apart from the
    loader's order (fault_tolerance.rerun_on_nonfinite reruns a step with each rank's data on
    another rank)."""
    return [default_collate([loader.dataset[g] for g in rows])
            for rows in loader.batch_sampler.micro_batches(step - 1, dp_rank=dp_rank)]
