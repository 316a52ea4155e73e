"""A one-line progress indication on stderr for long replays (only on a terminal)."""

from __future__ import annotations

import sys
import time
from typing import Final, TextIO

__all__ = ["ProgressLine"]

_MIN_INTERVAL_S: Final = 0.1


class ProgressLine:
    """Callable ``(phase, done, total)`` that redraws one status line, at most ten times a second.

    Silent when ``stream`` is not a terminal (logs, pipes, CI) or when ``enabled`` is False.
    """

    def __init__(self, program: str, stream: TextIO | None = None, *, enabled: bool = True) -> None:
        self._program = program
        self._stream = stream or sys.stderr
        self._enabled = enabled and self._stream.isatty()
        self._last = 0.0
        self._width = 0

    def __call__(self, phase: str, done: int, total: int) -> None:
        if not self._enabled:
            return
        now = time.monotonic()
        if done < total and now - self._last < _MIN_INTERVAL_S:
            return
        self._last = now
        text = f"{self._program}: {phase} {done}/{total}"
        self._stream.write("\r" + text.ljust(self._width))
        self._stream.flush()
        self._width = len(text)

    def close(self) -> None:
        """Erase the status line."""
        if self._enabled and self._width:
            self._stream.write("\r" + " " * self._width + "\r")
            self._stream.flush()
