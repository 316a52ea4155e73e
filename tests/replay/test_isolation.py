"""--isolate: local (teacher-forced) errors and verdicts tell where an error starts, not where it shows."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from torch import nn

from parity_harness.capture.models.adapters import load_adapter
from parity_harness.capture.record.recorder import capture_run
from parity_harness.common.format.bundle.selection import Selection
from parity_harness.common.numerics.tolerances import Tolerance, ToleranceTable
from parity_harness.replay.cli.replay_compare import main
from parity_harness.replay.compare.runner import compare_run
from parity_harness.replay.diagnose.isolation import ChainedRecords
from parity_harness.replay.naming.mapping import parse_map
from parity_harness.replay.reader import BundleReader
from parity_harness.replay.report.tables import render_result
from parity_harness.replay.result import ComparisonResult
from tests.conftest import PORT_DIR, PORT_MAP, REF_ADAPTER, replay_with_adapter
from tests.models import build_tiny, tiny_inputs

PORT_TOLERANCE = ToleranceTable(Tolerance(1e-4, 1e-4))
EXACT = ToleranceTable(Tolerance(0.0, 0.0))


def _replay_port(bundle: Path, ckpt: Path, adapter_name: str) -> ComparisonResult:
    return replay_with_adapter(bundle, ckpt, PORT_DIR / adapter_name, tolerances=PORT_TOLERANCE, isolate=True)


def _verdict(result: ComparisonResult, name: str) -> str | None:
    return next(r.verdict for r in result.records if r.name == name)


def test_correct_port_has_no_origin(ref_bundle: Path, ref_checkpoint: Path) -> None:
    """The correct port isolates every matched module and finds nothing wrong."""
    result = _replay_port(ref_bundle, ref_checkpoint, "adapter.py")
    assert result.match
    assert result.not_isolated == {}
    assert {r.verdict for r in result.records} == {"ok"}
    assert sum(r.local is not None for r in result.records) > 150


def test_bug_inside_attention_is_attributed_to_attention(ref_bundle: Path, ref_checkpoint: Path) -> None:
    """A wrong score scale inside attention: its child projection diverges first, attention is the origin."""
    result = _replay_port(ref_bundle, ref_checkpoint, "adapter_bug_attention.py")
    first = result.first_divergence("forward")
    assert first is not None
    assert first.module == "encoder.layers.1.self_attn.linear_out"
    assert _verdict(result, "encoder.layers.1.self_attn.linear_out/0/input.input") == "input differs"
    assert _verdict(result, "encoder.layers.1.self_attn.linear_out/0/output") == "inherited"
    assert _verdict(result, "encoder.layers.1.self_attn/0/output") == "origin"
    assert result.to_json()["first_origin"]["forward"] == "encoder.layers.1.self_attn"


def test_backward_only_bug_is_the_backward_origin(ref_bundle: Path, ref_checkpoint: Path) -> None:
    """A custom autograd function with a wrong backward is the backward origin; the forward is all ok."""
    result = _replay_port(ref_bundle, ref_checkpoint, "adapter_bug_backward.py")
    report = result.to_json()
    assert report["first_origin"] == {"forward": None, "backward": "encoder.layers.1.conv.activation"}
    assert {r.verdict for r in result.of_kind("forward")} == {"ok"}
    record = next(r for r in report["records"] if r["name"] == "encoder.layers.1.conv.activation/0/grad_input.x")
    assert record["verdict"] == "origin"
    assert record["local_match"] is False
    assert record["local_max_abs"] > 1e-2


def test_bug_in_parent_glue_shows_input_differs(ref_bundle: Path, ref_checkpoint: Path) -> None:
    """A wrong residual factor in the block's own code: its child sees other inputs, the block is the origin."""
    result = _replay_port(ref_bundle, ref_checkpoint, "adapter_bug_glue.py")
    assert _verdict(result, "encoder.layers.1.norm_out/0/input.input") == "input differs"
    assert _verdict(result, "encoder.layers.1.norm_out/0/output") == "inherited"
    origin = result.first_origin("forward")
    assert origin is not None
    assert origin.module == "encoder.layers.1"


class _ScaledGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx: object, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale  # type: ignore[attr-defined]
        return x.view_as(x)

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.scale, None  # type: ignore[attr-defined]


class _GlueBetween(nn.Module):
    """Two layers with the parent's own code between them: a gradient ``scale`` the backward applies there."""

    def __init__(self, scale: float) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.c1, self.c2, self.scale = nn.Linear(8, 8), nn.Linear(8, 8), scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c2(_ScaledGradient.apply(torch.tanh(self.c1(x)), self.scale))


class _WithGlue(nn.Module):
    def __init__(self, scale: float) -> None:
        super().__init__()
        self.p, self.head = _GlueBetween(scale), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.p(x))


def test_a_bug_in_a_parents_backward_glue_names_the_parent(tmp_path: Path) -> None:
    """A gradient scaled in p's own code between p.c1 and p.c2 (no record of p's differs): the table said "input
    differs" at p.c1's output gradient while the summary said the divergence was inherited and named no origin."""
    bundle = tmp_path / "glue.h5"
    capture_run(_WithGlue(1.0), {"x": torch.randn(2, 8, generator=torch.Generator().manual_seed(1))}, bundle)
    with BundleReader(bundle) as reader:
        result = compare_run(_WithGlue(1.01), reader, isolate=True)
    assert _verdict(result, "p.c1/0/grad_output") == "input differs"
    assert result.to_json()["origin_between_modules"] == {"backward": "p"}
    summary = render_result(result)
    assert "first origin (backward): p, between its modules  [p.c1/0/grad_output differs" in summary
    assert "is inherited" not in summary


def test_the_glues_module_is_named_though_its_own_records_are_waived(tmp_path: Path) -> None:
    """A map waiving every record of the module whose code holds the bug (an encoder whose records the port's
    cannot pair) made the summary blame "the root module": the caller is the nearest module the reference ran."""
    bundle = tmp_path / "glue.h5"
    capture_run(_WithGlue(1.0), {"x": torch.randn(2, 8, generator=torch.Generator().manual_seed(1))}, bundle)
    with BundleReader(bundle) as reader:
        result = compare_run(_WithGlue(1.01), reader, isolate=True, rename=parse_map("^p$ => -\nwaive p/*\n"))
    assert result.to_json()["origin_between_modules"] == {"backward": "p"}


def test_isolation_changes_no_chained_number_and_no_grad(tiny_bundle: Path) -> None:
    """Chained differences and the port's .grad are identical with and without --isolate."""
    runs = {}
    for isolate in (False, True):
        model = build_tiny()
        with torch.no_grad():
            model.blocks[1].norm.weight.mul_(1.001)
        with BundleReader(tiny_bundle) as reader:
            result = compare_run(model, reader, tolerances=EXACT, isolate=isolate)
        runs[isolate] = ({r.name: r.diff for r in result.records}, {n: p.grad for n, p in model.named_parameters()})
    assert runs[False][0] == runs[True][0]
    for name, grad in runs[False][1].items():
        assert torch.equal(grad, runs[True][1][name]), name


def test_module_called_twice_sums_local_parameter_gradients(tiny_bundle: Path) -> None:
    """blocks.0 runs twice: the sum of its isolated calls' weight gradients equals the reference's gradient."""
    with BundleReader(tiny_bundle) as reader:
        result = compare_run(build_tiny(), reader, tolerances=ToleranceTable(Tolerance(1e-6, 1e-6)), isolate=True)
    record = next(r for r in result.of_kind("param_grad") if r.name == "blocks.0.lin.weight")
    assert record.local is not None
    assert record.local.match
    assert record.verdict == "ok"


def test_changed_weight_is_origin_in_both_calls(tiny_bundle: Path) -> None:
    """A wrong weight in a module called twice makes both of its calls origins, and the earlier the first origin."""
    model = build_tiny()
    with torch.no_grad():
        model.blocks[0].lin.weight[0, 0] += 1e-2
    with BundleReader(tiny_bundle) as reader:
        result = compare_run(model, reader, tolerances=ToleranceTable(Tolerance(1e-6, 1e-6)), isolate=True)
    assert _verdict(result, "blocks.0.lin/0/output") == "origin"
    assert _verdict(result, "blocks.0.lin/1/output") == "origin"
    origin = result.first_origin("forward")
    assert origin is not None
    assert origin.name == "blocks.0.lin/0/output"


class _Opaque:
    """An argument capture cannot record."""

    def __init__(self, scale: float) -> None:
        self.scale = scale


class _Scaler(nn.Module):
    def forward(self, x: torch.Tensor, how: _Opaque) -> torch.Tensor:
        return x * how.scale


class _WithOpaqueArgument(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.scale = _Scaler()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale(self.lin(x), _Opaque(2.0))


def test_module_that_cannot_be_isolated_says_why_once(tmp_path: Path) -> None:
    """A module fed an unrecordable object is reported once, with the reason, and the rest is isolated."""
    torch.manual_seed(0)
    model = _WithOpaqueArgument()
    path = tmp_path / "opaque.h5"
    capture_run(model, (torch.randn(2, 4),), path)
    with BundleReader(path) as reader:
        result = compare_run(model, reader, tolerances=EXACT, isolate=True)
    assert list(result.not_isolated) == ["scale"]
    assert "_Opaque" in result.not_isolated["scale"]
    assert _verdict(result, "lin/0/output") == "ok"


class _Projection(nn.Module):
    """A weight of its own; ``unsqueezed`` returns its output with an extra leading dimension, as a port might."""

    def __init__(self, unsqueezed: bool) -> None:
        super().__init__()
        self.unsqueezed = unsqueezed
        self.weight = nn.Parameter(torch.randn(4, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x @ self.weight
        return y.unsqueeze(0) if self.unsqueezed else y


class _ProjectedBetween(nn.Module):
    def __init__(self, unsqueezed: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first, self.proj, self.last = nn.Linear(4, 4), _Projection(unsqueezed), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(self.proj(self.first(x)).reshape(-1, 4))


def test_a_module_output_of_another_shape_is_its_origin_not_a_crash(tmp_path: Path) -> None:
    """Isolated, a module whose output has another shape than the reference's is that difference's origin; its
    recorded grad_output cannot seed that output's backward, and the replay no longer ends in torch's "Mismatch in
    shape" (exit 2, no verdict)."""
    path = tmp_path / "projection.h5"
    capture_run(_ProjectedBetween(), (torch.randn(3, 4, generator=torch.Generator().manual_seed(1)),), path)
    with BundleReader(path) as reader:
        result = compare_run(_ProjectedBetween(unsqueezed=True), reader, tolerances=EXACT, isolate=True)
    assert result.verdict == "MISMATCH"
    assert _verdict(result, "proj/0/output") == "origin"
    assert _verdict(result, "last/0/output") == "ok"


def test_cli_isolate_prints_first_origin(ref_bundle: Path, ref_checkpoint: Path, tmp_path: Path) -> None:
    """replay-compare --isolate names the first origin in the summary and the JSON report."""
    report = tmp_path / "report.json"
    result = CliRunner().invoke(
        main,
        [
            "--bundle",
            str(ref_bundle),
            "--ckpt",
            str(ref_checkpoint),
            "--adapter",
            str(PORT_DIR / "adapter_bug_forward.py"),
            "--map",
            str(PORT_MAP),
            "--atol",
            "1e-4",
            "--rtol",
            "1e-4",
            "--isolate",
            "--json",
            str(report),
        ],
    )
    assert result.exit_code == 1, result.output
    assert "first origin (forward): encoder.layers.1.conv.batch_norm" in result.stdout
    assert "verdict" in result.stdout
    import json

    assert json.loads(report.read_text())["first_origin"]["forward"] == "encoder.layers.1.conv.batch_norm"


@pytest.mark.parametrize("inputs", [tiny_inputs()], ids=["tiny"])
def test_self_replay_with_isolation_is_exact(inputs: dict, tmp_path: Path) -> None:
    """Replaying the reference itself with --isolate gives every record an exact local match."""
    path = tmp_path / "self.h5"
    capture_run(build_tiny(), inputs, path)
    with BundleReader(path) as reader:
        result = compare_run(build_tiny(), reader, tolerances=EXACT, isolate=True)
    locals_ = [r.local for r in result.records if r.local is not None]
    assert locals_
    assert all(diff.match for diff in locals_)


@pytest.mark.parametrize("changed", [None, "encoder.layers.1.conv.pointwise_conv1.weight"], ids=["exact", "bug"])
def test_isolation_reuses_exact_chained_calls_without_changing_a_verdict(
    ref_bundle: Path, ref_checkpoint: Path, changed: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Calls the chained run already fed the reference's exact inputs and grad_outputs are not run again: every
    local difference and verdict is the one a rerun gives, and fewer module calls run."""
    model = load_adapter(str(REF_ADAPTER)).model(str(ref_checkpoint), "cpu")
    if changed is not None:
        with torch.no_grad():
            model.get_parameter(changed).mul_(1.01)
    reused, reused_calls = _calls_while_replaying(ref_bundle, model, isolate=True)
    monkeypatch.setattr(ChainedRecords, "reusable", lambda self, call, module: None)
    rerun, rerun_calls = _calls_while_replaying(ref_bundle, model, isolate=True)
    assert reused_calls < rerun_calls
    assert [(r.name, r.verdict, r.local) for r in reused.records] == [
        (r.name, r.verdict, r.local) for r in rerun.records
    ]
    assert reused.to_json()["first_origin"] == rerun.to_json()["first_origin"]
    if changed is not None:
        assert reused.to_json()["first_origin"]["forward"] == "encoder.layers.1.conv.pointwise_conv1"


class _Linear(nn.Linear):
    """A linear layer whose input goes through dropout in train mode."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(nn.functional.dropout(x, 0.5, self.training))


class _AlwaysTraining(_Linear):
    """Stays in train mode whatever the model is put in: its isolated reruns draw their own dropout masks."""

    def train(self, mode: bool = True) -> _AlwaysTraining:
        return super().train(True)


class _SharedWeights(nn.Module):
    """Owners of one weight three ways: ``first`` and ``second`` tie theirs, ``shared`` is called twice."""

    def __init__(self, second_training: bool = False) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.first, self.shared, self.last = (_Linear(6, 6) for _ in range(3))
        self.second = _AlwaysTraining(6, 6) if second_training else _Linear(6, 6)
        self.second.weight = self.first.weight
        with torch.no_grad():
            for param in self.parameters():
                param.uniform_(-0.8, 0.8)  # biases too: no zero to hide a difference behind

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.first(x))
        h = self.shared(torch.tanh(self.shared(h)))
        return self.last(torch.tanh(self.second(torch.tanh(h))))


def _shared_weights_bundle(folder: Path, second_training: bool = False) -> Path:
    inputs = {"x": torch.randn(3, 5, 6, generator=torch.Generator().manual_seed(4))}
    path = folder / "shared.h5"
    capture_run(_SharedWeights(second_training).eval(), inputs, path, seed=7)
    return path


def _calls_while_replaying(bundle: Path, model: nn.Module, isolate: bool) -> tuple[ComparisonResult, int]:
    calls = [0]

    def count(module: nn.Module, args: object) -> None:
        calls[0] += 1

    handle = nn.modules.module.register_module_forward_pre_hook(count)
    try:
        with BundleReader(bundle) as reader:
            return compare_run(model, reader, tolerances=PORT_TOLERANCE, isolate=isolate), calls[0]
    finally:
        handle.remove()


def test_isolating_an_exact_port_runs_no_module_again(tmp_path: Path) -> None:
    """Every record held the reference's bits, parameter gradients included (tied, and summed over two calls): the
    isolation reruns no module, and every local difference, parameter gradients' too, is exact."""
    bundle = _shared_weights_bundle(tmp_path)
    model = _SharedWeights().eval()
    chained, chained_calls = _calls_while_replaying(bundle, model, isolate=False)
    isolated, isolated_calls = _calls_while_replaying(bundle, model, isolate=True)
    assert isolated_calls == chained_calls
    grads = isolated.of_kind("param_grad")
    assert {r.name for r in grads} == {name for name, _ in model.named_parameters()}
    assert all(r.local is not None and r.local.bits_equal and r.verdict == "ok" for r in grads)
    assert {r.verdict for r in isolated.records} == {"ok"}
    assert [r.diff for r in isolated.records] == [r.diff for r in chained.records]


def _break(model: _SharedWeights, defect: str) -> None:
    with torch.no_grad():
        if defect == "last bias":  # the output differs, nothing upstream does
            model.last.bias[0] += 1e-2
        elif defect == "weight of a module called twice":
            model.shared.weight[1, 2] += 1e-2
        elif defect == "tied weight":
            model.first.weight[0, 0] += 1e-2
        elif defect == "gradient of one weight":  # a backward-only defect in no module record
            model.shared.weight.register_hook(lambda grad: grad * 1.001)


@pytest.mark.parametrize(
    "defect",
    ["last bias", "weight of a module called twice", "tied weight", "gradient of one weight", "tied owner training"],
)
def test_reused_calls_and_gradients_give_what_a_full_rerun_gives(
    tmp_path: Path, defect: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whatever differs, isolation taking calls and parameter gradients from the chained run gives every record
    the local difference and verdict that rerunning every call gives. A tied weight whose other owner stays in
    train mode is summed again, that owner's rerun drawing its own dropout mask, though its chained gradient held
    the reference's bits."""
    second_training = defect == "tied owner training"
    bundle = _shared_weights_bundle(tmp_path, second_training)
    model = _SharedWeights(second_training).eval()
    _break(model, defect)
    reused, reused_calls = _calls_while_replaying(bundle, model, isolate=True)
    monkeypatch.setattr(ChainedRecords, "reusable", lambda self, call, module: None)
    rerun, rerun_calls = _calls_while_replaying(bundle, model, isolate=True)
    assert reused_calls <= rerun_calls
    assert [(r.name, r.verdict, r.local) for r in reused.records] == [
        (r.name, r.verdict, r.local) for r in rerun.records
    ]
    if second_training:  # the chained run drew the capture's masks: only the isolated reruns differ
        tied = next(r for r in reused.records if r.name == "first.weight")
        assert reused.match
        assert tied.local is not None
        assert not tied.local.match
    else:
        assert not reused.match


def test_without_module_gradients_no_parameter_gets_a_local_gradient(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A capture without module gradient records gives isolation no grad_output to run a call's backward with:
    no parameter gradient gets a local difference, reused or not, as a full rerun gives none."""
    bundle = tmp_path / "no-grads.h5"
    inputs = {"x": torch.randn(3, 5, 6, generator=torch.Generator().manual_seed(4))}
    kinds = ("inputs", "outputs", "params", "param-grads")
    capture_run(_SharedWeights().eval(), inputs, bundle, seed=7, selection=Selection(kinds=kinds))
    reused, _ = _calls_while_replaying(bundle, _SharedWeights().eval(), isolate=True)
    monkeypatch.setattr(ChainedRecords, "reusable", lambda self, call, module: None)
    rerun, _ = _calls_while_replaying(bundle, _SharedWeights().eval(), isolate=True)
    assert reused.of_kind("param_grad")
    assert all(r.local is None for r in reused.of_kind("param_grad"))
    assert [(r.name, r.verdict, r.local) for r in reused.records] == [
        (r.name, r.verdict, r.local) for r in rerun.records
    ]


class _EmbedInner(nn.Module):
    """An embedding and a linear layer, seeded; subclasses say how the forward uses them."""

    seed = 5
    embedding: type[nn.Embedding] = nn.Embedding

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(self.seed)
        self.embed, self.inner = self.embedding(11, 8), nn.Linear(8, 8)


class _TiedHead(_EmbedInner):
    """A language model whose head is its embedding's weight, used through ``F.linear`` outside any module call."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(torch.tanh(self.inner(self.embed(ids))), self.embed.weight)


def test_weight_also_used_outside_its_module_is_no_origin_of_an_exact_port(tmp_path: Path) -> None:
    """The embedding's weight gets gradient from the embedding's call and from the tied head outside any module:
    on an exact port its local gradient is the chained one, exact, where summing the embedding call's share alone
    would fail against the reference's whole gradient and name the embedding an origin."""
    bundle = tmp_path / "tied-head.h5"
    ids = torch.randint(0, 11, (2, 5), generator=torch.Generator().manual_seed(1))
    capture_run(_TiedHead().eval(), {"ids": ids}, bundle, seed=1)
    result, _ = _calls_while_replaying(bundle, _TiedHead().eval(), isolate=True)
    embedding = next(r for r in result.records if r.name == "embed.weight")
    assert embedding.local is not None
    assert embedding.local.bits_equal
    assert {r.verdict for r in result.records} == {"ok"}
    assert result.to_json()["first_origin"] == {"forward": None, "backward": None}


class _ParentUsesChildWeight(_EmbedInner):
    """A parent whose forward multiplies by its child's weight itself, besides calling the child."""

    seed = 6

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        hidden = torch.tanh(self.inner(self.embed(ids)))
        return hidden @ self.inner.weight.t()


class _ParentReadsChildWeight(_EmbedInner):
    """A parent that only reads its child's weight where no gradient flows: its dtype, and a statistic under
    ``no_grad`` and through ``detach``."""

    seed = 7

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            scale = self.inner.weight.abs().mean()
        shift = self.inner.weight.detach().mean().to(self.inner.weight.dtype)
        return self.inner(self.embed(ids)) * scale + shift


def _near_port(model: nn.Module) -> nn.Module:
    """``model`` with ``inner``'s weight off by a relative 1e-7: every gradient near the reference's, few exact."""
    with torch.no_grad():
        noise = torch.randn(model.inner.weight.shape, generator=torch.Generator().manual_seed(3))
        model.inner.weight.mul_(1 + 1e-7 * noise)
    return model


@pytest.mark.parametrize(
    ("build", "outside"),
    [(_TiedHead, "embed.weight"), (_ParentUsesChildWeight, "inner.weight")],
    ids=["tied head via F.linear", "parent multiplies by a child's weight"],
)
def test_weight_also_used_outside_its_module_is_no_origin_of_a_near_port(
    tmp_path: Path, build: type[nn.Module], outside: str
) -> None:
    """A port within tolerance everywhere, whose weight gets gradient also from outside its module's calls: summing
    those calls alone would miss that share and name the module an origin. Its local gradient is not judged (the
    note says why), its chained comparison stands, and nothing is an origin."""
    bundle = tmp_path / "outside.h5"
    ids = torch.randint(0, 11, (2, 5), generator=torch.Generator().manual_seed(1))
    capture_run(build().eval(), {"ids": ids}, bundle, seed=1)
    result, _ = _calls_while_replaying(bundle, _near_port(build().eval()), isolate=True)
    weight = next(r for r in result.records if r.name == outside)
    assert weight.match
    assert weight.local is None
    assert {r.verdict for r in result.records} == {"ok"}
    assert "outside its module's calls" in result.not_isolated[outside]
    others = [r for r in result.of_kind("param_grad") if r.name != outside]
    assert others
    assert all(r.local is not None for r in others)


def test_weight_read_only_without_gradient_outside_its_module_is_still_isolated(tmp_path: Path) -> None:
    """A parent reading its child's weight where no gradient flows (its dtype, a statistic under no_grad or through
    detach) adds nothing to that weight's gradient: the weight's local gradient is judged as usual."""
    bundle = tmp_path / "reads.h5"
    ids = torch.randint(0, 11, (2, 5), generator=torch.Generator().manual_seed(1))
    capture_run(_ParentReadsChildWeight().eval(), {"ids": ids}, bundle, seed=1)
    result, _ = _calls_while_replaying(bundle, _near_port(_ParentReadsChildWeight().eval()), isolate=True)
    weight = next(r for r in result.records if r.name == "inner.weight")
    assert weight.local is not None
    assert "inner.weight" not in result.not_isolated


def test_a_wrong_tied_weight_is_found_where_it_is_used_by_its_module(tmp_path: Path) -> None:
    """A tied embedding whose weight differs: the embedding's forward output on the reference's ids is the origin;
    the weight's gradient fails chained and, used outside its module, is 'not isolated' rather than judged on a
    partial sum."""
    bundle = tmp_path / "tied-wrong.h5"
    ids = torch.randint(0, 11, (2, 5), generator=torch.Generator().manual_seed(1))
    capture_run(_TiedHead().eval(), {"ids": ids}, bundle, seed=1)
    port = _TiedHead().eval()
    with torch.no_grad():
        port.embed.weight.add_(1e-2)
    result, _ = _calls_while_replaying(bundle, port, isolate=True)
    assert _verdict(result, "embed/0/output") == "origin"
    assert _verdict(result, "embed.weight") == "not isolated"
    assert result.to_json()["first_origin"]["forward"] is not None


class _KeepsItsTranspose(nn.Embedding):
    """An embedding that keeps its weight's transpose, made during its call, for the head to use."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        self.head = self.weight.t()
        return super().forward(ids)


class _HeadThroughKeptView(_EmbedInner):
    """A tied head using the view its embedding made: the view is made inside the embedding's call, used outside."""

    seed = 8
    embedding = _KeepsItsTranspose

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.inner(self.embed(ids))) @ self.embed.head


class _LinearOnChildWeight(_EmbedInner):
    """A parent applying its child's weight through ``F.linear`` (under autocast, the child's cached cast of it)."""

    seed = 9

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(torch.tanh(self.inner(self.embed(ids))), self.inner.weight)


class _Plain(_EmbedInner):
    seed = 10

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.inner(self.embed(ids)))


def _isolated(bundle: Path, port: nn.Module, **options: object) -> ComparisonResult:
    with BundleReader(bundle) as reader:
        return compare_run(port, reader, isolate=True, **{"tolerances": PORT_TOLERANCE, **options})  # type: ignore[arg-type]


def test_a_view_made_inside_the_module_and_used_outside_is_an_outside_use(tmp_path: Path) -> None:
    """The embedding's call makes its weight's transpose and the parent's head uses it: that share of the gradient
    is outside the embedding's calls, so the near port's embedding weight is not judged on their sum."""
    bundle = tmp_path / "kept-view.h5"
    ids = torch.randint(0, 11, (2, 5), generator=torch.Generator().manual_seed(1))
    capture_run(_HeadThroughKeptView().eval(), {"ids": ids}, bundle, seed=1)
    result = _isolated(bundle, _near_port(_HeadThroughKeptView().eval()))
    assert "embed.weight" in result.not_isolated
    assert {r.verdict for r in result.records} == {"ok"}


def test_a_cast_autocast_made_inside_the_module_does_not_hide_an_outside_use(tmp_path: Path) -> None:
    """Under --autocast the child's call casts its weight once and the parent's F.linear reuses that cached cast,
    made inside the child's call: the parent's use is still outside, and no origin is named."""
    from parity_harness.replay.compare.precision import Precision

    bundle = tmp_path / "autocast.h5"
    ids = torch.randint(0, 11, (2, 5), generator=torch.Generator().manual_seed(1))
    capture_run(_LinearOnChildWeight().eval(), {"ids": ids}, bundle, seed=1)
    loose = ToleranceTable(Tolerance(5e-2, 5e-2))
    result = _isolated(bundle, _LinearOnChildWeight().eval(), tolerances=loose, precision=Precision(autocast="bf16"))
    assert "inner.weight" in result.not_isolated
    assert result.to_json()["first_origin"] == {"forward": None, "backward": None}
    assert "origin" not in {r.verdict for r in result.records}


def test_a_parameter_in_the_adapters_loss_is_an_outside_use(tmp_path: Path) -> None:
    """A loss with a weight penalty gives that weight gradient outside every module call: it is not judged on the
    sum of its module's calls."""
    bundle = tmp_path / "penalty.h5"
    ids = torch.randint(0, 11, (2, 5), generator=torch.Generator().manual_seed(1))
    reference, port = _Plain().eval(), _near_port(_Plain().eval())
    capture_run(
        reference, {"ids": ids}, bundle, seed=1, loss=lambda out: out.pow(2).sum() + reference.inner.weight.pow(2).sum()
    )
    result = _isolated(bundle, port, loss=lambda out: out.pow(2).sum() + port.inner.weight.pow(2).sum())
    assert "inner.weight" in result.not_isolated
    assert "origin" not in {r.verdict for r in result.records}


def test_a_weight_norm_hook_registered_before_works_inside_its_module(tmp_path: Path) -> None:
    """Old-style weight norm recomputes the weight in a forward pre-hook registered when the model was built: that
    work belongs to the module's call, whose isolated rerun runs the hook too, so every local gradient is judged."""
    import warnings

    def build() -> nn.Module:
        model = _Plain()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # torch.nn.utils.weight_norm is deprecated, still used
            model.inner = nn.utils.weight_norm(model.inner)
        return model.eval()

    bundle = tmp_path / "weight-norm.h5"
    ids = torch.randint(0, 11, (2, 5), generator=torch.Generator().manual_seed(1))
    capture_run(build(), {"ids": ids}, bundle, seed=1)
    port = build()
    with torch.no_grad():
        port.inner.weight_v.mul_(
            1 + 1e-7 * torch.randn(port.inner.weight_v.shape, generator=torch.Generator().manual_seed(3))
        )
    result = _isolated(bundle, port)
    assert result.not_isolated == {}
    grads = result.of_kind("param_grad")
    assert {r.name for r in grads} >= {"inner.weight_g", "inner.weight_v"}
    assert all(r.local is not None for r in grads)
