"""The rounding check's float64 rerun refuses only a view it cannot follow: one of a buffer the run wrote."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from parity_harness.capture.record.recorder import capture_run
from parity_harness.replay.compare.runner import compare_run
from parity_harness.replay.reader import BundleReader
from tests.independent_port import build, token_ids


def _with_views(model: nn.Module) -> nn.Module:
    """Views a float64 rerun reads correctly: a 2-D view of a causal mask no forward writes, empty placeholders (a
    device probe), a classic spectral norm's ``weight`` (a view of ``weight_orig`` that its hook replaces)."""
    model.register_buffer("causal", torch.ones(1, 1, 64, 64, dtype=torch.bool).tril(), persistent=False)
    model.causal_2d = model.causal[0, 0]
    model.register_buffer("device_probe", torch.empty(0), persistent=False)
    model.past = torch.empty(0)
    nn.utils.spectral_norm(model.head)
    return model


def test_a_correct_port_with_views_it_never_writes_passes_by_the_rounding_rule(tmp_path: Path) -> None:
    """Refusing the rerun over any attribute sharing a parameter's or buffer's memory left the near misses of such a
    correct port (its float32 rounding differs from the reference's) undecided, some failed outright: MISMATCH."""
    torch.manual_seed(0)
    capture_run(_with_views(build()), token_ids(), tmp_path / "b.h5", seed=0)
    torch.manual_seed(0)
    port = _with_views(build(manual=True))
    with BundleReader(tmp_path / "b.h5") as reader:
        result = compare_run(port, reader)
    assert result.verdict == "MATCH", result.notes
    assert any(note.startswith("rounding rule:") for note in result.notes)


def _with_written_view(model: nn.Module) -> nn.Module:
    """A view of a buffer the run writes (a step counter's row, moved by a pre-hook): the float64 rerun cannot
    follow it, and is refused."""
    model.register_buffer("steps", torch.zeros(2, 3), persistent=False)
    model.step_row = model.steps[0]
    model.register_forward_pre_hook(_count_step)
    return model


def _count_step(module: nn.Module, args: tuple[object, ...]) -> None:
    with torch.no_grad():
        module.steps.add_(1)


def test_a_refused_rerun_with_a_failing_record_says_the_verdict_is_a_mismatch(tmp_path: Path) -> None:
    """Where the rerun cannot run, the records rounding could explain are undecided; when another record fails anyway,
    the note said "the replay is INCOMPLETE, not a mismatch" while the verdict was MISMATCH."""
    torch.manual_seed(0)
    capture_run(_with_written_view(build()), token_ids(), tmp_path / "b.h5", seed=0)
    torch.manual_seed(0)
    port = _with_written_view(build(manual=True))
    with torch.no_grad():
        port.head.bias.add_(1.0)
    with BundleReader(tmp_path / "b.h5") as reader:
        result = compare_run(port, reader)
    notes = [note for note in result.notes if note.startswith("rounding check:")]
    assert len(notes) == 1, result.notes
    assert "shares the memory of a buffer its run wrote" in notes[0]
    assert result.verdict == "MISMATCH"
    assert notes[0].endswith("other records fail regardless")
