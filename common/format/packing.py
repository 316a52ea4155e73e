"""msgpack encoding of a bundle's structural metadata: plain types only, never pickle or ext types."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final

import msgpack
import numpy as np

from parity_harness.common.errors import BundleFormatError

__all__ = ["MAX_INDEX_BYTES", "pack", "unpack"]

MAX_INDEX_BYTES: Final = 48 << 20
"""Refuse metadata blobs over 48 MiB. A crafted blob of short map keys or strings decodes to up to ~34 bytes of
Python objects per byte at its peak (a 3-character key and its value: 5 bytes, ~170 in a dict), so this bounds
what a bundle from someone else can make the reader allocate to about 1.6 GiB. Real indexes take ~190 bytes per
tensor and decode to 4-8x their size (the Conformer example's 478 tensors: 88 KB): 48 MiB holds some 260,000
tensors."""


_PLAIN: Final = (str, bytes, int, float, bool, type(None))
_LEAVES: Final = frozenset(_PLAIN)
"""The exact types of plain values, told apart in C from containers (and from anything else)."""


def _check_plain(obj: object, where: str) -> None:
    """Refuse anything but plain data (msgpack itself packs ext types and Timestamps)."""
    pending = [obj]
    while pending:
        item = pending.pop()
        groups: tuple[Iterable[object], ...]
        if isinstance(item, dict):
            groups = (item.keys(), item.values())
        elif isinstance(item, (list, tuple)) and type(item) in (list, tuple):  # msgpack.ExtType is a namedtuple
            groups = (item,)
        elif isinstance(item, _PLAIN):  # a subclass of a plain type (an IntEnum)
            continue
        else:
            raise BundleFormatError(f"{where}: metadata holds a {type(item).__name__}, not plain msgpack data")
        for group in groups:
            # An index holds several plain values for each container: told apart by their types in C, so that only
            # containers (and values of other types) take a step of this loop.
            if not _LEAVES.issuperset(map(type, group)):
                pending.extend(child for child in group if type(child) not in _LEAVES)


def pack(obj: object, *, smaller: str = "record less") -> np.ndarray:
    """Encode plain data (dict, list, str, bytes, int, float, bool, None) as a uint8 array; ``smaller`` says how the
    writer can make metadata too large for any reader smaller."""
    _check_plain(obj, "pack")
    try:
        raw = msgpack.packb(obj, use_bin_type=True, strict_types=False)
    except (TypeError, ValueError, OverflowError) as err:
        raise BundleFormatError(f"metadata is not plain msgpack data: {err}") from err
    if len(raw) > MAX_INDEX_BYTES:  # else written whole and refused by every reader: a run that cannot be replayed
        raise BundleFormatError(
            f"metadata of {len(raw)} bytes exceeds the {MAX_INDEX_BYTES}-byte limit readers accept; {smaller}"
        )
    return np.frombuffer(raw, dtype=np.uint8)


_BYTES_PER_CONTAINER: Final = 8
"""A list or map decodes to ~60 bytes of Python objects from 1 byte of msgpack: at most one per this many bytes
keeps the decoded index within ~8x its size (measured indexes hold one per 36 to 77 bytes)."""


class _OverBudget(Exception):
    pass


class _ContainerBudget:
    """Counts the lists and maps msgpack builds, and stops it past ``limit``."""

    def __init__(self, limit: int) -> None:
        self.limit, self.count = limit, 0

    def take(self, container: object) -> object:
        """msgpack's hook for each finished list or map: count it, hand it back unchanged."""
        self.count += 1
        if self.count > self.limit:
            raise _OverBudget
        return container


def _refuse_ext(code: int, data: bytes) -> object:
    raise ValueError(f"msgpack ext type {code} is not allowed in a bundle")


def _described(err: Exception) -> str:
    """msgpack's complaint, with an ext type refused by its size (``max_ext_len`` 0: a Timestamp too, which msgpack
    decodes without the ext hook) named as such."""
    text = str(err)
    if "max_ext_len" in text or "imestamp" in text:
        return f"ext types are not allowed in a bundle ({text})"
    return text


def unpack(blob: np.ndarray | bytes, *, where: str) -> object:
    """Decode a blob written by :func:`pack`; any damage raises ``BundleFormatError`` naming ``where``."""
    raw = blob.tobytes() if isinstance(blob, np.ndarray) else bytes(blob)
    if len(raw) > MAX_INDEX_BYTES:
        raise BundleFormatError(f"{where}: metadata of {len(raw)} bytes exceeds the {MAX_INDEX_BYTES}-byte limit")
    budget = _ContainerBudget(len(raw) // _BYTES_PER_CONTAINER + 64)
    try:
        document = msgpack.unpackb(
            raw,
            raw=False,
            strict_map_key=False,
            use_list=True,
            ext_hook=_refuse_ext,
            max_ext_len=0,  # every ext type refused while decoding: the output is plain data by construction
            list_hook=budget.take,
            object_hook=budget.take,
        )
    except _OverBudget:
        raise BundleFormatError(
            f"{where}: metadata of {len(raw)} bytes holds more than {budget.limit} lists and maps (one per "
            f"{_BYTES_PER_CONTAINER} bytes at most; a real index has one per 30 or more): crafted to fill memory"
        ) from None
    except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as err:
        reason = f"{type(err).__name__}: {_described(err)}"
        raise BundleFormatError(f"{where}: metadata is not valid msgpack ({reason})") from err
    return document
