"""parity-harness replay: rerun a port on a bundle's inputs and compare it with the reference.

Names are imported on first use (PEP 562), so that loading the pytest plugin, which lives in this
package, does not import torch for test suites that never use the ``parity`` fixture.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    from replay.assertions import assert_parity
    from replay.compare import ComparisonResult, RecordResult
    from replay.mapping import RenameMap, parse_map, read_map
    from replay.reader import BundleReader
    from replay.runner import compare_run

__all__ = [
    "BundleReader",
    "ComparisonResult",
    "RecordResult",
    "RenameMap",
    "assert_parity",
    "compare_run",
    "parse_map",
    "read_map",
]

_HOMES: Final = {
    "assert_parity": "replay.assertions",
    "ComparisonResult": "replay.compare",
    "RecordResult": "replay.compare",
    "RenameMap": "replay.mapping",
    "parse_map": "replay.mapping",
    "read_map": "replay.mapping",
    "BundleReader": "replay.reader",
    "compare_run": "replay.runner",
}


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'replay' has no attribute {name!r}")
    return getattr(importlib.import_module(_HOMES[name]), name)
