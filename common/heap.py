"""The C heap's free memory given back to the operating system as work goes on.

glibc keeps memory a process frees for its next allocations: blocks freed in the middle of its heap stay
resident, and so do blocks from 128 KiB up once a freed one raised its threshold for mapping them apart.
Capture and replay allocate and free between the model's own allocations (snapshots, reads, comparisons, hook
bookkeeping), and the memory so kept showed as peak resident memory the bare model never had. On the
FastConformer-sized bench model (bare process 2.8 GB): ``capture-run`` 4.3-4.4 GB, ``replay-compare`` 2.95-3.1 GB
though its largest record is 8 MB. :class:`HeapTrimmer` calls glibc's ``malloc_trim`` once every
:data:`TRIM_EVERY` bytes of records written (:data:`READ_TRIM_EVERY` read), so that resident memory follows what
the process holds (3.0 and 2.65 GB then). Elsewhere (no glibc) it does nothing.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
from collections.abc import Callable, Iterator
from typing import Final

__all__ = ["READ_TRIM_EVERY", "TRIM_EVERY", "HeapTrimmer", "return_free_memory"]

TRIM_EVERY: Final = 256 << 20
"""Bytes of records written between two of capture's trims (the default of :class:`HeapTrimmer`). A trim itself
takes 1-4 ms; the pages it gives back are faulted in again by later allocations, which glibc would have served
without a fault. A one-shot command measured no cost; a process replaying again and again pays it (a repeated
FastConformer replay: 5.2 -> 5.8 s)."""
READ_TRIM_EVERY: Final = 1 << 30
"""Bytes of records read between two of replay's trims. Exact replays of the FastConformer-sized bench model
(4.2 GB bundle) in fresh processes, interleaved: 6.9-8.7 s (median 8.0) with a trim every 1 GiB in eight runs,
8.3-9.5 s (median 8.5) every 256 MiB in six; the peak 1-49 MB over the replay's start against 1-14 MB, while the
bare step's own peak moved 2807-2892 MB between those runs. Without trims: 7.1-7.7 s, the peak 160-208 MB over
its start."""


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        function = ctypes.CDLL(None).malloc_trim  # the C library the interpreter runs on
    except (OSError, AttributeError, TypeError):  # no glibc (musl, macOS, Windows): nothing to trim
        return None
    function.argtypes, function.restype = [ctypes.c_size_t], ctypes.c_int
    return function


def return_free_memory() -> bool:
    """Give the C heap's free pages back to the operating system; False where the C library cannot."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


class HeapTrimmer:
    """Counts bytes of work (:meth:`note`) and returns the heap's free memory every ``every`` of them
    (default :data:`TRIM_EVERY`)."""

    def __init__(self, every: int | None = None) -> None:
        self.every = TRIM_EVERY if every is None else every
        self._since = 0
        self._paused = 0

    @classmethod
    def for_reading(cls) -> HeapTrimmer:
        """A trimmer for replay's reads (:data:`READ_TRIM_EVERY`)."""
        return cls(READ_TRIM_EVERY)

    def note(self, nbytes: int) -> None:
        """Count ``nbytes`` of work done; trim once the count since the last trim reaches ``every`` (not while
        :meth:`paused`)."""
        self._since += nbytes
        if self._since >= self.every and not self._paused:
            self._since = 0
            return_free_memory()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """No trims within the block: for work during which the process's memory only shrinks (a backward pass,
        freeing the forward's activations), where a trim cannot lower the peak already reached and the pages it
        gives back are faulted in again by the next allocations. On the FastConformer-sized bench model an exact
        replay took 7.1-8.9 s trimming throughout and 6.4-6.8 s with the trims paused during backward, its peak
        resident memory the same (0-35 and 0-5 MB over the bare run's)."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1
