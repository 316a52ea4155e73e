"""Bundle format identity and the version gate that runs before anything else is read."""

from __future__ import annotations

import warnings
from typing import Final

from parity_harness.common.errors import BundleFormatError, UnsupportedBundleVersion

__all__ = [
    "FORMAT_MINOR",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "HARNESS_VERSION",
    "check_compatible",
    "parse_format_version",
]

FORMAT_NAME: Final = "parity-harness-bundle"
FORMAT_VERSION: Final = 1
"""Major version: bumped when a reader of the previous major could misread a bundle."""
FORMAT_MINOR: Final = 2
"""Minor version: bumped when fields are only added; older readers warn and go on."""


def parse_format_version(value: object, *, where: str) -> int:
    """Return a stored version attribute as a non-negative int, or raise ``BundleFormatError``."""
    if isinstance(value, bool):
        raise BundleFormatError(f"{where}: version attribute is {value!r}, expected an integer")
    try:
        number: int = int(value)  # type: ignore[call-overload]
    except (TypeError, ValueError, OverflowError) as err:
        raise BundleFormatError(f"{where}: version attribute is {value!r}, expected an integer") from err
    if number < 0 or number != value:
        raise BundleFormatError(f"{where}: version attribute is {value!r}, expected a non-negative integer")
    return number


def check_compatible(name: object, major: int, minor: int, *, where: str) -> None:
    """Refuse a file that is not a bundle or whose major version this reader does not know.

    Raises:
        BundleFormatError: ``name`` is not :data:`FORMAT_NAME`.
        UnsupportedBundleVersion: ``major`` is newer than :data:`FORMAT_VERSION`, or not positive.
    """
    if name != FORMAT_NAME:
        raise BundleFormatError(
            f"{where}: not a parity-harness bundle (root attribute 'format' is {name!r}, "
            f"expected {FORMAT_NAME!r}); pass a file written by capture-run"
        )
    if major > FORMAT_VERSION or major < 1:
        raise UnsupportedBundleVersion(
            f"{where}: bundle format version {major}.{minor} is not supported by this reader "
            f"(it reads up to {FORMAT_VERSION}.x); upgrade parity-harness in this environment"
        )
    if major == FORMAT_VERSION and minor > FORMAT_MINOR:
        warnings.warn(
            f"{where}: bundle format {major}.{minor} is newer than this reader's "
            f"{FORMAT_VERSION}.{FORMAT_MINOR}; fields added since are ignored",
            stacklevel=2,
        )


HARNESS_VERSION: Final = "0.1.0"
"""Version of parity-harness itself, recorded in every bundle's provenance."""
