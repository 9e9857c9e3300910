"""Batch-size and sequence-length warm-up: what each step reads, and in which shape.

The unit of data stays the sample of training.seq_len tokens (L) in the global order of
titanlite.data.loader, and each step reads the next `samples` of them, so the samples a run sees
are, in order, those of a run at the final batch size from the first sample: none lost, none
read twice, whatever the schedule. A phase at a shorter length l cuts each sample into L / l
pieces read as rows of l tokens (the same target tokens, a shorter context), each row with its
own document ids and positions. Everything here is a function of the config, so resuming needs
only the sample cursor.

Shapes: the micro-batch count on each data-parallel rank is `samples / (dp x local_batch_size)`
(the accumulation grows with the batch); below `dp x local_batch_size` samples one micro-batch
of `samples / dp` (the local batch grows). A shorter sequence keeps a micro-batch's tokens
(`local_batch_size x L / l` rows) with `seq_warmup_constant_tokens`, else its rows (and the step
reads `samples x l / L` samples).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable
from dataclasses import dataclass

from titanlite.config.job import Training
from titanlite.errors import ConfigError


@dataclass(frozen=True)
class Phase:
    """Steps first_step..last_step, all of one shape."""

    first_step: int
    last_step: int
    samples: int
    """Samples of training.seq_len read per step (its tokens / seq_len)."""
    seq_len: int
    pieces: int
    """Rows each sample is cut into: training.seq_len / seq_len."""
    rows: int
    """Rows per micro-batch on each data-parallel rank."""
    micro_batches: int
    """Micro-batches per step on each data-parallel rank."""
    first_sample: int
    """Samples read by the steps before first_step."""

    def describe(self) -> str:
        return (f"steps {self.first_step}-{self.last_step}: {self.samples * self.pieces} x {self.seq_len} tokens, "
                f"{self.micro_batches} micro-batch(es) of {self.rows} per rank")


@dataclass(frozen=True)
class DataSchedule:
    phases: tuple[Phase, ...]
    seq_len: int
    steps: int
    sqrt_lr: bool = False
    """training.batch_warmup_sqrt_lr: the learning rate follows the batch (lr_scale)."""

    @classmethod
    def constant(cls, global_batch_size: int, local_batch_size: int, dp: int, seq_len: int,
                 steps: int = 1 << 62) -> DataSchedule:
        """No warm-up: every step the global batch (a run's default schedule)."""
        return cls((Phase(1, steps, global_batch_size, seq_len, 1, local_batch_size,
                          global_batch_size // (local_batch_size * dp), 0),), seq_len, steps)

    @property
    def warms_up(self) -> bool:
        return len(self.phases) > 1

    @property
    def final(self) -> Phase:
        return self.phases[-1]

    def phase(self, step: int) -> Phase:
        """The phase of step `step` (1-based; past the last, the last phase goes on)."""
        return self.phases[max(0, bisect.bisect_right([p.first_step for p in self.phases], step) - 1)]

    def samples_before(self, step: int) -> int:
        """Samples read by steps 1 .. step - 1."""
        p = self.phase(step)
        return p.first_sample + (step - p.first_step) * p.samples

    def steps_for(self, samples: int) -> int | None:
        """The number of steps that read exactly `samples`, or None (not a step boundary)."""
        starts = [p.first_sample for p in self.phases]
        p = self.phases[max(0, bisect.bisect_right(starts, samples) - 1)]
        done, left = divmod(samples - p.first_sample, p.samples)
        return None if left else p.first_step - 1 + done

    @property
    def lr_scale(self) -> Callable[[int], float] | None:
        """With sqrt_lr, the learning rate's factor for the 0-based optimizer step `step`,
        sqrt(its tokens / the final step's): it grows by sqrt(new / old) with the batch (Merrill
        et al., 2025); else None."""
        if not self.sqrt_lr:
            return None
        return lambda step: math.sqrt(self.phase(step + 1).samples / self.final.samples)


def parse(key: str, entries: list[str], unit: str) -> list[tuple[int, int]]:
    """["VALUE:UNTIL", ...] -> [(value, until)], each an integer > 0, both increasing."""
    out = []
    for entry in entries:
        value, _, until = entry.strip().partition(":")
        if not (value.isdigit() and until.isdigit() and int(value) > 0 and int(until) > 0):
            raise ConfigError(f"training.{key}: bad entry '{entry}'; expected VALUE:UNTIL, two positive integers "
                              f"(UNTIL in {unit}), e.g. {key} = [\"64:1000\", \"128:2000\"]")
        out.append((int(value), int(until)))
    for (a, s), (b, t) in zip(out, out[1:]):
        if not (a < b and s < t):
            raise ConfigError(f"training.{key}: '{a}:{s}' then '{b}:{t}' is not increasing; each entry's value "
                              "and UNTIL must be larger than the one before")
    return out


def _check_values(key: str, values: list[int], final: int, final_key: str, what: str) -> None:
    for a, b in zip(values, [*values[1:], final]):
        if b <= a or b % a:
            name = final_key if b == final else f"the next {what}"
            raise ConfigError(f"training.{key}: {what} {a} is not below {name} {b} as a whole factor of it; each "
                              f"{what} must divide the next and {final_key}, e.g. doubling")


def build(t: Training, global_batch_size: int, dp: int, cp: int = 1, tp_split: int = 1, pp: bool = False,
          streaming: bool = False) -> DataSchedule:
    """The run's schedule from training.batch_warmup / seq_warmup, or the one-line reason it cannot
    be exact. `tp_split`: what each length must also divide by (sequence parallel's tp x cp)."""
    L, lb, G = t.seq_len, t.local_batch_size, global_batch_size
    unit = t.warmup_unit
    batch = parse("batch_warmup", t.batch_warmup, unit)
    seq = parse("seq_warmup", t.seq_warmup, unit)
    if not batch and not seq:
        return DataSchedule.constant(G, lb, dp, L, t.steps)
    if streaming:
        raise ConfigError("training.batch_warmup and seq_warmup read the global sample order, which data.streaming "
                          "has not; turn streaming off or leave them out")
    _check_values("batch_warmup", [b for b, _ in batch], G, "training.global_batch_size", "size")
    _check_values("seq_warmup", [s for s, _ in seq], L, "training.seq_len", "length")
    if pp and seq:
        raise ConfigError("training.seq_warmup with parallelism.pipeline_parallel_degree > 1: pipeline stages are "
                          "built for one sequence length; leave seq_warmup out or pipelining off")
    need = math.lcm(2 * cp if cp > 1 else 1, tp_split)
    for length, _ in seq:
        if length % need:
            raise ConfigError(f"training.seq_warmup: length {length} does not split over context and sequence "
                              f"parallelism (a multiple of {need}: 2 x context_parallel_degree chunks, tensor x "
                              "context parallel degree shards); use multiples of it")
    ends = sorted({u for _, u in batch} | {u for _, u in seq})
    if unit == "steps" and ends[-1] >= t.steps:
        raise ConfigError(f"training.batch_warmup/seq_warmup: a phase lasts until step {ends[-1]}, not before "
                          f"training.steps {t.steps}; end the warm-up earlier (UNTIL is in steps)")

    def value(entries: list[tuple[int, int]], final: int, done: int) -> int:
        return next((v for v, until in entries if done < until), final)

    phases, step, read = [], 1, 0
    while step <= t.steps:
        done = step - 1 if unit == "steps" else read * L
        size, length = value(batch, G, done), value(seq, L, done)
        pieces = L // length
        samples, rows_total = (size, size * pieces) if t.seq_warmup_constant_tokens else (size // pieces, size)
        if not t.seq_warmup_constant_tokens and size % pieces:
            raise ConfigError(f"training.seq_warmup: {size} rows of {length} tokens (seq_warmup_constant_tokens "
                              f"false) hold {size * length / L:g} samples of training.seq_len {L}, not a whole "
                              "number; use longer lengths or larger batches")
        if size % (dp * lb if size >= dp * lb else dp):
            raise ConfigError(f"training.batch_warmup: size {size} does not divide over {dp} data-parallel rank(s) x "
                              f"local_batch_size {lb}; use multiples of {dp * lb}, or below it multiples of {dp}")
        if pp and size < dp * lb:
            raise ConfigError(f"training.batch_warmup: size {size} is below {dp} data-parallel rank(s) x "
                              f"local_batch_size {lb}, and pipeline stages are built for one micro-batch shape; "
                              f"start at {dp * lb} or lower training.local_batch_size")
        micro = max(1, size // (dp * lb))
        rows = rows_total // (dp * micro)
        # the next step where either schedule moves on
        later = [u for u in ends if u > done]
        if not later:
            last = t.steps
        elif unit == "steps":
            last = min(later[0], t.steps)
        else:
            last = min(step - 1 + math.ceil((later[0] - done) / (samples * L)), t.steps)
        phases.append(Phase(step, last, samples, length, pieces, rows, micro, read))
        read += (last - step + 1) * samples
        step = last + 1
    if len(phases) == 1 or phases[-1].samples != G or phases[-1].seq_len != L:
        raise ConfigError(f"training.batch_warmup/seq_warmup: the warm-up lasts until after training.steps "
                          f"{t.steps} ({read * L:,} tokens); end it earlier (UNTIL is in {unit})")
    return DataSchedule(tuple(phases), L, t.steps, t.batch_warmup_sqrt_lr)
