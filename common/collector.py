"""Python's garbage collector kept off the objects that were alive before a capture or a replay began.

A run allocates tens of thousands of objects that outlive a young collection (the bundle's index, the records'
results, hook bookkeeping), and every so often they set off a full collection, which walks every object of the
process: the hundreds of thousands torch's import made, a framework's (NeMo, Lightning) more. On the Conformer
example a full collection took 90-120 ms, one every ten captures or replays (about 10 ms a run on average, 5% of
a step); a process with more objects pays more per collection. The objects alive before the run are frozen for
its length (``gc.freeze``) and unfrozen after it, so a collection during the run walks the run's own objects
only. Nothing else changes: frozen objects are alive or are collected after the run, as the collector would have.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

__all__ = ["older_objects_frozen"]


@contextlib.contextmanager
def older_objects_frozen() -> Iterator[None]:
    """Within the block, full collections skip the objects alive when it began (module docstring). Does nothing
    where the collector is off or objects are frozen already (the caller's own freeze is never undone)."""
    if not gc.isenabled() or gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
