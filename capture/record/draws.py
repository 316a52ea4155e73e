"""Random draws in a float64 rerun, made as the float32 run made them, and the proof that they were.

A float64 rerun of a model (the reference's noise floor and self-check, the port's rounding check) is the same
computation in exact arithmetic only if it draws the same random numbers. torch draws some differently in float64
from the same generator state (``torch.rand``, ``uniform_``, ``randn`` of more than 16 elements, CUDA's fused dropout;
the CPU's dropout masks happen to agree), and that changes which samples a stochastic-depth layer drops: the rerun's
distance to the float32 values is then no rounding, yet may be small enough to pass for it.

:class:`SameDraws` makes each such float64 draw in float32, from the same generator, into a tensor of the same
strides, and widens it: the rerun consumes the generator as the float32 run did and gets its numbers. A draw the
float32 run made in float64 on purpose is narrowed too: the generators' end state tells (below). Other draws
(``randint``, ``multinomial``, ``poisson``: the same in float64) are made as they come; the caller compares the state
torch's generators end the rerun in with the one the float32 run left, which tells of a draw made otherwise (not
inside ``torch.random.fork_rng``, which puts the state back).

A draw from a generator handed to it (``generator=g``) repeats the float32 run's only if ``g`` is where it was then,
wherever the model keeps it: a module's attribute (put back with the model state), a list or a helper object (moved on
by the run), or made in the forward and seeded there, perhaps from a step clock the rerun does not put back. Both
:class:`SameDraws` and :class:`DrawSequence` list, in order, the state each such draw started from
(:attr:`DrawSequence.started`); the caller compares the rerun's list with that of a float32 run made again from the
same starting point, and takes the rerun for another computation where they differ. Only a model that draws so pays for
that float32 run. The recorded (or replayed) run itself is not watched, so that nothing changes what it computes (a
torch function mode would turn off fused fast paths).

Randomness no generator tells of (a NumPy or Python generator the model holds, torch's reseeded from a step count
inside ``fork_rng``) and state no rerun puts back (a clock on a helper object) are caught otherwise: the caller makes
the forward again in float32 from the run's start and requires the run's outputs bit for bit
(:func:`first_unrepeated`). Only the outputs are compared, so a draw or a state that changes the gradients alone goes
unseen.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from typing import Any, Final

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = [
    "HANDED_GENERATORS",
    "NOT_REPEATED",
    "DrawSequence",
    "SameDraws",
    "first_unrepeated",
    "not_rerun",
    "unconfirmed",
]

HANDED_GENERATORS: Final = (
    "draws from generators handed to them, which the float64 run found in other states than a float32 run made "
    "again found them in: one the run moves on, wherever the model keeps it, or seeds from state the rerun does not "
    "put back"
)
"""What an ``unmatched`` set says where :attr:`DrawSequence.started` differs between the runs."""


NOT_REPEATED: Final = (
    "a run made again in float32 from where it started does not give its outputs bit for bit ({slot} differs): the "
    "model keeps state or draws random numbers that no rerun puts back (NumPy's or Python's generators, torch's "
    "reseeded from a step count, a clock on a helper object) or runs nondeterministic kernels "
    "(torch.use_deterministic_algorithms(True) makes them repeat)"
)
"""What an ``unmatched`` set says where :func:`first_unrepeated` finds an output."""


def first_unrepeated(outputs: Iterable[tuple[str, torch.Tensor]], again: Mapping[str, torch.Tensor]) -> str | None:
    """The first of a run's ``outputs`` (slot, value) that the run made again did not give bit for bit (NaNs where
    they were), if any: a float64 rerun measures rounding only if the float32 run repeats from its start."""
    for slot, value in outputs:
        other = again.get(slot)
        if other is None or other.shape != value.shape or other.dtype != value.dtype:
            return slot
        first, second = value.detach().reshape(-1), other.detach().reshape(-1).to(value.device)
        if value.is_floating_point() or value.is_complex():
            first, second = first.view(_BITS[value.element_size()]), second.view(_BITS[value.element_size()])
        if not torch.equal(first, second):
            return slot
    return None


_BITS: Final = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64, 16: torch.int64}


def not_rerun(err: Exception) -> str:
    """What an ``unmatched`` set says where the run made again to compare outputs with failed."""
    return f"a run made again in float32 to confirm the float64 run failed ({_said(err)})"


def unconfirmed(err: Exception) -> str:
    """What an ``unmatched`` set says where the float32 run made again to compare lists with failed."""
    return f"draws from generators handed to them, which a float32 run made again to confirm failed ({_said(err)})"


def _said(err: Exception) -> str:
    """An error's type and the first line of its message."""
    first = str(err).strip().splitlines()[0] if str(err).strip() else ""
    return f"{type(err).__name__}: {first[:200]}"


_aten = torch.ops.aten
_FILLS: Final = frozenset(
    {_aten.uniform_, _aten.normal_, _aten.bernoulli_, _aten.exponential_, _aten.cauchy_, _aten.log_normal_}
)
"""In-place draws into a tensor (its dtype decides how they are drawn)."""
_FACTORIES: Final = frozenset({_aten.rand, _aten.randn})
"""Draws into a new tensor of the ``dtype`` asked for."""
_LIKE: Final = frozenset({_aten.rand_like, _aten.randn_like})
"""Draws into a new tensor of another's dtype, unless ``dtype`` says otherwise."""


def _is_float64(value: object) -> bool:
    return isinstance(value, torch.Tensor) and value.dtype == torch.float64


def _widened(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether a call takes a float64 tensor or asks for float64 values."""
    return any(_is_float64(value) for value in args) or kwargs.get("dtype") == torch.float64


def _narrowed(value: object) -> object:
    return value.to(torch.float32) if isinstance(value, torch.Tensor) and value.dtype == torch.float64 else value


class DrawSequence(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Within the block, lists the state of each generator handed to a random draw, before the draw (module
    docstring); draws from torch's own generators, which the caller seeds, are not listed."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.started: list[bytes] = []
        """Per draw from a generator handed to it, in order: the generator's device and a digest of its state."""

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if torch.Tag.nondeterministic_seeded not in func.tags:
            return func(*args, **kwargs)
        generator = next((value for value in (*args, *kwargs.values()) if isinstance(value, torch.Generator)), None)
        if generator is not None:
            self.started.append(_digest(generator))
        return self._draw(func, args, kwargs)

    def _draw(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return func(*args, **kwargs)


def _digest(generator: torch.Generator) -> bytes:
    """A generator's device and a digest of its state (a CPU generator's is 5 KB)."""
    state = generator.get_state().numpy().tobytes()
    return generator.device.type.encode() + hashlib.blake2b(state, digest_size=16).digest()


class SameDraws(DrawSequence):  # type: ignore[no-untyped-call]
    """Within the block, float64 random draws are made in float32 and widened, and the states of the generators
    handed to them listed (module docstring)."""

    def _draw(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return self._narrowed_draw(func, func.overloadpacket, args, kwargs)

    def _narrowed_draw(self, func: Any, packet: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if packet in _FILLS and args and _is_float64(args[0]):
            return _fill_narrow(func, args, kwargs)
        if packet in _FACTORIES and kwargs.get("dtype") == torch.float64:
            return func(*args, **{**kwargs, "dtype": torch.float32}).to(torch.float64)
        if packet in _FACTORIES and _is_float64(kwargs.get("out")):  # rand(..., out=buffer)
            out = kwargs["out"]
            narrow = torch.empty_strided(out.size(), out.stride(), dtype=torch.float32, device=out.device)
            func(*args, **{**kwargs, "out": narrow})
            return out.copy_(narrow)
        if packet is _aten.normal and "out" not in kwargs and _widened(args, kwargs):  # torch.normal(mean, std)
            narrow_kwargs = {**kwargs, "dtype": torch.float32} if kwargs.get("dtype") == torch.float64 else kwargs
            return func(*(_narrowed(value) for value in args), **narrow_kwargs).to(torch.float64)
        if packet in _LIKE and _is_float64(args[0]) and kwargs.get("dtype") in (None, torch.float64):
            return func(*args, **{**kwargs, "dtype": torch.float32}).to(torch.float64)
        if packet is _aten.bernoulli and _is_float64(args[0]):  # probabilities in, draws of their dtype out
            return func(*(_narrowed(value) for value in args), **kwargs).to(torch.float64)
        if packet is _aten.native_dropout and _is_float64(args[0]):  # CUDA's fused dropout: the mask as in float32
            return _dropout_narrow(func, args, kwargs)
        if packet is _aten.rrelu_with_noise and _is_float64(args[0]):
            return _rrelu_narrow(func, args, kwargs)
        # Any other draw (randint, multinomial, poisson...) is made as it comes: torch's generators ending the rerun
        # in another state than the float32 run left them tells of one drawn otherwise (the caller compares them).
        return func(*args, **kwargs)


def _fill_narrow(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """An in-place draw into a float64 tensor, made into a float32 one of the same strides (a strided slice is drawn
    element by element, a contiguous tensor by vectors: other numbers) and widened into it."""
    target = args[0]
    narrow = torch.empty_strided(target.size(), target.stride(), dtype=torch.float32, device=target.device)
    func(narrow, *(_narrowed(value) for value in args[1:]), **kwargs)
    return target.copy_(narrow)


def _dropout_narrow(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """``native_dropout`` of a float64 input: its mask drawn as for the float32 input, the output scaled in float64."""
    values = args[0]
    p = float(args[1] if len(args) > 1 else kwargs["p"])
    _, mask = func(values.to(torch.float32), *args[1:], **kwargs)
    return values * mask * (0.0 if p >= 1.0 else 1.0 / (1.0 - p)), mask


def _rrelu_narrow(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``rrelu_with_noise`` of a float64 input: its noise (the slopes, 1 where the input is positive) drawn as for the
    float32 input into the caller's noise tensor, the output ``input * noise`` in float64."""
    values, noise = args[0], args[1]
    training = args[4] if len(args) > 4 else kwargs.get("training", False)
    if not training:
        return func(*args, **kwargs)
    narrow = noise.to(torch.float32)
    func(values.to(torch.float32), narrow, *args[2:], **kwargs)
    noise.copy_(narrow)
    return values * noise
