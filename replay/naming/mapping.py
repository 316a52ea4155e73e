"""``--map`` files: rename the port's module paths to the bundle's.

One rule per line, ``REGEX => REPLACEMENT``; the first rule whose regex matches the *whole*
path wins; ``\\1`` refers to groups; a replacement of ``-`` means "no counterpart in the
bundle"; ``#`` starts a comment; a path no rule matches keeps its name. A parameter's name is its
module's mapped path plus the parameter's own name, unless a rule matches the whole parameter name
(a parameter renamed on its own: ``^(.*)\\.bias_u$ => \\1.pos_bias_u``).

A line ``waive GLOB`` names bundle records (bundle naming, shell-style glob) that the port has no
counterpart for: they are not compared and count as waived, not missing (``MODULE/*``: a module's own
records, not its children's).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from parity_harness.common.errors import MapFileError

__all__ = ["RenameMap", "parse_map", "read_map", "unused_rules"]

_SEPARATOR = "=>"
_NO_COUNTERPART = "-"
_WAIVE = "waive"


@dataclass(frozen=True)
class RenameMap:
    """Ordered rename rules; an empty map renames nothing."""

    rules: tuple[tuple[re.Pattern[str], str], ...] = field(default_factory=tuple)
    waivers: tuple[str, ...] = ()
    """Globs of bundle record names the port has no counterpart for (``waive GLOB`` lines)."""

    def module(self, path: str) -> str | None:
        """The bundle's name for a module path, or None when it has no counterpart."""
        for pattern, replacement in self.rules:
            match = pattern.fullmatch(path)
            if match:
                return None if replacement == _NO_COUNTERPART else match.expand(replacement)
        return path

    def parameter(self, name: str) -> str | None:
        """The bundle's name for a parameter: what the first rule matching the whole parameter name (and not
        its module's path) gives, e.g. ``^attn\\.bias_u$ => attn.pos_bias_u``; else its module's mapped path
        plus its own name."""
        owner, _, leaf = name.rpartition(".")
        for pattern, replacement in self.rules:
            match = pattern.fullmatch(name)
            if match and not pattern.fullmatch(owner):  # a rule for modules that also fits the name: not a param rule
                return None if replacement == _NO_COUNTERPART else match.expand(replacement)
        if not owner:
            return name
        mapped = self.module(owner)
        if mapped is None:
            return None
        return f"{mapped}.{leaf}" if mapped else leaf


def unused_rules(rename: RenameMap, names: Iterable[str]) -> list[str]:
    """The rules (as written) that match none of ``names`` (the port's module paths and parameter names)."""
    seen = list(names)
    return [
        f"{pattern.pattern} => {replacement}"
        for pattern, replacement in rename.rules
        if not any(pattern.fullmatch(name) for name in seen)
    ]


def _parse_rule(line: str, number: int, source: str) -> tuple[re.Pattern[str], str] | None:
    text = line.split("#", 1)[0].strip()
    if not text:
        return None
    pattern, sep, replacement = text.partition(_SEPARATOR)
    pattern, replacement = pattern.strip(), replacement.strip()
    if not sep or not pattern or not replacement:
        raise MapFileError(
            f"{source}:{number}: expected 'REGEX => REPLACEMENT' (or '=> -' for no counterpart), got {line.strip()!r}"
        )
    try:
        compiled = re.compile(pattern)
    except re.error as err:
        raise MapFileError(f"{source}:{number}: invalid regular expression {pattern!r}: {err}") from err
    if replacement != _NO_COUNTERPART:
        _check_template(compiled, replacement, f"{source}:{number}")
    return compiled, replacement


def _check_template(compiled: re.Pattern[str], replacement: str, where: str) -> None:
    """Expand the replacement once now; ``re`` would only complain at the first matching path."""
    names = {index: name for name, index in compiled.groupindex.items()}
    same_groups = "".join(f"(?P<{names[i]}>)" if i in names else "()" for i in range(1, compiled.groups + 1))
    try:
        re.sub(same_groups, replacement, "", count=1)
    except (re.error, IndexError) as err:
        raise MapFileError(
            f"{where}: replacement {replacement!r} is invalid for a regex with {compiled.groups} group(s): {err}"
        ) from err


def _parse_waiver(line: str, number: int, source: str) -> str | None:
    """``waive GLOB``: the glob, or None when the line is not a waiver."""
    text = line.split("#", 1)[0].strip()
    keyword, _, glob = text.partition(" ")
    if keyword != _WAIVE:
        return None
    if not glob.strip() or _SEPARATOR in glob:
        raise MapFileError(
            f"{source}:{number}: expected 'waive GLOB' (a bundle record name pattern), got {line.strip()!r}"
        )
    return glob.strip()


def parse_map(text: str, source: str = "<map>") -> RenameMap:
    """Parse the text of a map file: rename rules and ``waive`` lines."""
    rules, waivers = [], []
    for number, line in enumerate(text.splitlines(), start=1):
        waiver = _parse_waiver(line, number, source)
        if waiver is not None:
            waivers.append(waiver)
        elif (rule := _parse_rule(line, number, source)) is not None:
            rules.append(rule)
    return RenameMap(tuple(rules), tuple(waivers))


def read_map(path: str | os.PathLike[str]) -> RenameMap:
    """Read and parse a map file."""
    file = Path(path)
    try:
        text = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise MapFileError(f"{file}: cannot read the map file: {err}") from err
    return parse_map(text, str(file))
