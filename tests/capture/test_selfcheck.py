"""--self-check: the recorded run must equal a run without hooks, bit for bit, or its gradients within the rounding of
sums the hooks group otherwise."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from torch import nn

from parity_harness.capture.cli.capture_run import main
from parity_harness.capture.observe.hooks import ModuleTap, _GradTap
from parity_harness.capture.record.recorder import capture_run
from parity_harness.capture.record.selfcheck import describe_self_check
from parity_harness.common.errors import CaptureError
from parity_harness.replay.reader import BundleReader
from tests.models import Clock, PreNormNet, RunningCentre, build_tiny, tiny_inputs


@pytest.mark.parametrize("train_mode", [False, True])
def test_observer_check_passes_on_an_honest_capture(tmp_path: Path, train_mode: bool) -> None:
    """In-place activations, a reused block and dropout-free train mode: the hooks change no bit."""
    capture_run(build_tiny(), tiny_inputs(), tmp_path / "b.h5", self_check=True, train_mode=train_mode)
    assert (tmp_path / "b.h5").exists()


def test_the_check_reruns_from_the_buffers_the_recorded_run_started_from(tmp_path: Path) -> None:
    """A buffer the forward updates before using it: the rerun started from the value the recorded run left and
    computed other numbers, so an honest capture failed as 'recording changed what the model computes'. The model
    gets its buffer back as it was before the capture."""
    model = RunningCentre()
    x = 10 * torch.randn(64, 16, generator=torch.Generator().manual_seed(1))
    capture_run(model, (x,), tmp_path / "b.h5", self_check=True, train_mode=True)
    assert (tmp_path / "b.h5").exists()
    assert torch.equal(model.mean, RunningCentre().mean)


def test_a_perturbing_observer_fails_the_capture(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """If the hooks changed a value (here: an 'alias' that is not exact), the capture fails and writes nothing."""
    honest = ModuleTap._alias

    def perturbing(self: ModuleTap, info: Any, value: Any, slot: str, *tracking: Any) -> Any:
        result = honest(self, info, value, slot, *tracking)
        return result * (1 + 1e-6) if isinstance(result, torch.Tensor) and result.requires_grad else result

    monkeypatch.setattr(ModuleTap, "_alias", perturbing)
    out = tmp_path / "b.h5"
    with pytest.raises(CaptureError, match=r"self-check: recording changed what the model computes in \d+ tensor"):
        capture_run(build_tiny(), tiny_inputs(), out, self_check=True)
    assert list(tmp_path.iterdir()) == []


def test_cli_reports_the_self_check(tmp_path: Path, tiny_ckpt: Path) -> None:
    """capture-run --self-check says it passed."""
    import numpy as np

    npz = tmp_path / "x.npz"
    np.savez(npz, x=np.random.default_rng(0).standard_normal((2, 3, 4)).astype(np.float32))
    result = CliRunner().invoke(
        main, ["--model", "tests.models:build_tiny", "--ckpt", str(tiny_ckpt), "--inputs", str(npz),
               "--out", str(tmp_path / "b.h5"), "--self-check"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "capture-run: self-check passed: outputs and gradients without hooks are bitwise the recorded ones" in (
        result.stdout
    )


class _WarmUp(nn.Module):
    """A forward scaling its output by a step counter it keeps in a plain attribute (a warm-up schedule)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 4)
        self.steps = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = min(1.0, (self.steps + 1) / 10)
        self.steps += 1
        return self.lin(x) * scale


def test_the_checks_rerun_from_the_attributes_the_recorded_run_started_from(tmp_path: Path) -> None:
    """The self-check's rerun and the noise floor's started from the buffers the recorded run started from, but from
    the step counter it had moved: an honest capture failed the self-check, and the floor measured the distance to
    another computation (0.2 where float32 rounding gives about 1e-7)."""
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
    model = _WarmUp()
    capture_run(model, (x,), tmp_path / "b.h5", self_check=True, noise_floor=True)
    with BundleReader(tmp_path / "b.h5") as reader:
        assert reader.index.noise_floor["output"] < 1e-6
    assert model.steps == 0


class _ViewOfCache(nn.Module):
    """An attribute viewing a buffer the forward writes into (half of a key/value cache)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 4)
        self.register_buffer("cache", torch.zeros(2, 4))
        self.keys = self.cache[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.cache[0].add_(x.mean(0))
        return self.lin(x) + self.keys


class _BufferViewOfCache(_ViewOfCache):
    """The same view, registered as a buffer of its own."""

    def __init__(self) -> None:
        super().__init__()
        del self.keys
        self.register_buffer("keys", self.cache[0], persistent=False)


class _MadeOnFirstCall(nn.Module):
    """A forward that registers a buffer and makes a layer on its first call."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 4)
        self.proj: nn.Linear | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.proj is None:
            self.register_buffer("centre", x.detach().mean(0))
            self.proj = nn.Linear(4, 4)
        return self.proj(self.lin(x) - self.centre)


def test_the_checks_rerun_with_the_models_views_and_what_its_forward_makes(tmp_path: Path) -> None:
    """The reruns started from copies of the model's attributes: a view of a buffer stopped following it, and the
    self-check failed an honest capture; a buffer and a layer made on the first call made it fail with a KeyError or
    a gradient "present without hooks"."""
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
    for model in (_ViewOfCache(), _MadeOnFirstCall()):
        capture_run(model, (x,), tmp_path / f"{type(model).__name__}.h5", self_check=True)


def test_the_noise_floor_refuses_what_its_float64_run_cannot_follow(tmp_path: Path) -> None:
    """A view of a buffer reads the float32 memory while the float64 run writes a float64 copy: the floor measured
    that (0.78 where rounding gives 1e-7) and let a port off by as much pass with a noise factor. A layer made in
    the forward is made in float32 there. Both refuse, saying why."""
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
    with pytest.raises(CaptureError, match=r"--noise-floor: the model's attribute 'keys' shares the memory of a buff"):
        capture_run(_ViewOfCache(), (x,), tmp_path / "view.h5", noise_floor=True)
    with pytest.raises(CaptureError, match=r"--noise-floor: the model's buffer '(keys|cache)' shares the memory of a"):
        capture_run(_BufferViewOfCache(), (x,), tmp_path / "buffer.h5", noise_floor=True)
    with pytest.raises(CaptureError, match=r"--noise-floor: the model's float64 run failed \(mat1 and mat2"):
        capture_run(_MadeOnFirstCall(), (x,), tmp_path / "made.h5", noise_floor=True)
    assert sorted(path.name for path in tmp_path.iterdir()) == []


class _Unhooked:
    """A tap's sink that records nothing."""

    def on_inputs(self, *_: object) -> None:
        pass

    def on_outputs(self, *_: object) -> None:
        pass

    def on_grad(self, *_: object) -> None:
        pass


def _pre_norm_grads(model: nn.Module, x: torch.Tensor, tapped: bool) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    tap = ModuleTap(model, _Unhooked())
    if tapped:
        with tap:
            y = model(x)
    else:
        y = model(x)
    y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(9)))
    tap.release()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


_PRE_NORM_INPUT = torch.randn(4, 7, 16, generator=torch.Generator().manual_seed(0))


def test_gradients_the_hooks_sum_apart_pass_within_float32_rounding(tmp_path: Path) -> None:
    """A pre-norm residual stack (Llama's, BERT's, T5's shape): the hooks hand each module an alias of its input, so the
    norm's two uses of it are summed before the residual's, and the gradients' last bits differ from a run without
    hooks. Honest captures of tiny HF Llama, BERT and T5 failed the self-check so; they pass within 4 x the model's
    own float32 error, measured against a float64 run, and the command says how many gradients differed."""
    model = PreNormNet()
    bare, hooked = _pre_norm_grads(model, _PRE_NORM_INPUT, False), _pre_norm_grads(model, _PRE_NORM_INPUT, True)
    differing = [name for name in bare if not torch.equal(bare[name], hooked[name])]
    assert differing, "the model no longer shows the hooks' regrouping: the test would prove nothing"
    summary = capture_run(model, (_PRE_NORM_INPUT,), tmp_path / "b.h5", self_check=True)
    assert summary.regrouped == len(differing)
    assert (tmp_path / "b.h5").exists()
    assert f"bitwise the recorded ones but {len(differing)}, which differ within float32 rounding" in (
        describe_self_check(summary.regrouped)
    )


def test_an_observer_perturbing_gradients_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Gradients are judged against the model's own rounding, not passed for differing a little: hooks that scaled
    the gradients flowing back by 1 + 1e-5 (about 80 float32 units in the last place) fail the capture."""

    def scaling(self: _GradTap, grad: torch.Tensor | None) -> torch.Tensor | None:
        return None if grad is None else grad * (1 + 1e-5)

    monkeypatch.setattr(_GradTap, "__call__", scaling)
    with pytest.raises(CaptureError, match=r"more than 4 x the bare run's own float32 error on it \(\S+, against"):
        capture_run(PreNormNet(), (_PRE_NORM_INPUT,), tmp_path / "b.h5", self_check=True)
    assert list(tmp_path.iterdir()) == []


class _Float32Only(PreNormNet):
    """A model whose forward refuses float64 (a kernel written for float32 only)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32:
            raise TypeError(f"expected float32, got {x.dtype}")
        return super().forward(x)


def test_gradients_that_no_float64_run_can_judge_fail_saying_why(tmp_path: Path) -> None:
    """Where the model cannot run in float64 (Mixtral's grouped matrix products), gradients whose bits differ cannot be
    told from a change: the capture fails, saying so and why, and does not claim that recording changed them."""
    with pytest.raises(CaptureError) as caught:
        capture_run(_Float32Only(), (_PRE_NORM_INPUT,), tmp_path / "b.h5", self_check=True)
    message = str(caught.value)
    assert re.match(r"self-check: \d+ output\(s\) or gradient\(s\) differ from a run without hooks, e\.g\. ", message)
    assert "could not be judged: the float64 run failed (TypeError: expected float32, got torch.float64)" in message
    assert "recording changed what the model computes" not in message
    assert message.endswith("capture without --self-check")
    assert list(tmp_path.iterdir()) == []


def _scaling_leaving(module: str) -> Any:
    """A defective hook: it scales the gradient leaving ``module`` towards its inputs by 1 + 1e-3."""

    def scaling(self: _GradTap, grad: torch.Tensor | None) -> torch.Tensor | None:
        if grad is not None and self.info.module == module and self.slot.startswith("grad_input"):
            return grad * (1 + 1e-3)
        return None

    return scaling


class _Counting(PreNormNet):
    """A forward scaling its input by a step counter it keeps (a warm-up schedule)."""

    def __init__(self) -> None:
        super().__init__()
        self.step = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.step += 1
        return super().forward(x * (1.0 + 0.1 * self.step))


def test_the_float64_run_starts_where_the_recorded_run_did(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The run without hooks moves the model's counter; the float64 run started from there computed the next step, its
    distance to the bare run was that step's, not rounding, and a defective hook passed within it. The float64 run now
    starts where the recorded run started: an honest capture passes, the defective hook fails."""
    summary = capture_run(_Counting(), (_PRE_NORM_INPUT,), tmp_path / "honest.h5", self_check=True)
    assert summary.regrouped > 0
    monkeypatch.setattr(_GradTap, "__call__", _scaling_leaving("layers.1"))
    with pytest.raises(
        CaptureError, match=r"recording changed what the model computes in \d+ tensor\(s\), e\.g\. grad"
    ):
        capture_run(_Counting(), (_PRE_NORM_INPUT,), tmp_path / "defect.h5", self_check=True)
    assert not (tmp_path / "defect.h5").exists()


class _Gained(PreNormNet):
    """A gain before the stack (a ReZero alpha, a learnt temperature): its gradient, one element, sums the whole
    batch."""

    def __init__(self, seed: int) -> None:
        super().__init__(seed=seed)
        self.gain = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(self.gain * x)


@pytest.mark.parametrize("seed", [11, 30])
def test_a_value_of_a_few_elements_passes_within_plausible_rounding(tmp_path: Path, seed: int) -> None:
    """A gain's gradient: the bare run's own error on it, one element, was 0.03 and 0.15 of the hooked run's in these
    seeds, and the honest captures failed. A value of a few elements now passes where the recorded run's error is
    plausible as float32 rounding."""
    x = torch.randn(4, 7, 16, generator=torch.Generator().manual_seed(seed))
    summary = capture_run(_Gained(seed), (x,), tmp_path / "b.h5", self_check=True, seed=seed)
    assert summary.regrouped > 0


class _Forces(nn.Module):
    """Forces as the gradient of an energy with respect to the positions: an output computed with autograd, so the
    hooks' grouping of sums shows in it."""

    def __init__(self) -> None:
        super().__init__()
        self.body = PreNormNet()

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        (forces,) = torch.autograd.grad(self.body(positions).sum(), positions, create_graph=True)
        return -forces


def test_outputs_computed_with_autograd_are_judged_like_gradients(tmp_path: Path) -> None:
    """A forces model's output differs in its last bits with the hooks: it is judged by the float64 run like a gradient
    (whose inputs require grad as the recorded ones do), where it used to fail as 'recording changed'."""
    positions = _PRE_NORM_INPUT.clone().requires_grad_()
    summary = capture_run(_Forces(), (positions,), tmp_path / "b.h5", self_check=True)
    assert summary.regrouped > 0


def test_after_the_check_the_model_holds_the_recorded_gradients(tmp_path: Path) -> None:
    """The check's runs leave the model's gradients those of the recorded run, the bundle's, not the run without
    hooks' (which differ in their last bits)."""
    model = PreNormNet()
    capture_run(model, (_PRE_NORM_INPUT,), tmp_path / "b.h5", self_check=True)
    with BundleReader(tmp_path / "b.h5") as reader:
        for name, param in model.named_parameters():
            recorded = reader.read_tensor(reader.index.grads[name])
            assert param.grad is not None
            assert torch.equal(param.grad, recorded), name


class _EpsOfItsDtype(PreNormNet):
    """Normalisation whose epsilon is its dtype's (``nn.RMSNorm(eps=None)``): on small activations the float64 run
    computes other numbers than rounding would give."""

    def __init__(self) -> None:
        super().__init__()
        for layer in self.layers:
            layer.norm = nn.RMSNorm(16)


def test_a_float64_run_that_computes_otherwise_judges_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the float64 run is farther from the bare run than rounding goes, its distance would let a defect through:
    the values it was to judge fail as unjudged, saying so."""
    monkeypatch.setattr(_GradTap, "__call__", _scaling_leaving("layers.1"))
    with pytest.raises(
        CaptureError, match=r"could not be judged: the float64 run is \S+ from the bare run there, more"
    ):
        capture_run(_EpsOfItsDtype(), (1e-4 * _PRE_NORM_INPUT,), tmp_path / "b.h5", self_check=True)
    assert list(tmp_path.iterdir()) == []


class _ReturnsItsLoss(nn.Module):
    """A model returning a 0-d loss (as a Hugging Face model given ``labels``), with a 0-d parameter."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 4)
        self.gain = nn.Parameter(torch.tensor(1.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(self.gain * x).pow(2).mean()


def test_zero_dimensional_outputs_and_parameters_are_compared(tmp_path: Path) -> None:
    """A 0-d output or parameter crashed the check with a raw RuntimeError (its bytes viewed without flattening)."""
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(0))
    capture_run(_ReturnsItsLoss(), (x,), tmp_path / "b.h5", self_check=True)
    assert (tmp_path / "b.h5").exists()


class _CountingOnAHelper(PreNormNet):
    def __init__(self) -> None:
        super().__init__()
        self.clock = Clock()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.clock.step += 1
        return super().forward(x * (1.0 + 0.1 * self.clock.step))


def test_a_run_that_does_not_repeat_from_the_rewound_state_judges_nothing(tmp_path: Path) -> None:
    """A step count on a helper object is not put back: the run without hooks computed the next step, and the check
    blamed recording ('recording changed'), or, for the float64 run, measured the step for rounding (and let a
    defective hook through). It now runs once more from the rewound state and, where the two differ, judges nothing,
    saying that the model keeps state the capture does not put back."""
    with pytest.raises(CaptureError) as caught:
        capture_run(_CountingOnAHelper(), (_PRE_NORM_INPUT,), tmp_path / "b.h5", self_check=True)
    message = str(caught.value)
    assert "could not be judged: the run without hooks does not repeat from the state the recorded run started" in (
        message
    )
    assert "recording changed what the model computes" not in message
    assert list(tmp_path.iterdir()) == []


def test_outputs_of_a_forward_without_autograd_inside_stay_bitwise(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Aliases are views: they change no value a forward computes, so an output is judged by rounding only where the
    forward ran autograd. Hooks that moved a hidden module's output by 2 units in the last place passed when every
    output was judged by rounding; they fail."""
    honest = ModuleTap._after

    def nudging(self: ModuleTap, module: nn.Module, args: Any, kwargs: Any, outputs: Any) -> Any:
        honest(self, module, args, kwargs, outputs)
        if module is model.layers[1] and isinstance(outputs, torch.Tensor):
            with torch.no_grad():
                outputs.mul_(1 + 2.4e-7)

    model = PreNormNet()
    monkeypatch.setattr(ModuleTap, "_after", nudging)
    with pytest.raises(CaptureError, match=r"recording changed what the model computes in \d+ tensor\(s\), e\.g\. out"):
        capture_run(model, (_PRE_NORM_INPUT,), tmp_path / "b.h5", self_check=True)


def test_a_value_of_a_few_elements_fails_beyond_rounding(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A value of fewer than 16 elements passed whenever the hooked run's error was 'plausible' by the rule's cancelling
    branch, true of any error larger than the value itself: a hook scaling the gradient into a gain by 10 passed. It
    must stay within 4 x float32's largest relative rounding of the value."""

    def scaling(self: _GradTap, grad: torch.Tensor | None) -> torch.Tensor | None:
        if grad is not None and self.info.module == "layers.0" and self.slot.startswith("grad_input"):
            return grad * 10
        return None

    monkeypatch.setattr(_GradTap, "__call__", scaling)
    with pytest.raises(CaptureError, match=r"grad gain: differs by up to \S+, more than 4 x"):
        capture_run(_Gained(0), (_PRE_NORM_INPUT,), tmp_path / "b.h5", self_check=True)


class _Potential(nn.Module):
    """A force field: one energy per molecule (4 values) and the forces, its gradient with respect to the positions."""

    def __init__(self) -> None:
        super().__init__()
        self.body = PreNormNet()
        self.readout = nn.Linear(5, 1)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        energy = self.readout(self.body(positions)).sum(dim=(1, 2))
        (gradient,) = torch.autograd.grad(energy.sum(), positions, create_graph=True)
        return energy, -gradient


def test_an_output_of_a_few_elements_gets_no_small_value_allowance(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A forward running autograd has its outputs judged like gradients, but the allowance for gradients of fewer than
    16 elements (whose own error is too small a sample) let a hook shift a 4-value energy by 2e-4 of it, thousands of
    times its rounding. Outputs get none."""
    honest = ModuleTap._after

    def shifting(self: ModuleTap, module: nn.Module, args: Any, kwargs: Any, outputs: Any) -> Any:
        honest(self, module, args, kwargs, outputs)
        if isinstance(module, nn.Linear) and outputs.shape[-1] == 1:
            with torch.no_grad():
                outputs.add_(2e-4 * float(outputs.abs().max()) / outputs.shape[1])

    positions = _PRE_NORM_INPUT.clone().requires_grad_()
    capture_run(_Potential(), (positions,), tmp_path / "honest.h5", self_check=True)
    monkeypatch.setattr(ModuleTap, "_after", shifting)
    with pytest.raises(CaptureError, match=r"output\.0: differs by up to \S+, more than 4 x"):
        capture_run(_Potential(), (positions,), tmp_path / "b.h5", self_check=True)


class _CentredNorm(nn.Module):
    """A LayerNorm written out: it uses its input several times, so the hooks' aliases regroup its gradient's sums."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        centred = x - x.mean(-1, keepdim=True)
        return self.weight * centred * torch.rsqrt(centred.pow(2).mean(-1, keepdim=True) + 1e-5)


class _CentredBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = _CentredNorm(width)
        self.up, self.down = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class _ShiftInvariant(nn.Module):
    """A learnt shift of the input of a stack of centring norms, which a shift does not change: the shift's gradient
    is 0 in exact arithmetic, float32 rounding noise in both runs."""

    def __init__(self, seed: int, width: int = 16) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.shift = nn.Parameter(torch.zeros(1))
        self.layers = nn.ModuleList(_CentredBlock(width) for _ in range(3))
        self.final, self.head = _CentredNorm(width), nn.Linear(width, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.shift
        for layer in self.layers:
            x = layer(x)
        return self.head(self.final(x))


@pytest.mark.parametrize("seed", [28, 43])
def test_a_gradient_about_zero_is_judged_against_the_models_gradients(tmp_path: Path, seed: int) -> None:
    """A gradient whose exact value is about zero holds rounding noise only, its scale that of the gradients around it,
    not its own: judged against its own, honest captures failed (8 seeds in 100: these two), as 'recording changed' or
    as a float64 run 1e-15 from a bare 0 'more than rounding goes'."""
    x = torch.randn(4, 7, 16, generator=torch.Generator().manual_seed(seed))
    capture_run(_ShiftInvariant(seed), (x,), tmp_path / "b.h5", self_check=True, seed=seed)


class _PeekingNoise(PreNormNet):
    """Noise from a copy of the model's own generator's state (the next step's numbers, without moving it), then from
    the generator itself."""

    def __init__(self) -> None:
        super().__init__()
        self.noise = torch.Generator().manual_seed(11)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        peek = torch.Generator()
        peek.set_state(self.noise.get_state())
        x = x + 0.01 * torch.randn(x.shape, generator=peek) + 0.01 * torch.randn(x.shape, generator=self.noise)
        return super().forward(x)


def test_draws_from_a_copy_of_the_models_generator_are_the_runs_own(tmp_path: Path) -> None:
    """After an earlier step moved the model's generator, a copy of its state is neither the generator put back nor in
    a fresh one's state: its draws were refused, and an honest capture failed the self-check as unjudged. The float32
    run drew from that state, so the float64 run may; the regrouped gradients are judged and pass."""
    model = _PeekingNoise()
    with torch.no_grad():
        model(_PRE_NORM_INPUT)  # the earlier step
    summary = capture_run(model, (_PRE_NORM_INPUT,), tmp_path / "b.h5", self_check=True, train_mode=True)
    assert summary.regrouped > 0, "no gradient differed from the bare run's: the float64 run judged nothing"


class _CompiledInside(nn.Module):
    """An MLP torch.compile compiles (inductor fuses the GELU: other bits than eager), then a tanh."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        inner = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
        self.inner = torch.compile(inner, backend="inductor")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x).tanh()


@pytest.mark.slow  # inductor compiles C++ kernels
def test_a_model_compiling_a_submodule_passes(tmp_path: Path) -> None:
    """The bare run ran under a dispatch mode that lists draws, under which torch.compile'd code runs eagerly: its
    outputs differed from the recorded run's in the last bits and the self-check blamed recording. The bare run is
    plain; only a run made to compare a float64 run's draws is watched."""
    torch._dynamo.reset()  # graphs other tests compiled for the same code would make it recompile, or fall back
    x = torch.randn(4, 16, 64, generator=torch.Generator().manual_seed(1))
    capture_run(_CompiledInside(), (x,), tmp_path / "b.h5", self_check=True, train_mode=True)
    assert (tmp_path / "b.h5").exists()
