"""The preflight child: a file that hangs or crashes HDF5 is refused; ordinary damage is left to the reader."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from parity_harness.common.errors import BundleFormatError
from parity_harness.replay import preflight
from parity_harness.replay.reader import BundleReader


def test_a_valid_bundle_passes(tiny_bundle: Path) -> None:
    """A fresh bundle walks cleanly and opens."""
    preflight.preflight(tiny_bundle, seconds=30)
    with BundleReader(tiny_bundle, preflight=30) as reader:
        assert reader.index.calls


def test_a_hanging_walk_is_refused_in_time(tiny_bundle: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A walk that never ends (as HDF5 on a crafted header) is refused after the time limit."""
    monkeypatch.setattr(preflight, "_WALK", "import time\ntime.sleep(60)")
    with pytest.raises(BundleFormatError, match=r"did not finish within 1 s; the file is damaged or crafted"):
        preflight.preflight(tiny_bundle, seconds=1)


@pytest.mark.skipif(not hasattr(signal, "SIGALRM"), reason="needs SIGALRM")
def test_the_child_ends_itself_when_its_parent_cannot(tiny_bundle: Path) -> None:
    """The child's own alarm ends a hang in C code even if nobody kills it: a killed parent leaves no spinner."""
    busy = preflight._WALK.split("import h5py")[0] + "while True:\n    pass\n"
    done = subprocess.run([sys.executable, "-c", busy, str(tiny_bundle), "1"], timeout=30, check=False)
    assert done.returncode == -signal.SIGALRM


def test_a_crashing_walk_is_refused_naming_the_signal(tiny_bundle: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A walk that crashes the interpreter is refused, naming the signal."""
    monkeypatch.setattr(preflight, "_WALK", "import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)")
    with pytest.raises(BundleFormatError, match=r"HDF5 crashed \(SIGSEGV\)"):
        preflight.preflight(tiny_bundle, seconds=30)


def test_ordinary_damage_is_left_to_the_reader(tmp_path: Path) -> None:
    """A file HDF5 refuses quickly passes the preflight; the reader then names the problem itself."""
    path = tmp_path / "not-hdf5.h5"
    path.write_bytes(b"not an HDF5 file at all")
    preflight.preflight(path, seconds=30)
    with pytest.raises(BundleFormatError, match="not an HDF5 file"):
        BundleReader(path, preflight=30)


def test_a_walk_that_ended_while_the_port_loaded_passes_however_long_the_load(tiny_bundle: Path) -> None:
    """replay-compare walks the bundle while the port loads: a load outlasting the walk's time limit does not
    turn the finished walk of a valid bundle into a refusal."""
    walk = preflight.start(tiny_bundle, seconds=30)
    walk._child.wait(timeout=120)  # the walk ends while the port loads...
    walk._deadline = time.monotonic() - 1  # ...and the load outlasts the walk's time limit
    walk.result()


def test_a_cancelled_walk_leaves_no_child(tiny_bundle: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A command that fails or is interrupted while the walk runs ends the child at once."""
    monkeypatch.setattr(preflight, "_WALK", "import time\ntime.sleep(60)")
    walk = preflight.start(tiny_bundle, seconds=30)
    walk.cancel()
    assert walk._child.returncode is not None
