"""Random draws in a float64 rerun, made as the float32 run made them.

A float64 rerun of a model (the reference's noise floor, the port's rounding check) is the same computation in exact
arithmetic only if it draws the same random numbers. torch draws some differently in float64 from the same
generator state (``torch.rand``, ``uniform_``, ``randn`` of more than 16 elements; dropout's masks happen to agree),
and that changes which samples a stochastic-depth layer drops: the rerun's distance to the float32 values is then no
rounding, yet may be small enough to pass for it.

:class:`SameDraws` makes each float64 draw in float32, from the same generator, and widens it: the rerun consumes the
generator as the float32 run did and gets its numbers. A draw it cannot make so (an operator it does not know, a
generator of the model's own, which the run before has moved on) is named in ``unmatched``, for the caller to judge
the rerun by; an operator tagged as drawing that leaves torch's generators as they were (attention without dropout)
drew nothing.
"""

from __future__ import annotations

from typing import Any, Final

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from parity_harness.capture.observe.driving import torch_generator_states

__all__ = ["SameDraws"]

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


def _narrowed(value: object) -> object:
    return value.to(torch.float32) if isinstance(value, torch.Tensor) and value.dtype == torch.float64 else value


class SameDraws(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Within the block, float64 random draws are made in float32 and widened (module docstring).

    Args:
        unmatched: where to add a description of each draw that could not be made as in float32.
    """

    def __init__(self, unmatched: set[str]) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.unmatched = unmatched

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if torch.Tag.nondeterministic_seeded not in func.tags:
            return func(*args, **kwargs)
        return self._draw(func, args, kwargs)

    def _draw(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        packet = func.overloadpacket
        if any(isinstance(value, torch.Generator) for value in (*args, *kwargs.values())):
            self.unmatched.add(f"{packet.__name__} from a generator of the model's own")
            return func(*args, **kwargs)
        if packet in _FILLS and args and _is_float64(args[0]):
            narrow = torch.empty_like(args[0], dtype=torch.float32)
            func(narrow, *(_narrowed(value) for value in args[1:]), **kwargs)
            return args[0].copy_(narrow)
        if packet in _FACTORIES and kwargs.get("dtype") == torch.float64:
            return func(*args, **{**kwargs, "dtype": torch.float32}).to(torch.float64)
        if packet in _LIKE and _is_float64(args[0]) and kwargs.get("dtype") in (None, torch.float64):
            return func(*args, **{**kwargs, "dtype": torch.float32}).to(torch.float64)
        if packet is _aten.bernoulli and _is_float64(args[0]):  # probabilities in, draws of their dtype out
            return func(*(_narrowed(value) for value in args), **kwargs).to(torch.float64)
        widened = any(_is_float64(value) for value in (*args, *kwargs.values())) or kwargs.get("dtype") == torch.float64
        before = torch_generator_states() if widened else ()
        result = func(*args, **kwargs)
        if widened and torch_generator_states() != before:  # it drew (attention without dropout draws nothing)
            self.unmatched.add(packet.__name__)
        return result
