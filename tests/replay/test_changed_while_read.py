"""A bundle that another user can change is read record by record into memory, never through a memory map.

A process reading a mapped page past the end of a file that shrank is killed (SIGBUS): the file's owner, or anyone
where all may write it, could so end a replay of a bundle they handed over. Such a file's records are read with
``pread``: a truncation is then a one-line error, exit 2. A file of this user's own is still mapped (the faster path
for large records), and refused in one line once it changed (truncated, or copied over) before its next record is
read.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from parity_harness.capture.record.recorder import capture_run
from parity_harness.common.errors import BundleFormatError
from parity_harness.common.numerics.tolerances import Tolerance, ToleranceTable
from parity_harness.replay.compare.runner import compare_run
from parity_harness.replay.reader import BundleReader

_TRUNCATING_MODEL = '''
import os, torch
from torch import nn

class Truncating(nn.Module):
    """Truncates the bundle named by BUNDLE_TO_TRUNCATE in its forward (the file's owner doing so mid-replay), or
    copies BUNDLE_COPIED_OVER onto it as ``cp`` does: truncated in place, then written."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(512, 512)

    def forward(self, x):
        target = os.environ["BUNDLE_TO_TRUNCATE"]
        source = os.environ.get("BUNDLE_COPIED_OVER")
        if source:
            with open(source, "rb") as given, open(target, "wb") as taken:
                taken.write(given.read())
        else:
            os.truncate(target, 4096)
        return self.lin(x)

def make():
    torch.manual_seed(0)
    return Truncating()
'''


class _Plain(nn.Module):
    def __init__(self, scale: float = 1.0) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin, self.scale = nn.Linear(512, 512), scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale


def _writable_by_all(path: Path) -> Path:
    path.chmod(path.stat().st_mode | stat.S_IWOTH)
    return path


def test_a_bundle_truncated_while_replayed_is_refused_in_one_line(tmp_path: Path) -> None:
    """Someone who may write the bundle (here: all may) truncates it during the port's forward: replay-compare
    says so in one line and exits 2; it used to die of SIGBUS reading a mapped record."""
    bundle = tmp_path / "bundle.h5"
    capture_run(_Plain(), (torch.randn(4, 512),), bundle)
    _writable_by_all(bundle)
    assert _replayed_while_changed(tmp_path, bundle) == "the bundle was truncated"


@pytest.mark.parametrize("how", ["truncated", "copied over"])
def test_a_mapped_bundle_of_ones_own_changed_while_replayed_is_refused_in_one_line(tmp_path: Path, how: str) -> None:
    """The user's own bundle (read through a memory map) truncated, or another bundle copied onto it as ``cp`` does
    (the same file truncated, then written), between two of its records' reads: one line, exit 2, where the next
    mapped read past its new end killed the process (SIGBUS, exit 135, nothing printed)."""
    bundle = tmp_path / "bundle.h5"
    capture_run(_Plain(), (torch.randn(4, 512),), bundle)
    with BundleReader(bundle) as reader:
        assert reader._map is not None  # the path under test: records read from a memory map
    smaller = None
    if how == "copied over":
        smaller = tmp_path / "smaller.h5"
        capture_run(nn.Linear(8, 8), (torch.randn(2, 8),), smaller)
        assert smaller.stat().st_size < bundle.stat().st_size // 4
    assert _replayed_while_changed(tmp_path, bundle, smaller) == "the bundle changed while it was read"


def _replayed_while_changed(tmp_path: Path, bundle: Path, copied_over: Path | None = None) -> str:
    """``replay-compare`` of ``bundle`` by a port that truncates it in its forward (or copies ``copied_over`` onto
    it), run in a child process: it must exit 2 with one line, whose words naming the cause are returned."""
    (tmp_path / "truncating.py").write_text(_TRUNCATING_MODEL)
    command = "from parity_harness.replay.cli.replay_compare import main; main()"
    path = os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))
    environment = {**os.environ, "PYTHONPATH": path, "BUNDLE_TO_TRUNCATE": str(bundle)}
    if copied_over is not None:
        environment["BUNDLE_COPIED_OVER"] = str(copied_over)
    done = subprocess.run(
        [sys.executable, "-c", command, "--model", "truncating:make", "--bundle", str(bundle), "--quiet"],
        env=environment,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2, (done.returncode, done.stderr[-2000:])
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, done.stderr[-2000:]
    causes = ("the bundle was truncated", "the bundle changed while it was read")
    found = [cause for cause in causes if cause in lines[0]]
    assert found, lines[0]
    return found[0]


@pytest.mark.parametrize("others_can_write", [False, True], ids=["mapped", "read into memory"])
def test_records_read_either_way_give_the_same_verdicts(tmp_path: Path, others_can_write: bool) -> None:
    """The same bundle replayed mapped and read into memory: the same records, the same figures, and a flipped bit
    is caught either way."""
    bundle = tmp_path / "bundle.h5"
    x = torch.randn(4, 512)
    capture_run(_Plain(), (x,), bundle)
    if others_can_write:
        _writable_by_all(bundle)
    tolerances = ToleranceTable(Tolerance(1e-6, 1e-6))
    with BundleReader(bundle) as reader:
        exact = compare_run(_Plain(), reader, tolerances=tolerances)
    with BundleReader(bundle) as reader:
        off = compare_run(_Plain(scale=1.001), reader, tolerances=tolerances)
    assert exact.match
    assert all(record.diff.bits_equal for record in exact.records)
    assert sorted((r.name, r.diff.mismatched, r.diff.max_abs) for r in off.records if not r.match) == sorted(
        _figures_of_a_private_copy(tmp_path, bundle, tolerances)
    )
    with BundleReader(bundle) as reader:
        ref = reader.index.params["lin.weight"]
        offset = reader._stored[ref.path.lstrip("/")].offset
    data = bytearray(bundle.read_bytes())
    assert offset is not None
    data[offset + 7] ^= 0x01
    bundle.write_bytes(bytes(data))
    with BundleReader(bundle) as reader, pytest.raises(BundleFormatError, match=r"params/lin\.weight: checksum"):
        compare_run(_Plain(), reader, tolerances=tolerances)


def _figures_of_a_private_copy(
    tmp_path: Path, bundle: Path, tolerances: ToleranceTable
) -> list[tuple[str, int, float]]:
    private = tmp_path / "private.h5"
    private.write_bytes(bundle.read_bytes())
    private.chmod(0o600)
    with BundleReader(private) as reader:
        off = compare_run(_Plain(scale=1.001), reader, tolerances=tolerances)
    return [(r.name, r.diff.mismatched, r.diff.max_abs) for r in off.records if not r.match]


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="counts descriptors in /proc/self/fd (Linux)")
def test_readers_of_a_bundle_read_into_memory_give_their_descriptors_back(tmp_path: Path) -> None:
    """Closed or merely dropped, a reader of a bundle others may write (which holds a descriptor of its own rather
    than a memory map) leaves no descriptor open behind it."""
    import gc

    bundle = tmp_path / "bundle.h5"
    capture_run(_Plain(), (torch.randn(4, 512),), bundle)
    _writable_by_all(bundle)
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(50):
        with BundleReader(bundle):
            pass
    for _ in range(50):
        BundleReader(bundle)  # dropped without close()
    gc.collect()
    assert len(os.listdir("/proc/self/fd")) <= before
