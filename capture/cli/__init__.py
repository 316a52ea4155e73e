"""Command-line shells (the only click users on the capture side): capture-run and the helpers every CLI shares.

Importing this package first checks that what the commands need is installed. A ``--no-deps`` install
puts every command on PATH; one whose dependencies are missing says in one line what to install and
exits 2, instead of ending in an import traceback with exit 1 (the code for "mismatch").
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Callable, Sequence
from typing import Final

__all__ = ["CAPTURE_NEEDS", "COMMANDS", "exit_unless_installed", "missing_modules"]

CAPTURE_NEEDS: Final = ("torch", "numpy", "h5py", "msgpack", "click")
"""What capture-run imports besides the standard library (the capture-only install's list)."""
COMMANDS: Final = ("capture-run", "replay-compare", "parity-train-diff", "ckpt-diff")


def _installed(name: str) -> bool:
    if name in sys.modules:
        return sys.modules[name] is not None
    return importlib.util.find_spec(name) is not None


def missing_modules(names: Sequence[str]) -> list[str]:
    """The top-level modules of ``names`` that this interpreter cannot import (found without importing)."""
    return [name for name in names if not _installed(name)]


def _program() -> str:
    name = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    return name if name in COMMANDS else "parity-harness"


def exit_unless_installed(needs: Sequence[str], fix: Callable[[list[str]], str]) -> None:
    """Print ``PROGRAM: error: ...`` naming the missing modules and ``fix(missing)``, and exit 2, if any is missing."""
    missing = missing_modules(needs)
    if missing:
        program = _program()
        sys.stderr.write(
            f"{program}: error: {', '.join(missing)} not installed for {sys.executable}, and {program} needs "
            f"{'them' if len(missing) > 1 else 'it'}: {fix(missing)}\n"
        )
        sys.exit(2)


def _capture_fix(missing: list[str]) -> str:
    return f"pip install {' '.join(missing)} (or the whole package: pip install parity-harness)"


exit_unless_installed(CAPTURE_NEEDS, _capture_fix)
