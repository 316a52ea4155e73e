"""Output paths are checked before any model is loaded; a failed capture (a full disk included) leaves nothing
behind; temporaries of killed captures are reported with the command that removes them (issue 18, item 7)."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import h5py
import pytest
from click.testing import CliRunner

from parity_harness.capture.cli.capture_run import main as capture_main
from parity_harness.capture.storage import streaming
from parity_harness.replay.cli.ckpt_diff import main as ckpt_diff_main
from parity_harness.replay.cli.replay_compare import main as replay_main
from tests.cli_helpers import one_error_line

FACTORY = """
import pathlib
from tests.models import build_tiny

def build():
    pathlib.Path(__file__).with_name("loaded").touch()  # proves the model was built
    return build_tiny()
"""


@pytest.fixture
def factory(tmp_path: Path) -> tuple[str, Path]:
    """A --model factory that leaves a ``loaded`` file beside itself when called."""
    module = tmp_path / "factory.py"
    module.write_text(FACTORY)
    return f"{module}:build", tmp_path / "loaded"


def _capture(model: str, out: Path, *extra: str) -> list[str]:
    return ["--model", model, "--out", str(out), "--batch-size", "2", "--seq-len", "4", *extra]


@pytest.mark.parametrize(
    ("where", "expected"),
    [("missing/out.h5", "does not exist; create it first"), ("existing.h5", "file exists; pass --overwrite")],
)
def test_capture_refuses_an_unusable_out_before_loading_the_model(
    tmp_path: Path, factory: tuple[str, Path], where: str, expected: str
) -> None:
    model, loaded = factory
    (tmp_path / "existing.h5").write_bytes(b"earlier")
    line = one_error_line("capture-run", CliRunner().invoke(capture_main, _capture(model, tmp_path / where)))
    assert expected in line
    assert not loaded.exists()
    assert (tmp_path / "existing.h5").read_bytes() == b"earlier"


@pytest.mark.parametrize("option", ["--json", "--report", "--plot"])
def test_replay_refuses_an_unwritable_report_before_loading_the_model(
    tmp_path: Path, tiny_bundle: Path, factory: tuple[str, Path], option: str
) -> None:
    model, loaded = factory
    args = ["--bundle", str(tiny_bundle), "--model", model, option, str(tmp_path / "missing" / "report")]
    line = one_error_line("replay-compare", CliRunner().invoke(replay_main, args))
    assert f"{option} " in line
    assert "does not exist" in line
    assert not loaded.exists()


def test_ckpt_diff_refuses_an_unwritable_out_first(tmp_path: Path, tiny_bundle: Path) -> None:
    args = [str(tiny_bundle), str(tiny_bundle), "--out", str(tmp_path / "missing" / "diff.txt")]
    assert "does not exist" in one_error_line("ckpt-diff", CliRunner().invoke(ckpt_diff_main, args))


def _no_space(*_: object) -> int:
    raise OSError(errno.ENOSPC, "No space left on device")


def _no_space_in_hdf5(self: h5py.File) -> None:
    raise OSError(
        errno.ENOSPC, "Can't flush (file write failed: errno = 28,\nerror message = 'No space left on device')"
    )


@pytest.mark.parametrize("where", ["tensor-data", "hdf5-metadata"])
def test_a_full_disk_is_one_line_and_leaves_nothing(
    tmp_path: Path, factory: tuple[str, Path], monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """ENOSPC while tensors stream out, or while HDF5 writes its own metadata at the end (a message of two
    lines): one line, exit 2, no bundle and no hidden temporary to keep the disk full."""
    if where == "tensor-data":
        monkeypatch.setattr(streaming.os, "pwrite", _no_space)
    else:
        monkeypatch.setattr(h5py.File, "flush", _no_space_in_hdf5)
    model, _ = factory
    out = tmp_path / "out" / "bundle.h5"
    out.parent.mkdir()
    line = one_error_line("capture-run", CliRunner().invoke(capture_main, _capture(model, out)))
    assert "writing the bundle failed" in line
    assert "No space left" in line or "no space left" in line
    assert list(out.parent.iterdir()) == []


def test_temporaries_of_killed_captures_are_reported(tmp_path: Path, factory: tuple[str, Path]) -> None:
    """A hidden temporary whose process is gone (a SIGKILLed capture) is named with the command removing it; one
    of a live process (a capture running now) is not."""
    model, _ = factory
    out = tmp_path / "bundle.h5"
    dead = tmp_path / f".bundle.h5.{2**22 + 12345}.0123abcd.tmp"
    live = tmp_path / f".bundle.h5.{os.getpid()}.89abcdef.tmp"
    dead.write_bytes(b"partial")
    live.write_bytes(b"partial")
    result = CliRunner().invoke(capture_main, _capture(model, out))
    assert result.exit_code == 0, result.output
    assert f"warning: {dead} was left by a capture that was killed; remove it: rm '{dead}'" in result.output
    assert str(live) not in result.output


def test_a_report_path_that_is_a_link_or_a_fifo_is_written_through(tmp_path: Path, tiny_bundle: Path) -> None:
    """--out through a symbolic link writes the link's target and keeps the link; --out /dev/stdout-like special
    files are written into, never replaced by a regular file; a bundle --out that is a link is refused."""
    target = tmp_path / "real.txt"
    target.write_text("old")
    link = tmp_path / "link.txt"
    link.symlink_to(target)
    result = CliRunner().invoke(ckpt_diff_main, [str(tiny_bundle), str(tiny_bundle), "--out", str(link)])
    assert result.exit_code == 0, result.output
    assert link.is_symlink()
    assert "EQUAL" in target.read_text() or "equal" in target.read_text()
    null = CliRunner().invoke(ckpt_diff_main, [str(tiny_bundle), str(tiny_bundle), "--out", os.devnull])
    assert null.exit_code == 0, null.output
    assert Path(os.devnull).is_char_device()
    bundle_link = tmp_path / "bundle.h5"
    bundle_link.symlink_to(tmp_path / "elsewhere.h5")
    line = one_error_line(
        "capture-run", CliRunner().invoke(capture_main, _capture("tests.models:build_tiny", bundle_link))
    )
    assert "not a regular file" in line


def test_capture_inputs_npz_gets_the_npz_checks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """capture-run --inputs: a FIFO is refused unopened and a zip bomb from its headers, one line each."""
    import numpy as np

    fifo = tmp_path / "inputs.npz"
    os.mkfifo(fifo)
    args = ["--model", "tests.models:build_tiny", "--out", str(tmp_path / "o.h5"), "--inputs", str(fifo)]
    assert "not a regular file" in one_error_line("capture-run", CliRunner().invoke(capture_main, args))
    bomb = tmp_path / "bomb.npz"
    np.savez_compressed(bomb, x=np.zeros(1 << 22, np.float32))
    monkeypatch.setenv("PARITY_NEMO_MAX_BYTES", "1M")
    args[-1] = str(bomb)
    assert "refused as a zip bomb" in one_error_line("capture-run", CliRunner().invoke(capture_main, args))
    assert not (tmp_path / "o.h5").exists()
