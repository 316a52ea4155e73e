"""parity-harness common layer: the bundle format, tensor metrics, tolerances and errors.

Imports only the standard library, NumPy, h5py, msgpack (and torch, in ``parity_harness.common.format.dtypes``).
"""

from __future__ import annotations

from parity_harness.common.errors import (
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
from parity_harness.common.format.bundle.version import FORMAT_MINOR, FORMAT_NAME, FORMAT_VERSION
from parity_harness.common.numerics.metrics import TensorDiff, diff_arrays
from parity_harness.common.numerics.tolerances import Tolerance, ToleranceTable

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
