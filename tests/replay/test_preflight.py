"""The preflight child: a file that hangs or crashes HDF5 is refused; ordinary damage is left to the reader."""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import h5py
import numpy as np
import pytest

from parity_harness.common.errors import BundleChangedError, BundleFormatError, InputError
from parity_harness.common.format import containment
from parity_harness.common.format.bundle.layout import ATTR_DTYPE
from parity_harness.common.format.tensor_files import is_hdf5_file
from parity_harness.replay import preflight
from parity_harness.replay import reader as reader_module
from parity_harness.replay.reader import BundleReader
from parity_harness.replay.training import training_file
from tests.hostile import craft_copy, external_storage, replace_in_place

DATA = Path(__file__).resolve().parent.parent / "data"
_Walk = preflight.Preflight


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


def test_a_file_hdf5_cannot_open_is_named_by_the_walk(tmp_path: Path) -> None:
    """A file that is not HDF5 is refused by the walk in the reader's words (the walk describes no file for the
    reader to hold its open to)."""
    path = tmp_path / "not-hdf5.h5"
    path.write_bytes(b"not an HDF5 file at all")
    with pytest.raises(BundleFormatError, match=r"not-hdf5\.h5: not an HDF5 file, so not a bundle \(OSError"):
        preflight.preflight(path, seconds=30)
    with pytest.raises(BundleFormatError, match="not an HDF5 file"):
        BundleReader(path, preflight=30)


def test_damage_past_the_superblock_is_called_damage_not_a_change(tiny_bundle: Path, tmp_path: Path) -> None:
    """A bundle whose metadata HDF5 fails on (its index's object header overwritten), unchanged, is refused as
    damaged, with HDF5's reason: never as a file that changed, which running again cannot mend."""
    path = tmp_path / "damaged.h5"
    shutil.copyfile(tiny_bundle, path)
    with h5py.File(path, "r") as file:
        header = h5py.h5o.get_info(file["index"].id).addr
    raw = bytearray(path.read_bytes())
    raw[header : header + 64] = b"\xa5" * 64
    path.write_bytes(bytes(raw))
    with pytest.raises(BundleFormatError, match=r"damaged\.h5: the bundle is damaged: reading its metadata failed \("):
        preflight.preflight(path, seconds=30)


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


# ---------------------------------------------------------------- the walk's catalog, handed to the reader


def test_the_walks_catalog_is_what_the_reader_would_find(tiny_bundle: Path) -> None:
    """The child's catalog names every dataset (with its dtype label) with the same place, shape and dtype as the
    parent's own walk, and the file it describes."""
    catalog = preflight.preflight(tiny_bundle, seconds=30, label="dtype")
    assert catalog is not None
    with h5py.File(tiny_bundle, "r") as file:
        walked = containment.check_contained(file, tiny_bundle, "bundle", label="dtype")
    assert catalog.datasets == walked
    assert len(walked) > 10
    assert all(stored.label for name, stored in walked.items() if name.startswith("params/"))
    assert catalog.describes(tiny_bundle.stat())


def test_a_reader_uses_the_catalog_of_the_file_unchanged(tiny_bundle: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Given the catalog of the file it opens, the reader does not walk the file again; given one of a file since
    changed (another modification time, set back by a user: the status change time still moved), it refuses the file
    rather than walk in this process what a child was to walk."""
    catalog = preflight.preflight(tiny_bundle, seconds=30, label="dtype")
    walks: list[Path] = []
    walk = reader_module.check_contained
    monkeypatch.setattr(
        reader_module, "check_contained", lambda f, path, *a, **k: walks.append(path) or walk(f, path, *a, **k)
    )
    with BundleReader(tiny_bundle, catalog=catalog) as reader:
        assert reader.index.calls
    assert walks == []
    status = tiny_bundle.stat()
    os.utime(tiny_bundle, ns=(status.st_atime_ns, status.st_mtime_ns + 1))
    os.utime(tiny_bundle, ns=(status.st_atime_ns, status.st_mtime_ns))
    with pytest.raises(BundleFormatError, match="the bundle opened is not the one checked: it changed or was replaced"):
        BundleReader(tiny_bundle, catalog=catalog)
    assert walks == []


def test_a_bundle_opened_again_unchanged_is_not_walked_again(
    tiny_bundle: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Opened again in the same process (a test suite asserting parity test after test), an unchanged bundle is not
    walked again; changed in place since (here crafted to read another file), it is walked again and refused."""
    path = tmp_path / "bundle.h5"
    shutil.copyfile(tiny_bundle, path)
    walks: list[Path] = []
    walk = reader_module.check_contained
    monkeypatch.setattr(
        reader_module, "check_contained", lambda f, path, *a, **k: walks.append(path) or walk(f, path, *a, **k)
    )
    for _ in range(3):
        with BundleReader(path) as reader:
            assert reader.index.calls
    assert walks == [path]
    secret = tmp_path / "secret.bin"
    secret.write_bytes(b"x" * (1 << 16))
    inode = path.stat().st_ino
    replace_in_place(path, "params/head.weight", external_storage, secret)
    status = path.stat()
    assert status.st_ino == inode
    os.utime(path, ns=(status.st_atime_ns, status.st_mtime_ns + 10**9))  # changed later than the clock's tick
    with pytest.raises(BundleFormatError, match="stored in another file"):
        BundleReader(path)
    assert walks == [path, path]


def test_a_catalog_never_vouches_for_a_file_put_in_its_place(
    tiny_bundle: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file swapped in at the path after the walk (here one whose dataset reads another file) is refused unwalked:
    the catalog names the file it came from, not the path."""
    path = tmp_path / "bundle.h5"
    shutil.copyfile(tiny_bundle, path)
    catalog = preflight.preflight(path, seconds=30, label="dtype")
    assert catalog is not None
    secret = tmp_path / "secret.bin"
    secret.write_bytes(b"x" * (1 << 16))
    crafted = craft_copy(path, tmp_path, external_storage, secret)
    os.replace(crafted, path)
    monkeypatch.setattr(reader_module, "check_contained", lambda *a, **k: pytest.fail("walked in this process"))
    with pytest.raises(BundleFormatError, match="not the one checked"):
        BundleReader(path, catalog=catalog)


def test_a_bundle_replaced_between_its_walk_and_its_opening_is_refused_unopened(
    tiny_bundle: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reader asked to walk a bundle in a child reads only the file that walk described: one put in its place
    after the child's walk (a crafted file whose dataset reads another file) is refused before HDF5 opens it in
    this process, let alone walks it."""
    path = tmp_path / "bundle.h5"
    shutil.copyfile(tiny_bundle, path)
    secret = tmp_path / "secret.bin"
    secret.write_bytes(b"x" * (1 << 16))
    crafted = craft_copy(path, tmp_path, external_storage, secret)
    walk = reader_module.walk_in_child

    def walk_then_swap(walked: Path, **options: object) -> containment.Catalog:
        catalog = walk(walked, **options)
        os.replace(crafted, walked)
        return catalog

    monkeypatch.setattr(reader_module, "walk_in_child", walk_then_swap)
    monkeypatch.setattr(reader_module, "_open_hdf5", lambda *a, **k: pytest.fail("opened by HDF5 in this process"))
    with pytest.raises(BundleChangedError, match=r"bundle\.h5: the bundle opened is not the one checked"):
        BundleReader(path, preflight=30)


def test_a_walk_that_saw_its_file_change_vouches_for_nothing(
    tiny_bundle: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A child that saw the file change under its walk, or go, makes the file refused as changed, to be run again;
    one that ends well but hands back nothing readable is refused as such. Never opened unchecked."""
    monkeypatch.setattr(reader_module, "_open_hdf5", lambda *a, **k: pytest.fail("opened by HDF5 in this process"))
    changed = "import sys\nprint('x.h5: changed while its metadata was checked', file=sys.stderr)\nsys.exit(6)"
    monkeypatch.setattr(preflight, "_WALK", changed)
    with pytest.raises(
        BundleChangedError, match=r"x\.h5: changed while its metadata was checked: the bundle is not read"
    ):
        BundleReader(tiny_bundle, preflight=30)
    monkeypatch.setattr(preflight, "_WALK", "import sys")
    with pytest.raises(BundleFormatError, match=r"could not hand back what it found \(0 bytes; is the temporary"):
        BundleReader(tiny_bundle, preflight=30)


def test_a_file_written_to_while_the_child_walks_it_is_refused_as_changed(
    tiny_bundle: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The child compares the file HDF5 opened before and after its walk: a byte appended meanwhile (here as its
    containment walk ends) makes it report a change, which the reader refuses without opening the file."""
    path = tmp_path / "bundle.h5"
    shutil.copyfile(tiny_bundle, path)
    appending = (
        "import parity_harness.common.format.containment as walk\n_walk = walk.check_contained\n"
        "def walk_then_append(file, where, *a, **k):\n    found = _walk(file, where, *a, **k)\n"
        "    with open(where, 'ab') as out:\n        out.write(b'\\0')\n    return found\n"
        "walk.check_contained = walk_then_append\n"
    )
    monkeypatch.setattr(preflight, "_WALK", appending + preflight._WALK)
    monkeypatch.setattr(reader_module, "_open_hdf5", lambda *a, **k: pytest.fail("opened by HDF5 in this process"))
    with pytest.raises(BundleChangedError, match=r"bundle\.h5: changed while its metadata was checked"):
        BundleReader(path, preflight=30)


def test_a_file_removed_before_the_child_opens_it_is_called_changed(
    tiny_bundle: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bundle removed between this process's look and the child's is refused as changed (run again), not as a file
    that is not HDF5."""
    path = tmp_path / "bundle.h5"
    shutil.copyfile(tiny_bundle, path)
    monkeypatch.setattr(preflight, "_WALK", "import os, sys\nos.unlink(sys.argv[1])\n" + preflight._WALK)
    with pytest.raises(BundleChangedError, match="finds no file at this path"):
        preflight.preflight(path, seconds=30)


def _swapping_walks(monkeypatch: pytest.MonkeyPatch, module: object, replacement: Path) -> None:
    """Make ``module``'s walks put a fresh copy of ``replacement`` at the walked path as each walk ends."""
    walk = module.walk_in_child  # type: ignore[attr-defined]

    def walk_then_swap(walked: Path, **options: object) -> containment.Catalog:
        catalog = walk(walked, **options)
        copy = walked.with_suffix(".swap")
        shutil.copyfile(replacement, copy)
        os.replace(copy, walked)
        return catalog

    monkeypatch.setattr(module, "walk_in_child", walk_then_swap)


@pytest.mark.parametrize("locked", [False, True], ids=["idle", "someone holds a lock on it"])
def test_a_training_file_replaced_between_its_walk_and_its_opening_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, locked: bool
) -> None:
    """The same for a training file (parity-train-diff), however often it is tried again: the file swapped in after
    each walk is refused before its header is read in this process. A lock held on the file (as a writer's would
    be, or anyone's who can read it) lets it grow between the walk and the open, never be another file."""
    path = tmp_path / "run.h5"
    shutil.copyfile(DATA / "training-golden-2.0.h5", path)
    _swapping_walks(monkeypatch, training_file, DATA / "training-golden-2.0.h5")
    monkeypatch.setattr(training_file, "read_header", lambda *a, **k: pytest.fail("read in this process"))
    with path.open("rb") as holder:
        if locked:
            fcntl.flock(holder.fileno(), fcntl.LOCK_EX)
        with pytest.raises(BundleChangedError, match=r"run\.h5: the training file opened is not the one checked"):
            training_file.TrainingRun(path)


def test_the_users_own_training_file_being_written_fast_is_read_as_its_writer_leaves_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A training file of the user's own that a writer holds (HDF5's lock) and changes under every walk is read in
    this process, as before walks were compared with the file; another user's locked file is not: anyone who can
    read a file can lock it."""
    path = tmp_path / "run.h5"
    shutil.copyfile(DATA / "training-golden-2.0.h5", path)

    def always_changing(walked: Path, **options: object) -> containment.Catalog:
        raise BundleChangedError(f"{walked}: changed while its metadata was checked")

    monkeypatch.setattr(training_file, "walk_in_child", always_changing)
    with path.open("rb") as writer:
        fcntl.flock(writer.fileno(), fcntl.LOCK_EX)
        run = training_file.TrainingRun(path)
        assert run.live
        assert run.full_steps()
        run.close()
        monkeypatch.setattr(training_file.os, "getuid", lambda: os.stat(path).st_uid + 1)
        with pytest.raises(BundleChangedError, match="changed while its metadata was checked"):
            training_file.TrainingRun(path)


def test_a_walk_that_hangs_on_a_live_training_file_is_not_tried_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A walk's refusal, hang or crash is the verdict on a live training file too: not repeated at its full time
    limit as a file read mid-step is."""
    path = tmp_path / "run.h5"
    shutil.copyfile(DATA / "training-golden-2.0.h5", path)
    monkeypatch.setattr(preflight, "_WALK", "import time\ntime.sleep(60)")
    starts = []
    monkeypatch.setattr(preflight, "Preflight", lambda *a, **k: starts.append(a) or _Walk(*a, **k))
    with path.open("rb") as writer:
        fcntl.flock(writer.fileno(), fcntl.LOCK_EX)
        with pytest.raises(BundleFormatError, match="did not finish within 1 s"):
            training_file.TrainingRun(path, preflight=1)
    assert len(starts) == 1


def test_asking_whether_a_fifo_is_being_written_never_waits(tmp_path: Path) -> None:
    """A FIFO put where a training file was is not opened for reading in a way that waits for a writer."""
    fifo = tmp_path / "run.h5"
    os.mkfifo(fifo)
    answers: list[bool] = []
    asking = threading.Thread(target=lambda: answers.append(training_file._held_by_writer(fifo)), daemon=True)
    asking.start()
    asking.join(timeout=20)
    assert answers == [False]


def test_a_training_file_that_changed_under_a_walk_is_walked_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A training file written without HDF5's lock (file locking off, as on some network file systems) that changed
    between one walk and the open is walked again, and read once a walk describes it."""
    path = tmp_path / "run.h5"
    shutil.copyfile(DATA / "training-golden-2.0.h5", path)
    walk, walks = training_file.walk_in_child, []

    def walk_then_touch_once(walked: Path, **options: object) -> containment.Catalog:
        catalog = walk(walked, **options)
        walks.append(walked)
        if len(walks) == 1:
            with walked.open("ab") as file:  # a step flushed
                file.write(b"\0")
        return catalog

    monkeypatch.setattr(training_file, "walk_in_child", walk_then_touch_once)
    run = training_file.TrainingRun(path)
    assert len(walks) == 2
    assert run.full_steps()


def test_the_walk_describes_the_file_hdf5_opened_not_the_path(tmp_path: Path, tiny_bundle: Path) -> None:
    """A path through a folder link flipped to another folder just while the child's HDF5 opens it, and back
    (a race made certain here), is refused by the child: the file it walked is not the one this process sees."""
    for folder in ("first", "second"):
        (tmp_path / folder).mkdir()
        shutil.copyfile(tiny_bundle, tmp_path / folder / "bundle.h5")
    link = tmp_path / "link"
    link.symlink_to("first")

    def flip(target: str) -> str:
        return (
            f"os.symlink({target!r}, {str(tmp_path / 'tmp')!r}); os.replace({str(tmp_path / 'tmp')!r}, {str(link)!r})"
        )

    race = (
        "import os, h5py\n_open = h5py.File\n"
        f"def racing(*a, **k):\n    {flip('second')}\n    f = _open(*a, **k)\n    {flip('first')}\n    return f\n"
        "h5py.File = racing\n"
    )
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(preflight, "_WALK", preflight._WALK.replace("import h5py\n", "import h5py\n" + race, 1))
        with pytest.raises(BundleFormatError, match="finds another file at this path"):
            preflight.preflight(link / "bundle.h5", seconds=30)


def test_the_reader_reads_the_file_hdf5_opened_even_if_the_path_is_replaced(
    tiny_bundle: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Records are read from the file HDF5 opened and the walk described: the path replaced by a file of other bytes
    right after HDF5 opened it (before the reader maps it) changes nothing the reader returns."""
    path = tmp_path / "bundle.h5"
    shutil.copyfile(tiny_bundle, path)
    other = tmp_path / "other.h5"
    other.write_bytes(b"\xff" * path.stat().st_size)
    open_hdf5 = reader_module._open_hdf5

    def open_then_swap(opened: Path) -> h5py.File:
        file = open_hdf5(opened)
        os.replace(other, opened)
        return file

    monkeypatch.setattr(reader_module, "_open_hdf5", open_then_swap)
    with BundleReader(path) as reader:
        for ref in reader.index.tensor_refs():
            if ref.path not in reader.index.summaries:
                reader.read_array(ref)  # every CRC-32 matches: the bytes of the file opened
        assert reader.verified


def test_a_catalog_is_plain_data_or_nothing(tmp_path: Path) -> None:
    """A catalog survives its bytes exactly (a name that is not UTF-8 included); garbage or a truncated hand-over
    decodes to None (the reader then walks), and a dataset whose dtype has no plain form gives no catalog."""
    stored = containment.StoredDataset((2, 3), np.dtype(">u2"), 4096, 12, "U16")
    catalog = containment.Catalog(
        (1, 2, 3, 4, 5), {"a/\udcff": stored, "b": containment.StoredDataset((), np.dtype("bool"), None, 1)}
    )
    raw = catalog.to_bytes()
    assert raw is not None
    assert containment.Catalog.from_bytes(raw) == catalog
    for broken in (b"", raw[: len(raw) // 2], b"\x93\x01\x02\x03", b"\xc1"):
        assert containment.Catalog.from_bytes(broken) is None
    text = containment.StoredDataset((1,), h5py.string_dtype("ascii", 2), None, 2)
    assert containment.Catalog((1, 2, 3, 4, 5), {"s": text}).to_bytes() is None


def test_the_commands_walk_a_bundle_once_in_the_child(
    tiny_bundle: Path, tiny_ckpt: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """replay-compare and ckpt-diff's bundle source open the bundle with the child's catalog: this process does not
    walk the file a second time."""
    from click.testing import CliRunner

    from parity_harness.replay.ckpt_diff.bundle_source import BundleSource
    from parity_harness.replay.cli.replay_compare import main

    walks: list[Path] = []
    walk = reader_module.check_contained
    monkeypatch.setattr(
        reader_module, "check_contained", lambda f, path, *a, **k: walks.append(path) or walk(f, path, *a, **k)
    )
    model = f"{Path(__file__).resolve().parent.parent / 'models.py'}:build_tiny"
    result = CliRunner().invoke(main, ["--bundle", str(tiny_bundle), "--model", model, "--ckpt", str(tiny_ckpt)])
    assert result.exit_code == 0, result.output
    source = BundleSource(tiny_bundle)
    assert source.tensors
    assert walks == []


# --------------------------------------------------------------------------- the walk started early


def _count_walks(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """Every walk child started from now on."""
    started: list[object] = []
    popen = subprocess.Popen

    def counting(*args: object, **kwargs: object) -> object:
        started.append(args[0])
        return popen(*args, **kwargs)  # type: ignore[call-overload]

    monkeypatch.setattr(preflight.subprocess, "Popen", counting)
    return started


def test_a_walk_started_early_is_the_one_the_job_waits_for(tiny_bundle: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The command line starts the walk before torch imports; the job's own start of the same file takes that walk
    over: one child walks the bundle, and its catalog reaches the reader."""
    started = _count_walks(monkeypatch)
    with preflight.walking_early(tiny_bundle, label=ATTR_DTYPE):
        catalog = preflight.start(tiny_bundle, label=ATTR_DTYPE).result()
    assert len(started) == 1
    assert catalog is not None
    assert catalog.identity == containment.file_identity(os.stat(tiny_bundle))


def _replace(path: Path) -> None:
    """Another file put in ``path``'s place (a new inode)."""
    replacement = path.with_name("replacement.h5")
    shutil.copyfile(path, replacement)
    os.replace(replacement, path)


def _rewrite_in_place(path: Path) -> None:
    """The same file written again in place (same inode and size; a crafted header could be written so)."""
    status = os.stat(path)
    with path.open("r+b") as file:
        file.seek(-1, os.SEEK_END)
        last = file.read(1)
        file.seek(-1, os.SEEK_END)
        file.write(last)
    os.utime(path, ns=(status.st_atime_ns, status.st_mtime_ns + 1_000_000_000))  # past the clock's granularity


@pytest.mark.parametrize("change", [_replace, _rewrite_in_place], ids=["replaced", "rewritten-in-place"])
def test_an_early_walk_of_a_file_changed_since_is_not_taken_over(
    tiny_bundle: Path, change: Callable[[Path], None], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bundle changed between the early start and the job's (another file put in its place, or its bytes written
    again) is walked again, as it is now; the walk of what the path held before is ended."""
    monkeypatch.setattr(preflight, "_WALK", "import time\ntime.sleep(60)")
    with preflight.walking_early(tiny_bundle, label=ATTR_DTYPE):
        early = preflight._EARLY[next(iter(preflight._EARLY))][1]
        change(tiny_bundle)
        monkeypatch.undo()
        walk = preflight.start(tiny_bundle, label=ATTR_DTYPE)
        assert early._child.returncode is not None  # ended, not waited for
        assert walk is not early
        catalog = walk.result()
    assert catalog is not None
    assert catalog.identity == containment.file_identity(os.stat(tiny_bundle))


def test_an_early_walk_nobody_takes_over_is_ended_with_its_block(
    tiny_bundle: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A command that fails before its job starts (or replays other files) leaves no child walking behind it."""
    monkeypatch.setattr(preflight, "_WALK", "import time\ntime.sleep(60)")
    walks: list[preflight.Preflight] = []

    def fail_while_walking() -> None:
        with preflight.walking_early(tiny_bundle, label=ATTR_DTYPE):
            walks.extend(walk for _, walk in preflight._EARLY.values())
            raise RuntimeError("the adapter failed to import")

    with pytest.raises(RuntimeError):
        fail_while_walking()
    (early,) = walks
    assert early._child.returncode is not None
    assert preflight._EARLY == {}


def test_an_early_walk_leaves_a_path_that_is_no_file_to_the_command(tmp_path: Path) -> None:
    """A missing path or a folder starts no walk: the command's own check names it."""
    for path in (tmp_path / "missing.h5", tmp_path, None):
        with preflight.walking_early(path, label=ATTR_DTYPE):
            assert preflight._EARLY == {}


_WALK_ORDER_PROBE = """
import importlib
import sys
walks = []
def note_walks(event, args):
    if event == "subprocess.Popen" and "check_contained" in " ".join(map(str, args[1])):
        walks.append("torch" in sys.modules)
sys.addaudithook(note_walks)
main = importlib.import_module(sys.argv[1]).main
try:
    main(sys.argv[2:])
finally:
    print("torch imported as each walk started:", walks, file=sys.stderr)
"""


def _walks_before_torch(command: str, *arguments: str) -> tuple[int, str]:
    """Run the command's module as its own process; its exit code and, for each metadata walk it started, whether
    torch was imported by then."""
    module = f"parity_harness.replay.cli.{command}"
    done = subprocess.run(
        [sys.executable, "-c", _WALK_ORDER_PROBE, module, *arguments], capture_output=True, text=True, check=False
    )
    found = re.search(r"torch imported as each walk started: (\[.*\])", done.stderr)
    assert found is not None, done.stderr
    return done.returncode, found.group(1)


def test_replay_compare_starts_the_walk_before_it_imports_torch(tiny_bundle: Path, tiny_ckpt: Path) -> None:
    """replay-compare, as its own process, starts its one metadata walk before importing torch, so that the child's
    start and walk (0.2 s) run while torch imports rather than after; the replay still matches."""
    model = f"{Path(__file__).resolve().parent.parent / 'models.py'}:build_tiny"
    arguments = ["--bundle", str(tiny_bundle), "--model", model, "--ckpt", str(tiny_ckpt), "--quiet"]
    assert _walks_before_torch("replay_compare", *arguments) == (0, "[False]")


def test_train_diff_walks_both_training_files_while_torch_imports(tmp_path: Path) -> None:
    """parity-train-diff A B starts both files' walks before importing torch (0.6 s of its 3.6 s); the same file
    given twice starts one early walk, not a second one nobody takes over (its second opening walks it again, as
    every opening does); a run that is no HDF5 file (a prediction CSV) starts no walk."""
    first, second = tmp_path / "a.h5", tmp_path / "b.h5"
    for copy in (first, second):
        shutil.copy(DATA / "training-golden-2.0.h5", copy)
    assert _walks_before_torch("train_diff", str(first), str(second)) == (0, "[False, False]")
    assert _walks_before_torch("train_diff", str(first), str(first)) == (0, "[False, True]")
    csv = tmp_path / "predictions.csv"
    csv.write_text("sample,label,logit_0\n0,0,1.0\n")
    code, walks = _walks_before_torch("train_diff", str(csv), str(csv))
    assert walks == "[]"
    assert code in (0, 1, 2)  # what the comparison makes of this CSV is not the point


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_looking_for_hdf5_never_opens_a_fifo(tmp_path: Path) -> None:
    """Deciding whether a command's input is an HDF5 file to walk early reads the first bytes of regular files only:
    a FIFO given as a run or checkpoint is refused by the command's own check, never opened (opening one for reading
    would wait for a writer)."""
    fifo = tmp_path / "run.h5"
    os.mkfifo(fifo)
    assert not is_hdf5_file(fifo)
    assert not is_hdf5_file(tmp_path)
    assert is_hdf5_file(DATA / "training-golden-2.0.h5")


def test_a_multi_rank_capture_is_walked_from_its_rank_files_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """replay-compare given a manifest starts its early walk on the first rank file, which the job takes over, and
    walks no file twice, nor the manifest (a JSON file, no HDF5)."""
    from click.testing import CliRunner

    from parity_harness.replay.cli.replay_compare import main

    golden = sorted(DATA.glob("manifest-golden-*.manifest.json"))[-1]
    stem = golden.name.removesuffix(".manifest.json")
    for file in DATA.glob(f"{stem}.*"):
        shutil.copy(file, tmp_path / file.name)
    started = _count_walks(monkeypatch)
    model = f"{Path(__file__).resolve().parent.parent / 'models.py'}:build_tiny"
    arguments = ["--bundle", str(tmp_path / golden.name), "--model", model, "--atol", "1e-6", "--rtol", "1e-6", "-q"]
    result = CliRunner().invoke(main, arguments)
    assert result.exit_code == 0, result.output
    walked = [Path(str(argv[3])).name for argv in started]  # type: ignore[index]
    assert walked == [f"{stem}.rank0.h5", f"{stem}.rank1.h5"]


# --------------------------------------------------------------------------- the file the walk checks


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc/self/fd")
def test_a_path_to_a_descriptor_of_this_process_is_refused(tiny_bundle: Path) -> None:
    """/proc/self/fd/N (or /dev/stdin) names a file only in this process: the child cannot walk it first, so it is
    refused rather than opened unchecked (the child's error would otherwise count as an ordinary one)."""
    with tiny_bundle.open("rb") as file:
        path = Path(f"/proc/self/fd/{file.fileno()}")
        with pytest.raises(BundleFormatError, match=r"finds no file at this path .*give the bundle's own file path"):
            preflight.preflight(path, seconds=30)


def test_a_file_replaced_before_the_child_walks_it_is_refused(
    tiny_bundle: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The child walks the file this process sees at the path, or refuses: one put in its place between the two
    looks (here, this process's view made to differ) is not vouched for."""
    monkeypatch.setattr(preflight, "_which_file", lambda path: "0:0")
    with pytest.raises(BundleFormatError, match=r"finds another file at this path \(it was replaced meanwhile"):
        preflight.preflight(tiny_bundle, seconds=30)


@pytest.mark.skipif(not Path("/dev/stdin").exists(), reason="needs /dev/stdin")
def test_replay_compare_refuses_a_bundle_given_as_its_standard_input(tiny_bundle: Path, tiny_ckpt: Path) -> None:
    """``replay-compare --bundle /dev/stdin < bundle.h5``: one line and exit 2, never the file opened unwalked."""
    model = f"{Path(__file__).resolve().parent.parent / 'models.py'}:build_tiny"
    program = "import sys\nfrom parity_harness.replay.cli.replay_compare import main\nmain(sys.argv[1:])"
    arguments = ["--bundle", "/dev/stdin", "--model", model, "--ckpt", str(tiny_ckpt), "--quiet"]
    with tiny_bundle.open("rb") as stdin:
        done = subprocess.run(
            [sys.executable, "-c", program, *arguments], stdin=stdin, capture_output=True, text=True, check=False
        )
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "/dev/stdin: the metadata walk's own process finds another file at this path" in lines[0]


def test_ckpt_diff_walks_two_bundles_side_by_side(
    tiny_bundle: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ckpt-diff A B of two bundles starts both walks at the start, side by side (each took 0.47 s, one after the
    other, before); opening each source waits for its own: two walks in all."""
    from click.testing import CliRunner

    from parity_harness.replay.cli.ckpt_diff import main

    events: list[str] = []
    started, waited = preflight.Preflight.__init__, preflight.Preflight.result
    monkeypatch.setattr(
        preflight.Preflight, "__init__", lambda self, *a, **k: events.append("start") or started(self, *a, **k)
    )
    monkeypatch.setattr(preflight.Preflight, "result", lambda self: events.append("wait") or waited(self))
    other = tmp_path / "other.h5"
    shutil.copy(tiny_bundle, other)
    result = CliRunner().invoke(main, [str(tiny_bundle), str(other)])
    assert result.exit_code == 0, result.output
    assert events == ["start", "start", "wait", "wait"]


def test_assert_parity_walks_a_bundle_in_a_child_once_per_file(
    tiny_bundle: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pytest fixture's assertion takes a bundle as the commands do: a crafted header that crashes HDF5 crashes
    the child, and the test fails with one line; an unchanged bundle asserted again is not walked again."""
    from parity_harness.replay.assertions import assert_parity
    from tests.models import build_tiny

    copy = tmp_path / "again.h5"
    shutil.copyfile(tiny_bundle, copy)
    starts: list[tuple[object, ...]] = []
    monkeypatch.setattr(preflight, "Preflight", lambda *a, **k: starts.append(a) or _Walk(*a, **k))
    assert_parity(build_tiny(), copy)
    assert_parity(build_tiny(), copy)
    assert len(starts) == 1
    crashing = tmp_path / "crashing.h5"
    shutil.copyfile(tiny_bundle, crashing)
    monkeypatch.setattr(preflight, "_WALK", "import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)")
    with pytest.raises(BundleFormatError, match=r"crashing\.h5: HDF5 crashed \(SIGSEGV\)"):
        assert_parity(build_tiny(), crashing)


def test_a_bundle_rewritten_in_place_while_hdf5_opens_it_is_closed_and_refused(
    tiny_bundle: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The file is checked against its walk once more after HDF5 opened it: one written to between the first check
    and HDF5's open (here, as HDF5 opens it) is closed and refused, before the reader reads its index."""
    path = tmp_path / "bundle.h5"
    shutil.copyfile(tiny_bundle, path)
    open_hdf5, opened = reader_module._open_hdf5, []

    def open_then_append(named: Path, target: str | None = None) -> h5py.File:
        file = open_hdf5(named, target)
        opened.append(file)
        with named.open("ab") as out:
            out.write(b"\0")
        return file

    monkeypatch.setattr(reader_module, "_open_hdf5", open_then_append)
    with pytest.raises(BundleChangedError, match=r"bundle\.h5: the bundle opened is not the one checked"):
        BundleReader(path, preflight=30)
    assert len(opened) == 1
    assert not opened[0].id.valid


def test_the_time_limit_grows_with_the_file_and_can_be_set(
    tiny_bundle: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A walk visits every object: a large legitimate bundle (a million small records, about a GiB) took longer
    than the fixed 60 s and was refused as damaged or crafted. The limit grows by a minute per GiB, and
    PARITY_PREFLIGHT_SECONDS sets the base for a very slow file system; the refusal says so."""
    large = tmp_path / "large.h5"
    with large.open("wb") as file:
        file.write(b"\1" * (8 << 20))
    assert preflight._allowed(large, 60) == pytest.approx(60 + 60 * 8 / 1024)
    with large.open("r+b") as file:
        file.truncate(10 << 40)  # a sparse tail of 10 TiB held nowhere: no more time (it gave the walk a week)
    assert preflight._allowed(large, 60) == pytest.approx(60 + 60 * 8 / 1024, abs=0.1)
    for wrong in ("soon", "0", "inf", "1e12", "nan"):
        monkeypatch.setenv("PARITY_PREFLIGHT_SECONDS", wrong)
        with pytest.raises(InputError, match="expected a number of seconds from 1 to 86400"):
            preflight._allowed(tiny_bundle, 60)
    monkeypatch.setenv("PARITY_PREFLIGHT_SECONDS", "600")
    assert preflight._allowed(tiny_bundle, 60) == pytest.approx(600, abs=0.01)
    monkeypatch.setenv("PARITY_PREFLIGHT_SECONDS", "1")
    monkeypatch.setattr(preflight, "_WALK", "import time\ntime.sleep(60)")
    with pytest.raises(BundleFormatError, match=r"within 1 s.*PARITY_PREFLIGHT_SECONDS=N allows N s"):
        preflight.preflight(tiny_bundle, seconds=60)
