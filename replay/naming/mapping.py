"""``--map`` files: rename the port's module paths to the bundle's.

One rule per line, ``REGEX => REPLACEMENT``; the first rule whose regex matches the *whole*
path wins; ``\\1`` refers to groups; a replacement of ``-`` means "no counterpart in the
bundle"; ``#`` starts a comment; a path no rule matches keeps its name. A parameter's name is its
module's mapped path plus the parameter's own name, unless a rule matches the whole parameter name
(a parameter renamed on its own: ``^(.*)\\.bias_u$ => \\1.pos_bias_u``).

A line ``waive GLOB`` names bundle records (bundle naming, shell-style glob) that the port has no
counterpart for: they are not compared and count as waived, not missing (``MODULE/*``: a module's own
records, not its children's).

A line ``slots GLOB PORT=REF ...`` renames the slots of the calls of the bundle modules matching GLOB
(bundle naming, shell-style glob): ``hidden_states=query`` says the port's argument ``hidden_states`` is
the reference's ``query`` (their gradients too); ``output.0=output`` does the same for output slots;
``hidden_states=query+key+value`` says the port passes one tensor where the reference passed three
equal ones: its value is compared with each, its gradient with their sum. The first line whose glob
matches a module and whose PORT starts the slot is used.
"""

from __future__ import annotations

import fnmatch
import os
import re
import stat
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Final

from parity_harness.common.errors import InputError, MapFileError
from parity_harness.replay.naming.bounded import time_limited

if TYPE_CHECKING:  # torch only types the model: ckpt-diff reads map files without importing it
    import torch

_MAX_MAP_BYTES = 16 << 20
"""Largest map file read (16 MiB of rules)."""
MAX_MAPPED_NAME: Final = 1024
"""Longest name a map rule's replacement may give (a module path or parameter name is far shorter): a replacement
repeating a group (``\\1\\1\\1...``) would otherwise make names as long as itself times the path."""

__all__ = [
    "MAX_MAPPED_NAME",
    "RenameMap",
    "SlotRule",
    "bundle_parameters",
    "describe_slot_rule",
    "literal_pattern",
    "parse_map",
    "read_map",
    "unused_rules",
    "unused_waiver_error",
]

_SEPARATOR = "=>"
_NO_COUNTERPART = "-"
_WAIVE = "waive"
_SLOTS = "slots"
_GRAD = "grad_"


@dataclass(frozen=True)
class SlotRule:
    """One ``PORT=REF[+REF...]`` of a ``slots`` line: the port's slot ``port`` is the reference's ``refs``."""

    modules: str
    """Shell-style glob over bundle module names."""
    port: str
    refs: tuple[str, ...]

    def applies(self, module: str, slot: str) -> bool:
        """Whether this rule renames ``slot`` (a forward slot, no ``grad_``) of a call of ``module``."""
        return (slot == self.port or slot.startswith(self.port + ".")) and fnmatch.fnmatchcase(module, self.modules)


@dataclass(frozen=True)
class RenameMap:
    """Ordered rename rules; an empty map renames nothing."""

    rules: tuple[tuple[re.Pattern[str], str], ...] = field(default_factory=tuple)
    waivers: tuple[str, ...] = ()
    """Globs of bundle record names the port has no counterpart for (``waive GLOB`` lines)."""
    slot_rules: tuple[SlotRule, ...] = ()
    """``slots`` lines, in order."""
    exact: tuple[tuple[str, str | None], ...] = ()
    """Literal renames of whole module paths or parameter names (None: no counterpart), looked up before the
    rules in constant time: ``--map auto`` writes one per module, thousands on a large model."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "_lookup", dict(self.exact))
        literals: dict[str, int] = {}
        patterned = []
        for position, (pattern, _) in enumerate(self.rules):
            literal = literal_pattern(pattern.pattern)
            if literal is None:
                patterned.append(position)
            else:
                literals.setdefault(literal, position)
        # A map saved by --map auto --save-map is one literal rule per module: looked up, not matched one by one.
        object.__setattr__(self, "_literals", literals)
        object.__setattr__(self, "_patterned", tuple(patterned))
        object.__setattr__(self, "_found", {})  # first_rule's answers: a replay asks for each name several times

    def first_rule(
        self,
        name: str,
        *,
        parameter: bool = False,
        wrapped: str | None = None,
        for_wrapped: frozenset[int] = frozenset(),
    ) -> tuple[bool, str | None, bool]:
        """Whether a rule names ``name`` (the first, in order, that fits it whole; a rule for modules that also fits a
        ``parameter`` name is no parameter rule), what it gives (None: no counterpart), and whether it is one of
        ``for_wrapped``: the rules written for a wrapped port's names, fitted to ``wrapped`` instead."""
        found: dict[tuple[object, ...], tuple[bool, str | None, bool]] = self._found  # type: ignore[attr-defined]
        key = (name, parameter, wrapped, for_wrapped)
        if key not in found:
            found[key] = self._first_rule(name, parameter, wrapped, for_wrapped)
        return found[key]

    def _first_rule(
        self, name: str, parameter: bool, wrapped: str | None, for_wrapped: frozenset[int]
    ) -> tuple[bool, str | None, bool]:
        literals: dict[str, int] = self._literals  # type: ignore[attr-defined]
        limit = len(self.rules)
        for spelled, of_wrapped in ((name, False), (wrapped, True)):
            position = None if spelled is None else literals.get(spelled)
            if position is not None and (position in for_wrapped) == of_wrapped:
                limit = min(limit, position)
        patterned: tuple[int, ...] = self._patterned  # type: ignore[attr-defined]
        tried = [*(p for p in patterned if p < limit), *([limit] if limit < len(self.rules) else [])]
        if not tried:  # most maps (none given, a saved --map auto): no regular expression to run, nor its timer
            return False, None, False
        with time_limited(name, MapFileError) as attempt:  # one timer for the rules tried on this name
            for position in tried:
                pattern, replacement = self.rules[position]
                attempt.pattern = pattern
                of_wrapped = position in for_wrapped
                spelled = wrapped if of_wrapped else name
                match = None if spelled is None else pattern.fullmatch(spelled)
                if match and not (parameter and pattern.fullmatch(spelled.rpartition(".")[0])):  # type: ignore[union-attr]
                    return True, _expand(match, replacement), of_wrapped
        return False, None, False

    def module_spellings(self, module: str) -> tuple[str, ...]:
        """The names a ``slots`` line's module glob is matched against, for bundle module ``module``: its own."""
        return (module,)

    def slot_rule(self, module: str, slot: str) -> SlotRule | None:
        """The ``slots`` rule that renames the port's ``slot`` of a call of bundle module ``module``, if any."""
        if not self.slot_rules:  # most maps: asked for every record of a replay
            return None
        forward, spellings = slot.removeprefix(_GRAD), self.module_spellings(module)
        return next((rule for rule in self.slot_rules if any(rule.applies(m, forward) for m in spellings)), None)

    def slots(self, module: str, slot: str) -> tuple[str, ...]:
        """The bundle's slot(s) for the port's ``slot`` of a call of bundle module ``module`` (``grad_`` slots
        follow their forward slot); several when the port passes one tensor for several of the reference's."""
        rule = self.slot_rule(module, slot)
        if rule is None:
            return (slot,)
        grad = _GRAD if slot.startswith(_GRAD) else ""
        rest = slot.removeprefix(_GRAD)[len(rule.port) :]
        return tuple(f"{grad}{ref}{rest}" for ref in rule.refs)

    def port_slot(self, module: str, ref_slot: str) -> str | None:
        """The port's forward slot for the reference's ``ref_slot``; None for the second and later slots of a sum
        (the port has one tensor for all of them)."""
        spellings = self.module_spellings(module)
        for rule in self.slot_rules:
            if not any(fnmatch.fnmatchcase(spelled, rule.modules) for spelled in spellings):
                continue
            for position, ref in enumerate(rule.refs):
                if ref_slot == ref or ref_slot.startswith(ref + "."):
                    return None if position else rule.port + ref_slot[len(ref) :]
        return ref_slot

    def module(self, path: str) -> str | None:
        """The bundle's name for a module path, or None when it has no counterpart."""
        named, mapped = self.named_module(path)
        return mapped if named else path

    def named_module(self, path: str) -> tuple[bool, str | None]:
        """Whether an exact rename or a rule names the module path ``path``, and the bundle's name it gives (None:
        no counterpart)."""
        lookup: dict[str, str | None] = self._lookup  # type: ignore[attr-defined]
        if path in lookup:
            return True, lookup[path]
        return self.first_rule(path)[:2]

    def named_parameter(self, name: str) -> tuple[bool, str | None]:
        """Whether an exact rename or a rule matching the whole parameter name (and not its module's path, e.g.
        ``^attn\\.bias_u$ => attn.pos_bias_u``) names the parameter ``name``, and the bundle's name it gives."""
        lookup: dict[str, str | None] = self._lookup  # type: ignore[attr-defined]
        if name in lookup:
            return True, lookup[name]
        return self.first_rule(name, parameter=True)[:2]

    def parameter(self, name: str) -> str | None:
        """The bundle's name for a parameter: what a rule for the whole parameter name gives
        (:meth:`named_parameter`); else its module's mapped path plus its own name."""
        named, mapped = self.named_parameter(name)
        if named:
            return mapped
        owner, _, leaf = name.rpartition(".")
        if not owner:
            return name
        module = self.module(owner)
        if module is None:
            return None
        return f"{module}.{leaf}" if module else leaf


def describe_slot_rule(rule: SlotRule) -> str:
    """A ``slots`` rule as a map file writes it."""
    refs = "+".join(ref.removeprefix("input.") for ref in rule.refs)
    return f"slots {rule.modules} {rule.port.removeprefix('input.')}={refs}"


def unused_rules(rename: RenameMap, names: Iterable[str]) -> list[str]:
    """The rules (as written) that match none of ``names`` (the port's module paths and parameter names)."""
    seen = list(names)
    known = set(seen)

    def used(pattern: re.Pattern[str]) -> bool:
        literal = literal_pattern(pattern.pattern)  # a saved --map auto map: thousands, each one path
        if literal is not None:
            return literal in known
        with time_limited(f"the {len(seen)} names of the port", MapFileError) as attempt:  # one timer: cheap
            attempt.pattern = pattern
            return any(map(pattern.fullmatch, seen))

    return [f"{pattern.pattern} => {replacement}" for pattern, replacement in rename.rules if not used(pattern)]


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
    except (re.error, OverflowError, RecursionError) as err:  # OverflowError: x{99999999999999999999}
        raise MapFileError(f"{source}:{number}: invalid regular expression {pattern!r}: {err}") from err
    if len(replacement) > MAX_MAPPED_NAME:
        raise MapFileError(f"{source}:{number}: replacement longer than {MAX_MAPPED_NAME} characters")
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


def unused_waiver_error(pattern: str, uncompared: Collection[str]) -> InputError:
    """The error for a waiver that waives nothing (a typo, or a waiver gone stale): refused, never ignored."""
    shown = sorted(uncompared)
    return InputError(
        f"waiver {pattern!r} (--waive or a map's 'waive' line) matches no record left uncompared; the uncompared ones "
        f"are {shown[:5]}{' ...' if len(shown) > 5 else ''}"
    )


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


_SLOT_NAME = re.compile(r"[^\s=+]+")


def _slot_path(name: str) -> str:
    """``hidden_states`` -> ``input.hidden_states``; ``output...`` stays as written."""
    return name if name == "output" or name.startswith("output.") else f"input.{name}"


def _parse_slots(line: str, number: int, source: str) -> list[SlotRule] | None:
    """``slots GLOB PORT=REF[+REF...] ...``: its rules, or None when the line is not a slots line."""
    text = line.split("#", 1)[0]
    words = text.split()
    if not words or words[0] != _SLOTS or _SEPARATOR in text:  # '^slots => x' renames a module named slots
        return None
    expected = "expected 'slots MODULE_GLOB PORT=REF[+REF...] ...' (e.g. 'slots layers.*.attn hidden_states=query')"
    if len(words) < 3 or "=" in words[1]:
        raise MapFileError(f"{source}:{number}: {expected}, got {line.strip()!r}")
    rules: list[SlotRule] = []
    for pair in words[2:]:
        port, sep, refs = pair.partition("=")
        names = refs.split("+")
        if not sep or not _SLOT_NAME.fullmatch(port) or not all(_SLOT_NAME.fullmatch(n) for n in names):
            raise MapFileError(f"{source}:{number}: {expected}; {pair!r} is not PORT=REF[+REF...]")
        kinds = {_slot_path(n).startswith("output") for n in (port, *names)}
        if len(kinds) != 1:
            raise MapFileError(f"{source}:{number}: {pair!r} pairs an input with an output slot")
        rule = SlotRule(words[1], _slot_path(port), tuple(_slot_path(n) for n in names))
        claimed = [ref for other in rules for ref in other.refs]
        if len(set(rule.refs)) != len(rule.refs) or set(rule.refs) & set(claimed):
            raise MapFileError(
                f"{source}:{number}: {pair!r} names a reference slot twice; each of the reference's slots pairs with "
                "one port slot (PORT=A+B says one port tensor stands for several reference ones, not the reverse)"
            )
        rules.append(rule)
    return rules


def parse_map(text: str, source: str = "<map>") -> RenameMap:
    """Parse the text of a map file: rename rules, ``waive`` and ``slots`` lines."""
    rules, waivers, slot_rules = [], [], []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.replace("\t", " ").isprintable():  # an escape sequence in a name would redraw the report's lines
            raise MapFileError(f"{source}:{number}: holds a control character ({line.strip()!r:.120})")
        waiver = _parse_waiver(line, number, source)
        slots = _parse_slots(line, number, source) if waiver is None else None
        if waiver is not None:
            waivers.append(waiver)
        elif slots is not None:
            slot_rules += slots
        elif (rule := _parse_rule(line, number, source)) is not None:
            rules.append(rule)
    return RenameMap(tuple(rules), tuple(waivers), tuple(slot_rules))


def read_map(path: str | os.PathLike[str]) -> RenameMap:
    """Read and parse a map file."""
    file = Path(path)
    try:
        if not stat.S_ISREG(file.stat().st_mode):  # a FIFO would block the read, a device never end it
            raise MapFileError(f"{file}: not a regular file; pass a text file of 'REGEX => REPLACEMENT' rules")
        with file.open("rb") as handle:
            raw = handle.read(_MAX_MAP_BYTES + 1)
        if len(raw) > _MAX_MAP_BYTES:
            raise MapFileError(f"{file}: larger than {_MAX_MAP_BYTES >> 20} MiB; a map file holds a few rules")
        text = raw.decode("utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise MapFileError(f"{file}: cannot read the map file: {err}") from err
    return parse_map(text, str(file))


_SPECIAL: Final = frozenset(".^$*+?{}[]|()\\")


def literal_pattern(pattern: str) -> str | None:
    """The one string a rule's pattern fits whole (anchors optional, every special character escaped), or None."""
    body = pattern.removeprefix("^")
    if body.endswith("$") and not body.endswith("\\$"):
        body = body[:-1]
    text, escaped = [], False
    for char in body:
        if escaped:
            if char.isalnum() or char == "_":  # \d, \w, \b: a class or an anchor, not a character
                return None
            text.append(char)
            escaped = False
        elif char == "\\":
            escaped = True
        elif char in _SPECIAL:
            return None
        else:
            text.append(char)
    return None if escaped else "".join(text)


def _expand(match: re.Match[str], replacement: str) -> str | None:
    """What a rule that matched gives: its replacement expanded, or None for ``-`` (no counterpart)."""
    if replacement == _NO_COUNTERPART:
        return None
    given = match.expand(replacement)
    if len(given) > MAX_MAPPED_NAME:  # ``\1\1\1...``: each name as long as the replacement times the path
        raise MapFileError(
            f"map rule {match.re.pattern!r} => {replacement[:60]!r} gives {match.string[:60]!r} a name of {len(given)} "
            f"characters (at most {MAX_MAPPED_NAME})"
        )
    return given


def bundle_parameters(
    model: torch.nn.Module, rename: RenameMap, known: Collection[str] = ()
) -> list[tuple[str, torch.nn.Parameter]]:
    """Each parameter of ``model`` once, under its bundle name. A parameter shared by several modules (a tied
    embedding and output head) has several names, and each side's recorder kept the first it registered: it
    takes the first of its names whose mapping is in ``known`` (the bundle's), else its first name's mapping.
    Parameters mapped to no counterpart are left out."""
    aliases: dict[int, tuple[torch.nn.Parameter, list[str]]] = {}
    sources: dict[str, tuple[int, str]] = {}  # bundle name -> the first port parameter mapped to it, and its name
    for name, param in model.named_parameters(remove_duplicate=False):
        mapped = rename.parameter(name)
        if mapped is None:
            continue
        first = sources.setdefault(mapped, (id(param), name))
        if first[0] != id(param):
            raise MapFileError(
                f"--map: the port's parameters {first[1]!r} and {name!r} are both mapped to the bundle's {mapped!r}, "
                "so one of them would be compared with another's record; give each its own name, or map the one "
                "with no counterpart to '-'"
            )
        aliases.setdefault(id(param), (param, []))[1].append(mapped)
    return [(next((n for n in names if n in known), names[0]), param) for param, names in aliases.values()]
