"""Log per-sample predictions of a training run to a CSV that ``parity-train-diff`` reads: a few calls, any loop.

    from parity_harness.capture.record import predictions

    predictions.init("run.csv", every=10, id_columns=("audio_file", "transcript_file"))
    for batch_idx, (inputs, labels, files, texts) in enumerate(loader):
        logits = model(inputs)
        predictions.log_batch(batch_idx, logits, epoch=epoch, labels=labels,
                              sample_ids={"audio_file": files, "transcript_file": texts})
    predictions.close()

Standard library only, at import time and after: it goes into any training script, whatever that script's
environment holds. Logits and labels are taken by duck typing (``.detach().cpu().tolist()``, ``.tolist()``,
or plain lists), so torch tensors, NumPy arrays and lists all work without this module importing either.

The header is written with the first logged batch (it fixes the logit count, and whether the file has
``epoch`` and ``label`` columns); the file is flushed after every logged batch, so a reader sees whole
batches while training runs. The format and its reader live in ``common.format.predictions``.
"""

from __future__ import annotations

import csv
import operator
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Final, TextIO

from parity_harness.common.errors import BundleExistsError, InputError

__all__ = ["PredictionLogger", "close", "init", "log_batch"]

# The header names of common.format.predictions, repeated here on purpose: that module imports NumPy (it reads
# the file into arrays), and this logger must import with the standard library alone.
# tests/capture/test_prediction_logger.py checks that both spell them alike.
EPOCH: Final = "epoch"
BATCH: Final = "batch_idx"
SAMPLE: Final = "sample_idx"
LABEL: Final = "label"
LOGIT_PREFIX: Final = "logit_"
# Names the reader takes for its own columns (aliases included), so not usable as id columns.
_RESERVED: Final = frozenset({EPOCH, BATCH, SAMPLE, LABEL, "batch", "step", "sample", "index", "target"})
_LOGIT: Final = re.compile(r"logits?_?[0-9]+")

_current: PredictionLogger | None = None


class PredictionLogger:
    """Writes one CSV row per sample of every ``every``-th batch; a context manager that closes the file.

    Args:
        path: the CSV to create.
        every: log the batches whose ``batch_idx % every == 0``.
        id_columns: the names of the sample-id columns, in order (an audio file and its transcript: two).
        overwrite: replace an existing file (refused otherwise).

    Raises:
        BundleExistsError: ``path`` exists and ``overwrite`` is false.
        InputError: ``every`` is not a positive integer, an id column is unnamed, repeated or a name the
            reader keeps for its own columns, or the file cannot be created.
    """

    def __init__(
        self, path: str | os.PathLike[str], *, every: int = 1, id_columns: Sequence[str] = ("sample_id",),
        overwrite: bool = False,
    ) -> None:  # fmt: skip
        self.path = Path(path)
        self.every = _positive(every, "every")
        self.id_columns = _id_columns(id_columns)
        handle = _create(self.path, overwrite=overwrite)
        self._file: TextIO | None = handle
        self._writer = csv.writer(handle)
        self._shape: tuple[int, bool, bool] | None = None
        """(logits per sample, has epochs, has labels), fixed by the first logged batch."""
        self._logged: set[tuple[int | None, int]] = set()

    def log_batch(
        self, batch_idx: int, logits: Any, *, epoch: int | None = None, labels: Any = None, sample_ids: Any = None
    ) -> None:
        """Write the batch's rows (when ``batch_idx % every == 0``) and flush them.

        Args:
            batch_idx: the batch number (>= 0).
            logits: shape (samples, classes): a tensor, an array or a list of lists.
            epoch: the epoch (>= 0), or None for a run without epochs; given for every batch or for none.
            labels: per sample, its class index; given for every batch or for none.
            sample_ids: per sample, its ids: a sequence of str (one id column), a sequence of tuples (one
                entry per id column), or a mapping id column -> sequence; None writes empty ids.

        Raises:
            InputError: a bad number or shape, lengths that differ, a logit count or the presence of epochs or
                labels that differs from the first batch, a batch logged twice, or a closed logger.
        """
        if self._file is None:
            raise InputError(f"{self.path}: the logger is closed; call predictions.init(path) again to log more")
        batch = _index(batch_idx, "batch_idx", f"{self.path}")
        if batch % self.every != 0:
            return
        key = (None if epoch is None else _index(epoch, "epoch", f"{self.path}: batch {batch}"), batch)
        where = f"{self.path}: batch {batch}" + ("" if epoch is None else f" of epoch {key[0]}")
        rows = _rows(logits, where)
        label_list = None if labels is None else _labels(labels, where)
        ids = _sample_ids(sample_ids, self.id_columns, len(rows), where)
        self._check(where, key, rows, label_list, ids)
        self._write(key, rows, label_list, ids)

    def close(self) -> None:
        """Close the file (again: nothing); it stops being the current logger."""
        global _current
        if _current is self:
            _current = None
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> PredictionLogger:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.close()

    def _check(
        self,
        where: str,
        key: tuple[int | None, int],
        rows: list[list[float]],
        labels: list[str] | None,
        ids: list[tuple[str, ...]],
    ) -> None:
        """Refuse a batch that does not fit itself or the batches before it."""
        if labels is not None and len(labels) != len(rows):
            raise InputError(f"{where}: {len(labels)} labels for {len(rows)} rows of logits; give one per sample")
        if len(ids) != len(rows):
            raise InputError(f"{where}: {len(ids)} sample ids for {len(rows)} rows of logits; give one per sample")
        if key in self._logged:
            raise InputError(f"{where}: logged twice; log each batch once (pass epoch= when batch numbers restart)")
        if rows:  # an empty batch writes nothing, so it fixes nothing
            self._check_shape(where, (len(rows[0]), key[0] is not None, labels is not None))

    def _check_shape(self, where: str, shape: tuple[int, bool, bool]) -> None:
        """The logit count and the presence of epochs and labels are those of the first logged batch."""
        first = self._shape or shape
        if shape[0] != first[0]:
            raise InputError(f"{where}: {shape[0]} logits per sample, the first batch had {first[0]}; keep it fixed")
        for present, expected, name in ((shape[1], first[1], "epoch"), (shape[2], first[2], "labels")):
            if present != expected:
                given = "given" if expected else "not given"
                raise InputError(f"{where}: {name} {given} for the first batch; give it for every batch or none")

    def _write(
        self, key: tuple[int | None, int], rows: list[list[float]], labels: list[str] | None, ids: list[tuple[str, ...]]
    ) -> None:
        """Write the header (first batch), then one row per sample, then flush."""
        assert self._file is not None  # _check refused a closed logger
        if not rows:
            return
        if self._shape is None:
            self._shape = (len(rows[0]), key[0] is not None, labels is not None)
            self._writer.writerow(self._header())
        epoch = [] if key[0] is None else [str(key[0])]
        for sample, logits in enumerate(rows):
            label = [] if labels is None else [labels[sample]]
            self._writer.writerow([*epoch, str(key[1]), str(sample), *label, *ids[sample], *map(repr, logits)])
        self._logged.add(key)
        self._file.flush()

    def _header(self) -> list[str]:
        assert self._shape is not None
        count, epochs, labels = self._shape
        return [
            *([EPOCH] if epochs else []), BATCH, SAMPLE, *([LABEL] if labels else []), *self.id_columns,
            *(f"{LOGIT_PREFIX}{index}" for index in range(count)),
        ]  # fmt: skip


def init(
    path: str | os.PathLike[str], every: int = 1, id_columns: Sequence[str] = ("sample_id",), overwrite: bool = False
) -> PredictionLogger:
    """Start logging to ``path``; the new logger becomes the current one (a current one before it is closed).

    Raises:
        BundleExistsError, InputError: as :class:`PredictionLogger`.
    """
    global _current
    logger = PredictionLogger(path, every=every, id_columns=id_columns, overwrite=overwrite)
    if _current is not None:
        _current.close()
    _current = logger
    return logger


def log_batch(
    batch_idx: int, logits: Any, *, epoch: int | None = None, labels: Any = None, sample_ids: Any = None
) -> None:
    """:meth:`PredictionLogger.log_batch` of the current logger.

    Raises:
        InputError: no logger was started with :func:`init`, or as :meth:`PredictionLogger.log_batch`.
    """
    if _current is None:
        raise InputError("no prediction logger; call predictions.init(path) before predictions.log_batch(...)")
    _current.log_batch(batch_idx, logits, epoch=epoch, labels=labels, sample_ids=sample_ids)


def close() -> None:
    """Close the current logger, if any."""
    if _current is not None:
        _current.close()


# ---------------------------------------------------------------- values in


def _create(path: Path, *, overwrite: bool) -> TextIO:
    """The file, opened for writing; an existing one is kept unless ``overwrite``. Not written through a temporary
    file and a rename like the other formats: a reader must see the batches while the run goes on."""
    try:
        return path.open("w" if overwrite else "x", encoding="utf-8", newline="")
    except FileExistsError as err:
        raise BundleExistsError(f"{path}: file exists; pass overwrite=True to replace it") from err
    except OSError as err:
        raise InputError(f"{path}: cannot create the prediction CSV ({err.strerror}); check the folder") from err


def _plain(value: Any) -> Any:
    """A tensor, array or sequence as nested Python lists and numbers."""
    for step in ("detach", "cpu"):
        if hasattr(value, step):
            value = getattr(value, step)()
    return value.tolist() if hasattr(value, "tolist") else value


def _rows(logits: Any, where: str) -> list[list[float]]:
    """Logits as one list of floats per sample, refused unless 2-D (samples, classes) and numeric."""
    plain = _plain(logits)
    try:
        rows = [[float(x) for x in row] for row in plain]
    except (TypeError, ValueError) as err:
        raise InputError(
            f"{where}: logits must be numbers of shape (samples, classes), got {type(logits).__name__} ({err}); "
            "pass a 2-D tensor, array or list of lists"
        ) from err
    if len({len(row) for row in rows}) > 1:
        raise InputError(f"{where}: logits rows differ in length; pass a 2-D tensor, array or list of lists")
    if rows and not rows[0]:
        raise InputError(f"{where}: logits have no classes (shape (samples, 0)); pass one logit per class")
    return rows


def _labels(labels: Any, where: str) -> list[str]:
    """Labels as text: whole numbers as ``3``, others as floats."""
    plain = _plain(labels)
    try:
        return [str(int(x)) if float(x).is_integer() else repr(float(x)) for x in plain]
    except (TypeError, ValueError, OverflowError) as err:
        raise InputError(f"{where}: labels must be one number per sample, got {type(labels).__name__} ({err})") from err


def _sample_ids(ids: Any, columns: tuple[str, ...], count: int, where: str) -> list[tuple[str, ...]]:
    """Per sample, one id per id column (empty ids when None)."""
    if ids is None:
        return [("",) * len(columns)] * count
    if isinstance(ids, Mapping):
        return _ids_by_column(ids, columns, where)
    if isinstance(ids, (str, bytes)):
        raise InputError(f"{where}: sample_ids is one string ({ids[:40]!r}); give one id per sample")
    plain = _plain(ids)
    return [_ids_of(entry, columns, where) for entry in plain]


def _ids_by_column(ids: Mapping[str, Any], columns: tuple[str, ...], where: str) -> list[tuple[str, ...]]:
    """``{column: ids}`` as per-sample tuples in ``columns`` order; every column given, each as long."""
    if set(ids) != set(columns):
        raise InputError(
            f"{where}: sample_ids has columns {sorted(ids)}, the logger was started with {list(columns)}; "
            "give one entry per id column"
        )
    values = [[str(x) for x in _plain(ids[column])] for column in columns]
    if len({len(column) for column in values}) > 1:
        lengths = ", ".join(f"{name}: {len(column)}" for name, column in zip(columns, values, strict=True))
        raise InputError(f"{where}: sample_ids columns differ in length ({lengths}); give one id per sample in each")
    return list(zip(*values, strict=True))


def _ids_of(entry: Any, columns: tuple[str, ...], where: str) -> tuple[str, ...]:
    """One sample's ids: a single value (one id column) or a tuple with one per column."""
    parts = [entry] if isinstance(entry, (str, bytes)) or not isinstance(entry, Iterable) else list(entry)
    if len(parts) != len(columns):
        raise InputError(
            f"{where}: a sample has {len(parts)} ids ({entry!r:.60}), the logger has {len(columns)} id columns "
            f"{list(columns)}; give a tuple per sample or a mapping column -> ids"
        )
    return tuple(str(part) for part in parts)


def _index(value: Any, name: str, where: str) -> int:
    """A non-negative whole number (an int, a NumPy integer, a 0-d integer tensor)."""
    try:
        number = operator.index(value)
    except TypeError as err:
        raise InputError(f"{where}: {name} must be a whole number >= 0, got {value!r}") from err
    if number < 0 or isinstance(value, bool):
        raise InputError(f"{where}: {name} must be a whole number >= 0, got {value!r}")
    return number


def _positive(value: Any, name: str) -> int:
    """A whole number >= 1 (an option of the logger)."""
    if _index(value, name, "PredictionLogger") < 1:
        raise InputError(f"PredictionLogger: {name} must be a whole number >= 1, got {value!r}")
    return int(value)


def _id_columns(names: Sequence[str]) -> tuple[str, ...]:
    """The id columns' names, refused when empty, repeated, or a name the reader would take for another column."""
    columns = (names,) if isinstance(names, str) else tuple(str(name) for name in names)
    lowered = [name.strip().lower() for name in columns]
    for name, low in zip(columns, lowered, strict=True):
        if not low or low in _RESERVED or _LOGIT.fullmatch(low) or lowered.count(low) > 1:
            raise InputError(
                f"id column {name!r} is unnamed, repeated, or a reserved name ({BATCH}, {LOGIT_PREFIX}0, ...); "
                "give each id column its own name"
            )
    return columns
