"""What every reader does with an HDF5 error on a damaged file: one ``BundleFormatError`` naming the file
and the place, never h5py's own exception."""

from __future__ import annotations

import os
from types import TracebackType

from parity_harness.common.errors import BundleFormatError, ParityError

__all__ = ["damage_guard"]

_DAMAGE = (OSError, RuntimeError, KeyError, ValueError, TypeError, IndexError, OverflowError)
"""What h5py and HDF5 raise on damaged bytes (a ParityError already says what is wrong and passes through)."""


class damage_guard:  # named as the function it replaced: ``with damage_guard(...)``
    """Turn whatever h5py or HDF5 raises inside the block into one BundleFormatError naming the file.

    A class, not a generator: a replay enters one for every record it reads (a generator-based guard cost ~2 us
    each).
    """

    __slots__ = ("_fix", "_noun", "_path", "_where")

    def __init__(
        self, path: str | os.PathLike[str], where: str, *, noun: str = "file", fix: str = "copy or capture it again"
    ) -> None:
        self._path, self._where, self._noun, self._fix = path, where, noun, fix

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, err: BaseException | None, tb: TracebackType | None) -> None:
        if err is None or isinstance(err, ParityError) or not isinstance(err, _DAMAGE):
            return
        message = str(err).replace("\n", " ")[:200]
        raise BundleFormatError(
            f"{self._path}:{self._where}: the {self._noun} is damaged ({type(err).__name__}: {message}); {self._fix}"
        ) from err
