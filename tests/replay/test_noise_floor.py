"""Noise floor: judge a port against the reference's own float32-vs-float64 error."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from parity_harness.capture.models.adapters import load_adapter
from parity_harness.capture.record.recorder import capture_run
from parity_harness.common.errors import InputError
from parity_harness.common.format.bundle.schema import iter_tensors
from parity_harness.common.numerics.tolerances import Tolerance, ToleranceTable
from parity_harness.replay.compare.runner import compare_run
from parity_harness.replay.reader import BundleReader
from parity_harness.replay.result import ComparisonResult
from tests.conftest import PORT_DIR, REF_ADAPTER, replay_with_adapter
from tests.models import RunningCentre


@pytest.fixture(scope="module")
def noise_bundle(tmp_path_factory: pytest.TempPathFactory, ref_checkpoint: Path) -> Path:
    """The example reference captured with --noise-floor (8000 samples)."""
    adapter = load_adapter(str(REF_ADAPTER))
    out = tmp_path_factory.mktemp("noise") / "ref_noise.h5"
    capture_run(adapter.model(str(ref_checkpoint), "cpu"), adapter.inputs(42, 2, 8000), out, noise_floor=True)
    return out


def _port(
    bundle: Path, ckpt: Path, adapter_name: str, tolerances: ToleranceTable, factor: float | None
) -> ComparisonResult:
    return replay_with_adapter(bundle, ckpt, PORT_DIR / adapter_name, tolerances=tolerances, noise_factor=factor)


def test_floor_is_recorded_per_record(noise_bundle: Path) -> None:
    """Float records get a floor (exactly 0 for the raw input, positive deeper in), ints get none."""
    with BundleReader(noise_bundle) as reader:
        floors = reader.index.noise_floor
        assert reader.format_minor >= 1
    assert floors["preprocessor/0/input.input_signal"] == 0.0
    assert floors["encoder.layers.1/0/output"] > 0.0
    assert floors["encoder.layers.0.conv.depthwise_conv.weight"] > 0.0
    assert "output.1" not in floors  # encoded lengths are integers


def test_rounding_only_port_passes_against_noise_where_zero_tolerance_fails(
    noise_bundle: Path, ref_checkpoint: Path
) -> None:
    """The correct port fails at atol=rtol=0 but passes within 4x the reference's own float64 error."""
    exact = ToleranceTable(Tolerance(0.0, 0.0))
    assert not _port(noise_bundle, ref_checkpoint, "adapter.py", exact, None).match
    judged = _port(noise_bundle, ref_checkpoint, "adapter.py", ToleranceTable(Tolerance(1e-7, 0.0)), 4.0)
    assert judged.match, [r.name for r in judged.records if not r.match]
    assert judged.to_json()["tolerance"]["noise_factor"] == 4.0


def test_real_bug_still_fails_against_noise(noise_bundle: Path, ref_checkpoint: Path) -> None:
    """A planted bug is far above the noise floor and still found at its module."""
    result = _port(noise_bundle, ref_checkpoint, "adapter_bug_forward.py", ToleranceTable(Tolerance(1e-7, 0.0)), 4.0)
    first = result.first_divergence("forward")
    assert first is not None
    assert first.module == "encoder.layers.1.conv.batch_norm"


def test_noise_floor_run_changes_no_recorded_value(tmp_path: Path, ref_checkpoint: Path) -> None:
    """The float64 rerun does not alter what the float32 run recorded."""
    adapter = load_adapter(str(REF_ADAPTER))
    paths = {}
    for flag in (False, True):
        paths[flag] = tmp_path / f"noise_{flag}.h5"
        capture_run(
            adapter.model(str(ref_checkpoint), "cpu"), adapter.inputs(42, 2, 4000), paths[flag], noise_floor=flag
        )
    with BundleReader(paths[False]) as plain, BundleReader(paths[True]) as noisy:
        for (slot, a), (_, b) in zip(
            iter_tensors(plain.index.outputs, "output"), iter_tensors(noisy.index.outputs, "output"), strict=True
        ):
            assert torch.equal(plain.read_tensor(a), noisy.read_tensor(b)), slot
        for name, ref in plain.index.grads.items():
            assert torch.equal(plain.read_tensor(ref), noisy.read_tensor(noisy.index.grads[name])), name


def test_noise_judging_needs_a_floor(tiny_bundle: Path) -> None:
    """Asking for noise judging on a bundle captured without --noise-floor says how to get one."""
    from tests.models import build_tiny

    with BundleReader(tiny_bundle) as reader, pytest.raises(InputError, match="capture-run --noise-floor"):
        compare_run(build_tiny(), reader, noise_factor=2.0)


class _NoCopy(torch.nn.Module):
    """A model that refuses to be deep-copied (as NeMo's proxies do), with a BatchNorm and a frozen parameter."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.lin, self.norm = torch.nn.Linear(4, 6), torch.nn.BatchNorm1d(6)
        self.scale = torch.nn.Parameter(torch.tensor(0.5), requires_grad=False)

    def __deepcopy__(self, memo: dict) -> None:
        raise NotImplementedError("object proxy must define __deepcopy__()")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.lin(x)) * self.scale


@pytest.mark.parametrize("train_mode", [False, True])
def test_noise_floor_needs_no_copy_and_leaves_the_model_as_it_was(tmp_path: Path, train_mode: bool) -> None:
    """The float64 rerun swaps the model's own tensors and puts the very same ones back: afterwards parameters,
    gradients, BatchNorm statistics and mode are bit-identical to a twin captured without it, same objects."""
    plain, measured = _NoCopy().train(train_mode), _NoCopy().train(train_mode)
    storage = {name: p.data_ptr() for name, p in measured.named_parameters()}
    x = torch.randn(5, 4)
    capture_run(plain, (x,), tmp_path / "plain.h5", seed=1, train_mode=train_mode)
    capture_run(measured, (x,), tmp_path / "noise.h5", seed=1, train_mode=train_mode, noise_floor=True)
    with BundleReader(tmp_path / "noise.h5") as reader:
        floors = reader.index.noise_floor
    assert floors["lin/0/output"] > 0.0
    assert floors["lin.weight"] > 0.0
    assert measured.training is train_mode
    assert all(p.data_ptr() == storage[name] for name, p in measured.named_parameters())  # the same memory
    twin = dict(plain.named_parameters())
    for name, param in measured.named_parameters():
        assert param.dtype == torch.float32
        assert (param.grad is None) == (twin[name].grad is None), name
        assert param.grad is None or torch.equal(param.grad, twin[name].grad), name
    for (name, tensor), other in zip(measured.state_dict().items(), plain.state_dict().values(), strict=True):
        assert torch.equal(tensor, other), name  # BatchNorm updates of the float64 run landed on copies


def test_the_noise_floor_run_starts_from_the_buffers_the_recorded_run_started_from(tmp_path: Path) -> None:
    """A buffer the recorded run moved (a running mean updated before use) is put back for the float64 run: its floor
    is the reference's rounding (about 1e-6 here), not the distance to a computation with another mean; and the model
    gets its buffer back as it was before the capture."""
    model = RunningCentre()
    x = 10 * torch.randn(64, 16, generator=torch.Generator().manual_seed(1))
    capture_run(model, (x,), tmp_path / "noise.h5", seed=0, train_mode=True, noise_floor=True)
    with BundleReader(tmp_path / "noise.h5") as reader:
        floor = reader.index.noise_floor["output"]
    assert 0.0 < floor < 1e-4
    assert torch.equal(model.mean, RunningCentre().mean)  # moved by the recorded run, then put back


class _CentresItsInput(nn.Module):
    """Centres its input in place (an audio front end's normalisation) before two linear layers."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        features -= features.mean(-1, keepdim=True)
        return self.body(features)


class _ReturnsItsMemory(nn.Module):
    """Returns a buffer its forward updates in place (a streaming state, an EMA codebook) beside its output."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(16, 16)
        self.register_buffer("memory", torch.zeros(16))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = self.lin(x)
        self.memory.mul_(0.9).add_(0.1 * y.detach().mean((0, 1)))
        return y, self.memory


@pytest.mark.parametrize("model", [_CentresItsInput, _ReturnsItsMemory])
def test_the_floor_reruns_what_the_run_was_given_and_returned(tmp_path: Path, model: type[nn.Module]) -> None:
    """The checks' reruns took the caller's inputs, which the recorded run had changed in place, and compared the
    recorded outputs after the rewind had put back the buffer one of them is: an honest reference looked as if it did
    not repeat its run, and --noise-floor refused it. The reruns take the inputs as given, the outputs as returned."""
    x = torch.randn(4, 8, 16, generator=torch.Generator().manual_seed(1))
    capture_run(model(), (x.clone(),), tmp_path / "b.h5", seed=0, train_mode=True, noise_floor=True, self_check=True)
    with BundleReader(tmp_path / "b.h5") as reader:
        assert 0 < reader.index.noise_floor["output.0" if model is _ReturnsItsMemory else "output"] < 1e-5
