"""parity-harness replay: rerun a port on a bundle's inputs and compare it with the reference."""

from __future__ import annotations

from replay.compare import ComparisonResult, RecordResult
from replay.mapping import RenameMap, parse_map, read_map
from replay.reader import BundleReader
from replay.runner import compare_run

__all__ = ["BundleReader", "ComparisonResult", "RecordResult", "RenameMap", "compare_run", "parse_map", "read_map"]
