"""Python garbage collection at known steps instead of whenever the allocator counts say.

An automatic collection can land anywhere in a step and, with many ranks, stall the
collectives of the others; collecting every N steps on every rank keeps pauses aligned.
"""

from __future__ import annotations

import gc


def start(freq: int) -> None:
    if freq > 0:
        gc.disable()
        gc.collect()


def maybe_collect(step: int, freq: int) -> None:
    if freq > 0 and step % freq == 0:
        gc.collect(1)


def stop(freq: int) -> None:
    if freq > 0:
        gc.enable()
