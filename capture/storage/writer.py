"""Streaming, atomic bundle writer.

Tensors go to disk as they are produced, into a hidden temporary file beside the target; the
index is written last and the file is moved into place only then. A crash leaves at most that
temporary file behind, never a half-written bundle at the output path, and never touches a
bundle that was already there.

Each dataset is created by HDF5 with its space allocated at once (contiguous, never filled), and
its bytes are written at that offset by a background thread (:mod:`parity_harness.capture.storage.streaming`), so disk
writes overlap the run. A tensor recorded again unchanged (a module's output that is the next
module's input, a gradient seen by a module and its last child) is stored once: the second
record is an HDF5 hard link to the first dataset. Unchanged means bit-equal to the copy staged for the first record,
not only an unmoved version counter, which edits through ``.data`` or an alias do not move. A CPU tensor is compared
as it is recorded; one elsewhere (a GPU) is staged too, and the two copies are compared when its batch is made.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import weakref
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Final

import h5py
import numpy as np
import torch

from parity_harness.capture.distributed import local_tensor
from parity_harness.capture.storage.streaming import BLOCK, DEFAULT_STAGING_BYTES, Staged, TensorStream, ring_span
from parity_harness.common.errors import BundleError, BundleExistsError
from parity_harness.common.format.atomic import commit, sibling_temp
from parity_harness.common.format.bundle.layout import (
    ATTR_DTYPE,
    ATTR_FORMAT,
    ATTR_MINOR,
    ATTR_VERSION,
    INDEX,
    PROVENANCE,
)
from parity_harness.common.format.bundle.lengths import LENGTH_TAGS
from parity_harness.common.format.bundle.schema import BundleIndex, TensorRef
from parity_harness.common.format.bundle.version import FORMAT_MINOR, FORMAT_NAME, FORMAT_VERSION
from parity_harness.common.format.dtypes import from_storage, storage_dtype, tag_of, to_float64, to_numeric, to_storage
from parity_harness.common.format.packing import pack
from parity_harness.common.heap import HeapTrimmer
from parity_harness.common.numerics.statistics import array_statistics, stored_crc32

__all__ = ["BundleWriter"]

_LIBVER: Final = ("v108", "v108")
"""HDF5's 1.8 file format (any HDF5 since 2008 reads it), not its 1.6 default: the metadata of a thousand small
datasets takes 0.6 MB, not 2.2, and each dataset is made and walked with less work."""
_META_BLOCK: Final = 64 << 10
"""Bytes HDF5 sets aside at a time for object headers, groups and links (its default: 2 KiB). The Conformer
example's 571 datasets, their attributes and 315 links are created in 17.5 ms rather than 25-26 in a tight loop
(``scripts/bench.py``'s objects floor), in a capture step in 24.2-24.5 ms rather than 25.4-26.6. The file holds
the blocks' unused ends: a few-module model's 69 KB bundle takes 103 KB, the Conformer's 88.69 MB 88.60 MB. A file
access setting: the file's format is the same, and any HDF5 reads it."""
_ALIGNED_FROM = 64 << 10
"""Datasets of at least this many bytes start on a BLOCK boundary (a few KiB of padding each)."""
_RECENT_TENSORS = 32
"""How many recently written tensors are kept to recognise a repeat: repeats are close in time."""
_BATCH, _BATCH_BYTES = 64, 8 << 20
"""Dataset creations (and hard links) deferred, then made together: up to this many, or while their snapshots hold
this many bytes of the staging ring (at most a quarter of it: a copy made after staging is compared with the
earlier one when its batch is made, before the ring has moved on a lap past it). HDF5 creates a dataset several times
faster when its own state is still in the CPU's caches, which the model's layers between two records evict: a
Conformer of 569 small datasets spent 48 ms creating them one per record, against 19 ms for the same creations in
a row."""

_StorageKey = tuple[object, ...]


def _storage_key(tensor: torch.Tensor) -> _StorageKey | None:
    """What makes two tensors views of the same bytes with the same values, or None if unknown."""
    if tensor.is_inference() or tensor.layout != torch.strided:
        return None  # inference tensors have no version counter to prove the values unchanged
    return (
        tensor.device,
        tensor.dtype,
        tensor.untyped_storage().data_ptr(),
        tensor.storage_offset(),
        tuple(tensor.shape),
        tuple(tensor.stride()),
        tensor.is_conj(),
        tensor.is_neg(),
    )


def _open_direct(path: Path) -> int | None:
    """``path`` opened for writing past the page cache, or None where the OS or file system cannot."""
    flag = getattr(os, "O_DIRECT", None)
    if flag is None or os.environ.get("PARITY_NO_DIRECT_IO"):
        return None
    try:
        return os.open(path, os.O_WRONLY | flag)
    except OSError:
        return None


def _allocate_early() -> h5py.h5p.PropDCID:
    """Dataset creation: space allocated at creation and never filled, so it can be written directly."""
    dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
    dcpl.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)
    dcpl.set_fill_time(h5py.h5d.FILL_TIME_NEVER)
    return dcpl


class _StringAttribute:
    """Writes one string attribute (a variable-length UTF-8 string, as h5py's ``attrs[name] = str`` does) through
    h5py's low level, its types made once: a third of ``attrs[name] = value``'s cost."""

    def __init__(self, name: str) -> None:
        self._name = name.encode()
        string = h5py.string_dtype()
        self._dtype = string
        self._file_type = h5py.h5t.py_create(string, logical=True)
        self._memory_type = h5py.h5t.py_create(string)
        self._space = h5py.h5s.create_simple(())

    def write(self, target: h5py.h5o.ObjectID, value: str) -> None:
        attribute = h5py.h5a.create(target, self._name, self._file_type, self._space)
        attribute.write(np.array(value, dtype=self._dtype), mtype=self._memory_type)


def _weakly(method: Callable[[], None]) -> Callable[[], None]:
    """``method`` called while its object lives; nothing after."""
    reference = weakref.WeakMethod(method)

    def call() -> None:
        bound = reference()
        if bound is not None:
            bound()

    return call


@dataclasses.dataclass(frozen=True)
class _Deferred:
    """A dataset to create and hand to the stream, or a hard link to make, at the next batch."""

    path: str
    link_to: str | None = None
    """Make ``path`` a hard link to this dataset (created before it)."""
    shape: tuple[int, ...] = ()
    tag: str = ""
    staged: Staged | None = None
    """A snapshot: its bytes already copied into the staging ring."""
    stable: torch.Tensor | None = None
    """A tensor that stays unchanged until commit, written from its own memory."""
    repeat_of: _Recent | None = None
    """An earlier record of the same memory (a tensor not in CPU memory): a link to it if the two staged copies
    prove equal when the batch is made, else a dataset of its own."""


@dataclasses.dataclass(frozen=True)
class _Recent:
    """A tensor recorded a moment ago, to recognise a repeat of it."""

    tensor: torch.Tensor
    version: int
    path: str
    staged: Staged
    """The copy of its bytes staged for the disk, which a repeat must equal bit for bit."""


class BundleWriter:
    """Write one bundle: ``write_tensor`` as the run goes, then ``commit(index)``.

    Args:
        path: final bundle path.
        overwrite: replace an existing file at ``path`` (refused by default).
        staging_bytes: size of the background writer's staging ring; 0 writes synchronously.
        deduplicate: store a tensor recorded again unchanged once, as a hard link.
        checksums: record each tensor's CRC-32 in the index (costs a core ~0.25 s per GB).

    Raises:
        BundleExistsError: ``path`` exists and ``overwrite`` is False.
        BundleError: the output folder does not exist or is not writable.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        overwrite: bool = False,
        staging_bytes: int = DEFAULT_STAGING_BYTES,
        deduplicate: bool = True,
        checksums: bool = True,
    ) -> None:
        self.path = Path(path)
        self._overwrite = overwrite
        if self.path.exists() and not overwrite:
            raise BundleExistsError(f"{self.path}: file exists; pass --overwrite to replace it")
        if not self.path.parent.is_dir():
            raise BundleError(f"{self.path}: output folder {self.path.parent} does not exist; create it first")
        self._tmp = sibling_temp(self.path)
        try:
            # Datasets from 64 KiB on start on 4 KiB boundaries, so their bytes can bypass the page cache.
            self._file = h5py.File(
                self._tmp,
                "w-",
                libver=_LIBVER,
                alignment_threshold=_ALIGNED_FROM,
                alignment_interval=BLOCK,
                meta_block_size=_META_BLOCK,
            )
        except OSError as err:
            raise BundleError(f"{self.path}: cannot create a file in {self.path.parent}: {err}") from err
        self._file.attrs[ATTR_FORMAT] = FORMAT_NAME
        self._file.attrs[ATTR_VERSION] = FORMAT_VERSION
        self._file.attrs[ATTR_MINOR] = FORMAT_MINOR
        self._fd = os.open(self._tmp, os.O_WRONLY)
        self._direct_fd = _open_direct(self._tmp)
        self._stream = TensorStream(
            self._fd, direct_fd=self._direct_fd, staging_bytes=staging_bytes, where=str(self.path), checksums=checksums
        )
        self._with_checksums = checksums
        self._dcpl = _allocate_early()
        self._lcpl = h5py.h5p.create(h5py.h5p.LINK_CREATE)
        self._lcpl.set_create_intermediate_group(True)
        self._type_ids: dict[np.dtype[np.generic], h5py.h5t.TypeID] = {}
        self._deduplicate = deduplicate
        self._recent: OrderedDict[_StorageKey, _Recent] = OrderedDict()
        self._stable: dict[str, tuple[torch.Tensor, int]] = {}  # written from memory: must stay unchanged
        self._handed_over: dict[str, int] = {}
        """Parameters written from their memory: path -> CRC-32 of their bytes when handed over, which the bytes
        written must equal (version counters miss edits through ``.data`` or an alias)."""
        self._from_memory: set[str] = set()
        """Tensors written from their own memory, later: the parameters among them are proven at commit."""
        self._provisional: set[str] = set()
        """Gradients (:meth:`write_provisional`): the bytes to store are those they hold at commit."""
        self._checksums: dict[str, int] = {}  # datasets written through HDF5
        self._links: dict[str, str] = {}  # linked path -> the path written
        self._placed: dict[str, tuple[int | None, tuple[int, ...], str]] = {}  # path -> (offset, shape, tag)
        self._tag_attribute = _StringAttribute(ATTR_DTYPE)
        self._deferred: list[_Deferred] = []  # in the order recorded: links follow what they link to
        self._deferred_bytes = 0
        self._batch_bytes = min(_BATCH_BYTES, max(staging_bytes // 4, 1))  # no ring: batches by count alone
        self._claimed: set[str] = set()  # every dataset path recorded, so a second use is refused at once
        self._groups: set[str] = set()  # the groups above them
        # The ring full of snapshots waiting for a dataset; weakly, or the stream's thread would keep the writer.
        self._stream.before_wait = _weakly(self._create_deferred)
        # What the model and the capture free between records would otherwise stay resident (common.heap).
        self._heap = HeapTrimmer()
        self.tensor_bytes = 0
        """Bytes of tensor data stored (a linked repeat adds nothing)."""
        self.tensor_count = 0
        """Tensors recorded, repeats included."""
        self.linked_count = 0
        """Records stored as links to an identical tensor recorded before."""
        self.summaries: dict[str, dict[str, float | int]] = {}
        """Path -> statistics of the tensors recorded as statistics only."""
        self.keep_vectors_of: int | None = None
        """Set to the batch size when lengths are declared: the values of integer vectors of that many elements
        stored in full are kept (:attr:`integer_vectors`)."""
        self.integer_vectors: dict[str, np.ndarray] = {}
        """Path -> values of the integer vectors of :attr:`keep_vectors_of` elements stored in full: per-example
        lengths are among them, and the cotangent's padding is found from them before the bundle can be read
        (``common.format.bundle.lengths``)."""

    def write_tensor(self, path: str, tensor: torch.Tensor, *, stable: bool = False) -> TensorRef:
        """Store a tensor's exact bits at dataset ``path`` and return its reference.

        The values are those of the moment of the call: the tensor may change right after. With
        ``stable``, the caller promises it will not change before :meth:`commit` (parameters,
        final gradients): it is then written from its own memory, without a copy, and a change
        is detected and fails the capture.
        """
        tensor = local_tensor(tensor)  # a DTensor activation: what this rank holds
        tag = tag_of(tensor.dtype)
        ref = TensorRef(path, tag, tuple(tensor.shape), bool(tensor.requires_grad))
        self.tensor_count += 1
        if tag in LENGTH_TAGS and tensor.dim() == 1 and tensor.numel() == self.keep_vectors_of:
            self.integer_vectors[path] = tensor.detach().to("cpu", torch.int64, copy=True).numpy()
        key = _storage_key(tensor) if self._deduplicate else None
        earlier = self._unchanged_earlier(key, tensor)
        if earlier is not None and self._stream.holds(earlier.staged, tensor):  # proven now, from CPU memory
            self._claim(path)
            self._link(path, earlier.path)
            return ref
        # Elsewhere (a GPU) the bytes are only seen once copied: the proof waits for the copy, at the batch.
        repeat_of = None
        if earlier is not None and not stable and self._proven_after_staging(tensor):
            repeat_of = earlier if self._stream.intact(earlier.staged) else None
        if stable and self._with_checksums and tensor.device.type == "cpu":  # its bytes now, for commit to prove
            self._handed_over[path] = stored_crc32(to_storage(tensor)[0])  # before its write can be queued
        staged = self._store(path, tensor, stable=stable, repeat_of=repeat_of)
        if path not in self._from_memory:
            self._handed_over.pop(path, None)  # copied when handed over, or written through HDF5: nothing to prove
        # Only a staged copy proves a repeat's bytes: one written from memory later (a parameter) holds what the
        # memory holds then, and an edit through .data between the two records would go unseen. A copy proven
        # after staging is the newest of those bytes: the next repeat is compared with it, and links its target.
        if key is not None and staged is not None:
            self._recent[key] = _Recent(tensor, tensor._version, path, staged)
            if len(self._recent) > _RECENT_TENSORS:
                self._recent.popitem(last=False)
        return ref

    def write_summary(self, path: str, tensor: torch.Tensor) -> TensorRef:
        """Record a tensor as statistics only (``numerics.statistics``): no dataset, an index entry."""
        tensor = local_tensor(tensor)  # a DTensor activation: what this rank holds
        self.tensor_count += 1
        # Computed again for a repeat: with no copy kept, nothing proves its values unchanged (version counters miss
        # edits through .data or an alias).
        stored, tag = to_storage(tensor)
        self.summaries[path] = array_statistics(stored, to_numeric(stored, tag))
        return TensorRef(path, tag, tuple(tensor.shape), bool(tensor.requires_grad))

    def write_provisional(self, path: str, tensor: torch.Tensor) -> TensorRef:
        """Start storing a tensor that may still change (a gradient while backward runs), from its memory.

        Call again with the final value before :meth:`commit`: it is written again only if it
        changed (another object, or its version counter moved) since the last call.
        """
        tensor = local_tensor(tensor)  # a DTensor activation: what this rank holds
        tag = tag_of(tensor.dtype)
        ref = TensorRef(path, tag, tuple(tensor.shape), bool(tensor.requires_grad))
        if path not in self._stable:
            self.tensor_count += 1
            self._store(path, tensor, stable=True)
            self._provisional.add(path)
            return ref
        held, version = self._stable[path]
        if held is not tensor or tensor._version != version:
            self._create_deferred()  # its place in the file, and no snapshot staged before this write's
            offset, shape, stored_tag = self._placed[path]
            if shape != ref.shape or stored_tag != tag:
                raise BundleError(f"{self.path}:{path}: the tensor changed shape or dtype while it was recorded")
            self._stable[path] = (tensor, tensor._version)
            if offset is None:
                self._write_through_hdf5(path, tensor)
            else:
                self._stream.write_stable(offset, tensor, path)  # after held's, if that is still queued
        return ref

    def _link(self, path: str, target: str) -> None:
        """Record ``path`` as a hard link to the dataset ``target``: the same dataset under a second name."""
        self._defer(_Deferred(path, link_to=target))
        self._links[path] = target
        self.linked_count += 1

    @staticmethod
    def _proven_after_staging(tensor: torch.Tensor) -> bool:
        """Whether a repeat of ``tensor`` is proven by comparing its staged copy with the earlier one (a tensor not
        in CPU memory) rather than its own memory with that copy."""
        return tensor.device.type != "cpu"

    def _store(
        self, path: str, tensor: torch.Tensor, *, stable: bool, repeat_of: _Recent | None = None
    ) -> Staged | None:
        """Store ``tensor`` at ``path``; the copy staged for it, if one was (to be linked to ``repeat_of`` instead
        if the two copies prove equal)."""
        tag = tag_of(tensor.dtype)
        shape = tuple(tensor.shape)
        self._claim(path)
        if stable:
            self._stable[path] = (tensor, tensor._version)
        nbytes = tensor.numel() * tensor.element_size()
        self.tensor_bytes += nbytes
        self._heap.note(nbytes)
        if shape and tensor.numel():  # HDF5 places 0-d and empty datasets only when written through it
            if stable and self._stream.writes_from_memory(tensor):
                self._defer(_Deferred(path, shape=shape, tag=tag, stable=tensor))
                self._from_memory.add(path)
                return None
            if not stable and self._stream.stages(tensor):
                staged = self._stream.stage(tensor, keep=None if repeat_of is None else repeat_of.staged)
                self._defer(_Deferred(path, shape=shape, tag=tag, staged=staged, repeat_of=repeat_of))
                return staged
        self._create_deferred()  # the stream writes in the order it was given
        offset = self._create_dataset(path, shape, storage_dtype(tag), tag)
        self._placed[path] = (offset, shape, tag)
        if offset is None:
            self._write_through_hdf5(path, tensor)
        elif stable:
            self._stream.write_stable(offset, tensor, path, twice=path in self._handed_over)
            if self._stream.writes_from_memory(tensor):  # later, as a deferred one (a 0-d one placed by HDF5)
                self._from_memory.add(path)
        else:
            self._stream.write(offset, tensor, path)
        return None

    def _claim(self, path: str) -> None:
        """Refuse at the record what HDF5 would refuse when the batch is made: a path recorded before, one running
        through a dataset, or one naming a group of other records."""
        parts = [part for part in path.split("/") if part]
        groups = ["/".join(parts[:end]) for end in range(1, len(parts))]
        name = "/".join(parts)
        through = next((group for group in groups if group in self._claimed), None)
        reason = None
        if name in self._claimed:
            reason = "it was recorded before"
        elif name in self._groups:
            reason = "a group of that name holds other records"
        elif through is not None:
            reason = f"it runs through the dataset {through}"
        if reason is not None:
            raise BundleError(f"{self.path}: cannot create dataset {path}: {reason}")
        self._claimed.add(name)
        self._groups.update(groups)

    def _defer(self, item: _Deferred) -> None:
        self._deferred.append(item)
        if item.staged is not None:  # the ring space it holds: whole blocks
            self._deferred_bytes += ring_span(item.staged.nbytes)
        if len(self._deferred) >= _BATCH or self._deferred_bytes >= self._batch_bytes:
            self._create_deferred()

    def _create_deferred(self) -> None:
        """Create the deferred datasets and links, in the order recorded, and hand their bytes to the stream. One
        that fails does not stop the others; the first failure is raised after them."""
        deferred, self._deferred, self._deferred_bytes = self._deferred, [], 0
        failure: BundleError | None = None
        for item in deferred:
            try:
                self._create(item)
            except Exception as err:  # raised below, after the rest of the batch
                if item.staged is not None:
                    self._stream.discard(item.staged)  # its ring space comes back in its turn
                if failure is None and isinstance(err, BundleError):
                    failure = err
                elif failure is None:
                    failure = BundleError(f"{self.path}:{item.path}: {err}")
                    failure.__cause__ = err
        if failure is not None:
            raise failure

    def _create(self, item: _Deferred) -> None:
        if item.link_to is not None:
            root = self._file.id
            root.links.create_hard(item.path.encode(), root, item.link_to.encode(), lcpl=self._lcpl)
            return
        if self._linked_as_repeat(item):
            return
        offset = self._create_dataset(item.path, item.shape, storage_dtype(item.tag), item.tag)
        if offset is None:  # not for a dataset of elements allocated early: HDF5 gave it no place
            raise BundleError(f"{self.path}: HDF5 placed no bytes for dataset {item.path} of shape {item.shape}")
        self._placed[item.path] = (offset, item.shape, item.tag)
        if item.staged is not None:
            self._stream.submit(item.staged, offset, item.path)
        else:
            assert item.stable is not None
            self._stream.write_stable(offset, item.stable, item.path, twice=item.path in self._handed_over)

    def _linked_as_repeat(self, item: _Deferred) -> bool:
        """Make ``item`` a hard link to the earlier record it may repeat if their staged copies hold the same bytes."""
        earlier, staged = item.repeat_of, item.staged
        if earlier is None or staged is None or not self._stream.same_copies(earlier.staged, staged):
            return False
        target = self._links.get(earlier.path, earlier.path)  # the dataset itself, where the earlier is a link
        root = self._file.id
        root.links.create_hard(item.path.encode(), root, target.encode(), lcpl=self._lcpl)
        self._links[item.path] = target
        self.linked_count += 1
        self.tensor_bytes -= staged.nbytes
        self._stream.discard(staged)  # its ring space comes back in its turn, unwritten
        return True

    def _write_through_hdf5(self, path: str, tensor: torch.Tensor) -> None:
        array = to_storage(tensor)[0]
        if array.size:
            self._file[path][()] = array
        self._checksums[path] = stored_crc32(array)

    def checksums(self) -> dict[str, int]:
        """Dataset path -> CRC-32 of its stored bytes, for every dataset written (call after the writes drained)."""
        sums = {**self._stream.checksums, **self._checksums}
        sums.update({path: sums[target] for path, target in self._links.items()})
        return sums

    def _create_dataset(self, path: str, shape: tuple[int, ...], dtype: np.dtype[np.generic], tag: str) -> int | None:
        """An empty dataset with its space allocated and its ``dtype`` attribute; its data's file offset, or None
        where HDF5 places it only when written through it. h5py's low level throughout: a third of the high
        level's cost, which a model of many small modules pays per record."""
        space = h5py.h5s.create_simple(shape) if shape else h5py.h5s.create(h5py.h5s.SCALAR)
        type_id = self._type_ids.get(dtype)
        if type_id is None:
            type_id = self._type_ids[dtype] = h5py.h5t.py_create(dtype)
        try:
            dataset_id = h5py.h5d.create(self._file.id, path.encode(), type_id, space, dcpl=self._dcpl, lcpl=self._lcpl)
        except ValueError as err:  # HDF5's "name already exists"
            raise BundleError(f"{self.path}: cannot create dataset {path}: {err}") from err
        self._tag_attribute.write(dataset_id, tag)
        offset = dataset_id.get_offset()
        return None if offset is None else int(offset)

    def _check_stable(self) -> None:
        """Tensors written from their own memory must not have changed since they were handed over."""
        changed = [path for path, (tensor, version) in self._stable.items() if tensor._version != version]
        if changed:
            raise self._changed_in_place(changed, "")

    def _check_contents(self) -> None:
        """What version counters cannot tell, told by the CRC-32s of the bytes written: a parameter holds the bytes
        it was handed over with, unchanged while they were written, or the capture fails; a gradient whose values
        changed after its bytes were written or copied (an edit through ``.data`` in a hook) is written again, from
        what it holds now that backward is over. Without checksums, version counters alone."""
        if not self._with_checksums:
            return
        written = {**self._stream.checksums, **self._checksums}
        unsteady = self._stream.unsteady  # changed while written: the file may hold other bytes than checksummed
        changed = [path for path, crc in self._handed_over.items() if written.get(path) != crc or path in unsteady]
        if changed:
            raise self._changed_in_place(changed, " (through .data or an alias: its version counter did not move)")
        again = False
        for path in self._provisional:
            tensor = self._stable[path][0]
            if written.get(path) == stored_crc32(to_storage(tensor)[0]):
                continue
            offset = self._placed[path][0]
            if offset is None:
                self._write_through_hdf5(path, tensor)
            else:
                self._stream.write_stable(offset, tensor, path)
                again = True
        if again:
            self._stream.drain()

    def _changed_in_place(self, changed: list[str], how: str) -> BundleError:
        return BundleError(
            f"{self.path}: {changed[0]} ({len(changed)} tensor(s) in all) changed in place while the capture was "
            f"running{how}, so the recorded value is not reliable; the model must not modify its parameters or "
            "their gradients during forward and backward"
        )

    def _unchanged_earlier(self, key: _StorageKey | None, tensor: torch.Tensor) -> _Recent | None:
        """A recently staged record of a view of the same bytes, if neither version counter moved since.

        A version counter that moved proves a change; one that did not proves nothing (``.data``, NumPy and DLPack
        aliases and in-place collectives write without moving it), so the caller still compares the bytes with the
        copy staged for the earlier record."""
        if key is None or (earlier := self._recent.get(key)) is None:
            return None
        if earlier.tensor._version != earlier.version or tensor._version != earlier.version:
            return None
        self._recent.move_to_end(key)
        return earlier

    def has(self, path: str) -> bool:
        """Whether something is already stored at ``path``."""
        self._create_deferred()
        return path in self._file

    def read_float64(self, path: str) -> np.ndarray | None:
        """Values of a tensor already written (float64), or None when nothing is stored there."""
        self._create_deferred()
        dataset = self._file.get(path)
        if dataset is None:
            return None
        self._stream.drain()
        return to_float64(np.asarray(dataset[()]), str(dataset.attrs[ATTR_DTYPE]))

    def read_tensor(self, path: str) -> torch.Tensor:
        """A tensor already written, bit-exact."""
        self._create_deferred()
        dataset = self._file[path]
        self._stream.drain()
        return from_storage(np.asarray(dataset[()]), str(dataset.attrs[ATTR_DTYPE]))

    def write_array(self, path: str, array: np.ndarray) -> None:
        """Store a plain NumPy array (RNG states and other non-tensor data), with its CRC-32 like a tensor's."""
        self._file.create_dataset(path, data=array)
        self._checksums[path] = stored_crc32(array)

    def write_provenance(self, provenance: dict[str, str]) -> None:
        """Store provenance as string attributes of ``/provenance``, readable with plain h5py."""
        group = self._file.require_group(PROVENANCE)
        for key, value in provenance.items():
            group.attrs[key] = str(value)

    def commit(self, index: BundleIndex) -> Path:
        """Wait for the tensor writes, write the index, close the file and move it into place atomically."""
        self._create_deferred()
        self._stream.drain()
        self._check_stable()
        self._check_contents()
        self._stream.close()
        self._recent.clear()
        self._stable.clear()
        self._handed_over.clear()
        self._from_memory.clear()
        self._provisional.clear()
        self._close_descriptors()
        self._heap.finish()
        index = dataclasses.replace(index, checksums=self.checksums() if self._with_checksums else {})
        try:
            smaller = "record fewer modules (--layers, --skip-layers) or kinds (--record)"
            self._file.create_dataset(INDEX, data=pack(index.to_dict(), smaller=smaller))
            self._file.flush()
            self._file.close()
        except (OSError, RuntimeError) as err:  # HDF5's own writes: a full disk, a vanished folder
            reason = str(err).replace("\n", " ")
            if "errno = 28" in reason or "No space left" in reason:
                reason = "no space left on the device"
            raise BundleError(f"{self.path}: writing the bundle failed: {reason[:300]}") from err
        self._move_into_place()
        return self.path

    def _move_into_place(self) -> None:
        try:
            commit(self._tmp, self.path, overwrite=self._overwrite)
        except BundleExistsError:
            self.abort()
            raise

    def abort(self) -> None:
        """Close and delete the temporary file, whatever closing it raises (a full disk); the output path is
        left as it was."""
        try:
            self._deferred.clear()
            with contextlib.suppress(Exception):  # already failing: the first error is the one to report
                self._stream.close()
            self._recent.clear()
            self._stable.clear()
            self._handed_over.clear()
            self._from_memory.clear()
            self._provisional.clear()
            with contextlib.suppress(OSError):
                self._close_descriptors()
            if self._file.id.valid:
                with contextlib.suppress(Exception):
                    self._file.close()
        finally:
            self._heap.finish()
            self._tmp.unlink(missing_ok=True)

    def _close_descriptors(self) -> None:
        for fd in (self._fd, self._direct_fd):
            if fd is not None and fd >= 0:
                os.close(fd)
        self._fd, self._direct_fd = -1, None

    def __enter__(self) -> BundleWriter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is not None:
            self.abort()
