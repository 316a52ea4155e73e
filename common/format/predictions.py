"""The per-sample prediction CSV: column names, header rules and the reader, shared by its writer and its reader.

A prediction CSV (``capture.record.predictions``, or any training script's own logging) is UTF-8 text, a header
row, then one row per sample. Known columns, matched case-insensitively: ``epoch`` (optional), ``batch_idx``
(also ``batch``, ``step``), ``sample_idx`` (also ``sample``, ``index``; optional: samples are then numbered in
file order within their batch), ``label`` (optional; also ``target``) and the logits ``logit_0 ... logit_{k-1}``
(also ``logits_0``, ``logit0``). Every other column holds a sample id; a sample may have several (an audio file
and its transcript), kept in header order.

Reading is bounded: a field longer than :data:`MAX_FIELD_CHARS`, a row with more than :data:`MAX_COLUMNS`
columns or longer than :data:`MAX_ROW_BYTES` is refused before it is held in memory, and a path that is not a
regular file (a FIFO, a device) is refused before it is opened, so a read never hangs.

A plain file (``plain_csv``: no quotes, every row whole, what writers produce) is read a block of columns at a
time, its numbers parsed by NumPy a column at once; any other file, and any file with a bad row, is read row by row,
whose errors name the line. Both give the same table (a 400,000-row file of one sample per batch: 4.9 s row by
row, 1.2 s by columns).
"""

from __future__ import annotations

import csv
import gc
import os
import re
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Final, NamedTuple, NoReturn, TypeAlias

import numpy as np

from parity_harness.common.errors import BundleFormatError, BundleNotFoundError, InputError
from parity_harness.common.format.plain_csv import read_plain_blocks, read_plain_header

__all__ = [
    "BATCH",
    "BATCH_ALIASES",
    "EPOCH",
    "LABEL",
    "LABEL_ALIASES",
    "LOGIT_PATTERN",
    "LOGIT_PREFIX",
    "MAX_COLUMNS",
    "MAX_FIELD_CHARS",
    "MAX_ROW_BYTES",
    "SAMPLE",
    "SAMPLE_ALIASES",
    "BatchKey",
    "PredictionBatch",
    "PredictionColumns",
    "PredictionTable",
    "classify_header",
    "logit_column",
    "read_prediction_csv",
]

# ---------------------------------------------------------------- column names

EPOCH: Final = "epoch"
BATCH: Final = "batch_idx"
SAMPLE: Final = "sample_idx"
LABEL: Final = "label"
LOGIT_PREFIX: Final = "logit_"
"""Names a writer uses; a reader also accepts the aliases below, in any letter case."""
BATCH_ALIASES: Final = (BATCH, "batch", "step")
SAMPLE_ALIASES: Final = (SAMPLE, "sample", "index")
LABEL_ALIASES: Final = (LABEL, "target")
LOGIT_PATTERN: Final = re.compile(r"logits?_?([0-9]+)")
"""A logit column, lower-cased and matched whole: ``logit_0``, ``logits_0``, ``logit0``; the group is its index."""

_ROLES: Final = {
    EPOCH: "epoch",
    **{name: "batch" for name in BATCH_ALIASES},
    **{name: "sample" for name in SAMPLE_ALIASES},
    **{name: "label" for name in LABEL_ALIASES},
}

# ---------------------------------------------------------------- bounds

MAX_FIELD_CHARS: Final = 1 << 20
"""Longest field read (1 MiB of characters): ids and numbers are short; a longer one is not a prediction CSV."""
MAX_COLUMNS: Final = 1_000_000
"""Most columns a row may have (counted by its separators before the row is split)."""
MAX_ROW_BYTES: Final = 64 << 20
"""Longest row read (64 MiB): a million full-precision logits fit; the bound keeps a damaged file from filling
memory."""
_SHOWN_CHARS: Final = 40
_WHOLE_NUMBERS: Final = re.compile(r"(?:[0-9]{1,18},)*[0-9]{1,18}")
"""A column of epoch, batch or sample numbers joined by commas, each as the row reader takes it unchanged."""

BatchKey: TypeAlias = tuple[int | None, int]
"""A batch's identity in a table: (epoch, or None when the file has no epoch column; batch number)."""


def logit_column(index: int) -> str:
    """The name a writer gives logit ``index``: ``logit_3``."""
    return f"{LOGIT_PREFIX}{index}"


# ---------------------------------------------------------------- results


@dataclass(frozen=True)
class PredictionColumns:
    """A classified header: the position of each known column, logits in index order, id columns in header order."""

    names: tuple[str, ...]
    """The header as written (stripped of surrounding spaces)."""
    batch: int
    logits: tuple[int, ...]
    epoch: int | None = None
    sample: int | None = None
    label: int | None = None
    ids: tuple[int, ...] = ()

    @property
    def id_names(self) -> tuple[str, ...]:
        """The id columns' names, in header order."""
        return tuple(self.names[position] for position in self.ids)


@dataclass(frozen=True, eq=False)
class PredictionBatch:
    """One batch's samples, sorted by sample index."""

    sample_indices: list[int]
    sample_ids: list[tuple[str, ...]]
    """Per sample, its ids (one entry per id column; empty tuples when the file has none)."""
    labels: np.ndarray | None
    """float64, shape (n,); None when the file has no label column."""
    logits: np.ndarray
    """float64, shape (n, k)."""


@dataclass(frozen=True, eq=False)
class PredictionTable:
    """A whole prediction CSV: its header and its batches, in (epoch, batch) order."""

    path: Path
    columns: PredictionColumns
    batches: dict[BatchKey, PredictionBatch] = field(default_factory=dict)

    @property
    def num_logits(self) -> int:
        """k: the logits per sample."""
        return len(self.columns.logits)


# ---------------------------------------------------------------- header


def classify_header(header: Sequence[str], *, where: str = "header") -> PredictionColumns:
    """Which column of ``header`` is which: known names and aliases (any case), logits, and the id columns.

    Args:
        header: the header row's cells.
        where: what error messages start with (``"run.csv:1"``).

    Raises:
        BundleFormatError: an unnamed or duplicate column, two aliases of one column, no batch column, no
            logit column, or logit indices that are not exactly 0..k-1.
    """
    names = tuple(cell.strip() for cell in header)
    seen: dict[str, int] = {}
    roles: dict[str, int] = {}
    logits: dict[int, int] = {}
    ids: list[int] = []
    for position, name in enumerate(names):
        key = name.lower()
        _check_name(seen, names, position, where)
        match = LOGIT_PATTERN.fullmatch(key)
        if key in _ROLES:
            _claim(roles, _ROLES[key], position, names, where)
        elif match:
            _claim_logit(logits, int(match[1]), position, names, where)
        else:
            ids.append(position)
    if "batch" not in roles:
        _fail(f"{where}: no batch column; expected one named {' or '.join(BATCH_ALIASES)}, got {_listing(names)}")
    return PredictionColumns(
        names, roles["batch"], _logit_order(logits, where), roles.get("epoch"), roles.get("sample"),
        roles.get("label"), tuple(ids),
    )  # fmt: skip


def _check_name(seen: dict[str, int], names: tuple[str, ...], position: int, where: str) -> None:
    """Refuse an empty name, or one that repeats an earlier column's (letter case aside); ``seen`` grows."""
    name = names[position]
    if not name:
        _fail(f"{where}: column {position + 1} has no name; name every column (batch_idx, logit_0, an id column...)")
    earlier = seen.setdefault(name.lower(), position)
    if earlier != position:
        _fail(
            f"{where}: column {position + 1} {name!r} repeats column {earlier + 1} {names[earlier]!r}; "
            "give each column its own name"
        )


def _claim(roles: dict[str, int], role: str, position: int, names: tuple[str, ...], where: str) -> None:
    """Record ``position`` as the ``role`` column, refused when another alias already named it."""
    if role in roles:
        _fail(
            f"{where}: both {names[roles[role]]!r} and {names[position]!r} name the {role} column; "
            "keep one of them (or rename the other to make it an id column)"
        )
    roles[role] = position


def _claim_logit(logits: dict[int, int], index: int, position: int, names: tuple[str, ...], where: str) -> None:
    """Record ``position`` as logit ``index``, refused when another column already is that logit."""
    if index in logits:
        _fail(f"{where}: both {names[logits[index]]!r} and {names[position]!r} are logit {index}; keep one")
    logits[index] = position


def _logit_order(logits: dict[int, int], where: str) -> tuple[int, ...]:
    """The logit columns' positions by index, refused unless the indices are exactly 0..k-1."""
    if not logits:
        _fail(f"{where}: no logit columns; expected {logit_column(0)}, {logit_column(1)}, ... (one per class)")
    missing = sorted(set(range(len(logits))) - set(logits))
    if missing:
        shown = ", ".join(logit_column(index) for index in missing[:5])
        _fail(
            f"{where}: logit columns must be numbered 0..{len(logits) - 1} without gaps; {shown} missing "
            f"(found indices up to {max(logits)}); number them from 0"
        )
    return tuple(logits[index] for index in range(len(logits)))


# ---------------------------------------------------------------- reading


def read_prediction_csv(path: str | os.PathLike[str]) -> PredictionTable:
    """Read a whole prediction CSV into its batches, each batch's samples sorted by sample index.

    Raises:
        BundleNotFoundError: nothing at ``path``.
        InputError: the file cannot be opened (permissions).
        BundleFormatError: the file is not a prediction CSV, or a row of it is bad; the one-line message names
            the file and line, what was expected and what was found.
    """
    source = _checked_path(Path(path))
    try:
        with source.open("rb") as raw, _csv_field_limit(MAX_FIELD_CHARS):
            return _read(source, raw)
    except OSError as err:
        raise InputError(f"{source}: cannot read the prediction CSV ({err.strerror}); check its permissions") from err


def _checked_path(path: Path) -> Path:
    """``path``, when it is a regular file (a FIFO or a device could block the read forever)."""
    if not path.exists():
        raise BundleNotFoundError(f"{path}: no such prediction CSV")
    if not path.is_file():
        _fail(f"{path}: not a regular file; pass a prediction CSV (header row, one row per sample)")
    return path


def _read(source: Path, raw: BinaryIO) -> PredictionTable:
    """The table, read by columns where the file is plain CSV, else (or for any error) row by row."""
    plain = _read_plain(source, raw)
    if plain is not None:
        return plain
    raw.seek(0)
    lines = _Lines(raw, source)
    records = _records(csv.reader(lines), lines)
    first = next(records, None)
    if first is None:
        _fail(f"{source}:1: empty file; expected a header row (batch_idx, logit_0, ...) then one row per sample")
    header, line = first
    table = _TableBuilder(source, classify_header(header, where=f"{source}:{line}"))
    for row, line in records:
        table.add(row, line)
    return table.build()


def _read_plain(source: Path, raw: BinaryIO) -> PredictionTable | None:
    """The table of a plain CSV (``plain_csv``) whose every row is good, read a block of columns at a time; None
    for any other file, which the row reader then reads (or refuses, naming the line)."""
    header = read_plain_header(raw, max_line_bytes=min(MAX_FIELD_CHARS, MAX_ROW_BYTES), max_columns=MAX_COLUMNS)
    if header is None:
        return None
    columns = classify_header(header, where=f"{source}:1")
    parts: list[_SampleColumns] = []
    for block in read_plain_blocks(raw, len(header), max_line_bytes=min(MAX_FIELD_CHARS, MAX_ROW_BYTES)):
        part = None if block is None else _block_columns(columns, block)
        if part is None:
            return None
        parts.append(part)
    if not parts:
        return None  # a header alone: the row reader's table
    batches = _sorted_batches(_joined(parts))
    return None if batches is None else PredictionTable(source, columns, batches)


def _block_columns(columns: PredictionColumns, fields: list[list[str]]) -> _SampleColumns | None:
    """A block's fields as typed columns; None when one is not what the row reader reads alike."""
    numbers: dict[str, np.ndarray] = {}
    for role, position in (("epoch", columns.epoch), ("batch", columns.batch), ("sample", columns.sample)):
        if position is not None:
            values = _whole_numbers(fields[position])
            if values is None:
                return None
            numbers[role] = values
    try:
        logits = np.array([fields[position] for position in columns.logits], dtype=np.float64).T
        labels = None if columns.label is None else np.array(fields[columns.label], dtype=np.float64)
    except ValueError:
        return None  # a field that is not a number: the row reader names it
    rows = len(fields[columns.batch])
    ids: list[tuple[str, ...]] = [()] * rows
    if columns.ids:
        ids = list(zip(*(fields[position] for position in columns.ids), strict=True))
    return _SampleColumns(numbers, ids, labels, logits)


def _whole_numbers(fields: list[str]) -> np.ndarray | None:
    """``fields`` as int64 when each is 1-18 ASCII digits, which the row reader reads alike; None otherwise (the
    row reader refuses such a field, or strips its spaces)."""
    if not _WHOLE_NUMBERS.fullmatch(",".join(fields)):
        return None
    return np.fromiter(map(int, fields), dtype=np.int64, count=len(fields))


class _SampleColumns(NamedTuple):
    """Samples as columns, in file order: epoch, batch and sample numbers (the columns the file has), ids, labels
    and logits (shape (samples, k))."""

    numbers: dict[str, np.ndarray]
    ids: list[tuple[str, ...]]
    labels: np.ndarray | None
    logits: np.ndarray


def _joined(parts: list[_SampleColumns]) -> _SampleColumns:
    """The blocks' columns as one."""
    if len(parts) == 1:
        return parts[0]
    numbers = {role: np.concatenate([part.numbers[role] for part in parts]) for role in parts[0].numbers}
    labels = [part.labels for part in parts if part.labels is not None]
    joined_labels = np.concatenate(labels) if labels else None
    ids = [sample for part in parts for sample in part.ids]
    return _SampleColumns(numbers, ids, joined_labels, np.concatenate([part.logits for part in parts]))


def _sorted_batches(samples: _SampleColumns) -> dict[BatchKey, PredictionBatch] | None:
    """The samples grouped into batches by (epoch, batch), batches in that order and samples by sample index (by
    file order without a sample column), as the row reader builds them; None when a sample repeats."""
    numbers = samples.numbers
    batch_numbers, sample_numbers = numbers["batch"], numbers.get("sample")
    rows = len(batch_numbers)
    epoch_order = numbers.get("epoch", np.full(rows, -1, dtype=np.int64))  # no epoch column: sorted as -1
    order = np.lexsort((batch_numbers, epoch_order) if sample_numbers is None else
                       (sample_numbers, batch_numbers, epoch_order))  # fmt: skip
    epoch_order, batch_numbers = epoch_order[order], batch_numbers[order]
    starts = np.flatnonzero(np.diff(epoch_order, prepend=-2) | np.diff(batch_numbers, prepend=-1))
    if sample_numbers is None:  # numbered in file order within the batch (lexsort is stable)
        sample_numbers = np.arange(rows) - np.repeat(starts, np.diff(starts, append=rows))
    else:
        sample_numbers = sample_numbers[order]
        in_batch = np.ones(rows, dtype=bool)
        in_batch[starts] = False
        if np.any((np.diff(sample_numbers) == 0) & in_batch[1:]):
            return None  # a repeated sample: the row reader names both lines
    ids, labels, logits = [samples.ids[i] for i in order.tolist()], samples.labels, samples.logits[order]
    labels = None if labels is None else labels[order]
    indices, bounds = sample_numbers.tolist(), [*starts.tolist(), rows]
    epoch_keys = epoch_order[starts].tolist() if "epoch" in numbers else [None] * len(starts)
    batches: dict[BatchKey, PredictionBatch] = {}
    batch_keys = zip(epoch_keys, batch_numbers[starts].tolist(), strict=True)
    with _collector_paused():
        for (epoch, batch), start, end in zip(batch_keys, bounds, bounds[1:], strict=False):
            batch_labels = None if labels is None else labels[start:end]
            batches[(epoch, batch)] = PredictionBatch(indices[start:end], ids[start:end], batch_labels,
                                                      logits[start:end])  # fmt: skip
    return batches


@contextmanager
def _collector_paused() -> Iterator[None]:
    """No garbage collection while batches are made: they hold no cycles, and a file of one sample per batch makes
    hundreds of thousands, whose collections took more than half the read (a 400,000-row file: 2.3 s, 1.0 without)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


_LIMIT_LOCK: Final = threading.Lock()


@contextmanager
def _csv_field_limit(limit: int) -> Iterator[None]:
    """csv's field limit is process-wide: set for this read only, and under a lock so that two reads in threads
    do not restore each other's value."""
    with _LIMIT_LOCK:
        previous = csv.field_size_limit(limit)
        try:
            yield
        finally:
            csv.field_size_limit(previous)


class _Lines:
    """The file's lines, decoded, for ``csv.reader``: each row is bounded (bytes, separators) before csv holds
    it, and decoding line by line puts a bad byte on its true line."""

    def __init__(self, raw: BinaryIO, path: Path) -> None:
        self.raw, self.path = raw, path
        self.number = 0
        self.row_bytes = self.row_commas = 0

    def __iter__(self) -> _Lines:
        return self

    def __next__(self) -> str:
        data = self.raw.readline(MAX_ROW_BYTES + 1)
        if not data:
            raise StopIteration
        self.number += 1
        self.row_bytes += len(data)
        self.row_commas += data.count(b",")
        if self.row_bytes > MAX_ROW_BYTES:
            _fail(f"{self._where()}: row longer than {MAX_ROW_BYTES:,} bytes (the limit); is this a prediction CSV?")
        if self.row_commas >= MAX_COLUMNS:
            _fail(f"{self._where()}: row has more than {MAX_COLUMNS:,} columns (the limit); is this a prediction CSV?")
        return self._decode(data.removeprefix(b"\xef\xbb\xbf") if self.number == 1 else data)

    def start_row(self) -> None:
        """The next line starts a new row: its bounds count from zero."""
        self.row_bytes = self.row_commas = 0

    def _decode(self, data: bytes) -> str:
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as err:
            _fail(
                f"{self._where()}: not UTF-8 text (byte {data[err.start]:#04x} at byte {err.start + 1} of the line); "
                "save the file as UTF-8"
            )
        if "\0" in text:
            _fail(f"{self._where()}: not text (a NUL character at column {text.index(chr(0)) + 1}); pass a CSV file")
        return text

    def _where(self) -> str:
        return f"{self.path}:{self.number}"


def _records(reader: Iterator[list[str]], lines: _Lines) -> Iterator[tuple[list[str], int]]:
    """Each non-blank row and the line it ends on; csv's own errors as BundleFormatError."""
    while True:
        lines.start_row()
        try:
            row = next(reader, None)
        except csv.Error as err:
            _fail(f"{lines.path}:{lines.number}: {_csv_problem(err)}")
        if row is None:
            return
        if row:
            yield row, lines.number


def _csv_problem(err: csv.Error) -> str:
    """What csv's own error means here, and how to fix it."""
    problem = str(err)
    if "field limit" in problem:
        return (
            f"a field is longer than {MAX_FIELD_CHARS:,} characters (the limit); keep ids and numbers shorter, or "
            "check that this is a prediction CSV"
        )
    if "new-line character" in problem:
        return "a line ends in a bare carriage return (\\r); save the file with \\n or \\r\\n line ends"
    return f"{problem}; check the CSV quoting"


class _Row(NamedTuple):
    sample: int
    ids: tuple[str, ...]
    label: float | None
    logits: np.ndarray
    line: int


class _TableBuilder:
    """Rows parsed one by one into batches; duplicates refused with both lines."""

    def __init__(self, path: Path, columns: PredictionColumns) -> None:
        self.path, self.columns = path, columns
        self.rows: dict[BatchKey, list[_Row]] = {}
        self.seen: dict[tuple[BatchKey, int], int] = {}

    def add(self, row: list[str], line: int) -> None:
        """Parse one sample's row into its batch."""
        where, columns = f"{self.path}:{line}", self.columns
        if len(row) != len(columns.names):
            _fail(
                f"{where}: {len(row)} fields, expected {len(columns.names)} (one per header column); give every "
                "row a value in every column (a stray or missing comma? an id with a comma must be quoted)"
            )
        epoch = None if columns.epoch is None else _index(row, columns.epoch, columns, where)
        key: BatchKey = (epoch, _index(row, columns.batch, columns, where))
        batch = self.rows.setdefault(key, [])
        sample = len(batch) if columns.sample is None else _index(row, columns.sample, columns, where)
        self._check_unique(key, sample, where, line)
        label = None if columns.label is None else float(_floats(row, (columns.label,), columns, where)[0])
        ids = tuple(row[position] for position in columns.ids)
        batch.append(_Row(sample, ids, label, _floats(row, columns.logits, columns, where), line))

    def _check_unique(self, key: BatchKey, sample: int, where: str, line: int) -> None:
        earlier = self.seen.setdefault((key, sample), line)
        if earlier != line:
            epoch = "" if key[0] is None else f"epoch {key[0]}, "
            _fail(
                f"{where}: sample {sample} of {epoch}batch {key[1]} is already on line {earlier}; "
                "each (epoch, batch, sample) may appear once: remove the repeated row or fix its sample_idx"
            )

    def build(self) -> PredictionTable:
        """The batches in (epoch, batch) order."""
        order = sorted(self.rows, key=lambda key: (-1 if key[0] is None else key[0], key[1]))
        batches = {key: _batch(self.rows[key], self.columns) for key in order}
        return PredictionTable(self.path, self.columns, batches)


def _batch(rows: list[_Row], columns: PredictionColumns) -> PredictionBatch:
    """A batch's rows as arrays, sorted by sample index."""
    rows = sorted(rows, key=lambda row: row.sample)
    # One row (a batch of one): its own copy, not np.stack's generality, nor a view keeping the row's array alive.
    logits = rows[0].logits.reshape(1, -1).copy() if len(rows) == 1 else np.stack([row.logits for row in rows])
    labels = None if columns.label is None else np.array([row.label for row in rows], dtype=np.float64)
    return PredictionBatch([row.sample for row in rows], [row.ids for row in rows], labels, logits)


def _index(row: list[str], position: int, columns: PredictionColumns, where: str) -> int:
    """A non-negative whole number (epoch, batch, sample)."""
    text = row[position].strip()
    digits = text.removeprefix("-")
    if not (digits.isascii() and digits.isdigit()):
        _fail(
            f"{where}: column {columns.names[position]!r} must be a whole number >= 0, got {_shown(row[position])}; "
            "write it as 0, 1, 2, ..."
        )
    if text.startswith("-"):
        _fail(
            f"{where}: column {columns.names[position]!r} is negative ({text}); expected a number >= 0 "
            "(count epochs, batches and samples from 0)"
        )
    if len(digits) > 18:  # past int64, and past what int() parses without a digit limit
        _fail(f"{where}: column {columns.names[position]!r} is {_shown(row[position])}, expected a number < 10**18")
    return int(text)


def _floats(row: list[str], positions: tuple[int, ...], columns: PredictionColumns, where: str) -> np.ndarray:
    """The fields at ``positions`` as float64 (``nan``, ``inf``, ``-inf`` included)."""
    values = [row[position] for position in positions]
    try:
        return np.asarray(values, dtype=np.float64)
    except ValueError:
        for position in positions:
            try:
                float(row[position])
            except ValueError:
                _fail(
                    f"{where}: column {columns.names[position]!r} must be a number (nan and inf are allowed), "
                    f"got {_shown(row[position])}"
                )
        return np.array([float(value) for value in values], dtype=np.float64)


def _shown(text: str) -> str:
    """A field as messages quote it: repr'd (one line), cut to a few dozen characters."""
    return repr(text) if len(text) <= _SHOWN_CHARS else f"{text[:_SHOWN_CHARS]!r}... ({len(text):,} characters)"


def _listing(names: tuple[str, ...]) -> str:
    """A header as messages show it: the first few names."""
    shown = ", ".join(repr(name) for name in names[:8])
    return f"[{shown}{', ...' if len(names) > 8 else ''}]"


def _fail(message: str) -> NoReturn:
    raise BundleFormatError(message)
