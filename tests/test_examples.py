"""The bundled example pair end to end: the port matches, and each planted bug is found where it is."""

from __future__ import annotations

from pathlib import Path

import pytest

from parity_harness.common.numerics.tolerances import Tolerance, ToleranceTable
from parity_harness.replay.result import ComparisonResult
from tests.conftest import PORT_DIR, REF_ADAPTER, replay_with_adapter


def _replay(
    bundle: Path, ckpt: Path, adapter_file: Path, tolerances: ToleranceTable | None = None, with_map: bool = True
) -> ComparisonResult:
    """Replay at ``tolerances``; none: the defaults (1e-5, and the rounding check for float32 near misses)."""
    return replay_with_adapter(bundle, ckpt, adapter_file, with_map=with_map, tolerances=tolerances)


def test_reference_replays_itself_exactly(ref_bundle: Path, ref_checkpoint: Path) -> None:
    """The reference replayed on its own bundle matches bit for bit in every record kind."""
    result = _replay(ref_bundle, ref_checkpoint, REF_ADAPTER, ToleranceTable(Tolerance(0.0, 0.0)), with_map=False)
    assert result.match
    assert all(compared > 0 for compared, _ in result.counts().values())
    assert not result.bundle_only
    assert not result.replay_only


def test_port_matches_reference(ref_bundle: Path, ref_checkpoint: Path) -> None:
    """The independently written port, renamed by its map file, matches at the default tolerances in every kind
    (with no tolerance given: some records differ from the reference by more than 1e-5, as float32 rounding)."""
    result = _replay(ref_bundle, ref_checkpoint, PORT_DIR / "adapter.py")
    assert result.match, [r.name for r in result.records if not r.match]
    counts = result.counts()
    assert counts["param_grad"] == (76, 76)
    assert counts["forward"][0] > 100
    assert counts["backward"][0] > 100
    assert all(r.match for r in result.param_values)
    assert len(result.param_values) == 76


@pytest.mark.parametrize(
    ("bug", "kind", "module"),
    [
        ("forward", "forward", "encoder.layers.1.conv.batch_norm"),
        ("backward", "backward", "encoder.layers.1.conv.activation"),
    ],
    ids=["forward-bug-batchnorm-eps", "backward-bug-swish-grad"],
)
def test_planted_bug_found_at_its_module(
    ref_bundle: Path, ref_checkpoint: Path, bug: str, kind: str, module: str
) -> None:
    """Each planted bug makes the replay fail with the buggy module as the first divergence."""
    result = _replay(ref_bundle, ref_checkpoint, PORT_DIR / f"adapter_bug_{bug}.py")
    assert not result.match
    first = result.first_divergence(kind)  # type: ignore[arg-type]
    assert first is not None
    assert first.module == module
    if bug == "backward":  # a backward-only bug leaves every forward record intact
        assert result.first_divergence("forward") is None
    assert result.to_json()["first_divergence"][kind] == module
