"""The capture-only install (issue 18, item 6): every command it puts on PATH either works or says in one
line what to install, with exit code 2, never an import traceback with exit 1 (the code for "mismatch").

Simulated here by making modules unimportable (``sys.modules[name] = None``); with
``PARITY_CAPTURE_PYTHON`` set to the capture-only environment's interpreter, its real commands are run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

REPLAY_COMMANDS = {
    "replay-compare": "parity_harness.replay.cli.replay_compare",
    "ckpt-diff": "parity_harness.replay.cli.ckpt_diff",
    "parity-train-diff": "parity_harness.replay.cli.train_diff",
}
ARGUMENTS = {
    "replay-compare": ["--bundle", "missing.h5"],
    "ckpt-diff": ["a.pt", "b.pt"],
    "parity-train-diff": ["a.h5", "b.h5"],
}
FULL_INSTALL = "pip install parity-harness (with its dependencies, i.e. without --no-deps)"


def run_blocked(command: str, module: str, blocked: list[str], *args: str) -> subprocess.CompletedProcess[str]:
    """Run ``command`` (its ``main`` in ``module``) in a fresh interpreter where ``blocked`` cannot be imported."""
    code = (
        f"import sys\nfor name in {blocked!r}:\n    sys.modules[name] = None\n"
        f"sys.argv[0] = {command!r}\nfrom {module} import main\nmain()\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, timeout=120, check=False
    )


def assert_one_line(result: subprocess.CompletedProcess[str], command: str) -> str:
    """Exit 2, one line on stderr starting with the command's name, no traceback, nothing on stdout."""
    assert result.returncode == 2, (result.returncode, result.stderr[-2000:])
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    assert lines[0].startswith(f"{command}: error: "), lines[0]
    return lines[0]


@pytest.mark.parametrize("command", sorted(REPLAY_COMMANDS))
def test_replay_commands_without_tabulate_say_what_to_install(command: str) -> None:
    """Without tabulate (the capture-only install): one line naming it and the full install, exit 2."""
    result = run_blocked(command, REPLAY_COMMANDS[command], ["tabulate"], *ARGUMENTS[command])
    line = assert_one_line(result, command)
    assert f"{command}: error: tabulate not installed for {sys.executable}" in line
    assert "capture-only install" in line
    assert FULL_INSTALL in line


def test_capture_run_without_click_says_what_to_install() -> None:
    """capture-run missing one of its own dependencies names it and the pip command."""
    result = run_blocked("capture-run", "parity_harness.capture.cli.capture_run", ["click", "msgpack"], "--help")
    line = assert_one_line(result, "capture-run")
    assert "msgpack, click not installed" in line
    assert "pip install msgpack click" in line


@pytest.mark.skipif(
    not os.environ.get("PARITY_CAPTURE_PYTHON"), reason="set PARITY_CAPTURE_PYTHON to a capture-only interpreter"
)
def test_the_real_capture_only_environment(tmp_path: Path) -> None:
    """In the capture-only venv: its replay commands on PATH answer in one line with exit 2; capture-run works."""
    bin_dir = Path(os.environ["PARITY_CAPTURE_PYTHON"]).parent
    for command in REPLAY_COMMANDS:
        script = bin_dir / command
        if not script.exists():
            pytest.skip(f"{script} is not installed")
        result = subprocess.run(
            [str(script), *ARGUMENTS[command]], capture_output=True, text=True, cwd=tmp_path, timeout=120, check=False
        )
        assert FULL_INSTALL in assert_one_line(result, command)
    helped = subprocess.run([str(bin_dir / "capture-run"), "--help"], capture_output=True, text=True, timeout=120)
    assert helped.returncode == 0, helped.stderr
    assert "--out" in helped.stdout
