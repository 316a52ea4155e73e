"""Bundle format identity and the version gate that runs before anything else is read."""

from __future__ import annotations

from typing import Final

from parity_harness.common.format.gate import FormatGate, parse_format_version

__all__ = [
    "BUNDLE_GATE",
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
FORMAT_MINOR: Final = 6
"""Minor version: bumped when fields are only added; older readers warn and go on."""


BUNDLE_GATE: Final = FormatGate(
    FORMAT_NAME,
    FORMAT_VERSION,
    FORMAT_MINOR,
    noun="bundle",
    writer="capture-run",
    instead=(
        (
            "parity-harness-training",
            (
                "it is a training run (capture-run --steps): rerun a port on it with replay-compare --steps, or "
                "compare two runs with parity-train-diff"
            ),
        ),
    ),
)


def check_compatible(name: object, major: int, minor: int, *, where: str) -> None:
    """Refuse a file that is not a bundle or whose major version this reader does not know.

    Raises:
        BundleFormatError: ``name`` is not :data:`FORMAT_NAME`.
        UnsupportedBundleVersion: ``major`` is newer than :data:`FORMAT_VERSION`, or not positive.
    """
    BUNDLE_GATE.check(name, major, minor, where=where, stacklevel=3)


HARNESS_VERSION: Final = "0.1.0"
"""Version of parity-harness itself, recorded in every bundle's provenance."""
