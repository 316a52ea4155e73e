"""Capture and replay run float32 as float32: TF32 and oneDNN's reduced modes off for the run, put back after.

On a GPU, TF32 (cuDNN's default for float32 convolutions) put a FastConformer-sized correct port 1e-4 away from
its reference and failed 569 of 586 parameter gradients at the defaults; with TF32 off on both sides it matched.
CI has no GPU: these tests check the settings the run sees and leaves, which are the same on every build.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from torch import nn

from parity_harness.capture.cli.capture_run import main as capture_main
from parity_harness.capture.record.provenance import snapshot
from parity_harness.capture.record.recorder import capture_run
from parity_harness.capture.record.tf32 import _precisions, full_float32
from parity_harness.capture.record.training import record_training
from parity_harness.replay.cli.replay_compare import main as replay_main
from parity_harness.replay.compare.runner import compare_run
from parity_harness.replay.reader import BundleReader
from parity_harness.replay.report.tables import render_provenance
from parity_harness.replay.training.rerun import rerun_training
from parity_harness.replay.training.training_file import TrainingRun
from tests.models import build_tiny, tiny_inputs


def _legacy(read: Callable[[], object]) -> object:
    try:
        return read()
    except RuntimeError:
        return "refused"


def _state() -> dict[str, object]:
    """Every setting the context touches, as torch reports it (a legacy flag torch refuses to read: "refused")."""
    state: dict[str, object] = {".".join(pair): torch._C._get_fp32_precision_getter(*pair) for pair in _precisions()}
    state["cudnn"] = _legacy(lambda: torch.backends.cudnn.allow_tf32)
    state["matmul"] = _legacy(lambda: torch.backends.cuda.matmul.allow_tf32)
    state["matmul_precision"] = _legacy(torch.get_float32_matmul_precision)
    return state


@pytest.fixture
def torch_defaults() -> Iterator[None]:
    """The process's float32 settings back at torch's defaults after the test, whatever it set."""
    defaults = [torch._C._get_fp32_precision_getter(*pair) for pair in _precisions()]
    yield
    torch.backends.cudnn.allow_tf32 = True
    torch.set_float32_matmul_precision("highest")
    for pair, value in zip(_precisions(), defaults, strict=True):
        torch._C._set_fp32_precision_setter(*pair, value)


def _medium() -> None:
    torch.set_float32_matmul_precision("medium")


def _high() -> None:
    torch.set_float32_matmul_precision("high")


def _legacy_matmul_on() -> None:
    torch.backends.cuda.matmul.allow_tf32 = True


def _new_api_conv_only() -> None:  # legacy and new disagree: torch refuses to read cudnn.allow_tf32
    if not _precisions():
        pytest.skip("this torch has no fp32_precision settings (before 2.9)")
    torch.backends.cudnn.conv.fp32_precision = "ieee"


@pytest.mark.usefixtures("torch_defaults")
@pytest.mark.parametrize("setup", [lambda: None, _high, _medium, _legacy_matmul_on, _new_api_conv_only])
def test_the_run_sees_full_float32_and_leaves_the_settings_as_they_were(setup: Callable[[], None]) -> None:
    """Whatever the process set, and however (legacy flags, set_float32_matmul_precision, the new per-operator
    settings, a mix torch refuses to read), the run sees no reduced float32 mode, legacy flags readable."""
    setup()
    before = _state()
    with full_float32():
        during = _state()
    assert _state() == before
    assert during["cudnn"] is False
    assert during["matmul"] is False
    assert during["matmul_precision"] == "highest"
    assert all(value == "ieee" for key, value in during.items() if "." in key)


def _parent_level_tf32() -> None:  # the documented new API at the backend's level, not per operator
    if not _precisions():
        pytest.skip("this torch has no fp32_precision settings (before 2.9)")
    torch.backends.cudnn.fp32_precision = "tf32"


@pytest.mark.usefixtures("torch_defaults")
@pytest.mark.parametrize("setup", [lambda: None, _parent_level_tf32])
def test_a_cudnn_flags_block_inside_the_model_hands_back_no_tf32(setup: Callable[[], None]) -> None:
    """A model whose forward runs a ``torch.backends.cudnn.flags()`` block: as the block exits, torch hands
    convolutions back to their parent level's setting, which was TF32 where the process set it there."""
    setup()
    with full_float32():
        with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
            pass
        after_block = _state()
        with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):  # a second block once failed to read flags
            pass
    assert after_block["cudnn"] is False
    assert all(value == "ieee" for key, value in after_block.items() if "." in key)


@pytest.mark.parametrize("allow_tf32", [False, True])
def test_torch_flags_frozen_by_a_test_harness_do_not_stop_a_run(tmp_path: Path, allow_tf32: bool) -> None:
    """torch's own test utilities freeze its flags (``disable_global_flags``): a capture and a replay still run,
    TF32 off, and the flags stay frozen."""
    torch.backends.disable_global_flags()
    try:
        capture_run(build_tiny(), tiny_inputs(), tmp_path / "frozen.h5", allow_tf32=allow_tf32)
        with BundleReader(tmp_path / "frozen.h5") as reader:
            assert compare_run(build_tiny(), reader, allow_tf32=allow_tf32).verdict == "MATCH"
            assert reader.provenance()["tf32_cudnn"] == str(allow_tf32)
        assert torch.backends.flags_frozen()
    finally:
        torch.backends.disable_global_flags.__globals__["__allow_nonbracketed_mutation_flag"] = True  # thaw them
    assert torch.backends.cudnn.allow_tf32 is True


@pytest.mark.usefixtures("torch_defaults")
def test_allow_tf32_keeps_the_settings_and_an_error_still_restores_them() -> None:
    _high()
    before = _state()
    with full_float32(allow_tf32=True):
        assert _state() == before
    with pytest.raises(ValueError, match="inside"), full_float32():
        raise ValueError("inside")
    assert _state() == before


class _Watching(nn.Module):
    """A linear layer that notes the TF32 settings its forward runs under, in a list it does not hold itself: capture
    and replay give a module's own lists back as they found them."""

    def __init__(self, seen: list[tuple[object, object]]) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.note = seen.append

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.note((torch.backends.cudnn.allow_tf32, torch.get_float32_matmul_precision()))
        return self.lin(x)


@pytest.mark.usefixtures("torch_defaults")
def test_capture_and_replay_run_without_tf32_and_provenance_says_so(tmp_path: Path) -> None:
    """cuDNN's TF32 is on by default and a model may ask for TF32 matrix products: neither reaches the run (the
    self-check's rerun included), the provenance records what the run used, and ``allow_tf32`` keeps them."""
    _high()
    torch.manual_seed(0)
    seen: list[tuple[object, object]] = []
    model, inputs = _Watching(seen), (torch.randn(2, 4),)
    capture_run(model, inputs, tmp_path / "off.h5", self_check=True)
    with BundleReader(tmp_path / "off.h5") as reader:
        result = compare_run(model, reader)
        recorded = reader.provenance()
    assert result.verdict == "MATCH"
    assert set(seen) == {(False, "highest")}
    assert (recorded["tf32_cudnn"], recorded["float32_matmul_precision"]) == ("False", "highest")
    assert result.replay_provenance["tf32_matmul"] == "False"
    seen.clear()
    capture_run(model, inputs, tmp_path / "on.h5", allow_tf32=True)
    with BundleReader(tmp_path / "on.h5") as reader:
        compare_run(model, reader, allow_tf32=True)
        assert reader.provenance()["float32_matmul_precision"] == "high"
    assert set(seen) == {(True, "high")}
    assert torch.get_float32_matmul_precision() == "high"


@pytest.mark.usefixtures("torch_defaults")
def test_provenance_of_settings_torch_refuses_to_read_is_a_line_not_a_crash(tmp_path: Path) -> None:
    """A process that set cuDNN's TF32 through both of torch's APIs, disagreeing, made reading the legacy flag
    raise: capture's provenance crashed with it. The run itself has them agree; outside it the snapshot says so."""
    _new_api_conv_only()
    assert _state()["cudnn"] == "refused"
    assert "disagree" in snapshot()["tf32_cudnn"]
    capture_run(build_tiny(), tiny_inputs(), tmp_path / "mixed.h5")
    with BundleReader(tmp_path / "mixed.h5") as reader:
        assert reader.provenance()["tf32_cudnn"] == "False"
        assert "tf32_cudnn" in render_provenance(reader.provenance(), snapshot())


@pytest.mark.usefixtures("torch_defaults")
def test_the_commands_turn_tf32_off_unless_allow_tf32(tmp_path: Path, tiny_ckpt: Path) -> None:
    """capture-run and replay-compare at torch's defaults (cuDNN's TF32 on) record runs without it;
    ``--allow-tf32`` keeps it, and the replay's provenance says which it used."""
    model = f"{Path(__file__).resolve().parent.parent / 'models.py'}:build_tiny"
    inputs = tmp_path / "inputs.npz"
    np.savez(inputs, x=np.random.default_rng(7).standard_normal((2, 3, 4)).astype(np.float32))
    for flag, expected in (((), "False"), (("--allow-tf32",), "True")):
        out, report = tmp_path / f"tiny{expected}.h5", tmp_path / f"report{expected}.json"
        common = ["--model", model, "--ckpt", str(tiny_ckpt), *flag]
        captured = CliRunner().invoke(capture_main, [*common, "--out", str(out), "--inputs", str(inputs)])
        assert captured.exit_code == 0, captured.output
        with BundleReader(out) as reader:
            assert reader.provenance()["tf32_cudnn"] == expected
        replayed = CliRunner().invoke(replay_main, [*common, "--bundle", str(out), "--json", str(report)])
        assert replayed.exit_code == 0, replayed.output
        assert json.loads(report.read_text())["provenance"]["replay"]["tf32_cudnn"] == expected
    assert torch.backends.cudnn.allow_tf32 is True


@pytest.mark.usefixtures("torch_defaults")
def test_training_runs_and_reruns_without_tf32(tmp_path: Path) -> None:
    """capture-run --steps and replay-compare --steps train with TF32 off as well (allow_tf32 keeps it)."""
    seen: list[bool] = []

    def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        seen.append(torch.backends.cudnn.allow_tf32)
        optimizer.zero_grad()
        loss = model(batch["x"]).square().mean()
        loss.backward()
        optimizer.step()
        return loss

    def model_and_optimizer() -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = nn.Linear(4, 2)
        return model, torch.optim.SGD(model.parameters(), lr=0.1)

    batches = [{"x": torch.randn(3, 4)} for _ in range(2)]
    record_training(*model_and_optimizer(), batches, train_step, tmp_path / "run.h5")
    with TrainingRun(tmp_path / "run.h5") as run:
        rerun_training(*model_and_optimizer(), train_step, run, tmp_path / "port.h5")
    assert seen == [False] * 4
    record_training(*model_and_optimizer(), batches, train_step, tmp_path / "kept.h5", allow_tf32=True)
    assert seen[4:] == [True, True]


WATCHED_MODEL = """
import os
import torch
from tests.models import TinyNet


class Watched(TinyNet):
    def forward(self, x):
        with open(os.environ["TF32_SEEN"], "a") as log:
            log.write(f"{torch.backends.cudnn.allow_tf32}\\n")
        return super().forward(x)


def build():
    torch.manual_seed(0)
    return Watched()
"""


@pytest.mark.usefixtures("torch_defaults")
def test_map_auto_aligns_with_the_setting_the_replay_runs_with(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--map auto runs the port once to align it; that run computed with TF32 as torch set it (on for cuDNN),
    whatever the replay then used."""
    (tmp_path / "watched.py").write_text(WATCHED_MODEL)
    seen = tmp_path / "seen.txt"
    monkeypatch.setenv("TF32_SEEN", str(seen))
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2]))
    bundle = tmp_path / "tiny.h5"
    capture_run(build_tiny(), tiny_inputs(), bundle)
    model = f"{tmp_path / 'watched.py'}:build"
    result = CliRunner().invoke(replay_main, ["--bundle", str(bundle), "--model", model, "--map", "auto"])
    assert result.exit_code == 0, result.output
    runs = seen.read_text().split()
    assert len(runs) >= 2  # the alignment's run and the replay's (one forward each)
    assert set(runs) == {"False"}
