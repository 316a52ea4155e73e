"""Coverage is part of the verdict: every recorded tensor is compared or explicitly waived, else no MATCH."""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner, Result
from torch import nn
from torch.nn import functional as F

from parity_harness.common.errors import InputError, MapFileError, ParityMismatch
from parity_harness.common.numerics.tolerances import Tolerance, ToleranceTable
from parity_harness.replay.assertions import assert_parity
from parity_harness.replay.cli.replay_compare import main
from parity_harness.replay.compare.runner import compare_run
from parity_harness.replay.naming.mapping import parse_map
from parity_harness.replay.reader import BundleReader
from parity_harness.replay.report.markdown import render_markdown
from parity_harness.replay.report.tables import render_result
from parity_harness.replay.result import RecordResult
from tests.cli_helpers import one_error_line
from tests.models import Block, GradientScaled, ProductsSummedOtherwise, build_tiny

HERE = Path(__file__).resolve()


class FunctionalBlock(Block):
    """The same block computing ReLU as a function: the port has no ``act`` module."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.relu(self.lin(self.norm(x)))


def build_functional() -> nn.Module:
    """TinyNet whose blocks have no activation module (same weights, same numbers)."""
    model = build_tiny()
    for block in model.blocks:
        block.__class__ = FunctionalBlock
        del block.act
    return model


def build_frozen() -> nn.Module:
    """TinyNet with the head's bias frozen: it gets no gradient."""
    model = build_tiny()
    model.head.bias.requires_grad_(False)
    return model


def replay(*args: object) -> Result:
    return CliRunner().invoke(main, [str(a) for a in args])


def test_a_port_without_a_module_is_incomplete_not_a_match(tiny_bundle: Path, tmp_path: Path) -> None:
    """Records of a module the port lacks are listed as not compared; exit 1 and RESULT: INCOMPLETE, never MATCH."""
    report = tmp_path / "r.json"
    result = replay("--bundle", tiny_bundle, "--model", f"{HERE}:build_functional", "--json", report)
    assert result.exit_code == 1, result.output
    assert "RESULT: INCOMPLETE" in result.stdout
    assert "RESULT: MATCH" not in result.stdout
    document = json.loads(report.read_text())
    assert (document["match"], document["complete"], document["verdict"]) == (False, False, "INCOMPLETE")
    forward = document["coverage"]["forward"]
    assert "blocks.0.act/0/output" in forward["missing"]
    assert forward["recorded"] == forward["compared"] + forward["waived"] + len(forward["missing"])
    assert all(record["match"] for record in document["records"])


def test_waiving_the_missing_module_makes_it_a_match(tiny_bundle: Path, tmp_path: Path) -> None:
    """--waive-module waives a module's own records: they count as waived and the verdict is MATCH."""
    report = tmp_path / "r.json"
    waivers = ["--waive-module", "blocks.0.act", "--waive-module", "blocks.1.act"]
    result = replay("--bundle", tiny_bundle, "--model", f"{HERE}:build_functional", *waivers, "--json", report)
    assert result.exit_code == 0, result.output
    document = json.loads(report.read_text())
    assert document["complete"]
    assert document["verdict"] == "MATCH"
    assert document["coverage"]["forward"]["waived"] > 0
    assert document["coverage"]["forward"]["missing"] == []


def test_waive_module_does_not_waive_its_children(tiny_bundle: Path) -> None:
    """--waive-module blocks.0 covers blocks.0's own records, not its act child's: those stay missing (exit 2 here,
    since blocks.0's own records were all compared and the waiver is stale)."""
    result = replay("--bundle", tiny_bundle, "--model", f"{HERE}:build_functional", "--waive-module", "blocks.0")
    assert "waiver 'blocks.0/*'" in one_error_line("replay-compare", result)
    with BundleReader(tiny_bundle) as reader:
        partial = compare_run(build_functional(), reader, waive=("blocks.1.act/*",))
    assert partial.verdict == "INCOMPLETE"
    assert {name.split("/")[0] for name in partial.bundle_only} == {"blocks.0.act"}


def test_a_map_file_carries_waivers(tiny_bundle: Path) -> None:
    """'waive GLOB' lines of a map file waive like --waive."""
    rename = parse_map("# the port computes ReLU as a function\nwaive blocks.*.act/*\n")
    with BundleReader(tiny_bundle) as reader:
        result = compare_run(build_functional(), reader, rename=rename)
    assert result.match
    assert all(why == "waived by blocks.*.act/*" for _, why in result.waived.values())


@pytest.mark.parametrize("line", ["waive", "waive   # nothing", "waive a => b"], ids=["empty", "comment", "arrow"])
def test_a_malformed_waive_line_is_a_map_error(line: str) -> None:
    """A waive line without a glob (or with a rename arrow) is refused with its line number."""
    with pytest.raises(MapFileError, match=r"<map>:1: expected 'waive GLOB'"):
        parse_map(line)


def test_a_waiver_that_matches_nothing_is_an_error(tiny_bundle: Path) -> None:
    """A stale or misspelt waiver (nothing left uncompared matches it) is exit 2, not silently ignored."""
    line = one_error_line(
        "replay-compare", replay("--bundle", tiny_bundle, "--model", f"{HERE}:build_tiny_port", "--waive", "blokcs*")
    )
    assert "'blokcs*'" in line
    assert "matches no record left uncompared" in line


def build_tiny_port() -> nn.Module:
    """The reference itself, as a port."""
    return build_tiny()


@pytest.mark.parametrize("option", ["--layers", "--skip-layers"])
def test_a_layer_filter_that_selects_nothing_is_an_error(tiny_bundle: Path, option: str) -> None:
    """A typo in --layers no longer compares zero module records and passes: exit 2 naming the pattern."""
    result = replay("--bundle", tiny_bundle, "--model", f"{HERE}:build_tiny_port", option, "blokcs.*")
    line = one_error_line("replay-compare", result)
    assert f"{option} 'blokcs.*' matches no module recorded" in line


def test_layer_filters_count_as_waived(tiny_bundle: Path) -> None:
    """Module records left out by --layers are waived (with the reason), so the run is complete."""
    from parity_harness.common.format.bundle.selection import Selection

    with BundleReader(tiny_bundle) as reader:
        result = compare_run(build_tiny(), reader, layers=Selection(layers=("blocks.1",)))
    assert result.match
    assert result.complete
    assert result.coverage()["forward"].waived
    assert all("left out by modules matching blocks.1" in why for _, why in result.waived.values())


def test_a_frozen_parameter_is_a_mismatch_of_its_own(tiny_bundle: Path, tmp_path: Path) -> None:
    """A parameter with a gradient in the reference and none in the port is a failing record saying so."""
    report = tmp_path / "r.json"
    result = replay("--bundle", tiny_bundle, "--model", f"{HERE}:build_frozen", "--json", report)
    assert result.exit_code == 1, result.output
    records = {r["name"]: r for r in json.loads(report.read_text())["records"]}
    assert records["head.bias"]["match"] is False
    assert "no gradient in the port" in result.stdout
    assert json.loads(report.read_text())["complete"]


def test_assert_parity_fails_an_incomplete_run(tiny_bundle: Path) -> None:
    """assert_parity (and so the parity fixture) raises on an incomplete run and lists what was not compared."""
    with pytest.raises(ParityMismatch, match=r"INCOMPLETE: 12 recorded tensor\(s\) were not compared: blocks\.0\.act"):
        assert_parity(build_functional(), tiny_bundle)
    assert_parity(build_functional(), tiny_bundle, waive=("blocks.*.act/*",))


def test_compare_run_raises_input_error_for_a_bad_filter(tiny_bundle: Path) -> None:
    """The library raises InputError (the CLI's exit 2) for a filter that selects nothing."""
    from parity_harness.common.format.bundle.selection import Selection

    with BundleReader(tiny_bundle) as reader, pytest.raises(InputError, match="matches no module"):
        compare_run(build_tiny(), reader, layers=Selection(skip_layers=("nope",)))


class Biased(nn.Module):
    """A module with its own parameter, named ``pos_bias_u`` (reference) or ``bias_u`` (port)."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.name = name
        self.register_parameter(name, nn.Parameter(torch.linspace(-1.0, 1.0, 4)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + getattr(self, self.name)


def build_biased(name: str) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(Biased(name), nn.Tanh())


def test_a_map_rule_renames_a_parameter(tmp_path: Path) -> None:
    """A rule matching a whole parameter name pairs a parameter whose own name differs (bias_u vs pos_bias_u)."""
    from parity_harness.capture.record.recorder import capture_run

    bundle = tmp_path / "b.h5"
    inputs = (torch.randn(2, 4, generator=torch.Generator().manual_seed(1)),)
    capture_run(build_biased("pos_bias_u"), inputs, bundle)
    with BundleReader(bundle) as reader:
        unmapped = compare_run(build_biased("bias_u"), reader)
        mapped = compare_run(build_biased("bias_u"), reader, rename=parse_map(r"^0\.bias_u$ => 0.pos_bias_u"))
    assert unmapped.verdict == "INCOMPLETE"
    assert "0.pos_bias_u" in unmapped.coverage()["param_grad"].missing
    assert mapped.match
    assert "0.pos_bias_u" in {r.name for r in mapped.of_kind("param_grad")}


def test_a_map_rule_that_matches_nothing_is_a_warning(tiny_bundle: Path) -> None:
    """A rule matching no module or parameter of the port is named in a warning (a typo, or a stale map)."""
    rename = parse_map("^blokcs\\.(\\d+)$ => blocks.\\1\n^head$ => head\n")
    with BundleReader(tiny_bundle) as reader:
        result = compare_run(build_tiny(), reader, rename=rename)
    warnings = [note for note in result.notes if note.startswith("WARNING: map rule")]
    assert warnings == [
        "WARNING: map rule '^blokcs\\.(\\d+)$ => blocks.\\1' matches no module or parameter of the port"
    ]


class Positions(nn.Module):
    """A position table (``rows`` rows, 16 used) feeding a linear layer; ``leak`` touches the spare row."""

    def __init__(self, rows: int, leak: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.pos = nn.Embedding(16, 8)
        self.out = nn.Linear(8, 2)
        if rows > 16:
            spare = torch.randn(rows - 16, 8, generator=torch.Generator().manual_seed(5))
            self.pos.weight = nn.Parameter(torch.cat([self.pos.weight.detach(), spare]))
        self.leak = leak

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.pos(ids)
        if self.leak:  # same values, but a gradient flows into the spare row
            spare = self.pos.weight[16].sum()
            h = h + (spare - spare.detach())
        return self.out(h)


@pytest.mark.parametrize("leak", [False, True], ids=["spare-row-untouched", "spare-row-gets-a-gradient"])
def test_a_padded_parameter_is_compared_on_the_overlap(tmp_path: Path, leak: bool) -> None:
    """A port table with a spare row (vocabulary padding) matches on the overlap; a gradient in the spare row fails."""
    from parity_harness.capture.record.recorder import capture_run

    bundle = tmp_path / "pos.h5"
    ids = (torch.arange(16).reshape(2, 8),)
    capture_run(Positions(16), ids, bundle)
    with BundleReader(bundle) as reader:
        result = compare_run(Positions(17, leak=leak), reader)
    grad = next(r for r in result.of_kind("param_grad") if r.name == "pos.weight")
    assert any("padded parameter pos.weight: 17 against the reference's 16 along dim 0" in n for n in result.notes)
    assert all(r.match for r in result.param_values)
    assert grad.match is not leak
    assert result.match is not leak
    if leak:
        assert "gradient beyond the reference's 16 along dim 0 is nonzero" in (grad.diff.problem or "")


class _Vocabulary(nn.Module):
    """Token embeddings (16 rows) into a head; ``wrong_row`` converts one row wrongly; ``frozen`` freezes them."""

    def __init__(self, wrong_row: int | None = None, frozen: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.head = nn.Embedding(16, 8), nn.Linear(8, 3)
        if wrong_row is not None:
            with torch.no_grad():
                self.embed.weight[wrong_row] += 0.5
        self.embed.weight.requires_grad_(not frozen)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(ids))


@pytest.mark.parametrize("frozen", [False, True], ids=["trained", "frozen"])
def test_a_weight_no_record_shows_still_decides_the_verdict(tmp_path: Path, frozen: bool) -> None:
    """A wrongly converted embedding row of a token not in the batch: every output, module record and gradient
    agrees (the row is never read, its gradient is zero on both sides), and the replay said MATCH with a warning.
    A recorded parameter value the port's differs from is now a MISMATCH (the CLI exits 1), named in the report
    and in the pytest assertion's message."""
    from parity_harness.capture.record.recorder import capture_run
    from parity_harness.replay.report.failure import failure_message

    bundle = tmp_path / "vocab.h5"
    ids = torch.tensor([[1, 2, 3], [4, 5, 6]])
    capture_run(_Vocabulary(frozen=frozen), (ids,), bundle)
    with BundleReader(bundle) as reader:
        assert compare_run(_Vocabulary(frozen=frozen), reader).verdict == "MATCH"
        result = compare_run(_Vocabulary(wrong_row=9, frozen=frozen), reader)
    assert all(record.match for record in result.records)  # nothing the run computed shows it
    assert (result.match, result.verdict) == (False, "MISMATCH")
    assert [r.name for r in result.differing_parameters] == ["embed.weight"]
    assert "1 parameter value(s) not the reference's" in failure_message(result, bundle)
    assert "MISMATCH: 1 of 3 parameters differ from the reference's weights (embed.weight)" in render_result(result)
    written = result.to_json()
    assert (written["verdict"], written["differing_parameters"]) == ("MISMATCH", ["embed.weight"])
    assert "MISMATCH: 1 of 3 parameters differ" in render_markdown(result, str(bundle))


class DetachedBranchBlock(Block):
    """The port detaches the residual branch: its modules get no gradient at all."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.act(self.lin(self.norm(x))).detach()


class DetachedInputBlock(Block):
    """The port detaches the branch's input: no gradient flows into ``x`` through the branch."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.act(self.lin(self.norm(x.detach())))


def build_detached_branch() -> nn.Module:
    model = build_tiny()
    model.blocks[1].__class__ = DetachedBranchBlock
    return model


def build_detached_input() -> nn.Module:
    model = build_tiny()
    model.blocks[1].__class__ = DetachedInputBlock
    return model


@pytest.mark.parametrize(
    ("factory", "absent"),
    [
        (
            "build_detached_branch",
            {f"blocks.1.{m}/0/grad_{s}" for m in ("norm", "lin", "act") for s in ("input.input", "output")},
        ),
        ("build_detached_input", {"blocks.1.norm/0/grad_input.input"}),
    ],
)
def test_a_gradient_the_port_never_computes_is_shown_as_absent(
    tiny_bundle: Path, tmp_path: Path, factory: str, absent: set[str]
) -> None:
    """Module gradients the port's backward never reaches are failing records saying "no gradient in the port",
    never a value borrowed from another tensor and never merely "not compared"."""
    report = tmp_path / "r.json"
    result = replay("--bundle", tiny_bundle, "--model", f"{HERE}:{factory}", "--isolate", "--json", report)
    assert result.exit_code == 1, result.output
    document = json.loads(report.read_text())
    assert document["verdict"] == "MISMATCH"
    assert document["coverage"]["backward"]["missing"] == []
    records = {record["name"]: record for record in document["records"]}
    for name in absent:
        assert not records[name]["match"], name
        assert "no gradient in the port" in records[name]["problem"], name
        assert records[name]["max_abs"] is None, name
    shown = {name for name, record in records.items() if "no gradient in the port" in (record["problem"] or "")}
    assert {name for name in shown if "/" in name} == absent


class _TwoHeads(nn.Module):
    """Two differentiable outputs; ``cut`` detaches one (or the whole loss) as a buggy port might."""

    def __init__(self, cut: str = "") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 4)
        self.cut = cut

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        y = self.lin(x)
        aux = y.pow(2).sum()
        if self.cut == "aux":
            aux = aux.detach()
        if self.cut == "all":
            y, aux = y.detach(), aux.detach()
        return {"y": y, "aux": aux}


@pytest.mark.parametrize("cut", ["aux", "all"])
def test_an_output_the_port_detached_fails_its_record_not_the_run(tmp_path: Path, cut: str) -> None:
    """The reference backpropagated through an output the port detached: that output's record fails naming why, the
    backward runs through the rest, and the run is a MISMATCH (exit 1), not a crash (exit 2)."""
    from parity_harness.capture.record.recorder import capture_run

    bundle = tmp_path / "heads.h5"
    capture_run(_TwoHeads(), {"x": torch.randn(2, 4, generator=torch.Generator().manual_seed(2))}, bundle, seed=0)
    with BundleReader(bundle) as reader:
        result = compare_run(_TwoHeads(cut), reader)
    failing = {record.name: record.diff.problem for record in result.records if not record.match}
    cut_outputs = ["output.aux"] if cut == "aux" else ["output.y", "output.aux"]
    for name in cut_outputs:
        assert "does not require grad" in (failing[name] or "")
    assert result.verdict == "MISMATCH"
    assert any("left out: the reference backpropagated through them" in note for note in result.notes)


def test_an_output_the_port_detached_is_a_mismatch_when_kept_as_statistics(tmp_path: Path) -> None:
    """The same against a bundle kept as statistics only: the detached output's record is a difference (not
    undecided, as records whose statistics cannot decide are), and so is the run."""
    from parity_harness.capture.record.recorder import capture_run
    from parity_harness.common.format.bundle.selection import Selection

    bundle = tmp_path / "heads.h5"
    inputs = {"x": torch.randn(2, 4, generator=torch.Generator().manual_seed(2))}
    capture_run(_TwoHeads(), inputs, bundle, seed=0, selection=Selection(summary_only=True))
    with BundleReader(bundle) as reader:
        result = compare_run(_TwoHeads("aux"), reader)
    aux = next(record for record in result.records if record.name == "output.aux")
    assert not aux.match
    assert not aux.undecided
    assert result.verdict == "MISMATCH"


class _Reshaped(nn.Module):
    """A linear layer's output and its sum; ``change`` returns one of them in another shape, as a port might."""

    def __init__(self, change: str = "") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 4)
        self.change = change

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = self.lin(x)
        total = y.sum()
        if self.change == "unsqueezed":
            return y.unsqueeze(0), total
        if self.change == "narrowed":
            return y[:, :3], total
        return y, total.reshape(1) if self.change == "scalar as (1,)" else total


@pytest.mark.parametrize(("change", "slot"), [("unsqueezed", "0"), ("narrowed", "0"), ("scalar as (1,)", "1")])
def test_an_output_of_another_shape_is_a_mismatch_not_a_crash(tmp_path: Path, change: str, slot: str) -> None:
    """The reference backpropagated a cotangent into an output the port returns in another shape: that output's record
    fails naming the reference's shape, the backward runs through the rest, and the run is a MISMATCH (exit 1), where
    torch's "Mismatch in shape" used to end it (exit 2, no verdict)."""
    from parity_harness.capture.record.recorder import capture_run

    bundle = tmp_path / "shapes.h5"
    capture_run(_Reshaped(), {"x": torch.randn(3, 4, generator=torch.Generator().manual_seed(2))}, bundle, seed=0)
    with BundleReader(bundle) as reader:
        result = compare_run(_Reshaped(change), reader)
    failing = {record.name: record.diff.problem or "" for record in result.records if not record.match}
    assert "cotangent has shape" in failing[f"output.{slot}"]
    assert "left out of the port's backward" in failing[f"output.{slot}"]
    assert result.verdict == "MISMATCH"
    assert {record.name for record in result.records if record.kind == "param_grad"} == {"lin.weight", "lin.bias"}


def _cross_entropy(outputs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(outputs[0], torch.tensor([0, 1, 2]))


def test_an_adapter_loss_failing_on_outputs_of_another_shape_is_a_mismatch(tmp_path: Path) -> None:
    """A bundle backpropagated from the adapter's loss: on a port output of another shape that loss raises (here
    cross-entropy on an extra dimension); the output fails its record, the loss is left out of the backward, and the
    run is a MISMATCH, not the loss's error (exit 2). A loss that fails on outputs of the recorded shapes still does."""
    from parity_harness.capture.record.recorder import capture_run

    bundle = tmp_path / "loss.h5"
    inputs = {"x": torch.randn(3, 4, generator=torch.Generator().manual_seed(2))}
    capture_run(_Reshaped(), inputs, bundle, seed=0, loss=_cross_entropy)
    with BundleReader(bundle) as reader:
        result = compare_run(_Reshaped("unsqueezed"), reader, loss=_cross_entropy)
        assert result.verdict == "MISMATCH"
        assert any("loss (the adapter's loss raised" in note for note in result.notes)
        with pytest.raises(RuntimeError, match="the port's own loss"):
            compare_run(_Reshaped(), reader, loss=_failing_loss)


def _failing_loss(outputs: object) -> torch.Tensor:
    raise RuntimeError("the port's own loss")


class _WithSpare(nn.Module):
    """A linear layer and, unless ``spare`` is False, a parameter the forward never uses (no gradient recorded)."""

    def __init__(self, spare: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 4)
        if spare:
            self.spare = nn.Parameter(torch.ones(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


def _capture_with_spare(tmp_path: Path) -> Path:
    from parity_harness.capture.record.recorder import capture_run

    bundle = tmp_path / "spare.h5"
    capture_run(_WithSpare(), {"x": torch.randn(2, 4, generator=torch.Generator().manual_seed(3))}, bundle, seed=0)
    return bundle


def test_a_recorded_parameter_the_port_lacks_leaves_the_replay_incomplete(tmp_path: Path) -> None:
    """A parameter of the reference's that the port does not have (unused, so no gradient record goes missing) is a
    recorded tensor left uncompared: INCOMPLETE and exit 1, named under its own kind, never a MATCH."""
    bundle = _capture_with_spare(tmp_path)
    with BundleReader(bundle) as reader:
        result = compare_run(_WithSpare(spare=False), reader)
    assert (result.verdict, result.match, result.complete) == ("INCOMPLETE", False, False)
    assert result.coverage()["param"].missing == ("spare",)
    assert result.counts()["param"] == (2, 2)  # lin.weight and lin.bias compared and equal
    text = render_result(result)
    assert "param: recorded but: 1 record(s) not compared: spare" in text
    report = tmp_path / "r.json"
    cli = replay("--bundle", bundle, "--model", f"{HERE}:_without_spare", "--json", report)
    assert cli.exit_code == 1, cli.output
    document = json.loads(report.read_text())
    assert document["coverage"]["param"]["missing"] == ["spare"]
    assert document["summary"]["param"] == {"compared": 2, "matched": 2}


def test_a_waived_parameter_the_port_lacks_matches(tmp_path: Path) -> None:
    """Waiving the absent parameter (the port needs none) gives MATCH, the waiver listed under the parameters."""
    bundle = _capture_with_spare(tmp_path)
    with BundleReader(bundle) as reader:
        result = compare_run(_WithSpare(spare=False), reader, waive=("spare",))
    assert result.verdict == "MATCH"
    assert [name for name, _ in result.coverage()["param"].waived] == ["spare"]
    cli = replay("--bundle", bundle, "--model", f"{HERE}:_without_spare", "--waive", "spare")
    assert cli.exit_code == 0, cli.output


def _without_spare() -> nn.Module:
    return _WithSpare(spare=False)


class _RootParameter(nn.Module):
    """A parameter held by the root module itself (a ViT's position embedding), trainable or frozen."""

    def __init__(self, trainable: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 4)
        self.pos_embed = nn.Parameter(torch.randn(4), requires_grad=trainable)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x + self.pos_embed)


@pytest.mark.parametrize("trainable", [True, False], ids=["trainable", "frozen"])
def test_a_wrapped_ports_root_parameter_is_compared(tmp_path: Path, trainable: bool) -> None:
    """A wrapped port's root parameter (``module.pos_embed`` under DataParallel) was mapped to no bundle name: its
    gradient went missing and, frozen, its value (INCOMPLETE for a correct port). Both are paired now."""
    from parity_harness.capture.record.recorder import capture_run

    bundle = tmp_path / "root.h5"
    capture_run(_RootParameter(trainable), {"x": torch.randn(2, 4, generator=torch.Generator().manual_seed(1))}, bundle)
    with BundleReader(bundle) as reader:
        result = compare_run(nn.DataParallel(_RootParameter(trainable)), reader)
    assert result.verdict == "MATCH", result.bundle_only
    assert "pos_embed" in {r.name for r in result.param_values}
    assert ("pos_embed" in {r.name for r in result.of_kind("param_grad")}) is trainable


class _Encoder(nn.Module):
    """Two layers; ``bug`` scales its negative outputs, which a ReLU after it zeroes."""

    def __init__(self, bug: float) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.l1, self.l2, self.bug = nn.Linear(8, 8), nn.Linear(8, 4), bug

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.l2(torch.tanh(self.l1(x)))
        return torch.where(h < 0, h * self.bug, h)


class _ChildNamedModule(nn.Module):
    """A model whose only child is a real submodule named ``module`` (as DDP names the model it wraps)."""

    def __init__(self, bug: float = 1.0) -> None:
        super().__init__()
        self.module = _Encoder(bug)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.module(x))


def test_a_real_child_named_module_is_compared_not_waived_as_a_ddp_wrapper(tmp_path: Path) -> None:
    """A root whose only child is named ``module`` was taken for DDP on both sides and that child's records waived:
    a bug in it that the root's ReLU hides from the output was a MATCH. Alike on both sides, the names pair as they
    are; a DataParallel port of an unwrapped capture still pairs through the wrapper."""
    from parity_harness.capture.record.recorder import capture_run

    bundle = tmp_path / "child.h5"
    x = {"x": torch.randn(2, 8, generator=torch.Generator().manual_seed(1))}
    capture_run(_ChildNamedModule(), x, bundle)
    with BundleReader(bundle) as reader:
        wrong = compare_run(_ChildNamedModule(bug=3.0), reader)
        assert wrong.verdict == "MISMATCH"
        first = wrong.first_divergence("forward")
        assert first is not None
        assert first.name.startswith("module/0/output")
        assert compare_run(_ChildNamedModule(), reader).verdict == "MATCH"
    capture_run(_Encoder(1.0), x, tmp_path / "plain.h5")
    with BundleReader(tmp_path / "plain.h5") as reader:
        assert compare_run(nn.DataParallel(_Encoder(1.0)), reader).verdict == "MATCH"
    # Wrapped on one side only: the port's DataParallel is told by its class, the capture's by the names that meet.
    with BundleReader(bundle) as reader:
        assert compare_run(nn.DataParallel(_ChildNamedModule(bug=3.0)), reader).verdict == "MISMATCH"
        assert compare_run(nn.DataParallel(_ChildNamedModule()), reader).verdict == "MATCH"
    capture_run(nn.DataParallel(_ChildNamedModule()), x, tmp_path / "wrapped.h5")
    harmless = parse_map("^nothing$ => other\n")

    class OwnDataParallel(nn.DataParallel):  # type: ignore[type-arg]
        pass

    with BundleReader(tmp_path / "wrapped.h5") as reader:
        assert compare_run(_ChildNamedModule(bug=3.0), reader).verdict == "MISMATCH"
        for port in (_ChildNamedModule(), nn.DataParallel(_ChildNamedModule()), OwnDataParallel(_ChildNamedModule())):
            assert compare_run(port, reader).verdict == "MATCH", type(port)
            assert compare_run(port, reader, rename=harmless).verdict == "MATCH", type(port)


@pytest.mark.parametrize(
    "selection",
    [{"layers": ("module.l1",)}, {"layers": ("module.l*",)}, {"summary_only": True}, {"max_tensor_bytes": 8}],
    ids=["one-layer", "layers", "summary-only", "max-tensor-bytes"],
)
def test_a_wrapped_capture_recording_less_pairs_with_the_plain_port(tmp_path: Path, selection: dict[str, Any]) -> None:
    """A DataParallel capture recording less (no call of the wrapped model itself, or statistics instead of bytes)
    is still known for one by its recorded class (a check by the records' checksums made them INCOMPLETE against the
    plain port)."""
    from parity_harness.capture.record.recorder import capture_run
    from parity_harness.common.format.bundle.selection import Selection

    bundle = tmp_path / "some.h5"
    x = {"x": torch.randn(2, 8, generator=torch.Generator().manual_seed(1))}
    capture_run(nn.DataParallel(_Encoder(1.0)), x, bundle, selection=Selection(**selection))
    with BundleReader(bundle) as reader:
        assert compare_run(_Encoder(1.0), reader).verdict == "MATCH"
        assert compare_run(_Encoder(3.0), reader).verdict == "MISMATCH"


def _rescaled(module: nn.Linear, how: str) -> None:
    """``module.weight`` made 1.5 times larger: in place, with its storage swapped, or as a new Parameter."""
    with torch.no_grad():
        if how == "in-place":
            module.weight.mul_(1.5)
        elif how == "set_":
            module.weight.set_(module.weight.detach() * 1.5)
        elif how == "data":
            module.weight.data = module.weight.detach() * 1.5
        elif how == "new-parameter":
            module.weight = nn.Parameter(module.weight.detach() * 1.5)
        elif how == "scaled-and-cast":
            module.weight.data = (module.weight.detach() * 1.5).double()
        elif how == "new-parameter-on-meta":
            module.weight = nn.Parameter(torch.empty_like(module.weight, device="meta"))


class _RescalesItsWeight(nn.Module):
    """Two layers; ``rescale`` names how its forward makes the first weight 1.5 times larger after using it."""

    def __init__(self, rescale: str | None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.rescale = nn.Linear(8, 8), nn.Linear(8, 4), rescale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.b(torch.tanh(self.a(x)))
        if self.rescale:
            _rescaled(self.a, self.rescale)
        return out


@pytest.mark.parametrize(
    "how", ["in-place", "set_", "data", "new-parameter", "scaled-and-cast", "new-parameter-on-meta"]
)
def test_a_port_changing_its_weights_during_its_run_is_a_mismatch_saying_so(tmp_path: Path, how: str) -> None:
    """A port rescaling a weight in its forward, after using it: outputs and gradients of that step equal, the
    parameter values compared before the run equal, so MATCH, while a capture of such a model is refused. The
    port's parameters are looked up again after the run; one whose version moved, or whose values now lie
    elsewhere (its storage swapped by ``set_`` or ``.data =``, a new Parameter put in its place: a review found
    those MATCH), is compared again and fails, saying the run changed it."""
    from parity_harness.capture.record.recorder import capture_run

    bundle = tmp_path / "steady.h5"
    capture_run(_RescalesItsWeight(None), {"x": torch.randn(2, 8, generator=torch.Generator().manual_seed(1))}, bundle)
    with BundleReader(bundle) as reader:
        result = compare_run(_RescalesItsWeight(how), reader)
        assert compare_run(_RescalesItsWeight(None), reader).verdict == "MATCH"
    assert result.verdict == "MISMATCH"
    assert [r.name for r in result.param_values if not r.match] == ["a.weight"]
    assert "the port's run changed 1 parameter(s) in place (a.weight)" in render_result(result)
    with pytest.raises(ParityMismatch, match=r"1 changed in place by the port's run"):
        assert_parity(_RescalesItsWeight(how), bundle)


class _CastsItself(nn.Module):
    """A layer whose forward casts the whole model to ``dtype`` first (precision chosen by hand)."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin, self.dtype = nn.Linear(8, 4), dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.to(self.dtype)
        return self.lin(x.to(self.dtype)).float()


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_a_model_casting_itself_in_its_forward_replays_against_its_own_capture(
    tmp_path: Path, dtype: torch.dtype
) -> None:
    """The model captured, replayed as its own port: its parameters' values now lie elsewhere, in another dtype,
    and compared again after the run they failed as changed by the run (a review's regression). A cast is what
    the reference's run did alike: left as compared before the run, with a note."""
    from parity_harness.capture.record.recorder import capture_run

    bundle = tmp_path / "cast.h5"
    capture_run(_CastsItself(dtype), {"x": torch.randn(2, 8, generator=torch.Generator().manual_seed(1))}, bundle)
    with BundleReader(bundle) as reader:
        result = compare_run(_CastsItself(dtype), reader)
    assert result.verdict == "MATCH", [r.name for r in result.records if not r.match]
    assert any("the port's run cast 2 parameter(s) to another dtype or device" in note for note in result.notes)


class _PositionsAsParameter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin, self.pos = nn.Linear(4, 4), nn.Parameter(torch.randn(4), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x + self.pos)


class _PositionsAsBuffer(nn.Module):
    """The port holding the reference's frozen parameter ``pos`` as a buffer; ``how`` it changes it after use."""

    def __init__(self, how: str | None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin, self.how = nn.Linear(4, 4), how
        self.register_buffer("pos", torch.randn(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.lin(x + self.pos)
        if self.how == "in-place":
            self.pos.mul_(1.5)
        elif self.how == "reassigned":
            self.pos = self.pos * 1.5
        elif self.how == "another-dtype":
            self.pos = (self.pos * 1.5).double()
        elif self.how == "another-shape":
            self.pos = torch.cat([self.pos, self.pos])
        return out


@pytest.mark.parametrize("how", ["in-place", "reassigned", "another-dtype", "another-shape"])
def test_a_buffer_standing_for_a_parameter_is_looked_up_again_after_the_run(tmp_path: Path, how: str) -> None:
    """A port's buffer compared as a recorded parameter, replaced by a new tensor in its forward after use, was
    compared again as the one held before the run: MATCH (a review). It is looked up again."""
    from parity_harness.capture.record.recorder import capture_run

    bundle = tmp_path / "pos.h5"
    capture_run(_PositionsAsParameter(), {"x": torch.randn(2, 4, generator=torch.Generator().manual_seed(1))}, bundle)
    with BundleReader(bundle) as reader:
        assert compare_run(_PositionsAsBuffer(None), reader).verdict == "MATCH"
        result = compare_run(_PositionsAsBuffer(how), reader)
    assert result.verdict == "MISMATCH"
    assert [r.name for r in result.param_values if not r.match] == ["pos"]


class _ScaledWeightGradient(torch.autograd.Function):
    """A linear map whose backward gives the input's gradient right and the weight's ``scale`` times too large."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.scale = scale
        return x @ weight.t()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        x, weight = ctx.saved_tensors
        return grad @ weight, ctx.scale * grad.t() @ x, None


class _OwnBackward(nn.Module):
    def __init__(self, scale: float) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.weight, self.scale = nn.Parameter(torch.randn(4, 8)), scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _ScaledWeightGradient.apply(x, self.weight, self.scale)


class _WithOwnBackward(nn.Module):
    def __init__(self, scale: float) -> None:
        super().__init__()
        self.l, self.head = _OwnBackward(scale), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.l(x)))


def test_a_wrong_parameter_gradient_alone_names_the_module_that_computes_it(tmp_path: Path) -> None:
    """Only l.weight's gradient wrong (a custom backward), every module record agreeing: 'first divergence
    (backward): none' pointed nowhere. The line names the module owning the parameter."""
    from parity_harness.capture.record.recorder import capture_run

    bundle = tmp_path / "own.h5"
    x = torch.randn(2, 8, generator=torch.Generator().manual_seed(1), requires_grad=True)
    capture_run(_WithOwnBackward(1.0), {"x": x}, bundle)
    with BundleReader(bundle) as reader:
        result = compare_run(_WithOwnBackward(1.01), reader)
    assert result.verdict == "MISMATCH"
    assert [r.name for r in result.records if not r.match] == ["l.weight"]
    summary = render_result(result)
    assert (
        "none among the modules' records, yet parameter gradients differ: l (l.weight: its forward records agree: "
        "its backward computes them wrongly)" in summary
    )


class _ScaledInput(nn.Module):
    def __init__(self, scale: float) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.l, self.scale = nn.Linear(4, 3), scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l(x * self.scale)


def test_a_parameter_gradient_moved_by_the_forward_does_not_blame_the_backward(tmp_path: Path) -> None:
    """The root scales the input 2.5x, not 2x: l's input differs, so its weight's gradient does, while l's backward
    is right. The line said that module's backward computes them wrongly."""
    from parity_harness.capture.record.recorder import capture_run

    bundle = tmp_path / "scaled.h5"
    capture_run(_ScaledInput(2.0), {"x": torch.randn(2, 4, generator=torch.Generator().manual_seed(1))}, bundle)
    with BundleReader(bundle) as reader:
        summary = render_result(compare_run(_ScaledInput(2.5), reader))
    assert "parameter gradients differ: l (l.weight: its forward records differ already)" in summary
    assert "backward computes them wrongly" not in summary


class _Table(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 8))

    def forward(self) -> torch.Tensor:
        return self.weight


class _TiedInForward(nn.Module):
    """Ties its head to the table its module returns, inside its forward (the returned object must be the
    parameter itself: a capture handing back an alias made the assignment fail)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.table, self.head = _Table(), nn.Linear(8, 4, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.head.weight = self.table()
        return self.head(x)


def test_a_parameter_a_module_returns_reaches_its_caller_as_itself(tmp_path: Path) -> None:
    """Observing a call must hand its caller what the module returned: a parameter, tied by the caller, stays one."""
    from parity_harness.capture.record.recorder import capture_run

    bundle = tmp_path / "tied.h5"
    capture_run(_TiedInForward(), {"x": torch.randn(2, 8, generator=torch.Generator().manual_seed(1))}, bundle)
    with BundleReader(bundle) as reader:
        assert compare_run(_TiedInForward(), reader).verdict == "MATCH"


class _TransposedLinear(nn.Module):
    """A linear layer holding its weight transposed, touched in place in its forward (multiplied by ``factor``: 1
    changes no value, as nn.Embedding's max_norm renormalising no row)."""

    def __init__(self, linear: nn.Linear, factor: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(linear.weight.detach().t().contiguous())
        self.bias, self.factor = linear.bias, factor

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # nn.Linear's argument name: the records pair
        out = input @ self.weight + self.bias
        with torch.no_grad():
            self.weight.mul_(self.factor)
        return out


class _TransposedAndTouched(nn.Module):
    def __init__(self, factor: float) -> None:
        super().__init__()
        reference = _RescalesItsWeight(None)
        self.a, self.b = _TransposedLinear(reference.a, factor), reference.b

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


def test_a_parameter_touched_in_place_is_compared_again_as_the_port_presents_it(tmp_path: Path) -> None:
    """A weight the port holds transposed (to_reference transposes it back) touched in place without a change of
    value (as nn.Embedding's max_norm renormalises) was compared again untransformed: a false 'changed in place'."""
    from parity_harness.capture.record.recorder import capture_run

    bundle = tmp_path / "steady.h5"
    capture_run(_RescalesItsWeight(None), {"x": torch.randn(2, 8, generator=torch.Generator().manual_seed(1))}, bundle)

    def to_reference(record: str, value: torch.Tensor) -> torch.Tensor:
        return value.t() if record == "a.weight" else value

    with BundleReader(bundle) as reader:
        assert compare_run(_TransposedAndTouched(1.0), reader, to_reference=to_reference).verdict == "MATCH"
        changed = compare_run(_TransposedAndTouched(1.5), reader, to_reference=to_reference)
    assert changed.verdict == "MISMATCH"
    assert "the port's run changed 1 parameter(s) in place (a.weight)" in render_result(changed)


class _RenamedRoot(nn.Module):
    """:class:`_RootParameter` with other names: ``proj`` for ``lin``, ``pe`` for ``pos_embed``."""

    def __init__(self) -> None:
        super().__init__()
        reference = _RootParameter(trainable=True)
        self.proj, self.pe = reference.lin, reference.pos_embed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x + self.pe)


@pytest.mark.parametrize(
    "rules",
    [r"^proj$ => lin" + "\n" + r"^pe$ => pos_embed", r"^module\.proj$ => lin" + "\n" + r"^module\.pe$ => pos_embed"],
    ids=["written-for-the-unwrapped-port", "written-for-the-wrapper"],
)
def test_a_map_for_the_unwrapped_port_renames_the_wrapped_ports_modules(tmp_path: Path, rules: str) -> None:
    """A map is written for the model's own names; the same port under DataParallel names its modules
    ``module.proj``, which no rule fits: its module records and parameters went unpaired (INCOMPLETE for a correct
    port) while its root parameter was paired. Rules apply to the names without the port's wrappers too; a map
    written with the wrapper's prefix keeps working, and neither is reported as matching nothing."""
    from parity_harness.capture.record.recorder import capture_run

    bundle = tmp_path / "renamed.h5"
    capture_run(_RootParameter(True), {"x": torch.randn(2, 4, generator=torch.Generator().manual_seed(1))}, bundle)
    for port in (_RenamedRoot(), nn.DataParallel(_RenamedRoot())):
        with BundleReader(bundle) as reader:
            result = compare_run(port, reader, rename=parse_map(rules))
        if "module" in rules and not isinstance(port, nn.DataParallel):
            assert result.verdict == "INCOMPLETE"  # that map names a wrapper this port does not have
            continue
        assert result.verdict == "MATCH", result.bundle_only
        assert {r.name for r in result.of_kind("param_grad")} == {"lin.weight", "lin.bias", "pos_embed"}
        assert {r.name for r in result.of_kind("forward")} == {"lin/0/input.input", "lin/0/output"}
        assert not [note for note in result.notes if "matches no module or parameter" in note], result.notes


class _PositionTable(nn.Module):
    """A frozen position table: a parameter in the reference, a buffer in the port (``as_buffer``); ``row`` of the
    port's table is off by 1e-3 where given."""

    def __init__(self, as_buffer: bool = False, row: int | None = None, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 4)
        table = torch.randn(6, 4)
        if row is not None:
            table[row] += 1e-3
        if as_buffer:
            self.register_buffer("pos", table.to(dtype))
        else:
            self.pos = nn.Parameter(table, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x + self.pos[: x.shape[1]].to(x.dtype))


def test_a_recorded_parameter_the_port_holds_as_a_buffer_is_compared(tmp_path: Path) -> None:
    """A frozen parameter the port registers as a buffer of the same name, shape and dtype is compared with it (it
    was missing: INCOMPLETE for a correct port); a wrong row the batch never reads (the sixth) still fails; a buffer
    of another dtype is another tensor, left unpaired (INCOMPLETE), not a divergence."""
    from parity_harness.capture.record.recorder import capture_run

    bundle = tmp_path / "pos.h5"
    capture_run(_PositionTable(), {"x": torch.randn(2, 5, 4, generator=torch.Generator().manual_seed(1))}, bundle)
    with BundleReader(bundle) as reader:
        result = compare_run(_PositionTable(as_buffer=True), reader)
        wrong = compare_run(_PositionTable(as_buffer=True, row=5), reader)
        wider = compare_run(_PositionTable(as_buffer=True, dtype=torch.float64), reader)
    assert (wider.verdict, wider.coverage()["param"].missing) == ("INCOMPLETE", ("pos",))
    assert result.verdict == "MATCH", result.bundle_only
    assert "pos" in {r.name for r in result.param_values}
    assert (wrong.verdict, [r.name for r in wrong.differing_parameters]) == ("MISMATCH", ["pos"])


class _LayerScale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gamma = nn.Parameter(torch.full((4,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gamma


class _ScaledBlock(nn.Module):
    """A block with a LayerScale module (``ls.gamma``), or (``folded``) the port's: the same scale held as the block's
    own ``gamma``, kept out of training where ``bug``."""

    def __init__(self, folded: bool = False, bug: bool = False) -> None:
        super().__init__()
        self.fc, self.folded, self.bug = nn.Linear(4, 4), folded, bug
        if folded:
            self.gamma = nn.Parameter(torch.full((4,), 0.5))
        else:
            self.ls = _LayerScale()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.folded:
            return x + self.ls(self.fc(x))
        return x + self.fc(x) * (self.gamma.detach() if self.bug else self.gamma)


def _scaled(folded: bool = False, bug: bool = False) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(_ScaledBlock(folded, bug), _ScaledBlock(folded, bug))


def test_waiving_a_folded_module_leaves_its_parameters_to_be_paired_or_named(tmp_path: Path) -> None:
    """A port that folds a module into its parent mostly keeps the module's parameter there, under another name (or
    tied, or as a buffer, or cast, padded, sharded): waiving the module waives its records, never its parameters',
    or a port whose scale never trains would pass. They stay missing; mapped, the bug is a MISMATCH; only a waiver
    naming them waives them."""
    from parity_harness.capture.record.recorder import capture_run

    bundle = tmp_path / "scaled.h5"
    capture_run(_scaled(), (torch.randn(2, 4, generator=torch.Generator().manual_seed(1)),), bundle, seed=0)
    modules = ("0.ls/*", "1.ls/*")
    with BundleReader(bundle) as reader:
        buggy = compare_run(_scaled(folded=True, bug=True), reader, waive=modules)
        assert buggy.verdict == "INCOMPLETE"
        assert sorted(buggy.bundle_only) == ["0.ls.gamma", "1.ls.gamma"]
        mapped = compare_run(
            _scaled(folded=True, bug=True), reader, waive=modules, rename=parse_map(r"^(\d+)\.gamma$ => \1.ls.gamma")
        )
        assert mapped.verdict == "MISMATCH"
        assert {r.name for r in mapped.records if not r.match} == {"0.ls.gamma", "1.ls.gamma"}
        by_name = compare_run(_scaled(folded=True), reader, waive=(*modules, "*.ls.gamma"))
        assert by_name.verdict == "MATCH", by_name.bundle_only


class _Positions(nn.Module):
    """A root parameter (``pos``, or ``other`` in a port that renames it) doubled in backward where ``bug``."""

    def __init__(self, name: str = "pos", bug: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin, self.name, self.bug = nn.Linear(4, 4), name, bug
        setattr(self, name, nn.Parameter(torch.randn(4)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pos = getattr(self, self.name)
        return self.lin(x + (pos + pos - pos.detach() if self.bug else pos))


def test_a_wrapper_root_waiver_leaves_the_roots_parameters_alone(tmp_path: Path) -> None:
    """A capture under DataParallel names the root ``module``; ``module/*`` waives that wrapper's records, never the
    root's own parameters (``module.pos``): a port that renamed and broke that parameter stayed INCOMPLETE before
    and passed after module globs waived parameters."""
    from parity_harness.capture.record.recorder import capture_run

    bundle = tmp_path / "wrapped.h5"
    x = {"x": torch.randn(2, 4, generator=torch.Generator().manual_seed(1))}
    capture_run(nn.DataParallel(_Positions()), x, bundle, seed=0)
    with BundleReader(bundle) as reader:
        assert compare_run(_Positions(), reader).verdict == "MATCH"
        result = compare_run(_Positions("other", bug=True), reader, waive=("module/*",))
    assert result.verdict == "INCOMPLETE"
    assert result.bundle_only == ["module.pos"]


class _Tail(nn.Module):
    """Blocks with a linear named ``inner`` (``ln`` in the reference, ``norm`` in the port), a final one named
    ``last`` (``norm_f``, ``norm``), and a child module named ``module`` holding a ``proj`` (``lin`` in the port)."""

    def __init__(self, port: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inner, self.last, self.child = ("norm", "norm", "lin") if port else ("ln", "norm_f", "proj")
        self.blocks = nn.ModuleList(nn.Module() for _ in range(2))
        for block in self.blocks:
            setattr(block, self.inner, nn.Linear(4, 4))
        setattr(self, self.last, nn.Linear(4, 4))
        self.module = nn.Module()  # a real child of that name (a user's container), not a wrapper
        setattr(self.module, self.child, nn.Linear(4, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = getattr(self.module, self.child)(x)
        for block in self.blocks:
            x = x + getattr(block, self.inner)(x)
        return getattr(self, self.last)(x)


_TAIL_MAP = "\n".join([r"^norm$ => norm_f", r"^(.*)\.norm$ => \1.ln", r"^module\.lin$ => module.proj"])


@pytest.mark.parametrize("wrap", ["none", "DataParallel", "checkpoint_wrapper"])
def test_a_wrapped_port_is_renamed_as_the_unwrapped_one_rule_order_included(tmp_path: Path, wrap: str) -> None:
    """Under a wrapper the port's names change (``module.norm``), and a later, generic rule fitting the wrapped name
    (``^(.*)\\.norm$``) took it before the first rule, written for ``norm``; a child really named ``module`` lost that
    part of its name. Rules are matched against the unwrapped names, in their order, as for the unwrapped port."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    from parity_harness.capture.record.recorder import capture_run

    bundle = tmp_path / "tail.h5"
    capture_run(_Tail(port=False), (torch.randn(2, 4, generator=torch.Generator().manual_seed(1)),), bundle, seed=0)
    port = _Tail(port=True)
    if wrap == "checkpoint_wrapper":
        port.blocks[0].norm = checkpoint_wrapper(port.blocks[0].norm)
    wrapped = nn.DataParallel(port) if wrap == "DataParallel" else port
    with BundleReader(bundle) as reader:
        result = compare_run(wrapped, reader, rename=parse_map(_TAIL_MAP))
    assert result.verdict == "MATCH", result.bundle_only
    assert {"norm_f.weight", "blocks.0.ln.weight", "module.proj.weight"} <= {r.name for r in result.param_values}


class _Checkpointable(nn.Module):
    """Two layers, the first under activation checkpointing's wrapper where ``checkpointed``; ``bug`` scales the
    first layer's output by 1.001."""

    def __init__(self, checkpointed: bool = False, bug: bool = False) -> None:
        super().__init__()
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        torch.manual_seed(0)
        self.lin, self.out, self.bug = nn.Linear(4, 4), nn.Linear(4, 4), bug
        if checkpointed:
            self.lin = checkpoint_wrapper(self.lin)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.lin(x) * (1.001 if self.bug else 1.0))


_WRAPPED: dict[str, Any] = {
    "plain": lambda bug=False: _Checkpointable(bug=bug),
    "checkpointed": lambda bug=False: _Checkpointable(checkpointed=True, bug=bug),
    "DataParallel-checkpointed": lambda bug=False: nn.DataParallel(_Checkpointable(checkpointed=True, bug=bug)),
    "DataParallel-compiled": lambda bug=False: nn.DataParallel(
        torch.compile(_Checkpointable(bug=bug), backend="eager")
    ),
}


@pytest.mark.parametrize("captured", list(_WRAPPED))
def test_a_capture_with_wrappers_around_modules_pairs_with_any_wrapping_of_the_port(
    tmp_path: Path, captured: str
) -> None:
    """A wrapper around a module (activation checkpointing's, FSDP1's) and a wrapper inside the root's (DataParallel
    around torch.compile) are recorded as modules of their own, whose names normalise to those of the modules they
    wrap: the two collided, nothing was normalised, and a correct port wrapped otherwise was INCOMPLETE. The
    wrappers' records now go as a wrapper's, the wrapped modules pair with the port's, however it is wrapped."""
    from parity_harness.capture.record.recorder import capture_run

    bundle = tmp_path / "wrapped.h5"
    capture_run(_WRAPPED[captured](), {"x": torch.randn(2, 4, generator=torch.Generator().manual_seed(1))}, bundle)
    with BundleReader(bundle) as reader:
        for name, make in _WRAPPED.items():
            result = compare_run(make(), reader)
            assert result.verdict == "MATCH", (name, result.bundle_only, result.notes)
            assert compare_run(make(bug=True), reader).verdict == "MISMATCH", name


class _Twice(nn.Module):
    """A linear layer called twice, checkpointed (``impl``: activation checkpointing's implementation) or not;
    ``bug``: its input's gradient scaled by 1.01."""

    def __init__(self, impl: str | None = None, bug: bool = False) -> None:
        super().__init__()
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

        torch.manual_seed(0)
        self.lin, self.out, self.bug = nn.Linear(4, 4), nn.Linear(4, 4), bug
        if impl is not None:
            self.lin = checkpoint_wrapper(self.lin, checkpoint_impl=CheckpointImpl[impl])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.tanh(self.lin(x))
        hidden = GradientScaled.apply(hidden, 1.01) if self.bug else hidden  # the first call's gradient, wrong
        return self.out(torch.tanh(self.lin(hidden)))


@pytest.mark.parametrize("captured", [None, "NO_REENTRANT", "REENTRANT"])
@pytest.mark.parametrize("ported", [None, "NO_REENTRANT"])
def test_a_checkpoint_wrapper_never_counts_a_call_twice_nor_hides_the_only_gradient_record(
    tmp_path: Path, captured: str | None, ported: str | None
) -> None:
    """A port's wrapper around a module and the wrapped module both named the same module: each call counted twice,
    and a correct port whose checkpointed layer runs twice failed. Under reentrant checkpointing the wrapped module
    records no gradient, and the wrapper's were waived as a wrapper's: a port wrong in that backward passed; then
    they stayed missing, and a correct port was INCOMPLETE. They are now the wrapped module's gradient records,
    compared with the port's."""
    from parity_harness.capture.record.recorder import capture_run

    bundle = tmp_path / "twice.h5"
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(1)).requires_grad_(True)
    capture_run(_Twice(captured), (x,), bundle)
    with BundleReader(bundle) as reader:
        correct, buggy = compare_run(_Twice(ported), reader), compare_run(_Twice(ported, bug=True), reader)
    assert correct.verdict == "MATCH", (correct.bundle_only, [r.name for r in correct.records if not r.match])
    assert buggy.verdict == "MISMATCH"
    if captured == "REENTRANT":  # the wrapper's gradient records are compared, never waived
        grads = {"lin/0/grad_output", "lin/0/grad_input.input", "lin/1/grad_output", "lin/1/grad_input.input"}
        assert grads <= {r.name for r in correct.records}
        assert "lin/0/grad_output" in {r.name for r in buggy.records if not r.match}
        assert not any("grad" in name for name in correct.waived)


class _ScaledInside(nn.Sequential):
    """A layer whose backward scales the gradient reaching its output by 1.01, inside it: a bug of its own."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # nn.Sequential's argument name
        return GradientScaled.apply(super().forward(input), 1.01)


class _WeightGradientScaled(nn.Linear):
    """A linear layer whose weight's gradient alone is scaled by 1.01: a bug in a child of a layer."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # nn.Linear's argument name
        return nn.functional.linear(input, GradientScaled.apply(self.weight, 1.01), self.bias)


class _CheckpointedLayers(nn.Module):
    """Three layers of two modules each, each layer under activation checkpointing's wrapper (``impl``) or not;
    ``bug``: ``backward`` scales the gradient into layer 1's output by 1.01 (between the layers), ``inside`` does
    so inside layer 1, ``weight`` scales the gradient of layer 1's linear weight alone, ``detached`` cuts layer 0's
    input off from the graph."""

    def __init__(self, impl: str | None = None, bug: str | None = None) -> None:
        super().__init__()
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

        torch.manual_seed(0)
        layers = [nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(3)]
        if bug == "inside":
            layers[1] = _ScaledInside(*layers[1])
        if bug == "weight":
            child = _WeightGradientScaled(4, 4)
            child.load_state_dict(layers[1][0].state_dict())
            layers[1][0] = child
        if impl is not None:
            layers = [checkpoint_wrapper(layer, checkpoint_impl=CheckpointImpl[impl]) for layer in layers]
        self.layers, self.bug = nn.ModuleList(layers), bug

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.detach() if self.bug == "detached" else x
        for number, layer in enumerate(self.layers):
            x = layer(x)
            x = GradientScaled.apply(x, 1.01) if self.bug == "backward" and number == 1 else x
        return x


@pytest.mark.parametrize("ported", [None, "NO_REENTRANT", "DataParallel"])
def test_a_reentrant_checkpointed_capture_compares_its_layers_gradients_with_any_port(
    tmp_path: Path, ported: str | None
) -> None:
    """Under reentrant activation checkpointing only each layer's wrapper records gradients, at the layer's
    boundary: they are the layer's own gradient records, compared with a port checkpointed otherwise or not at all
    (a correct port was INCOMPLETE); a port wrong in a layer's backward, or whose backward never reaches a layer's
    input, fails there."""
    from parity_harness.capture.record.recorder import capture_run

    def port(bug: str | None = None) -> nn.Module:
        if ported == "DataParallel":
            return nn.DataParallel(_CheckpointedLayers(bug=bug))
        return _CheckpointedLayers(ported, bug)

    bundle = tmp_path / "layers.h5"
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(1)).requires_grad_(True)
    capture_run(_CheckpointedLayers("REENTRANT"), (x,), bundle)
    with BundleReader(bundle) as reader:
        correct = compare_run(port(), reader)
        wrong, detached = compare_run(port("backward"), reader), compare_run(port("detached"), reader)
    assert correct.verdict == "MATCH", (correct.bundle_only, [r.name for r in correct.records if not r.match])
    boundaries = {f"layers.{n}/0/{slot}" for n in range(3) for slot in ("grad_output", "grad_input.input")}
    assert boundaries <= {r.name for r in correct.records}
    assert wrong.verdict == "MISMATCH"
    assert "layers.1/0/grad_output" in {r.name for r in wrong.records if not r.match}
    assert "layers.2/0/grad_output" not in {r.name for r in wrong.records if not r.match}
    assert detached.verdict == "MISMATCH"
    absent = {r.name: r.diff.problem for r in detached.records if not r.match}
    assert "no gradient in the port" in (absent.get("layers.0/0/grad_input.input") or ""), absent


@pytest.mark.parametrize("impl", ["NO_REENTRANT", "REENTRANT"])
def test_a_checkpoint_wrapper_around_a_compiled_model_pairs_with_the_plain_port(tmp_path: Path, impl: str) -> None:
    """``checkpoint_wrapper(torch.compile(model))``: torch.compile's ``_orig_mod`` follows the wrapper in every module
    name and leads every parameter name (the root wrapper drops its own): neither paired with the plain port, a
    correct port was INCOMPLETE with only its output compared. Both are seen through now; a backward bug fails."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

    from parity_harness.capture.record.recorder import capture_run

    bundle = tmp_path / "compiled.h5"
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(1)).requires_grad_(True)
    compiled = torch.compile(_CheckpointedLayers(), backend="eager")
    capture_run(checkpoint_wrapper(compiled, checkpoint_impl=CheckpointImpl[impl]), (x,), bundle)
    with BundleReader(bundle) as reader:
        correct = compare_run(_CheckpointedLayers(), reader)
        wrong = compare_run(_CheckpointedLayers(bug="backward"), reader)
    assert correct.verdict == "MATCH", (correct.bundle_only, [r.name for r in correct.records if not r.match])
    assert len(correct.of_kind("param_grad")) == 6
    assert len(correct.of_kind("forward")) > 10
    assert wrong.verdict == "MISMATCH"


def test_isolation_finds_a_bug_inside_a_layer_whose_wrapper_holds_its_gradients(tmp_path: Path) -> None:
    """Under reentrant checkpointing the layer's gradient records are its wrapper's: --isolate seeds the layer's
    backward with them and judges its input gradient by them, so a bug inside layer 1 is the origin there (it was
    'not isolated', with no reason and no origin); a correct port has none. The gradients of the parameters of the
    modules inside it, which recorded none, come from that backward too: a bug in a child's weight gradient is the
    origin at that weight (it was 'not isolated')."""
    from parity_harness.capture.record.recorder import capture_run

    bundle = tmp_path / "layers.h5"
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(1)).requires_grad_(True)
    capture_run(_CheckpointedLayers("REENTRANT"), (x,), bundle)
    with BundleReader(bundle) as reader:
        correct = compare_run(_CheckpointedLayers(), reader, isolate=True)
        wrong = compare_run(_CheckpointedLayers(bug="inside"), reader, isolate=True)
    assert correct.verdict == "MATCH"
    assert correct.first_origin("backward") is None
    origin = wrong.first_origin("backward")
    assert origin is not None
    assert origin.name == "layers.1/0/grad_input.input"
    assert {r.name: r.verdict for r in wrong.of_kind("backward")}["layers.0/0/grad_output"] == "inherited"
    by_layer = {r.name.split(".")[1]: r.verdict for r in wrong.of_kind("param_grad")}  # the layer's own inside it
    assert by_layer == {"0": "inherited", "1": "origin", "2": "ok"}, by_layer
    with BundleReader(bundle) as reader:
        weight = compare_run(_CheckpointedLayers(bug="weight"), reader, isolate=True)
    verdicts = {r.name: r.verdict for r in weight.of_kind("param_grad") if not r.match}
    assert verdicts == {"layers.1._checkpoint_wrapped_module.0.weight": "origin"}, verdicts


@pytest.mark.parametrize("impl", ["NO_REENTRANT", "REENTRANT"])
@pytest.mark.parametrize("parallel", [False, True], ids=["wrapper-root", "DataParallel-around-it"])
def test_a_capture_of_a_model_wrapped_whole_for_checkpointing_pairs_its_parameters(
    tmp_path: Path, impl: str, parallel: bool
) -> None:
    """The checkpoint wrapper at the root names its parameters without itself (``layers.0.0.weight``), its modules
    with it (``_checkpoint_wrapped_module.layers.0``): the unwrapped port's gradients paired with none of them, and a
    correct port was INCOMPLETE. Under DataParallel the wrapper's own records are the root's, which no port module
    has: its inputs, outputs and output gradient (the cotangent) go as a wrapper's; its input gradient, under
    reentrant checkpointing the only record of the model input's gradient, stays uncompared until waived (waiving it
    was a false MATCH for a port whose backward never reaches its input). A backward bug fails at the parameters it
    reaches."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

    from parity_harness.capture.record.recorder import capture_run

    bundle = tmp_path / "wrapped_whole.h5"
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(1)).requires_grad_(True)
    reference: nn.Module = checkpoint_wrapper(_CheckpointedLayers(), checkpoint_impl=CheckpointImpl[impl])
    capture_run(nn.DataParallel(reference) if parallel else reference, (x,), bundle)
    input_gradient = ["module/0/grad_input.x"] if parallel and impl == "REENTRANT" else []
    with BundleReader(bundle) as reader:
        assert any(name.endswith("layers.0.0.weight") for name in reader.index.grads)
        unwaived = compare_run(_CheckpointedLayers(), reader)
        correct = compare_run(_CheckpointedLayers(), reader, waive=tuple(input_gradient))
        wrong = compare_run(_CheckpointedLayers(bug="backward"), reader, waive=tuple(input_gradient))
    assert unwaived.bundle_only == input_gradient
    assert correct.verdict == "MATCH", (correct.bundle_only, [r.name for r in correct.records if not r.match])

    def unwrapped(records: list[RecordResult]) -> set[str]:  # the bundle's names, under DataParallel's prefixes
        return {record.name[record.name.index("layers.") :] for record in records}

    expected = {f"layers.{n}.0.{p}" for n in range(3) for p in ("weight", "bias")}
    assert unwrapped(correct.of_kind("param_grad")) == expected
    assert wrong.verdict == "MISMATCH"
    failing = unwrapped([r for r in wrong.of_kind("param_grad") if not r.match])
    assert {"layers.0.0.weight", "layers.1.0.weight"} <= failing


class _SwappedGradients(torch.autograd.Function):
    """The identity on two tensors whose backward hands each input the other's gradient."""

    @staticmethod
    def forward(ctx: Any, first: torch.Tensor, second: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return first.clone(), second.clone()

    @staticmethod
    def backward(ctx: Any, first: torch.Tensor, second: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return second, first


class _Gate(nn.Module):
    """``lin(a) * b``."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return self.lin(a) * b


class _PortedGate(_Gate):
    """The port's: its arguments named the other way round (its ``b`` is the reference's ``a``); ``bug``: their
    gradients swapped in its backward."""

    def __init__(self, bug: bool = False) -> None:
        super().__init__()
        self.bug = bug

    def forward(self, b: torch.Tensor, a: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        if self.bug:
            b, a = _SwappedGradients.apply(b, a)
        return self.lin(b) * a


class _Gated(nn.Module):
    def __init__(self, make_gate: Callable[[], nn.Module], impl: str | None = None) -> None:
        super().__init__()
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

        torch.manual_seed(0)
        gate = make_gate()
        self.gate = gate if impl is None else checkpoint_wrapper(gate, checkpoint_impl=CheckpointImpl[impl])
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.gate(x, y)))


@pytest.mark.parametrize(
    ("root", "line"), [(False, "slots gate a=b b=a"), (True, "slots gate a=b b=a"), (False, "slots gate.* a=b b=a")]
)
def test_a_map_s_slots_line_renames_the_gradients_a_wrapper_holds(tmp_path: Path, root: bool, line: str) -> None:
    """The gradients a reentrant checkpoint wrapper records for the module it wraps are that module's: a map's
    ``slots`` line for the module renames them too. It was matched against the wrapper's name (under a DataParallel
    capture, or written for the bundle's spelling of the module), the slots were paired unrenamed, and a port
    swapping its two inputs' gradients passed."""
    from parity_harness.capture.record.recorder import capture_run

    generator = torch.Generator().manual_seed(1)
    x, y = (torch.randn(2, 4, generator=generator).requires_grad_() for _ in range(2))
    reference = _Gated(_Gate, "REENTRANT")
    bundle = tmp_path / "gated.h5"
    capture_run(nn.DataParallel(reference) if root else reference, (x, y), bundle)
    rename = parse_map(line + "\n")
    with BundleReader(bundle) as reader:
        correct = compare_run(_Gated(_PortedGate), reader, rename=rename)
        wrong = compare_run(_Gated(functools.partial(_PortedGate, bug=True)), reader, rename=rename)
    assert correct.verdict == "MATCH", (correct.bundle_only, [r.name for r in correct.records if not r.match])
    gate = "module.gate" if root else "gate"
    assert {f"{gate}/0/grad_input.a", f"{gate}/0/grad_input.b"} <= {r.name for r in correct.records}
    assert wrong.verdict == "MISMATCH"
    assert {f"{gate}/0/grad_input.a", f"{gate}/0/grad_input.b"} <= {r.name for r in wrong.records if not r.match}


class _TwoOutputs(nn.Module):
    """A layer returning its output and a sum of it: the sum's gradient reaches the first output inside."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = self.lin(x)
        return y, y.sum(-1)


class _Pooled(nn.Module):
    def __init__(self, impl: str | None = None) -> None:
        super().__init__()
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

        torch.manual_seed(0)
        block = _TwoOutputs()
        self.block = block if impl is None else checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl[impl])
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, total = self.block(x)
        return self.head(torch.tanh(y)) * total.unsqueeze(-1)


def test_a_wrapper_s_output_gradients_stand_in_only_for_a_module_with_one(tmp_path: Path) -> None:
    """A reentrant checkpoint wrapper's output gradients are those from outside the module: where one output is
    computed from another inside it (``(y, y.sum())``), the module's own output gradient also takes what the other
    sends back, and a correct port failed there. Such a call's output gradients stay uncompared (INCOMPLETE until
    waived); its input gradients, which take in every path through the module, are compared."""
    from parity_harness.capture.record.recorder import capture_run

    bundle = tmp_path / "pooled.h5"
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(1)).requires_grad_()
    capture_run(_Pooled("REENTRANT"), (x,), bundle)
    with BundleReader(bundle) as reader:
        result = compare_run(_Pooled(), reader)
        waived = compare_run(_Pooled(), reader, waive=("block/0/grad_output.*",))
    assert result.verdict == "INCOMPLETE", [r.name for r in result.records if not r.match]
    assert set(result.bundle_only) == {"block/0/grad_output.0", "block/0/grad_output.1"}
    assert "block/0/grad_input.x" in {r.name for r in result.records if r.match}
    assert waived.verdict == "MATCH"


def test_a_reentrant_checkpointed_layer_s_gradients_are_judged_by_the_rounding_rule(tmp_path: Path) -> None:
    """A correct port whose layers round differently fails the wrapper-recorded gradients of a reentrant capture at
    atol = rtol = 0 by float32 rounding alone; the rounding check's float64 rerun did not produce them (it looked for
    them under the wrapped module's name), and the correct port was MISMATCH."""
    from parity_harness.capture.record.recorder import capture_run

    bundle = tmp_path / "layers.h5"
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(1)).requires_grad_(True)
    capture_run(_CheckpointedLayers("REENTRANT"), (x,), bundle)
    port = _CheckpointedLayers()
    for layer in port.layers:
        summing = ProductsSummedOtherwise(4, 4)
        summing.load_state_dict(layer[0].state_dict())
        layer[0] = summing
    with BundleReader(bundle) as reader:
        result = compare_run(port, reader, tolerances=ToleranceTable(Tolerance(0.0, 0.0)), rounding=True)
    assert result.verdict == "MATCH", [(r.name, r.rounding) for r in result.records if not r.match]
    by_rounding = {r.name for r in result.records if r.rule == "rounding"}
    assert {"layers.0/0/grad_output", "layers.0/0/grad_input.input"} <= by_rounding


class _SharedBase(nn.Module):
    """A frozen base layer called directly, then through a checkpoint wrapper (``impl``) on a second input: the
    wrapped module's call 0 is the direct one, the wrapper's call 0 the checkpointed one. ``bug``: the checkpointed
    call's gradient scaled by 1.01."""

    def __init__(self, impl: str | None = None, bug: bool = False) -> None:
        super().__init__()
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

        torch.manual_seed(0)
        base = nn.Linear(4, 4).requires_grad_(False)
        self.ck = checkpoint_wrapper(base, checkpoint_impl=CheckpointImpl[impl]) if impl else base
        self.head, self.bug = nn.Linear(8, 4), bug

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        direct = getattr(self.ck, "_checkpoint_wrapped_module", self.ck)(x)
        through = self.ck(y)
        through = GradientScaled.apply(through, 1.01) if self.bug else through
        return self.head(torch.cat([direct, through], -1))


class _GradientScaler(nn.Module):
    """Not a wrapper, though its child has a wrapper's child name: it scales the gradient into its input."""

    def __init__(self, scale: float) -> None:
        super().__init__()
        self._checkpoint_wrapped_module, self.scale = nn.Linear(4, 4), scale

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        kept = input.detach()
        return self._checkpoint_wrapped_module(kept + self.scale * (input - kept))


def _scaled_first(scale: float) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(_GradientScaler(scale), nn.Tanh(), nn.Linear(4, 3))


def test_a_wrapper_record_goes_as_a_wrapper_s_only_where_it_holds_the_wrapped_record_s_values(tmp_path: Path) -> None:
    """A wrapper's record was waived wherever the wrapped module had a record of the same call number and slot: a
    module also called directly numbers its calls otherwise (the checkpointed call's gradients, recorded by the
    wrapper alone under reentrant checkpointing, were waived against the direct call's), and a module of another
    class with a child of the wrapped module's name does work of its own (its input's gradient, scaled, recorded
    nowhere else). A port wrong in either passed. Such records now stay missing, or are compared."""
    from parity_harness.capture.record.recorder import capture_run

    shared = tmp_path / "shared.h5"
    inputs = tuple(torch.randn(2, 4, generator=torch.Generator().manual_seed(seed)).requires_grad_() for seed in (1, 2))
    capture_run(_SharedBase("REENTRANT"), inputs, shared)
    with BundleReader(shared) as reader:
        for port in (_SharedBase(bug=True), _SharedBase("REENTRANT", bug=True)):
            result = compare_run(port, reader)
            assert result.verdict != "MATCH"
            assert {"ck/0/grad_output", "ck/0/grad_input.input"} <= set(result.bundle_only)
    scaled = tmp_path / "scaled.h5"
    capture_run(_scaled_first(0.1), (inputs[0],), scaled)
    with BundleReader(scaled) as reader:
        assert compare_run(_scaled_first(0.1), reader).verdict == "MATCH"
        wrong = compare_run(_scaled_first(-1.0), reader)
    assert wrong.verdict == "MISMATCH"
    assert "0/0/grad_input.input" in {r.name for r in wrong.records if not r.match}


@pytest.mark.parametrize("layers", ["out", "lin"])
def test_a_capture_recording_no_wrapped_module_still_normalises_its_parameters(tmp_path: Path, layers: str) -> None:
    """A capture whose filters leave out the module a checkpoint wrapper wraps still records its parameters under the
    wrapper's name (``lin._checkpoint_wrapped_module.weight``); normalisation looked at module names alone, so
    nothing was normalised and a correct plain port was INCOMPLETE."""
    from parity_harness.capture.record.recorder import capture_run
    from parity_harness.common.format.bundle.selection import Selection

    bundle = tmp_path / "filtered.h5"
    x = {"x": torch.randn(2, 4, generator=torch.Generator().manual_seed(1))}
    capture_run(_Checkpointable(checkpointed=True), x, bundle, selection=Selection(layers=(layers,)))
    with BundleReader(bundle) as reader:
        assert "lin._checkpoint_wrapped_module.weight" in reader.index.params
        result = compare_run(_Checkpointable(), reader)
        assert result.verdict == "MATCH", result.bundle_only
        assert compare_run(_Checkpointable(bug=True), reader).verdict == "MISMATCH"


class _InputProjection(nn.Module):
    """A bias-free projection whose argument is called ``input`` (the reference's)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 4))

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return input @ self.weight.T


class _XProjection(_InputProjection):
    """The same, its argument called ``x`` (the port's)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x)


class _Projected(nn.Module):
    """The reference (``lin``, ``out``) or the port (``proj``, ``head``), whose projection names its argument
    otherwise; ``bug`` scales the hidden values by 1.001."""

    def __init__(self, port: bool, checkpointed: bool = False, bug: bool = False) -> None:
        super().__init__()
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        torch.manual_seed(0)
        layer: nn.Module = _XProjection() if port else _InputProjection()
        self.names, self.bug = ("proj", "head") if port else ("lin", "out"), bug
        setattr(self, self.names[0], checkpoint_wrapper(layer) if checkpointed else layer)
        setattr(self, self.names[1], nn.Linear(4, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.tanh(getattr(self, self.names[0])(x)) * (1.001 if self.bug else 1.0)
        return getattr(self, self.names[1])(hidden)


@pytest.mark.parametrize("wrap", ["checkpointed", "DataParallel"])
def test_a_maps_slots_line_names_a_wrapped_capture_s_module_as_the_unwrapped_one(tmp_path: Path, wrap: str) -> None:
    """A map's ``slots lin x=input`` line, written for the unwrapped model as its rules are, was matched against the
    bundle's own module names only (``lin._checkpoint_wrapped_module``, ``module.lin``): the renamed argument went
    unpaired and a correct port was INCOMPLETE."""
    from parity_harness.capture.record.recorder import capture_run

    bundle = tmp_path / "slots.h5"
    reference = _Projected(port=False, checkpointed=wrap == "checkpointed")
    capture_run(nn.DataParallel(reference) if wrap == "DataParallel" else reference, {"x": torch.randn(2, 4)}, bundle)
    rename = parse_map("^proj$ => lin\n^head$ => out\nslots lin x=input\n")
    with BundleReader(bundle) as reader:
        correct = compare_run(_Projected(port=True), reader, rename=rename)
        assert correct.verdict == "MATCH", correct.bundle_only
        assert not [note for note in correct.notes if "renamed nothing" in note]
        assert compare_run(_Projected(port=True, bug=True), reader, rename=rename).verdict == "MISMATCH"


@pytest.mark.parametrize("reentrant", [False, True])
def test_a_wrapper_s_records_kept_as_statistics_go_as_the_wrapped_module_s(tmp_path: Path, reentrant: bool) -> None:
    """A capture keeping its records as statistics only (``--summary-only``) under activation checkpointing: the
    wrapper's records were never taken for the wrapped module's (statistics proved nothing equal), and a correct port
    was INCOMPLETE. Equal statistics, the CRC-32 of the bytes among them, now count as the same values: the wrapper's
    forward records go as a wrapper's, and under reentrant checkpointing its gradients stand for the wrapped
    module's; a port wrong in that backward still fails there."""
    from parity_harness.capture.record.recorder import capture_run
    from parity_harness.common.format.bundle.selection import Selection

    bundle = tmp_path / "statistics.h5"
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(1)).requires_grad_(True)
    capture_run(
        _CheckpointedLayers("REENTRANT" if reentrant else "NO_REENTRANT"),
        (x,),
        bundle,
        selection=Selection(summary_only=True),
    )
    with BundleReader(bundle) as reader:
        correct, wrong = (
            compare_run(_CheckpointedLayers(), reader),
            compare_run(_CheckpointedLayers(bug="backward"), reader),
        )
    assert correct.verdict == "MATCH", correct.bundle_only
    assert wrong.verdict == "MISMATCH"
    failing = {r.name for r in wrong.records if not r.match}
    layer = "layers.1" if reentrant else "layers.1._checkpoint_wrapped_module"  # the wrapper's, or its own
    assert f"{layer}/0/grad_output" in failing, failing


class _Scale(nn.Module):
    """Multiplies by a float64 scale of 1 (a buffer: its gradient would sum past float64's range): values near
    float64's limit pass through unchanged."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("weight", torch.ones((), dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight


def test_records_whose_statistics_hold_a_nan_sum_are_the_same_where_equal(tmp_path: Path) -> None:
    """Finite float64 values summing past float64's range give a NaN sum, and a NaN never equals a NaN: two records
    of the same bytes kept as statistics only were not the same, and the wrapper's record was left missing."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    from parity_harness.capture.record.recorder import capture_run
    from parity_harness.common.format.bundle.selection import Selection
    from parity_harness.replay.compare.records import record_ref

    values = torch.zeros(1, 16, dtype=torch.float64)
    values[0, [0, 8]], values[0, [1, 9]] = 1e308, -1e308
    bundle, only_statistics = tmp_path / "huge.h5", Selection(summary_only=True)
    capture_run(
        nn.Sequential(checkpoint_wrapper(_Scale())), (values.requires_grad_(),), bundle, selection=only_statistics
    )
    with BundleReader(bundle) as reader:
        summary = reader.summary(record_ref(reader, "0/0/output"))  # type: ignore[arg-type]
        assert summary is not None
        assert math.isnan(summary["sum"])
        result = compare_run(nn.Sequential(_Scale()), reader)
    assert result.verdict == "MATCH", result.bundle_only
