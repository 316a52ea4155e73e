"""Regular expressions from a map file or the command line, matched within a time limit.

Python's matcher backtracks: a rule such as ``^(.|.)*Z$``, ``(a?){28}a{28}`` or ten ``.{0,16}`` in a row takes
exponential time on a name it does not match, and no test of a pattern's form tells every such rule from the usual
ones (``^(?:[a-z_]+\\.)*norm$`` is linear, ``^(?:[a-z_]+)*norm$`` is not). So the matching itself is timed: in the main
thread (the commands, a test suite), a ``SIGALRM`` timer interrupts a match running past :data:`LIMIT_SECONDS` (the
matcher checks for signals as it goes), which is then refused in one line. Elsewhere (a replay started from another
thread), or while the process's own interval timer runs (pytest-timeout), the pattern is trusted as the caller's.
"""

from __future__ import annotations

import contextlib
import re
import signal
import threading
from collections.abc import Iterator
from typing import Final

from parity_harness.common.errors import InputError

__all__ = ["LIMIT_SECONDS", "Attempt", "time_limited"]

LIMIT_SECONDS: Final = 2.0
"""Longest a regular expression may take on one name (a usual rule takes microseconds)."""


class _TooLong(Exception):
    """Raised by the timer's signal handler inside the match it interrupts."""


class Attempt:
    """The pattern being matched in a :func:`time_limited` block, for the error's message."""

    pattern: re.Pattern[str] | None = None


@contextlib.contextmanager
def time_limited(name: str, error: type[InputError] = InputError) -> Iterator[Attempt]:
    """Run the block (matching patterns against ``name``, each set on the yielded :class:`Attempt` first) within
    :data:`LIMIT_SECONDS` where a timer can be set; past it, raise ``error`` naming the pattern and the name."""
    attempt = Attempt()
    if not _can_time():
        yield attempt
        return

    def interrupt(signum: int, frame: object) -> None:
        raise _TooLong

    previous = signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, LIMIT_SECONDS)
    try:
        yield attempt
    except _TooLong:
        shown = "?" if attempt.pattern is None else attempt.pattern.pattern[:120]
        raise error(
            f"regular expression {shown!r} took over {LIMIT_SECONDS:g} s matching {name[:120]!r}: its matching "
            "backtracks (a repetition of alternatives or of optional items, many in a row); write it without them"
        ) from None
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _can_time() -> bool:
    """Whether a ``SIGALRM`` timer may be set here: the main thread, a platform that has one, none running."""
    return (
        hasattr(signal, "setitimer")
        and threading.current_thread() is threading.main_thread()
        and signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    )
