"""The measuring scripts keep working: the README's cost figures come from them, so a script broken by a change
elsewhere (an option it no longer passes, a function it times that moved) must fail here, not in a user's hands."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT


def _run(script: str, *arguments: str) -> str:
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / script), *arguments],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.mark.slow
def test_bench_prints_each_step_beside_its_target(tmp_path: Path) -> None:
    out = _run(
        "bench.py",
        "--model",
        "conformer",
        "--no-commands",
        "--repeat",
        "1",
        "--steps",
        "replay",
        "--dir",
        str(tmp_path),
    )
    assert "CRC-32 by " in out
    for line in ("bare forward + backward", "capture_run ", "compare_run, exact"):
        assert line in out, out
    for target in ("<= 2x: ", "<= 2.5x: "):  # the Conformer's capture and replay targets, met or not
        assert target in out, out


@pytest.mark.slow
def test_bench_phases_splits_both_commands_into_phases(tmp_path: Path) -> None:
    out = _run("bench_phases.py", "--model", "conformer", "--rounds", "1", "--dir", str(tmp_path))
    phases = ("capture-run: ", "replay-compare: ", "import torch", "dataset creation (HDF5)", "comparing records")
    for phase in (*phases, "checksums (CRC-32)"):
        assert phase in out, out
