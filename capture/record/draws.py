"""Random draws in a float64 rerun, made as the float32 run made them.

A float64 rerun of a model (the reference's noise floor, the port's rounding check) is the same computation in exact
arithmetic only if it draws the same random numbers. torch draws some differently in float64 from the same
generator state (``torch.rand``, ``uniform_``, ``randn`` of more than 16 elements, CUDA's fused dropout; the CPU's
dropout masks happen to agree), and that changes which samples a stochastic-depth layer drops: the rerun's distance to
the float32 values is then no rounding, yet may be small enough to pass for it.

:class:`SameDraws` makes each such float64 draw in float32, from the same generator, into a tensor of the same
strides, and widens it: the rerun consumes the generator as the float32 run did and gets its numbers. A draw from a
generator passed to it (``generator=g``) is repeated only from a state the float32 run drew from, as its
``observe.draw_log.DrawLog`` counted them, each once, or from one the rerun's own draws from such a state led to:
any other (a generator the float32 run moved on, wherever the model keeps it; one the forward seeds from a step
clock the rerun does not put back) is named in ``unmatched``, for the caller to judge the rerun by. A
draw the float32 run made in float64 on purpose is narrowed too: the generators' end state tells (below). Other draws
(``randint``, ``multinomial``, ``poisson``: the same in float64) are made as they come; the caller compares the state
torch's generators end the rerun in with the one the float32 run left, which tells of a draw made otherwise (not
inside ``torch.random.fork_rng``, which puts the state back).
"""

from __future__ import annotations

import collections
from collections.abc import Mapping, Sequence
from typing import Any, Final

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from parity_harness.capture.observe.draw_log import state_key

__all__ = ["SameDraws"]

_aten = torch.ops.aten
_MARKER_SEED: Final = 0x5EED_CAFE
"""Seed of the marker state written through a generator to tell which of the model's it is."""
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


class SameDraws(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Within the block, float64 random draws are made in float32 and widened (module docstring).

    Args:
        unmatched: where to add a description of each draw that could not be made as in float32.
        own: the generators the model's modules hold as attributes, put back in the states they held when the float32
            run started (``observe.model_state``): draws from them repeat the run's.
        drawn: the states the float32 run drew from (``DrawLog.states``, counts); without it, no draw from a generator
            passed to the call, other than ``own``'s, is taken for the run's.
    """

    def __init__(
        self, unmatched: set[str], own: Sequence[torch.Generator] = (), drawn: Mapping[bytes, int] | None = None
    ) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.unmatched = unmatched
        self._own = list(own)
        self._drawn = collections.Counter(drawn or {})
        """The float32 run's states not yet drawn from by this run."""
        self._repeatable: set[bytes] = set()
        """States this run's draws from other generators led to (each draw's next state)."""

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if torch.Tag.nondeterministic_seeded not in func.tags:
            return func(*args, **kwargs)
        return self._draw(func, args, kwargs)

    def _draw(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        packet = func.overloadpacket
        generator = next((value for value in (*args, *kwargs.values()) if isinstance(value, torch.Generator)), None)
        put_back = generator is not None and self._is_own(generator)
        # A draw from one put back uses up the float32 run's draw from that state too: it vouches for no other.
        if generator is not None and not self._drew_before(generator) and not put_back:
            self.unmatched.add(
                f"{packet.__name__} from a generator of the model's own in a state the float32 run did not draw from"
            )
        result = self._narrowed_draw(func, packet, args, kwargs)
        if generator is not None and not put_back:  # a state one put back reaches vouches for no other generator
            self._repeatable.add(state_key(generator))
        return result

    def _is_own(self, generator: torch.Generator) -> bool:
        """Whether ``generator`` is one of those put back (``own``). It reaches ``__torch_dispatch__`` as another
        Python object than the model holds, and another generator may be in the same state (one of the same seed on
        a helper object, moved on by the float32 run): told apart by writing a marker state through it and seeing
        which one holds it."""
        state = generator.get_state()
        candidates = [
            own for own in self._own if own.device == generator.device and torch.equal(own.get_state(), state)
        ]
        if not candidates:
            return False
        marker = torch.Generator(device=generator.device).manual_seed(_MARKER_SEED).get_state()
        if torch.equal(marker, state):
            marker = torch.Generator(device=generator.device).manual_seed(_MARKER_SEED + 1).get_state()
        generator.set_state(marker)
        try:
            return any(torch.equal(own.get_state(), marker) for own in candidates)
        finally:
            generator.set_state(state)

    def _drew_before(self, generator: torch.Generator) -> bool:
        """Whether the float32 run drew from ``generator``'s state (each of its draws vouches for one draw here), or
        this run's own draws from such a state led to it."""
        state = state_key(generator)
        if state in self._repeatable:
            return True
        if self._drawn[state] <= 0:
            return False
        self._drawn[state] -= 1
        return True

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
