"""A bundle or training file is read from its own bytes only: crafted files that would read another file,
block on a FIFO or fill gigabytes from kilobytes are refused, with one line naming the dataset, before any
data is read, by every reader (replay-compare, --list, ckpt-diff, parity-train-diff, the pytest fixture)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import h5py
import pytest
import torch
from click.testing import CliRunner

from parity_harness.capture.record.recorder import capture_run
from parity_harness.common.errors import BundleFormatError
from parity_harness.replay.assertions import assert_parity
from parity_harness.replay.cli.ckpt_diff import main as ckpt_diff_main
from parity_harness.replay.cli.replay_compare import main as replay_main
from parity_harness.replay.cli.train_diff import main as train_diff_main
from parity_harness.replay.reader import BundleReader
from tests.cli_helpers import one_error_line
from tests.hostile import CRAFTS, craft_copy, external_storage
from tests.models import build_tiny, tiny_inputs
from tests.test_training import train

ROOT = Path(__file__).resolve().parent.parent
SECRET = b"TOP-SECRET-CREDENTIAL-"


@pytest.fixture(scope="module")
def clean_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("containment") / "tiny.h5"
    capture_run(build_tiny(), tiny_inputs(), path, seed=0)
    return path


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A file of the user's that no bundle may read: a secret."""
    secret = tmp_path / "outside" / "credentials"
    secret.parent.mkdir()
    secret.write_bytes(SECRET * 64)
    return secret


@pytest.mark.parametrize("shape", list(CRAFTS))
def test_every_reader_refuses_a_crafted_bundle_before_reading_data(
    clean_bundle: Path, tmp_path: Path, outside: Path, shape: str
) -> None:
    """replay-compare, its --list, ckpt-diff and assert_parity: exit 2 (or the error), one line naming the
    dataset and what is wrong, and the outside file's bytes appear nowhere."""
    craft, reason = CRAFTS[shape]
    bundle = craft_copy(clean_bundle, tmp_path, craft, outside)
    runner = CliRunner()
    listed = runner.invoke(replay_main, ["--bundle", str(bundle), "--list"])
    line = one_error_line("replay-compare", listed)
    assert "params/" in line
    assert reason in line
    model = f"{ROOT / 'tests' / 'models.py'}:build_tiny"
    replayed = runner.invoke(replay_main, ["--bundle", str(bundle), "--model", model])
    assert reason in one_error_line("replay-compare", replayed)
    diffed = runner.invoke(ckpt_diff_main, [str(bundle), str(clean_bundle)])
    assert reason in one_error_line("ckpt-diff", diffed)
    with pytest.raises(BundleFormatError, match=reason):
        assert_parity(build_tiny(), bundle)
    for result in (listed, replayed, diffed):
        assert SECRET.decode() not in result.output


def test_a_training_file_that_reads_another_file_is_refused(tmp_path: Path, outside: Path) -> None:
    """parity-train-diff: the same rule for training files."""
    run = train(tmp_path / "run.h5", lambda model: torch.optim.SGD(model.parameters(), lr=0.1))
    with h5py.File(run, "r") as file:
        names: list[str] = []
        file.visititems(lambda n, node: names.append(n) if isinstance(node, h5py.Dataset) and "params/" in n else None)
    crafted = craft_copy(run, tmp_path, external_storage, outside, dataset=sorted(names)[0])
    result = CliRunner().invoke(train_diff_main, [str(crafted), str(run)])
    line = one_error_line("parity-train-diff", result)
    assert "stored in another file" in line
    assert SECRET.decode() not in result.output


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
@pytest.mark.parametrize("shape", ["external-storage", "external-link", "virtual-dataset"])
def test_a_bundle_pointing_at_a_fifo_never_blocks(clean_bundle: Path, tmp_path: Path, shape: str) -> None:
    """Reading from a FIFO blocks until someone writes: each tool, run as a user runs it, refuses the bundle
    without opening it (an open would block, and the run would not end within the limit)."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    bundle = craft_copy(clean_bundle, tmp_path, CRAFTS[shape][0], fifo)
    commands = [
        ["from parity_harness.replay.cli.replay_compare import main; main()", "--bundle", str(bundle), "--list"],
        ["from parity_harness.replay.cli.ckpt_diff import main; main()", str(bundle), str(clean_bundle)],
    ]
    for code, *args in commands:
        done = subprocess.run(
            [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120, cwd=ROOT, check=False
        )
        assert done.returncode == 2, done.stderr
        assert len(done.stderr.strip().splitlines()) == 1, done.stderr
        assert CRAFTS[shape][1] in done.stderr


def test_a_fifo_given_as_the_bundle_is_refused(tmp_path: Path) -> None:
    """The path itself a FIFO: refused as not a regular file, never opened."""
    if not hasattr(os, "mkfifo"):
        pytest.skip("needs FIFOs")
    fifo = tmp_path / "bundle.h5"
    os.mkfifo(fifo)
    with pytest.raises(BundleFormatError, match="not a regular file"):
        BundleReader(fifo)


def test_an_npz_that_decompresses_beyond_its_size_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """ckpt-diff on an .npz: an array header declaring more than its member holds, or members decompressing past
    the limit (a zip bomb), is refused from the headers, before any array is decompressed."""
    import io
    import zipfile

    import numpy as np

    lying = tmp_path / "lying.npz"
    with zipfile.ZipFile(lying, "w") as archive:
        header = io.BytesIO()
        np.lib.format.write_array_header_1_0(header, {"descr": "<f4", "fortran_order": False, "shape": (1 << 30,)})
        archive.writestr("w.npy", header.getvalue() + b"\0" * 64)
    line = one_error_line("ckpt-diff", CliRunner().invoke(ckpt_diff_main, [str(lying), str(lying)]))
    assert "w: declares 4294967296 bytes of float32" in line
    bomb = tmp_path / "bomb.npz"
    np.savez_compressed(bomb, w=np.zeros(1 << 22, np.float32))  # 16 MiB of zeros in a few KiB
    monkeypatch.setenv("PARITY_NEMO_MAX_BYTES", "1M")
    line = one_error_line("ckpt-diff", CliRunner().invoke(ckpt_diff_main, [str(bomb), str(bomb)]))
    assert "refused as a zip bomb" in line
    monkeypatch.delenv("PARITY_NEMO_MAX_BYTES")
    assert CliRunner().invoke(ckpt_diff_main, [str(bomb), str(bomb)]).exit_code == 0


def test_a_fifo_given_as_a_manifest_or_training_file_is_refused(tmp_path: Path) -> None:
    """The other formats' readers refuse a FIFO unopened too (opening one for reading would block)."""
    if not hasattr(os, "mkfifo"):
        pytest.skip("needs FIFOs")
    from parity_harness.common.format.manifest import read_manifest
    from parity_harness.replay.training.training_file import TrainingRun

    manifest, training = tmp_path / "run.manifest.json", tmp_path / "run.h5"
    os.mkfifo(manifest)
    os.mkfifo(training)
    with pytest.raises(BundleFormatError, match="not a regular file"):
        read_manifest(manifest)
    with pytest.raises(BundleFormatError, match="not a regular file"):
        TrainingRun(training)


def test_a_link_name_that_is_not_utf8_is_one_refusal_line(clean_bundle: Path, tmp_path: Path) -> None:
    """A crafted link name of arbitrary bytes is named in the refusal (escaped), never an exception of HDF5's
    Python layer."""
    bundle = tmp_path / "odd-name.h5"
    bundle.write_bytes(clean_bundle.read_bytes())
    with h5py.File(bundle, "r+") as file:
        file.id.links.create_hard(b"\xffextra", file.id, b"params/" + next(iter(file["params"])).encode())
    with pytest.raises(BundleFormatError, match="not named by the index"):
        BundleReader(bundle)
