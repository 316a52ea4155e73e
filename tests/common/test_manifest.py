"""The multi-rank manifest as a format: version gate, a validator per field, the golden file of each version."""

from __future__ import annotations

import json
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from parity_harness.common.errors import BundleFormatError, UnsupportedBundleVersion
from parity_harness.common.format.manifest import (
    MANIFEST_FORMAT,
    MANIFEST_MINOR,
    MANIFEST_VERSION,
    MAX_MANIFEST_BYTES,
    build_manifest,
    parse_manifest,
    read_manifest,
)
from parity_harness.replay.cli.replay_compare import main as replay_main
from tests.cli_helpers import one_error_line

DATA = Path(__file__).resolve().parent.parent / "data"
MODELS = Path(__file__).resolve().parent.parent / "models.py"
GOLDEN = sorted(DATA.glob("manifest-golden-*.manifest.json"))


@pytest.fixture
def manifest(tmp_path: Path) -> Path:
    """A copy of the newest golden manifest and its rank files, free to damage."""
    source = GOLDEN[-1]
    stem = source.name.removesuffix(".manifest.json")
    for file in DATA.glob(f"{stem}.*"):
        shutil.copy(file, tmp_path / file.name)
    return tmp_path / source.name


def edit(path: Path, change: Callable[[dict[str, Any]], object]) -> Path:
    """Apply ``change`` to the manifest document in place (a returned list replaces the whole document)."""
    document = json.loads(path.read_text())
    replaced = change(document)
    path.write_text(json.dumps(replaced if isinstance(replaced, list) else document))
    return path


def test_a_golden_manifest_exists_for_the_current_version() -> None:
    """Every released manifest version keeps a golden file; the current one is among them."""
    assert DATA / f"manifest-golden-{MANIFEST_VERSION}.{MANIFEST_MINOR}.manifest.json" in GOLDEN


@pytest.mark.parametrize("golden", GOLDEN, ids=[p.name for p in GOLDEN])
def test_golden_manifest_reads_with_every_field(golden: Path) -> None:
    """The committed manifest reads: two ranks in order, their files beside it, how to combine them."""
    manifest = read_manifest(golden)
    assert manifest.world_size == 2
    assert [f.name for f in manifest.files] == [e.file for e in manifest.ranks]
    assert all(f.parent == golden.parent for f in manifest.files)
    assert (manifest.grad_reduction, manifest.params_from, manifest.shards) == ("mean", 0, False)
    assert manifest.backend == "gloo"
    assert all(len(e.sha256) == 64 for e in manifest.ranks)


@pytest.mark.parametrize("golden", GOLDEN, ids=[p.name for p in GOLDEN])
def test_golden_manifest_replays_with_a_match(golden: Path) -> None:
    """replay-compare on the golden manifest replays both ranks of TinyNet and matches every record."""
    result = CliRunner().invoke(
        replay_main, ["--bundle", str(golden), "--model", f"{MODELS}:build_tiny", "--atol", "1e-6", "--rtol", "1e-6"]
    )
    assert result.exit_code == 0, result.output
    assert "MATCH" in result.output


def test_a_manifest_of_format_1_0_without_minor_reads(manifest: Path) -> None:
    """Manifests written before the explicit minor (1.0) are still read."""
    edit(manifest, lambda d: d.pop("minor"))
    assert read_manifest(manifest).minor == 0


def test_a_fresh_document_passes_its_own_validator(tmp_path: Path) -> None:
    """What build_manifest writes is what parse_manifest accepts."""
    ranks = [{"rank": r, "file": f"b.rank{r}.h5", "bytes": 1, "sha256": "0" * 64} for r in range(4)]
    document = build_manifest(4, "nccl", ranks, grad_reduction="sum", params_from=3, params="local shards",
                              mesh={"shape": [2, 2], "dim_names": ["dp", "tp"]})  # fmt: skip
    parsed = parse_manifest(document, tmp_path / "b.manifest.json")
    assert (parsed.world_size, parsed.grad_reduction, parsed.params_from, parsed.shards) == (4, "sum", 3, True)
    assert parsed.mesh == {"shape": [2, 2], "dim_names": ["dp", "tp"]}


def test_a_newer_major_is_refused_naming_both_versions(manifest: Path) -> None:
    """A manifest of major 2 is refused by this reader, which says which versions it reads."""
    edit(manifest, lambda d: d.update(version=2, minor=0))
    refused = r"2\.0 is not supported .*reads up to 1\.x.*upgrade parity-harness"
    with pytest.raises(UnsupportedBundleVersion, match=refused):
        read_manifest(manifest)


def test_a_newer_minor_warns_and_reads(manifest: Path) -> None:
    """A newer minor only adds fields: it is read, with a warning, and unknown fields are ignored."""
    edit(manifest, lambda d: d.update(minor=MANIFEST_MINOR + 1, future_field={"x": 1}))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert read_manifest(manifest).world_size == 2
    assert any("newer than this reader" in str(w.message) for w in caught)


def _rank(index: int, **change: object) -> Callable[[dict[str, Any]], None]:
    return lambda d: d["ranks"][index].update(change)


DAMAGE: list[tuple[str, Callable[[dict[str, Any]], object], str]] = [
    ("array", lambda d: [d], "a JSON object"),
    ("other-format", lambda d: d.update(format="parity-harness-bundle"), "not a parity-harness manifest"),
    ("no-format", lambda d: d.pop("format"), "not a parity-harness manifest"),
    ("version-string", lambda d: d.update(version="1"), "'version' is '1'"),
    ("major-0", lambda d: d.update(version=0), "0.1 is not supported"),
    ("no-world-size", lambda d: d.pop("world_size"), "'world_size' is missing"),
    ("world-size-bool", lambda d: d.update(world_size=True), "'world_size' is True"),
    ("world-size-zero", lambda d: d.update(world_size=0), "'world_size' is 0"),
    ("world-size-huge", lambda d: d.update(world_size=10**12), "expected an integer in 1.."),
    ("ranks-missing", lambda d: d.__delitem__("ranks"), "'ranks' must list world_size = 2 entries, got NoneType"),
    ("ranks-short", lambda d: d["ranks"].pop(), "got 1 entries"),
    ("rank-not-object", lambda d: d["ranks"].__setitem__(1, "rank1.h5"), r"ranks\[1\]: expected an object"),
    ("ranks-out-of-order", lambda d: d["ranks"].reverse(), r"ranks\[0\]: 'rank' is 1, expected 0"),
    ("file-traversal", _rank(1, file="../secret.h5"), "not a plain file name"),
    ("file-absolute", _rank(1, file="/etc/passwd"), "not a plain file name"),
    ("file-dotdot", _rank(1, file=".."), "not a plain file name"),
    ("file-number", _rank(0, file=7), "'file' is 7, expected a string"),
    ("same-file-twice", lambda d: d["ranks"][1].update(file=d["ranks"][0]["file"]), "two ranks name the same file"),
    ("bytes-negative", _rank(0, bytes=-1), "'bytes' is -1"),
    ("bytes-float", _rank(0, bytes=1.5), "'bytes' is 1.5"),
    ("sha-not-hex", _rank(0, sha256="z" * 64), "not 64 lowercase hex digits"),
    ("reduction-unknown", lambda d: d.update(grad_reduction="max"), "expected one of mean, sum"),
    (
        "params-from-out-of-range",
        lambda d: d.update(params_from=2),
        r"'params_from' is 2, expected an integer in 0\.\.1",
    ),
    ("params-kind-unknown", lambda d: d.update(params="half"), "expected one of gathered, local shards"),
    ("mesh-wrong-size", lambda d: d.update(mesh={"shape": [3], "dim_names": []}), "multiplying to 2"),
    ("mesh-not-object", lambda d: d.update(mesh=[2]), "'mesh.shape' None"),
    ("mesh-names", lambda d: d.update(mesh={"shape": [2], "dim_names": [1]}), "list of strings"),
    ("rank-file-resized", _rank(1, bytes=5), "another size than recorded"),
]


@pytest.mark.parametrize(("change", "message"), [d[1:] for d in DAMAGE], ids=[d[0] for d in DAMAGE])
def test_a_damaged_manifest_is_one_format_error(manifest: Path, change: Callable[..., object], message: str) -> None:
    """Each kind of damage is one BundleFormatError naming the manifest and what is wrong."""
    edit(manifest, change)
    with pytest.raises(BundleFormatError, match=message) as caught:
        read_manifest(manifest)
    assert str(manifest) in str(caught.value)


@pytest.mark.parametrize(
    "content", [b"", b"{", b"\xff\xfe", b"[" * 100_000 + b"]" * 100_000, b'{"format": NaN'], ids=str
)
def test_unreadable_bytes_are_one_format_error(manifest: Path, content: bytes) -> None:
    """Empty, truncated, non-UTF-8 and absurdly nested files are refused as not a readable manifest."""
    manifest.write_bytes(content)
    with pytest.raises(BundleFormatError, match="manifest"):
        read_manifest(manifest)


def test_an_oversized_manifest_is_refused_before_it_is_read(manifest: Path) -> None:
    """A manifest beyond the size limit is refused from its size alone (no unbounded read)."""
    with manifest.open("r+b") as handle:
        handle.truncate(MAX_MANIFEST_BYTES + 1)
    with pytest.raises(BundleFormatError, match="is not a manifest"):
        read_manifest(manifest)


def test_a_missing_rank_file_is_refused(manifest: Path) -> None:
    """A manifest whose rank file was not copied along says which rank and what to do."""
    read_manifest(manifest).files[1].unlink()
    with pytest.raises(BundleFormatError, match=r"rank 1's bundle .* is missing.*copy every rank file"):
        read_manifest(manifest)


@pytest.mark.parametrize("where", ["outside", "subfolder"])
def test_a_rank_file_linked_from_elsewhere_is_refused(
    manifest: Path, tmp_path_factory: pytest.TempPathFactory, where: str
) -> None:
    """A rank file that is a link to a file outside the manifest's folder (of the right size: the manifest's only
    check of a file's identity) is never read: replay-compare exits 2 with one line naming the link and its target."""
    rank_file = read_manifest(manifest).files[1]
    elsewhere = tmp_path_factory.mktemp("elsewhere") if where == "outside" else manifest.parent / "sub"
    elsewhere.mkdir(exist_ok=True)
    target = elsewhere / rank_file.name
    shutil.move(rank_file, target)
    rank_file.symlink_to(target)
    with pytest.raises(BundleFormatError, match=r"rank 1's bundle .* is a link to .*outside the manifest's folder"):
        read_manifest(manifest)
    result = CliRunner().invoke(replay_main, ["--bundle", str(manifest), "--model", f"{MODELS}:build_tiny"])
    assert "is a link to" in one_error_line("replay-compare", result)


def test_a_capture_linked_file_by_file_into_another_folder_reads(manifest: Path, tmp_path: Path) -> None:
    """``ln -s /shared/run/* work/``: the manifest and its rank files all links, each rank file beside the file
    the manifest links to; read as the capture itself."""
    work = tmp_path / "work"
    work.mkdir()
    for file in manifest.parent.iterdir():
        if file.is_file():
            (work / file.name).symlink_to(file)
    assert read_manifest(work / manifest.name).world_size == 2


def test_a_rank_file_linked_within_its_folder_reads(manifest: Path) -> None:
    """A link to a file beside the manifest is that file: read as usual."""
    rank_file = read_manifest(manifest).files[1]
    rank_file.rename(manifest.parent / "renamed.h5")
    rank_file.symlink_to("renamed.h5")
    assert read_manifest(manifest).files[1] == rank_file


@pytest.mark.parametrize(("change", "message"), [d[1:] for d in DAMAGE[:6]], ids=[d[0] for d in DAMAGE[:6]])
def test_replay_compare_on_a_damaged_manifest_exits_2_with_one_line(
    manifest: Path, change: Callable[..., object], message: str
) -> None:
    """replay-compare ends with exit 2 and one error line, never a traceback."""
    edit(manifest, change)
    result = CliRunner().invoke(replay_main, ["--bundle", str(manifest), "--model", f"{MODELS}:build_tiny"])
    line = one_error_line("replay-compare", result)
    assert str(manifest) in line


def test_layout_names_match_the_spec() -> None:
    """docs/manifest.md names the format and every top-level field the writer emits."""
    spec = (Path(__file__).resolve().parents[2] / "docs" / "manifest.md").read_text()
    document = build_manifest(1, "gloo", [], grad_reduction="mean", params_from=0, params="gathered", mesh=None)
    assert MANIFEST_FORMAT in spec
    for key in (*document, "rank", "file", "bytes", "sha256", "host", "pid"):
        assert f"`{key}`" in spec, key


def test_a_rank_file_replayed_alone_says_so(manifest: Path) -> None:
    """Replaying one rank's bundle instead of the manifest warns what the file is and what to replay."""
    rank_file = read_manifest(manifest).files[1]
    result = CliRunner().invoke(replay_main, ["--bundle", str(rank_file), "--model", f"{MODELS}:build_tiny"])
    assert "is rank 1 of a 2-rank capture" in result.output
    assert f"replay {manifest} (every rank) instead" in result.output
