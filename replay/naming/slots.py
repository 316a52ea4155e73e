"""Which of the bundle's slots a port tensor is compared with: slot rules of the map, then output structure.

A port's module may return ``(out, weights)`` where the reference returns ``out``, or a one-element
tuple where the reference returns a tensor: the first element pairs with the single output (its
gradient likewise) and the rest stay the port's own (listed, never compared).
"""

from __future__ import annotations

from collections.abc import Container

from parity_harness.replay.naming.mapping import RenameMap

__all__ = ["bundle_slots", "counterpart"]

_OUTPUTS = ("output", "grad_output")


def counterpart(slot: str, known: Container[str]) -> str | None:
    """The slot among ``known`` that ``slot`` pairs with: itself, else across tuple structure for outputs
    (``output.0`` <-> ``output``, ``output.0.logits`` <-> ``output.logits``); None when there is none."""
    if slot in known:
        return slot
    prefix, _, rest = slot.partition(".")
    if prefix not in _OUTPUTS:
        return None
    if rest == "0" or rest.startswith("0."):
        candidate = prefix + rest[1:]  # the first element of a tuple: drop the position
    else:
        candidate = f"{prefix}.0" + (f".{rest}" if rest else "")  # a bare value: the reference's first element
    return candidate if candidate in known else None


def bundle_slots(rename: RenameMap, module: str, slot: str, known: Container[str]) -> list[str]:
    """The bundle slots (among ``known``) that the port's ``slot`` of a call of bundle module ``module`` is
    compared with: renamed by the map's ``slots`` lines, then paired across output structure. Empty when none;
    several when the port passes one tensor for several of the reference's (every one must be recorded). A rename
    whose targets this call did not record falls back to the slot's own name (a glob wider than meant)."""
    for targets in (rename.slots(module, slot), (slot,)):
        found = [counterpart(target, known) for target in targets]
        present = [target for target in found if target is not None]
        if present and len(present) == len(found):
            return present
    return []
