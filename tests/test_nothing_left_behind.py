"""A capture or a replay in a process leaves nothing behind: no hook on any tensor, no objects that outlive it.

Gradient hooks sit on tensors (module inputs and outputs, and the bases of views) that autograd holds from C++;
a hook left there keeps its sink, the sink's records and the views it watches alive in cycles Python's garbage
collector cannot see. A test suite that captures and replays hundreds of times in one process must not grow.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

from parity_harness.capture.record.recorder import capture_run
from parity_harness.common.numerics.tolerances import Tolerance, ToleranceTable
from parity_harness.replay.compare.runner import compare_run
from parity_harness.replay.reader import BundleReader


class _Mixer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


class _ViewsNet(nn.Module):
    """Submodules called on views (transposes, slices, reshapes) of tensors that require grad, inputs included:
    every kind of hook a tap puts on tensors, fallbacks on the views' bases too."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second, self.norm = _Mixer(), _Mixer(), nn.LayerNorm(6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.first(x.transpose(0, 1))
        h = self.norm(h[:, 1:].reshape(-1, 6))
        return self.second(h.view(3, -1, 6).transpose(0, 1))


def _model() -> nn.Module:
    torch.manual_seed(0)
    return _ViewsNet().eval()


def _inputs() -> dict[str, torch.Tensor]:
    return {"x": torch.randn(4, 3, 6, generator=torch.Generator().manual_seed(1), requires_grad=True)}


def _hooked_tensors() -> int:
    """Live tensors carrying Python gradient hooks."""
    gc.collect()
    return sum(1 for o in gc.get_objects() if issubclass(type(o), torch.Tensor) and o._backward_hooks)


def _growth(run: Callable[[], None], times: int = 4) -> int:
    """Objects the garbage collector tracks after ``times`` runs, less after one (warm caches)."""
    run()
    gc.collect()
    before = len(gc.get_objects())
    for _ in range(times):
        run()
    gc.collect()
    return len(gc.get_objects()) - before


def _captures(tmp_path: Path, **options: object) -> Callable[[], None]:
    model, inputs = _model(), _inputs()

    def run() -> None:
        capture_run(model, inputs, tmp_path / "c.h5", seed=3, overwrite=True, **options)
        assert not inputs["x"]._backward_hooks  # the caller's own tensor is as it was

    return run


def _replays(tmp_path: Path, port: nn.Module, **options: object) -> Callable[[], None]:
    bundle = tmp_path / "ref.h5"
    capture_run(_model(), _inputs(), bundle, seed=3)

    def run() -> None:
        with BundleReader(bundle) as reader:
            compare_run(port, reader, **options)

    return run


def _off_by(scale: float) -> nn.Module:
    port = _model()
    with torch.no_grad():
        for p in port.parameters():
            p.mul_(1 + scale)
    return port


CASES: dict[str, Callable[[Path], Callable[[], None]]] = {
    "capture": lambda tmp: _captures(tmp),
    "capture --noise-floor --self-check": lambda tmp: _captures(tmp, noise_floor=True, self_check=True),
    "replay, exact port": lambda tmp: _replays(tmp, _model()),
    "replay, port off (rounding rerun in float64)": lambda tmp: _replays(
        tmp, _off_by(3e-6), tolerances=ToleranceTable(Tolerance(1e-6, 1e-6)), rounding=True
    ),
    "replay --isolate": lambda tmp: _replays(tmp, _off_by(1e-3), isolate=True),
}


@pytest.mark.parametrize("case", CASES)
def test_runs_leave_no_hooks_and_no_objects(case: str, tmp_path: Path) -> None:
    """Repeated in one process, each kind of run leaves no tensor hooked and the tracked objects do not grow (a
    leak was thousands of objects a run; a few dozen allow for caches that fill once)."""
    run = CASES[case](tmp_path)
    growth = _growth(run)
    assert _hooked_tensors() == 0
    assert growth < 50, f"{growth} objects left behind by 4 runs"
