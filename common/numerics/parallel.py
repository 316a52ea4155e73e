"""Work over a large record in two halves on two threads.

A record is compared inside a hook, between two module calls: the model is not computing then, so the
second core is idle. NumPy releases the GIL in its loops over large arrays, so the two halves of a scan that
is one long NumPy call per block (the bit-identity scan of an exact port's records: 4.4 -> 7.8 GB/s measured)
run side by side. Work made of many short NumPy calls (the float64 path) contends for the GIL between them
and was measured slower on two threads, so it stays on one. Small records stay on the calling thread, where
a hand-off would cost more than it saves.
"""

from __future__ import annotations

import atexit
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Final, TypeVar

__all__ = ["PARALLEL_FROM", "in_halves", "on_second_thread"]

PARALLEL_FROM: Final = 1 << 20
"""Elements from which work is split (4 MiB of float32): below, the hand-off to the second thread (waking it,
the GIL passed back and forth) was measured to cost more than it saves."""

_T = TypeVar("_T")
_executor: ThreadPoolExecutor | None = None
_lock = threading.Lock()


def _second_thread() -> ThreadPoolExecutor:
    global _executor
    with _lock:
        if _executor is None:
            _executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="parity-compare")
            atexit.register(_executor.shutdown, wait=False)
        return _executor


def on_second_thread(work: Callable[..., _T], *args: object) -> Future[_T]:
    """``work(*args)`` started on the second thread (after anything queued there before)."""
    return _second_thread().submit(work, *args)


def in_halves(
    size: int, grain: int, work: Callable[[int, int], _T], settled: Callable[[_T], bool] | None = None
) -> list[_T]:
    """``work(begin, end)`` over ``[0, size)``: in one piece, or from :data:`PARALLEL_FROM` elements on in two
    pieces split at a multiple of ``grain`` (so that chunked work sees the same chunks), the later one on a
    second thread. Results in order.

    ``settled(first)``: the first half's result settles the question (a difference, for "all equal?"): the later
    half is then dropped if it has not started (the second thread may be busy with checksums queued before it),
    and only the first result is returned.
    """
    if size < PARALLEL_FROM or size < 2 * grain:
        return [work(0, size)]
    half = size // 2 // grain * grain
    later = _second_thread().submit(work, half, size)
    try:
        first = work(0, half)
    except BaseException:
        later.cancel() or later.exception()  # no work left running behind on arrays the caller may free
        raise
    if settled is not None and settled(first) and later.cancel():
        return [first]
    return [first, later.result()]  # waited for even when settled: no work left running behind
