"""zlib's CRC-32, from ISA-L where it is installed.

Every checksum a bundle holds is zlib's CRC-32 (``zlib.crc32``: anyone can recompute it without this project).
The standard library's zlib computes it at about 2.2 GB/s on one core of this project's VM, and a bundle's
CRC-32s are a large part of what capture and a differing replay cost: 0.8 s of a core for GPT-2's 1.75 GB, 2.5 s
for a FastConformer's 4.2 GB. ISA-L (``pip install isal``, or ``pip install parity-harness[fast]``) computes the
same checksum with carry-less multiplication at 12-18 GB/s. Where it is importable it is used, after it gave
zlib's value on a probe at import; the bundle format does not change, and a bundle checksummed by one
implementation verifies with the other.

``PARITY_HARNESS_CRC32=zlib`` keeps the standard library's (to measure the difference, or to rule the accelerator
out when a checksum disagrees).
"""

from __future__ import annotations

import importlib
import os
import warnings
import zlib
from collections.abc import Callable
from typing import Final

__all__ = ["CRC32_IMPLEMENTATION", "crc32"]

ACCELERATOR: Final = "isal.isal_zlib"
"""The module whose ``crc32`` is used where importable (ISA-L's, through python-isal)."""
_ENVIRONMENT: Final = "PARITY_HARNESS_CRC32"
_NAMES: Final = ("isal", "zlib")

Crc32 = Callable[..., int]
"""``crc32(data, value=0) -> int``: data is any C-contiguous buffer; value the CRC-32 of the bytes before it."""


def _probe() -> list[tuple[memoryview, int]]:
    """Inputs whose CRC-32 an implementation must agree with zlib's on: lengths around the block sizes fast
    implementations switch at, up to past a MiB (where they change algorithm again), starting at unaligned
    addresses, with a running value carried in."""
    pattern = memoryview(bytes(range(251)) * 4200)  # a prime period: no block lines up with it
    lengths = (0, 1, 15, 16, 63, 64, 255, 256, 4095, 4096, 10240, (1 << 20) + 7)
    starts = ((0, 0), (3, 0x9E3779B9))
    return [(pattern[offset : offset + length], start) for length in lengths for offset, start in starts]


def _agrees(candidate: Crc32) -> bool:
    try:
        return all(candidate(data, start) == zlib.crc32(data, start) for data, start in _probe())
    except Exception:  # a broken accelerator is one we do not use
        return False


def _choose(wanted: str | None) -> tuple[str, Crc32]:
    """ISA-L's CRC-32 if importable and agreeing with zlib, unless ``wanted`` is "zlib"; else zlib's."""
    if wanted not in (None, *_NAMES):
        warnings.warn(
            f"{_ENVIRONMENT}={wanted!r} names no CRC-32 implementation (expected {' or '.join(_NAMES)}); "
            "using the fastest one available",
            stacklevel=2,
        )
    if wanted != "zlib":
        try:
            candidate: Crc32 = importlib.import_module(ACCELERATOR).crc32
        except Exception:  # not installed, or a build that fails to load: zlib's serves
            return "zlib", zlib.crc32
        if _agrees(candidate):
            return "isal", candidate
    return "zlib", zlib.crc32


CRC32_IMPLEMENTATION, crc32 = _choose(os.environ.get(_ENVIRONMENT) or None)
"""Which implementation ``crc32`` is ("isal" or "zlib"), and the function itself."""
