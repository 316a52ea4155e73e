"""Atomic files: written beside their target under a temporary name and renamed into place only when
complete, so that a reader (or a crash) never sees half of one. Every format and report goes through here."""

from __future__ import annotations

import os
import re
import uuid
from pathlib import Path

from parity_harness.common.errors import BundleExistsError, InputError

__all__ = [
    "check_output",
    "commit",
    "sibling_temp",
    "stale_temporaries",
    "write_bytes_atomically",
    "write_text_atomically",
]


def sibling_temp(path: str | os.PathLike[str]) -> Path:
    """A fresh hidden name in ``path``'s folder (same file system: the final rename is atomic)."""
    target = Path(path)
    return target.with_name(f".{target.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")


def commit(tmp: Path, target: Path, *, overwrite: bool) -> None:
    """Move a complete ``tmp`` to ``target``; without ``overwrite`` an existing target is never replaced.

    Raises:
        BundleExistsError: ``target`` exists (or appeared meanwhile) and ``overwrite`` is false.
    """
    if overwrite:
        os.replace(tmp, target)
        return
    try:
        os.link(tmp, target)  # fails if the target appeared meanwhile: never clobber
    except FileExistsError as err:
        tmp.unlink(missing_ok=True)
        raise BundleExistsError(f"{target}: file appeared during capture; pass --overwrite") from err
    except OSError:  # a file system without hard links: the check and the rename are then two steps
        if target.exists():
            tmp.unlink(missing_ok=True)
            raise BundleExistsError(f"{target}: file exists; pass --overwrite to replace it") from None
        os.replace(tmp, target)
        return
    tmp.unlink()


def write_text_atomically(path: str | os.PathLike[str], text: str, *, what: str, noun: str = "file") -> None:
    """Write ``text`` to ``path`` (replacing it) all at once; through a symbolic link to its target, and straight
    into a FIFO or device (``/dev/stdout``), which are never replaced.

    Raises:
        InputError: the file cannot be written; the message starts with ``what``.
    """
    write_bytes_atomically(path, text.encode("utf-8"), what=what, noun=noun)


def write_bytes_atomically(path: str | os.PathLike[str], data: bytes, *, what: str, noun: str = "file") -> None:
    """:func:`write_text_atomically` for bytes (an image)."""
    target = Path(path).resolve() if Path(path).is_symlink() else Path(path)  # a link stays, its target is written
    if target.exists() and not target.is_file():  # /dev/stdout, a FIFO, a terminal: written through, never replaced
        if target.is_dir():
            raise InputError(f"{what}: is a folder; give a file path")
        try:
            with target.open("wb") as handle:
                handle.write(data)
        except OSError as err:
            raise InputError(f"{what}: cannot write the {noun}: {err}") from err
        return
    tmp = sibling_temp(target)
    try:
        tmp.write_bytes(data)
        os.replace(tmp, target)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        raise InputError(f"{what}: cannot write the {noun}: {err}") from err


def check_output(path: str | os.PathLike[str], *, what: str, overwrite: bool | None = None) -> None:
    """Refuse, before any work is done, an output path that cannot be written: its folder missing or not writable,
    a folder at the path, or, for a bundle (``overwrite`` given), anything but a regular file and (``overwrite``
    False) a file already there. ``what`` names the option.

    Raises:
        InputError: the folder or the path is unusable.
        BundleExistsError: a file is there and ``overwrite`` is False.
    """
    target = Path(path)
    folder = target.parent
    if not folder.is_dir():
        raise InputError(f"{what} {target}: the folder {folder} does not exist; create it first")
    if target.is_dir():
        raise InputError(f"{what} {target}: is a folder; give a file path")
    if overwrite is not None and (target.is_symlink() or (target.exists() and not target.is_file())):
        raise InputError(f"{what} {target}: not a regular file (a link, FIFO or device); give the bundle's own path")
    if overwrite is False and target.exists():
        raise BundleExistsError(f"{target}: file exists; pass --overwrite to replace it")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise InputError(f"{what} {target}: the folder {folder} is not writable")


def stale_temporaries(path: str | os.PathLike[str]) -> list[Path]:
    """Hidden temporaries of ``path`` (``sibling_temp``) whose process is gone: left by a killed run."""
    target = Path(path)
    pattern = re.compile(rf"\.{re.escape(target.name)}\.(\d+)\.[0-9a-f]{{8}}\.tmp")
    stale = []
    try:
        candidates = list(target.parent.iterdir())
    except OSError:
        return []
    for candidate in candidates:
        match = pattern.fullmatch(candidate.name)
        if match and not _alive(int(match.group(1))):
            stale.append(candidate)
    return sorted(stale)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    return True
