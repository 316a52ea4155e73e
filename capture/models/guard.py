"""Adapter code may not end the process: ``sys.exit`` or a raised ``KeyboardInterrupt`` in a hook becomes
an ``AdapterError`` naming the adapter and the hook, so a CI gate never passes on a run that compared nothing.

A real Ctrl-C still interrupts: while a hook runs, a SIGINT handler notes that the signal arrived before
handing it to the handler that was there, so a ``KeyboardInterrupt`` is the user's only when a SIGINT came.
Outside the main thread no handler can be installed, and every ``KeyboardInterrupt`` counts as the user's.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import FrameType
from typing import Any

from parity_harness.common.errors import AdapterError

__all__ = ["GuardedHook", "guarded", "no_exit"]


@dataclass
class _SigintWatch:
    """A SIGINT handler that records the signal, then does what the previous (callable) handler did."""

    previous: Any
    signalled: bool = False

    def __call__(self, signum: int, frame: FrameType | None) -> Any:
        self.signalled = True
        return self.previous(signum, frame)


@contextmanager
def _watching_sigint() -> Iterator[_SigintWatch | None]:
    """Install a recording SIGINT handler for the block, restoring the previous one; ``None`` outside the main
    thread, where none can be installed. Under SIG_IGN or SIG_DFL a real SIGINT raises nothing: no handler."""
    if threading.current_thread() is not threading.main_thread():
        yield None
        return
    watch = _SigintWatch(signal.getsignal(signal.SIGINT))
    if not callable(watch.previous):
        yield watch
        return
    signal.signal(signal.SIGINT, watch)
    try:
        yield watch
    finally:
        signal.signal(signal.SIGINT, watch.previous)


@contextmanager
def no_exit(adapter: str, hook: str) -> Iterator[None]:
    """Run adapter code; ``SystemExit`` or a ``KeyboardInterrupt`` it raised itself becomes an ``AdapterError``."""
    with _watching_sigint() as watch:
        try:
            yield
        except SystemExit as err:
            raise AdapterError(_exit_message(adapter, hook, f"called sys.exit({err.code!r}) (SystemExit)")) from None
        except KeyboardInterrupt:
            if watch is None or watch.signalled:
                raise
            raise AdapterError(_exit_message(adapter, hook, "raised KeyboardInterrupt without a Ctrl-C")) from None


def _exit_message(adapter: str, hook: str, what: str) -> str:
    return (
        f"adapter {adapter}: {hook} {what}; an adapter must return its result or raise an exception, "
        "never end the process (nothing was compared or written): remove the exit or raise an error instead"
    )


@dataclass(frozen=True)
class GuardedHook:
    """An adapter function run under :func:`no_exit`; ``inspect.signature`` sees the function's own."""

    function: Callable[..., Any]
    adapter: str
    hook: str

    @property
    def __wrapped__(self) -> Callable[..., Any]:
        return self.function

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with no_exit(self.adapter, self.hook):
            return self.function(*args, **kwargs)


def guarded(function: Callable[..., Any] | None, adapter: str, hook: str) -> Callable[..., Any] | None:
    """``function`` under :func:`no_exit` (``None`` stays ``None``; a guarded hook is not wrapped twice)."""
    if function is None or isinstance(function, GuardedHook):
        return function
    return GuardedHook(function, adapter, hook)
