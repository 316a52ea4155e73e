"""The bundled example pair end to end: the port matches, and each planted bug is found where it is."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from parity_harness.capture.models.adapters import load_adapter
from parity_harness.common.numerics.tolerances import Tolerance, ToleranceTable
from parity_harness.replay.compare.runner import compare_run
from parity_harness.replay.naming.alignment import align_modules
from parity_harness.replay.naming.mapping import read_map
from parity_harness.replay.reader import BundleReader
from parity_harness.replay.result import ComparisonResult
from tests.conftest import PORT_DIR, PORT_MAP, REF_ADAPTER, replay_with_adapter


def _replay(
    bundle: Path, ckpt: Path, adapter_file: Path, tolerances: ToleranceTable | None = None, with_map: bool = True
) -> ComparisonResult:
    """Replay at ``tolerances``; none: the defaults (1e-5, and the rounding check for float32 near misses)."""
    return replay_with_adapter(bundle, ckpt, adapter_file, with_map=with_map, tolerances=tolerances)


def test_reference_replays_itself_exactly(ref_bundle: Path, ref_checkpoint: Path) -> None:
    """The reference replayed on its own bundle matches bit for bit in every record kind (an eval-mode run moves no
    buffer: none is compared)."""
    result = _replay(ref_bundle, ref_checkpoint, REF_ADAPTER, ToleranceTable(Tolerance(0.0, 0.0)), with_map=False)
    assert result.match
    counts = result.counts()
    assert counts.pop("buffer") == (0, 0)
    assert counts.pop("input_grad") == (0, 0)  # audio that requires no gradient
    assert all(compared > 0 for compared, _ in counts.values())
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


@pytest.mark.parametrize("adapter", ["adapter.py", "adapter_bug_forward.py", "adapter_bug_backward.py",
                                     "adapter_bug_attention.py", "adapter_bug_glue.py"])  # fmt: skip
def test_map_auto_finds_what_the_hand_map_finds(ref_bundle: Path, ref_checkpoint: Path, adapter: str) -> None:
    """--map auto (with the hand map's waivers) on the correct port and on each planted bug: the same verdict,
    first divergences and first origins as the hand-written map (the weights pin every module holding them)."""
    port = load_adapter(str(PORT_DIR / adapter))
    waivers = tuple(line.split()[1] for line in PORT_MAP.read_text().splitlines() if line.startswith("waive "))
    with BundleReader(ref_bundle) as reader:
        model = port.model(str(ref_checkpoint), "cpu")
        proposal = align_modules(model, reader, forward=port.forward, to_reference=port.to_reference)
        auto = compare_run(
            model,
            reader,
            forward=port.forward,
            isolation_inputs=port.isolation_inputs,
            rename=proposal.rename_map(),
            waive=waivers,
            isolate=True,
        )
    with BundleReader(ref_bundle) as reader:
        hand = compare_run(
            port.model(str(ref_checkpoint), "cpu"),
            reader,
            forward=port.forward,
            isolation_inputs=port.isolation_inputs,
            rename=read_map(PORT_MAP),
            isolate=True,
        )
    assert auto.verdict == hand.verdict
    for kind in ("forward", "backward"):
        assert auto.to_json()["first_divergence"][kind] == hand.to_json()["first_divergence"][kind]
        assert auto.to_json()["first_origin"][kind] == hand.to_json()["first_origin"][kind]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_parakeet_ports_features_follow_the_signals_dtype(dtype: torch.dtype) -> None:
    """transformers' feature extractor computes in float32: the example port's features came out float32 in the
    rounding check's float64 rerun too, which then failed ("Input type (float) and bias type (double)"), leaving a
    correct port's near misses undecided (INCOMPLETE, a review's 1-layer and 4 x 2 s variants)."""
    pytest.importorskip("transformers")
    from tests.nemo.parakeet_variants import Featurizer as featurizer_class  # the example port's own

    config = {"sample_rate": 16000, "features": 80, "n_fft": 512, "window_size": 0.025, "window_stride": 0.01}
    featurizer = featurizer_class(config, torch.rand(1, 80, 257, generator=torch.Generator().manual_seed(0)))
    signal = torch.randn(2, 16000, generator=torch.Generator().manual_seed(1)).to(dtype)
    features, frames = featurizer(signal, torch.tensor([16000, 12000]))
    assert features.dtype == dtype
    assert frames.tolist() == [100, 75]
