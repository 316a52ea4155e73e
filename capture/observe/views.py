"""Fallback hooks on the bases of hooked views, and when they may let go of the view.

A hook on a view dies when the view (or a view derived from it) is modified in place: autograd rebuilds the view's
history and the hooked node leaves the graph. A fallback hook on the view's base then recovers the view's gradient
(``hooks`` module docstring). To tell at backward whether the view was modified in place since its module call, the
fallback reads the view's version counter, so it holds the view. Holding every hooked view until backward keeps
alive each module input and output that the bare run frees (390 MB on a FastConformer of realistic shape).

So a fallback lets go of its view as soon as nothing but fallbacks reaches the view's memory: no Python reference
besides theirs, no C++ one (an autograd saved tensor), no other tensor on the same storage, and the view's base
reached only through the views. From then on nothing can modify the view in place, so its version is final: the
fallback keeps the verdict (modified or not), drops the view, and the memory goes when the bare run's would.
Decided from reference counts (under a microsecond a view), in sweeps as module calls return, and again when the
base's gradient arrives (else the view, whose history leads back to the base's node, would keep itself alive in a
cycle through the graph until Python's garbage collector ran). Views that Python code still holds are rechecked at
every sweep; views that autograd keeps (saved for backward: holding them costs no memory) when their number has
doubled.
"""

from __future__ import annotations

import enum
import sys
from collections import Counter
from typing import Final, Protocol

import torch

__all__ = ["BaseFallback", "HeldViews"]

_storage_use_count = getattr(torch._C, "_storage_Use_Count", None) if hasattr(torch.Tensor, "_use_count") else None
"""Reference count of a storage; without it (or the tensors' own counts), views are held until backward."""

_SWEEP_EVERY: Final = 32
"""New views held between two sweeps."""


class _Tap(Protocol):
    fired: bool

    def __call__(self, grad: torch.Tensor | None) -> None: ...


class BaseFallback:
    """A hook on a view's base that recovers the view's gradient if the view's own hook died."""

    __slots__ = (
        "base_size",
        "base_stride",
        "ledger",
        "modified",
        "offset",
        "size",
        "storage",
        "stride",
        "tap",
        "version",
        "view",
    )

    def __init__(self, tap: _Tap, view: torch.Tensor, base: torch.Tensor) -> None:
        self.tap, self.version = tap, view._version
        self.view: torch.Tensor | None = view
        self.modified = False
        """Whether the view was modified in place since its call; final once ``view`` is None."""
        self.storage = 0
        """The view's storage, for :class:`HeldViews` (0: not tracked)."""
        self.ledger: HeldViews | None = None
        """The :class:`HeldViews` tracking the view, if any."""
        self.size, self.stride = tuple(view.size()), tuple(view.stride())
        self.offset = view.storage_offset() - base.storage_offset()
        self.base_size, self.base_stride = tuple(base.size()), tuple(base.stride())

    def let_go(self) -> None:
        """Drop the view, keeping its final verdict: nothing but fallbacks reaches it any more."""
        if self.view is not None:
            self.modified, self.view = self.view._version != self.version, None

    def __call__(self, grad: torch.Tensor | None) -> None:
        # Let go of the view here if nothing else reaches it: held any longer, it would outlive this node (its history
        # leads back here, a cycle through the graph that only Python's garbage collector breaks). Not otherwise: a
        # gradient taken inside forward (``autograd.grad``) runs this node while forward code still holds the view.
        if self.ledger is not None:
            self.ledger.settle(self)
        if self.tap.fired or grad is None:  # the view's hook runs before its base's whenever it is alive
            return
        if not (self.modified if self.view is None else self.view._version != self.version):
            # Not modified in place since the call, so the view's own hook is alive: it did not fire because no
            # gradient flows through this view (a detached branch), and the base's gradient belongs to others.
            return
        laid_out = torch.empty_strided(self.base_size, self.base_stride, dtype=grad.dtype, device=grad.device)
        laid_out.copy_(grad)
        self.tap(laid_out.as_strided(self.size, self.stride, self.offset))


class _Reach(enum.Enum):
    """Who besides the fallbacks reaches a storage's views."""

    NOBODY = "nobody"
    PYTHON = "Python code"
    ELSEWHERE = "autograd, another tensor or the base"


class HeldViews:
    """The views that base fallbacks hold, let go of once nothing else reaches their memory (module docstring)."""

    def __init__(self) -> None:
        self._recent: list[BaseFallback] = []
        self._kept: list[BaseFallback] = []  # reached from elsewhere than Python at their last sweep
        self._kept_sweep_at = _SWEEP_EVERY
        self._on_storage: dict[int, list[BaseFallback]] = {}
        self._since_sweep = 0

    def add(self, fallback: BaseFallback) -> None:
        """Track a new fallback's view (plain tensors only; a subclass or a tensor without storage stays held)."""
        view = fallback.view
        if _storage_use_count is None or type(view) is not torch.Tensor:
            return
        try:
            fallback.storage = view.untyped_storage()._cdata
        except (RuntimeError, NotImplementedError):  # no storage to count (a functional or fake tensor)
            return
        fallback.ledger = self
        self._on_storage.setdefault(fallback.storage, []).append(fallback)
        self._recent.append(fallback)
        self._since_sweep += 1

    def sweep_if_due(self) -> None:
        """Let go of every view nothing else reaches, when enough views were added since the last sweep."""
        if self._since_sweep >= _SWEEP_EVERY:
            self._since_sweep = 0
            self._recent, kept = self._sweep(self._recent)
            self._kept += kept
        if len(self._kept) >= self._kept_sweep_at:
            recent, self._kept = self._sweep(self._kept)
            self._recent += recent
            self._kept_sweep_at = 2 * len(self._kept) + _SWEEP_EVERY

    def settle(self, fallback: BaseFallback) -> None:
        """Let go of ``fallback``'s view, with every view on its storage, if nothing else reaches them."""
        group = self._on_storage.get(fallback.storage) if fallback.view is not None else None
        if group and self._reach(group) is _Reach.NOBODY:
            self._let_go_of(fallback.storage)

    def _let_go_of(self, storage: int) -> None:
        """Every fallback holding a view on ``storage`` lets go of it (nothing else reaches them)."""
        for holder in self._on_storage.pop(storage):
            holder.let_go()

    def _sweep(self, fallbacks: list[BaseFallback]) -> tuple[list[BaseFallback], list[BaseFallback]]:
        """Let go where nobody else reaches a storage; the rest split into (reached by Python, reached elsewhere)."""
        reach: dict[int, _Reach] = {}
        python: list[BaseFallback] = []
        elsewhere: list[BaseFallback] = []
        for fallback in fallbacks:
            if fallback.view is None:  # let go of with its storage's other views
                continue
            key = fallback.storage
            if key not in reach:
                reach[key] = self._reach(self._on_storage[key])
                if reach[key] is _Reach.NOBODY:
                    self._let_go_of(key)
            if reach[key] is _Reach.PYTHON:
                python.append(fallback)
            elif reach[key] is _Reach.ELSEWHERE:
                elsewhere.append(fallback)
        return python, elsewhere

    @staticmethod
    def _reach(group: list[BaseFallback]) -> _Reach:
        """Who besides ``group`` (every fallback holding a view on one storage) reaches that storage."""
        holders = Counter(id(fallback.view) for fallback in group)
        views = {id(fallback.view): fallback for fallback in group}  # one fallback per distinct view
        if any(fallback.view._use_count() != 1 for fallback in views.values()):  # type: ignore[union-attr]
            return _Reach.ELSEWHERE  # autograd saved it for backward (the memory stays anyway)
        for view_id, fallback in views.items():
            # References: each holder's attribute, and getrefcount's own argument.
            if sys.getrefcount(fallback.view) > holders[view_id] + 1:
                return _Reach.PYTHON
        first = next(iter(views.values())).view
        assert first is not None  # held views only
        assert _storage_use_count is not None  # checked in add
        # On the storage: each view, their base, and the storage object this query makes.
        if _storage_use_count(first.untyped_storage()._cdata) != len(views) + 2:
            return _Reach.ELSEWHERE
        base = first._base
        if base is None or any(fallback.view._base is not base for fallback in views.values()):  # type: ignore[union-attr]
            return _Reach.ELSEWHERE
        # The base is held by each view's autograd metadata and by ``base`` here, by nothing else.
        return _Reach.NOBODY if base._use_count() == len(views) + 1 else _Reach.ELSEWHERE  # type: ignore[attr-defined]
