"""What a module's lists, dicts, sets, tuples and deques held at one point of a run, to put back in place.

A forward may append to a history it keeps in a list, count in a ``defaultdict``, keep a tensor in a dict and add to
it in place: state the next run (another rank's, the rounding check's float64 rerun, the caller's next capture or
replay) would otherwise start from. Each container is put back as the same object holding the same items (whoever
else holds it sees the same), nested ones too; a dense tensor among the items that changed its values is replaced by a
copy of the old ones, never written in place (it may view a weight). Containers are copied once each, however many
attributes hold them, and one that holds what it held is left alone.
"""

from __future__ import annotations

import collections
import contextlib
import functools
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

import torch

__all__ = [
    "MAX_ITEMS",
    "MAX_KEPT_BYTES",
    "MAX_TENSOR_BYTES",
    "CopyBudget",
    "HeldItems",
    "backed",
    "dense",
    "hold",
    "holds",
    "is_container",
    "put_back",
    "replace_tensors",
    "storage_address",
    "version_of",
    "written_back",
]

MAX_ITEMS: Final = 1 << 12
"""Items of the largest container kept (a vocabulary is no state a forward moves; copying it would cost seconds)."""
MAX_TENSOR_BYTES: Final = 16 << 20
"""Bytes of the largest tensor in a container whose values are kept (a read-only table would double in memory)."""
MAX_KEPT_BYTES: Final = 256 << 20
"""Bytes of such tensors' values kept in all, for one model: past them, tensors are watched by their version counter
instead (a list of per-layer caches would double in memory)."""
_ALWAYS_KEPT: Final = 64 << 10
"""Bytes of a tensor kept whatever is left of the budget (a step counter after the tables of a long model)."""
_MAX_DEPTH: Final = 4
"""Containers nested deeper are not looked into."""
_KINDS: Final = (list, dict, set, tuple, collections.deque)


@dataclass
class HeldItems:
    """One container and what it held: its items (the same objects), and for each item that is itself a container
    or a dense tensor, what that held."""

    container: Any
    items: list[Any]
    """A list's or tuple's items, a dict's ``(key, value)`` pairs, a set's elements."""
    inner: dict[int, HeldItems | torch.Tensor] = field(default_factory=dict)
    """Position in ``items`` -> what the container there held, or a copy of the tensor's values there."""
    unkept: dict[int, int] = field(default_factory=dict)
    """Position in ``items`` -> the version counter of a tensor there too large to copy."""

    def tensors(self) -> Iterator[torch.Tensor]:
        """Each tensor among the items, here and in the containers inside."""
        for value in _values(self.container, self.items):
            if isinstance(value, torch.Tensor):
                yield value
        for inner in self.inner.values():
            if isinstance(inner, HeldItems):
                yield from inner.tensors()

    def moved(self) -> bool:
        """Whether a tensor too large to copy changed since (its version moved), here or in a container inside."""
        values = _values(self.container, self.items)
        if any(version_of(values[position]) != version for position, version in self.unkept.items()):
            return True
        return any(inner.moved() for inner in self.inner.values() if isinstance(inner, HeldItems))


def is_container(value: object) -> bool:
    """A list, dict, set, tuple or deque (their subclasses too: a ``defaultdict``, an ``OrderedDict``)."""
    return isinstance(value, _KINDS)


class CopyBudget:
    """What is left of the bytes of tensor values one model's state may keep copies of (:data:`MAX_KEPT_BYTES`)."""

    def __init__(self) -> None:
        self.left = MAX_KEPT_BYTES

    def take(self, tensor: torch.Tensor, largest: int = MAX_TENSOR_BYTES) -> bool:
        """Whether ``tensor``'s values may be copied (no larger than ``largest``, and within what is left), taking
        their bytes from what is left if so."""
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes > largest or nbytes > max(self.left, _ALWAYS_KEPT):  # a counter comes back whatever came before
            return False
        self.left -= nbytes
        return True


def hold(
    container: Any, memo: dict[int, HeldItems], own: frozenset[int], budget: CopyBudget, depth: int = 0
) -> HeldItems | None:
    """What ``container`` holds now (None when it is too large to keep); ``memo`` keeps each container once; ``budget``
    bounds the bytes of tensor values copied; ``own``:
    the ids of the model's parameters and buffers, kept as the objects they are (their values come back with the
    model's own: an LSTM lists its weights, a module may keep a child's buffer in a list)."""
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
            inner = hold(value, memo, own, budget, depth + 1)
            if inner is not None:
                held.inner[position] = inner
        elif _kept(value, own, budget):
            held.inner[position] = value.detach().clone()
        elif isinstance(value, torch.Tensor) and id(value) not in own:
            held.unkept[position] = version_of(value)
    return held


def put_back(
    held: HeldItems,
    done: set[int],
    standing_in: Mapping[int, torch.Tensor] | None = None,
    weights: frozenset[int | None] | None = None,
) -> None:
    """``held.container`` holding what it held (each container once, however many hold it: ``done``).
    ``standing_in``: tensors by the id of the one they stand for (a buffer's copy the rerun runs with). ``weights``:
    give the model back (its parameters' storages, never written); a tensor that changed in place gets its values
    back in place (:func:`written_back`), else a copy of them in its place."""
    if id(held.container) in done:
        return
    done.add(id(held.container))
    container, items = held.container, list(held.items)
    for position, inner in held.inner.items():
        if isinstance(inner, HeldItems):
            put_back(inner, done, standing_in, weights)
            continue
        tensor = _values(container, items)[position]
        if weights is not None and (storage_address(tensor) in weights or written_back(tensor, inner, weights)):
            continue  # back in place, or on a parameter's memory: as the parameter, what the run left (never a copy)
        if not holds(tensor, inner):
            _set_value(container, items, position, inner.clone().requires_grad_(tensor.requires_grad))
    if standing_in:
        for position, value in enumerate(_values(container, items)):
            if id(value) in standing_in:
                _set_value(container, items, position, standing_in[id(value)])
    if not isinstance(container, tuple) and not _same_items(container, items):
        _refill(container, items)


def _set_value(container: Any, items: list[Any], position: int, value: Any) -> None:
    """Item ``position`` of ``items`` with another value (a tuple's stays: it cannot take one)."""
    if isinstance(container, dict):
        items[position] = (items[position][0], value)
    elif not isinstance(container, tuple):
        items[position] = value


def _kept(value: object, own: frozenset[int], budget: CopyBudget) -> bool:
    """A tensor whose values are kept: dense, not the model's own, within the budget."""
    if not isinstance(value, torch.Tensor) or id(value) in own or not dense(value):
        return False
    return budget.take(value)


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
    """The container emptied and given ``items`` back through its own methods (a ``Counter`` counts what ``update``
    gives it: each key is set instead). One that refuses (torch.fx's immutable lists, a ``ModelOutput``) is left as
    it is: what it holds then is what the run left there."""
    before = list(container.items()) if isinstance(container, dict) else list(container)
    try:
        if isinstance(container, list):
            container[:] = items
            return
        if isinstance(container, collections.deque):  # a bounded one holds what it held: no more than its bound
            container.clear()
            container.extend(items)
            return
        if isinstance(container, dict) and [key for key, _ in before] == [key for key, _ in items]:
            for key, value in items:  # the same keys: only values change (a dict refusing new keys takes these)
                if container[key] is not value:
                    container[key] = value
            return
        container.clear()
        if isinstance(container, dict):
            for key, value in items:
                container[key] = value
        else:
            container.update(items)
    except Exception:  # any type's own refusal, whatever it raises (a ModelOutput raises Exception itself)
        _as_it_was(container, before)


def _as_it_was(container: Any, before: list[Any]) -> None:
    """What a container refusing to be refilled held before the attempt, put back past its own methods."""
    with contextlib.suppress(Exception):  # an immutable one refused before it changed
        if isinstance(container, dict):
            dict.clear(container)
            dict.update(container, before)
        elif isinstance(container, list):
            list.__setitem__(container, slice(None), before)
        elif isinstance(container, collections.deque):
            collections.deque.clear(container)
            collections.deque.extend(container, before)
        elif isinstance(container, set):
            set.clear(container)
            set.update(container, before)


def dense(value: object) -> bool:
    """A tensor whose values can be copied and compared (not sparse, not on the meta device, its storage holding
    every element it views)."""
    return isinstance(value, torch.Tensor) and value.layout == torch.strided and not value.is_meta and backed(value)


def backed(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s storage holds every element it views: FSDP1 frees the storage of its modules' weights
    between forwards (and offloading tricks do the same), and reading such a view reads past the storage's end."""
    if tensor.numel() == 0:
        return True
    try:
        nbytes = tensor.untyped_storage().nbytes()
    except (RuntimeError, NotImplementedError, TypeError):  # no storage to ask (a subclass, a functional tensor)
        return True
    last = tensor.storage_offset() + sum(
        (size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride(), strict=True)
    )
    return (last + 1) * tensor.element_size() <= nbytes


def holds(tensor: object, values: torch.Tensor) -> bool:
    """Whether ``tensor`` still holds ``values`` (shape, dtype, device and every element)."""
    if not isinstance(tensor, torch.Tensor) or not dense(tensor):
        return False
    same_kind = (tensor.shape, tensor.dtype, tensor.device) == (values.shape, values.dtype, values.device)
    return same_kind and bool(torch.equal(tensor, values))


def replace_tensors(
    container: Any, replacements: Mapping[int, torch.Tensor], undo: list[Callable[[], None]], depth: int = 0
) -> None:
    """Each item of ``container`` (and of the lists and dicts inside it) that is a tensor in ``replacements`` (by id)
    replaced by its replacement, past the container's own methods; ``undo`` gets what puts each back."""
    if depth > _MAX_DEPTH or len(container) > MAX_ITEMS or isinstance(container, (set, frozenset)):
        return
    places = container.items() if isinstance(container, dict) else enumerate(container)
    for key, value in list(places):
        if is_container(value):
            replace_tensors(value, replacements, undo, depth + 1)
        elif isinstance(value, torch.Tensor) and id(value) in replacements and not isinstance(container, tuple):
            setter: Callable[[Any, Any, Any], None] = (
                dict.__setitem__
                if isinstance(container, dict)
                else list.__setitem__
                if isinstance(container, list)
                else collections.deque.__setitem__
            )
            setter(container, key, replacements[id(value)])
            undo.append(functools.partial(setter, container, key, value))


def written_back(tensor: object, values: torch.Tensor, weights: frozenset[int | None]) -> bool:
    """Whether ``values`` (a copy of what ``tensor`` held) could be written back into ``tensor`` itself, which every
    tensor sharing its memory then sees again (a tensor two modules hold, a view of a buffer): the same shape, dtype
    and device, writable (not expanded, not an inference-mode tensor), and not on a parameter's memory (``weights``:
    their storages' addresses), which is never written: a view of a few rows of a weight the run renormalised (an
    embedding's ``max_norm``) would put those rows back and not the others."""
    if not isinstance(tensor, torch.Tensor) or not dense(tensor):
        return False
    if (tensor.shape, tensor.dtype, tensor.device) != (values.shape, values.dtype, values.device):
        return False
    if storage_address(tensor) in weights:
        return False
    try:
        with torch.no_grad():
            tensor.copy_(values)
    except (RuntimeError, NotImplementedError):
        return False
    return True


def version_of(tensor: torch.Tensor) -> int:
    """``tensor``'s version counter; -1 for an inference-mode tensor, which has none (nor can it be written outside
    inference mode)."""
    try:
        return int(tensor._version)
    except RuntimeError:
        return -1


def storage_address(tensor: torch.Tensor) -> int | None:
    """Where ``tensor``'s storage starts (None where it has none to ask)."""
    try:
        return int(tensor.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError, TypeError):
        return None
