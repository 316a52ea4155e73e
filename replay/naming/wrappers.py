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
real submodule called ``module`` next to others is left alone). Names are normalised on both
sides only when the bundle's normalised names are unambiguous, and the report says what was
normalised, so that normalisation never hides a real rename.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Final

import torch

from parity_harness.common.format.bundle.schema import BundleIndex
from parity_harness.replay.naming.mapping import RenameMap

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


def strip_wrappers(name: str, roots: tuple[str, ...]) -> str:
    """``name`` without the given leading wrappers and without inner wrapper components."""
    for root in roots:
        name = "" if name == root else name.removeprefix(root + ".")
    return ".".join(part for part in name.split(".") if part not in INNER_WRAPPERS)


def _inner(names: Iterable[str]) -> set[str]:
    return {part for name in names for part in name.split(".") if part in INNER_WRAPPERS}


@dataclass(frozen=True)
class WrapperRenameMap(RenameMap):
    """A rename map followed by wrapper normalisation: port name -> mapped -> the bundle's own spelling."""

    port_roots: tuple[str, ...] = ()
    bundle_modules: dict[str, str] = field(default_factory=dict)
    """Normalised name -> the bundle's name, for modules."""
    bundle_params: dict[str, str] = field(default_factory=dict)
    hidden: frozenset[str] = frozenset()
    """Bundle modules that are a wrapper's inner root (``module``): no port module is one."""

    def module(self, path: str) -> str | None:
        named, mapped = self._port_named(self.named_module, path)
        if not named:
            mapped = path
        if mapped is None:
            return None
        normal = strip_wrappers(mapped, self.port_roots)
        if not normal:
            return None  # the port's wrapped root: the bundle's root is not a record
        return self.bundle_modules.get(normal, normal)

    def parameter(self, name: str) -> str | None:
        named, mapped = self._port_named(self.named_parameter, name)
        if not named:
            owner, _, leaf = name.rpartition(".")
            if owner and strip_wrappers(owner, self.port_roots):
                module = self.module(owner)
                if module is None:
                    return None
                mapped = f"{module}.{leaf}"
            else:  # the root's own parameter (a ViT's pos_embed), under the port's wrappers or not
                mapped = strip_wrappers(name, self.port_roots)
        if mapped is None:
            return None
        normal = strip_wrappers(mapped, self.port_roots)
        return self.bundle_params.get(normal, normal)

    def _port_named(self, named: Callable[[str], tuple[bool, str | None]], name: str) -> tuple[bool, str | None]:
        """What the map's renames make of the port's ``name`` as it is, else of the name without the port's
        wrappers: a map is mostly written for the unwrapped model (its rules fit ``encoder.layer.0``, not
        ``module.encoder.layer.0`` under DataParallel), and one written for the wrapped port keeps working."""
        found = named(name)
        unwrapped = strip_wrappers(name, self.port_roots)
        if found[0] or unwrapped == name or not unwrapped:
            return found
        return named(unwrapped)


def normalize_wrappers(rename: RenameMap, model: torch.nn.Module, index: BundleIndex) -> tuple[RenameMap, str | None]:
    """``rename`` extended to see through wrapper prefixes on either side, and a note for the report.

    Returns ``rename`` unchanged (and no note) when neither side has wrapper names, or when
    normalising would make two bundle names collide (then the note says so).
    """
    port_modules = [path for path, _ in model.named_modules() if path]
    bundle_modules = sorted({call.module for call in index.calls})
    buffers = index.buffers
    recorded_buffers = () if buffers is None else (*buffers.changed, *buffers.unchanged)
    bundle_params = sorted({*index.params, *index.grads, *recorded_buffers})  # buffers are named as parameters are
    port_roots, bundle_roots = _roots(port_modules), _roots(bundle_modules or bundle_params)
    port_inner, bundle_inner = _inner(port_modules), _inner(bundle_modules)
    if not (port_roots or bundle_roots or port_inner or bundle_inner):
        return rename, None
    modules: dict[str, str] = {}
    for name in bundle_modules:
        normal = strip_wrappers(name, bundle_roots)
        if normal in modules:
            return rename, f"wrapper names not normalised: bundle modules {modules[normal]!r} and {name!r} collide"
        modules[normal] = name
    params = {strip_wrappers(name, bundle_roots): name for name in bundle_params}
    modules.pop("", None)
    hidden = frozenset({name for name in bundle_modules if not strip_wrappers(name, bundle_roots)})
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
            bundle_modules=modules,
            bundle_params=params,
            hidden=hidden,
        ),
        note,
    )
