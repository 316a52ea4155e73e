"""Hostile checkpoints, round 2 (issue 18, item 4): .nemo tar bombs and Hugging Face shard indexes that
point out of their folder are refused in one line, before anything is written or read outside."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import tracemalloc
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import save_file

from parity_harness.capture.cli.capture_run import main as capture_main
from parity_harness.capture.models import checkpoints
from parity_harness.capture.models.builtin import hf
from parity_harness.capture.models.checkpoints import NEMO_LIMIT_VARIABLE, load_checkpoint
from parity_harness.common.errors import CheckpointError
from parity_harness.replay.ckpt_diff.kinds import open_source
from parity_harness.replay.cli.ckpt_diff import main as ckpt_diff_main
from tests.capture.test_checkpoints import NEMO_CONFIG, _add_bytes, _assert_state_equal, _linear_state, _torch_bytes
from tests.cli_helpers import one_error_line
from tests.conftest import ROOT

TINY = f"{ROOT / 'tests' / 'models.py'}:build_tiny"
MB = 1 << 20


@pytest.fixture
def work(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The temporary folder extraction uses (tempfile.tempdir), empty; no limit set in the environment."""
    folder = tmp_path / "work"
    folder.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    monkeypatch.delenv(NEMO_LIMIT_VARIABLE, raising=False)
    return folder


@pytest.fixture
def extracted(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the archive members extracted, in order (a spy on the one function that writes)."""
    names: list[str] = []
    real = checkpoints._extract_member

    def spy(archive: tarfile.TarFile, member: tarfile.TarInfo, target: Path) -> Path:
        names.append(member.name)
        return real(archive, member, target)

    monkeypatch.setattr(checkpoints, "_extract_member", spy)
    return names


def bomb_nemo(path: Path, *, members: int = 4, member_bytes: int = 2 * MB) -> Path:
    """A gzip .nemo: config and weights plus ``members`` zero-filled padding members (a few KB on disk)."""
    with tarfile.open(path, "w:gz") as archive:
        _add_bytes(archive, "model_config.yaml", NEMO_CONFIG.encode())
        for i in range(members):
            _add_bytes(archive, f"padding{i}.bin", bytes(member_bytes))
        _add_bytes(archive, "model_weights.ckpt", _torch_bytes(_linear_state()))
    return path


def declared_bomb_nemo(path: Path, declared: int) -> Path:
    """A plain tar whose weights member declares ``declared`` bytes but carries none (a few KB on disk)."""
    config = io.BytesIO()
    with tarfile.open(fileobj=config, mode="w", format=tarfile.GNU_FORMAT) as archive:
        _add_bytes(archive, "model_config.yaml", NEMO_CONFIG.encode())
    info = tarfile.TarInfo("model_weights.ckpt")
    info.size = declared
    head = config.getvalue().rstrip(b"\0")
    head += b"\0" * (-len(head) % tarfile.BLOCKSIZE)
    path.write_bytes(head + info.tobuf(format=tarfile.GNU_FORMAT) + b"\0" * (2 * tarfile.BLOCKSIZE))
    return path


# ------------------------------------------------------------------ .nemo: only the used members, capped


def test_only_the_config_and_weights_are_extracted(work: Path, extracted: list[str]) -> None:
    """Padding members beside the two used ones are never written; the temporary folder is removed."""
    path = bomb_nemo(work.parent / "padded.nemo", members=3, member_bytes=MB)
    checkpoint = load_checkpoint(path)
    _assert_state_equal(checkpoint.state_dict, _linear_state())
    assert extracted == ["model_config.yaml", "model_weights.ckpt"]
    assert list(work.iterdir()) == []


def test_gzip_bomb_refused_before_writing(work: Path, extracted: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Members declaring more than the limit in all: refused, naming the limit and how to raise it, nothing written."""
    monkeypatch.setenv(NEMO_LIMIT_VARIABLE, "3MB")
    path = bomb_nemo(work.parent / "bomb.nemo")
    assert path.stat().st_size < 100_000  # 8 MB of members in a few KB
    with pytest.raises(CheckpointError, match=rf"more than {3 * MB} bytes.*tar bomb.*{NEMO_LIMIT_VARIABLE}"):
        load_checkpoint(path)
    assert extracted == []
    assert list(work.iterdir()) == []


def test_declared_size_over_the_default_limit_refused(work: Path, extracted: list[str]) -> None:
    """A member whose header declares 1 TiB is refused from its header alone, with the default limit."""
    path = declared_bomb_nemo(work.parent / "declared.nemo", 1 << 40)
    assert path.stat().st_size < 4096
    with pytest.raises(CheckpointError, match=r"declare more than 1073741824 bytes \(1099511627\d+ so far"):
        load_checkpoint(path)
    assert extracted == []
    assert list(work.iterdir()) == []


def test_oversized_config_refused(work: Path, extracted: list[str]) -> None:
    """A model_config.yaml over 16 MiB is refused before extraction, even under the total limit."""
    path = work.parent / "big_config.nemo"
    with tarfile.open(path, "w:gz") as archive:
        _add_bytes(archive, "model_config.yaml", b"#" * (17 * MB))
        _add_bytes(archive, "model_weights.ckpt", _torch_bytes(_linear_state()))
    with pytest.raises(CheckpointError, match=r"model_config\.yaml declares 17825792 bytes, over the 16777216"):
        load_checkpoint(path)
    assert extracted == []


def test_two_weights_members_refused(work: Path) -> None:
    """A model-parallel archive (two model_weights.ckpt, none at the top) is refused naming both."""
    path = work.parent / "mp.nemo"
    with tarfile.open(path, "w") as archive:
        for rank in range(2):
            _add_bytes(archive, f"mp_rank_0{rank}/model_weights.ckpt", _torch_bytes(_linear_state()))
    with pytest.raises(CheckpointError, match=r"2 members named model_weights\.ckpt \('mp_rank_00/"):
        load_checkpoint(path)


def test_interrupt_while_loading_removes_the_temporary(work: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C while the extracted weights load: the temporary folder and its files are gone."""
    seen: list[Path] = []

    def interrupted(path: Path, trust_pickle: bool) -> object:
        seen.append(path)
        assert path.is_file()  # really extracted at the moment of the interrupt
        raise KeyboardInterrupt

    monkeypatch.setattr(checkpoints, "_torch_load", interrupted)
    with pytest.raises(KeyboardInterrupt):
        load_checkpoint(bomb_nemo(work.parent / "m.nemo", members=0))
    assert seen
    assert not seen[0].exists()
    assert list(work.iterdir()) == []


def test_tar_bomb_is_one_line_in_both_clis(work: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """capture-run and ckpt-diff on a tar bomb: exit 2, one line, no bundle, no temporary."""
    monkeypatch.setenv(NEMO_LIMIT_VARIABLE, "3MB")
    bomb = bomb_nemo(tmp_path / "bomb.nemo")
    out = tmp_path / "o.h5"
    line = one_error_line(
        "capture-run", CliRunner().invoke(capture_main, ["--model", TINY, "--ckpt", str(bomb), "--out", str(out)])
    )
    assert "tar bomb" in line
    assert str(bomb) in line
    assert not out.exists()
    line = one_error_line("ckpt-diff", CliRunner().invoke(ckpt_diff_main, [str(bomb), str(bomb)]))
    assert "tar bomb" in line
    assert list(work.iterdir()) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bomb.nemo", "work"]


def test_bad_limit_variable_is_named(work: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An unreadable PARITY_NEMO_MAX_BYTES is a CheckpointError naming the variable."""
    monkeypatch.setenv(NEMO_LIMIT_VARIABLE, "lots")
    with pytest.raises(CheckpointError, match=rf"{NEMO_LIMIT_VARIABLE}='lots'"):
        load_checkpoint(bomb_nemo(work.parent / "m.nemo", members=0))


# ------------------------------------------------------------------ Hugging Face folders: shards stay inside

ESCAPES = ["../elsewhere/x.safetensors", "../../../elsewhere/x.safetensors", "/elsewhere/x.safetensors"]


def escaping_folder(tmp_path: Path, shard: str) -> tuple[Path, Path]:
    """A model folder whose index names ``shard``, and an existing outside file the escape would reach."""
    outside = tmp_path / "elsewhere" / "x.safetensors"
    outside.parent.mkdir()
    save_file({"w": torch.full((2,), 7.0)}, str(outside))
    folder = tmp_path / "deep" / "er" / "model"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    save_file({"inside": torch.ones(2)}, str(folder / "model-00001-of-00002.safetensors"))
    weight_map = {"inside": "model-00001-of-00002.safetensors", "w": shard}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return folder, outside


@pytest.mark.parametrize("shard", ESCAPES)
def test_every_reader_refuses_an_escaping_shard(tmp_path: Path, shard: str) -> None:
    """load_checkpoint, ckpt-diff's open_source and the hf adapter refuse the same index, naming entry and shard."""
    folder, _ = escaping_folder(tmp_path, shard)
    expected = rf"model\.safetensors\.index\.json: weight_map entry 'w' names shard '{shard}', which points outside"
    for read in (load_checkpoint, open_source, lambda f: hf.load_model(str(f), "cpu")):
        with pytest.raises(CheckpointError, match=expected):
            read(folder)


def test_a_variant_index_is_checked_too(tmp_path: Path) -> None:
    """An escaping entry in any *.index.json (a variant transformers may read) is refused."""
    folder, _ = escaping_folder(tmp_path, "model-00001-of-00002.safetensors")
    (folder / "model.fp16.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "../x.safetensors"}}))
    with pytest.raises(CheckpointError, match=r"model\.fp16\.safetensors\.index\.json: .* points outside"):
        hf.load_model(str(folder), "cpu")


AUDITED = """
import json, sys
sentinel, record, module = sys.argv[1:4]
opened = []


def audit(event, args):
    if event == "open" and sentinel in str(args[0]):
        opened.append(str(args[0]))


sys.addaudithook(audit)
sys.argv = [module, *sys.argv[4:]]
try:
    __import__(module, fromlist=["main"]).main()
finally:
    with open(record, "w") as handle:
        json.dump({"opened": opened, "transformers": "transformers" in sys.modules}, handle)
"""


def run_audited(sentinel: Path, record: Path, module: str, *args: str) -> subprocess.CompletedProcess[str]:
    """Run a CLI in a fresh interpreter that records every open() of a path containing ``sentinel``."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-c", AUDITED, str(sentinel), str(record), module, *args]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=300, check=False)


@pytest.mark.parametrize(
    ("module", "args"),
    [
        ("parity_harness.capture.cli.capture_run", ["--adapter", "hf", "--ckpt", "{folder}", "--out", "{out}"]),
        ("parity_harness.replay.cli.ckpt_diff", ["{folder}", "{folder}"]),
    ],
    ids=["capture-run-adapter-hf", "ckpt-diff"],
)
def test_escaping_shard_is_never_opened(tmp_path: Path, module: str, args: list[str]) -> None:
    """In a fresh process: exit 2 with one line, the outside file never opened, transformers never imported."""
    folder, outside = escaping_folder(tmp_path, "../../../elsewhere/x.safetensors")
    out, record = tmp_path / "o.h5", tmp_path / "audit.json"
    result = run_audited(outside.parent, record, module, *(a.format(folder=folder, out=out) for a in args))
    assert result.returncode == 2, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert "points outside the folder" in lines[0]
    audit = json.loads(record.read_text())
    assert audit == {"opened": [], "transformers": False}
    assert not out.exists()


def test_a_fifo_or_device_as_a_folder_json_file_is_refused_unread(tmp_path: Path) -> None:
    """An index that is a FIFO (reading would block) or a link to /dev/zero (reading would never end): refused by
    every reader in one line, in seconds, before anything is read."""
    folder, _ = escaping_folder(tmp_path, "model-00001-of-00002.safetensors")
    index = folder / "model.safetensors.index.json"
    index.unlink()
    os.mkfifo(index)
    for read in (load_checkpoint, open_source, lambda f: hf.load_model(str(f), "cpu")):
        with pytest.raises(CheckpointError, match="not a regular file"):
            read(folder)
    index.unlink()
    index.symlink_to("/dev/zero")
    line = one_error_line("ckpt-diff", CliRunner().invoke(ckpt_diff_main, [str(folder), str(folder)]))
    assert "not a regular file" in line


def test_a_compressed_torch_zip_is_refused_before_torch_reads_it(tmp_path: Path) -> None:
    """torch.save stores members as they are; a repacked file whose storage is deflated (a small file that would
    decompress to far more) is refused from its zip directory, and a damaged file is called damaged, not code."""
    import zipfile

    plain = tmp_path / "plain.pt"
    torch.save({"w": torch.zeros(1 << 16)}, plain)
    packed = tmp_path / "packed.pt"
    with zipfile.ZipFile(plain) as source, zipfile.ZipFile(packed, "w", zipfile.ZIP_DEFLATED) as target:
        for info in source.infolist():
            target.writestr(info.filename, source.read(info))
    assert packed.stat().st_size < plain.stat().st_size // 10
    line = one_error_line("ckpt-diff", CliRunner().invoke(ckpt_diff_main, [str(packed), str(plain)]))
    assert "is compressed; torch.save stores every member as is" in line
    text = tmp_path / "notes.pt"
    text.write_text("not a checkpoint at all\n")
    line = one_error_line("ckpt-diff", CliRunner().invoke(ckpt_diff_main, [str(text), str(plain)]))
    assert "not a checkpoint this tool can read (damaged, truncated or another format" in line
    assert "--trust-pickle" not in line


def test_a_damaged_nemo_weights_member_is_named_in_the_archive(tmp_path: Path) -> None:
    """The message names the archive and its member, not the temporary copy that is gone by then."""
    archive_path = tmp_path / "model.nemo"
    with tarfile.open(archive_path, "w") as archive:
        _add_bytes(archive, "model_config.yaml", NEMO_CONFIG.encode())
        _add_bytes(archive, "model_weights.ckpt", b"not a checkpoint")
    line = one_error_line("ckpt-diff", CliRunner().invoke(ckpt_diff_main, [str(archive_path), str(archive_path)]))
    assert f"{archive_path}:model_weights.ckpt: not a checkpoint this tool can read" in line
    assert "parity-nemo-" not in line


def test_a_tar_header_bomb_is_refused_before_it_is_read(tmp_path: Path) -> None:
    """A gzip .nemo whose first member carries a 2 MiB PAX header (tarfile would read it whole; such a header can
    declare gigabytes in a few kilobytes): refused from the header's declared size, one line."""
    archive_path = tmp_path / "model.nemo"
    with tarfile.open(archive_path, "w:gz", format=tarfile.PAX_FORMAT) as archive:
        info = tarfile.TarInfo("model_config.yaml")
        info.pax_headers = {"comment": "x" * (2 * MB)}
        info.size = len(NEMO_CONFIG.encode())
        archive.addfile(info, io.BytesIO(NEMO_CONFIG.encode()))
        _add_bytes(archive, "model_weights.ckpt", _torch_bytes(_linear_state()))
    assert archive_path.stat().st_size < 64 * 1024
    line = one_error_line("ckpt-diff", CliRunner().invoke(ckpt_diff_main, [str(archive_path), str(archive_path)]))
    assert "refused as a tar header bomb" in line


def test_many_extended_headers_each_under_the_bound_are_refused_in_all(tmp_path: Path) -> None:
    """Members whose PAX headers are each under the one-header bound but add up (tarfile keeps every one, decoded,
    in its member list: 100 such members took 330 MB from a 110 KB file) are refused once their sum passes the
    archive's bound: one line, and memory stays near that bound, not the members' count times it."""
    archive_path = tmp_path / "model.nemo"
    with tarfile.open(archive_path, "w:gz", format=tarfile.PAX_FORMAT) as archive:
        _add_bytes(archive, "model_config.yaml", NEMO_CONFIG.encode())
        for index in range(40):
            info = tarfile.TarInfo(f"padding{index}")
            info.pax_headers = {"comment": "x" * (MB - 1000)}
            archive.addfile(info, io.BytesIO(b""))
        _add_bytes(archive, "model_weights.ckpt", _torch_bytes(_linear_state()))
    assert archive_path.stat().st_size < 256 * 1024
    tracemalloc.start()
    try:
        with pytest.raises(CheckpointError, match=r"model\.nemo: refused as a tar header bomb.*in all") as caught:
            load_checkpoint(archive_path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert "\n" not in str(caught.value)
    assert peak < 64 * MB, f"peak {peak / MB:.0f} MB"
    line = one_error_line("ckpt-diff", CliRunner().invoke(ckpt_diff_main, [str(archive_path), str(archive_path)]))
    assert "refused as a tar header bomb" in line


def test_a_torch_without_a_safe_restricted_unpickler_loads_no_pickle(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before torch 2.6 weights_only=True can be bypassed (CVE-2025-32434): a pickle is refused unless trusted."""
    plain = tmp_path / "plain.pt"
    torch.save({"w": torch.zeros(2)}, plain)
    monkeypatch.setattr(torch, "__version__", "2.5.1")
    with pytest.raises(CheckpointError, match="CVE-2025-32434"):
        load_checkpoint(plain)
    assert set(load_checkpoint(plain, trust_pickle=True).state_dict) == {"w"}
