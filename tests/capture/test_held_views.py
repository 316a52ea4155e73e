"""The views the gradient hooks hold: let go of as soon as nothing else reaches them, with gradients unchanged.

Each hooked view has a fallback hook on its base that must know, at backward, whether the view was modified in place
(``capture/observe/views.py``). The fallback lets go of the view once nothing but fallbacks reaches its memory, keeping
the verdict. These tests check the gradients recorded through released views (in-place and out-of-place twins record
the same bits), that a view still held by Python code is not let go of, and that the hooks keep no memory the bare
run frees.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

from parity_harness.capture.observe import views
from parity_harness.capture.record.recorder import capture_run
from tests.capture.test_hooks import recorded_grads


class _Double(nn.Module):
    def __init__(self, inplace: bool) -> None:
        super().__init__()
        self.inplace = inplace

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mul_(2) if self.inplace else x * 2


class _Block(nn.Module):
    """Two in-place changes of views: one whose memory autograd keeps (ReLU saves its result), one that nothing keeps
    (the doubled projection is only added), so its view is let go of, modified, before backward."""

    def __init__(self, inplace: bool) -> None:
        super().__init__()
        self.norm, self.lin1, self.lin2 = nn.LayerNorm(8), nn.Linear(8, 8), nn.Linear(8, 8)
        self.act, self.twice = nn.ReLU(inplace=inplace), _Double(inplace)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.twice(self.lin2(self.act(self.lin1(self.norm(x)))))


def _twins(build: Callable[[bool], nn.Module], x: torch.Tensor, tmp_path: Path) -> dict[bool, dict]:
    """The gradient records of the out-of-place (False) and in-place (True) twin, each built from the same seed."""
    recorded = {}
    for inplace in (False, True):
        torch.manual_seed(0)
        path = tmp_path / f"twin_{inplace}.h5"
        capture_run(build(inplace), (x,), path, seed=3)
        recorded[inplace] = recorded_grads(path)
    return recorded


def _deep(inplace: bool) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[_Block(inplace) for _ in range(12)])


@pytest.fixture
def verdicts(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Whether each view let go of by a sweep (before backward) had been modified in place."""
    found: list[bool] = []
    original = views.HeldViews._reach

    def reach(group: list[views.BaseFallback]) -> object:
        decided = original(group)
        if decided is views._Reach.NOBODY:
            found.extend(f.view._version != f.version for f in group if f.view is not None)
        return decided

    monkeypatch.setattr(views.HeldViews, "_reach", staticmethod(reach))
    return found


def test_views_let_go_of_keep_their_gradients(tmp_path: Path, verdicts: list[bool]) -> None:
    """A deep model whose views are modified in place records bitwise the gradients of its out-of-place twin, while
    sweeps let go of views both modified and unmodified before backward."""
    x = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(1))
    recorded = _twins(_deep, x, tmp_path)
    assert True in verdicts  # a view let go of after an in-place change, and one without
    assert False in verdicts
    plain, inplace = recorded[False], recorded[True]
    assert sorted(plain) == sorted(inplace)
    assert ("11.twice", "grad_input.x") in inplace
    assert ("11.lin2", "grad_output") in inplace
    for key, value in plain.items():
        assert torch.equal(value, inplace[key]), key


class _LateInplace(nn.Module):
    """A projection's output (a view) kept in a local while many module calls run, then modified in place."""

    def __init__(self, inplace: bool) -> None:
        super().__init__()
        self.inplace = inplace
        self.proj = nn.Linear(8, 8)
        self.mids = nn.ModuleList(nn.Linear(8, 8) for _ in range(30))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        held = self.proj(x)
        y = x
        for mid in self.mids:  # sweeps run meanwhile: ``held`` is reached by this frame, so it stays held
            y = mid(y)
        return (held.relu_() if self.inplace else held.relu()) + y


def test_a_view_held_by_python_code_is_not_let_go(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A view modified in place long after its module returned, by code holding it, still has its gradient."""
    sweeps = []
    original = views.HeldViews._sweep
    monkeypatch.setattr(views.HeldViews, "_sweep", lambda self, f: sweeps.append(len(f)) or original(self, f))
    x = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(1))
    recorded = _twins(_LateInplace, x, tmp_path)
    assert len(sweeps) >= 2
    assert torch.count_nonzero(recorded[True][("proj", "grad_output")]) < 80  # the ReLU's mask reached it
    for key, value in recorded[False].items():
        assert torch.equal(value, recorded[True][key]), key


class _GradientInsideForward(nn.Module):
    """A gradient taken inside forward runs the base's node (and its fallback) while forward still holds the view,
    which is modified in place afterwards."""

    def __init__(self, inplace: bool) -> None:
        super().__init__()
        self.lin, self.flat, self.act, self.out = (
            nn.Linear(8, 8),
            nn.Flatten(),
            nn.ReLU(inplace=inplace),
            nn.Linear(16, 4),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.lin(x)
        flat = self.flat(hidden)  # a hooked view of ``hidden``
        (inner,) = torch.autograd.grad((hidden * 3).sum(), x, create_graph=True)
        return self.out(self.act(flat)) + inner.sum()


def test_a_gradient_inside_forward_does_not_let_go_of_a_held_view(tmp_path: Path) -> None:
    """The fallback called by a gradient taken inside forward keeps a view that forward code still holds: the view
    modified in place afterwards records the gradients of its out-of-place twin."""
    x = torch.randn(2, 2, 8, generator=torch.Generator().manual_seed(1), requires_grad=True)
    recorded = _twins(_GradientInsideForward, x, tmp_path)
    assert ("flat", "grad_output") in recorded[True]
    assert sorted(recorded[False]) == sorted(recorded[True])
    for key, value in recorded[False].items():
        assert torch.equal(value, recorded[True][key]), key


_PEAK = textwrap.dedent(
    """
    import sys, torch
    from torch import nn
    from parity_harness.capture.observe.hooks import ModuleTap

    class FF(nn.Module):  # tanh keeps its output, not its input: the bare run frees each projection's output
        def __init__(self):
            super().__init__()
            self.norm, self.up, self.act = nn.LayerNorm(128), nn.Linear(128, 1024), nn.Tanh()
            self.drop, self.down = nn.Dropout(0.1), nn.Linear(1024, 128)
        def forward(self, x):
            return x + 0.5 * self.down(self.drop(self.act(self.up(self.norm(x)))))

    class Ignore:
        def on_inputs(self, *a): pass
        def on_outputs(self, *a): pass
        def on_grad(self, *a): pass

    torch.manual_seed(0)
    model = nn.Sequential(*[FF() for _ in range(12)]).eval()
    x = torch.randn(4, 256, 128, requires_grad=True)
    def status(field):
        return next(int(line.split()[1]) << 10 for line in open("/proc/self/status") if line.startswith(field))

    with open("/proc/self/clear_refs", "w") as clear:  # the peak so far (imports) reset to the present use
        clear.write("5")
    before = status("VmRSS:")
    with (ModuleTap(model, Ignore()) if sys.argv[1] == "hooked" else torch.enable_grad()):
        out = model(x)
    out.backward(torch.ones_like(out))
    print(status("VmHWM:") - before)
    """
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="peak RSS through glibc's mmap threshold")
def test_hooks_keep_no_memory_the_bare_run_frees() -> None:
    """Forward and backward with every gradient hook on peak within two projection outputs (4 MB each) of the bare
    run: the views that died since the last sweep wait for the next. Holding every hooked view until backward cost
    about 16 such outputs here (67 MB).

    Allocations above 64 KiB are mapped and unmapped one by one (``MALLOC_MMAP_THRESHOLD_``), so the peak RSS
    follows live tensor memory exactly instead of the allocator's reuse; the child's peak is reset after its imports
    (``/proc/self/clear_refs``: ``ru_maxrss`` would carry over this process's own from the fork)."""
    environment = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"}

    def peak(mode: str) -> int:
        done = subprocess.run(
            [sys.executable, "-c", _PEAK, mode], capture_output=True, text=True, env=environment, check=True
        )
        return int(done.stdout.split()[-1])

    bare, hooked = peak("bare"), peak("hooked")
    assert bare > 50 << 20  # the model's activations really are measured
    assert hooked - bare <= 8 << 20, (bare >> 20, hooked >> 20)
