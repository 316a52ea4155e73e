"""Values read from a file, as error messages show them: short whatever the value.

A crafted file can put a value megabytes long, or nested deeper than ``repr`` can go (``RecursionError``), where
a message quotes it; a message must stay one short line. :func:`shown` is ``repr`` cut in depth, items and
characters.
"""

from __future__ import annotations

import reprlib
from typing import Final

__all__ = ["SHOWN_CHARACTERS", "clipped", "first_names", "printable", "shown"]

SHOWN_CHARACTERS: Final = 120
"""The most characters :func:`shown` returns (and an ellipsis)."""


def _preview() -> reprlib.Repr:
    limits = reprlib.Repr()  # Python 3.11's takes no limits as arguments
    limits.maxlevel, limits.maxtuple, limits.maxlist, limits.maxdict, limits.maxset = 3, 6, 6, 6, 6
    limits.maxstring, limits.maxlong, limits.maxother = 60, 40, 60
    return limits


_PREVIEW: Final = _preview()


def shown(value: object) -> str:
    """A short repr of ``value`` for a message: at most three levels deep, six items a container, 60 characters a
    string and :data:`SHOWN_CHARACTERS` in all."""
    return clipped(_PREVIEW.repr(value))


def first_names(names: list[str], limit: int = 5) -> str:
    """The first few of ``names`` and how many more there are."""
    return ", ".join(names[:limit]) + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")


def printable(value: object) -> str:
    """Text from a bundle, shown as is but for control characters (escaped): a crafted name or provenance string
    cannot start a line of its own (a forged ``RESULT: MATCH``) or drive the terminal."""
    text = str(value)
    return text if text.isprintable() else "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def clipped(text: str) -> str:
    """``text`` (a name from a file, quoted as it is) cut to :data:`SHOWN_CHARACTERS`."""
    return text if len(text) <= SHOWN_CHARACTERS else text[:SHOWN_CHARACTERS] + "..."
