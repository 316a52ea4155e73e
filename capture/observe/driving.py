"""How one reference run is driven: seeding, the forward call, and the backward seed (cotangent).

Replay drives the port through the same functions, so both environments run the same way.
"""

from __future__ import annotations

import copy
import dataclasses
import random
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from parity_harness.capture.observe.naming import iter_live_tensors
from parity_harness.common.numerics.padding import lengths_like, padding_axis, padding_mask, time_sizes

__all__ = [
    "ForwardFn",
    "LossFn",
    "call_forward",
    "live_time_sizes",
    "make_cotangents",
    "map_tensors",
    "rng_state",
    "seed_everything",
    "to_device",
]

ForwardFn = Callable[[torch.nn.Module, Any], Any]
LossFn = Callable[[Any], torch.Tensor]


def seed_everything(seed: int) -> None:
    """Seed Python's, NumPy's and torch's (all devices) global generators."""
    random.seed(seed)
    np.random.seed(seed % (1 << 32))
    torch.manual_seed(seed)


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


def output_lengths(outputs: Any, declared: Sequence[int]) -> list[np.ndarray]:
    """The integer ``(batch,)`` outputs that are the declared lengths after framing or subsampling (NeMo's
    ``encoded_len``), in slot order."""
    root = np.asarray(declared, dtype=np.int64)
    found = []
    for _, tensor in iter_live_tensors(outputs, "output"):
        if tensor.dtype in (torch.int64, torch.int32) and tensor.dim() == 1 and tensor.numel() == len(root):
            vector = tensor.detach().to("cpu", torch.int64).numpy()
            if lengths_like(vector, root):
                found.append(vector)
    return found


def live_time_sizes(value: Any, lengths: np.ndarray) -> frozenset[int] | None:
    """:func:`~parity_harness.common.numerics.padding.time_sizes` among the tensors of ``value`` (the model's
    inputs for the declared lengths, its outputs for lengths among them)."""
    return time_sizes((tuple(tensor.shape) for _, tensor in iter_live_tensors(value, "value")), lengths)


def make_cotangents(
    outputs: Any, seed: int, lengths: Sequence[int] | None = None, inputs: Any = None
) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """A seeded standard-normal cotangent for every floating output (real or complex) that requires grad.

    Returns ``(slot, output, cotangent)`` triples in slot order. Values are drawn in float32 on
    the CPU from a private generator, then cast, so they do not depend on the device, the output's
    dtype or the global RNG (a float64 rerun gets the float32 run's values exactly; drawing in
    float64 took three times as long: 0.22 s for a GPT-2 model's logits, a quarter of its step).
    With the batch's declared ``lengths`` (``capture-run --lengths``), each output's cotangent is
    zero past each example's length on its time axis, taken from the first output that carries
    those lengths and fits it, else from the declared lengths on an axis of the size the model's ``inputs`` have
    for them (a tagger's logits; :mod:`parity_harness.common.numerics.padding`): what a model leaves in padded
    frames then reaches no gradient, parameter gradients included. Replay's ``--mask-padding`` masks by the
    same rule.
    """
    generator = torch.Generator().manual_seed(seed)
    carried = [] if lengths is None else _cotangent_lengths(outputs, inputs, lengths)
    triples = []
    for slot, tensor in iter_live_tensors(outputs, "output"):
        if tensor.requires_grad and (tensor.is_floating_point() or tensor.is_complex()):
            noise = torch.randn(tensor.shape, generator=generator, dtype=torch.float32)
            if tensor.is_complex():  # its real and imaginary parts drawn one after the other
                noise = torch.complex(noise, torch.randn(tensor.shape, generator=generator, dtype=torch.float32))
            shape = tuple(tensor.shape)
            fitting = next(((v, sizes) for v, sizes in carried if padding_axis(shape, v, sizes) is not None), None)
            padded = None if fitting is None else padding_mask(shape, *fitting)
            if padded is not None:
                noise[torch.from_numpy(padded)] = 0.0
            triples.append((slot, tensor, noise.to(dtype=tensor.dtype, device=tensor.device)))
    return triples


def _cotangent_lengths(outputs: Any, inputs: Any, lengths: Sequence[int]) -> list[tuple[np.ndarray, frozenset[int]]]:
    """The lengths that zero the cotangent, each with the size its time axis has, by the rule replay's
    ``--mask-padding`` masks the outputs with: the outputs' own lengths (not with one example, where any positive
    integer would do), sized among the outputs and, where they equal the declared ones, the inputs; then the
    declared lengths, sized among the inputs (else the outputs carrying them too); the longest length alone where
    nothing fits."""
    declared = np.asarray(lengths, dtype=np.int64)
    own = output_lengths(outputs, lengths) if len(declared) > 1 else []
    returned = any(np.array_equal(vector, declared) for vector in own)
    carried = []
    for vector in own:
        given = np.array_equal(vector, declared)
        carried.append((vector, live_time_sizes([outputs, inputs] if given else outputs, vector)))
    sizes = live_time_sizes(inputs, declared)
    if sizes is None and returned:
        sizes = live_time_sizes([inputs, outputs], declared)
    carried.append((declared, sizes))
    return [(vector, sizes or frozenset({int(vector.max(initial=0))})) for vector, sizes in carried]


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
