"""parity-harness common layer: the bundle format, tensor metrics, tolerances and errors.

Imports only the standard library, NumPy, h5py, msgpack (and torch, in ``parity_harness.common.format.dtypes``).
Importing this package itself needs none of them: the metrics and tolerances load when first named, so that
stdlib-only modules (``capture.record.predictions``) can raise this project's errors.
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

TYPE_CHECKING = False
if TYPE_CHECKING:
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

_LAZY = {
    "TensorDiff": "parity_harness.common.numerics.metrics",
    "diff_arrays": "parity_harness.common.numerics.metrics",
    "Tolerance": "parity_harness.common.numerics.tolerances",
    "ToleranceTable": "parity_harness.common.numerics.tolerances",
}


def __getattr__(name: str) -> object:
    """The NumPy-backed names, imported when first asked for."""
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_LAZY[name]), name)
