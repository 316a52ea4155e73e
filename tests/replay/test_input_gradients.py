"""The gradient of a model input that requires grad (saliency, forces, adversarial ports): recorded by capture and
compared by replay (format 1.6). Before, a port whose glue detached the input in one term matched: its forward,
every module record and every parameter gradient agreed, and only d(output)/d(input) differed."""

from __future__ import annotations

import json
from pathlib import Path

import h5py
import msgpack
import pytest
import torch
from click.testing import CliRunner
from torch import nn

from parity_harness.capture.record.recorder import capture_run
from parity_harness.replay.cli.replay_compare import main as replay_main
from parity_harness.replay.compare.runner import compare_run
from parity_harness.replay.reader import BundleReader
from parity_harness.replay.result import ComparisonResult


class _Saliency(nn.Module):
    """A linear layer plus a term of the input's own between the modules; ``glue`` says what the port does there."""

    def __init__(self, glue: str = "same") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin, self.glue = nn.Linear(4, 3), glue

    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        if self.glue == "detached-input":  # every use of x cut from the graph: x gets no gradient
            x = x.detach()
        term = x.detach() if self.glue == "detached-term" else x
        if self.glue == "unused-scale":
            return self.lin(x) + (term**2).sum(-1, keepdim=True) + 0 * scale.detach()
        return self.lin(x) + (term**2).sum(-1, keepdim=True) * scale


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(2, 4, generator=generator).requires_grad_(), torch.rand(1, generator=generator).requires_grad_()


def _replay(bundle: Path, glue: str) -> ComparisonResult:
    with BundleReader(bundle) as reader:
        return compare_run(_Saliency(glue), reader)


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("input-grads") / "ref.h5"
    inputs = _inputs()
    inputs[0].grad = torch.full((2, 4), 100.0)  # a gradient the caller left: not part of this run's
    capture_run(_Saliency(), inputs, path, seed=0)
    return path


def test_each_input_that_requires_grad_has_its_gradient_recorded(bundle: Path) -> None:
    """This run's gradient alone (the caller's stale .grad is not added), at /input_grads/<slot>."""
    x, scale = _inputs()
    model = _Saliency()
    output = model(x, scale)
    output.backward(torch.randn(output.shape, generator=torch.Generator().manual_seed(0)))
    with BundleReader(bundle) as reader:
        assert set(reader.index.input_grads) == {"input.0", "input.1"}
    with h5py.File(bundle, "r") as file:
        assert sorted(file["input_grads"]) == ["input.0", "input.1"]
    # the cotangent is the bundle's own seeded draw: compare with the gradient replay computes from it
    assert _replay(bundle, "same").verdict == "MATCH"


def test_an_identical_port_matches_with_every_input_gradient_compared(bundle: Path) -> None:
    result = _replay(bundle, "same")
    assert result.verdict == "MATCH"
    compared = result.of_kind("input_grad")
    assert [record.name for record in compared] == ["input.0", "input.1"]
    assert all(record.diff.max_abs == 0 for record in compared)
    assert result.coverage()["input_grad"].compared == 2


@pytest.mark.parametrize(
    ("glue", "failing", "problem"),
    [
        pytest.param("detached-term", {"input.0"}, None, id="a-term-detached"),
        pytest.param("detached-input", {"input.0"}, "no gradient in the port", id="no-gradient-in-the-port"),
        pytest.param("unused-scale", {"input.0", "input.1"}, "no gradient in the port", id="an-input-left-unused"),
    ],
)
def test_a_port_differing_only_in_its_inputs_gradient_fails(
    bundle: Path, glue: str, failing: set[str], problem: str | None
) -> None:
    """Forward values and every module record agree where the port's glue changes only how the input is used."""
    result = _replay(bundle, glue)
    assert result.verdict == "MISMATCH"
    differing = {record.name for record in result.of_kind("input_grad") if not record.match}
    assert differing == failing
    if problem is not None:
        assert any(problem in (record.diff.problem or "") for record in result.of_kind("input_grad"))
    if glue == "detached-term":
        assert all(record.match for record in result.records if record.kind != "input_grad")


def test_an_input_gradient_the_reference_did_not_have_fails(tmp_path: Path) -> None:
    """The reference leaves its scale unused (no gradient); a port using it gives it one."""
    capture_run(_Saliency("unused-scale"), _inputs(), tmp_path / "ref.h5", seed=0)
    with BundleReader(tmp_path / "ref.h5") as reader:
        assert set(reader.index.input_grads) == {"input.0"}
        result = compare_run(_Saliency("same"), reader)
    scale = next(record for record in result.of_kind("input_grad") if record.name == "input.1")
    assert not scale.match
    assert "no gradient in the reference" in (scale.diff.problem or "")


def test_the_report_and_its_json_list_the_input_gradients(bundle: Path, tmp_path: Path) -> None:
    """A table of their own; in the JSON under input_grads, beside records (whose kinds stay the contract's four)."""
    report = tmp_path / "r.json"
    result = CliRunner().invoke(
        replay_main,
        ["--bundle", str(bundle), "--model", f"{__name__}:_Saliency", "--json", str(report)],
    )
    assert result.exit_code == 0, result.output
    assert "== Input gradients (inputs that require grad): 2/2 match ==" in result.output
    document = json.loads(report.read_text())
    assert [record["name"] for record in document["input_grads"]] == ["input.0", "input.1"]
    assert {record["kind"] for record in document["records"]} <= {"output", "param_grad", "forward", "backward"}


def test_a_differing_input_gradient_is_named_where_the_modules_agree(bundle: Path, tmp_path: Path) -> None:
    output = (
        CliRunner().invoke(replay_main, ["--bundle", str(bundle), "--model", f"{__name__}:_detached_term_port"]).output
    )
    assert "yet the model's input gradients differ (input.0)" in output
    assert "RESULT: MISMATCH" in output


def _detached_term_port() -> nn.Module:
    return _Saliency("detached-term")


class _ProductsLinear(nn.Linear):
    """The same maths as nn.Linear, its sums rounded otherwise (elementwise products, then a sum)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return (input.unsqueeze(-2) * self.weight).sum(-1) + self.bias


class _Sensitive(nn.Module):
    def __init__(self, port: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = (_ProductsLinear if port else nn.Linear)(64, 64)
        self.o = nn.Linear(64, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.o(torch.tanh(self.a(x * 30)) * 30)


def test_an_input_gradient_off_by_float32_rounding_alone_passes_the_rounding_check(tmp_path: Path) -> None:
    """A correct port rounding otherwise fails the input's gradient at atol/rtol 1e-5; the float64 rerun measures
    the port's own rounding on it as on a parameter's gradient (MATCH, judged so)."""
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(2)).requires_grad_()
    capture_run(_Sensitive(), (x,), tmp_path / "ref.h5", seed=0)
    with BundleReader(tmp_path / "ref.h5") as reader:
        plain = compare_run(_Sensitive(port=True), reader, rounding=False)
        judged = compare_run(_Sensitive(port=True), reader)
    assert not next(iter(plain.of_kind("input_grad"))).match
    assert judged.verdict == "MATCH", judged.notes
    assert next(iter(judged.of_kind("input_grad"))).rule == "rounding"


class _TwoArguments(nn.Module):
    def __init__(self, scale: float = 1.0) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin, self.scale = nn.Linear(4, 4), scale

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return self.lin(a) * b * self.scale


@pytest.mark.parametrize(
    ("make", "unrecorded"),
    [
        pytest.param(lambda x: (x, x), ["input.0", "input.1"], id="one-tensor-twice"),
        pytest.param(lambda x: (x, x[0]), ["input.0", "input.1"], id="a-view-of-another"),
        pytest.param(lambda x: (x, 2 * x), ["input.0", "input.1"], id="one-made-from-another"),
        pytest.param(lambda x: (x, torch.ones(4).requires_grad_()), [], id="apart"),
    ],
)
def test_inputs_sharing_a_tensor_match_the_port_that_rebuilds_them_apart(
    tmp_path: Path, make: object, unrecorded: list[str]
) -> None:
    """A review: model(x, x) and model(x, x[0]) failed against the very model, capture's hook on x summing every use
    where replay's separate inputs each see their own (model(x, 2 * x) alike, through autograd). Such inputs are left
    out, and the replay says so; inputs apart are compared."""
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(1)).requires_grad_()
    capture_run(_TwoArguments(), make(x), tmp_path / "ref.h5", seed=0)  # type: ignore[operator]
    with BundleReader(tmp_path / "ref.h5") as reader:
        assert list(reader.index.input_grads_unrecorded) == unrecorded
        result = compare_run(_TwoArguments(), reader)
        bug = compare_run(_TwoArguments(scale=1.001), reader)
    assert result.verdict == "MATCH", [(r.name, r.diff.max_abs) for r in result.records if not r.match]
    assert len(result.of_kind("input_grad")) == 2 - len(unrecorded)
    assert any("input gradients not recorded" in note for note in result.notes) == bool(unrecorded)
    assert bug.verdict == "MISMATCH"


def test_a_reader_of_format_1_5_sees_the_input_gradients_as_uncompared_parameter_gradients(bundle: Path) -> None:
    """The previous reader refuses a dataset no index entry it knows names: the gradients are listed in grads too
    (under names no parameter has), so it reads the bundle and leaves them uncompared (INCOMPLETE), as it does the
    buffers of 1.5 bundles. This reader takes them out of grads."""
    with h5py.File(bundle, "r") as file:
        index = msgpack.unpackb(file["index"][()].tobytes(), raw=False)
    stored = {name: node[1] for name, node in index["grads"]}
    assert stored[".input_grad:input.0"] == "/input_grads/input.0"
    assert index["input_grads"] == {"with": ["input.0", "input.1"], "without": [], "unrecorded": []}
    with BundleReader(bundle) as reader:
        assert not any(name.startswith(".") for name in reader.index.grads)


def test_a_complex_input_that_requires_grad_keeps_requiring_it_in_replay(tmp_path: Path) -> None:
    """Replay rebuilt a complex input without requires_grad: no gradient in the port, against the very model."""

    class Spectral(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.mix = nn.Parameter(torch.randn(4, 4, dtype=torch.complex64))

        def forward(self, z: torch.Tensor) -> torch.Tensor:
            return torch.tanh(z @ self.mix)

    z = torch.randn(2, 4, dtype=torch.complex64, generator=torch.Generator().manual_seed(1)).requires_grad_()
    capture_run(Spectral(), (z,), tmp_path / "ref.h5", seed=0)
    with BundleReader(tmp_path / "ref.h5") as reader:
        result = compare_run(Spectral(), reader)
    assert result.verdict == "MATCH", [(r.name, r.diff.problem) for r in result.records if not r.match]
    assert [record.name for record in result.of_kind("input_grad")] == ["input.0"]


def test_the_noise_floor_covers_the_input_gradients(tmp_path: Path) -> None:
    """capture-run --noise-floor measured no floor for them: replayed with --noise-factor, a port differing by
    float32 rounding passed every record on its floor but failed its input's gradient at the bare tolerance."""
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(2)).requires_grad_()
    capture_run(_Sensitive(), (x,), tmp_path / "ref.h5", seed=0, noise_floor=True)
    with BundleReader(tmp_path / "ref.h5") as reader:
        assert reader.index.noise_floor.get("input.0", 0.0) > 0.0
        result = compare_run(_Sensitive(port=True), reader, noise_factor=4.0)
    assert result.verdict == "MATCH", [(r.name, r.diff.max_abs) for r in result.records if not r.match]


class _OddInputUse(nn.Module):
    """Uses of its input that a tensor other than the caller's would change (a review of handing the model aliases)."""

    def __init__(self, use: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin, self.use = nn.Linear(4, 4), use

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use == "is-leaf" and not x.is_leaf:
            return self.lin(x) * 2
        if self.use == "inner-step":  # an FGSM-style step: the input's own .grad read inside the forward
            self.lin(x).sum().backward()
            assert x.grad is not None
            x = x + 0.1 * x.grad.sign()
            return self.lin(x.detach())
        return self.lin(x)


@pytest.mark.parametrize("use", ["is-leaf", "inner-step"])
def test_capture_hands_the_model_the_callers_own_inputs(tmp_path: Path, use: str) -> None:
    """Handing the model an alias of each input that requires grad changed what it computed (x.is_leaf) or broke it
    (x.grad after an inner backward): the model gets the caller's tensors, and the very model replays as MATCH."""
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(1)).requires_grad_()
    capture_run(_OddInputUse(use), (x,), tmp_path / "ref.h5", seed=0)
    with BundleReader(tmp_path / "ref.h5") as reader:
        assert compare_run(_OddInputUse(use), reader).verdict == "MATCH"


def test_a_batch_of_its_own_type_reaches_the_model_as_it_is(tmp_path: Path) -> None:
    """Capture rebuilt every input container to hand the model aliases: a Mapping read by attribute arrived as a plain
    dict (AttributeError), a list the model fills stayed empty for the caller."""

    class Batch(dict):  # type: ignore[type-arg]
        def __getattr__(self, name: str) -> torch.Tensor:
            try:
                return self[name]
            except KeyError:
                raise AttributeError(name) from None

    class ReadsByAttribute(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, batch: Batch, seen: list[int]) -> torch.Tensor:
            seen.append(1)
            return self.lin(batch.x)

    seen: list[int] = []
    batch = Batch(x=torch.randn(2, 4).requires_grad_())
    capture_run(ReadsByAttribute(), (batch, seen), tmp_path / "ref.h5", seed=0)
    assert seen == [1]


class _TimeMajorConv(nn.Conv1d):
    """A Conv1d taking and giving (batch, time, channels): the port's layout of a (batch, channels, time) one."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return super().forward(input.transpose(1, 2)).transpose(1, 2)


class _Conv(nn.Module):
    def __init__(self, port: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv, self.port = (_TimeMajorConv if port else nn.Conv1d)(4, 4, 3, padding=1), port

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x.transpose(1, 2)) if self.port else self.conv(x)


def test_the_adapters_layout_change_is_not_applied_to_the_inputs_gradients(tmp_path: Path) -> None:
    """The port's inputs are the recorded ones, in the reference's layout: its to_reference (transposing every 3-D
    tensor here) turned a correct port's input gradient into another shape (MISMATCH)."""
    x = torch.randn(2, 4, 5, generator=torch.Generator().manual_seed(1)).requires_grad_()
    capture_run(_Conv(port=False), (x,), tmp_path / "ref.h5", seed=0)

    def to_reference(name: str, tensor: torch.Tensor) -> torch.Tensor:  # every 3-D value of the port is time-major
        value = "/" in name or name.startswith(("output", "input"))  # records by name, "input.0" among them
        return tensor.transpose(1, 2) if value and tensor.dim() == 3 else tensor

    with BundleReader(tmp_path / "ref.h5") as reader:
        result = compare_run(_Conv(port=True), reader, to_reference=to_reference)
    assert [record.match for record in result.of_kind("input_grad")] == [True]
    assert result.verdict == "MATCH", [(r.name, r.diff.problem) for r in result.records if not r.match]


class _Lookup(nn.Module):
    """A table handed in as an input, looked up sparsely: its gradient is a sparse tensor."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 2)

    def forward(self, table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return self.lin(nn.functional.embedding(ids, table, sparse=True))


def test_an_input_with_a_sparse_gradient_is_recorded_as_its_dense_values(tmp_path: Path) -> None:
    """Capture crashed copying the sparse gradient into its staging buffer."""
    table = torch.randn(10, 4, generator=torch.Generator().manual_seed(1)).requires_grad_()
    capture_run(_Lookup(), (table, torch.tensor([[1, 2], [3, 1]])), tmp_path / "ref.h5", seed=0)
    with BundleReader(tmp_path / "ref.h5") as reader:
        assert list(reader.index.input_grads) == ["input.0"]
        assert compare_run(_Lookup(), reader).verdict == "MATCH"
