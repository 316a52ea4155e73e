"""DumpRun: per-batch torch dumps read as a training run, lazily and without running code."""

from __future__ import annotations

import builtins
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from parity_harness.common.errors import BundleNotFoundError, CheckpointError, InputError
from parity_harness.replay.training import dump_run
from parity_harness.replay.training.dump_run import DumpRun
from parity_harness.replay.training.kinds import open_run
from parity_harness.replay.training.runs import StepKey


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3), torch.nn.Linear(3, 2))


def _trained(steps: int = 3) -> list[dict[str, Any]]:
    """Dumps of a tiny seeded model trained with Adam, one per step."""
    model = _model()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    inputs, targets = torch.randn(8, 4), torch.randint(0, 2, (8,))
    dumps = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(inputs), targets)
        loss.backward()
        optimizer.step()
        dumps.append(
            {
                "model_state_dict": {k: v.clone() for k, v in model.state_dict().items()},
                "optimizer_state_dict": optimizer.state_dict(),
                "loss": loss.detach().clone(),
                "acc": 0.25,
            }
        )
    return dumps


def _save(path: Path, dump: object, **kwargs: Any) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(dump, path, **kwargs)
    return path


@pytest.fixture(scope="module")
def dumps() -> list[dict[str, Any]]:
    """Three steps of the tiny model."""
    return _trained()


@pytest.mark.parametrize(
    ("relative", "key"),
    [
        ("epoch_003/batch_0040.pt", StepKey(3, 40)),
        ("batch_dumps/epoch_1/batch_20.pt", StepKey(1, 20)),
        ("epoch1_batch20.pt", StepKey(1, 20)),
        ("e3_b40.pth", StepKey(3, 40)),
        ("batch_0040.bin", StepKey(None, 40)),
        ("step_000120.pt", StepKey(None, 120)),
        ("Epoch-2/iter-7.pt", StepKey(2, 7)),
        ("lr1e5/batch_idx_9.pt", StepKey(None, 9)),
    ],
    ids=["nested", "three-levels", "joined", "letters", "flat", "step", "dashes", "no-epoch-in-1e5"],
)
def test_path_patterns(tmp_path: Path, dumps: list[dict[str, Any]], relative: str, key: StepKey) -> None:
    """Each accepted naming gives the step's epoch and batch."""
    _save(tmp_path / relative, dumps[0])
    assert list(DumpRun(tmp_path).steps()) == [key]


def test_epochs_restarting_batch_numbers(tmp_path: Path, dumps: list[dict[str, Any]]) -> None:
    """Batch numbers restarting per epoch are different steps, ordered by epoch then batch."""
    for epoch in (1, 0):
        for batch, dump in enumerate(dumps):
            _save(tmp_path / f"epoch_{epoch:03d}" / f"batch_{batch:04d}.pt", dump)
    steps = DumpRun(tmp_path).steps()
    assert list(steps) == [StepKey(e, b) for e in (0, 1) for b in range(3)]
    assert steps[StepKey(1, 2)].loss == pytest.approx(dumps[2]["loss"].item())
    assert steps[StepKey(1, 2)].metrics == {"acc": 0.25}


def test_numbers_from_the_file_when_the_path_lacks_them(tmp_path: Path, dumps: list[dict[str, Any]]) -> None:
    """A number the path does not give comes from the dump's keys; the path wins over the keys."""
    _save(tmp_path / "dump_a.pt", {**dumps[0], "epoch": 2, "batch_idx": torch.tensor(5)})
    _save(tmp_path / "batch_0007.pt", {**dumps[1], "epoch": 1, "batch": 99})
    assert list(DumpRun(tmp_path).steps()) == [StepKey(1, 7), StepKey(2, 5)]


def test_no_batch_number_refused(tmp_path: Path, dumps: list[dict[str, Any]]) -> None:
    """A dump with no batch number in its name or keys is refused, naming it and the accepted names."""
    _save(tmp_path / "final.pt", dumps[0])
    with pytest.raises(InputError, match=r"final\.pt: no batch number .* epoch_003/batch_0040\.pt"):
        DumpRun(tmp_path).steps()


def test_single_file(tmp_path: Path, dumps: list[dict[str, Any]]) -> None:
    """One file is one step (batch 0 when nothing numbers it), its weights as float64."""
    file = _save(tmp_path / "reference.pt", dumps[1])
    run = open_run(file)
    assert isinstance(run, DumpRun)
    assert (run.kind, run.live, list(run.steps())) == ("dump", False, [StepKey(None, 0)])
    params = run.tensors(StepKey(None, 0), "params")
    assert params["0.weight"].dtype == np.float64
    np.testing.assert_array_equal(params["0.weight"], dumps[1]["model_state_dict"]["0.weight"].double().numpy())
    assert list(DumpRun(_save(tmp_path / "e4_b9.pt", dumps[1])).steps()) == [StepKey(4, 9)]


def test_folder_opened_by_open_run(tmp_path: Path, dumps: list[dict[str, Any]]) -> None:
    """open_run gives a folder to DumpRun, whose parameter names are the first dump's state dict."""
    _save(tmp_path / "batch_1.pt", dumps[0])
    run = open_run(tmp_path)
    assert (type(run), run.kind) == (DumpRun, "dump folder")
    assert run.parameter_names() == list(dumps[0]["model_state_dict"])


def test_module_prefix_stripped_and_bf16_widened(tmp_path: Path, dumps: list[dict[str, Any]]) -> None:
    """A DataParallel ``module.`` prefix is removed from weights and grads; bf16 reads as float64."""
    state = {f"module.{k}": v.to(torch.bfloat16) for k, v in dumps[0]["model_state_dict"].items()}
    grads = {"module.0.weight": torch.ones(3, 4)}
    _save(tmp_path / "batch_1.pt", {"state_dict": state, "grads": grads, "loss": 1.5})
    run = DumpRun(tmp_path)
    assert run.parameter_names() == list(dumps[0]["model_state_dict"])
    params = run.tensors(StepKey(None, 1), "params")
    np.testing.assert_array_equal(params["0.bias"], state["module.0.bias"].double().numpy())
    assert list(run.tensors(StepKey(None, 1), "grads")) == ["0.weight"]


def test_optimizer_state_named_by_parameter(tmp_path: Path, dumps: list[dict[str, Any]]) -> None:
    """Adam's state is named ``<parameter>/<key>`` (BatchNorm buffers skipped), ``step`` included as a scalar."""
    _save(tmp_path / "batch_2.pt", dumps[2])
    state = DumpRun(tmp_path).tensors(StepKey(None, 2), "optimizer")
    parameters = ["0.weight", "0.bias", "1.weight", "1.bias", "2.weight", "2.bias"]
    assert sorted(state) == sorted(f"{p}/{k}" for p in parameters for k in ("step", "exp_avg", "exp_avg_sq"))
    assert state["2.bias/step"].shape == ()
    assert float(state["2.bias/step"]) == 3.0
    expected = dumps[2]["optimizer_state_dict"]["state"][5]["exp_avg"].double().numpy()
    np.testing.assert_array_equal(state["2.bias/exp_avg"], expected)


def test_optimizer_state_unmatched_counts(tmp_path: Path, dumps: list[dict[str, Any]]) -> None:
    """When the optimizer's parameters do not match the state dict's count, they keep their indices."""
    state_dict = {**dumps[0]["model_state_dict"], "extra.position_ids": torch.arange(3)}
    _save(tmp_path / "batch_1.pt", {**dumps[0], "model_state_dict": state_dict})
    names = DumpRun(tmp_path).tensors(StepKey(None, 1), "optimizer")
    assert "param_0/exp_avg" in names
    assert "param_5/step" in names


def test_metrics_loss_ids_and_groups(tmp_path: Path, dumps: list[dict[str, Any]]) -> None:
    """Loss, accuracy, a metrics dict and sample ids are read; predictions and labels come as one array each."""
    extra = {"accuracy": 0.5, "metrics": {"f1": torch.tensor(0.75), "name": "x"}, "ids": ["a.wav", "b.wav"]}
    extra |= {"logits": torch.ones(2, 3), "targets": torch.tensor([0, 2])}
    _save(tmp_path / "batch_3.pt", {**dumps[0], **extra})
    _save(tmp_path / "batch_4.pt", {"model_state_dict": dumps[0]["model_state_dict"]})
    run = DumpRun(tmp_path)
    steps = run.steps()
    assert steps[StepKey(None, 3)].metrics == {"acc": 0.25, "accuracy": 0.5, "f1": 0.75}
    assert steps[StepKey(None, 3)].sample_ids == [("a.wav",), ("b.wav",)]
    assert (steps[StepKey(None, 4)].loss, steps[StepKey(None, 4)].sample_ids) == (None, None)
    np.testing.assert_array_equal(run.tensors(StepKey(None, 3), "labels")["labels"], [0.0, 2.0])
    assert run.tensors(StepKey(None, 3), "predictions")["predictions"].shape == (2, 3)
    assert run.tensors(StepKey(None, 4), "grads") == {}


def test_unknown_group_or_step_refused(tmp_path: Path, dumps: list[dict[str, Any]]) -> None:
    """An unknown tensor group or step is a one-line InputError."""
    run = DumpRun(_save(tmp_path / "batch_1.pt", dumps[0]).parent)
    with pytest.raises(InputError, match="unknown tensor group 'weights'; expected one of params"):
        run.tensors(StepKey(None, 1), "weights")
    with pytest.raises(InputError, match="no step 0:1 in this dump folder"):
        run.tensors(StepKey(0, 1), "params")


def test_loading_is_lazy(tmp_path: Path, dumps: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch) -> None:
    """Opening loads nothing, steps() maps each file once, tensors() loads one step once for all its groups."""
    for batch, dump in enumerate(dumps):
        _save(tmp_path / f"batch_{batch}.pt", dump)
    calls: list[tuple[str, bool]] = []
    real = dump_run.load_torch_object

    def spy(path: Path, trust_pickle: bool = False, *, mmap: bool = False) -> object:
        calls.append((path.name, mmap))
        return real(path, trust_pickle, mmap=mmap)

    monkeypatch.setattr(dump_run, "load_torch_object", spy)
    run = DumpRun(tmp_path)
    assert calls == []
    run.steps()
    run.steps()
    assert calls == [(f"batch_{b}.pt", True) for b in range(3)]
    calls.clear()
    for group in ("params", "optimizer", "grads"):
        run.tensors(StepKey(None, 1), group)
    assert calls == [("batch_1.pt", True)]


def test_old_serialization_format(tmp_path: Path, dumps: list[dict[str, Any]]) -> None:
    """A dump in torch's old (non-zip) format, which cannot be memory-mapped, is loaded whole."""
    _save(tmp_path / "batch_1.pt", dumps[0], _use_new_zipfile_serialization=False)
    run = DumpRun(tmp_path)
    assert run.steps()[StepKey(None, 1)].loss == pytest.approx(dumps[0]["loss"].item())
    assert "0.weight" in run.tensors(StepKey(None, 1), "params")


def test_duplicate_steps_name_both_files(tmp_path: Path, dumps: list[dict[str, Any]]) -> None:
    """Two files of the same (epoch, batch) are refused, naming both."""
    _save(tmp_path / "epoch_1" / "batch_5.pt", dumps[0])
    _save(tmp_path / "epoch1_batch5.pt", dumps[1])
    with pytest.raises(InputError, match=r"epoch1_batch5\.pt and .*batch_5\.pt: both are step 1:5"):
        DumpRun(tmp_path).steps()


@pytest.mark.parametrize("content", [None, "notes.txt", ".hidden/batch_1.pt"], ids=["empty", "no-dump", "hidden"])
def test_folder_without_dumps(tmp_path: Path, dumps: list[dict[str, Any]], content: str | None) -> None:
    """A folder with no dump says which file names are expected."""
    if content is not None:
        _save(tmp_path / content, dumps[0])
    with pytest.raises(InputError, match=r"no dump found .* expected files named like epoch_003/batch_0040\.pt"):
        DumpRun(tmp_path)


def test_missing_path(tmp_path: Path) -> None:
    """A path with nothing there is a BundleNotFoundError (a FileNotFoundError)."""
    with pytest.raises(BundleNotFoundError, match="no such dump or dump folder"):
        DumpRun(tmp_path / "absent")


@pytest.mark.parametrize(
    ("content", "said"),
    [([1, 2], r"holds a list, not a dict"), ({"foo": 1, "lr": 0.1}, r"holds neither .*its keys: 'foo', 'lr'")],
    ids=["list", "no-weights-no-loss"],
)
def test_dump_without_weights_or_loss_refused(tmp_path: Path, content: object, said: str) -> None:
    """A dump that is no dict, or holds neither weights nor a loss, is refused naming the file."""
    _save(tmp_path / "batch_1.pt", content)
    with pytest.raises(InputError, match=r"batch_1\.pt: " + said):
        DumpRun(tmp_path).steps()


class _Hostile:
    """Unpickled with code execution, it would create a file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str, str]]:
        return (builtins.open, (str(self.marker), "w"))


def test_code_executing_pickle_refused(tmp_path: Path, dumps: list[dict[str, Any]]) -> None:
    """A dump whose pickle calls a function is refused before anything runs."""
    marker = tmp_path / "marker"
    _save(tmp_path / "dumps" / "batch_1.pt", {**dumps[0], "loss": _Hostile(marker)})
    with pytest.raises(CheckpointError, match="cannot be loaded without running code"):
        DumpRun(tmp_path / "dumps").steps()
    assert not marker.exists()


@pytest.mark.parametrize("kind", ["file", "folder"])
def test_link_leaving_the_folder_refused(tmp_path: Path, dumps: list[dict[str, Any]], kind: str) -> None:
    """A link to a file or folder outside the dump folder is refused; one inside is read."""
    outside = _save(tmp_path / "outside" / "batch_9.pt", dumps[0])
    inside = _save(tmp_path / "run" / "batch_1.pt", dumps[0])
    try:
        os.symlink(inside, tmp_path / "run" / "batch_2.pt")
        os.symlink(outside if kind == "file" else outside.parent, tmp_path / "run" / "epoch_3")
    except OSError:
        pytest.skip("symbolic links are not permitted here")
    with pytest.raises(InputError, match=r"epoch_3: a link to .*outside.*, outside the dump folder"):
        DumpRun(tmp_path / "run")
    (tmp_path / "run" / "epoch_3").unlink()
    assert list(DumpRun(tmp_path / "run").steps()) == [StepKey(None, 1), StepKey(None, 2)]


def test_too_many_entries_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A walk meeting more entries than the cap stops with an error (a wrong folder, not a dump folder)."""
    monkeypatch.setattr(dump_run, "MAX_DUMP_FILES", 3)
    for index in range(4):
        (tmp_path / f"batch_{index}.txt").touch()
    with pytest.raises(InputError, match="more than 3 entries; this is not a dump folder"):
        DumpRun(tmp_path)
