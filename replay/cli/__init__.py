"""Command-line shells (the only click users on the replay side): parse, one library call, render, exit code.

Importing this package first checks the replay side's own dependencies: the capture-only install
(``pip install --no-deps parity-harness`` plus h5py, msgpack and click) leaves replay-compare, ckpt-diff
and parity-train-diff on PATH, and they then say in one line what to install and exit 2.
"""

from __future__ import annotations

from typing import Final

from parity_harness.capture.cli import CAPTURE_NEEDS, exit_unless_installed

__all__ = ["REPLAY_NEEDS"]

REPLAY_NEEDS: Final = (*CAPTURE_NEEDS, "tabulate")
"""What the replay commands import besides the standard library (the package's dependencies)."""


def _full_install(missing: list[str]) -> str:
    full = "pip install parity-harness (with its dependencies, i.e. without --no-deps)"
    if "tabulate" in missing and len(missing) == 1:
        return f"this is the capture-only install, where only capture-run works; to compare here: {full}"
    return full


exit_unless_installed(REPLAY_NEEDS, _full_install)
