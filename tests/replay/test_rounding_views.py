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
