"""The one exception hierarchy of parity-harness.

Every error a user can cause (bad flag, missing file, damaged bundle, unloadable model) is a
``ParityError``; the CLIs turn it into one line on stderr and exit code 2. Subclasses also inherit
the matching builtin so callers can catch ``FileNotFoundError`` or ``ValueError`` as usual.
"""

from __future__ import annotations

__all__ = [
    "AdapterError",
    "BundleChangedError",
    "BundleError",
    "BundleExistsError",
    "BundleFormatError",
    "BundleNotFoundError",
    "CaptureError",
    "CheckpointError",
    "DistributedError",
    "InputError",
    "MapFileError",
    "ParityError",
    "ParityMismatch",
    "UnsupportedBundleVersion",
]


class ParityError(Exception):
    """Base class of every error raised on purpose by parity-harness."""


class BundleError(ParityError):
    """A bundle cannot be written or read."""


class BundleNotFoundError(BundleError, FileNotFoundError):
    """The bundle path does not exist."""


class BundleExistsError(BundleError, FileExistsError):
    """The output path exists and overwriting was not asked for."""


class BundleFormatError(BundleError, ValueError):
    """The file is not a bundle, or a part of it is missing or damaged."""


class BundleChangedError(BundleFormatError):
    """The file changed while it was checked or opened (another process writes or replaces it): running again may
    succeed."""


class UnsupportedBundleVersion(BundleFormatError):
    """The bundle was written by a newer, incompatible format version."""


class AdapterError(ParityError, ValueError):
    """An adapter, model factory or ``--inputs`` file cannot be loaded or used."""


class CheckpointError(ParityError, ValueError):
    """A checkpoint cannot be loaded safely."""


class InputError(ParityError, ValueError):
    """A value given by the user (inputs, tolerances, options) is invalid."""


class MapFileError(InputError):
    """A ``--map`` rename file has a bad line."""


class CaptureError(ParityError):
    """Recording a run went wrong in a way that is not the model's fault (the observer check failed)."""


class DistributedError(ParityError):
    """A rank of a distributed capture or replay failed, or ranks do not fit together."""


class ParityMismatch(AssertionError):
    """Raised by assertion helpers when the port does not match the reference."""
