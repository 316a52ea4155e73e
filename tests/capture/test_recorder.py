"""What a capture records for various models, and that replaying the same model reproduces it exactly."""

from __future__ import annotations

import collections
import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from parity_harness.capture.record.recorder import capture_run
from parity_harness.common.errors import AdapterError
from parity_harness.common.format.bundle.schema import iter_tensors
from parity_harness.common.numerics.tolerances import Tolerance, ToleranceTable
from parity_harness.replay.compare.runner import compare_run
from parity_harness.replay.reader import BundleReader
from tests.models import build_embed, build_tiny, tiny_inputs

EXACT = ToleranceTable(Tolerance(0.0, 0.0))


def _self_replay(path: Path, model: nn.Module, **options: object):
    with BundleReader(path) as reader:
        return compare_run(model, reader, tolerances=EXACT, **options)  # type: ignore[arg-type]


def test_integer_inputs_keywords_and_dataclass_output(capture_model) -> None:
    """Int token inputs, a float keyword and a nested dataclass output are recorded and replay exactly."""
    tokens = torch.randint(0, 11, (2, 7), generator=torch.Generator().manual_seed(0))
    path = capture_model(build_embed(), {"tokens": tokens, "scale": 0.5})
    with BundleReader(path) as reader:
        index = reader.index
        assert index.inputs[0] == "D"
        assert ["scale", ["S", 0.5]] in index.inputs[1]
        assert index.outputs[:3] == ["O", "tests.models.Prediction", "dataclass"]
        slots = [slot for slot, _ in iter_tensors(index.outputs, "output")]
        assert slots == ["output.scores", "output.extras.0", "output.extras.1"]
        rebuilt = reader.rebuild(index.inputs)
        assert torch.equal(rebuilt["tokens"], tokens)
        assert rebuilt["tokens"].dtype == torch.int64
        assert rebuilt["scale"] == 0.5
    result = _self_replay(path, build_embed())
    assert result.match
    assert result.counts()["output"] == (3, 3)
    assert "embed/0/input.input" in {r.name for r in result.records}


@pytest.mark.parametrize(("dtype", "tag"), [(torch.bfloat16, "BF16"), (torch.float16, "F16")], ids=["bf16", "fp16"])
def test_reduced_precision_model_round_trips_bit_exactly(capture_model, dtype: torch.dtype, tag: str) -> None:
    """A bf16/fp16 model's tensors are stored under their tag and replay with zero tolerance."""
    inputs = {"x": tiny_inputs()["x"].to(dtype)}
    path = capture_model(build_tiny().to(dtype), inputs)
    with BundleReader(path) as reader:
        assert {ref.tag for ref in reader.index.grads.values()} == {tag}
        logits = dict(iter_tensors(reader.index.outputs, "output"))["output.logits"]
        assert reader.read_tensor(logits).dtype == dtype
    result = _self_replay(path, build_tiny().to(dtype))
    assert result.match
    assert all(r.diff.dtype == tag for r in result.of_kind("param_grad"))


def test_train_mode_dropout_replays_exactly(capture_model) -> None:
    """With --train-mode, dropout draws from the recorded seed on both sides, so replay still matches exactly."""

    def build() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 16), nn.Dropout(0.5), nn.Linear(16, 2))

    path = capture_model(build(), (torch.randn(3, 4),), train_mode=True, seed=5)
    with BundleReader(path) as reader:
        assert reader.index.run.train_mode is True
    assert _self_replay(path, build()).match


def test_loss_mode_records_and_requires_the_loss(capture_model) -> None:
    """An adapter loss is recorded and compared as record 'loss'; replay without a loss says what is missing."""

    def loss(outputs: dict[str, torch.Tensor]) -> torch.Tensor:
        return outputs["logits"].square().mean()

    path = capture_model(build_tiny(), tiny_inputs(), loss=loss)
    with BundleReader(path) as reader:
        assert reader.index.run.backward == "loss"
        assert reader.index.cotangent is None
    result = _self_replay(path, build_tiny(), loss=loss)
    assert result.match
    assert "loss" in {r.name for r in result.of_kind("output")}
    with pytest.raises(AdapterError, match="loss"):
        _self_replay(path, build_tiny())


def test_failed_forward_leaves_nothing_behind(tmp_path: Path) -> None:
    """A model that raises mid-capture leaves no bundle and no temporary file, and keeps an existing bundle."""

    class Broken(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.lin(x)
            raise RuntimeError("boom")

    out = tmp_path / "bundle.h5"
    with pytest.raises(RuntimeError, match="boom"):
        capture_run(Broken(), (torch.randn(2, 4),), out)
    assert list(tmp_path.iterdir()) == []
    out.write_bytes(b"an earlier bundle")
    with pytest.raises(RuntimeError, match="boom"):
        capture_run(Broken(), (torch.randn(2, 4),), out, overwrite=True)
    assert out.read_bytes() == b"an earlier bundle"
    assert list(tmp_path.iterdir()) == [out]


def test_changed_weight_is_flagged_as_different_weights(tiny_bundle: Path) -> None:
    """Replaying with one weight changed warns about parameter values and finds the module first."""
    model = build_tiny()
    with torch.no_grad():
        model.blocks[1].lin.weight[0, 0] += 1e-3
    result = _self_replay(tiny_bundle, model)
    assert not result.match
    assert [r.name for r in result.param_values if not r.match] == ["blocks.1.lin.weight"]
    first = result.first_divergence("forward")
    assert first is not None
    assert first.name == "blocks.1.lin/0/output"


def test_tied_parameters_are_recorded_and_compared_once(capture_model) -> None:
    """A weight shared by two modules is one parameter gradient, under the first name, compared once."""

    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(10, 4)
            self.unembed = nn.Linear(4, 10, bias=False)
            self.unembed.weight = self.embed.weight

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            return self.unembed(self.embed(tokens))

    torch.manual_seed(0)
    model = Tied()
    path = capture_model(model, (torch.tensor([[1, 2, 3]]),))
    with BundleReader(path) as reader:
        assert list(reader.index.grads) == ["embed.weight"]
    result = _self_replay(path, model)
    assert [r.name for r in result.of_kind("param_grad")] == ["embed.weight"]
    assert result.match


class _ComplexOut(nn.Module):
    """A linear layer whose output is read as complex numbers (an STFT front end's), scaled by ``factor``."""

    def __init__(self, factor: float = 1.0) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin, self.factor = nn.Linear(4, 4), factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.view_as_complex((self.lin(x) * self.factor).reshape(2, 2, 2))


def test_a_complex_output_gets_a_cotangent_and_its_backward_is_compared(tmp_path: Path) -> None:
    """A model with a complex output is backpropagated (it recorded no backward at all, so a port whose gradients
    were wrong matched): the gradients are recorded, the same model replays exactly, and gradients that differ
    fail."""
    path = tmp_path / "complex.h5"
    summary = capture_run(_ComplexOut(), (torch.randn(2, 4, generator=torch.Generator().manual_seed(1)),), path, seed=3)
    assert summary.backward == "cotangent"
    with BundleReader(path) as reader:
        assert set(reader.index.grads) == {"lin.weight", "lin.bias"}
        assert reader.index.cotangent is not None
    assert _self_replay(path, _ComplexOut()).match

    class WrongBackward(_ComplexOut):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out = super().forward(x)
            return out + (out * 0.5 - (out * 0.5).detach())  # the same values; gradients 1.5x

    result = _self_replay(path, WrongBackward())
    assert not result.match
    assert {r.kind for r in result.records if not r.match} == {"param_grad", "backward"}


class _Heads(nn.Module):
    def __init__(self, factor: float = 3.0) -> None:
        super().__init__()
        self.factor = factor

    def forward(self, h: torch.Tensor) -> dict[object, torch.Tensor]:
        return {1: h * 2, "1": h * self.factor}


class _KeyedHeads(nn.Module):
    def __init__(self, factor: float = 3.0) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin, self.heads = nn.Linear(4, 4), _Heads(factor)

    def forward(self, x: torch.Tensor) -> dict[object, torch.Tensor]:
        return self.heads(self.lin(x))


def test_keys_of_other_types_with_one_text_are_recorded_apart(tmp_path: Path) -> None:
    """``{1: a, "1": b}`` made capture fail ("recorded before"): the later key is named by its type too, in the
    capture, the index's slots and the port's alike, so the same model matches and a change in one head is found
    there."""
    path = tmp_path / "keys.h5"
    capture_run(_KeyedHeads(), (torch.randn(2, 4),), path, seed=0)
    with BundleReader(path) as reader:
        assert [slot for slot, _ in iter_tensors(reader.index.outputs, "output")] == ["output.1", "output.1~str"]
    assert _self_replay(path, _KeyedHeads()).match
    failing = {r.name for r in _self_replay(path, _KeyedHeads(factor=3.5)).records if not r.match}
    assert {"output.1~str", "heads/0/output.1~str"} <= failing
    assert not failing & {"output.1", "heads/0/output.1"}


class _Forces(nn.Module):
    """An energy and its forces -dE/dpos, by ``torch.autograd.grad`` inside forward (molecular models, gradient
    penalties) or written out by hand (``analytic``): the same numbers."""

    def __init__(self, analytic: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin1, self.act, self.lin2 = nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1)
        self.analytic = analytic

    def forward(self, pos: torch.Tensor) -> dict[str, torch.Tensor]:
        pos = pos if pos.requires_grad else pos.requires_grad_(True)
        hidden = self.act(self.lin1(pos))
        energy = self.lin2(hidden).sum()
        if self.analytic:
            forces = -((1 - hidden * hidden) * self.lin2.weight) @ self.lin1.weight
        else:
            forces = -torch.autograd.grad(energy, pos, create_graph=True)[0]
        return {"energy": energy, "forces": forces}


def test_a_gradient_taken_inside_forward_is_no_record_of_the_backward(tmp_path: Path) -> None:
    """autograd.grad inside forward ran the module records' one-shot gradient hooks with its own gradient
    (lin2's grad_output recorded as dE/dE = 1), and the run's backward went unrecorded: a port writing the forces
    out by hand failed on six backward records. Only the run's own backward is recorded now."""
    path = tmp_path / "forces.h5"
    capture_run(_Forces(), (torch.randn(5, 3, generator=torch.Generator().manual_seed(1)),), path, seed=42)
    with BundleReader(path) as reader:
        _, lin2 = reader.find_call("lin2", 0)
        grad_output = reader.read_tensor(lin2.grad_outputs["grad_output"])
        assert not torch.equal(grad_output, torch.ones_like(grad_output))
    assert _self_replay(path, _Forces()).match
    with BundleReader(path) as reader:
        assert compare_run(_Forces(analytic=True), reader).match


@dataclasses.dataclass(frozen=True)
class _PairData:
    a: torch.Tensor
    b: torch.Tensor


_PairTuple = collections.namedtuple("_PairTuple", "a b")


class _Mix(nn.Module):
    def forward(self, pair: Any) -> torch.Tensor:
        a, b = (pair["a"], pair["b"]) if isinstance(pair, dict) else (pair.a, pair.b)
        return a * 2.0 + b


class _Mixing(nn.Module):
    """A module given a tensor inside a container, that tensor also feeding a skip connection."""

    def __init__(self, container: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin, self.mix, self.container = nn.Linear(4, 4), _Mix(), container

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        pair: Any = {"a": h, "b": x}
        if self.container == "namedtuple":
            pair = _PairTuple(h, x)
        elif self.container == "dataclass":
            pair = _PairData(h, x)
        elif self.container == "ordereddict":
            pair = collections.OrderedDict(pair)
        return self.mix(pair) + h * 5.0


@pytest.mark.parametrize("container", ["namedtuple"])
def test_a_tensor_inside_a_container_gets_the_modules_own_input_gradient(tmp_path: Path, container: str) -> None:
    """A tensor passed in a named tuple got a plain hook, so its grad_input was summed over every consumer (the skip
    too): recorded 7 x grad_output rather than 2 x. It is the module's own now, and the same call with a plain dict
    (same slots, same numbers) matches. (A mutable object of the model's own keeps the plain hook: see below.)"""
    path = tmp_path / "mix.h5"
    capture_run(_Mixing(container), (torch.randn(2, 4, generator=torch.Generator().manual_seed(1)),), path, seed=4)
    with BundleReader(path) as reader:
        _, mix = reader.find_call("mix", 0)
        grad_input = reader.read_tensor(mix.grad_inputs["grad_input.pair.a"])
        grad_output = reader.read_tensor(mix.grad_outputs["grad_output"])
        assert torch.equal(grad_input, 2 * grad_output)
    assert _self_replay(path, _Mixing(container)).match
    assert _self_replay(path, _Mixing("dict")).match


@dataclasses.dataclass
class _State:
    h: torch.Tensor


class _Updates(nn.Module):
    """Writes its result into the state object it is given, returning nothing (a decoder state, a cache)."""

    def forward(self, state: Any) -> None:
        if isinstance(state, dict):
            state["h"] = state["h"] * 2.0 + 1.0
        else:
            state.h = state.h * 2.0 + 1.0


class _Stateful(nn.Module):
    def __init__(self, container: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin, self.update, self.container = nn.Linear(4, 4), _Updates(), container

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        state: Any = _State(h) if self.container == "dataclass" else collections.OrderedDict(h=h)
        if self.container == "dict":
            state = {"h": h}
        self.update(state)
        return state.h if self.container == "dataclass" else state["h"]


@pytest.mark.parametrize("container", ["dataclass", "ordereddict", "dict"])
def test_a_module_updating_the_object_it_was_given_computes_what_it_computes_bare(
    tmp_path: Path, container: str
) -> None:
    """A module writing into a dataclass, OrderedDict or dict it was given: the capture hands it that very object, so
    the caller sees the update (a copy holding aliases lost it: the self-check refused the capture, and without it
    the bundle held other numbers, as did a plain dict's before); its input gradient is still recorded."""
    path = tmp_path / "state.h5"
    capture_run(_Stateful(container), (torch.randn(2, 4),), path, seed=0, self_check=True)
    with BundleReader(path) as reader:
        _, call = reader.find_call("update", 0)
        assert list(call.grad_inputs) == ["grad_input.state.h"]
    assert _self_replay(path, _Stateful(container)).match


class _Appends(nn.Module):
    """Appends its result to the list it is given (collecting each layer's states) and returns the list."""

    def forward(self, found: list[torch.Tensor]) -> list[torch.Tensor]:
        found.append(found[-1] * 3.0)
        return found


class _Collecting(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin, self.add, self.keep = nn.Linear(4, 4), _Appends(), _Updates()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        states = self.add([h])
        state = {"h": h}
        self.keep(state)
        return states[-1] + states[0] * 0.5 + state["h"] + h


def test_lists_and_dicts_given_to_modules_keep_what_the_modules_write(tmp_path: Path) -> None:
    """A list a module appends to and returns, and a dict it writes into: the run computes what it computes bare,
    the module's own input gradient is recorded (the skip ``+ h`` not counted in it), and the same model matches."""
    path = tmp_path / "collect.h5"
    capture_run(_Collecting(), (torch.randn(2, 4),), path, seed=0, self_check=True)
    with BundleReader(path) as reader:
        _, keep = reader.find_call("keep", 0)
        grad_input = reader.read_tensor(keep.grad_inputs["grad_input.state.h"])
        grad_output = reader.read_tensor(reader.find_call("lin", 0)[1].grad_outputs["grad_output"])
        assert not torch.equal(grad_input, grad_output)  # the module's share, not the sum over h's consumers
    assert _self_replay(path, _Collecting()).match


class _Frozen(nn.Module):
    """A trainable layer whose forward turns autograd off inside: its output carries no gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    @torch.no_grad()
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).tanh()


class _WithFrozen(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.pre, self.frozen, self.head = nn.Linear(4, 4), _Frozen(), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.pre(x)
        mask = (h > 0).float()  # a floating output of no module, from inputs that require grad: nothing to say
        return self.head(h * mask + self.frozen(h))


def test_a_module_turning_autograd_off_inside_its_forward_is_named(tmp_path: Path) -> None:
    """``@torch.no_grad()`` on a submodule's forward: its hooks run with autograd on, so it went unnamed while the
    calls inside it were named, and its own missing gradients (grad_output, grad_input) went unexplained."""
    summary = capture_run(_WithFrozen(), (torch.randn(3, 4),), tmp_path / "b.h5")
    assert summary.backward == "cotangent"
    assert summary.without_autograd == ["frozen/0", "frozen.lin/0"]  # in call order: the module, then its calls


def test_modules_whose_outputs_need_no_gradient_are_not_named(tmp_path: Path) -> None:
    """Integer outputs, and floating ones of a call whose inputs and parameters need no gradient (a frozen
    embedding), carry none to miss."""
    torch.manual_seed(0)
    frozen = nn.Embedding(5, 4).requires_grad_(False)
    model = nn.Sequential(frozen, nn.Linear(4, 2))
    summary = capture_run(model, (torch.tensor([[1, 2, 3]]),), tmp_path / "b.h5")
    assert summary.backward == "cotangent"
    assert summary.without_autograd == []


class _Table(nn.Module):
    """A sinusoidal table built from its input's shape (a rotary embedding's cosines): no gradient to miss."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        position = torch.arange(x.shape[1], dtype=torch.float32)[:, None]
        return torch.sin(position / 10 ** (torch.arange(x.shape[2], dtype=torch.float32) / x.shape[2]))


class _Mask(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x.abs().sum(-1) > 0.5).float()


class _StopGradient(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.detach()


class _NoGradNormalize(nn.Module):
    @torch.no_grad()
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.normalize(x, dim=-1)


class _Tables(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin, self.table, self.mask, self.stop = nn.Linear(4, 4), _Table(), _Mask(), _StopGradient()
        self.normalize = _NoGradNormalize()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        return (h + self.table(h)) * self.mask(h)[..., None] + self.stop(h) + self.normalize(h)


def test_tables_and_masks_are_not_named_but_a_detaching_module_is(tmp_path: Path) -> None:
    """A module without parameters building a table or a mask from inputs that require grad cut no gradient: naming
    it put a note on every replay of, for one, every Llama-like model (its rotary embedding). One returning its input
    detached, or normalising it under ``torch.no_grad``, did cut it."""
    summary = capture_run(_Tables(), (torch.randn(2, 3, 4),), tmp_path / "b.h5")
    assert summary.without_autograd == ["stop/0", "normalize/0"]
