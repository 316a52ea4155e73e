"""Capture and replay in separate processes, as in two environments: an exact match, every kind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REF_ADAPTER, ROOT

CAPTURE = "from parity_harness.capture.cli.capture_run import main; main()"
REPLAY = "from parity_harness.replay.cli.replay_compare import main; main()"


def _run(python: str, code: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [python, "-c", code, *args], capture_output=True, text=True, env=env, timeout=300, check=False
    )


def _capture_then_replay(capture_python: str, tmp_path: Path, ref_checkpoint: Path) -> dict:
    bundle, report = tmp_path / "bundle.h5", tmp_path / "report.json"
    adapter = ["--ckpt", str(ref_checkpoint), "--adapter", str(REF_ADAPTER)]
    captured = _run(capture_python, CAPTURE, *adapter, "--out", str(bundle), "--seq-len", "8000")
    assert captured.returncode == 0, captured.stderr
    replayed = _run(
        sys.executable, REPLAY, *adapter, "--bundle", str(bundle), "--atol", "0", "--rtol", "0", "--json", str(report)
    )
    assert replayed.returncode == 0, replayed.stdout[-3000:] + replayed.stderr
    return json.loads(report.read_text())


def _assert_exact(report: dict) -> None:
    assert report["match"] is True
    assert report["first_divergence"] == {"forward": None, "backward": None}
    kinds = {record["kind"] for record in report["records"]}
    assert kinds == {"output", "param_grad", "forward", "backward"}
    assert all(record["max_abs"] == 0 for record in report["records"])
    assert report["unmatched"] == {"bundle_only": [], "replay_only": []}


@pytest.mark.slow
def test_two_processes_match_exactly(tmp_path: Path, ref_checkpoint: Path) -> None:
    """capture-run in one process, replay-compare in another: every record matches with atol=rtol=0."""
    _assert_exact(_capture_then_replay(sys.executable, tmp_path, ref_checkpoint))


@pytest.mark.slow
@pytest.mark.skipif(
    not os.environ.get("PARITY_CAPTURE_PYTHON"), reason="set PARITY_CAPTURE_PYTHON to a second interpreter"
)
def test_capture_in_another_interpreter(tmp_path: Path, ref_checkpoint: Path) -> None:
    """A capture made by a second interpreter (another venv) replays exactly here."""
    _assert_exact(_capture_then_replay(os.environ["PARITY_CAPTURE_PYTHON"], tmp_path, ref_checkpoint))
