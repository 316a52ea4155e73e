"""What every reader does with an HDF5 error on a damaged file: one ``BundleFormatError`` naming the file
and the place, never h5py's own exception."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

from parity_harness.common.errors import BundleFormatError, ParityError

__all__ = ["damage_guard"]

_DAMAGE = (OSError, RuntimeError, KeyError, ValueError, TypeError, IndexError, OverflowError)
"""What h5py and HDF5 raise on damaged bytes (a ParityError already says what is wrong and passes through)."""


@contextmanager
def damage_guard(
    path: str | os.PathLike[str], where: str, *, noun: str = "file", fix: str = "copy or capture it again"
) -> Iterator[None]:
    """Turn whatever h5py or HDF5 raises inside the block into one BundleFormatError naming the file."""
    try:
        yield
    except ParityError:
        raise
    except _DAMAGE as err:
        message = str(err).replace("\n", " ")[:200]
        raise BundleFormatError(
            f"{path}:{where}: the {noun} is damaged ({type(err).__name__}: {message}); {fix}"
        ) from err
