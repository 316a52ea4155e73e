"""The generator states a float32 run drew from, for its float64 rerun to draw from the same ones and no others.

A float64 rerun (the reference's noise floor and self-check, the port's rounding check) repeats the float32 run's
arithmetic only if it draws the same random numbers. For torch's own generators the rerun seeds them as the run was
seeded and compares the states they end in; a generator passed to a draw (``generator=g``) may live anywhere: a
module's attribute (put back by the model state), a list, a helper object, or made in the forward and seeded there,
perhaps from a step clock the rerun does not put back. Only the run itself can say which states it drew from:
:class:`DrawLog` counts, while the float32 forward runs, the state of every generator handed to a torch call before
the call, and ``record.draws.SameDraws`` lets the rerun draw from those states only (or from the states its own draws
from them lead to).

The tap's hooks set the log aside (:func:`set_aside`): their torch calls are not the model's, and taking them through
the mode cost a replay of the Conformer example about 10% where the model's own calls cost about 2%.
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["DrawLog", "set_aside", "state_key"]

_Hook = TypeVar("_Hook", bound=Callable[..., Any])


def state_key(generator: torch.Generator) -> bytes:
    """A generator's state as a key: its device type and state bytes."""
    return generator.device.type.encode() + b":" + generator.get_state().numpy().tobytes()


class DrawLog(TorchFunctionMode):
    """Within the block, each torch call given ``generator=`` counts that generator's state before the call in
    :attr:`states` (torch's signatures take the generator by keyword only). Enter it once per run; the counts add up."""

    def __init__(self) -> None:
        super().__init__()
        self.states: collections.Counter[bytes] = collections.Counter()

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        if not kwargs:
            return func(*args)
        generator = kwargs.get("generator")
        if isinstance(generator, torch.Generator):
            self.states[state_key(generator)] += 1
        return func(*args, **kwargs)


def _logging() -> bool:
    """Whether a :class:`DrawLog` is the innermost torch function mode."""
    depth = torch._C._len_torch_function_stack()
    return depth > 0 and isinstance(torch._C._get_function_stack_at(depth - 1), DrawLog)


def set_aside(hook: _Hook) -> _Hook:
    """``hook`` as is where no :class:`DrawLog` is active now, else run with the log taken off torch's mode stack
    for each call (the observer's work is not the model's). Decided when called: a tap entered inside a log."""
    if not _logging():
        return hook

    @functools.wraps(hook)
    def unlogged(*args: Any, **kwargs: Any) -> Any:
        if not _logging():  # another mode entered inside the forward is on top: leave the stack alone
            return hook(*args, **kwargs)
        log = torch._C._pop_torch_function_stack()
        try:
            return hook(*args, **kwargs)
        finally:
            torch._C._push_on_torch_function_stack(log)

    return unlogged  # type: ignore[return-value]
