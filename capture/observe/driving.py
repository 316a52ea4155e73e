"""How one reference run is driven: seeding, the forward call, and the backward seed (cotangent).

Replay drives the port through the same functions, so both environments run the same way.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import random
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from parity_harness.capture.observe.naming import iter_live_tensors

__all__ = [
    "ForwardFn",
    "LossFn",
    "PaddedPositions",
    "call_forward",
    "fresh_copies",
    "generators_kept",
    "handed_generators",
    "make_cotangents",
    "map_tensors",
    "rng_state",
    "seed_everything",
    "to_device",
    "torch_generator_states",
]

ForwardFn = Callable[[torch.nn.Module, Any], Any]
LossFn = Callable[[Any], torch.Tensor]


def seed_everything(seed: int) -> None:
    """Seed Python's, NumPy's and torch's (all devices) global generators."""
    random.seed(seed)
    np.random.seed(seed % (1 << 32))
    torch.manual_seed(seed)


def torch_generator_states(own: Sequence[torch.Generator] = ()) -> tuple[bytes, ...]:
    """The states of torch's global generators (the CPU's, and each CUDA device's once CUDA is initialised), and of
    the generators ``own`` a model holds: two that differ tell that a run drew random numbers from them."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else []  # type: ignore[no-untyped-call]
    held = [generator.get_state() for generator in own]
    return tuple(state.numpy().tobytes() for state in (torch.get_rng_state(), *cuda, *held))


def fresh_copies(value: Any) -> Any:
    """``value`` with a copy of each of its tensors, requiring grad where it did: what a rerun of the model takes, so
    that a forward changing its inputs in place changes no other run's."""

    def copy(tensor: torch.Tensor) -> torch.Tensor:
        fresh = tensor.detach().clone()
        differentiable = fresh.is_floating_point() or fresh.is_complex()
        return fresh.requires_grad_(True) if tensor.requires_grad and differentiable else fresh

    return map_tensors(value, copy)


def handed_generators(value: Any, depth: int = 0) -> list[torch.Generator]:
    """The ``torch.Generator`` objects among a model's inputs (nested mappings, lists, tuples and dataclasses), each
    once: a sampler or a diffusion step takes its noise from one the caller hands it."""
    found: dict[int, torch.Generator] = {}
    if isinstance(value, torch.Generator):
        return [value]
    if depth > 32:  # as deep as any real batch nests
        return []
    if isinstance(value, Mapping):
        items: Iterable[Any] = value.values()
    elif isinstance(value, (list, tuple)):
        items = value
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        items = [getattr(value, f.name) for f in dataclasses.fields(value)]
    else:
        return []
    for item in items:
        for generator in handed_generators(item, depth + 1):
            found.setdefault(id(generator), generator)
    return list(found.values())


@contextlib.contextmanager
def generators_kept(handed: Iterable[torch.Generator] = ()) -> Iterator[None]:
    """Python's, NumPy's and torch's global generators as they were, once the block is over, and those ``handed`` to
    the model among its inputs: a capture or replay seeds and moves them for its runs, and a test suite checking parity
    must not find its own random numbers changed after."""
    given = [(generator, generator.get_state()) for generator in handed]
    python, numpy_state, torch_cpu, seed = random.getstate(), np.random.get_state(), torch.get_rng_state(), None
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None  # type: ignore[no-untyped-call]
    if cuda is None:
        seed = torch.initial_seed()  # what CUDA's generators start from, once initialised
    try:
        yield
    finally:
        for generator, state in given:
            generator.set_state(state)
        random.setstate(python)
        np.random.set_state(numpy_state)
        torch.set_rng_state(torch_cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)
        elif seed is not None and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
            torch.cuda.manual_seed_all(seed)  # initialised by the run: as the caller's seed would have left them


def rng_state() -> tuple[dict[str, object], np.ndarray]:
    """Python and NumPy generator states as plain data, and torch's CPU state as bytes."""
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    plain: dict[str, object] = {
        "python": [version, list(internal), gauss],
        "numpy": [name, [int(k) for k in keys], int(pos), int(has_gauss), float(cached)],
    }
    return plain, torch.get_rng_state().numpy()


def call_forward(model: torch.nn.Module, inputs: Any, forward: ForwardFn | None = None) -> Any:
    """Run the model: the adapter's ``forward`` if given, else ``model(**inputs)`` / ``model(*inputs)``."""
    if forward is not None:
        return forward(model, inputs)
    if isinstance(inputs, Mapping):
        return model(**inputs)
    if isinstance(inputs, (tuple, list)):
        return model(*inputs)
    return model(inputs)


PaddedPositions = Callable[[tuple[int, ...]], "np.ndarray | None"]
"""The padded positions of a model output of a given shape, or None where it has none."""


def make_cotangents(
    outputs: Any, seed: int, padded: PaddedPositions | None = None
) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """A seeded standard-normal cotangent for every floating output (real or complex) that requires grad.

    Returns ``(slot, output, cotangent)`` triples in slot order. Values are drawn in float32 on
    the CPU from a private generator, then cast, so they do not depend on the device, the output's
    dtype or the global RNG (a float64 rerun gets the float32 run's values exactly; drawing in
    float64 took three times as long: 0.22 s for a GPT-2 model's logits, a quarter of its step).
    ``padded`` gives each output's padded positions, where the cotangent is zero: what a model leaves in
    padded frames then reaches no gradient, parameter gradients included (capture gives the run's
    :class:`~parity_harness.common.format.bundle.lengths.PaddingPlan`, by which replay's ``--mask-padding`` masks
    the outputs).
    """
    generator = torch.Generator().manual_seed(seed)
    triples = []
    for slot, tensor in iter_live_tensors(outputs, "output"):
        if tensor.requires_grad and (tensor.is_floating_point() or tensor.is_complex()):
            noise = torch.randn(tensor.shape, generator=generator, dtype=torch.float32)
            if tensor.is_complex():  # its real and imaginary parts drawn one after the other
                noise = torch.complex(noise, torch.randn(tensor.shape, generator=generator, dtype=torch.float32))
            mask = None if padded is None else padded(tuple(tensor.shape))
            if mask is not None:
                noise[torch.from_numpy(mask)] = 0.0
            triples.append((slot, tensor, noise.to(dtype=tensor.dtype, device=tensor.device)))
    return triples


def map_tensors(value: Any, change: Callable[[torch.Tensor], Any]) -> Any:
    """``value`` with every tensor of its nested mappings (another type than ``dict`` kept where it rebuilds from
    items: replay's RecordedObject, a ``UserDict`` batch such as transformers' BatchEncoding), lists, tuples and named
    tuples replaced by ``change(tensor)``; anything else as it is."""
    if isinstance(value, torch.Tensor):
        return change(value)
    if isinstance(value, Mapping):
        moved = {key: map_tensors(item, change) for key, item in value.items()}
        if type(value) is not dict:  # keep the mapping's own type: code reading it by attribute still works
            rebuild: Callable[[dict[Any, Any]], Any] = type(value)
            try:
                return rebuild(moved)
            except (TypeError, ValueError):
                return moved
        return moved
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a named tuple takes its fields one by one
        return type(value)(*(map_tensors(item, change) for item in value))
    if isinstance(value, (list, tuple)):
        return type(value)(map_tensors(item, change) for item in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _map_dataclass(value, change)
    return value


def _map_dataclass(value: Any, change: Callable[[torch.Tensor], Any]) -> Any:
    """A copy of a dataclass with its fields mapped (set directly: neither ``__init__`` nor ``__post_init__`` runs
    again); the object itself when no field changes."""
    fields = {f.name: map_tensors(getattr(value, f.name), change) for f in dataclasses.fields(value)}
    if all(fields[name] is getattr(value, name) for name in fields):
        return value
    copied = copy.copy(value)
    for name, field_value in fields.items():
        object.__setattr__(copied, name, field_value)
    return copied


def to_device(value: Any, device: str | torch.device) -> Any:
    """Move every tensor of a nested dict/list/tuple value to ``device``."""
    return map_tensors(value, lambda tensor: tensor.to(device))
