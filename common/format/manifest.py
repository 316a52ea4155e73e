"""The multi-rank manifest: a JSON file beside a distributed capture's per-rank bundles.

``bundle.h5`` captured by N ranks is ``bundle.rank0.h5`` ... ``bundle.rank<N-1>.h5`` and
``bundle.manifest.json``, written last (after every rank reported success) and atomically. The
manifest names its rank files beside itself only, with their sizes; a reader checks the whole
document (version gate first, then every field) before it opens a rank file. See docs/manifest.md.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from parity_harness.common.errors import BundleFormatError
from parity_harness.common.format.atomic import write_text_atomically
from parity_harness.common.format.gate import FormatGate
from parity_harness.common.format.preview import shown

__all__ = [
    "GRAD_REDUCTIONS",
    "MANIFEST_FORMAT",
    "MANIFEST_MINOR",
    "MANIFEST_VERSION",
    "PARAMS_KINDS",
    "Manifest",
    "RankEntry",
    "build_manifest",
    "find_manifest",
    "manifest_path",
    "parse_manifest",
    "rank_path",
    "read_manifest",
    "write_manifest",
]

MANIFEST_FORMAT: Final = "parity-harness-manifest"
MANIFEST_VERSION: Final = 1
"""Major version: bumped when a reader of the previous major could misread a manifest."""
MANIFEST_MINOR: Final = 1
"""Minor version: bumped when fields are only added (1: ``minor`` itself, stated explicitly)."""
GRAD_REDUCTIONS: Final = ("mean", "sum", "none")
PARAMS_KINDS: Final = ("gathered", "local shards")
MAX_MANIFEST_BYTES: Final = 16 << 20
"""A manifest of a million ranks is ~200 MB; refuse anything this side of absurd before reading it."""
MAX_WORLD_SIZE: Final = 1 << 20


def rank_path(out: Path, rank: int) -> Path:
    """``bundle.h5`` -> ``bundle.rank3.h5``."""
    return out.with_name(f"{out.stem}.rank{rank}{out.suffix}")


def manifest_path(out: Path) -> Path:
    """``bundle.h5`` -> ``bundle.manifest.json``."""
    return out.with_name(f"{out.stem}.manifest.json")


@dataclass(frozen=True)
class RankEntry:
    """One rank's bundle as the manifest records it."""

    rank: int
    file: str
    bytes: int
    sha256: str
    host: str = ""
    pid: int = 0


@dataclass(frozen=True)
class Manifest:
    """A multi-rank capture: its rank bundles, in rank order, and how to put them together."""

    path: Path
    world_size: int
    files: tuple[Path, ...]
    grad_reduction: str
    params_from: int
    shards: bool = False
    """Parameters and gradients are each rank's local shards (``capture_run(shards=True)``)."""
    backend: str = ""
    ranks: tuple[RankEntry, ...] = ()
    mesh: dict[str, Any] | None = None
    minor: int = 0

    def rank_file(self, rank: int) -> Path:
        """The bundle of ``rank``; raises when the job had no such rank."""
        if not 0 <= rank < self.world_size:
            raise BundleFormatError(f"{self.path}: the capture ran {self.world_size} ranks; there is no rank {rank}")
        return self.files[rank]


def build_manifest(world_size: int, backend: str, ranks: list[dict[str, Any]], **fields: Any) -> dict[str, Any]:
    """The manifest document of a finished job (``fields``: grad_reduction, params_from, params, mesh)."""
    return {
        "format": MANIFEST_FORMAT,
        "version": MANIFEST_VERSION,
        "minor": MANIFEST_MINOR,
        "world_size": world_size,
        "backend": backend,
        "ranks": ranks,
        **fields,
    }


def write_manifest(path: Path, document: dict[str, Any]) -> Path:
    """Write a manifest atomically (a reader never sees half of one); returns its path."""
    write_text_atomically(path, json.dumps(document, indent=2) + "\n", what=f"manifest {path}")
    return path


def find_manifest(path: Path) -> Manifest | None:
    """The manifest ``path`` names (``X.manifest.json``, or ``X.h5`` when only its manifest exists), else None."""
    if path.name.endswith(".manifest.json"):
        return read_manifest(path)
    if not path.exists() and manifest_path(path).is_file():
        return read_manifest(manifest_path(path))
    return None


def read_manifest(path: Path) -> Manifest:
    """Read, validate and check a manifest: every field, then every rank's file beside it with its recorded size.

    Raises:
        BundleFormatError: not a manifest, a field missing or malformed, or a rank file missing or resized.
        UnsupportedBundleVersion: written by a newer major version.
    """
    manifest = parse_manifest(_load_json(path), path)
    folders = (path.parent.resolve(), path.resolve().parent)  # beside the manifest, or beside the file it links to
    for entry, file in zip(manifest.ranks, manifest.files, strict=True):
        _check_beside(file, folders, f"{path}: rank {entry.rank}'s bundle")
        if not file.is_file() or file.stat().st_size != entry.bytes:
            raise BundleFormatError(
                f"{path}: rank {entry.rank}'s bundle {file} is missing or has another size than recorded "
                f"({entry.bytes} bytes); copy every rank file with the manifest"
            )
    return manifest


def _check_beside(file: Path, folders: tuple[Path, ...], what: str) -> None:
    """Refuse a rank file that is a link to a file outside the manifest's (resolved) folder, or the folder of the
    manifest it links to (a capture linked file by file into a work folder): a manifest from someone else must not
    make replay read any other file of the user's."""
    if not file.is_symlink():
        return
    try:
        target = file.resolve(strict=True)
    except (OSError, RuntimeError):  # dangling, or a loop of links: the size check says "missing"
        return
    if target.parent not in folders:
        raise BundleFormatError(
            f"{what} {file} is a link to {target}, outside the manifest's folder {folders[0]}; refusing to read "
            "it: copy the rank file beside the manifest"
        )


def _load_json(path: Path) -> object:
    if path.exists() and not path.is_file():  # a FIFO would block the read, a device never end it
        raise BundleFormatError(f"{path}: not a regular file; pass the manifest capture-run wrote")
    try:
        size = path.stat().st_size
        if size > MAX_MANIFEST_BYTES:
            raise BundleFormatError(
                f"{path}: {size} bytes is not a manifest (at most {MAX_MANIFEST_BYTES}); "
                "pass the file capture-run wrote"
            )
        with path.open("rb") as handle:
            return json.loads(handle.read(MAX_MANIFEST_BYTES + 1))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as err:
        if isinstance(err, BundleFormatError):
            raise
        raise BundleFormatError(f"{path}: not a readable manifest ({type(err).__name__}: {err})") from err


def parse_manifest(document: object, path: Path) -> Manifest:
    """Validate a manifest document field by field (version gate first); rank files are not opened."""
    if not isinstance(document, dict):
        raise BundleFormatError(f"{path}: a manifest is a JSON object, got {type(document).__name__}")
    minor = _check_version(document, path)
    world = _parse_int(document, "world_size", path, low=1, high=MAX_WORLD_SIZE)
    ranks = parse_ranks(document.get("ranks"), world, path)
    params = _parse_choice(document, "params", PARAMS_KINDS, path, default="gathered")
    return Manifest(
        path=path,
        world_size=world,
        files=tuple(path.with_name(entry.file) for entry in ranks),
        grad_reduction=_parse_choice(document, "grad_reduction", GRAD_REDUCTIONS, path, default="mean"),
        params_from=_parse_int(document, "params_from", path, low=0, high=world - 1, default=0),
        shards=params == "local shards",
        backend=_parse_str(document, "backend", path, default=""),
        ranks=ranks,
        mesh=parse_mesh(document.get("mesh"), world, path),
        minor=minor,
    )


MANIFEST_GATE: Final = FormatGate(
    MANIFEST_FORMAT,
    MANIFEST_VERSION,
    MANIFEST_MINOR,
    noun="manifest",
    writer="a distributed capture-run (X.manifest.json)",
    format_field="field 'format'",
)


def _check_version(document: dict[str, Any], path: Path) -> int:
    """The gate (format name, then major, then minor), before any other field is read."""
    major = _parse_int(document, "version", path, low=0, high=None, default=0)
    minor = _parse_int(document, "minor", path, low=0, high=None, default=0)
    MANIFEST_GATE.check(document.get("format"), major, minor, where=str(path), stacklevel=4)
    return minor


def parse_ranks(value: object, world: int, path: Path) -> tuple[RankEntry, ...]:
    """``ranks``: one entry per rank, in rank order, each naming a plain file beside the manifest."""
    if not isinstance(value, list) or len(value) != world:
        got = f"{len(value)} entries" if isinstance(value, list) else type(value).__name__
        raise BundleFormatError(f"{path}: 'ranks' must list world_size = {world} entries, got {got}")
    entries = tuple(parse_rank_entry(entry, position, path) for position, entry in enumerate(value))
    if len({entry.file for entry in entries}) != world:
        raise BundleFormatError(f"{path}: two ranks name the same file; each rank has its own bundle")
    return entries


def parse_rank_entry(entry: object, position: int, path: Path) -> RankEntry:
    """One ``ranks[i]`` entry: rank ``i``, a plain file name, its size and SHA-256."""
    where = f"{path}: ranks[{position}]"
    if not isinstance(entry, dict):
        raise BundleFormatError(f"{where}: expected an object, got {type(entry).__name__}")
    if _parse_int(entry, "rank", Path(where), low=0, high=None) != position:
        raise BundleFormatError(f"{where}: 'rank' is {shown(entry.get('rank'))}, expected {position} (rank order)")
    file = _parse_str(entry, "file", Path(where))
    if Path(file).name != file or file in {"", ".", ".."} or os.sep in file or "\0" in file:
        raise BundleFormatError(f"{where}: 'file' {shown(file)} is not a plain file name beside the manifest")
    sha = _parse_str(entry, "sha256", Path(where), default="")
    if sha and (len(sha) != 64 or any(c not in "0123456789abcdef" for c in sha)):
        raise BundleFormatError(f"{where}: 'sha256' {shown(sha)} is not 64 lowercase hex digits")
    return RankEntry(
        rank=position,
        file=file,
        bytes=_parse_int(entry, "bytes", Path(where), low=0, high=None),
        sha256=sha,
        host=_parse_str(entry, "host", Path(where), default=""),
        pid=_parse_int(entry, "pid", Path(where), low=0, high=None, default=0),
    )


def parse_mesh(value: object, world: int, path: Path) -> dict[str, Any] | None:
    """``mesh``: null, or the DTensor device mesh (``shape``: positive ints whose product is the world size)."""
    if value is None:
        return None
    shape = value.get("shape") if isinstance(value, dict) else None
    names = value.get("dim_names", []) if isinstance(value, dict) else None
    ok_shape = isinstance(shape, list) and shape and all(type(n) is int and n > 0 for n in shape)
    if not ok_shape or math.prod(shape) != world:  # type: ignore[arg-type]
        raise BundleFormatError(f"{path}: 'mesh.shape' {shown(shape)} must be positive integers multiplying to {world}")
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise BundleFormatError(f"{path}: 'mesh.dim_names' {shown(names)} must be a list of strings")
    return {"shape": list(shape), "dim_names": list(names)}  # type: ignore[arg-type]


_MISSING: Final = object()


def _field(document: dict[str, Any], key: str, path: Path, default: object) -> object:
    value = document.get(key, default)
    if value is _MISSING:
        raise BundleFormatError(f"{path}: required field {key!r} is missing; the manifest is damaged")
    return value


def _parse_int(
    document: dict[str, Any], key: str, path: Path, *, low: int, high: int | None, default: object = _MISSING
) -> int:
    value = _field(document, key, path, default)
    if type(value) is not int or value < low or (high is not None and value > high):
        bounds = f">= {low}" if high is None else f"in {low}..{high}"
        raise BundleFormatError(f"{path}: {key!r} is {shown(value)}, expected an integer {bounds}")
    return value


def _parse_str(document: dict[str, Any], key: str, path: Path, *, default: object = _MISSING) -> str:
    value = _field(document, key, path, default)
    if not isinstance(value, str) or len(value) > 4096:
        raise BundleFormatError(f"{path}: {key!r} is {shown(value)}, expected a string")
    return value


def _parse_choice(document: dict[str, Any], key: str, choices: tuple[str, ...], path: Path, *, default: str) -> str:
    value = _field(document, key, path, default)
    if value not in choices:
        raise BundleFormatError(f"{path}: {key!r} is {shown(value)}, expected one of {', '.join(choices)}")
    return str(value)
