"""What a module's lists, dicts, sets and tuples held at one point of a replay, to put back in place.

A forward may append to a history it keeps in a list, count in a ``defaultdict``, keep a tensor in a dict and add to
it in place: state the next run (another rank's, the rounding check's float64 rerun, the caller's next replay) would
otherwise start from. Each container is put back as the same object holding the same items (whoever else holds it
sees the same), nested ones too; a dense tensor among the items that changed its values is replaced by a copy of the
old ones, never written in place (it may view a weight). Containers are copied once each, however many attributes
hold them, and one that holds what it held is left alone.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Final

import torch

__all__ = ["HeldItems", "hold", "put_back"]

MAX_ITEMS: Final = 1 << 16
"""Items of the largest container kept (a vocabulary is no state a forward moves; copying it would cost seconds)."""
_MAX_DEPTH: Final = 4
"""Containers nested deeper are not looked into."""
_KINDS: Final = (list, dict, set, tuple)


@dataclass
class HeldItems:
    """One container and what it held: its items (the same objects), and for each item that is itself a container
    or a dense tensor, what that held."""

    container: Any
    items: list[Any]
    """A list's or tuple's items, a dict's ``(key, value)`` pairs, a set's elements."""
    inner: dict[int, HeldItems | torch.Tensor] = field(default_factory=dict)
    """Position in ``items`` -> what the container there held, or a copy of the tensor's values there."""


def is_container(value: object) -> bool:
    """A list, dict, set or tuple (their subclasses too: a ``defaultdict``, an ``OrderedDict``)."""
    return isinstance(value, _KINDS)


def hold(container: Any, memo: dict[int, HeldItems], depth: int = 0) -> HeldItems | None:
    """What ``container`` holds now (None when it is too large to keep); ``memo`` keeps each container once."""
    if id(container) in memo:
        return memo[id(container)]
    if len(container) > MAX_ITEMS:
        return None
    items = list(container.items()) if isinstance(container, dict) else list(container)
    held = memo[id(container)] = HeldItems(container, items)
    if depth >= _MAX_DEPTH or isinstance(container, (set, frozenset)):
        return held
    for position, value in enumerate(_values(container, items)):
        if is_container(value):
            inner = hold(value, memo, depth + 1)
            if inner is not None:
                held.inner[position] = inner
        elif isinstance(value, torch.Tensor) and _dense(value):
            held.inner[position] = value.detach().clone()
    return held


def put_back(held: HeldItems, done: set[int] | None = None) -> None:
    """``held.container`` holding what it held (each container once, however many hold it)."""
    done = set() if done is None else done
    if id(held.container) in done:
        return
    done.add(id(held.container))
    container, items = held.container, list(held.items)
    for position, inner in held.inner.items():
        if isinstance(inner, HeldItems):
            put_back(inner, done)
            continue
        tensor = _values(container, items)[position]
        if not _holds(tensor, inner) and not isinstance(container, tuple):  # a tuple's tensor stays as it is
            copy = inner.clone().requires_grad_(tensor.requires_grad)
            items[position] = (items[position][0], copy) if isinstance(container, dict) else copy
    if not isinstance(container, tuple) and not _same_items(container, items):
        _refill(container, items)


def _values(container: Any, items: list[Any]) -> list[Any]:
    return [value for _, value in items] if isinstance(container, dict) else items


def _same_items(container: Any, items: list[Any]) -> bool:
    """Whether the container holds exactly ``items`` (the same objects, in order)."""
    now: Iterable[Any] = container.items() if isinstance(container, dict) else container
    if len(container) != len(items):
        return False
    if isinstance(container, (set, frozenset)):
        return all(item in container for item in items)
    if isinstance(container, dict):
        return all(k is k2 and v is v2 for (k, v), (k2, v2) in zip(now, items, strict=True))
    return all(a is b for a, b in zip(now, items, strict=True))


def _refill(container: Any, items: list[Any]) -> None:
    if isinstance(container, list):
        container[:] = items
    elif isinstance(container, dict):
        container.clear()
        container.update(items)
    else:
        container.clear()
        container.update(items)


def _dense(value: torch.Tensor) -> bool:
    return value.layout == torch.strided and not value.is_meta


def _holds(tensor: Any, values: torch.Tensor) -> bool:
    """Whether ``tensor`` still holds ``values`` (shape, dtype, device and every element)."""
    if not isinstance(tensor, torch.Tensor) or not _dense(tensor):
        return False
    same_kind = (tensor.shape, tensor.dtype, tensor.device) == (values.shape, values.dtype, values.device)
    return same_kind and bool(torch.equal(tensor, values))
