"""A rank's console: titanlite's own lines, and nothing else.

Everything else a training process writes to stderr goes to <dump_folder>/logs/rank-R.log,
kept for whoever wants it: torch's C++ warnings (written straight to file descriptor 2), the
tracebacks torchft logs when a peer group dies, its HTTP checkpoint server's access-log lines,
Python warnings, and the stack of an unexpected exception (the rank's one-line error says where
it went). Lines that start with `titanlite:` go to the console, and to the log too, so the log
reads in order. stdout (the step lines) is left as it is.
"""

from __future__ import annotations

import io
import os
import sys
import threading
import time
from pathlib import Path

PREFIX = "titanlite:"

_log_path: Path | None = None
_saved: tuple[int, object] | None = None
"""The console's file descriptor and sys.stderr before quiet(), for restore()."""


class _Router(io.TextIOBase):
    """sys.stderr while training: whole lines, each to the log, titanlite's also to the console."""

    def __init__(self, console: io.TextIOBase, log: io.TextIOBase) -> None:
        self.console, self.log = console, log
        self._partial = ""
        self._lock = threading.Lock()  # torchft's threads write too

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        with self._lock:
            *lines, self._partial = (self._partial + text).split("\n")
            for line in lines:
                self.log.write(line + "\n")
                if line.startswith(PREFIX):
                    self.console.write(line + "\n")
        return len(text)

    def flush(self) -> None:
        self.log.flush()
        self.console.flush()

    def fileno(self) -> int:
        return 2  # the log: what writes to the descriptor (faulthandler, C) is not titanlite's


def quiet(dump_folder: str, rank: int) -> Path:
    """From now on, this process's stderr goes to <dump_folder>/logs/rank-R.log (appended: a
    restarted attempt continues it), but for titanlite's lines; returns the log's path."""
    global _log_path, _saved
    restore()
    path = Path(dump_folder, "logs", f"rank-{rank}.log")
    path.parent.mkdir(parents=True, exist_ok=True)
    sys.stderr.flush()
    log = open(path, "a", buffering=1, encoding="utf-8", errors="replace")
    log.write(f"-- {time.strftime('%Y-%m-%d %H:%M:%S')} rank {rank}, pid {os.getpid()}, attempt "
              f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}\n")
    console = os.fdopen(os.dup(2), "w", buffering=1, encoding="utf-8", errors="replace")
    _saved = (os.dup(2), sys.stderr)
    os.dup2(log.fileno(), 2)  # C and C++ (torch's warnings, gloo's aborts) write to the descriptor
    sys.stderr = _Router(console, log)
    _log_path = path
    return path


def restore() -> None:
    """stderr as it was before quiet() (a tool that trains in process, then reports)."""
    global _log_path, _saved
    if _saved is not None:
        sys.stderr.flush()
        fd, sys.stderr = _saved
        os.dup2(fd, 2)
        os.close(fd)
        _saved = _log_path = None


def log_path() -> Path | None:
    """Where this process's stderr goes, once quiet() was called; None before."""
    return _log_path
