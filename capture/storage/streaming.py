"""Tensor bytes to disk off the critical path: a staging ring, a disk thread and a checksum thread.

Two kinds of writes, both done by one background thread with ``os.pwrite`` (which releases the
GIL, so disk writes overlap the model's compute):

* ``write``: a snapshot. The main thread copies the tensor into a preallocated staging ring (a
  memory copy at many GB/s; pinned memory and a non-blocking copy for CUDA tensors) and goes on.
  The copy is what makes this safe for activations and gradients: a recorded tensor may be
  changed in place a moment later (a residual ``x += ...``), and the bundle must hold the values
  of the moment it was recorded. Tensors too large for the ring are written synchronously,
  straight from their memory, while the main thread waits.
* ``write_stable``: no copy at all, for tensors that stay unchanged until the capture ends
  (parameters, final gradients). The thread writes from the tensor's own memory, in slices, after
  any pending snapshot (so the ring never waits behind a large parameter); the caller proves
  afterwards, with the tensor's version counter, that it was not modified meanwhile.

Where the file system allows it, the 4 KiB-aligned middle of every write from 1 MiB goes through a second
descriptor opened with ``O_DIRECT``: the disk reads the bytes straight from memory, where a
buffered write costs a CPU core copying them into the page cache (measured on a 2-core VM: 0.06 s
of CPU per 1.7 GB instead of 0.7 s, or 3.4 s when the page cache must first grow). The bundle's
datasets are laid out 4 KiB-aligned for this (:mod:`parity_harness.capture.storage.writer`); unaligned heads and tails,
tensors under 1 MiB and file systems without ``O_DIRECT`` (tmpfs) use ordinary writes.

Every write's CRC-32 is taken once its bytes are written. The disk thread takes those of small writes itself;
those of large ones (from 4 MiB) it leaves to the checksum thread and goes on with the next write, so that zlib
and the disk no longer wait for each other: on a GPT-2 model's capture the one thread had been busy from its
first write to its last, 1.6 s writing and 1.0 s checksumming, and the model's last layers waited for it. A
caller waiting for ring space or for the drain takes waiting checksums itself rather than only wait. (The
checksum thread at idle priority, so that torch's threads would never wait for it, took a further 0.28 s off
that capture on an idle machine, but made it twice as slow beside two busy processes: its CRC-32s waited.)

The ring is a FIFO: space is reclaimed in the order it was handed out, once the write and its checksum are done.
A write of a name still queued under that name lands after it, bytes and checksum alike: snapshots are written
before stable tensors queued earlier, and a synchronous write at once, so those two wait for the drain first when
the name has such a write queued.
The disk thread is woken once a batch is queued, not per tensor, and then writes every queued snapshot. A write
error (a full disk) is kept and raised by the next call.
"""

from __future__ import annotations

import collections
import errno
import mmap
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final, cast

import numpy as np
import torch

from parity_harness.common.errors import BundleError
from parity_harness.common.format.dtypes import to_storage
from parity_harness.common.numerics.bytewise import memory_equal, same_bytes
from parity_harness.common.numerics.checksum import crc32
from parity_harness.common.numerics.statistics import crc32_combine

__all__ = ["DEFAULT_STAGING_BYTES", "Staged", "TensorStream", "ring_span"]

DEFAULT_STAGING_BYTES: Final = 256 << 20
BLOCK: Final = 4096
"""Alignment of O_DIRECT writes (address, offset and length), and of ring slots."""
_SLICE: Final = 8 << 20
"""Bytes of a stable tensor written at a time, so that snapshots waiting for ring space go first."""
_DIRECT_FROM: Final = 1 << 20
"""Bytes from which a write bypasses the page cache: below, a synchronous device write per tensor (tens of
microseconds each) cost more than the copy into the page cache it saves (a Conformer of 569 small tensors: 243 ->
210 ms)."""
_SUM_APART_FROM: Final = 4 << 20
"""Bytes of a write from which its CRC-32 is taken on the checksum thread while the disk thread goes on with the next
write. Below, handing it over cost more than the overlap gained: a Conformer's capture, whose 32 writes of 1-4 MiB
keep no thread waiting, took 12 ms longer when they were handed over; a GPT-2 model's, whose disk thread had been
busy writing and checksumming without a pause, 0.24 s less (the disk and zlib each waited for the other)."""
_WAKE_ITEMS: Final = 64
_WAKE_BYTES: Final = 16 << 20
"""The writer thread is woken once this many tensors or bytes are queued (or when the ring is full, or at drain)."""


_DISCARDED: Final = -1
"""The offset of a staged copy given back unwritten (:meth:`TensorStream.discard`)."""


def _no_crc(data: object, value: int = 0) -> int:
    return 0


def _bytes_of(array: np.ndarray) -> np.ndarray:
    """The bytes of a C-contiguous array as a flat uint8 array, without a copy."""
    return array.reshape(-1).view(np.uint8)


_BITS: Final = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _same_bits(copy: torch.Tensor, tensor: torch.Tensor) -> bool:
    """Whether ``copy`` (a tensor's bytes in C order, as uint8) holds ``tensor``'s exact bits: -0.0 is not 0.0, a
    NaN equals only the same NaN."""
    if tensor.is_contiguous():
        verdict = memory_equal(copy.numpy(), tensor.detach().reshape(-1).view(torch.uint8).numpy())
        if verdict is not None:
            return verdict
    if tensor.is_complex():
        tensor = torch.view_as_real(tensor)
    bits = _BITS[tensor.element_size()]
    return torch.equal(copy.view(bits).view(tensor.shape), tensor.detach().view(bits))


def ring_span(nbytes: int) -> int:
    """The ring space a staged copy of ``nbytes`` holds: whole BLOCKs, so every slot starts aligned for O_DIRECT."""
    return -(-nbytes // BLOCK) * BLOCK


def _address(data: np.ndarray) -> int:
    return int(data.__array_interface__["data"][0])


def _started(target: Callable[[], None], name: str) -> threading.Thread:
    """A daemon thread running ``target``, started (kept only once it runs: one that failed to start is never
    joined)."""
    thread = threading.Thread(target=target, name=name, daemon=True)
    thread.start()
    return thread


def _write_all(fd: int, data: np.ndarray, offset: int) -> None:
    view = data.data
    while view:
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written


class _Disk:
    """Puts bytes at file offsets: the aligned middle with O_DIRECT when possible, the rest buffered."""

    def __init__(self, fd: int, direct_fd: int | None) -> None:
        self._fd, self._direct_fd = fd, direct_fd
        self._bounce: np.ndarray | None = None  # page-aligned, for sources that are not aligned
        self._bounce_lock = threading.Lock()

    def put(self, data: np.ndarray, offset: int) -> None:
        start = -(-offset // BLOCK) * BLOCK
        end = (offset + data.size) // BLOCK * BLOCK
        direct_fd = self._direct_fd  # read once: a write on another thread may turn O_DIRECT off meanwhile
        if direct_fd is None or end - start < _DIRECT_FROM:
            _write_all(self._fd, data, offset)
            return
        head, middle, tail = data[: start - offset], data[start - offset : end - offset], data[end - offset :]
        _write_all(self._fd, head, offset)
        try:
            self._put_direct(middle, start, direct_fd)
        except OSError as err:
            if err.errno not in (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP):
                raise
            self._direct_fd = None  # the file system refuses O_DIRECT after all: buffered from now on
            _write_all(self._fd, middle, start)
        _write_all(self._fd, tail, end)

    def _put_direct(self, data: np.ndarray, offset: int, direct_fd: int) -> None:
        if _address(data) % BLOCK == 0:
            _write_all(direct_fd, data, offset)
            return
        with self._bounce_lock:
            if self._bounce is None:
                self._bounce = np.frombuffer(mmap.mmap(-1, _SLICE), dtype=np.uint8)
            for begin in range(0, data.size, _SLICE):
                piece = data[begin : begin + _SLICE]
                np.copyto(self._bounce[: piece.size], piece)
                _write_all(direct_fd, self._bounce[: piece.size], offset + begin)


@dataclass(frozen=True)
class Staged:
    """A tensor's bytes copied into the staging ring, not yet given a place in the file."""

    start: int
    nbytes: int
    event: torch.cuda.Event | None
    lap_start: int = 0
    """Where the copy starts on the ring's unrolled tape (every slice handed out laid end to end, a skipped tail
    included): the copy stays intact until the tape's head passes ``lap_start`` plus the ring's size."""


@dataclass
class _Snapshot:
    name: str
    offset: int
    start: int
    nbytes: int
    event: torch.cuda.Event | None


@dataclass
class _Stable:
    name: str
    offset: int
    data: np.ndarray
    tensor: torch.Tensor
    """Kept so that the memory being written stays allocated."""
    twice: bool = False
    """Checksum each slice again once written: one that changed meanwhile puts :attr:`name` in ``unsteady``."""
    done: int = 0
    """Bytes handed to the disk thread."""
    folded: int = 0
    """Bytes whose CRC-32 is folded into :attr:`crc` (slices are given back in order)."""
    crc: int = 0


@dataclass
class _Written:
    """Work the disk thread finished: its bytes are in the file (unless the stream failed), their CRC-32s still to
    be taken before it is given back, in the order it was handed out (the ring slots of a batch of snapshots, a
    slice of a stable tensor)."""

    slots: int
    names: list[str]
    """The snapshots' names, one per piece (a batch's)."""
    pieces: list[np.ndarray]
    sums: list[int | None]
    """One CRC-32 per piece; None for one still to be taken."""
    stable: _Stable | None = None
    """The tensor a slice is of, whose CRC-32 is its slices' folded together."""

    @property
    def summed(self) -> bool:
        return None not in self.sums


class TensorStream:
    """Write tensors' exact bytes at given offsets of an open file, in the background.

    Args:
        fd: a file descriptor open for writing (the stream does not close it).
        direct_fd: the same file opened with ``O_DIRECT``, if the file system allows it.
        staging_bytes: size of the staging ring; 0 writes everything synchronously.
        where: the file's name, for error messages.
        checksums: compute each tensor's CRC-32 (:attr:`checksums`) as its bytes are written.
    """

    def __init__(
        self,
        fd: int,
        *,
        direct_fd: int | None = None,
        staging_bytes: int = DEFAULT_STAGING_BYTES,
        where: str = "",
        checksums: bool = True,
    ) -> None:
        self._disk = _Disk(fd, direct_fd)
        self._capacity, self._where = staging_bytes, where
        self._crc = crc32 if checksums else _no_crc
        self._ring: torch.Tensor | None = None
        self._ring_bytes: np.ndarray | None = None
        self._head = 0  # end of the newest slice handed out
        self._tape_head = 0  # the same end on the unrolled tape (Staged.lap_start)
        self._in_use: collections.deque[tuple[int, int]] = collections.deque()  # (start, end), oldest first
        self._snapshots: collections.deque[_Snapshot] = collections.deque()
        self._stables: collections.deque[_Stable] = collections.deque()
        self._busy = 0  # work taken by the disk thread and not yet written
        self._written: collections.deque[_Written] = collections.deque()  # written, not given back; oldest first
        self._to_sum: collections.deque[_Written] = collections.deque()  # written, CRC-32s not taken by any thread
        self._checksums_on = checksums
        self._lock = threading.Condition()
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._summer: threading.Thread | None = None
        self._closing = False
        self._unannounced = 0  # items queued since the writer was last woken
        self._unannounced_bytes = 0
        self._unsubmitted = 0  # staged copies not yet submitted
        self.before_wait: Callable[[], None] | None = None
        """Called when the ring is full while copies staged and not yet submitted hold some of it: submits them."""
        self.checksums: dict[str, int] = {}
        """Name -> CRC-32 of the bytes written for it (the last write of a name wins)."""
        self.unsteady: set[str] = set()
        """Stable tensors written ``twice``-checked whose memory changed while a slice of it was written: the file may
        hold bytes other than those checksummed."""
        self._queued: collections.Counter[str] = collections.Counter()
        """Names with writes queued whose checksums are not recorded yet. Counted up on the caller's thread and down
        on any, so the caller's unlocked look can only see a write as still queued after it was recorded: a spare
        drain, never a missed one."""
        self._queued_stable: collections.Counter[str] = collections.Counter()
        """The same for writes of stable tensors."""

    # ------------------------------------------------------------------ main thread

    def write(self, offset: int, tensor: torch.Tensor, name: str = "") -> None:
        """Write ``tensor``'s bytes (C order) at ``offset``; its values are taken before this returns.

        The CRC-32 of the bytes lands in :attr:`checksums` under ``name`` once written.
        """
        self._raise_pending()
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes == 0 or not self.stages(tensor):
            self._after_queued(name, self._queued)  # written now: after what is queued for the name, not before
        if nbytes == 0:
            self.checksums[name] = self._crc(b"")
            return
        if not self.stages(tensor):  # written now, from its memory, while the caller waits
            array, _ = to_storage(tensor)
            data = _bytes_of(array)
            self._disk.put(data, offset)
            with self._lock:
                self.checksums[name] = self._crc(data.data)
            return
        self.submit(self.stage(tensor), offset, name)

    def stages(self, tensor: torch.Tensor) -> bool:
        """Whether :meth:`stage` takes ``tensor``: not empty and at most half the ring."""
        return 0 < tensor.numel() * tensor.element_size() <= self._capacity // 2

    def stage(self, tensor: torch.Tensor, keep: Staged | None = None) -> Staged:
        """Copy ``tensor`` (one :meth:`stages` takes) into the ring now; :meth:`submit` says later where it goes.
        ``keep``: an earlier copy the new one is to be compared with (:meth:`same_copies`), not to be overwritten
        by it where the ring has room elsewhere.

        Staged copies must be submitted in the order they were staged. When the ring is full of copies not yet
        submitted, :attr:`before_wait` is called to submit them (else they could never be written and freed).
        """
        self._raise_pending()
        nbytes = tensor.numel() * tensor.element_size()
        start = self._reserve(nbytes, pinned=tensor.is_cuda, keep=keep)
        assert self._ring is not None
        slot = self._ring[start : start + nbytes].view(tensor.dtype).view(tensor.shape)
        event = None
        if tensor.is_cuda and self._ring.is_pinned():
            slot.copy_(tensor.detach(), non_blocking=True)  # on the current stream of the tensor's device
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(torch.cuda.current_stream(tensor.device))
        else:
            slot.copy_(tensor.detach())
        self._unsubmitted += 1
        return Staged(start, nbytes, event, self._tape_head - (self._head - start))

    def holds(self, staged: Staged, tensor: torch.Tensor) -> bool:
        """Whether ``staged``'s copy is still in the ring (no later copy overwrote it) and holds ``tensor``'s exact
        bits: the proof that a tensor recorded again is unchanged, where its version counter misses edits through
        ``.data``, a NumPy or DLPack alias or an in-place collective. A tensor not in CPU memory is not compared."""
        if self._ring is None or staged.event is not None or not self.intact(staged):
            return False
        if tensor.device.type != "cpu" or tensor.is_conj() or tensor.is_neg() or tensor.layout != torch.strided:
            return False
        copy = self._ring[staged.start : staged.start + staged.nbytes]
        return staged.nbytes == tensor.numel() * tensor.element_size() and _same_bits(copy, tensor)

    def intact(self, staged: Staged) -> bool:
        """Whether no copy staged since overwrote ``staged``'s (the tape's head has not gone a ring further)."""
        return self._tape_head <= staged.lap_start + self._capacity

    def same_copies(self, earlier: Staged, later: Staged) -> bool:
        """Whether two staged copies, ``earlier`` still in the ring (no copy since overwrote it), hold the same bytes:
        the proof for a tensor not in CPU memory, whose copy is made before it can be compared. Waits for both copies
        (non-blocking ones from a GPU) to be done: the caller's thread waits for the GPU to reach the later copy."""
        if self._ring_bytes is None or earlier.nbytes != later.nbytes or not self.intact(earlier):
            return False
        for staged in (earlier, later):
            if staged.event is not None:
                staged.event.synchronize()
        first = self._ring_bytes[earlier.start : earlier.start + earlier.nbytes]
        return same_bytes(first, self._ring_bytes[later.start : later.start + later.nbytes])

    def submit(self, staged: Staged, offset: int, name: str = "") -> None:
        """Have a staged copy written at ``offset`` (its CRC-32 lands in :attr:`checksums` under ``name``)."""
        self._unsubmitted -= 1
        if offset != _DISCARDED:
            self._after_queued(name, self._queued_stable)  # snapshots go first: not before a stable write of the name
        snapshot = _Snapshot(name, offset, staged.start, staged.nbytes, staged.event)
        self._submit(lambda: self._enqueue_snapshot(snapshot), staged.nbytes)

    def _enqueue_snapshot(self, snapshot: _Snapshot) -> None:
        self._snapshots.append(snapshot)
        if snapshot.offset != _DISCARDED:
            self._queued[snapshot.name] += 1

    def discard(self, staged: Staged) -> None:
        """Give a staged copy's ring space back, in its turn, without writing it (its dataset could not be made)."""
        self.submit(staged, _DISCARDED)

    def write_stable(self, offset: int, tensor: torch.Tensor, name: str = "", *, twice: bool = False) -> None:
        """Write ``tensor``'s bytes at ``offset`` from its own memory, later; it must not change before :meth:`drain`.
        ``twice``: prove each slice unchanged while it was written (:attr:`unsteady`).

        Tensors not in plain CPU memory are snapshotted as :meth:`write` does.
        """
        self._raise_pending()
        if not self.writes_from_memory(tensor):
            self.write(offset, tensor, name)
            return
        array, _ = to_storage(tensor)
        if array.nbytes == 0:
            self._after_queued(name, self._queued)
            self.checksums[name] = self._crc(b"")
            return
        item = _Stable(name, offset, _bytes_of(array), tensor, twice)
        self._submit(lambda: self._enqueue_stable(item), array.nbytes)

    def _enqueue_stable(self, item: _Stable) -> None:
        self._stables.append(item)
        self._queued[item.name] += 1
        self._queued_stable[item.name] += 1

    def _after_queued(self, name: str, queued: collections.Counter[str]) -> None:
        """Drain first if ``queued`` holds a write of ``name`` that would otherwise land after the one coming."""
        if name in queued:
            self.drain()

    @staticmethod
    def writes_from_memory(tensor: torch.Tensor) -> bool:
        """Whether :meth:`write_stable` writes ``tensor`` from its own memory (else it stages a copy)."""
        return tensor.device.type == "cpu" and tensor.is_contiguous() and not tensor.is_conj() and not tensor.is_neg()

    def drain(self) -> None:
        """Wait until every queued write reached the OS and has its CRC-32; raise the first error. Checksums not
        yet taken are taken here too, on this thread beside the checksum thread."""
        while True:
            with self._lock:
                self._wake()
                if not (self._snapshots or self._stables or self._busy or self._written) or self._error is not None:
                    break
                if not self._to_sum:
                    self._lock.wait(timeout=0.5)
                    continue
            self._sum_next()
        self._raise_pending()

    def close(self) -> None:
        """Drain, stop the disk and checksum threads and free the ring."""
        try:
            self.drain()
        finally:
            threads = [thread for thread in (self._thread, self._summer) if thread is not None]
            if threads:
                with self._lock:
                    self._closing = True
                    self._lock.notify_all()
                for thread in threads:  # the disk thread first: it may still pass work to the checksum thread
                    thread.join()
                self._thread = self._summer = None  # a stream used again starts its threads again
                self._closing = False
            while self._sum_next():  # what a drain cut short left (an interrupt, an error): given back
                pass
            self._ring = self._ring_bytes = None  # its memory now, not whenever the stream is collected
            self._tape_head += self._capacity  # the copies went with the ring: none may prove a repeat any more
            self.before_wait = None  # usually a method of the stream's owner: no cycle left behind

    def _submit(self, enqueue: object, nbytes: int) -> None:
        if self._thread is None:
            self._thread = _started(self._run, "parity-bundle-writer")
        if self._summer is None and self._checksums_on and nbytes >= _SUM_APART_FROM:  # a write to hand over
            self._summer = _started(self._run_sums, "parity-bundle-checksums")
        with self._lock:
            enqueue()  # type: ignore[operator]
            self._unannounced += 1
            self._unannounced_bytes += nbytes
            if self._unannounced >= _WAKE_ITEMS or self._unannounced_bytes >= _WAKE_BYTES:
                self._wake()

    def _wake(self) -> None:
        """Tell the writer thread what was queued since it was last told (call holding the lock). Waking it for
        every small tensor cost more than the writes: each wake passes the GIL to it and back."""
        self._unannounced = self._unannounced_bytes = 0
        self._lock.notify_all()

    def _reserve(self, nbytes: int, *, pinned: bool, keep: Staged | None = None) -> int:
        """Space for ``nbytes`` in the ring, waiting for the writer to free some if needed (``keep``: see
        :meth:`stage`)."""
        if self._ring is None:
            pin = pinned and torch.cuda.is_available()
            memory = torch.empty(self._capacity + BLOCK, dtype=torch.uint8, pin_memory=pin)
            shift = -memory.data_ptr() % BLOCK  # slots start on BLOCK boundaries, ready for O_DIRECT
            self._ring = memory[shift : shift + self._capacity]
            self._ring_bytes = self._ring.numpy()
        need = ring_span(nbytes)
        while True:
            with self._lock:
                self._raise_pending()
                start = self._fit(need, keep)
                if start is not None:
                    self._in_use.append((start, start + need))
                    # on the tape, a slice at or after the head follows it; one before it starts the next lap
                    lap = self._tape_head - self._head + (self._capacity if start < self._head else 0)
                    self._head = start + need
                    self._tape_head = lap + self._head
                    return start
                unsubmitted, submit, summable = self._unsubmitted, self.before_wait, bool(self._to_sum)
                if not (summable or (unsubmitted and submit)):
                    self._wake()  # the ring is full of what the writer has not been told about yet
                    self._lock.wait(timeout=0.5)
                    continue
            if summable:  # the ring waits for checksums: take some here
                self._sum_next()
                continue
            assert submit is not None
            submit()  # outside the lock: the writer thread takes it to report what it wrote
            if self._unsubmitted >= unsubmitted:  # it could submit nothing: wait as above rather than spin
                with self._lock:
                    self._wake()
                    self._lock.wait(timeout=0.5)

    def _fit(self, need: int, keep: Staged | None = None) -> int | None:
        """Where ``need`` bytes fit after the newest slice without overrunning the oldest, if anywhere."""
        if not self._in_use:
            return self._restart(need, keep)
        oldest, newest_end = self._in_use[0][0], self._head
        if self._in_use[-1][0] >= oldest:  # not wrapped: free are [newest_end, capacity) and [0, oldest)
            if newest_end + need <= self._capacity:
                return newest_end
            return 0 if need <= oldest else None
        return newest_end if newest_end + need <= oldest else None  # wrapped: free is [newest_end, oldest)

    def _restart(self, need: int, keep: Staged | None) -> int:
        """Where a slice goes in an empty ring: at its start (the fewest pages touched, a small footprint for small
        models), unless ``keep`` is still intact and the head has room: going back to the start begins a lap of the
        tape, after which no earlier copy counts as intact."""
        keeping = keep is not None and self.intact(keep)
        return self._head if keeping and self._head + need <= self._capacity else 0

    def _raise_pending(self) -> None:
        if self._error is not None:
            raise BundleError(f"{self._where}: writing the bundle failed: {self._error}") from self._error

    # ------------------------------------------------------------------ writer thread

    def _next(self) -> list[_Snapshot] | tuple[_Stable, np.ndarray, int] | None:
        """The next work: the queued snapshots (they hold ring space), else a slice of a stable tensor."""
        with self._lock:
            while not (self._snapshots or self._stables or self._closing):
                self._lock.wait()
            if self._snapshots:  # at most a wake's worth: ring space comes back after each batch
                batch = [self._snapshots.popleft() for _ in range(min(len(self._snapshots), _WAKE_ITEMS))]
                self._busy += 1
                return batch
            if self._stables:
                item = self._stables[0]
                piece = item.data[item.done : item.done + _SLICE]
                offset = item.offset + item.done
                item.done += len(piece)
                if item.done >= len(item.data):
                    self._stables.popleft()
                self._busy += 1
                return item, piece, offset
            return None

    def _run(self) -> None:
        """The disk thread: writes the work handed out; the CRC-32s of large writes are left to the checksum thread,
        to be taken while the disk takes the next write (small writes are not worth passing on)."""
        while (work := self._next()) is not None:
            written = _Written(len(work), [], [], []) if isinstance(work, list) else _Written(0, [], [], [], work[0])
            try:
                if self._error is None:
                    # A slice of a tensor's own memory is summed before it is written: what a change made after the
                    # sum leaves in the file, the writer sees at commit (the sum then differs from the memory's).
                    before = None if isinstance(work, list) else self._crc(work[1].data)
                    self._put(work, written)
                    written.sums = [self._crc_now(piece) for piece in written.pieces] if before is None else [before]
                    if not isinstance(work, list) and work[0].twice and self._crc(work[1].data) != before:
                        self.unsteady.add(work[0].name)  # read by the writer once drained
            except BaseException as err:  # handed to the main thread
                self._error = err
            with self._lock:
                self._busy -= 1
                if self._error is not None:  # nothing more is written or summed: given back unrecorded
                    written.sums = [0] * len(written.pieces)
                self._written.append(written)
                if not written.summed:
                    self._to_sum.append(written)
                self._give_back()
                self._lock.notify_all()

    def _crc_now(self, piece: np.ndarray) -> int | None:
        """A written piece's CRC-32 taken now, or None to leave it to the checksum thread (a large write)."""
        return None if self._checksums_on and piece.size >= _SUM_APART_FROM else self._crc(piece.data)

    def _put(self, work: list[_Snapshot] | tuple[_Stable, np.ndarray, int], written: _Written) -> None:
        if isinstance(work, list):
            assert self._ring_bytes is not None
            for snapshot in work:
                if snapshot.event is not None:
                    snapshot.event.synchronize()
                if snapshot.offset == _DISCARDED:
                    continue
                data = self._ring_bytes[snapshot.start : snapshot.start + snapshot.nbytes]
                self._disk.put(data, snapshot.offset)
                written.names.append(snapshot.name)
                written.pieces.append(data)
            return
        _, piece, offset = work
        self._disk.put(piece, offset)
        written.pieces.append(piece)

    def _run_sums(self) -> None:
        """The checksum thread: takes the CRC-32s of written work, oldest first, until the stream closes."""
        while True:
            with self._lock:
                while not (self._to_sum or self._closing):
                    self._lock.wait()
                if not self._to_sum:
                    return
            self._sum_next()

    def _sum_next(self) -> bool:
        """Take the CRC-32s of the oldest written work waiting for them, if any, outside the lock (each CRC-32
        implementation releases the GIL), then give back what is done; whether there was any. Work taken by a caller
        whose thread is interrupted (Ctrl-C) goes back to the queue, for another thread."""
        written = None
        try:
            with self._lock:
                if not self._to_sum:
                    return False
                written = self._to_sum.popleft()
            pairs = zip(written.pieces, written.sums, strict=True)
            sums: list[int | None] = [self._crc(piece.data) if crc is None else crc for piece, crc in pairs]
        except Exception as err:  # handed to the caller; the work is given back unrecorded
            self._error = self._error or err
            sums = [] if written is None else [0] * len(written.pieces)
        except BaseException:
            if written is not None:
                with self._lock:
                    self._to_sum.appendleft(written)
                    self._lock.notify_all()
            raise
        if written is None:
            return False
        with self._lock:
            written.sums = sums
            self._give_back()
            self._lock.notify_all()
        return True

    def _give_back(self) -> None:
        """Give back the written work whose checksums are taken, in the order it was handed out: its ring slots,
        its CRC-32s, each stable tensor's slices folded into one (call holding the lock). Once the stream failed,
        no checksum is recorded: some of its bytes may not be in the file."""
        while self._written and self._written[0].summed:
            written = self._written.popleft()
            for _ in range(written.slots):
                self._in_use.popleft()
            if self._error is not None:
                continue
            try:
                self._record(written)
            except Exception as err:  # handed to the caller, not lost with a background thread
                self._error = err

    def _record(self, written: _Written) -> None:
        item, sums = written.stable, cast(list[int], written.sums)
        if item is None:
            self.checksums.update(zip(written.names, sums, strict=True))
            for name in written.names:
                _count_down(self._queued, name)
            return
        for piece, crc in zip(written.pieces, sums, strict=True):
            item.crc = crc32_combine(item.crc, crc, piece.size) if item.folded and self._checksums_on else crc
            item.folded += piece.size
        if item.folded == len(item.data):
            self.checksums[item.name] = item.crc
            _count_down(self._queued, item.name)
            _count_down(self._queued_stable, item.name)


def _count_down(counter: collections.Counter[str], name: str) -> None:
    if counter[name] > 1:
        counter[name] -= 1
    else:
        del counter[name]
