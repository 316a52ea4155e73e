"""parity-harness common layer: the bundle format, tensor metrics, tolerances and errors.

Imports only the standard library, NumPy, h5py, msgpack (and torch, in ``common.dtypes``).
"""

from __future__ import annotations

from common.errors import (
    AdapterError,
    BundleError,
    BundleExistsError,
    BundleFormatError,
    BundleNotFoundError,
    CheckpointError,
    InputError,
    MapFileError,
    ParityError,
    ParityMismatch,
    UnsupportedBundleVersion,
)
from common.metrics import TensorDiff, diff_arrays
from common.tolerances import Tolerance, ToleranceTable
from common.version import FORMAT_MINOR, FORMAT_NAME, FORMAT_VERSION

__all__ = [
    "FORMAT_MINOR",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "AdapterError",
    "BundleError",
    "BundleExistsError",
    "BundleFormatError",
    "BundleNotFoundError",
    "CheckpointError",
    "InputError",
    "MapFileError",
    "ParityError",
    "ParityMismatch",
    "TensorDiff",
    "Tolerance",
    "ToleranceTable",
    "UnsupportedBundleVersion",
    "diff_arrays",
]

__version__ = "0.1.0"
