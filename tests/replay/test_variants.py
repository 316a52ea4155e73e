"""Replay variants: reduced precision, torch.compile, another device."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from torch import nn

from parity_harness.capture.record.recorder import capture_run
from parity_harness.common.errors import InputError
from parity_harness.common.numerics.tolerances import Tolerance, ToleranceTable
from parity_harness.replay.cli.replay_compare import main
from parity_harness.replay.compare.precision import Precision
from parity_harness.replay.compare.runner import compare_run
from parity_harness.replay.reader import BundleReader
from parity_harness.replay.result import ComparisonResult
from tests.conftest import PORT_DIR, REF_ADAPTER, replay_with_adapter
from tests.models import MatmulConv1d, build_convolutions, build_tiny, tiny_inputs

EXACT = ToleranceTable(Tolerance(1e-5, 1e-5))


def build_smooth() -> nn.Module:
    """A seeded model without kinks (no ReLU): reduced precision moves values, never flips a branch."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 4))


@pytest.fixture
def smooth_bundle(tmp_path: Path) -> Path:
    out = tmp_path / "smooth.h5"
    capture_run(build_smooth(), (torch.randn(8, 16, generator=torch.Generator().manual_seed(1)),), out)
    return out


def replay(bundle: Path, model: nn.Module, tolerances: ToleranceTable, **options: object) -> ComparisonResult:
    with BundleReader(bundle) as reader:
        return compare_run(model, reader, tolerances=tolerances, **options)  # type: ignore[arg-type]


@pytest.mark.parametrize("precision", [Precision(autocast="bf16"), Precision(dtype="bf16"), Precision(dtype="fp16")])
def test_reduced_precision_fails_float32_tolerances_and_passes_its_preset(
    smooth_bundle: Path, precision: Precision
) -> None:
    """A float32 bundle replayed in bf16/fp16: out of tolerance at 1e-5, within the precision's preset."""
    strict = replay(smooth_bundle, build_smooth(), EXACT, precision=precision)
    assert not strict.match
    assert all(r.diff.problem is None for r in strict.records)  # values differ; no dtype mismatch is claimed
    preset = replay(smooth_bundle, build_smooth(), ToleranceTable(precision.preset()), precision=precision)
    assert preset.match, [r.name for r in preset.records if not r.match]
    assert f"precision: {precision.describe()}; values compared upcast to float32" in preset.notes


def test_cli_uses_the_precision_preset_unless_tolerances_are_given(tmp_path: Path, tiny_ckpt: Path) -> None:
    """replay-compare --autocast bf16 applies the bf16 preset by default and the given --atol/--rtol otherwise."""
    out = tmp_path / "b.h5"
    capture_run(build_tiny(), tiny_inputs(), out)
    args = ["--bundle", str(out), "--model", "tests.models:build_tiny", "--ckpt", str(tiny_ckpt), "--quiet",
            "--json", str(tmp_path / "r.json")]  # fmt: skip
    for extra, atol in (([], 5e-2), (["--atol", "1e-3", "--rtol", "1e-3"], 1e-3)):
        result = CliRunner().invoke(main, [*args, "--autocast", "bf16", *extra])
        assert result.exit_code in (0, 1), result.output
        assert "precision: forward under autocast(bf16); values compared upcast to float32" in result.output
        assert f"atol={atol:g}" in result.output


def test_bad_precision_is_refused() -> None:
    """--autocast fp32 would change nothing: refused, saying what to use."""
    with pytest.raises(InputError, match="--autocast fp32 changes nothing"):
        Precision(autocast="fp32")


@pytest.fixture(scope="module")
def ref_bundle_with_floor(tmp_path_factory: pytest.TempPathFactory, ref_checkpoint: Path) -> Path:
    """The example reference captured with its float32-vs-float64 noise floor."""
    from parity_harness.capture.cli.capture_run import main as capture_main

    out = tmp_path_factory.mktemp("floor") / "ref.h5"
    args = ["--ckpt", str(ref_checkpoint), "--adapter", str(REF_ADAPTER), "--out", str(out), "--noise-floor"]
    assert CliRunner().invoke(capture_main, args).exit_code == 0
    return out


@pytest.mark.slow
def test_compiled_example_port_matches_the_eager_reference(ref_bundle_with_floor: Path, ref_checkpoint: Path) -> None:
    """The example port under torch.compile (inductor, CPU) matches the eager float32 reference within 8x the
    reference's own float32 rounding error per record; module records are left out and the report says so."""
    result = replay_with_adapter(
        ref_bundle_with_floor, ref_checkpoint, PORT_DIR / "adapter.py",
        tolerances=ToleranceTable(Tolerance(1e-7, 0.0)), noise_factor=8, compile_backend="inductor",
    )  # fmt: skip
    assert result.match, [(r.name, r.diff.max_abs) for r in result.records if not r.match][:5]
    counts = result.counts()
    assert counts["output"][0] >= 1
    assert counts["param_grad"] == (76, 76)
    assert counts["forward"] == (0, 0)
    assert not result.bundle_only
    assert any("torch.compile (backend inductor)" in note for note in result.notes)


def test_compiled_port_with_module_records(tmp_path: Path) -> None:
    """--compile-per-module keeps the hooks: module records are compared too (eager backend, quick)."""
    out = tmp_path / "b.h5"
    capture_run(build_smooth(), (torch.randn(8, 16, generator=torch.Generator().manual_seed(1)),), out)
    result = replay(out, build_smooth(), EXACT, compile_backend="eager", compiled_module_records=True)
    assert result.match
    assert result.counts()["forward"][0] > 0
    assert not result.bundle_only


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_replay_on_cuda_matches_a_cpu_capture(tmp_path: Path) -> None:
    """A CPU float32 capture replayed on CUDA (TF32 off, by the replay) matches at float32 tolerances; comparison
    runs on the host."""
    out = tmp_path / "b.h5"
    capture_run(build_smooth(), (torch.randn(8, 16, generator=torch.Generator().manual_seed(1)),), out)
    result = replay(out, build_smooth().cuda(), ToleranceTable(Tolerance(1e-5, 1e-4)), device="cuda")
    assert result.match, [(r.name, r.diff.max_abs) for r in result.records if not r.match][:5]
    assert result.replay_provenance["device"].startswith("cuda")


_DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))]


@pytest.mark.parametrize("device", _DEVICES)
def test_a_port_with_its_own_convolution_kernel_matches_at_the_defaults(tmp_path: Path, device: str) -> None:
    """The reference's convolutions run in cuDNN, the port's as matrix products: a correct port at the defaults.
    On a GPU cuDNN rounds float32 convolutions to TF32 unless told not to (about 1e-3): with TF32 as torch sets
    it the same port fails, so the pass is the tool turning it off, not luck."""
    out = tmp_path / "conv.h5"
    inputs = (torch.randn(4, 64, 200, generator=torch.Generator().manual_seed(1)).to(device),)
    capture_run(build_convolutions(nn.Conv1d).to(device), inputs, out)
    with BundleReader(out) as reader:
        result = compare_run(build_convolutions(MatmulConv1d).to(device), reader, device=device)
    assert result.verdict == "MATCH", [(r.name, r.diff.max_abs) for r in result.records if not r.match][:5]
    if device == "cuda" and torch.cuda.get_device_capability() >= (8, 0):  # TF32 exists from Ampere on
        capture_run(build_convolutions(nn.Conv1d).to(device), inputs, out, overwrite=True, allow_tf32=True)
        with BundleReader(out) as reader:
            with_tf32 = compare_run(build_convolutions(MatmulConv1d).to(device), reader, device=device, allow_tf32=True)
        assert with_tf32.verdict == "MISMATCH"


@pytest.mark.parametrize("precision", [Precision(dtype="bf16"), Precision(autocast="bf16")])
def test_isolation_runs_modules_in_the_replay_precision(smooth_bundle: Path, precision: Precision) -> None:
    """--isolate with --dtype/--autocast feeds each module the recorded inputs in that precision: every module
    is isolated (none refused for a dtype clash) and, within the preset, nothing is an origin."""
    result = replay(
        smooth_bundle, build_smooth(), ToleranceTable(precision.preset()), precision=precision, isolate=True
    )
    assert result.isolated
    assert result.not_isolated == {}
    assert result.match


def test_assert_parity_with_a_precision_takes_its_preset(smooth_bundle: Path) -> None:
    """assert_parity(precision=bf16) at the defaults judges by the bf16 preset, as replay-compare --dtype bf16 does
    (it judged by 1e-5 and every record failed)."""
    from parity_harness.replay import assert_parity

    result = assert_parity(build_smooth(), smooth_bundle, precision=Precision(dtype="bf16"))
    assert (result.tolerances.default.atol, result.tolerances.default.rtol) == (5e-2, 5e-2)


class _Normed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin, self.norm = nn.Linear(4, 4), nn.BatchNorm1d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.lin(x))


def test_a_replay_leaves_the_callers_model_as_it_was(tmp_path: Path) -> None:
    """A train-mode replay moves BatchNorm's statistics and sets train mode, --dtype casts the weights: after
    compare_run the model has its own mode, buffer values and weights back, so that a test checking one model
    against two bundles compares the second with the model it built (it failed 15 of 22 records)."""
    inputs = (torch.randn(8, 4, generator=torch.Generator().manual_seed(1)),)
    trained, evaluated = tmp_path / "train.h5", tmp_path / "eval.h5"
    capture_run(_Normed(), inputs, trained, seed=0, train_mode=True)
    capture_run(_Normed().eval(), inputs, evaluated, seed=0)
    model = _Normed().eval()
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    assert replay(trained, model, EXACT).match
    assert replay(evaluated, model, EXACT).match
    replay(evaluated, model, EXACT, precision=Precision(dtype="bf16"))
    assert not model.training
    assert not model.norm.training
    after = model.state_dict()
    assert all(torch.equal(after[name], value) and after[name].dtype == value.dtype for name, value in before.items())


class _OddBuffers(nn.Module):
    """Buffers that cannot be written in place: an expanded one (stride 0) and one made under inference_mode."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 4)
        self.register_buffer("scale", torch.ones(1, 4).expand(3, 4))
        with torch.inference_mode():
            self.register_buffer("shift", torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale[0] + self.shift.clone()


def test_buffers_that_cannot_be_written_in_place_do_not_fail_the_replay(tmp_path: Path) -> None:
    """Putting the model back wrote every buffer in place, and an expanded or inference-mode buffer made every
    replay of such a model exit 2; unchanged buffers are left alone now."""
    path = tmp_path / "odd.h5"
    capture_run(_OddBuffers(), (torch.randn(3, 4),), path, seed=0)
    model = _OddBuffers()
    assert replay(path, model, EXACT).match
    assert model.scale.stride() == (0, 1)
