"""The C heap's free memory given back to the operating system as work goes on.

glibc keeps memory a process frees for its next allocations: blocks freed in the middle of its heap stay
resident, and so do blocks from 128 KiB up once a freed one raised its threshold for mapping them apart.
Capture and replay allocate and free between the model's own allocations (snapshots, reads, comparisons, hook
bookkeeping), and the memory so kept showed as peak resident memory the bare model never had. On the
FastConformer-sized bench model (bare process 2.8 GB): ``capture-run`` 4.3-4.4 GB, ``replay-compare`` 2.95-3.1 GB
though its largest record is 8 MB. :class:`HeapTrimmer` calls glibc's ``malloc_trim`` once every
:data:`TRIM_EVERY` bytes of records written (:data:`READ_TRIM_EVERY` read), so that resident memory follows what
the process holds (3.0 and 2.65 GB then). Elsewhere (no glibc) it does nothing.

A process's first capture or replay trims so throughout. One that follows an earlier one in the same process (a
test suite, a loop of steps) trims only once it holds more than the process's peak when the last one ended
(:meth:`HeapTrimmer.finish`): below that peak, what a trim gives back is mostly the earlier run's freed memory, which
this one allocates again, page fault by page fault. GPT-2's steps repeated in one process, the two rules swapped
round by round: exact replay 1.52x -> 1.26x the bare step, capture 1.99x -> 1.80x. What it costs is that loop's peak,
which settles higher (docs/performance.md). A first run keeps the old rule because its trims below any such mark
still matter: a review found a capture whose process had held a little more than the capture's trimmed peak before
it began peak 45-91 MB higher without them (trims also keep freed holes from being pinned by small blocks later).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
from collections.abc import Callable, Iterator
from typing import Final

__all__ = ["READ_TRIM_EVERY", "TRIM_EVERY", "HeapTrimmer", "return_free_memory"]

TRIM_EVERY: Final = 256 << 20
"""Bytes of records written between two of capture's trims (the default of :class:`HeapTrimmer`). A trim itself
takes 1-4 ms; the pages it gives back are faulted in again by later allocations, which glibc would have served
without a fault: hence, after a first run in a process, no trims below its peak (:class:`HeapTrimmer`)."""
READ_TRIM_EVERY: Final = 1 << 30
"""Bytes of records read between two of replay's trims. Exact replays of the FastConformer-sized bench model
(4.2 GB bundle) in fresh processes, interleaved: 6.9-8.7 s (median 8.0) with a trim every 1 GiB in eight runs,
8.3-9.5 s (median 8.5) every 256 MiB in six; the peak 1-49 MB over the replay's start against 1-14 MB, while the
bare step's own peak moved 2807-2892 MB between those runs. Without trims: 7.1-7.7 s, the peak 160-208 MB over
its start."""

_LOOKS_PER_TRIM: Final = 8
"""How often, per ``every`` bytes, a trimmer whose trim is due looks again whether the process passed its mark."""


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        function = ctypes.CDLL(None).malloc_trim  # the C library the interpreter runs on
    except (OSError, AttributeError, TypeError):  # no glibc (musl, macOS, Windows): nothing to trim
        return None
    function.argtypes, function.restype = [ctypes.c_size_t], ctypes.c_int
    return function


def resident_bytes() -> int | None:
    """This process's resident memory now (Linux's ``/proc/self/statm``); None where it cannot be read."""
    try:
        with open("/proc/self/statm", "rb") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def peak_resident_bytes() -> int | None:
    """The most this process has held resident so far (``VmHWM``); None where it cannot be read."""
    try:
        with open("/proc/self/status", "rb") as status:
            for line in status:
                if line.startswith(b"VmHWM:"):
                    return int(line.split()[1]) * 1024  # in kB
    except (OSError, ValueError, IndexError):
        return None
    return None


def return_free_memory() -> bool:
    """Give the C heap's free pages back to the operating system; False where the C library cannot."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


_peak_at_last_finish: int | None = None
"""The process's peak resident memory when its last capture or replay ended: a bundle writer committed or aborted, or
a reader closed, a reader opened only to list or read a bundle among them (:meth:`HeapTrimmer.finish`); None before
any did."""


class HeapTrimmer:
    """Counts bytes of work (:meth:`note`) and returns the heap's free memory every ``every`` of them
    (default :data:`TRIM_EVERY`); after an earlier capture or replay in the process, only while the process holds
    more than its peak when that one ended."""

    def __init__(self, every: int | None = None) -> None:
        self.every = TRIM_EVERY if every is None else every
        self._since = 0
        self._paused = 0
        self._due = self.every  # the count at which to trim, or look again whether to
        self._mark = _peak_at_last_finish

    def finish(self) -> None:
        """Note that the work ended: later trimmers in this process take the process's peak now as their mark."""
        global _peak_at_last_finish
        _peak_at_last_finish = peak_resident_bytes()

    @classmethod
    def for_reading(cls) -> HeapTrimmer:
        """A trimmer for replay's reads (:data:`READ_TRIM_EVERY`)."""
        return cls(READ_TRIM_EVERY)

    def note(self, nbytes: int) -> None:
        """Count ``nbytes`` of work done; once the count since the last trim reaches ``every`` (not while
        :meth:`paused`), trim if the process is past its earlier peak, else look again every ``every / 8`` bytes."""
        self._since += nbytes
        if self._since < self._due or self._paused:
            return
        if self._past_earlier_peak():
            self._since, self._due = 0, self.every
            return_free_memory()
        else:  # still due: made as soon as the process passes its mark, not up to ``every`` bytes later
            self._due = self._since + max(self.every // _LOOKS_PER_TRIM, 1)

    def _past_earlier_peak(self) -> bool:
        """Whether the process holds more now than its peak when an earlier capture or replay ended (True with no
        such mark, or where resident memory cannot be read: trimming then every ``every`` bytes)."""
        if self._mark is None:
            return True
        resident = resident_bytes()
        return resident is None or resident >= self._mark

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
