"""parity-harness replay: rerun a port on a bundle's inputs and compare it with the reference.

Names are imported on first use (PEP 562), so that loading the pytest plugin, which lives in this
package, does not import torch for test suites that never use the ``parity`` fixture.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    from parity_harness.replay.assertions import assert_parity
    from parity_harness.replay.compare.precision import Precision
    from parity_harness.replay.compare.runner import compare_run
    from parity_harness.replay.naming.mapping import RenameMap, parse_map, read_map
    from parity_harness.replay.reader import BundleReader
    from parity_harness.replay.result import ComparisonResult, RecordResult

__all__ = [
    "BundleReader",
    "ComparisonResult",
    "Precision",
    "RecordResult",
    "RenameMap",
    "assert_parity",
    "compare_run",
    "parse_map",
    "read_map",
]

_HOMES: Final = {
    "assert_parity": "parity_harness.replay.assertions",
    "Precision": "parity_harness.replay.compare.precision",
    "ComparisonResult": "parity_harness.replay.result",
    "RecordResult": "parity_harness.replay.result",
    "RenameMap": "parity_harness.replay.naming.mapping",
    "parse_map": "parity_harness.replay.naming.mapping",
    "read_map": "parity_harness.replay.naming.mapping",
    "BundleReader": "parity_harness.replay.reader",
    "compare_run": "parity_harness.replay.compare.runner",
}


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'parity_harness.replay' has no attribute {name!r}")
    return getattr(importlib.import_module(_HOMES[name]), name)
