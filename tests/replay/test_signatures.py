"""Pairing across call signatures: arguments bound to forward's parameter names, slots renamed by the map
(one port tensor for several equal reference ones), and output structure normalised."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner, Result
from torch import nn

from parity_harness.capture.record.recorder import capture_run
from parity_harness.common.errors import MapFileError
from parity_harness.replay.cli.replay_compare import main
from parity_harness.replay.naming.mapping import parse_map
from tests.cli_helpers import one_error_line
from tests.models import GradientScaled, ProductsSummedOtherwise

HERE = Path(__file__).resolve()


class RefAttention(nn.Module):
    """NeMo-style: separate query/key/value arguments, returns a tensor."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.linear_q, self.linear_k, self.linear_v = (nn.Linear(width, width) for _ in range(3))

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        q, k, v = self.linear_q(query), self.linear_k(key), self.linear_v(value)
        return torch.softmax(q @ k.transpose(1, 2) / math.sqrt(q.shape[-1]), dim=-1) @ v


class RefLayer(nn.Module):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.self_attn = RefAttention(width)

    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        return x + scale * self.self_attn(query=h, key=h, value=h)


class RefNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.layer = RefLayer()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        return self.layer(x=h, scale=torch.full((1,), 0.5))  # keywords, as NeMo calls its layers


class PortAttention(nn.Module):
    """transformers-style: one hidden_states argument, returns (output, weights)."""

    def __init__(self, width: int = 8, wrong_scale: bool = False) -> None:
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(width, width) for _ in range(3))
        self.wrong_scale = wrong_scale

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q, k, v = self.q_proj(hidden_states), self.k_proj(hidden_states), self.v_proj(hidden_states)
        scale = 1.0 / q.shape[-1] if self.wrong_scale else 1.0 / math.sqrt(q.shape[-1])
        weights = torch.softmax(q @ k.transpose(1, 2) * scale, dim=-1)
        return weights @ v, weights


class PortLayer(nn.Module):
    def __init__(self, wrong_scale: bool = False) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.self_attn = PortAttention(8, wrong_scale)

    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return x + scale * self.self_attn(self.norm(x))[0]


class PortNet(nn.Module):
    def __init__(self, wrong_scale: bool = False) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.layer = PortLayer(wrong_scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(self.inp(x), torch.full((1,), 0.5))  # positionally


PORT_MAP = """
^(.*)\\.q_proj$ => \\1.linear_q
^(.*)\\.k_proj$ => \\1.linear_k
^(.*)\\.v_proj$ => \\1.linear_v
slots layer.self_attn hidden_states=query+key+value
"""


def build_reference() -> RefNet:
    torch.manual_seed(0)
    model = RefNet()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(torch.randn_like(parameter) * 0.5)
    return model


def _port(wrong_scale: bool) -> PortNet:
    port = PortNet(wrong_scale)
    state = {
        key.replace("linear_q", "q_proj").replace("linear_k", "k_proj").replace("linear_v", "v_proj"): value
        for key, value in build_reference().state_dict().items()
    }
    port.load_state_dict(state)
    return port


def build_port() -> PortNet:
    return _port(wrong_scale=False)


def build_port_attention_bug() -> PortNet:
    return _port(wrong_scale=True)


@pytest.fixture
def bundle(tmp_path: Path) -> Path:
    out = tmp_path / "ref.h5"
    capture_run(build_reference(), {"x": torch.randn(2, 5, 4, generator=torch.Generator().manual_seed(3))}, out, seed=1)
    return out


def replay(
    bundle: Path, factory: str, tmp_path: Path, *extra: str, map_text: str | None = PORT_MAP
) -> tuple[Result, dict]:
    report = tmp_path / "r.json"
    args = ["--bundle", str(bundle), "--model", f"{HERE}:{factory}", "--json", str(report), *extra]
    if map_text is not None:
        (tmp_path / "port.map").write_text(map_text)
        args += ["--map", str(tmp_path / "port.map")]
    result = CliRunner().invoke(main, args)
    assert result.exit_code in (0, 1), result.output
    return result, json.loads(report.read_text())


def test_keyword_and_positional_calls_pair_by_parameter_name(bundle: Path, tmp_path: Path) -> None:
    """The reference calls its layer with keywords, the port positionally: both record input.x and input.scale."""
    _, report = replay(bundle, "build_port", tmp_path)
    names = {record["name"] for record in report["records"]}
    assert {"layer/0/input.x", "layer/0/input.scale", "layer/0/grad_input.x"} <= names
    assert {"inp/0/input.input", "layer.norm/0/grad_input.input"} <= names


def test_one_port_argument_for_three_equal_reference_ones(bundle: Path, tmp_path: Path) -> None:
    """hidden_states=query+key+value: its value is compared with each, its gradient with their sum; the port's
    (out, weights) pairs its first element with the reference's single output; the run is complete."""
    result, report = replay(bundle, "build_port", tmp_path, "--isolate")
    assert result.exit_code == 0, result.output
    assert (report["verdict"], report["complete"]) == ("MATCH", True)
    records = {record["name"]: record for record in report["records"]}
    for slot in ("query", "key", "value"):
        assert records[f"layer.self_attn/0/input.{slot}"]["match"]
        assert records[f"layer.self_attn/0/grad_input.{slot}"]["match"]
        assert records[f"layer.self_attn/0/grad_input.{slot}"]["verdict"] == "ok"
    assert records["layer.self_attn/0/output"]["match"]
    assert records["layer.self_attn/0/grad_output"]["match"]
    assert "layer.self_attn/0/output.1" in report["unmatched"]["replay_only"]  # the port's weights: listed
    assert any("sum" in note for note in report["notes"])


def test_the_sum_is_what_is_compared(bundle: Path, tmp_path: Path) -> None:
    """Pairing the port's gradient with the query slot alone (no '+') fails: it is the sum of three paths."""
    text = PORT_MAP.replace("hidden_states=query+key+value", "hidden_states=query")
    text += "waive layer.self_attn/0/*input.key\nwaive layer.self_attn/0/*input.value\n"
    result, report = replay(bundle, "build_port", tmp_path, map_text=text)
    assert result.exit_code == 1
    records = {record["name"]: record for record in report["records"]}
    assert records["layer.self_attn/0/input.query"]["match"]
    assert not records["layer.self_attn/0/grad_input.query"]["match"]


def test_without_the_slots_line_the_arguments_are_listed_not_silently_passed(bundle: Path, tmp_path: Path) -> None:
    """No slots line: the reference's query/key/value stay uncompared and the run is INCOMPLETE, never MATCH."""
    text = PORT_MAP.replace("slots layer.self_attn hidden_states=query+key+value", "")
    result, report = replay(bundle, "build_port", tmp_path, "--isolate", map_text=text)
    assert result.exit_code == 1
    assert report["verdict"] == "INCOMPLETE"
    assert "layer.self_attn/0/input.query" in report["coverage"]["forward"]["missing"]
    assert "slots" in report["not_isolated"]["layer.self_attn"]  # the hint names the fix


def test_a_bug_inside_attention_is_blamed_on_attention(bundle: Path, tmp_path: Path) -> None:
    """With the arguments paired, --isolate names the attention module itself as the origin, both directions."""
    result, report = replay(bundle, "build_port_attention_bug", tmp_path, "--isolate")
    assert result.exit_code == 1
    assert report["first_origin"] == {"forward": "layer.self_attn", "backward": "layer.self_attn"}


def test_map_auto_proposes_the_slots_line(bundle: Path, tmp_path: Path) -> None:
    """--map auto pairs the arguments by their values and saves the slots line a user would write."""
    saved = tmp_path / "auto.map"
    result, report = replay(bundle, "build_port", tmp_path, "--map", "auto", "--save-map", str(saved), map_text=None)
    assert result.exit_code == 0, result.output
    assert "slots layer.self_attn hidden_states=query+key+value" in saved.read_text()
    assert report["complete"], report["coverage"]


@pytest.mark.parametrize(
    "line",
    ["slots layer.self_attn", "slots layer hidden_states", "slots layer a=b=c", "slots layer x=output"],
)
def test_a_malformed_slots_line_is_a_one_line_error(line: str) -> None:
    """A slots line that is not 'slots GLOB PORT=REF[+REF...]' is refused naming the line."""
    with pytest.raises(MapFileError, match="<map>:1"):
        parse_map(line)


def test_a_malformed_slots_line_exits_2(bundle: Path, tmp_path: Path) -> None:
    (tmp_path / "bad.map").write_text("slots layer hidden_states\n")
    args = ["--bundle", str(bundle), "--model", f"{HERE}:build_port", "--map", str(tmp_path / "bad.map")]
    assert "bad.map:1" in one_error_line("replay-compare", CliRunner().invoke(main, args))


# --------------------------------------------------------------------------- signatures of every shape


class _VarArgs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + sum(rest)


class _PositionalOnly(nn.Module):
    def forward(self, x: torch.Tensor, /, **extra: torch.Tensor) -> torch.Tensor:
        return x * 2 + extra["x"]


class _Shapes(nn.Module):
    """A ``*args`` forward, a positional-only one whose name is also a keyword, and a checkpoint-wrapped block."""

    def __init__(self, wrap: bool = False) -> None:
        super().__init__()
        torch.manual_seed(2)
        self.mix, self.posonly, self.block = _VarArgs(), _PositionalOnly(), nn.Linear(4, 4)
        if wrap:
            from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

            self.block = checkpoint_wrapper(self.block)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.mix(x, x * 2)
        return self.block(self.posonly(h, x=h * 3))


def build_shapes_wrapped() -> nn.Module:
    return _Shapes(wrap=True)


def test_varargs_positional_only_and_wrapped_forwards(tmp_path: Path) -> None:
    """``forward(x, *rest)`` names x and keeps rest's positions (and isolates); a positional-only ``x`` next to a
    keyword ``x`` records both; a checkpoint-wrapped port module is read through to the module's own signature."""
    bundle = tmp_path / "shapes.h5"
    capture_run(_Shapes(), {"x": torch.randn(2, 4, requires_grad=True)}, bundle, seed=2)
    result, report = replay(bundle, "build_shapes_wrapped", tmp_path, "--isolate", map_text=None)
    assert result.exit_code == 0, result.output
    assert report["complete"]
    names = {record["name"] for record in report["records"]}
    assert {"mix/0/input.x", "mix/0/input.1", "posonly/0/input.0", "posonly/0/input.x", "block/0/input.input"} <= names
    assert report["not_isolated"] == {}


def test_summed_statistics_only_records_are_left_uncompared_not_waived(tmp_path: Path) -> None:
    """A sum cannot be formed from statistics: those records stay uncompared (INCOMPLETE, exit 1, the note saying
    why), never waived on the user's behalf, which passed a port whose backward into them was wrong; the user's own
    waiver leaves a correct port's records, whose bits differ, undecided by their statistics (INCOMPLETE) until
    ``--accept-statistics`` counts them as matching."""
    from parity_harness.common.format.bundle.selection import Selection

    bundle = tmp_path / "summary.h5"
    inputs = {"x": torch.randn(2, 5, 4, generator=torch.Generator().manual_seed(3))}
    capture_run(build_reference(), inputs, bundle, seed=1, selection=Selection(summary_only=True))
    result, report = replay(bundle, "build_port", tmp_path)
    assert result.exit_code == 1, result.output
    assert report["verdict"] == "INCOMPLETE"
    assert "layer.self_attn/0/grad_input.key" in report["coverage"]["backward"]["missing"]
    assert any("statistics only, so the port's one gradient cannot be compared" in note for note in report["notes"])
    waived = ("--waive", "layer.self_attn/0/grad_input.*")
    result, report = replay(bundle, "build_port", tmp_path, *waived)
    assert result.exit_code == 1, result.output
    assert report["verdict"] == "INCOMPLETE"
    assert report["complete"]
    assert any("prove no match" in (record["problem"] or "") for record in report["records"])
    result, report = replay(bundle, "build_port", tmp_path, *waived, "--accept-statistics")
    assert result.exit_code == 0, result.output
    assert any("counted as matching (--accept-statistics)" in note for note in report["notes"])


class _MaskedBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.lin(x).masked_fill(mask, 0.0)


class _PortMaskedBlock(_MaskedBlock):
    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return self.lin(x).masked_fill(attn_mask, 0.0)


class _MaskedNet(nn.Module):
    def __init__(self, port: bool = False) -> None:
        super().__init__()
        torch.manual_seed(4)
        self.blk = _PortMaskedBlock() if port else _MaskedBlock()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blk(x, x > 0)


def build_masked_port() -> nn.Module:
    return _MaskedNet(port=True)


def test_a_tensor_argument_the_port_does_not_take_is_never_dropped_silently(tmp_path: Path) -> None:
    """Isolation does not run the port module without the reference's mask (that would blame it for the
    difference): the module is 'not isolated', naming the argument and the fix."""
    bundle = tmp_path / "masked.h5"
    capture_run(_MaskedNet(), {"x": torch.randn(3, 4, requires_grad=True)}, bundle, seed=1)
    _, report = replay(bundle, "build_masked_port", tmp_path, "--isolate", map_text="waive blk/*/input.mask\n")
    assert "'mask'" in report["not_isolated"]["blk"]
    assert "slots" in report["not_isolated"]["blk"]
    assert report["first_origin"] == {"forward": None, "backward": None}
    _, paired = replay(bundle, "build_masked_port", tmp_path, "--isolate", map_text="slots blk attn_mask=mask\n")
    assert paired["not_isolated"] == {}
    assert paired["complete"]


def test_a_slots_line_that_renames_nothing_is_a_warning(bundle: Path, tmp_path: Path) -> None:
    """A typo in a slots line's glob leaves it unused: a named WARNING note, besides the missing records."""
    text = PORT_MAP.replace("slots layer.self_attn", "slots layer.self_atn")
    _, report = replay(bundle, "build_port", tmp_path, map_text=text)
    assert any("WARNING" in note and "self_atn" in note for note in report["notes"])


@pytest.mark.parametrize(
    ("text", "rename"),
    [("^slots$ => layers", True), ("slots m q=h k=h", False), ("slots m x=x+x", False), ("slots a=b c=d", False)],
    ids=["module-named-slots", "one-reference-slot-twice", "repeated-in-a-sum", "glob-forgotten"],
)
def test_slots_lines_that_cannot_mean_one_thing(text: str, rename: bool) -> None:
    """A rename rule for a module called ``slots`` stays a rename rule; a reference slot claimed twice, or a
    line whose glob is missing, is refused."""
    if rename:
        assert parse_map(text).module("slots") == "layers"
    else:
        with pytest.raises(MapFileError, match="<map>:1"):
            parse_map(text)


class _TwoArgumentGate(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(a)) * b


class _OneArgumentGate(nn.Module):
    """The port's: one argument standing for both; ``bug``: its gradient scaled."""

    def __init__(self, width: int, bug: bool) -> None:
        super().__init__()
        self.lin, self.bug = ProductsSummedOtherwise(width, width), bug

    def forward(self, a: torch.Tensor) -> torch.Tensor:
        a = GradientScaled.apply(a, 1.001) if self.bug else a
        return torch.tanh(self.lin(a)) * a


class _Gated(nn.Module):
    def __init__(self, port: bool = False, bug: bool = False, width: int = 256) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.pre = ProductsSummedOtherwise(width, width) if port else nn.Linear(width, width)
        self.gate = _OneArgumentGate(width, bug) if port else _TwoArgumentGate(width)
        self.head = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.pre(x) * 30
        return self.head(self.gate(h) if isinstance(self.gate, _OneArgumentGate) else self.gate(h, h))


def test_a_summed_gradient_is_judged_by_the_rounding_rule(tmp_path: Path) -> None:
    """One port gradient compared with the sum of several reference slots (``a=a+b``) was never offered to the
    rounding check: a correct port that only rounds differently failed it at the default tolerances while its
    other records passed as rounding. It is now judged against the sum; a bug in that gradient still fails."""
    from parity_harness.replay.compare.runner import compare_run
    from parity_harness.replay.reader import BundleReader

    bundle = tmp_path / "gated.h5"
    capture_run(_Gated(), (torch.randn(64, 256, generator=torch.Generator().manual_seed(1)).requires_grad_(),), bundle)
    rename = parse_map("slots gate a=a+b\n")
    with BundleReader(bundle) as reader:
        correct = compare_run(_Gated(port=True), reader, rename=rename)
        wrong = compare_run(_Gated(port=True, bug=True), reader, rename=rename)
    summed = {"gate/0/grad_input.a", "gate/0/grad_input.b"}
    assert correct.verdict == "MATCH", [(r.name, r.rounding) for r in correct.records if not r.match]
    assert summed <= {r.name for r in correct.records if r.rule == "rounding"}  # out of atol/rtol, by rounding
    assert wrong.verdict == "MISMATCH"
    assert summed <= {r.name for r in wrong.records if not r.match}
