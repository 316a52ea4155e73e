"""Layering: capture and common import without click, tabulate or pytest; the packages are ours."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import ROOT

BLOCKED = ("click", "tabulate", "pytest")


@pytest.mark.parametrize(
    "modules",
    [
        ["common"],
        ["capture"],
        [
            "capture.recorder",
            "capture.hooks",
            "capture.writer",
            "capture.adapters",
            "capture.driving",
            "capture.training",
            "capture.checkpoints",
            "capture.noise",
        ],
    ],
    ids=["common", "capture", "capture-internals"],
)
def test_capture_side_needs_no_cli_or_test_packages(modules: list[str]) -> None:
    """capture/ and common/ import with click, tabulate and pytest made unimportable."""
    block = "; ".join(f"sys.modules[{name!r}] = None" for name in BLOCKED)
    imports = "; ".join(f"import {module}" for module in modules)
    code = f"import sys; {block}; {imports}; print('ok')"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


@pytest.mark.parametrize("package", ["common", "capture", "replay"])
def test_top_level_packages_resolve_to_this_project(package: str) -> None:
    """`common`, `capture` and `replay` are this project's, not another distribution's same-named package."""
    module = __import__(package)
    assert module.__file__ is not None
    assert (ROOT / package) in __import__("pathlib").Path(module.__file__).resolve().parents
