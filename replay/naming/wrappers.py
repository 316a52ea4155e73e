"""Names that wrappers add: a wrapped model and an unwrapped one compare without a map.

=================================  =====================================================
component                          added by
=================================  =====================================================
``module.`` (leading)              ``DistributedDataParallel``, ``DataParallel``
``_orig_mod.`` (leading)           ``torch.compile``
``_fsdp_wrapped_module.``          FSDP1 (``FullyShardedDataParallel``); FSDP2 adds none
``_checkpoint_wrapped_module.``    activation checkpointing's ``checkpoint_wrapper``
=================================  =====================================================

A leading component counts as a wrapper only when *every* name on that side starts with it (a
real submodule called ``module`` next to others is left alone), when the side shows it to be one (the port's
module of a wrapper class; in the bundle, the recorded class of the captured model and of each wrapped module: a
root whose only child is named ``module`` is no DDP unless it is one), and when the other side's
leading wrappers differ (alike, names pair as they are). Names are normalised on both sides only when the
bundle's normalised names are unambiguous, and the report says what was normalised, so that normalisation never
hides a real rename.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Final

import torch

from parity_harness.common.format.bundle.schema import BundleIndex
from parity_harness.replay.naming.mapping import RenameMap, literal_pattern

__all__ = ["INNER_WRAPPERS", "ROOT_WRAPPERS", "WrapperRenameMap", "normalize_wrappers", "strip_wrappers"]

ROOT_WRAPPERS: Final = {"module": "DDP/DataParallel", "_orig_mod": "torch.compile"}
INNER_WRAPPERS: Final = {"_fsdp_wrapped_module": "FSDP1", "_checkpoint_wrapped_module": "activation checkpointing"}


def _roots(names: list[str]) -> tuple[str, ...]:
    """The leading wrapper components every name starts with, outermost first."""
    found: list[str] = []
    remaining = names
    while remaining:
        first = remaining[0].split(".", 1)[0]
        if first not in ROOT_WRAPPERS or not all(n == first or n.startswith(first + ".") for n in remaining):
            break
        found.append(first)
        remaining = [n[len(first) + 1 :] for n in remaining if n != first]
    return tuple(found)


_ROOT_TYPES: Final = {"module": ("DataParallel", "DistributedDataParallel"), "_orig_mod": ("OptimizedModule",)}
"""The classes whose child a root wrapper component names: a model of another class with a child named ``module``
does work of its own around it."""


def _wrapper_roots(model: torch.nn.Module, roots: tuple[str, ...]) -> tuple[str, ...]:
    """The leading ``roots`` the port's module objects show to be wrappers (a DataParallel, or a subclass of one,
    around the model), in order; the first that is not ends them."""
    kept: list[str] = []
    holder = model
    for root in roots:
        if not any(kind.__name__ in _ROOT_TYPES[root] for kind in type(holder).__mro__):
            break
        kept.append(root)
        holder = getattr(holder, root)
    return tuple(kept)


def _bundle_wrapper_roots(roots: tuple[str, ...], index: BundleIndex) -> tuple[str, ...]:
    """The leading ``roots`` the bundle shows to be wrappers: the captured model's class (``run.extra``) for the
    first, each wrapped module's recorded class for the next (``module._orig_mod`` under DataParallel around
    torch.compile). A bundle written before that class was recorded, or a call not recorded (``--layers``), leaves
    the names to decide."""
    classes = index.run.root_classes()
    if classes is None:
        return roots
    kept: list[str] = []
    for count, root in enumerate(roots, start=1):
        if not any(name in _ROOT_TYPES[root] for name in classes):
            break
        kept.append(root)
        call = next((c for c in index.calls if c.module == ".".join(roots[:count])), None)
        if call is None:
            return (*kept, *roots[count:])
        classes = [call.type.rpartition(".")[2]]
    return tuple(kept)


def strip_wrappers(name: str, roots: tuple[str, ...]) -> str:
    """``name`` without the given leading wrappers and without inner wrapper components (nor torch.compile's
    ``_orig_mod`` right after one: ``checkpoint_wrapper(torch.compile(block))``)."""
    for root in roots:
        name = "" if name == root else name.removeprefix(root + ".")
    kept: list[str] = []
    after_inner = False
    for part in name.split("."):
        if part in INNER_WRAPPERS or (after_inner and part == "_orig_mod"):
            after_inner = True
            continue
        after_inner = False
        kept.append(part)
    return ".".join(kept)


def _inner(names: Iterable[str]) -> set[str]:
    return {part for name in names for part in name.split(".") if part in INNER_WRAPPERS}


@dataclass(frozen=True)
class WrapperRenameMap(RenameMap):
    """A rename map followed by wrapper normalisation: port name -> mapped -> the bundle's own spelling.

    A map is mostly written for the unwrapped model (``^encoder\\.layer\\.(\\d+)$``, not
    ``^module\\.encoder...`` under DataParallel): each rule is matched against the port's names without its
    wrappers, as the unwrapped port's would be, except a rule written for the wrapped names (one that fits some of
    them and none of the unwrapped ones), which is matched against the wrapped names as it always was. What a
    rule gives is a bundle name, used as it is."""

    port_roots: tuple[str, ...] = ()
    bundle_roots: tuple[str, ...] = ()
    bundle_modules: dict[str, str] = field(default_factory=dict)
    """Normalised name -> the bundle's name, for modules."""
    bundle_params: dict[str, str] = field(default_factory=dict)
    """Normalised name -> the bundle's name, for parameters (and the buffers named as they are)."""
    hidden: frozenset[str] = frozenset()
    """Bundle modules that are wrappers (:func:`_wrapper_modules`): no port module is one."""
    around: dict[str, str] = field(default_factory=dict)
    """A bundle wrapper around a module -> the wrapped module: a record of the wrapper goes as a wrapper's only where
    the wrapped module has the same one (under reentrant checkpointing the wrapper alone records gradients)."""
    port_wrappers: frozenset[str] = frozenset()
    """The port's wrappers around a module: not tapped, or the wrapped module's calls would count twice."""
    wrapped_rules: frozenset[int] = frozenset()
    """Positions of the rules written for the port's wrapped names."""

    def module(self, path: str) -> str | None:
        if path in self.port_wrappers:
            return None
        named, mapped, wrapped = self._renamed(path, parameter=False)
        if not named:
            mapped = strip_wrappers(path, self.port_roots)
        elif mapped is not None and wrapped:  # a rule for the wrapped names may keep the wrapper
            mapped = strip_wrappers(mapped, self.port_roots)
        if not mapped:
            return None  # no counterpart, or the port's wrapped root: the bundle's root is not a record
        return self.bundle_modules.get(mapped, mapped)

    def parameter(self, name: str) -> str | None:
        named, mapped, wrapped = self._renamed(name, parameter=True)
        if named:
            if mapped is None:
                return None
            return self._bundle_parameter(strip_wrappers(mapped, self.port_roots) if wrapped else mapped)
        owner, _, leaf = name.rpartition(".")
        if owner and strip_wrappers(owner, self.port_roots):
            module = self.module(owner)
            return None if module is None else self._bundle_parameter(f"{module}.{leaf}")
        return self._bundle_parameter(strip_wrappers(name, self.port_roots))  # the root's own (a ViT's pos_embed)

    def _bundle_parameter(self, name: str) -> str:
        """The bundle's spelling of a parameter name: as it is where the bundle has it, else through the bundle's
        wrappers."""
        known: frozenset[str] = self._recorded  # type: ignore[attr-defined]
        if name in known:
            return name
        # A checkpoint wrapper at the bundle's root names parameters without itself (its named_parameters strips its
        # prefix) where its modules keep it: the parameter of a module under it is found by its normalised name.
        return self.bundle_params.get(name) or self.bundle_params.get(strip_wrappers(name, self.bundle_roots), name)

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "_recorded", frozenset(self.bundle_params.values()))
        object.__setattr__(self, "_normal", {bundle: normal for normal, bundle in self.bundle_modules.items()})

    def module_spellings(self, module: str) -> tuple[str, ...]:
        """A bundle module's own name and its name without the bundle's wrappers: a map's ``slots`` line is written
        for the unwrapped model as its rules are."""
        normal: dict[str, str] = self._normal  # type: ignore[attr-defined]
        return (module, normal[module]) if normal.get(module, module) != module else (module,)

    def _renamed(self, name: str, *, parameter: bool) -> tuple[bool, str | None, bool]:
        """Whether the map renames the port's ``name`` (an exact rename of it as it is or unwrapped, else the first
        rule fitting the spelling it is written for), what it gives, and whether a rule for the wrapped names did."""
        unwrapped = strip_wrappers(name, self.port_roots)
        exact: dict[str, str | None] = self._lookup  # type: ignore[attr-defined]
        for key in (name, unwrapped):
            if key in exact:
                return True, exact[key], False
        return self.first_rule(unwrapped, parameter=parameter, wrapped=name, for_wrapped=self.wrapped_rules)


def _rules_for_wrapped_names(rename: RenameMap, names: list[str], roots: tuple[str, ...]) -> frozenset[int]:
    """The rules that fit some of the port's wrapped ``names`` and none of them unwrapped: written for the wrapped
    spelling (before maps applied to the unwrapped names, the only one that worked). A rule naming one literal path
    (``--save-map`` writes one per module) is looked up, not matched against every name."""
    unwrapped = [strip_wrappers(name, roots) for name in names]
    wrapped = [name for name, bare in zip(names, unwrapped, strict=True) if name != bare]
    wrapped_set, unwrapped_set = set(wrapped), set(unwrapped)
    found = set()
    for position, (pattern, _) in enumerate(rename.rules):
        literal = literal_pattern(pattern.pattern)
        if literal is not None:
            fits = literal in wrapped_set and literal not in unwrapped_set
        else:
            fits = any(map(pattern.fullmatch, wrapped)) and not any(map(pattern.fullmatch, unwrapped))
        if fits:
            found.add(position)
    return frozenset(found)


_WRAPPER_TYPES: Final = frozenset({"CheckpointWrapper", "FullyShardedDataParallel"})
"""The classes of the wrappers around a module (their names, so that neither is imported): a module of another class
with a child of the wrapped module's name does work of its own."""


def _wrapper_modules(modules: list[str], roots: tuple[str, ...], around: dict[str, str]) -> frozenset[str]:
    """The modules that are wrappers, whose records the other side's modules need not have: the root's (``module``
    under DDP, ``module._orig_mod`` under DataParallel around torch.compile) and each around a module (``around``)."""
    return frozenset(name for name in modules if not strip_wrappers(name, roots)) | frozenset(around)


def _around(types: dict[str, str]) -> dict[str, str]:
    """Each wrapper around a module (activation checkpointing's, FSDP1's; by module path -> class name) -> the module
    it wraps, recorded under ``<wrapper>._checkpoint_wrapped_module``: the other side's module of that name."""
    return {
        name: f"{name}.{inner}"
        for name, kind in types.items()
        if kind.rpartition(".")[2] in _WRAPPER_TYPES
        for inner in INNER_WRAPPERS
        if f"{name}.{inner}" in types
    }


def normalize_wrappers(rename: RenameMap, model: torch.nn.Module, index: BundleIndex) -> tuple[RenameMap, str | None]:
    """``rename`` extended to see through wrapper prefixes on either side, and a note for the report.

    Returns ``rename`` unchanged (and no note) when neither side has wrapper names, or when
    normalising would make two bundle names collide (then the note says so).
    """
    port_modules = [path for path, _ in model.named_modules() if path]
    port_names = [
        *port_modules,
        *(name for name, _ in model.named_parameters(remove_duplicate=False)),
        *(name for name, _ in model.named_buffers(remove_duplicate=False)),  # a buffer standing for a parameter
    ]
    bundle_modules = sorted({call.module for call in index.calls})
    buffers = index.buffers
    recorded_buffers = () if buffers is None else (*buffers.changed, *buffers.unchanged)
    bundle_params = sorted({*index.params, *index.grads, *recorded_buffers})  # buffers are named as parameters are
    port_roots = _wrapper_roots(model, _roots(port_modules))
    bundle_roots = _roots(bundle_modules or bundle_params)
    bundle_roots = _bundle_wrapper_roots(bundle_roots, index) if bundle_modules else bundle_roots
    if port_roots == bundle_roots:  # the same on both sides pairs as it is: a real child named ``module`` is no DDP
        port_roots = bundle_roots = ()
    port_inner, bundle_inner = _inner(port_names), _inner([*bundle_modules, *bundle_params])
    if not (port_roots or bundle_roots or port_inner or bundle_inner):
        return rename, None
    bundle_around = _around({call.module: call.type for call in index.calls})
    hidden = _wrapper_modules(bundle_modules, bundle_roots, bundle_around)
    modules: dict[str, str] = {}
    for name in bundle_modules:
        normal = strip_wrappers(name, bundle_roots)
        if name in hidden:
            continue
        if normal in modules:
            return rename, f"wrapper names not normalised: bundle modules {modules[normal]!r} and {name!r} collide"
        modules[normal] = name
    # A checkpoint wrapper at the root names its parameters without itself: what follows (torch.compile's
    # ``_orig_mod``) leads every parameter name, a root of theirs alone.
    param_roots = bundle_roots or _roots(bundle_params)
    params = {strip_wrappers(name, param_roots): name for name in bundle_params}
    described = []
    for side, roots, inner in (("bundle", bundle_roots, bundle_inner), ("port", port_roots, port_inner)):
        parts = [f"'{c}.' ({ROOT_WRAPPERS[c]})" for c in roots] + [f"'{c}.' ({INNER_WRAPPERS[c]})" for c in inner]
        described.append(f"{side}: {', '.join(parts) or 'none'}")
    note = "wrapper names normalised on both sides (" + "; ".join(described) + ")"
    return (
        WrapperRenameMap(
            rename.rules,
            rename.waivers,
            rename.slot_rules,
            rename.exact,
            port_roots=port_roots,
            bundle_roots=bundle_roots,
            bundle_modules=modules,
            bundle_params=params,
            hidden=hidden,
            around=bundle_around,
            port_wrappers=frozenset(_around({path: type(module).__name__ for path, module in model.named_modules()})),
            wrapped_rules=_rules_for_wrapped_names(rename, port_names, port_roots),
        ),
        note,
    )
