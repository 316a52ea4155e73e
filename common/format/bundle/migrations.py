"""Migrations of the bundle index between format versions: pure ``dict -> dict`` functions.

The reader applies them once, right after decoding, so nothing else in the code base branches on
the format version. Version 1 is the first version; there is nothing to migrate yet.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

from parity_harness.common.errors import UnsupportedBundleVersion
from parity_harness.common.format.bundle.version import FORMAT_VERSION

__all__ = ["MIGRATIONS", "migrate"]

Migration = Callable[[object], object]
MIGRATIONS: Final[dict[int, Migration]] = {}
"""``MIGRATIONS[n]`` turns a version-``n`` index into a version-``n + 1`` index."""


def migrate(document: object, version: int) -> object:
    """Bring an index written at ``version`` up to :data:`FORMAT_VERSION`."""
    while version < FORMAT_VERSION:
        step = MIGRATIONS.get(version)
        if step is None:
            raise UnsupportedBundleVersion(
                f"bundle format version {version} cannot be migrated to {FORMAT_VERSION}: no migration is known"
            )
        document, version = step(document), version + 1
    return document
