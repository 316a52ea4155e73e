"""Open and validate a bundle, then hand out its tensors lazily.

Order of checks on open: the file is a regular file and HDF5, the root names the format and a version this
reader knows (before anything else is read), every object lies in the file's own bytes
(``common.format.containment``: nothing read from elsewhere, nothing larger than the file), the index decodes
and validates, and every tensor the
index names exists with exactly the declared dtype and shape (unless it was recorded as
statistics only), with no unreferenced tensor left over. Only then is any tensor data read, one record at a time.

Tensors stored contiguously and unfiltered (everything capture writes) are read without a copy,
as read-only views of the file mapped into memory, at the offsets the containment walk found (no HDF5 call
per record); the mapped pages are dropped from this process once the records read add up to the largest
record, so reading a bundle of any size keeps at most about twice the largest record resident.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import keyword
import mmap
import os
import re
import stat
import threading
import weakref
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar

import h5py
import numpy as np

from parity_harness.common.errors import BundleFormatError, BundleNotFoundError, InputError
from parity_harness.common.format.bundle.layout import (
    ATTR_DTYPE,
    ATTR_FORMAT,
    ATTR_MINOR,
    ATTR_VERSION,
    INDEX,
    PROVENANCE,
    RNG,
)
from parity_harness.common.format.bundle.migrations import migrate
from parity_harness.common.format.bundle.schema import BundleIndex, ModuleCall, TensorRef, Tree, parse_index
from parity_harness.common.format.bundle.version import FORMAT_VERSION, check_compatible, parse_format_version
from parity_harness.common.format.containment import (
    Catalog,
    StoredDataset,
    check_contained,
    file_identity,
    require_regular_file,
)
from parity_harness.common.format.damage import damage_guard
from parity_harness.common.format.dtypes import from_storage, storage_dtype, to_float64
from parity_harness.common.format.manifest import find_manifest
from parity_harness.common.format.packing import unpack
from parity_harness.common.format.preview import clipped, shown
from parity_harness.common.heap import HeapTrimmer
from parity_harness.common.numerics.parallel import on_second_thread
from parity_harness.common.numerics.statistics import stored_crc32
from parity_harness.replay.preflight import DEFAULT_PREFLIGHT_SECONDS, open_walked
from parity_harness.replay.preflight import preflight as walk_in_child

if TYPE_CHECKING:  # reading metadata needs no torch (replay-compare --list): tensors are made in common.format.dtypes
    import torch

__all__ = ["BundleReader", "open_bundle_for_listing", "rebuild", "refuse_unusable_path"]

_Derived = TypeVar("_Derived")

_FAULT_AROUND = 1 << 21
"""Alignment of the span whose pages are dropped: a read fault also maps the cached pages around it, within an
aligned block (64 KiB by default) that never crosses a page table's 2 MiB reach, as a large folio mapped whole
does not either."""

VERIFY_LATER_FROM = 1 << 20
"""Bytes from which :meth:`BundleReader.verify` may run a checksum on the second thread: below, handing it over
costs more than computing it."""


def refuse_unusable_path(path: Path) -> None:
    """Refuse, without opening it, a path that names no bundle file: nothing, a folder, a FIFO or a device."""
    if not path.exists():
        raise BundleNotFoundError(f"{path}: no such bundle; check the path or run capture-run first")
    if path.is_dir():
        raise BundleFormatError(f"{path}: is a folder, expected a bundle file written by capture-run")
    require_regular_file(path, "bundle")


def _open_hdf5(path: Path, target: str | None = None) -> h5py.File:
    """HDF5's open of the bundle ``path`` (through ``target``: the same file, named as :func:`open_walked` gives
    it)."""
    try:
        return h5py.File(target or path, "r")
    except OSError as err:
        raise BundleFormatError(f"{path}: not an HDF5 file, so not a bundle ({err})") from err


class BundleReader:
    """A validated, read-only bundle.

    Args:
        path: the ``.h5`` bundle.
        verify: check each tensor's CRC-32 against the index the first time it is read (bundles
            written since format 1.2 carry them; the RNG state's too, at open, where recorded); a mismatch
            names the record, and a bundle without checksums is refused as unverified.
        preflight: first walk the file's HDF5 metadata in a child process for at most this many
            seconds, so that a crafted file that hangs or crashes HDF5 is refused instead
            (:mod:`parity_harness.replay.preflight`); None skips it (files this process or the user wrote).
        catalog: what such a walk, already made, learnt of the file: used instead of walking it again when it
            describes the file opened, unchanged (its device, inode, size, and times of change).

    Raises:
        BundleNotFoundError: nothing at ``path``.
        UnsupportedBundleVersion: written by a newer major format version.
        BundleFormatError: not a bundle, or a part of it is missing or damaged.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        verify: bool = True,
        preflight: float | None = None,
        catalog: Catalog | None = None,
    ) -> None:
        self.path = Path(path)
        self._verify = verify
        self._verified: dict[object, int] = {}
        """The checksum each dataset (by :meth:`dataset_identity`, else by name) was verified against."""
        self._pending: list[tuple[str, int, Future[int]]] = []
        self.differences_seen = False
        """A record read through this reader differed from the port's value (set by the comparison): later
        records' checksums then start before their comparison, not after."""
        self._file, catalog = self._open(preflight, catalog)
        try:
            with self._damage_guard("/"):
                self.format_version, self.format_minor = self._check_version()
                # A file from elsewhere as the child's walk found it: never walked in this process.
                self._stored = self._contained() if catalog is None else catalog.datasets
                self.index = self._checked_index()
        except BaseException:
            self._file.close()
            raise
        self._calls = {(call.module, call.call): position for position, call in enumerate(self.index.calls)}
        self._map, self._read_fd = _map_file(self._file)
        self._mapped_from, self._mapped_as = _mapped_state(self._file) if self._map is not None else (None, None)
        # A reader dropped unclosed gives its descriptor back when it goes, as its memory map would.
        self._closes_fd = None if self._read_fd is None else weakref.finalize(self, os.close, self._read_fd)
        self._resident_bytes = 0
        self._resident_span = (len(self._map) if self._map is not None else 0, 0)
        """The first and last byte of the file read since pages were last dropped."""
        facts = _walked.derived(self._stored, "facts", lambda: _WalkFacts.of(self._stored))
        self._largest, self._names_per_dataset = facts.largest, facts.names_per_dataset
        # Pages of records read are dropped once they add up to the largest record, and no fewer than two of the
        # blocks a drop is widened to: peak memory stays within twice the largest record plus those blocks, and
        # small records cost no system call each. Dropping every 1 MB (a Conformer's largest record) also dropped
        # the rest of each block, which the next records faulted in again: 175 drops a replay, 5% of its time.
        self._resident_budget = max(self._largest, 2 * _FAULT_AROUND)
        # What replay frees between the model's allocations would otherwise stay resident (common.heap).
        self._heap = HeapTrimmer.for_reading()

    def _open(self, preflight: float | None, catalog: Catalog | None) -> tuple[h5py.File, Catalog | None]:
        """HDF5's open of the bundle, and the walk that vouches for it: a file from elsewhere (``preflight`` asked
        for, or a ``catalog`` given) is opened only as a walk in a child described it."""
        refuse_unusable_path(self.path)
        if preflight is not None:
            catalog = _walked.get(_identity_now(self.path))  # this file, unchanged, walked before
            if catalog is None:
                catalog = walk_in_child(self.path, seconds=preflight, label=ATTR_DTYPE)
                _walked.put(catalog)
        if catalog is None:
            return _open_hdf5(self.path), None
        return open_walked(self.path, catalog, "bundle", lambda target: _open_hdf5(self.path, target)), catalog

    def _contained(self) -> dict[str, StoredDataset]:
        """Every dataset, from this process's last walk of the file where it describes the file HDF5 opened, else
        from a walk of the file."""
        descriptor = _descriptor(self._file)
        if descriptor is None:
            return check_contained(self._file, self.path, "bundle", label=ATTR_DTYPE)
        status = os.fstat(descriptor)
        known = _walked.get(file_identity(status))
        if known is not None and known.describes(status):
            return known.datasets
        datasets = check_contained(self._file, self.path, "bundle", label=ATTR_DTYPE)
        if file_identity(os.fstat(descriptor)) == file_identity(status):  # not changed while it was walked
            _walked.put(Catalog(file_identity(status), datasets))
        return datasets

    def _check_version(self) -> tuple[int, int]:
        attrs = self._file.attrs
        where = str(self.path)
        name = attrs.get(ATTR_FORMAT)
        name = name.decode() if isinstance(name, bytes) else name
        if ATTR_VERSION not in attrs:
            check_compatible(name, FORMAT_VERSION, 0, where=where)  # refuses files that are not bundles
            raise BundleFormatError(f"{where}: root attribute {ATTR_VERSION!r} is missing; the bundle is damaged")
        major = parse_format_version(attrs.get(ATTR_VERSION), where=where)
        minor = parse_format_version(attrs.get(ATTR_MINOR, 0), where=where)
        check_compatible(name, major, minor, where=where)
        return major, minor

    def _checked_index(self) -> BundleIndex:
        """The index, decoded and checked against the datasets found; what of that depends only on the index's bytes
        and the walk is done as this process last did it, where it did (:class:`_RecentIndexes`). The RNG state's
        checksum is read from the file at every opening."""
        raw, version = self._index_bytes(), (self.format_version, self.format_minor)
        decoded = _decoded.find(raw, version)
        if decoded is None:
            decoded = _decoded.add(raw, version, self._parse_index(raw))
        self.index, self._derived = decoded.index, decoded.derived
        checked = decoded.checked_against(self._stored, self._verify)
        if not checked:
            self._require_checksums(decoded.tensor_paths)
            self._check_datasets()
        self._verify_auxiliary(decoded.tensor_paths)
        if not checked:
            self._refuse_orphans(decoded.tensor_paths)
            decoded.note_checked(self._stored, self._verify)
        return decoded.index

    def _index_bytes(self) -> bytes:
        node = self._file.get(INDEX)
        if not isinstance(node, h5py.Dataset) or node.dtype != np.uint8 or node.ndim != 1:
            raise BundleFormatError(
                f"{self.path}: the index ({INDEX}) is missing or malformed, so the capture did not finish; "
                "capture again"
            )
        return bytes(node[()].tobytes())  # h5py reads as Any

    def _parse_index(self, raw: bytes) -> BundleIndex:
        document = unpack(raw, where=f"{self.path}:{INDEX}")
        try:
            return parse_index(migrate(document, self.format_version))
        except BundleFormatError as err:
            raise BundleFormatError(f"{self.path}: {err}") from err

    def _check_datasets(self) -> None:
        """Every tensor the index names (but those kept as statistics) is a dataset of its dtype and shape, with a
        checksum where the index has any."""
        sums, summaries = self.index.checksums, self.index.summaries
        for ref in self.index.tensor_refs():
            if ref.path not in summaries:
                self._check_dataset(ref)
                if sums and ref.path not in sums:
                    raise BundleFormatError(f"{self.path}:{ref.path}: the index has no checksum for this tensor")

    def _refuse_orphans(self, tensors: frozenset[str]) -> None:
        """No dataset the index does not name (but its own and the RNG state's)."""
        referenced = {path.lstrip("/") for path in tensors if path not in self.index.summaries}
        orphans = [name for name in self._stored if name not in referenced and not _is_auxiliary(name)]
        if orphans:
            raise BundleFormatError(
                f"{self.path}: {len(orphans)} dataset(s) not named by the index, e.g. /{orphans[0]}; "
                "the bundle was altered after capture"
            )

    def _require_checksums(self, tensors: frozenset[str]) -> None:
        """A bundle holding tensors but no checksums cannot be verified: refused unless verification is off."""
        stored = any(path not in self.index.summaries for path in tensors)
        if self._verify and stored and not self.index.checksums:
            raise BundleFormatError(
                f"{self.path}: unverified: the bundle has no checksums (captured with --no-checksums, or they were "
                "removed), so altered or damaged bytes would go unnoticed; pass --no-verify to read it anyway, or "
                "capture it again with checksums"
            )

    def _verify_auxiliary(self, tensors: frozenset[str]) -> None:
        """The RNG state's checksum (format 1.4 on, where every RNG dataset has one; a few kilobytes, checked at
        once), and no checksum naming nothing."""
        sums = self.index.checksums
        if sums and (self.format_version, self.format_minor) >= (1, 4):
            stored = [
                f"{RNG}/{name}" for name, node in (self._file.get(RNG) or {}).items() if isinstance(node, h5py.Dataset)
            ]
            unsummed = [name for name in stored if name not in sums]
            if unsummed:
                raise BundleFormatError(f"{self.path}:{unsummed[0]}: no checksum in the index; the bundle was altered")
            stray = [name for name in sums if name not in tensors and name not in stored]
            if stray:
                named = shown(stray[0])
                raise BundleFormatError(f"{self.path}: the index has a checksum for {named}, which is no dataset")
        for name in (path for path in sums if path.startswith(RNG + "/")):
            node = self._file.get(name)
            if not isinstance(node, h5py.Dataset):
                raise BundleFormatError(f"{self.path}:{name}: has a checksum in the index but is missing")
            array = np.asarray(node[()])
            if self._verify and stored_crc32(array) != sums[name]:
                raise BundleFormatError(
                    f"{self.path}:{name}: checksum mismatch: the stored RNG state changed after capture; copy the "
                    "bundle again (or pass --no-verify to read it anyway)"
                )

    @property
    def verified(self) -> bool:
        """Whether tensors are checked against recorded checksums as they are read."""
        return self._verify and bool(self.index.checksums)

    def _check_dataset(self, ref: TensorRef) -> None:
        node = self._stored.get(ref.path.lstrip("/"))
        if (
            node is not None
            and node.label == ref.tag
            and node.dtype == storage_dtype(ref.tag)
            and tuple(node.shape) == ref.shape
        ):
            return
        where = f"{self.path}:{clipped(ref.path)}"
        if node is None:
            raise BundleFormatError(f"{where}: tensor named by the index is missing; the bundle is incomplete")
        tag = node.label
        if tag != ref.tag:
            raise BundleFormatError(f"{where}: dtype tag {shown(tag)} != {ref.tag!r} declared in the index")
        if node.dtype != storage_dtype(ref.tag):
            raise BundleFormatError(f"{where}: stored as {node.dtype}, expected {storage_dtype(ref.tag)} for {ref.tag}")
        if tuple(node.shape) != ref.shape:
            raise BundleFormatError(f"{where}: shape {tuple(node.shape)} != {ref.shape} declared in the index")

    # ------------------------------------------------------------- access

    def _damage_guard(self, where: str) -> contextlib.AbstractContextManager[None]:
        """Whatever h5py raises on a damaged file, as one BundleFormatError naming the file."""
        return damage_guard(self.path, where)

    def provenance(self) -> dict[str, str]:
        """The capturing environment's provenance strings (read once per kept walk of the file: 0.8 ms of HDF5's
        attributes an opening)."""
        if not self._file.id.valid:  # HDF5 would read nothing, and that nothing would be kept for the next opening
            raise InputError(f"{self.path}: the reader is closed; read the provenance while it is open")
        return dict(_walked.derived(self._stored, "provenance", self._read_provenance))

    def _read_provenance(self) -> dict[str, str]:
        with self._damage_guard(PROVENANCE):
            group = self._file.get(PROVENANCE)
            if not isinstance(group, h5py.Group):
                return {}
            return {key[:_PROVENANCE_CHARACTERS]: _provenance_text(value) for key, value in group.attrs.items()}

    def summary(self, ref: TensorRef) -> dict[str, float | int] | None:
        """The statistics of a tensor recorded as statistics only, else None (its values are stored)."""
        return self.index.summaries.get(ref.path)

    def dataset_identity(self, ref: TensorRef) -> tuple[object, ...] | None:
        """Which bytes of the file hold a record's values: records with equal identities hold the same values (a
        repeat stored as a link at capture). None for a record kept as statistics, or stored in no bytes of its own
        (compact or empty)."""
        stored = self._stored.get(ref.path.lstrip("/"))
        return None if stored is None or ref.path in self.index.summaries else _identity(stored)

    def repeated_identity(self, ref: TensorRef) -> tuple[object, ...] | None:
        """:meth:`dataset_identity` of a record whose bytes another record names too (a repeat linked at capture),
        else None."""
        identity = self.dataset_identity(ref)
        return identity if identity is not None and self._names_per_dataset[identity] > 1 else None

    @property
    def largest_record_bytes(self) -> int:
        """The size of the largest dataset's values."""
        return self._largest

    def read_array(self, ref: TensorRef, *, verify: bool = True) -> np.ndarray:
        """The stored array of a tensor (raw bits for bf16/fp8); may be a read-only view of the file.

        With ``verify`` (and the reader's verification on), its CRC-32 is checked first; callers
        that check later pass False and call :meth:`verify` themselves.
        """
        if ref.path in self.index.summaries:
            raise BundleFormatError(
                f"{self.path}:{ref.path}: recorded as statistics only (capture-run --summary-only or "
                "--max-tensor-bytes), so its values cannot be read"
            )
        stored = self._stored.get(ref.path.lstrip("/"))  # every tensor the index names was found at open
        if stored is None:
            raise BundleFormatError(f"{self.path}:{clipped(ref.path)}: no such dataset in the bundle")
        offset, nbytes = stored.offset, stored.nbytes
        if offset is None or nbytes == 0 or (self._map is None and self._read_fd is None):  # compact, empty
            with self._damage_guard(ref.path):  # read through HDF5; the bytes below are read without it
                array = np.asarray(self._file[ref.path][()])
            return self.verify(ref, array) if verify else array
        if self._map is None:
            array = self._read_bytes(ref, stored)
            self._heap.note(nbytes)
            return self.verify(ref, array) if verify else array
        if offset + nbytes > len(self._map):
            raise BundleFormatError(
                f"{self.path}:{ref.path}: data at bytes {offset}..{offset + nbytes} lies past the end of the "
                f"file ({len(self._map)} bytes); the bundle is truncated"
            )
        self._check_unchanged(ref)
        self._keep_resident(offset, nbytes)
        view = np.frombuffer(self._map, dtype=stored.dtype, count=nbytes // stored.dtype.itemsize, offset=offset)
        array = view.reshape(stored.shape)
        return self.verify(ref, array) if verify else array

    def _check_unchanged(self, ref: TensorRef) -> None:
        """Refuse a mapped file that was truncated or written since it was mapped (``cp`` over a bundle rewrites it in
        place) before a page of it is read: a mapped page past a new end kills the process (SIGBUS). A change landing
        while mapped pages are in use (a record compared, checksummed on the second thread, or read again) can still
        do so; reading every record into memory would close that too, at the cost of a second pass over every byte (a
        prototype with reused buffers: GPT-2's exact replay 1.3-1.4x -> 1.8-1.9x the bare step). One ``fstat``: under
        1 us."""
        if self._mapped_from is None:  # its state could not be read when mapped
            return
        if _written_state(self._mapped_from) != self._mapped_as:
            raise BundleFormatError(
                f"{self.path}:{clipped(ref.path)}: the bundle changed while it was read (truncated or written over: "
                "copied onto while replayed?); replay it once it is complete"
            )

    def _read_bytes(self, ref: TensorRef, stored: StoredDataset) -> np.ndarray:
        """A record's bytes read into memory of its own (a file others may change, :func:`_map_file`): one that
        shrank meanwhile is a short read, refused, where its mapped pages would have killed the process."""
        fd, offset = self._read_fd, stored.offset
        assert fd is not None  # what _read_array reads with when nothing is mapped
        assert offset is not None
        buffer = np.empty(stored.nbytes, dtype=np.uint8)
        done = 0
        while done < stored.nbytes:  # a single read returns at most about 2 GiB
            try:
                got = os.preadv(fd, [buffer[done:].data], offset + done)
            except OSError as err:
                raise BundleFormatError(f"{self.path}:{clipped(ref.path)}: reading its data failed: {err}") from err
            if got <= 0:
                raise BundleFormatError(
                    f"{self.path}:{clipped(ref.path)}: data at bytes {offset}..{offset + stored.nbytes} ends after "
                    f"{done} bytes: the bundle was truncated (changed while it was read?)"
                )
            done += got
        array = buffer.view(stored.dtype).reshape(stored.shape)
        array.flags.writeable = False  # as a mapped record: read-only
        return array

    def verify(self, ref: TensorRef, array: np.ndarray, *, later: bool = False) -> np.ndarray:
        """``array`` (read for ``ref``) after its CRC-32 matched the one recorded at capture (once per dataset).

        ``later``: a large array's CRC-32 runs on the second thread while the caller goes on (the comparison is
        single-threaded, so the checksum costs no wall time); :meth:`settle` waits for it and raises then.
        """
        expected = self.index.checksums.get(ref.path)
        # A repeat linked at capture is the same bytes under a second name: checked once, if its checksum agrees.
        where = self.dataset_identity(ref) or ref.path
        if not self._verify or expected is None or self._verified.get(where) == expected:
            return array
        self._verified[where] = expected
        if later and array.nbytes >= VERIFY_LATER_FROM:
            self._pending.append((ref.path, expected, on_second_thread(stored_crc32, array)))
        else:
            self._check_crc(ref.path, expected, stored_crc32(array))
        return array

    def trims_paused(self) -> contextlib.AbstractContextManager[None]:
        """No heap trims while records are read within the block (``common.heap.HeapTrimmer.paused``): for the
        port's backward, during which its memory only shrinks."""
        return self._heap.paused()

    def settle(self) -> None:
        """Wait for the checksums :meth:`verify` started with ``later``; raise for the first that did not match."""
        pending, self._pending = self._pending, []
        computed = [(path, expected, future.result()) for path, expected, future in pending]
        for path, expected, actual in computed:
            self._check_crc(path, expected, actual)

    def _check_crc(self, path: str, expected: int, actual: int) -> None:
        if actual != expected:
            raise BundleFormatError(
                f"{self.path}:{path}: checksum mismatch (CRC-32 {actual:08x}, recorded {expected:08x}): the "
                "stored bytes changed after capture; copy the bundle again (or pass --no-verify to read it anyway)"
            )

    def _keep_resident(self, offset: int, nbytes: int) -> None:
        """Note a record about to be read; first drop the pages of those read before from this process (they
        stay in the OS page cache) when they and it would exceed the largest record. Every so many bytes read,
        the C heap's free memory goes back to the OS too."""
        if self._resident_bytes + nbytes > self._resident_budget:
            self._release_resident()
        self._resident_bytes += nbytes
        low, high = self._resident_span
        self._resident_span = (min(low, offset), max(high, offset + nbytes))
        self._heap.note(nbytes)

    def _release_resident(self) -> None:
        self.settle()  # checksums still reading the pages would fault them back in
        low, high = self._resident_span
        if self._map is not None and high > low and hasattr(mmap, "MADV_DONTNEED"):
            # The span of the records read, widened to the blocks the kernel maps around each fault (fault-around),
            # so that those pages do not pile up record after record. Not the whole mapping: dropping a span costs
            # in proportion to its length, mapped or not (35 us for a 90 MB bundle, a small model's thousand records
            # drop pages a hundred times).
            low = low // _FAULT_AROUND * _FAULT_AROUND
            high = min(len(self._map), -(-high // _FAULT_AROUND) * _FAULT_AROUND)
            self._map.madvise(mmap.MADV_DONTNEED, low, high - low)
        self._resident_bytes = 0
        self._resident_span = (len(self._map) if self._map is not None else 0, 0)

    def read_tensor(self, ref: TensorRef) -> torch.Tensor:
        """A tensor exactly as captured (dtype and bits), on the CPU."""
        return from_storage(self.read_array(ref), ref.tag)

    def read_float64(self, ref: TensorRef) -> np.ndarray:
        """The tensor's values as float64 (complex128 for complex dtypes)."""
        return to_float64(self.read_array(ref), ref.tag)

    def derived(self, build: Callable[[BundleIndex], _Derived]) -> _Derived:
        """``build(self.index)``, built once per decoded index: an opening of the same index bytes again (a test suite
        replaying one bundle) takes it as built. ``build`` reads the index alone, and what it returns, shared so, is
        never changed (checked after every test, in ``tests/conftest.py``)."""
        found = self._derived.get(build)
        if found is None:
            found = self._derived[build] = build(self.index)
        return found

    def find_call(self, module: str, call: int) -> tuple[int, ModuleCall] | None:
        """The position and record of a module call, or None when the bundle has no such call."""
        position = self._calls.get((module, call))
        return None if position is None else (position, self.index.calls[position])

    def rebuild(self, tree: Tree) -> Any:
        """Rebuild a recorded value (inputs, outputs) with its tensors loaded."""
        return rebuild(tree, self.read_tensor)

    def close(self) -> None:
        """Close the file, after any checksum still running (its result unclaimed: :meth:`settle` raises). Arrays
        read before stay readable until they are dropped."""
        for *_, future in self._pending:
            future.exception()  # waited for, not raised: closing must not mask what is already propagating
        self._pending = []
        self._heap.finish()
        self._file.close()
        self._map = None  # unmapped once the last array read from it is gone
        if self._closes_fd is not None:
            self._closes_fd()  # once: a finalizer called is dead
        self._read_fd = None

    def __enter__(self) -> BundleReader:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def _identity(stored: StoredDataset) -> tuple[object, ...] | None:
    """Where and as what a dataset's values lie in the file; None when it has no bytes of its own."""
    if stored.offset is None or stored.nbytes == 0:
        return None
    return (stored.offset, stored.nbytes, stored.shape, stored.dtype.str, stored.label)


@dataclasses.dataclass(frozen=True)
class _WalkFacts:
    """What a reader derives from a walk's datasets alone. Shared by the openings of one file: never changed."""

    largest: int
    """The largest dataset's bytes."""
    names_per_dataset: Counter[tuple[object, ...] | None]
    """How many names each dataset's bytes have (by :func:`_identity`): a repeat linked at capture has two or more."""

    @classmethod
    def of(cls, datasets: dict[str, StoredDataset]) -> _WalkFacts:
        largest = max((stored.nbytes for stored in datasets.values()), default=0)
        return cls(largest, Counter(_identity(stored) for stored in datasets.values()))


class _RecentWalks:
    """The catalogs of the files this process walked last, by file identity: a test suite opening one bundle test
    after test walks it once (a file changed since has another identity, and is walked again); with each, what
    openings derive from the file (:meth:`derived`: :class:`_WalkFacts`, 0.5 ms an opening of the Conformer
    example's 888 names; its provenance, 0.8 ms)."""

    def __init__(self, size: int) -> None:
        self._size, self._lock = size, threading.Lock()
        self._catalogs: OrderedDict[tuple[int, ...], Catalog] = OrderedDict()
        self._derived: dict[tuple[int, ...], dict[str, Any]] = {}
        """Per kept catalog's identity: what openings derived from it (:meth:`derived`)."""

    def get(self, identity: tuple[int, ...] | None) -> Catalog | None:
        with self._lock:
            return None if identity is None else self._catalogs.get(identity)

    def put(self, catalog: Catalog) -> None:
        with self._lock:
            self._catalogs[catalog.identity] = catalog
            self._catalogs.move_to_end(catalog.identity)
            self._derived.pop(catalog.identity, None)  # of the catalog it replaces, if any
            while len(self._catalogs) > self._size:
                self._derived.pop(self._catalogs.popitem(last=False)[0], None)

    def derived(self, datasets: dict[str, StoredDataset], what: str, build: Callable[[], _Derived]) -> _Derived:
        """``build()`` (``what`` names it), derived from the file these ``datasets`` were walked from: as derived before
        where they are a kept walk's (the object itself), the file unchanged since (its identity, status change time
        included). Shared so: never changed by those it is handed to."""
        with self._lock:
            kept = self._kept(datasets)
            found = None if kept is None else self._derived.get(kept, {}).get(what)
        if found is None:
            found = build()
            if kept is not None:
                with self._lock:
                    catalog = self._catalogs.get(kept)
                    if catalog is not None and catalog.datasets is datasets:  # still kept
                        self._derived.setdefault(kept, {})[what] = found
        return found

    def holds(self, datasets: dict[str, StoredDataset]) -> bool:
        """Whether these datasets (the object itself) are those of a walk kept here: one that can be reused."""
        with self._lock:
            return self._kept(datasets) is not None

    def _kept(self, datasets: dict[str, StoredDataset]) -> tuple[int, ...] | None:
        """The identity of the kept walk these datasets (the object itself) are, if any; the lock held."""
        return next((key for key, catalog in self._catalogs.items() if catalog.datasets is datasets), None)


_walked = _RecentWalks(4)


@dataclasses.dataclass
class _Decoded:
    """An index as decoded from its bytes, and the walks of a file it was found to agree with."""

    raw: bytes
    version: tuple[int, int]
    index: BundleIndex
    checked: list[tuple[dict[str, StoredDataset], bool]] = dataclasses.field(default_factory=list)
    """The datasets of each walk (the object itself) the index was checked against, and whether checksums were
    verified then: only walks :data:`_walked` keeps, which can be reused (a walk handed over by the preflight child
    for one opening never is), so no more than it keeps (with either setting)."""
    derived: dict[Callable[[BundleIndex], Any], Any] = dataclasses.field(default_factory=dict)
    """What readers built from the index alone (:meth:`BundleReader.derived`), by the function that built it."""

    @functools.cached_property
    def tensor_paths(self) -> frozenset[str]:
        """The path of every tensor the index names."""
        return frozenset(ref.path for ref in self.index.tensor_refs())

    def checked_against(self, stored: dict[str, StoredDataset], verify: bool) -> bool:
        return any(walked is stored and verified == verify for walked, verified in self.checked)

    def note_checked(self, stored: dict[str, StoredDataset], verify: bool) -> None:
        """Note a check passed in full; one against a walk that cannot be reused is not kept."""
        kept = [(walked, verified) for walked, verified in self.checked if _walked.holds(walked)]
        self.checked = [*kept, (stored, verify)] if _walked.holds(stored) else kept


class _RecentIndexes:
    """The indexes this process decoded last, by their exact bytes and format version, and the walks each was
    checked against: a test suite opening one bundle test after test decodes and checks its index once (for the
    Conformer example, 5-7 ms and some 2,000 objects an opening, which Python's garbage collector otherwise moves
    through its generations replay after replay). Nothing is trusted beyond what was checked: a decoding is reused
    only for the same bytes, a check only for the same walk, itself reused only for the same file unchanged
    (:class:`_RecentWalks`). Nothing may change an index once it is decoded (checked after every test, in
    ``tests/conftest.py``)."""

    def __init__(self, size: int, largest: int) -> None:
        self._size, self._largest, self._lock = size, largest, threading.Lock()
        self._entries: list[_Decoded] = []

    def find(self, raw: bytes, version: tuple[int, int]) -> _Decoded | None:
        with self._lock:
            return next((entry for entry in self._entries if entry.version == version and entry.raw == raw), None)

    def add(self, raw: bytes, version: tuple[int, int], index: BundleIndex) -> _Decoded:
        entry = _Decoded(raw, version, index)
        if len(raw) > self._largest:
            return entry
        with self._lock:
            self._entries = [*self._entries[-(self._size - 1) :], entry]
        return entry


_decoded = _RecentIndexes(4, largest=2 << 20)
"""Indexes of up to 2 MiB (some 11,000 records), decoded into about 4.5 times that in objects, and what was built
from each (a replay's ``RecordPlan``: each record's name and the dicts of a call's records, about as much again): at
most about 80 MB held, beside the walks they were checked against: those :data:`_walked` keeps, or kept at an
index's last check."""


def _identity_now(path: Path) -> tuple[int, ...] | None:
    """The file identity of ``path`` now; None when it cannot be had (gone meanwhile: the walk will say so)."""
    try:
        return file_identity(os.stat(path))
    except OSError:
        return None


def _descriptor(file: h5py.File) -> int | None:
    """The descriptor HDF5 reads the file through (its default driver's), or None for another driver."""
    try:
        handle = file.id.get_vfd_handle()
    except (OSError, RuntimeError, ValueError):
        return None
    return handle if isinstance(handle, int) and handle >= 0 else None


def _mapped_state(file: h5py.File) -> tuple[int | None, tuple[int, int] | None]:
    """The descriptor a mapped file is watched through (HDF5's own), and its :func:`_written_state` now; neither
    where that cannot be read."""
    descriptor = _descriptor(file)
    state = None if descriptor is None else _written_state(descriptor)
    return (None, None) if state is None else (descriptor, state)


def _written_state(descriptor: int) -> tuple[int, int] | None:
    """A file's size and modification time (nanoseconds): both move when it is truncated or written; None when
    they cannot be read."""
    try:
        status = os.fstat(descriptor)
    except OSError:
        return None
    return status.st_size, status.st_mtime_ns


def _map_file(file: h5py.File) -> tuple[mmap.mmap | None, int | None]:
    """The file HDF5 opened (the same one even if its path was replaced since), mapped whole and read-only where
    it is this user's own; else the descriptor to read its records from, or neither (another driver: HDF5 reads
    them). Another user who can write the file (its owner, or anyone where all may write it) could shrink it while
    it is read, and a read from a mapped page past its new end kills the process (SIGBUS). A file of one's own that
    one's group may write is still mapped: a umask of 002 makes every file so, and reading large records into
    memory of their own took GPT-2's exact replay from 1.5 to 2.3 s."""
    descriptor = _descriptor(file)
    if descriptor is None:
        return None, None
    readable = descriptor if hasattr(os, "preadv") else None
    try:
        status = os.fstat(descriptor)
        own = status.st_uid == getattr(os, "geteuid", lambda: status.st_uid)()
        if readable is not None and (not own or status.st_mode & stat.S_IWOTH):
            return None, os.dup(readable)  # closed with the reader, not with HDF5's file
        return mmap.mmap(descriptor, 0, access=mmap.ACCESS_READ), None  # the mapping holds its own duplicate
    except (OSError, ValueError):
        return None, None  # HDF5 reads the records


def _is_auxiliary(name: str) -> bool:
    return name == INDEX.lstrip("/") or name.startswith(RNG.lstrip("/") + "/")


class RecordedObject(dict):  # type: ignore[type-arg]
    """A recorded dataclass or mapping object fed back: a ``dict`` of its fields that also reads them as attributes
    (``batch.audio`` as well as ``batch["audio"]``), so that a forward written for the object runs on it."""

    __slots__ = ()

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


def _named_tuple(type_name: object, fields: list[str], values: list[Any]) -> tuple[Any, ...]:
    """A recorded named tuple fed back as a named tuple of the same short name and fields (made here, by name only:
    no class named in the bundle is imported)."""
    short = re.sub(r"\W", "_", str(type_name).rsplit(".", 1)[-1])
    short = short if short.isidentifier() and not keyword.iskeyword(short) else "RecordedTuple"
    made = _NAMED_TUPLES.get((short, tuple(fields)))
    if made is None:
        made = _NAMED_TUPLES.setdefault((short, tuple(fields)), collections.namedtuple(short, fields, rename=True))
    return made(*values)  # type: ignore[no-any-return]


_NAMED_TUPLES: dict[tuple[str, tuple[str, ...]], type] = {}


def rebuild(tree: Tree, load: Callable[[TensorRef], torch.Tensor]) -> Any:
    """Turn a validated tree back into Python values.

    No class is ever imported or instantiated from a name stored in a bundle: a recorded dataclass or mapping
    class becomes a :class:`RecordedObject` (a ``dict`` reading its keys as attributes too), a named tuple a named
    tuple made here with its short name and fields.
    """
    kind = tree[0]
    if kind == "T":
        _, path, tag, shape, requires_grad = tree
        return load(TensorRef(str(path), str(tag), tuple(shape), bool(requires_grad)))  # type: ignore[arg-type]
    if kind == "N":
        return None
    if kind == "S":
        return tree[1]
    if kind in ("L", "U"):
        items = [rebuild(child, load) for child in tree[1]]  # type: ignore[attr-defined]
        return items if kind == "L" else tuple(items)
    if kind == "D":
        return {key: rebuild(child, load) for key, child in tree[-1]}  # type: ignore[attr-defined]
    if kind == "O" and tree[2] != "namedtuple":
        return RecordedObject((key, rebuild(child, load)) for key, child in tree[-1])  # type: ignore[attr-defined]
    if kind == "O":
        fields = [str(key) for key, _ in tree[3]]  # type: ignore[attr-defined]
        return _named_tuple(tree[1], fields, [rebuild(child, load) for _, child in tree[3]])  # type: ignore[attr-defined]
    raise BundleFormatError(f"recorded value of type {tree[1]} could not be recorded ({tree[2]}), so it cannot be fed")


@contextmanager
def open_bundle_for_listing(bundle: Path, *, rank: int = 0, verify: bool = True) -> Iterator[BundleReader]:
    """The bundle ``replay-compare --list`` shows: the file itself, or rank ``rank`` of a multi-rank capture."""
    manifest = find_manifest(bundle)
    if manifest is not None and rank >= manifest.world_size:
        raise InputError(f"--rank {rank}: the capture ran {manifest.world_size} ranks (0..{manifest.world_size - 1})")
    if manifest is None and rank != 0:
        raise InputError(f"--rank {rank}: {bundle} is one bundle, not a multi-rank capture; drop --rank")
    path = manifest.rank_file(rank) if manifest is not None else bundle
    with BundleReader(path, verify=verify, preflight=DEFAULT_PREFLIGHT_SECONDS) as reader:
        yield reader


_PROVENANCE_CHARACTERS = 4096
"""Characters of a provenance string kept (a command line, a package list): a crafted bundle's 100 MB attribute
would be copied at every step of a report, gigabytes in all."""


def _provenance_text(value: object) -> str:
    """A provenance attribute as text, cut to :data:`_PROVENANCE_CHARACTERS` as soon as it is read."""
    text = value.decode() if isinstance(value, bytes) else value if isinstance(value, str) else str(value)
    if len(text) <= _PROVENANCE_CHARACTERS:
        return text
    return f"{text[:_PROVENANCE_CHARACTERS]}... ({len(text)} characters)"
