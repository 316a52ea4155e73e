"""The prediction logger end to end: logger -> CSV -> reader -> ``PredictionRun``, its refusals, its light import."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from parity_harness.capture.record import predictions as logger_module
from parity_harness.capture.record.predictions import PredictionLogger
from parity_harness.common.errors import BundleExistsError, InputError
from parity_harness.common.format import predictions as csv_format
from parity_harness.common.format.predictions import read_prediction_csv
from parity_harness.replay.training.kinds import open_run
from parity_harness.replay.training.prediction_run import PredictionRun
from parity_harness.replay.training.runs import StepKey

LOGITS = [[0.25, -1.0, 3.5], [float("nan"), float("inf"), -float("inf")]]
FILES = ["a.wav", "b,c.wav"]
TEXTS = ["a.txt", "b\nc.txt"]


@pytest.fixture(autouse=True)
def no_current_logger() -> Iterator[None]:
    """Each test starts and ends without a current module-level logger."""
    logger_module.close()
    yield
    logger_module.close()


def as_kind(kind: str, value: list[Any]) -> Any:
    """``value`` as a list, a NumPy array or a torch tensor."""
    if kind == "numpy":
        return np.array(value)
    return torch.tensor(value) if kind == "torch" else value


@pytest.mark.parametrize("kind", ["list", "numpy", "torch"], ids=["lists", "numpy-arrays", "torch-tensors"])
def test_round_trip_with_two_id_columns(tmp_path: Path, kind: str) -> None:
    """Logits (NaN and infinities too), labels, epochs and two id columns come back exactly as logged."""
    path = tmp_path / "run.csv"
    with PredictionLogger(path, id_columns=("audio_file", "transcript_file")) as log:
        for number in range(2):
            log.log_batch(
                number, as_kind(kind, LOGITS), epoch=1, labels=as_kind(kind, [2, 0]),
                sample_ids={"transcript_file": TEXTS, "audio_file": FILES},
            )  # fmt: skip
    table = read_prediction_csv(path)
    assert list(table.batches) == [(1, 0), (1, 1)]
    assert table.columns.id_names == ("audio_file", "transcript_file")
    batch = table.batches[(1, 1)]
    assert batch.sample_ids == list(zip(FILES, TEXTS, strict=True))
    assert batch.labels is not None
    assert batch.labels.tolist() == [2.0, 0.0]
    assert np.array_equal(batch.logits, np.array(LOGITS), equal_nan=True)


@pytest.mark.parametrize(
    ("id_columns", "sample_ids", "expected"),
    [
        (("sample_id",), ["x", "y"], [("x",), ("y",)]),
        (("sample_id",), np.array([7, 8]), [("7",), ("8",)]),
        (("audio", "text"), [("a", "t"), ("b", "u")], [("a", "t"), ("b", "u")]),
        (("sample_id",), None, [("",), ("",)]),
    ],
    ids=["strings", "numbers-as-text", "tuples", "none-writes-empty-ids"],
)
def test_sample_ids_forms(tmp_path: Path, id_columns: tuple[str, ...], sample_ids: Any, expected: list[Any]) -> None:
    """Ids may be one sequence (one column), a sequence of tuples, a mapping (above), or absent."""
    with PredictionLogger(tmp_path / "run.csv", id_columns=id_columns) as log:
        log.log_batch(0, [[1.0], [2.0]], sample_ids=sample_ids)
    assert read_prediction_csv(tmp_path / "run.csv").batches[(None, 0)].sample_ids == expected


def test_every_logs_one_batch_in_n(tmp_path: Path) -> None:
    """With ``every=3`` only batches 0, 3, 6, 9 are written."""
    with PredictionLogger(tmp_path / "run.csv", every=3) as log:
        for batch in range(10):
            log.log_batch(batch, [[float(batch)]], sample_ids=[f"s{batch}"])
    assert list(read_prediction_csv(tmp_path / "run.csv").batches) == [(None, 0), (None, 3), (None, 6), (None, 9)]


def test_a_reader_sees_each_batch_before_close(tmp_path: Path) -> None:
    """The file is flushed after every logged batch: a second reader sees complete batches while logging goes on."""
    path = tmp_path / "run.csv"
    logger_module.init(path, id_columns=("sample_id",))
    logger_module.log_batch(0, [[1.0, 2.0]], sample_ids=["a"])
    assert list(read_prediction_csv(path).batches) == [(None, 0)]
    logger_module.log_batch(1, [[3.0, 4.0], [5.0, 6.0]], sample_ids=["b", "c"])
    assert read_prediction_csv(path).batches[(None, 1)].logits.tolist() == [[3.0, 4.0], [5.0, 6.0]]
    logger_module.close()
    with pytest.raises(InputError, match=r"call predictions\.init"):
        logger_module.log_batch(2, [[1.0, 2.0]])


def test_init_closes_the_previous_logger(tmp_path: Path) -> None:
    """A second ``init`` becomes the current logger and closes the first one."""
    first = logger_module.init(tmp_path / "a.csv")
    second = logger_module.init(tmp_path / "b.csv")
    logger_module.log_batch(0, [[1.0]])
    with pytest.raises(InputError, match="the logger is closed"):
        first.log_batch(0, [[1.0]])
    second.close()
    assert list(read_prediction_csv(tmp_path / "b.csv").batches) == [(None, 0)]


def test_an_existing_file_is_kept_unless_overwrite(tmp_path: Path) -> None:
    """An existing file is refused (and left as it was) unless ``overwrite=True``."""
    path = tmp_path / "run.csv"
    path.write_text("precious\n", encoding="utf-8")
    with pytest.raises(BundleExistsError, match="pass overwrite=True"):
        logger_module.init(path)
    assert path.read_text(encoding="utf-8") == "precious\n"
    with logger_module.init(path, overwrite=True) as log:
        log.log_batch(0, [[1.0]])
    assert list(read_prediction_csv(path).batches) == [(None, 0)]


def logged(tmp_path: Path, *calls: dict[str, Any], id_columns: tuple[str, ...] = ("sample_id",)) -> None:
    """Log each call's keyword arguments as one batch (batch_idx defaults to the call's position)."""
    with PredictionLogger(tmp_path / "run.csv", id_columns=id_columns) as log:
        for number, call in enumerate(calls):
            log.log_batch(**{"batch_idx": number, **call})


@pytest.mark.parametrize(
    ("calls", "fragment"),
    [
        ([{"logits": [[1.0], [2.0]], "labels": [0]}], "1 labels for 2 rows of logits"),
        ([{"logits": [[1.0], [2.0]], "sample_ids": ["a", "b", "c"]}], "3 sample ids for 2 rows of logits"),
        ([{"logits": [[1.0]], "sample_ids": {"sample_id": ["a"], "other": ["b"]}}], "sample_ids has columns"),
        ([{"logits": [[1.0]], "sample_ids": "abc"}], "sample_ids is one string"),
        ([{"logits": [[1.0]], "sample_ids": [("a", "b")]}], "a sample has 2 ids"),
        ([{"logits": [[1.0], [2.0, 3.0]]}], "logits rows differ in length"),
        ([{"logits": [1.0, 2.0]}], "logits must be numbers of shape (samples, classes)"),
        ([{"logits": [[1.0, 2.0]]}, {"logits": [[1.0, 2.0, 3.0]]}], "3 logits per sample, the first batch had 2"),
        ([{"logits": [[1.0]]}, {"logits": [[1.0]], "epoch": 0}], "epoch not given for the first batch"),
        ([{"logits": [[1.0]], "labels": [0]}, {"logits": [[1.0]]}], "labels given for the first batch"),
        ([{"logits": [[1.0]], "batch_idx": 4}, {"logits": [[1.0]], "batch_idx": 4}], "logged twice"),
        ([{"logits": [[1.0]], "batch_idx": -1}], "batch_idx must be a whole number >= 0"),
        ([{"logits": [[1.0]], "batch_idx": 1.0}], "batch_idx must be a whole number >= 0"),
        ([{"logits": [[1.0]], "epoch": -2}], "epoch must be a whole number >= 0"),
    ],
    ids=[
        "labels-length", "ids-length", "ids-mapping-columns", "ids-one-string", "ids-tuple-width", "ragged-logits",
        "one-dimensional-logits", "logit-count-changes", "epoch-appears", "labels-disappear", "batch-twice",
        "negative-batch", "float-batch", "negative-epoch",
    ],
)  # fmt: skip
def test_bad_batches_are_refused(tmp_path: Path, calls: list[dict[str, Any]], fragment: str) -> None:
    """Lengths that differ, shapes that change, and bad numbers are an InputError saying which."""
    with pytest.raises(InputError) as caught:
        logged(tmp_path, *calls)
    assert fragment in str(caught.value)


@pytest.mark.parametrize(
    ("options", "fragment"),
    [
        ({"every": 0}, "every must be a whole number >= 1"),
        ({"id_columns": ("batch",)}, "reserved name"),
        ({"id_columns": ("logit_3",)}, "reserved name"),
        ({"id_columns": ("id", "ID")}, "repeated"),
        ({"id_columns": ("",)}, "unnamed"),
    ],
    ids=["every-zero", "id-named-like-batch", "id-named-like-logit", "id-repeated", "id-unnamed"],
)
def test_bad_options_are_refused(tmp_path: Path, options: dict[str, Any], fragment: str) -> None:
    """Options the reader could not read back are refused when the logger starts, before a file is made."""
    with pytest.raises(InputError, match=fragment):
        PredictionLogger(tmp_path / "run.csv", **options)
    assert not (tmp_path / "run.csv").exists()


def test_header_names_match_the_format() -> None:
    """The logger's copy of the header names (kept to stay NumPy-free) spells them as the format does."""
    names = ("EPOCH", "BATCH", "SAMPLE", "LABEL", "LOGIT_PREFIX")
    assert [getattr(logger_module, n) for n in names] == [getattr(csv_format, n) for n in names]


def test_imports_and_logs_with_numpy_and_torch_blocked(tmp_path: Path) -> None:
    """Without NumPy or torch the module imports, logs lists, and still raises this project's InputError on misuse."""
    path = tmp_path / "run.csv"
    code = (
        "import sys; sys.modules['numpy'] = None; sys.modules['torch'] = None\n"
        "from parity_harness.capture.record import predictions\n"
        "from parity_harness.common.errors import InputError\n"
        f"with predictions.init({str(path)!r}) as log:\n"
        "    log.log_batch(0, [[1.0, 2.0]], labels=[1], sample_ids=['a'])\n"
        "try:\n"
        "    predictions.log_batch(1, [[1.0, 2.0]])\n"
        "except InputError as err:\n"
        "    print('refused:', err)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/", check=False)
    assert done.returncode == 0, done.stderr
    assert "refused: no prediction logger" in done.stdout
    assert read_prediction_csv(path).batches[(None, 0)].sample_ids == [("a",)]


# ---------------------------------------------------------------- PredictionRun


@pytest.fixture
def prediction_csv(tmp_path: Path) -> Callable[..., Path]:
    """A factory: a logged run of two epochs of two batches, labels optional."""

    def make(*, labels: bool = True) -> Path:
        path = tmp_path / ("labelled.csv" if labels else "plain.csv")
        with PredictionLogger(path, id_columns=("audio", "text")) as log:
            for epoch in range(2):
                for batch in range(2):
                    logits = torch.tensor([[0.0, 1.0], [2.0, 1.0], [0.5, 0.25]]) * (epoch + 1)
                    ids = [(f"a{epoch}{batch}{i}", f"t{i}") for i in range(3)]
                    log.log_batch(batch, logits, epoch=epoch, labels=[1, 1, 0] if labels else None, sample_ids=ids)
        return path

    return make


def test_prediction_run_steps_and_accuracy(prediction_csv: Callable[..., Path]) -> None:
    """One step per (epoch, batch), no loss, accuracy = fraction of argmax == label, ids in sample order."""
    run = open_run(prediction_csv())
    assert isinstance(run, PredictionRun)
    assert (run.kind, run.live, run.parameter_names()) == ("prediction CSV", False, [])
    steps = run.steps()
    assert list(steps) == [StepKey(0, 0), StepKey(0, 1), StepKey(1, 0), StepKey(1, 1)]
    info = steps[StepKey(1, 0)]
    assert info.loss is None
    assert info.metrics == {"accuracy": pytest.approx(2 / 3)}
    assert info.sample_ids == [("a100", "t0"), ("a101", "t1"), ("a102", "t2")]
    run.close()


def test_prediction_run_tensors(prediction_csv: Callable[..., Path]) -> None:
    """``predictions`` and ``labels`` groups as float64; other groups empty; sample indices by step."""
    with PredictionRun(prediction_csv()) as run:
        key = StepKey(1, 1)
        predictions = run.tensors(key, "predictions")["predictions"]
        assert predictions.dtype == np.float64
        assert predictions.tolist() == [[0.0, 2.0], [4.0, 2.0], [1.0, 0.5]]
        assert run.tensors(key, "labels")["labels"].tolist() == [1.0, 1.0, 0.0]
        assert run.tensors(key, "grads") == {}
        assert run.sample_indices(key) == [0, 1, 2]
        with pytest.raises(InputError, match="no step 5:0"):
            run.tensors(StepKey(5, 0), "predictions")


def test_prediction_run_without_labels(prediction_csv: Callable[..., Path]) -> None:
    """Without a label column: no accuracy, and the ``labels`` group is empty."""
    with PredictionRun(prediction_csv(labels=False)) as run:
        assert run.steps()[StepKey(0, 0)].metrics == {}
        assert run.tensors(StepKey(0, 0), "labels") == {}


def test_round_trip_property(tmp_path: Path) -> None:
    """Any float64 logits (NaN as NaN) and any id without NUL come back exactly, -0.0 and infinities too."""
    hypothesis = pytest.importorskip("hypothesis")
    strategies = pytest.importorskip("hypothesis.strategies")
    extra = pytest.importorskip("hypothesis.extra.numpy")
    counter = iter(range(10**9))

    @hypothesis.settings(max_examples=40, deadline=None)
    @hypothesis.given(
        logits=extra.arrays(np.float64, extra.array_shapes(min_dims=2, max_dims=2, min_side=1, max_side=6)),
        text=strategies.text(strategies.characters(blacklist_characters="\x00", blacklist_categories=("Cs",))),
    )
    def check(logits: np.ndarray, text: str) -> None:
        path = tmp_path / f"run{next(counter)}.csv"
        with PredictionLogger(path) as log:
            log.log_batch(0, logits, sample_ids=[text] * len(logits))
        batch = read_prediction_csv(path).batches[(None, 0)]
        assert np.array_equal(batch.logits, logits, equal_nan=True)
        numbers = ~np.isnan(logits)  # a NaN's sign and payload are not kept: "nan" is written
        assert np.array_equal(np.signbit(batch.logits[numbers]), np.signbit(logits[numbers]))  # -0.0 stays -0.0
        assert batch.sample_ids == [(text,)] * len(logits)

    check()
