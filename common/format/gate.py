"""The version gate every format passes before anything else is read: the format's name, then its major
version (a newer or unknown one refused, naming both versions and the fix), then its minor (a newer one
read with a warning, since minors only add fields)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass

from parity_harness.common.errors import BundleFormatError, UnsupportedBundleVersion
from parity_harness.common.format.preview import shown

__all__ = ["FormatGate", "parse_format_version"]


def parse_format_version(value: object, *, where: str) -> int:
    """Return a stored version attribute as a non-negative int, or raise ``BundleFormatError``."""
    if isinstance(value, bool):
        raise BundleFormatError(f"{where}: version attribute is {shown(value)}, expected an integer")
    try:
        number: int = int(value)  # type: ignore[call-overload]
    except (TypeError, ValueError, OverflowError) as err:
        raise BundleFormatError(f"{where}: version attribute is {shown(value)}, expected an integer") from err
    if number < 0 or number != value:
        raise BundleFormatError(f"{where}: version attribute is {shown(value)}, expected a non-negative integer")
    return number


@dataclass(frozen=True)
class FormatGate:
    """A versioned file format as its reader sees it: the name and newest version it reads, and how it is called.

    The bundle, the training file and the manifest share this gate, so both refuse and warn in the same words.
    """

    name: str
    major: int
    minor: int
    noun: str
    """What messages call the file (``"bundle"``, ``"training file"``)."""
    writer: str
    """What writes it, named in the hint when another file is passed (``"capture-run"``)."""
    format_field: str = "root attribute 'format'"
    """Where the format name is stored, as messages name it."""
    instead: tuple[tuple[str, str], ...] = ()
    """(another format's name, what to do with such a file): a training file given where a bundle is read says to
    add ``--steps``, rather than to pass a file written by capture-run, which it is."""

    def check(self, name: object, major: int, minor: int, *, where: str, stacklevel: int = 2) -> None:
        """Refuse a file of another format or of a major version this reader does not know; warn on a newer minor.

        Raises:
            BundleFormatError: ``name`` is not :attr:`name`.
            UnsupportedBundleVersion: ``major`` is newer than :attr:`major`, or not positive.
        """
        if name != self.name:
            fix = next((hint for other, hint in self.instead if name == other), f"pass a file written by {self.writer}")
            raise BundleFormatError(
                f"{where}: not a parity-harness {self.noun} ({self.format_field} is {shown(name)}, "
                f"expected {self.name!r}); {fix}"
            )
        if major > self.major or major < 1:
            raise UnsupportedBundleVersion(
                f"{where}: {self.noun} format version {major}.{minor} is not supported by this reader "
                f"(it reads up to {self.major}.x); upgrade parity-harness in this environment"
            )
        if major == self.major and minor > self.minor:
            warnings.warn(
                f"{where}: {self.noun} format {major}.{minor} is newer than this reader's "
                f"{self.major}.{self.minor}; fields added since are ignored",
                stacklevel=stacklevel,
            )
