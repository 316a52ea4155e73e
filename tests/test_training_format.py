"""The training file as a format: version gate, validators, layout constants, spec, golden files, damaged files."""

from __future__ import annotations

import importlib.util
import json
import re
import warnings
from collections.abc import Callable
from functools import partial
from pathlib import Path
from types import ModuleType
from typing import Any

import h5py
import numpy as np
import pytest
import torch
from click.testing import CliRunner

from parity_harness.capture.record.training import TrainingRecorder
from parity_harness.common.errors import BundleFormatError, InputError, UnsupportedBundleVersion
from parity_harness.common.format.packing import pack, unpack
from parity_harness.common.format.training import (
    ATTR_FORMAT,
    ATTR_MINOR,
    ATTR_VERSION,
    BATCH,
    GRADS,
    INITIAL_META,
    INITIAL_META_KEYS,
    INITIAL_PARAMS,
    LABELS,
    META,
    OPTIMIZER,
    PARAMS,
    PREDICTIONS,
    STEP_META_KEYS,
    STEPS,
    TRAINING_FORMAT,
    TRAINING_MINOR,
    TRAINING_VERSION,
    InitialMeta,
    StepMeta,
    parse_step_key,
    read_header,
    step_group,
)
from parity_harness.replay.cli.train_diff import main
from parity_harness.replay.training.compare import compare_training
from parity_harness.replay.training.rerun import rerun_training
from parity_harness.replay.training.runs import StepKey
from parity_harness.replay.training.training_file import TrainingRun
from tests.conftest import ROOT

DATA = ROOT / "tests" / "data"
GOLDEN = sorted(DATA.glob("training-golden-*.h5"))
SPEC = ROOT / "docs" / "training-file.md"
STEP0 = step_group(0, 0)
KEYS = [StepKey(0, 0), StepKey(0, 1), StepKey(1, 2)]
"""The recipe's steps: three batches, two per epoch."""
K0, K2 = KEYS[0], KEYS[2]
DROP = object()
"""A key to delete from a document."""


def _load_recipe() -> ModuleType:
    """scripts/make_golden_training.py, the one recipe of the golden run (model, batches, train step)."""
    spec = importlib.util.spec_from_file_location("make_golden_training", ROOT / "scripts" / "make_golden_training.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


RECIPE = _load_recipe()


@pytest.fixture
def fresh(tmp_path: Path) -> Path:
    """A training file the current writer just recorded (the golden recipe: 3 steps, full steps 0 and 2)."""
    path = tmp_path / "run.h5"
    RECIPE.record(path)
    return path


# ---------------------------------------------------------------- damage


def _replace(file: h5py.File, path: str, data: Any, tag: str | None = None) -> None:
    if path in file:
        del file[path]
    dataset = file.create_dataset(path, data=data)
    if tag is not None:
        dataset.attrs["dtype"] = tag


def _make_group(file: h5py.File, path: str) -> None:
    if path in file:
        del file[path]
    file.create_group(path)


def _delete(file: h5py.File, path: str) -> None:
    del file[path]


def _set_attr(file: h5py.File, path: str, name: str, value: object) -> None:
    if value is DROP:
        del file[path].attrs[name]
    else:
        file[path].attrs[name] = value


def _edit(file: h5py.File, path: str, changes: dict[str, object]) -> None:
    document = unpack(file[path][()], where=path)
    assert isinstance(document, dict)
    for key, value in changes.items():
        if value is DROP:
            document.pop(key)
        else:
            document[key] = value
    _replace(file, path, pack(document))


def _point_batch_at_another_step(file: h5py.File) -> None:
    document = unpack(file[f"{STEP0}/meta"][()], where="meta")
    document["batch"][1][0][1][1] = f"{step_group(2, 1)}/batch/batch.x"  # type: ignore[index]
    _replace(file, f"{STEP0}/meta", pack(document))


Damage = Callable[[h5py.File], None]
F32 = np.float32

DAMAGES: list[tuple[str, Damage, str]] = [
    ("wrong-format-name", partial(_set_attr, path="/", name=ATTR_FORMAT, value="parity-harness-bundle"),
     "not a parity-harness training file (root attribute 'format' is 'parity-harness-bundle'"),
    ("newer-major", partial(_set_attr, path="/", name=ATTR_VERSION, value=TRAINING_VERSION + 1),
     f"training file format version {TRAINING_VERSION + 1}.{TRAINING_MINOR} is not supported by this reader"),
    ("version-not-an-integer", partial(_set_attr, path="/", name=ATTR_VERSION, value="one"),
     "root attribute 'format_version': version attribute is 'one', expected an integer"),
    ("version-missing", partial(_set_attr, path="/", name=ATTR_VERSION, value=DROP),
     "root attribute 'format_version' is missing"),
    ("initial-missing", partial(_delete, path="/initial"),
     "/initial/meta: expected a 1-D uint8 dataset of msgpack, got nothing (it is missing)"),
    ("initial-params-missing", partial(_delete, path=INITIAL_PARAMS),
     "/initial/params: expected the group of initial weights, got nothing"),
    ("initial-param-missing", partial(_delete, path=f"{INITIAL_PARAMS}/0.bias"), "tensors ['0.bias'] are missing"),
    ("initial-meta-not-msgpack", partial(_replace, path=INITIAL_META, data=np.frombuffer(b"\xc1\xc1", np.uint8)),
     "/initial/meta: metadata is not valid msgpack"),
    ("initial-meta-not-a-map", partial(_replace, path=INITIAL_META, data=pack([1, 2])),
     "/initial/meta: expected a map with string keys, got list"),
    ("initial-meta-optimizer-missing", partial(_edit, path=INITIAL_META, changes={"optimizer": DROP}),
     "required keys ['optimizer'] are missing"),
    ("initial-meta-optimizer-a-string", partial(_edit, path=INITIAL_META, changes={"optimizer": "SGD"}),
     "'optimizer' is 'SGD' (str), expected null or"),
    ("initial-meta-seed-a-string", partial(_edit, path=INITIAL_META, changes={"seed": "seven"}),
     "'seed' is 'seven' (str), expected an integer"),
    ("initial-meta-every-zero", partial(_edit, path=INITIAL_META, changes={"every": 0}),
     "'every' is 0 (int), expected an integer >= 1"),
    ("initial-meta-parameters-not-strings", partial(_edit, path=INITIAL_META, changes={"parameters": [1]}),
     "'parameters' is [1] (list), expected a list of strings"),
    ("steps-a-dataset", partial(_replace, path=STEPS, data=np.zeros(2)), "/steps: expected the group of steps"),
    ("step-key-not-a-number", partial(_make_group, path=f"{STEPS}/latest"),
     "/steps/latest: expected a step group named by 9 digits (<step> or <epoch>_<step>), got 'latest'"),
    ("step-meta-not-uint8", partial(_replace, path=f"{STEP0}/meta", data=np.zeros(4)),
     "/steps/000000000_000000000/meta: expected a 1-D uint8 dataset of msgpack, got a float64 dataset of shape [4]"),
    ("step-meta-loss-not-numeric", partial(_edit, path=f"{STEP0}/meta", changes={"loss": "high"}),
     "/steps/000000000_000000000/meta: 'loss' is 'high' (str), expected a number"),
    ("step-meta-loss-a-bool", partial(_edit, path=f"{STEP0}/meta", changes={"loss": True}),
     "'loss' is True (bool), expected a number"),
    ("step-meta-metrics-a-list", partial(_edit, path=f"{STEP0}/meta", changes={"metrics": [0.5]}),
     "'metrics' is [0.5] (list), expected a map"),
    ("step-meta-metric-not-numeric", partial(_edit, path=f"{STEP0}/meta", changes={"metrics": {"accuracy": "good"}}),
     "'metrics.accuracy' is 'good' (str), expected a number"),
    ("step-meta-batch-missing", partial(_edit, path=f"{STEP0}/meta", changes={"batch": DROP}),
     "required keys ['batch'] are missing"),
    ("step-meta-batch-not-a-tree", partial(_edit, path=f"{STEP0}/meta", changes={"batch": ["Q"]}),
     "'batch' is not a value tree (batch: unknown value node ['Q'])"),
    ("step-meta-another-step", partial(_edit, path=f"{STEP0}/meta", changes={"step": 5}),
     "'step' is 5, expected 0 (the number of its group)"),
    ("step-meta-full-a-string", partial(_edit, path=f"{STEP0}/meta", changes={"full": "yes"}),
     "'full' is 'yes' (str), expected true or false"),
    ("step-meta-epoch-negative", partial(_edit, path=f"{STEP0}/meta", changes={"epoch": -1}),
     "'epoch' is -1 (int), expected an integer >= 0"),
    ("step-meta-sample-ids-not-strings", partial(_edit, path=f"{STEP0}/meta", changes={"sample_ids": [1, 2]}),
     "'sample_ids' is [1, 2] (list), expected a list of strings"),
    ("batch-tensor-missing", partial(_delete, path=f"{STEP0}/batch/batch.x"),
     "/steps/000000000_000000000/batch/batch.x: expected a tensor dataset, got nothing (it is missing)"),
    ("batch-tensor-of-another-step", _point_batch_at_another_step,
     ("batch tensor 'batch.x' is at '/steps/000000001_000000002/batch/batch.x', expected under "
      "'/steps/000000000_000000000/batch/'")),
    ("batch-shape-mismatch", partial(_replace, path=f"{STEP0}/batch/batch.x", data=np.zeros((2, 3), F32), tag="F32"),
     "/steps/000000000_000000000/batch/batch.x: shape is [2, 3], expected [3, 3]"),
    ("batch-tag-differs-from-meta",
     partial(_replace, path=f"{STEP0}/batch/batch.x", data=np.zeros((3, 3)), tag="F64"),
     "/steps/000000000_000000000/batch/batch.x: dtype tag is 'F64', expected 'F32'"),
    ("tag-storage-mismatch", partial(_set_attr, path=f"{STEP0}/params/0.weight", name="dtype", value="F64"),
     "/steps/000000000_000000000/params/0.weight: holds float32 values, expected float64 (the storage of tag 'F64')"),
    ("tag-unknown", partial(_set_attr, path=f"{STEP0}/labels", name="dtype", value="Q7"),
     "/steps/000000000_000000000/labels: attribute 'dtype' is 'Q7', expected a dtype tag"),
    ("tag-missing", partial(_set_attr, path=f"{STEP0}/predictions", name="dtype", value=DROP),
     "/steps/000000000_000000000/predictions: attribute 'dtype' is None, expected a dtype tag"),
    ("param-shape-mismatch", partial(_replace, path=f"{STEP0}/params/0.weight", data=np.zeros(1, F32), tag="F32"),
     "/steps/000000000_000000000/params/0.weight: shape is [1], expected [2, 3]"),
    ("step-params-missing", partial(_delete, path=f"{STEP0}/params"),
     "/steps/000000000_000000000/params: the weights of this full step are missing"),
    ("step-param-missing", partial(_delete, path=f"{STEP0}/params/0.bias"),
     "/steps/000000000_000000000/params: tensors ['0.bias'] are missing"),
    ("grad-of-no-parameter", partial(_replace, path=f"{STEP0}/grads/ghost", data=np.zeros(1, F32), tag="F32"),
     "/steps/000000000_000000000/grads: tensors ['ghost'] name no recorded parameter"),
    ("optimizer-state-not-a-group", partial(_replace, path=f"{STEP0}/optimizer/0.bias", data=np.zeros(1)),
     "/steps/000000000_000000000/optimizer/0.bias: expected a group of state tensors, got a float64 dataset"),
    ("predictions-a-group", partial(_make_group, path=f"{STEP0}/predictions"),
     "/steps/000000000_000000000/predictions: expected a tensor dataset, got a group"),
]  # fmt: skip


def _damage(path: Path, damage: Damage) -> None:
    with h5py.File(path, "r+") as file:
        damage(file)


@pytest.mark.parametrize(("damage", "fragment"), [d[1:] for d in DAMAGES], ids=[d[0] for d in DAMAGES])
def test_damaged_file_is_one_format_error(fresh: Path, damage: Damage, fragment: str) -> None:
    """Every kind of damage is one BundleFormatError naming the file, the HDF5 path and what is wrong."""
    _damage(fresh, damage)
    with pytest.raises(BundleFormatError) as caught:
        TrainingRun(fresh)
    message = str(caught.value)
    assert message.startswith(str(fresh))
    assert fragment in message
    assert "\n" not in message


@pytest.mark.parametrize(("damage", "fragment"), [d[1:] for d in DAMAGES], ids=[d[0] for d in DAMAGES])
def test_train_diff_on_a_damaged_file_exits_2_with_one_line(
    fresh: Path, tmp_path: Path, damage: Damage, fragment: str
) -> None:
    """parity-train-diff on a damaged file: exit 2, one line on stderr naming the file, no traceback."""
    good = tmp_path / "good.h5"
    RECIPE.record(good)
    _damage(fresh, damage)
    result = CliRunner().invoke(main, [str(good), str(fresh)])
    assert result.exit_code == 2, result.output
    assert len(result.stderr.splitlines()) == 1, result.stderr
    assert str(fresh) in result.stderr
    assert fragment in result.stderr
    assert "Traceback" not in result.output


def test_truncated_file_is_one_format_error(fresh: Path) -> None:
    """A file cut in half (a copy that did not finish) is one BundleFormatError naming it."""
    data = fresh.read_bytes()
    fresh.write_bytes(data[: len(data) // 2])
    with pytest.raises(BundleFormatError, match=re.escape(str(fresh))), TrainingRun(fresh) as run:
        compare_training(run, run)


def _unreadable(*args: object) -> None:
    raise OSError("Can't synchronously read data (file read failed)")


def test_damaged_data_read_later_is_one_format_error(fresh: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An HDF5 error while reading tensors after the header checked out is a BundleFormatError, not an h5py one."""
    with TrainingRun(fresh) as run:
        monkeypatch.setattr(h5py.Dataset, "__getitem__", _unreadable)
        reads = (partial(run.tensors, K0, PARAMS), partial(run.batch, K0), partial(run.optimizer_state, K0))
        for read in reads:
            with pytest.raises(BundleFormatError, match=re.escape(f"{fresh}:/steps/000000000_000000000/")):
                read()


# ---------------------------------------------------------------- version gate


def test_newer_major_is_refused_naming_both_versions(fresh: Path) -> None:
    """A file of major 2 is refused with its version and the reader's in the message."""
    _damage(fresh, partial(_set_attr, path="/", name=ATTR_VERSION, value=TRAINING_VERSION + 1))
    with pytest.raises(UnsupportedBundleVersion) as caught:
        TrainingRun(fresh)
    assert f"{TRAINING_VERSION + 1}.{TRAINING_MINOR}" in str(caught.value)
    assert f"up to {TRAINING_VERSION}.x" in str(caught.value)
    assert "upgrade parity-harness" in str(caught.value)


def _add_newer_minor_fields(file: h5py.File) -> None:
    file.attrs[ATTR_MINOR] = TRAINING_MINOR + 1
    _edit(file, INITIAL_META, {"scheduler": {"class": "CosineAnnealingLR"}})
    _edit(file, f"{STEP0}/meta", {"learning_rate": 0.1})
    _replace(file, f"{STEP0}/activations", np.zeros(3, F32), tag="F32")


def test_newer_minor_warns_and_reads(fresh: Path) -> None:
    """A newer minor (with keys and members this reader does not know) reads with a warning naming both versions."""
    _damage(fresh, _add_newer_minor_fields)
    newer, ours = f"{TRAINING_VERSION}.{TRAINING_MINOR + 1}", f"{TRAINING_VERSION}.{TRAINING_MINOR}"
    expected = rf"training file format {re.escape(newer)} is newer than this reader's {re.escape(ours)}"
    with pytest.warns(UserWarning, match=expected):
        run = TrainingRun(fresh)
    with run:
        assert sorted(run.meta) == KEYS
        assert "learning_rate" not in run.meta[K0]
        assert compare_training(run, run, atol=0, rtol=0).first_diverging_step is None


def _as_early_1_0(file: h5py.File) -> None:
    """What the first 1.0 writers wrote: no seed/every/parameters/recorded, no full/epoch/sample_ids."""
    file.attrs[ATTR_MINOR] = 0
    _edit(file, INITIAL_META, {key: DROP for key in ("seed", "every", "parameters", "recorded")})
    for step in (0, 1, 2):
        _rename_group(file, step_group(step, step // RECIPE.EVERY), step_group(step))  # 1.x: named by step alone
        _edit(file, f"{step_group(step)}/meta", {"full": DROP, "epoch": DROP, "sample_ids": DROP})


def _rename_group(file: h5py.File, old: str, new: str) -> None:
    """Move a step group, and point its meta's batch tree at the new place."""
    file.move(old, new)

    def moved(node: object) -> object:
        if isinstance(node, str):
            return node.replace(f"{old}/", f"{new}/")
        return [moved(item) for item in node] if isinstance(node, list) else node

    document = unpack(file[f"{new}/meta"][()], where="meta")
    assert isinstance(document, dict)
    _edit(file, f"{new}/meta", {"batch": moved(document["batch"])})


def test_keys_older_writers_left_out_take_their_defaults(fresh: Path) -> None:
    """A 1.0 file without the optional keys reads, with the documented defaults."""
    _damage(fresh, _as_early_1_0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        run = TrainingRun(fresh)
    with run:
        assert (run.format_minor, run.seed, run.initial["every"], run.initial["recorded"]) == (0, 0, 1, None)
        assert sorted(run.parameter_names()) == ["0.bias", "0.weight"]  # from /initial/params
        plain = [StepKey(None, s) for s in (0, 1, 2)]
        assert [run.meta[key]["full"] for key in plain] == [True, True, True]
        assert (run.meta[plain[0]]["epoch"], run.meta[plain[0]]["sample_ids"]) == (None, None)


# ---------------------------------------------------------------- fresh files


def test_fresh_file_passes_validation(fresh: Path) -> None:
    """The header of a file the writer just wrote validates, with every document typed."""
    with h5py.File(fresh, "r") as file:
        header = read_header(file, str(fresh))
    assert (header.major, header.minor) == (TRAINING_VERSION, TRAINING_MINOR)
    assert header.initial["recorded"] == [PARAMS, GRADS, OPTIMIZER]
    assert sorted(header.steps) == [(0, 0), (0, 1), (1, 2)]
    assert [header.steps[key]["full"] for key in KEYS] == [True, False, True]
    assert header.groups[(1, 2)] == step_group(2, 1)


def test_unfinished_step_is_ignored(fresh: Path) -> None:
    """A step group without meta (the process died while writing it) is not validated nor visible."""
    _damage(fresh, partial(_replace, path=f"{step_group(3, 1)}/batch/batch.x", data=np.zeros(7, F32)))
    with TrainingRun(fresh) as run:
        assert sorted(run.meta) == KEYS


def test_file_without_steps_passes(tmp_path: Path) -> None:
    """A run closed before its first step is a valid, empty training file."""
    model = RECIPE.build_model()
    TrainingRecorder(tmp_path / "empty.h5", model, RECIPE.make_optimizer(model)).close()
    with TrainingRun(tmp_path / "empty.h5") as run:
        assert (run.meta, run.parameter_names()) == ({}, ["0.weight", "0.bias"])


def test_layout_constants_match_what_the_writer_writes(fresh: Path) -> None:
    """Root attributes, paths, step members and document keys of a fresh file are the module's constants."""
    with h5py.File(fresh, "r") as file:
        assert dict(file.attrs) == {
            ATTR_FORMAT: TRAINING_FORMAT,
            ATTR_VERSION: TRAINING_VERSION,
            ATTR_MINOR: TRAINING_MINOR,
        }
        assert set(file[step_group(0, 0)]) == {BATCH, PARAMS, GRADS, OPTIMIZER, PREDICTIONS, LABELS, META}
        assert set(file[step_group(1, 0)]) == {BATCH, META}
        assert isinstance(file[INITIAL_PARAMS], h5py.Group)
        assert set(unpack(file[INITIAL_META][()], where="i")) == set(INITIAL_META_KEYS)  # type: ignore[arg-type]
        assert set(unpack(file[f"{STEP0}/{META}"][()], where="s")) == set(STEP_META_KEYS)  # type: ignore[arg-type]
        assert sorted(file[STEPS]) == [step_group(s, e).rsplit("/", 1)[1] for e, s in KEYS]
    assert tuple(InitialMeta.__annotations__) == INITIAL_META_KEYS
    assert tuple(StepMeta.__annotations__) == STEP_META_KEYS


@pytest.mark.parametrize(
    ("key", "step"),
    [("000000000", (None, 0)), ("000000042", (None, 42)), ("1000000000", (None, 10**9)),
     ("000000003_000000042", (3, 42)), ("000000000_1000000000", (0, 10**9))],
    ids=["zero", "42", "ten-digits", "epoch-and-step", "epoch-and-ten-digits"],
)  # fmt: skip
def test_step_keys_parse(key: str, step: tuple[int | None, int]) -> None:
    """A step group's name is its number in 9 digits (more past 999999999), after its epoch's when it has one."""
    assert parse_step_key(key, "run.h5") == step


@pytest.mark.parametrize(
    "key",
    ["42", "-00000001", "00000004x", "\uff10" * 9, "000000001_", "_000000001", "000000001_000000002_000000003",
     "000000001-000000002"],
    ids=["short", "negative", "letter", "fullwidth-digits", "empty-step", "empty-epoch", "three-parts", "dash"],
)  # fmt: skip
def test_bad_step_keys_are_refused(key: str) -> None:
    """Anything but ASCII digits, at least 9 of them, is not a step group."""
    with pytest.raises(BundleFormatError, match=r"^run\.h5:/steps/.*expected a step group named by 9 digits"):
        parse_step_key(key, "run.h5")


@pytest.mark.parametrize(("step", "epoch"), [(-1, None), (0, -1), (0, 0.5)], ids=["step", "epoch", "float-epoch"])
def test_writer_refuses_numbers_a_reader_would_refuse(tmp_path: Path, step: int, epoch: Any) -> None:
    """A negative step or a non-integer epoch is an InputError when recorded, not an unreadable file later."""
    model = RECIPE.build_model()
    with TrainingRecorder(tmp_path / "run.h5", model) as recorder, pytest.raises(InputError, match="integer >= 0"):
        recorder.step(step, torch.zeros(1), epoch=epoch)


# ---------------------------------------------------------------- spec


def _documented(heading: str) -> list[str]:
    """The first cells of the markdown table under ``heading`` that are code."""
    text = SPEC.read_text()
    rows = []
    for line in text[text.index(heading) :].splitlines()[1:]:
        if line.startswith("## "):
            break
        if line.startswith("| `"):
            rows.append(line.split("|")[1].strip().strip("`"))
    return rows


def _record_with_buffers(path: Path) -> Path:
    """The golden recipe's run with a BatchNorm after its layer: a file holding persistent buffers too."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
    optimizer = RECIPE.make_optimizer(model)
    with TrainingRecorder(path, model, optimizer, optimizer_state=True) as recorder:
        for step, batch in enumerate(RECIPE.make_batches()):
            loss, logits = RECIPE.forward_backward(model, optimizer, batch)
            recorder.step(step, batch, loss=loss, predictions=logits.detach(), labels=batch["y"])
    return path


def test_every_documented_path_exists_in_a_fresh_file(tmp_path: Path) -> None:
    """Each row of docs/training-file.md's layout table names a root attribute or path a fresh file has."""
    rows = _documented("## Groups, datasets and attributes")
    assert len(rows) >= 12
    with h5py.File(_record_with_buffers(tmp_path / "run.h5"), "r") as file:
        names: list[str] = []
        file.visit(lambda name: names.append("/" + name))
        attrs = set(file.attrs)
    for row in rows:
        if row.startswith("/` attr `"):
            assert row.removeprefix("/` attr `") in attrs, row
            continue
        pattern = re.sub(r"<[^>]+>", "@", row).replace(".", r"\.").replace("@", "[^/]+")
        assert any(re.fullmatch(pattern, name) for name in names), f"documented {row} is not in a fresh file"


@pytest.mark.parametrize(
    ("heading", "keys"),
    [("## `/initial/meta`", INITIAL_META_KEYS), ("## `/steps/<step>/meta`", STEP_META_KEYS)],
    ids=["initial-meta", "step-meta"],
)
def test_spec_documents_every_meta_key(heading: str, keys: tuple[str, ...]) -> None:
    """The spec's key tables list exactly the keys the module defines."""
    assert tuple(_documented(heading)) == keys


# ---------------------------------------------------------------- golden files


def test_there_is_a_golden_file_of_the_current_version() -> None:
    """scripts/make_golden_training.py was run for the current version."""
    assert DATA / f"training-golden-{TRAINING_VERSION}.{TRAINING_MINOR}.h5" in GOLDEN


LOSSES = [0.42933616042137146, 0.6682648062705994, 0.885573148727417]
ACCURACY = [1.0, 0.6666666865348816, 0.3333333432674408]


@pytest.mark.parametrize("path", GOLDEN, ids=[path.stem for path in GOLDEN])
def test_golden_file_reads_with_its_values(path: Path) -> None:
    """Every golden training file reads, with its version, steps, documents and tensors as recorded."""
    version = re.fullmatch(r"training-golden-(\d+\.\d+)\.h5", path.name).group(1)  # type: ignore[union-attr]
    batches = RECIPE.make_batches()
    with TrainingRun(path) as run:
        assert f"{run.format_version}.{run.format_minor}" == version
        assert (sorted(run.meta), run.full_steps(), run.seed, run.parameter_names()) == (KEYS, [K0, K2], 7, [
            "0.weight", "0.bias"])  # fmt: skip
        assert [run.meta[key]["loss"] for key in KEYS] == LOSSES
        assert [run.meta[key]["metrics"]["accuracy"] for key in KEYS] == ACCURACY
        assert [run.meta[key]["epoch"] for key in KEYS] == [0, 0, 1]
        assert run.meta[K2]["sample_ids"] == ["sample-2-0", "sample-2-1", "sample-2-2"]
        batch = run.batch(KEYS[1])
        assert batch["scale"].dtype == torch.bfloat16
        assert all(torch.equal(batch[key], batches[1][key]) for key in ("x", "y", "scale"))
        assert {name: value.shape for name, value in run.tensors(K2, PARAMS).items()} == {
            "0.weight": (2, 3), "0.bias": (2,)}  # fmt: skip
        assert {name: set(state) for name, state in run.optimizer_state(K2).items()} == {
            "0.weight": {"momentum_buffer"}, "0.bias": {"momentum_buffer"}}  # fmt: skip


@pytest.mark.parametrize("path", GOLDEN, ids=[path.stem for path in GOLDEN])
def test_golden_file_replays(path: Path, tmp_path: Path) -> None:
    """The recipe's model, trained from the golden weights on the golden batches, matches its losses and tensors."""
    model = RECIPE.build_model()
    with TrainingRun(path) as run:
        rerun_training(model, RECIPE.make_optimizer(model), RECIPE.train_step, run, tmp_path / "port.h5")
        with TrainingRun(tmp_path / "port.h5") as port:
            result = compare_training(run, port, atol=1e-6, rtol=1e-6)
    assert [step.step for step in result.steps] == [0, 1, 2]  # step 1: the loss between full steps
    for step in result.steps:  # the rerun records no metrics: compare the rest
        assert step.loss_b == pytest.approx(step.loss_a, rel=1e-6, abs=1e-6)
        if step.step != 1:
            assert max(step.weight_max_abs, *step.others.values()) <= 1e-6, step


def test_train_diff_between_golden_versions(tmp_path: Path) -> None:
    """parity-train-diff compares the golden files of two versions of the same run: exit 0, losses as recorded.

    The 2.0 file was recorded by another torch build than the 1.x ones: gradients differ in their last bit.
    """
    oldest, newest = GOLDEN[0], GOLDEN[-1]
    report = tmp_path / "r.json"
    tolerances = ["--atol", "1e-7", "--rtol", "1e-6"]
    result = CliRunner().invoke(main, [str(oldest), str(newest), *tolerances, "--json", str(report)])
    assert result.exit_code == 0, result.output
    document = json.loads(report.read_text())
    assert [(s["step"], s["loss_a"], s["loss_b"]) for s in document["steps"]] == [  # step 1: a loss between full ones
        (0, LOSSES[0], LOSSES[0]), (1, LOSSES[1], LOSSES[1]), (2, LOSSES[2], LOSSES[2])]  # fmt: skip
