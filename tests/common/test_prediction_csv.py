"""The per-sample prediction CSV as a format: header rules, the reader, and one precise error per kind of bad input."""

from __future__ import annotations

import csv
import gc
import os
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from parity_harness.common.errors import BundleFormatError, BundleNotFoundError, InputError
from parity_harness.common.format import plain_csv, predictions
from parity_harness.common.format.predictions import (
    MAX_COLUMNS,
    MAX_FIELD_CHARS,
    PredictionColumns,
    classify_header,
    read_prediction_csv,
)


def write(tmp_path: Path, content: str | bytes, name: str = "run.csv") -> Path:
    """A file holding ``content`` (text is written as UTF-8, line endings untouched)."""
    path = tmp_path / name
    path.write_bytes(content.encode("utf-8") if isinstance(content, str) else content)
    return path


def format_error(path: Path) -> str:
    """The one-line BundleFormatError message that reading ``path`` gives."""
    with pytest.raises(BundleFormatError) as caught:
        read_prediction_csv(path)
    message = str(caught.value)
    assert "\n" not in message, message
    return message


# ---------------------------------------------------------------- header


@pytest.mark.parametrize(
    ("header", "expected"),
    [
        (["batch_idx", "logit_0"], PredictionColumns(("batch_idx", "logit_0"), 0, (1,))),
        (
            ["epoch", "batch_idx", "sample_idx", "label", "sample_id", "logit_0", "logit_1"],
            PredictionColumns(
                ("epoch", "batch_idx", "sample_idx", "label", "sample_id", "logit_0", "logit_1"), 1, (5, 6), 0, 2, 3,
                (4,),
            ),
        ),
        (
            ["Step", " INDEX ", "Target", "audio_file", "transcript_file", "Logits_1", "logits_0"],
            PredictionColumns(
                ("Step", "INDEX", "Target", "audio_file", "transcript_file", "Logits_1", "logits_0"), 0, (6, 5), None,
                1, 2, (3, 4),
            ),
        ),
        (["logit1", "batch", "sample", "logit0"], PredictionColumns(("logit1", "batch", "sample", "logit0"), 1, (3, 0),
                                                                    sample=2)),
    ],
    ids=["minimal", "every-known-column", "aliases-any-case-logits-out-of-order", "logit-without-underscore"],
)  # fmt: skip
def test_header_is_classified(header: list[str], expected: PredictionColumns) -> None:
    """Known names and their aliases are found in any case; logits are ordered by index; the rest are ids."""
    assert classify_header(header) == expected


def test_id_columns_keep_header_order() -> None:
    """Every unknown column is an id column, named in header order."""
    columns = classify_header(["transcript_file", "batch_idx", "audio_file", "logit_0", "speaker"])
    assert columns.id_names == ("transcript_file", "audio_file", "speaker")


@pytest.mark.parametrize(
    ("header", "fragment"),
    [
        (["sample_idx", "logit_0"], "no batch column"),
        (["batch_idx", "sample_idx", "audio_file"], "no logit columns"),
        (["batch_idx", "logit_0", "logit_2"], "logit_1 missing"),
        (["batch_idx", "logit_1", "logit_2"], "logit_0"),
        (["batch_idx", "logit_0", "id", "ID"], "repeats column 3 'id'"),
        (["batch_idx", "logit_0", "logit_0"], "repeats column"),
        (["batch_idx", "logit_0", "logit0"], "are logit 0"),
        (["batch", "step", "logit_0"], "both 'batch' and 'step' name the batch column"),
        (["batch_idx", "label", "target", "logit_0"], "name the label column"),
        (["batch_idx", "", "logit_0"], "column 2 has no name"),
    ],
    ids=[
        "no-batch", "no-logits", "logit-gap", "logits-not-from-0", "duplicate-name-any-case", "duplicate-logit-name",
        "one-logit-two-spellings", "two-batch-aliases", "two-label-aliases", "unnamed-column",
    ],
)  # fmt: skip
def test_bad_header_is_refused(tmp_path: Path, header: list[str], fragment: str) -> None:
    """A header that cannot be read one way is refused, naming the file, line 1 and the problem."""
    with pytest.raises(BundleFormatError, match=r"^header: ") as caught:
        classify_header(header)
    assert fragment in str(caught.value)
    path = write(tmp_path, ",".join(header) + "\n")
    message = format_error(path)
    assert message.startswith(f"{path}:1: ")
    assert fragment in message


# ---------------------------------------------------------------- reading


def test_batches_are_read_sorted_with_their_ids_labels_and_logits(tmp_path: Path) -> None:
    """Rows in any order become batches in (epoch, batch) order, samples by index; ids keep every column."""
    path = write(
        tmp_path,
        "epoch,batch_idx,sample_idx,label,audio_file,transcript_file,logit_0,logit_1\n"
        '1,0,1,0,"a,1.wav",a1.txt,0.5,-1.5\n'
        "1,0,0,1,a0.wav,a0.txt,2,3\n"
        "0,7,0,1,b0.wav,b0.txt,nan,inf\n",
    )
    table = read_prediction_csv(path)
    assert list(table.batches) == [(0, 7), (1, 0)]
    assert table.num_logits == 2
    assert table.columns.id_names == ("audio_file", "transcript_file")
    batch = table.batches[(1, 0)]
    assert batch.sample_indices == [0, 1]
    assert batch.sample_ids == [("a0.wav", "a0.txt"), ("a,1.wav", "a1.txt")]
    assert batch.labels is not None
    assert batch.labels.dtype == np.float64
    assert batch.labels.tolist() == [1.0, 0.0]
    assert batch.logits.dtype == np.float64
    assert batch.logits.tolist() == [[2.0, 3.0], [0.5, -1.5]]


@pytest.mark.parametrize(
    ("text", "expected"),
    [("nan", np.nan), ("NaN", np.nan), ("inf", np.inf), ("-inf", -np.inf), ("Infinity", np.inf), (" 1e-3 ", 1e-3)],
    ids=["nan", "NaN", "inf", "minus-inf", "Infinity", "spaces-around"],
)
def test_nan_and_inf_are_values(tmp_path: Path, text: str, expected: float) -> None:
    """NaN and infinities spelled as Python spells them are logits like any other."""
    path = write(tmp_path, f"batch_idx,logit_0\n0,{text}\n")
    assert np.array_equal(read_prediction_csv(path).batches[(None, 0)].logits, [[expected]], equal_nan=True)


def test_a_file_without_epochs_samples_or_labels(tmp_path: Path) -> None:
    """No epoch column: keys have epoch None; no sample column: file order; no label column: labels None."""
    path = write(tmp_path, "step,logit0\n3,1\n3,2\n1,5\n")
    table = read_prediction_csv(path)
    assert list(table.batches) == [(None, 1), (None, 3)]
    assert table.batches[(None, 3)].sample_indices == [0, 1]
    assert table.batches[(None, 3)].logits.tolist() == [[1.0], [2.0]]
    assert table.batches[(None, 3)].labels is None
    assert table.batches[(None, 3)].sample_ids == [(), ()]


@pytest.mark.parametrize(
    "content",
    [
        b"\xef\xbb\xbfbatch_idx,id,logit_0\r\n0,x,1\r\n\r\n",
        b"batch_idx,id,logit_0\n\n0,x,1",
        b'batch_idx,id,logit_0\n0,"x",1\n',
    ],
    ids=["bom-and-crlf-and-blank-line", "blank-line-and-no-final-newline", "quoted-id"],
)
def test_ordinary_csv_variants_are_read(tmp_path: Path, content: bytes) -> None:
    """A byte-order mark, CRLF line ends, blank lines and quoting are what spreadsheet tools write."""
    table = read_prediction_csv(write(tmp_path, content))
    assert table.columns.id_names == ("id",)
    assert table.batches[(None, 0)].sample_ids == [("x",)]


def test_an_id_may_hold_a_line_break(tmp_path: Path) -> None:
    """A quoted id spanning two lines is one field, and a later error names the line it is on."""
    path = write(tmp_path, 'batch_idx,id,logit_0\n0,"two\nlines",1\n1,y,oops\n')
    message = format_error(path)
    assert message.startswith(f"{path}:4: ")
    table_path = write(tmp_path, 'batch_idx,id,logit_0\n0,"two\nlines",1\n', name="ok.csv")
    assert read_prediction_csv(table_path).batches[(None, 0)].sample_ids == [("two\nlines",)]


# ---------------------------------------------------------------- bad input


HEADER = "epoch,batch_idx,sample_idx,label,id,logit_0,logit_1\n"
GOOD = "0,0,0,1,a,0.5,1.5\n"


@pytest.mark.parametrize(
    ("content", "line", "fragment"),
    [
        (HEADER + GOOD + "0,1.5,0,1,b,0,0\n", 3, "'batch_idx' must be a whole number >= 0, got '1.5'"),
        (HEADER + "x,0,0,1,a,0,0\n", 2, "'epoch' must be a whole number >= 0, got 'x'"),
        (HEADER + "0,0,first,1,a,0,0\n", 2, "'sample_idx' must be a whole number >= 0, got 'first'"),
        (HEADER + "0,-1,0,1,a,0,0\n", 2, "'batch_idx' is negative (-1)"),
        (HEADER + "0,0,-3,1,a,0,0\n", 2, "'sample_idx' is negative (-3)"),
        (HEADER + "0,0,0,1,a,0,high\n", 2, "'logit_1' must be a number (nan and inf are allowed), got 'high'"),
        (HEADER + "0,0,0,1,a,0,\n", 2, "'logit_1' must be a number"),
        (HEADER + "0,0,0,cat,a,0,0\n", 2, "'label' must be a number"),
        (HEADER + GOOD + "0,0,1,1,a,0\n", 3, "6 fields, expected 7"),
        (HEADER + GOOD + "0,0,1,1,a,b,0,0\n", 3, "8 fields, expected 7"),
        (HEADER + GOOD + "0,1,0,1,b,0,0\n" + GOOD, 4, "sample 0 of epoch 0, batch 0 is already on line 2"),
        ((HEADER + GOOD).encode() + b"0,0,0,1,\xff,0,0\n", 3, "not UTF-8 text (byte 0xff"),
        (HEADER + GOOD + "0,0,1,1,a\x00b,0,0\n", 3, "not text (a NUL character"),
        (b"", 1, "empty file"),
        (b"\n\r\n\n", 1, "empty file"),
        (b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR", 1, "not UTF-8 text"),
        (b"batch_idx,logit_0\r0,1\r", 1, "bare carriage return"),
    ],
    ids=[
        "fractional-batch", "non-integer-epoch", "non-integer-sample", "negative-batch", "negative-sample",
        "non-numeric-logit", "empty-logit", "non-numeric-label", "too-few-fields", "too-many-fields",
        "duplicate-sample", "not-utf8", "nul-character", "empty-file", "only-blank-lines", "binary-file",
        "carriage-return-line-ends",
    ],
)  # fmt: skip
def test_bad_input_is_one_precise_error(tmp_path: Path, content: str | bytes, line: int, fragment: str) -> None:
    """Each kind of bad input is one BundleFormatError line naming the file, the line and what is wrong."""
    path = write(tmp_path, content)
    message = format_error(path)
    assert message.startswith(f"{path}:{line}: "), message
    assert fragment in message, message


def test_missing_file_is_not_found(tmp_path: Path) -> None:
    """Nothing at the path: BundleNotFoundError (a FileNotFoundError), naming the path."""
    with pytest.raises(BundleNotFoundError, match="no such prediction CSV"):
        read_prediction_csv(tmp_path / "absent.csv")


def test_a_folder_is_refused(tmp_path: Path) -> None:
    """A folder named like a CSV is not read."""
    assert "not a regular file" in format_error(tmp_path)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs on this platform")
def test_a_fifo_is_refused_without_blocking(tmp_path: Path) -> None:
    """A FIFO (whose open would wait for a writer forever) is refused before it is opened."""
    fifo = tmp_path / "pipe.csv"
    os.mkfifo(fifo)
    assert "not a regular file" in format_error(fifo)


# ---------------------------------------------------------------- bounds


def test_a_field_at_the_limit_is_read(tmp_path: Path) -> None:
    """An id of exactly MAX_FIELD_CHARS characters is still a field."""
    path = write(tmp_path, f"batch_idx,id,logit_0\n0,{'x' * MAX_FIELD_CHARS},1\n")
    assert len(read_prediction_csv(path).batches[(None, 0)].sample_ids[0][0]) == MAX_FIELD_CHARS


@pytest.mark.parametrize("quoted", [False, True], ids=["plain", "quoted"])
def test_a_field_over_the_limit_is_refused_fast(tmp_path: Path, quoted: bool) -> None:
    """One character more than MAX_FIELD_CHARS is refused at once, naming the line; csv's own limit is restored."""
    field = "x" * (MAX_FIELD_CHARS + 1)
    cell = f'"{field}"' if quoted else field
    path = write(tmp_path, f"batch_idx,id,logit_0\n0,a,1\n0,{cell},1\n")
    before = csv.field_size_limit()
    start = time.perf_counter()
    message = format_error(path)
    assert time.perf_counter() - start < 5
    assert message.startswith(f"{path}:3: a field is longer than {MAX_FIELD_CHARS:,} characters")
    assert csv.field_size_limit() == before


def test_csv_field_limit_is_restored_after_a_read(tmp_path: Path) -> None:
    """Reading leaves the process-wide csv field limit as it found it."""
    before = csv.field_size_limit()
    read_prediction_csv(write(tmp_path, "batch_idx,logit_0\n0,1\n"))
    assert csv.field_size_limit() == before


def test_a_row_with_too_many_columns_is_refused(tmp_path: Path) -> None:
    """More than MAX_COLUMNS columns is refused before the row is split."""
    path = write(tmp_path, "batch_idx,logit_0" + "," * MAX_COLUMNS + "\n")
    assert f"row has more than {MAX_COLUMNS:,} columns" in format_error(path)


def test_a_row_over_the_byte_limit_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A row longer than MAX_ROW_BYTES (lowered here) is refused, on one line or spread over several."""
    monkeypatch.setattr(predictions, "MAX_ROW_BYTES", 100)
    one_line = write(tmp_path, "batch_idx,id,logit_0\n0," + "y" * 120 + ",1\n", name="long.csv")
    assert format_error(one_line).startswith(f"{one_line}:2: row longer than 100 bytes")
    spread = write(tmp_path, 'batch_idx,id,logit_0\n0,"' + "z\n" * 60 + '",1\n', name="spread.csv")
    assert "row longer than 100 bytes" in format_error(spread)


def test_header_of_many_columns_is_classified_in_linear_time() -> None:
    """A wide header (many id columns) is classified quickly: duplicate names are found by lookup, not by scan."""
    header = ["batch_idx", "logit_0", *(f"id{i}" for i in range(200_000))]
    start = time.perf_counter()
    assert len(classify_header(header).ids) == 200_000
    assert time.perf_counter() - start < 5


@pytest.mark.skipif(sys.platform == "win32", reason="permission bits")
def test_an_unreadable_file_is_an_input_error(tmp_path: Path) -> None:
    """A file the process may not read: one InputError line that says to check permissions."""
    path = write(tmp_path, "batch_idx,logit_0\n0,1\n")
    path.chmod(0)
    try:
        if os.access(path, os.R_OK):
            pytest.skip("running as a user who reads any file")
        with pytest.raises(InputError, match="check its permissions"):
            read_prediction_csv(path)
    finally:
        path.chmod(0o600)


# ---------------------------------------------------------------- reading by columns


def _random_csv(rng: np.random.Generator) -> bytes:
    """A prediction CSV as writers and people make them: columns in any order and case, optional epoch, sample,
    label and ids, batches and samples in any order; now and then something the row reader alone reads (quotes,
    spaces, blank lines, a bare \\r) or refuses (a repeated sample, a word for a number, a short row)."""
    roles = ["batch_idx", "logit_0", "logit_1", "logit_2"][: rng.integers(2, 5)]
    roles += [name for name in ("epoch", "sample_idx", "label", "file", "text") if rng.random() < 0.5]
    header = [name.upper() if rng.random() < 0.2 else name for name in rng.permutation(roles)]
    rows = []
    for epoch in range(int(rng.integers(1, 3))):
        for batch in rng.permutation(int(rng.integers(1, 5))):
            samples = rng.permutation(int(rng.integers(1, 4)))
            for sample in samples:
                cells = {"epoch": str(epoch), "batch_idx": str(batch), "sample_idx": str(sample)}
                cells |= {"label": str(rng.integers(0, 3)), "file": f"a{sample}.wav", "text": "héllo wörld"}
                row = [cells.get(name.lower(), repr(float(rng.normal()))) for name in header]
                rows.append(",".join(row))
    body = ",".join(header) + "\n" + "\n".join(rows) + ("\n" if rng.random() < 0.8 else "")
    twist = rng.integers(0, 12)
    twists = {
        0: lambda text: text.replace("\n", "\r\n"),
        1: lambda text: '"' + text.replace(",", '","', 1),
        2: lambda text: text.replace("\n", "\n\n", 2),
        3: lambda text: text.replace(",", ", ", 3),
        4: lambda text: text + text.partition("\n")[2],
        5: lambda text: text.replace(repr(0.0)[:1], "x", 1) if "\n" in text else text,
        6: lambda text: text.rstrip("\n").rpartition(",")[0] + "\n",
        7: lambda text: "\ufeff" + text,
        8: lambda text: text.replace("\n", "\r", 1),
        9: lambda text: text.replace("nan", "NaN").replace("1", "inf", 1),
    }
    return twists.get(int(twist), lambda text: text)(body).encode("utf-8")


def _read_either_way(path: Path, monkeypatch: pytest.MonkeyPatch, *, rows: bool) -> object:
    """What reading ``path`` gives (the table, or the error's type and message), by rows alone or as the reader
    chooses."""
    with monkeypatch.context() as patch:
        if rows:
            patch.setattr(predictions, "read_plain_header", lambda *args, **kwargs: None)
        try:
            table = read_prediction_csv(path)
        except (BundleFormatError, InputError) as err:
            return type(err), str(err)
    return table.columns, [
        (key, batch.sample_indices, batch.sample_ids, _values(batch.labels), _values(batch.logits))
        for key, batch in table.batches.items()
    ]


def _values(array: np.ndarray | None) -> object:
    """An array as comparable plain data: dtype, shape and values with NaN spelled out."""
    return None if array is None else (array.dtype.str, array.shape, np.where(np.isnan(array), "nan", array).tolist())


@pytest.mark.parametrize("seed", range(60))
def test_reading_by_columns_gives_what_reading_by_rows_gives(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, seed: int
) -> None:
    """Every file reads to the same table (or the same one-line error) whichever way it is read."""
    path = write(tmp_path, _random_csv(np.random.default_rng(seed)))
    if seed % 2:  # blocks of a few lines each: the columns of several blocks joined
        monkeypatch.setattr(plain_csv, "_BLOCK_BYTES", 5 + seed)
    assert _read_either_way(path, monkeypatch, rows=False) == _read_either_way(path, monkeypatch, rows=True)


@pytest.mark.parametrize("enabled", [True, False])
def test_reading_leaves_the_garbage_collector_as_it_was(tmp_path: Path, enabled: bool) -> None:
    """The reader pauses collections while it makes batches, and restores the collector's state after."""
    path = write(tmp_path, "batch_idx,logit_0\n" + "".join(f"{i},{i}\n" for i in range(100)))
    was = gc.isenabled()
    try:
        (gc.enable if enabled else gc.disable)()
        assert len(read_prediction_csv(path).batches) == 100
        assert gc.isenabled() is enabled
    finally:
        (gc.enable if was else gc.disable)()


def test_a_plain_file_is_read_by_columns(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A plain CSV (no quotes, every row whole) never goes through the row reader, across several blocks too."""
    monkeypatch.setattr(predictions._TableBuilder, "add", lambda *args: pytest.fail("read row by row"))
    monkeypatch.setattr(plain_csv, "_BLOCK_BYTES", 64)
    rows = "".join(f"{i % 7},{i // 7},{i * 0.5},{-i}\n" for i in range(100))
    table = read_prediction_csv(write(tmp_path, "sample_idx,batch_idx,logit_0,logit_1\n" + rows))
    assert list(table.batches) == [(None, batch) for batch in range(15)]
    assert table.batches[(None, 14)].sample_indices == [0, 1]
    assert table.batches[(None, 3)].logits.tolist() == [[i * 0.5, -i] for i in range(21, 28)]


@pytest.mark.parametrize(
    ("content", "line", "fragment"),
    [
        ("batch_idx,logit_0\n0,1\n1,x\n", 3, "must be a number"),
        ("batch_idx,logit_0\n0,1\n1\n", 3, "1 fields, expected 2"),
        ("batch_idx,sample_idx,logit_0\n0,0,1\n0,0,2\n", 3, "already on line 2"),
        ("batch_idx,logit_0\n0,1\n-1,2\n", 3, "is negative"),
        ("batch_idx,logit_0\n0,1\n1234567890123456789,2\n", 3, "expected a number < 10**18"),
    ],
)
def test_a_bad_row_of_a_plain_file_is_named_by_its_line(tmp_path: Path, content: str, line: int, fragment: str) -> None:
    """The columns' reader hands a file with a bad row to the row reader, whose error names the row's line."""
    path = write(tmp_path, content)
    message = format_error(path)
    assert message.startswith(f"{path}:{line}:"), message
    assert fragment in message, message
