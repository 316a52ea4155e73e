"""A capture killed with SIGKILL never leaves a damaged bundle at its output path."""

from __future__ import annotations

import hashlib
import os
import random
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from parity_harness.capture.record.recorder import capture_run
from parity_harness.replay.reader import BundleReader
from tests.kill_worker import CALLS_PER_CAPTURE
from tests.models import build_tiny, tiny_inputs

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs SIGKILL")


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def read_everything(path: Path) -> int:
    """Open a bundle and read (and so checksum-verify) every tensor; return how many."""
    with BundleReader(path) as reader:
        refs = list(reader.index.tensor_refs())
        for ref in refs:
            reader.read_array(ref)
    return len(refs)


def prepare(folder: Path, with_earlier: bool) -> str | None:
    """An empty folder, or one holding an earlier bundle at the output path; returns that bundle's hash."""
    folder.mkdir()
    if not with_earlier:
        return None
    capture_run(build_tiny(), tiny_inputs(), folder / "bundle.h5")
    return sha256(folder / "bundle.h5")


def kill_worker(out: Path, *, pause_at: int | None = None, delay: float = 0.0) -> int:
    """Run the capture loop, SIGKILL it at its pause point (or ``delay`` s in); return its commit count."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "tests.kill_worker", str(out)]
    if pause_at is not None:
        command.append(str(pause_at))
    worker = subprocess.Popen(command, cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert worker.stdout is not None
    assert worker.stdout.readline().strip() == "ready"
    committed = 0
    if pause_at is not None:
        for line in worker.stdout:
            if line.strip() == "paused":
                break
            committed += line.startswith("committed")
        else:
            pytest.fail(f"the worker ended before its pause point {pause_at}")
    else:
        time.sleep(delay)
    worker.send_signal(signal.SIGKILL)
    worker.wait(timeout=60)
    return committed + sum(1 for line in worker.stdout if line.startswith("committed"))


def judge(out: Path, earlier: str | None) -> str:
    """What a kill left at the output path; fails the test on anything but the three safe outcomes."""
    if not out.exists():
        return "no file"
    read_everything(out)  # a complete, verified bundle or the test fails here
    if earlier is not None and sha256(out) == earlier:
        return "earlier bundle intact"
    return "a complete bundle"


# Each case starts a worker (~5 s): by default one kill inside the first capture over an earlier bundle
# (it must stay byte for byte); with -m slow also an empty folder, a kill after a commit and the edges
# (first call, last call before a commit, first call after it, a third capture).
PAUSE_POINTS = [
    pytest.param(5, id="capture0"),
    pytest.param(CALLS_PER_CAPTURE + 17, id="capture1", marks=pytest.mark.slow),
    *(
        pytest.param(n, id=f"call{n}", marks=pytest.mark.slow)
        for n in (0, CALLS_PER_CAPTURE - 1, CALLS_PER_CAPTURE, 2 * CALLS_PER_CAPTURE + 30)
    ),
]


@pytest.mark.parametrize(
    "with_earlier", [pytest.param(False, id="empty", marks=pytest.mark.slow), pytest.param(True, id="over-earlier")]
)
@pytest.mark.parametrize("pause_at", PAUSE_POINTS)
def test_sigkill_at_a_known_moment_leaves_the_expected_file(tmp_path: Path, pause_at: int, with_earlier: bool) -> None:
    """Killed inside capture k's forward: before any commit the path holds nothing (or the earlier bundle,
    byte for byte), after one it holds the last committed bundle, complete and checksum-verified."""
    earlier = prepare(tmp_path / "trial", with_earlier)
    out = tmp_path / "trial" / "bundle.h5"
    committed = kill_worker(out, pause_at=pause_at)
    assert committed == pause_at // CALLS_PER_CAPTURE
    outcome = judge(out, earlier)
    if committed:
        assert outcome == "a complete bundle"
    else:
        assert outcome == ("earlier bundle intact" if with_earlier else "no file")
    assert not [p.name for p in out.parent.iterdir() if p.name not in {"bundle.h5"} and not p.name.startswith(".")]


@pytest.mark.slow
def test_sigkill_at_random_moments_never_leaves_a_damaged_bundle(tmp_path: Path) -> None:
    """20 kills at random moments (half over an existing bundle), wherever they land (writer thread, rename,
    teardown): the path holds no file, the untouched earlier bundle, or a complete bundle that verifies."""
    rng = random.Random(1234)
    plans = [(tmp_path / f"trial{n}", n % 2 == 1, rng.uniform(0.0, 1.5)) for n in range(20)]

    def trial(folder: Path, with_earlier: bool, delay: float) -> str:
        earlier = prepare(folder, with_earlier)
        kill_worker(folder / "bundle.h5", delay=delay)
        return judge(folder / "bundle.h5", earlier)

    with ThreadPoolExecutor(max_workers=2) as pool:
        outcomes = list(pool.map(lambda plan: trial(*plan), plans))
    assert len(outcomes) == 20  # where the kills land depends on the machine's speed: the outcome kinds may not
