"""The preflight child: a file that hangs or crashes HDF5 is refused; ordinary damage is left to the reader."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np
import pytest

from parity_harness.common.errors import BundleFormatError
from parity_harness.common.format import containment
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


def test_the_walk_reads_every_attribute_and_compact_dataset(
    tiny_bundle: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Between them, the containment walk (the ``dtype`` label of each dataset) and the rest of the child's walk read
    every attribute in the file and the data of every compact dataset, so that a crafted header fails HDF5 in the
    child; each is read once."""
    path = tmp_path / "annotated.h5"
    shutil.copy(tiny_bundle, path)
    compact = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
    compact.set_layout(h5py.h5d.COMPACT)
    with h5py.File(path, "r+") as file:
        file["outputs"].attrs["note"] = "a group's"
        name = next(key for key in file["params"])
        file["params"][name].attrs["note"] = "a dataset's second"
        file.create_dataset("extra/plain", data=np.arange(3)).attrs["only"] = 1  # no dtype label
        h5py.h5d.create(file.id, b"extra/compact", h5py.h5t.NATIVE_INT32, h5py.h5s.create_simple((4,)), dcpl=compact)
        objects = [file]
        file.visititems(lambda _, obj: objects.append(obj))  # each object once, as HDF5 names it
        expected = {(obj.name, key) for obj in objects for key in obj.attrs}
    read: list[tuple[str, str]] = []
    read_label, read_attribute = containment.string_attribute, h5py.AttributeManager.__getitem__

    def label(target: h5py.h5o.ObjectID, name: str) -> str | None:
        if h5py.h5a.exists(target, name.encode()):  # asked of every dataset, read where it is there
            read.append((h5py.h5i.get_name(target).decode(), name))
        return read_label(target, name)

    def attribute(self: h5py.AttributeManager, name: str) -> object:
        read.append((h5py.h5i.get_name(self._id).decode(), name))
        return read_attribute(self, name)

    data: list[str] = []
    read_data = h5py.Dataset.__getitem__
    monkeypatch.setattr(containment, "string_attribute", label)
    monkeypatch.setattr(h5py.AttributeManager, "__getitem__", attribute)
    monkeypatch.setattr(h5py.Dataset, "__getitem__", lambda self, key: data.append(self.name) or read_data(self, key))
    with h5py.File(path, "r") as file:
        containment.read_other_metadata(file, containment.check_contained(file, path, "bundle", "dtype"), "dtype")
    assert sorted(read) == sorted(expected)  # every attribute, once
    assert "/extra/compact" in data
