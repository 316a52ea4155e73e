"""Atomic files: written beside their target under a temporary name and renamed into place only when
complete, so that a reader (or a crash) never sees half of one. Every format and report goes through here."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

from parity_harness.common.errors import BundleExistsError, InputError

__all__ = ["commit", "sibling_temp", "write_text_atomically"]


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
    """Write ``text`` to ``path`` (replacing it) all at once.

    Raises:
        InputError: the file cannot be written; the message starts with ``what``.
    """
    tmp = sibling_temp(path)
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        raise InputError(f"{what}: cannot write the {noun}: {err}") from err
