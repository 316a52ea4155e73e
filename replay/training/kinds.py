"""Which kind of run a path holds, and opening it: ``parity-train-diff`` takes any two."""

from __future__ import annotations

import os
from pathlib import Path

from parity_harness.common.errors import BundleNotFoundError
from parity_harness.replay.training.dump_run import DUMP_SUFFIXES, DumpRun
from parity_harness.replay.training.prediction_run import PredictionRun
from parity_harness.replay.training.runs import RunSource
from parity_harness.replay.training.training_file import TrainingRun

__all__ = ["open_run"]


def open_run(path: str | os.PathLike[str], *, preflight: float | None = None, trust_pickle: bool = False) -> RunSource:
    """Open a run by what ``path`` is: a ``.csv`` of predictions, a folder or file of torch dumps, or a training file.

    Args:
        path: the run.
        preflight: seconds a training file's metadata walk may take in a child process (None: in this process).
        trust_pickle: load torch dumps with code execution (``--trust-pickle``: files the user vouches for).

    Raises:
        BundleNotFoundError: nothing at ``path``.
        InputError, BundleFormatError, CheckpointError: the run cannot be read (one line saying why).
    """
    where = Path(path)
    if not where.exists():
        raise BundleNotFoundError(f"{where}: no such run; pass a training file, a dump folder or a prediction CSV")
    if where.suffix.lower() == ".csv":
        return PredictionRun(where)
    if where.is_dir() or where.suffix.lower() in DUMP_SUFFIXES:
        return DumpRun(where, trust_pickle=trust_pickle)
    return TrainingRun(where) if preflight is None else TrainingRun(where, preflight=preflight)
