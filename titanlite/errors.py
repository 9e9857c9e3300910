"""The kinds of failure titanlite reports as one line; this module imports nothing of titanlite."""

from __future__ import annotations

import traceback


class ConfigError(ValueError):
    """A user mistake in the configuration, command line or input files; exit code 2."""


class RunError(RuntimeError):
    """A failure during training (non-finite step, failed save, dead peer); exit code 1."""


class WorkerError(Exception):
    """An exception raised in a worker process, as text: its type's name, its message's first line,
    the file:line it was raised at, and its whole traceback. multiprocessing pickles what a worker
    raises, so an exception that holds an object that does not pickle would reach the parent as a
    pickling error about that object, its own type, message and place lost."""

    def __init__(self, kind: str, message: str, where: str, tb: str) -> None:
        super().__init__(kind, message, where, tb)  # what pickling rebuilds it from
        self.kind, self.message, self.where, self.tb = kind, message, where, tb

    def __str__(self) -> str:
        return f"{self.kind}: {self.message}, at {self.where}"

    @classmethod
    def of(cls, e: BaseException) -> WorkerError:
        frames = traceback.extract_tb(e.__traceback__)
        where = f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "an unknown place"
        return cls(type(e).__name__, (str(e).strip().splitlines() or [""])[0], where,
                   "".join(traceback.format_exception(e)))
