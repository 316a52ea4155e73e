"""Which kind of run a path holds, and opening it: ``parity-train-diff`` takes any two."""

from __future__ import annotations

import os
from pathlib import Path

from parity_harness.common.errors import BundleNotFoundError, InputError
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
    if where.is_dir() or where.suffix.lower() in DUMP_SUFFIXES:  # a training file refuses such names as it is read
        return _without_crafted_names(DumpRun(where, trust_pickle=trust_pickle))
    return TrainingRun(where) if preflight is None else TrainingRun(where, preflight=preflight)


def _without_crafted_names(run: DumpRun) -> DumpRun:
    """``run``, refused (and closed) if a parameter or metric name holds a control character: the report would
    print a line of it (a forged ``all steps match``)."""
    names = [*run.parameter_names(), *(metric for info in run.steps().values() for metric in info.metrics)]
    crafted = next((name for name in names if not name.isprintable()), None)
    if crafted is not None:
        run.close()
        raise InputError(
            f"{run.path}: the name {crafted!r:.120} holds a control character (a report would print a line of it); "
            "refused as crafted"
        )
    return run
