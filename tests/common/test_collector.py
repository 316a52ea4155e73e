"""The garbage collector kept off the objects alive before a run, for the run's length only."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from parity_harness.capture.record.recorder import capture_run
from parity_harness.common.collector import older_objects_frozen
from parity_harness.replay.compare.runner import compare_run
from parity_harness.replay.reader import BundleReader


@pytest.fixture
def nothing_frozen() -> Iterator[None]:
    gc.unfreeze()
    yield
    gc.unfreeze()


def test_frozen_inside_and_unfrozen_after(nothing_frozen: None) -> None:
    """Objects alive before the block are frozen within it; after it nothing is, an exception included."""
    assert gc.get_freeze_count() == 0
    with older_objects_frozen():
        assert gc.get_freeze_count() > 0
    assert gc.get_freeze_count() == 0
    with pytest.raises(ValueError, match="in the block"), older_objects_frozen():
        raise ValueError("in the block")
    assert gc.get_freeze_count() == 0


def test_garbage_of_frozen_objects_is_collected_after(nothing_frozen: None) -> None:
    """A cycle alive when the block began that became garbage in it is left alone by collections within the block
    (they walk the run's own objects) and collected once the block ends."""

    class Node:
        pass

    node = Node()
    node.itself = node  # type: ignore[attr-defined]
    alive = weakref.ref(node)
    with older_objects_frozen():
        del node
        gc.collect()
        assert alive() is not None
    gc.collect()
    assert alive() is None


def test_a_caller_freeze_and_a_disabled_collector_are_left_alone(nothing_frozen: None) -> None:
    """Objects the caller froze stay frozen after the block; with the collector off, nothing is frozen."""
    gc.freeze()
    frozen = gc.get_freeze_count()
    with older_objects_frozen():
        pass
    assert gc.get_freeze_count() == frozen
    gc.unfreeze()
    gc.disable()
    try:
        with older_objects_frozen():
            assert gc.get_freeze_count() == 0
    finally:
        gc.enable()


def test_capture_and_replay_leave_nothing_frozen(tmp_path: Path, nothing_frozen: None) -> None:
    """The library calls freeze for their own length only."""
    seen: list[int] = []

    class Probe(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen.append(gc.get_freeze_count())
            return x * 2

    model = torch.nn.Sequential(torch.nn.Linear(3, 3), Probe())
    inputs = (torch.randn(2, 3),)
    capture_run(model, inputs, tmp_path / "b.h5")
    assert seen[-1] > 0
    assert gc.get_freeze_count() == 0
    with BundleReader(tmp_path / "b.h5") as reader:
        assert compare_run(model, reader).match
    assert seen[-1] > 0
    assert gc.get_freeze_count() == 0
