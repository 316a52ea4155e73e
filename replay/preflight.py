"""Walk a bundle's HDF5 metadata in a child process before this process touches it.

HDF5 is not hardened against crafted files: a damaged object header can make it loop for minutes or crash the
process, inside C code that no Python timeout can interrupt. The child first checks that it has the file this
process sees at the path (same device and inode; a path naming one of this process's descriptors, such as
/dev/stdin, is refused), then that the file reads nothing outside its own bytes (``common.format.containment``: no
link or storage leaves it, so nothing can block on a FIFO), then walks every attribute, object and compact dataset
the reader would touch; if it refuses, hangs or crashes, the bundle is refused with one line, and this process
never opens it. A file HDF5 cannot open, a damaged one, and one that changed while it was walked are refused too,
each in its own words. Costs one interpreter start with h5py (a few tenths of a second); the command-line tools and
``assert_parity`` use it, replay-compare while it imports torch and loads the port (:func:`walking_early`,
:func:`start`). What the walk learnt comes back as a :class:`~parity_harness.common.format.containment.Catalog` of
the file the child's HDF5 opened, and the reader opens only that file, unchanged (:func:`open_walked`), without
walking it again (66 ms for the Conformer example's 571 datasets, about 240 ms for a FastConformer's 3540).
"""

from __future__ import annotations

import math
import os
import signal
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Final

from parity_harness.common.errors import BundleChangedError, BundleFormatError, InputError
from parity_harness.common.format.containment import Catalog, file_identity
from parity_harness.common.format.packing import MAX_INDEX_BYTES
from parity_harness.common.format.tensor_files import is_hdf5_file

if TYPE_CHECKING:  # the commands import this module before h5py, which only the walk's child needs here
    import h5py

__all__ = [
    "DEFAULT_PREFLIGHT_SECONDS",
    "Preflight",
    "open_walked",
    "preflight",
    "require_walked",
    "start",
    "walking_early",
    "walking_early_each",
]

DEFAULT_PREFLIGHT_SECONDS: Final = 60.0
_SECONDS_PER_GIB: Final = 60.0
"""Time added per GiB of file: a walk visits every object, and a bundle of a million small records (about 15,000
walked a second on a local disk) takes about a GiB; a large legitimate bundle must not be refused as crafted."""
_MOST: Final = 86400.0
"""No walk is given more than a day."""
_OVERRIDE: Final = "PARITY_PREFLIGHT_SECONDS"
"""An environment variable giving the base time limit instead (a very slow network file system)."""


def _allowed(path: Path, seconds: float) -> float:
    """The walk's time limit for ``path``: the base (``seconds``, or the environment's override, 1 s to a day), plus
    a minute per GiB the file holds on disk (its allocated blocks: a sparse tail adds nothing), at most a day."""
    override, base = os.environ.get(_OVERRIDE, ""), seconds
    if override:
        try:
            base = float(override)
        except ValueError:
            base = math.nan
        if not 1 <= base <= _MOST:  # NaN included
            raise InputError(f"{_OVERRIDE}={override!r}: expected a number of seconds from 1 to {_MOST:.0f}")
    try:
        stat = os.stat(path)
        held = min(stat.st_size, getattr(stat, "st_blocks", 0) * 512)
    except OSError:
        held = 0
    return min(base + _SECONDS_PER_GIB * held / 2**30, _MOST)


_REFUSED: Final = 3
"""The child's exit code when the file breaks the containment rule (its message on stderr)."""
_UNOPENED: Final = 4
"""The child's exit code when HDF5 cannot open the file at all (not HDF5, or damaged at its start)."""
_REPLACED: Final = 5
"""The child's exit code when the path names another file than the parent's (replaced meanwhile, or a descriptor)."""
_CHANGED: Final = 6
"""The child's exit code when the file changed or went while it was walked (its message on stderr)."""

_WALK: Final = r"""
import os
import signal
import sys

getattr(signal, "alarm", int)(int(sys.argv[2]))  # the kernel ends this process on time, even with its parent gone
import h5py

from parity_harness.common.errors import BundleFormatError
from parity_harness.common.format.containment import Catalog, check_contained, file_identity, read_other_metadata


def refuse(message, code=3):
    print(message.replace("\n", " "), file=sys.stderr)
    sys.exit(code)


def check_same(status):  # refuse unless it is the parent's file (device, inode); none to compare if it saw none
    if sys.argv[5] and (status is None or f"{status.st_dev}:{status.st_ino}" != sys.argv[5]):
        found = "no file" if status is None else "another file"
        refuse(
            f"{sys.argv[1]}: the metadata walk's own process finds {found} at this path (it was replaced meanwhile, "
            f"or it names a descriptor of this process, such as /dev/stdin, which no other process can check first); "
            f"give the {sys.argv[3]}'s own file path",
            5,
        )


try:
    initial = os.stat(sys.argv[1])  # before HDF5 opens what the path names (a FIFO would block it)
except OSError:
    initial = None
check_same(initial)


def changed(status):  # whether the file moved on since this process first looked (a write, or another file)
    return initial is None or file_identity(status) != file_identity(initial)


try:
    file = h5py.File(sys.argv[1], "r", locking=False)  # a training file may be being written
except FileNotFoundError as err:
    refuse(f"{sys.argv[1]}: removed before its metadata could be checked ({err})", 6)
except OSError as err:
    try:
        moved = changed(os.stat(sys.argv[1]))
    except OSError:
        moved = True
    if moved:
        refuse(f"{sys.argv[1]}: changed while its metadata was checked ({type(err).__name__}: {err})", 6)
    refuse(f"{type(err).__name__}: {err}", 4)
with file:
    check_same(os.fstat(file.id.get_vfd_handle()))  # the file HDF5 opened: the path may name another by now
    label = sys.argv[4] or None
    try:
        stored = check_contained(file, sys.argv[1], sys.argv[3], label)  # links and storage first: nothing outside
        read_other_metadata(file, stored, label)
    except BundleFormatError as err:
        refuse(str(err))
    except Exception as err:  # HDF5 failed on the metadata: damage, or a file written meanwhile
        if changed(os.fstat(file.id.get_vfd_handle())):
            refuse(f"{sys.argv[1]}: changed while its metadata was checked ({type(err).__name__}: {err})", 6)
        refuse(f"{type(err).__name__}: {err}", 1)
    after = os.fstat(file.id.get_vfd_handle())
if changed(after):  # HDF5 may have read some of it before a write and the rest after
    refuse(f"{sys.argv[1]}: changed while its metadata was checked", 6)
catalog = Catalog(file_identity(initial), stored)
raw = catalog.to_bytes()
if raw is None:  # a dtype with no plain form: no bundle or training file holds one
    odd = next(name for name in stored if Catalog(catalog.identity, {name: stored[name]}).to_bytes() is None)
    refuse(
        f"{sys.argv[1]}:/{odd}: a dataset of type {stored[odd].dtype}, which no parity-harness bundle or training "
        f"file holds; pass a file capture-run or TrainingRecorder wrote"
    )
sys.stdout.buffer.write(raw)
sys.stdout.flush()
"""


def _which_file(path: Path) -> str:
    """The file ``path`` names in this process (device and inode), for the child to check it walks that one; empty
    where there is none (the child then fails as the reader will)."""
    try:
        status = os.stat(path)
    except (OSError, ValueError):
        return ""
    return f"{status.st_dev}:{status.st_ino}"


class Preflight:
    """A metadata walk started in a child process (:func:`start`); :meth:`result` waits for its verdict.

    Started early, the walk runs while the parent does other work (loads the port): the command pays for it
    only where it takes longer than that work.
    """

    def __init__(self, path: Path, seconds: float, noun: str, label: str | None = None) -> None:
        seconds = _allowed(path, seconds)
        self.path, self.seconds, self.noun = path, seconds, noun
        self._deadline = time.monotonic() + seconds
        # A file, not a pipe: nobody reads while the parent works, and a child blocked on a full pipe would look hung.
        self._stderr = tempfile.TemporaryFile()  # noqa: SIM115 (closed by result() or cancel())
        self._catalog = tempfile.TemporaryFile()  # noqa: SIM115 (the same)
        arguments = [str(path), str(max(1, math.ceil(seconds)) + 1), noun, label or "", _which_file(path)]
        self._child = subprocess.Popen(
            [sys.executable, "-c", _WALK, *arguments],
            stdin=subprocess.DEVNULL,
            stdout=self._catalog,
            stderr=self._stderr,
        )

    def result(self) -> Catalog:
        """Wait for the walk; what it learnt of the file, which a reader then holds the file it opens to
        (:func:`require_walked`). Refuse the file (``BundleFormatError``) where it broke the rule, hung or crashed
        HDF5, could not be read, or changed while it was walked (``BundleChangedError``)."""
        try:
            code = self._wait()
            self._judge(code)
            size = self._catalog.seek(0, os.SEEK_END)
            self._catalog.seek(0)
            catalog = Catalog.from_bytes(self._catalog.read()) if 0 < size <= MAX_INDEX_BYTES else None
            if catalog is None:  # the child ended well, yet what it wrote cannot be read back
                raise BundleFormatError(
                    f"{self.path}: the separate process that checks its metadata could not hand back what it found "
                    f"({size} bytes; is the temporary folder {tempfile.gettempdir()} full?)"
                )
            return catalog
        finally:
            self._close()

    def _close(self) -> None:
        self._stderr.close()
        self._catalog.close()

    def _wait(self) -> int:
        try:
            # A child that ended while the parent was busy is done, however long ago the deadline passed.
            code = self._child.poll()
            return code if code is not None else self._child.wait(timeout=max(0.0, self._deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.cancel()
            raise self._too_long() from None
        except BaseException:  # Ctrl-C while waiting: the child goes too
            self.cancel()
            raise

    def _judge(self, code: int) -> None:
        if code == -getattr(signal, "SIGALRM", 14):
            raise self._too_long()
        if code in (_REFUSED, _REPLACED):
            lines = self._stderr_tail().splitlines()
            refused = BundleFormatError if code == _REFUSED else BundleChangedError
            raise refused(lines[-1] if lines else f"{self.path}: refused by the metadata walk")
        if code == _CHANGED:
            detail = self._stderr_tail().splitlines()[-1:] or ["it changed"]
            raise BundleChangedError(
                f"{detail[0][:300]}: the {self.noun} is not read; run again once nothing is writing or replacing it"
            )
        if code < 0:
            name = signal.Signals(-code).name
            raise BundleFormatError(
                f"{self.path}: HDF5 crashed ({name}) reading its metadata; the file is damaged or crafted"
            )
        if code == _UNOPENED:  # HDF5 refused the file at its first bytes: the reader's own words
            detail = self._stderr_tail().splitlines()[-1:] or ["no reason given"]
            if is_hdf5_file(self.path):
                raise BundleFormatError(f"{self.path}: HDF5 cannot open this {self.noun} ({detail[0][:200]})")
            raise BundleFormatError(f"{self.path}: not an HDF5 file, so not a {self.noun} ({detail[0][:200]})")
        if code != 0:
            detail = self._stderr_tail().splitlines()[-1:] or [f"exit code {code}"]
            raise BundleFormatError(
                f"{self.path}: the {self.noun} is damaged: reading its metadata failed ({detail[0][:200]}); copy or "
                "capture it again"
            )

    def cancel(self) -> None:
        """End the child if it still runs (the command failed or was interrupted meanwhile)."""
        if self._child.poll() is None:
            self._child.kill()
            self._child.wait()
        self._close()

    def _stderr_tail(self) -> str:
        """The end of what the child wrote on stderr (its refusal is the last line)."""
        size = self._stderr.seek(0, os.SEEK_END)
        self._stderr.seek(max(0, size - (1 << 16)))
        return self._stderr.read().decode(errors="replace").strip()

    def _too_long(self) -> BundleFormatError:
        return BundleFormatError(
            f"{self.path}: reading its HDF5 metadata did not finish within {self.seconds:.0f} s; the file is "
            f"damaged or crafted, and is not opened (on a very slow file system, {_OVERRIDE}=N allows N s)"
        )


def start(
    path: Path, *, seconds: float = DEFAULT_PREFLIGHT_SECONDS, noun: str = "bundle", label: str | None = None
) -> Preflight:
    """Start walking ``path``'s metadata in a child process; call ``result()`` before opening it. ``label``: a
    string attribute every dataset carries (a bundle's ``dtype``), read by the containment walk itself. A walk of
    the same file, unchanged, with the same arguments, started early (:func:`walking_early`), is adopted instead."""
    return _adopt_early(path, seconds, noun, label) or Preflight(path, seconds, noun, label)


_EarlyKey = tuple[str, float, str, "str | None"]
_EARLY: dict[_EarlyKey, tuple[tuple[int, ...], Preflight]] = {}
"""Walks started by :func:`walking_early` that no :func:`start` has adopted yet, by file and arguments."""


@contextmanager
def walking_early(
    path: Path | None, *, seconds: float = DEFAULT_PREFLIGHT_SECONDS, noun: str = "bundle", label: str | None = None
) -> Iterator[None]:
    """Start walking ``path`` now, before the command imports torch and loads the port (a second, idle core then
    hides the child's start, most of the walk's cost on a small port); a :func:`start` of the same file, unchanged,
    inside the block adopts this walk. None, or a path that is no regular file, starts nothing (the command's own
    checks report it). As the block exits the walk is ended if it still runs (nobody adopted it, or the block was
    interrupted)."""
    try:
        status = None if path is None else os.stat(path)
    except (OSError, ValueError):
        status = None
    if path is None or status is None or not stat.S_ISREG(status.st_mode):
        yield
        return
    key = (os.path.realpath(path), seconds, noun, label)
    walk = Preflight(path, seconds, noun, label)
    _EARLY[key] = (file_identity(status), walk)
    try:
        yield
    finally:
        if _EARLY.get(key, (None, None))[1] is walk:
            del _EARLY[key]
        walk.cancel()  # a walk already waited for is left as it is


@contextmanager
def walking_early_each(
    paths: Iterable[str | os.PathLike[str]],
    *,
    seconds: float = DEFAULT_PREFLIGHT_SECONDS,
    noun: str = "bundle",
    label: str | None = None,
) -> Iterator[None]:
    """:func:`walking_early` for each of ``paths`` (the command's HDF5 inputs), once per file, all at once."""
    with ExitStack() as walks:
        seen: set[str] = set()
        for path in paths:
            real = os.path.realpath(path)
            if real not in seen:
                walks.enter_context(walking_early(Path(path), seconds=seconds, noun=noun, label=label))
            seen.add(real)
        yield


def _adopt_early(path: Path, seconds: float, noun: str, label: str | None) -> Preflight | None:
    """The early walk of this file with these arguments, if its file has not changed since it started."""
    try:
        key = (os.path.realpath(path), seconds, noun, label)
        identity = file_identity(os.stat(path))
    except (OSError, ValueError):
        return None
    early = _EARLY.pop(key, None)
    if early is None:
        return None
    if early[0] != identity:  # the file changed since: that walk vouches for nothing now
        early[1].cancel()
        return None
    return early[1]


def require_walked(catalog: Catalog, descriptor: int, path: Path, noun: str, *, growing: bool = False) -> Catalog:
    """``catalog``, when it describes the file open as ``descriptor`` unchanged; else refuse the file.

    A walk in a child vouches only for the file it walked: one replaced or rewritten since (another process racing
    the command) is not read in this process, which is what the child was there to spare it. ``growing``: a file
    being written (a live training file) may have grown since, but must be the same file.
    """
    status = os.fstat(descriptor)
    if catalog.describes(status):
        return catalog
    device, inode, size = catalog.identity[:3]
    if growing and (status.st_dev, status.st_ino) == (device, inode) and status.st_size >= size:
        return catalog
    raise BundleChangedError(
        f"{path}: the {noun} opened is not the one checked: it changed or was replaced after a separate process "
        f"checked its metadata ({size} bytes then, {status.st_size} now), so it is not read; run again once nothing "
        "is writing or replacing it"
    )


def open_walked(
    path: Path, catalog: Catalog, noun: str, opener: Callable[[str], h5py.File], *, growing: bool = False
) -> h5py.File:
    """``opener`` (an HDF5 open) applied to the very file ``catalog`` describes, checked before HDF5 reads a byte of
    it (where ``/proc/self/fd`` (Linux) or ``/dev/fd`` exists, HDF5 is handed that file itself, leaving no path
    lookup to race) and again once HDF5 has it open: a file rewritten in place meanwhile is closed and refused."""
    try:
        # Non-blocking: a FIFO put at the path since must not wait for a writer (it is then refused as not the file).
        descriptor = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as err:
        raise BundleChangedError(
            f"{path}: the {noun} checked is gone ({err.strerror}); run again once nothing is writing or replacing it"
        ) from err
    try:
        require_walked(catalog, descriptor, path, noun, growing=growing)
        own = next((f"{d}/{descriptor}" for d in ("/proc/self/fd", "/dev/fd") if os.path.isdir(d)), str(path))
        file = opener(own)
    finally:
        os.close(descriptor)
    try:
        require_walked(catalog, file.id.get_vfd_handle(), path, noun, growing=growing)
    except BaseException:
        file.close()
        raise
    return file


def preflight(
    path: Path, *, seconds: float = DEFAULT_PREFLIGHT_SECONDS, noun: str = "bundle", label: str | None = None
) -> Catalog:
    """Refuse ``path`` (a ``noun``) if it breaks the containment rule, or walking its HDF5 metadata hangs or
    crashes a child process; what the walk learnt otherwise (:meth:`Preflight.result`)."""
    return start(path, seconds=seconds, noun=noun, label=label).result()
