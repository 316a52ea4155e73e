"""While a port is exact, a record whose bits it reproduces is judged on a short path (no conversions, no layers of
the general comparison). That path must give every record the verdict the full comparison gives it, in both
directions: a NaN or an infinity reproduced bit for bit is not a match under the default rule, bf16 and float8
(held as raw bits) are decoded before their finiteness is judged, a port of another dtype holding the same bytes is
another dtype, and a port that stops being exact halfway through is compared in full from then on."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from parity_harness.capture.record.recorder import capture_run
from parity_harness.common.numerics.tolerances import Tolerance, ToleranceTable
from parity_harness.replay import result as result_module
from parity_harness.replay.compare.runner import compare_run
from parity_harness.replay.reader import BundleReader
from parity_harness.replay.result import RecordResult


class _Special(nn.Module):
    """A linear layer, then one module whose output holds one kind of value the short path must judge as the full
    comparison does (``kind``, a key of ``_KINDS``), then ``last``; ``late_change``: ``last``'s output moves by one ulp
    in the port."""

    def __init__(self, kind: str, late_change: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin, self.special = nn.Linear(8, 8), _Map(_KINDS[kind])
        self.last = _Map((lambda x: torch.nextafter(x, x + 1)) if late_change else (lambda x: x * 1))

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.lin(x)
        return {"special": self.special(h), "last": self.last(h)}


class _Map(nn.Module):
    """A module applying a function to its input."""

    def __init__(self, function: object) -> None:
        super().__init__()
        self.function = function

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.function(x)  # type: ignore[operator, no-any-return]


_KINDS = {
    "nan": lambda x: x.masked_fill(x > 0.3, float("nan")),
    "infinities": lambda x: x.masked_fill(x > 0.3, float("inf")).masked_fill(x < -0.3, float("-inf")),
    "signed zeros": lambda x: torch.where(x > 0, torch.zeros_like(x), -torch.zeros_like(x)),
    "bf16 nan": lambda x: x.bfloat16().masked_fill(x > 0.3, float("nan")),
    "bf16": lambda x: x.bfloat16(),
    "f16 infinity": lambda x: x.half().masked_fill(x.half() > 0.5, float("inf")),
    "integers": lambda x: (x > 0).sum(-1),
    "transposed": lambda x: x.t(),
    "float64": lambda x: x.double(),
}
"""What the special module returns; those holding NaN are no match unless the rule says NaN equals NaN."""
_WITH_NAN = {"nan", "bf16 nan"}
_NOT_FINITE = _WITH_NAN | {"infinities", "f16 infinity"}


def _inputs() -> dict[str, torch.Tensor]:
    return {"x": torch.randn(6, 8, generator=torch.Generator().manual_seed(1))}


def _replay(bundle: Path, port: nn.Module, tolerance: Tolerance) -> list[RecordResult]:
    """Every record compared, the parameters' values first."""
    with BundleReader(bundle) as reader:
        result = compare_run(port, reader, tolerances=ToleranceTable(tolerance))
    assert not result.bundle_only
    assert not result.replay_only
    return result.param_values + result.records


def _in_full(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every record through the full comparison: the short path never answers."""
    monkeypatch.setattr(result_module, "_reproduced", lambda *_: None)


@pytest.mark.parametrize("equal_nan", [False, True])
@pytest.mark.parametrize("late_change", [False, True])
@pytest.mark.parametrize("kind", sorted(_KINDS))
def test_every_record_gets_the_verdict_of_the_full_comparison(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str, equal_nan: bool, late_change: bool
) -> None:
    """Each kind of value is the first record past an exact start, so that the short path is the one asked."""
    bundle = tmp_path / "special.h5"
    capture_run(_Special(kind), _inputs(), bundle, seed=0)
    tolerance = Tolerance(0.0, 0.0, equal_nan)
    short = _replay(bundle, _Special(kind, late_change), tolerance)
    with monkeypatch.context() as patched:
        _in_full(patched)
        full = _replay(bundle, _Special(kind, late_change), tolerance)
    assert [(r.name, r.diff) for r in short] == [(r.name, r.diff) for r in full]
    verdicts = {r.name: r.match for r in short}
    assert verdicts["special/0/output"] is (kind not in _WITH_NAN or equal_nan)
    # Only finite bytes found bit for bit equal vouch for themselves (and skip their checksum): not a NaN, not -inf.
    special = next(r for r in short if r.name == "special/0/output")
    assert special.diff.bits_equal is (kind not in _NOT_FINITE)
    assert verdicts["last/0/output"] is not late_change
    assert verdicts["lin/0/output"]
    assert all(r.match for r in short if r.kind in ("param", "param_grad"))


class _Plain(nn.Module):
    """Linear -> tanh -> Linear; ``late_change``: the last output moves by one ulp in the port."""

    def __init__(self, late_change: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first, self.act, self.head = nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)
        self.late_change = late_change

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.head(self.act(self.first(x)))
        return torch.nextafter(out, out + 1) if self.late_change else out


def test_the_short_path_answers_an_exact_port_and_stops_once_it_differs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """It answers for every record of an exact port (else it would be dead weight); once a record differed, the
    records after it go the full way (where each is also checksummed beside its comparison)."""
    bundle = tmp_path / "plain.h5"
    capture_run(_Plain(), _inputs(), bundle, seed=0)
    answered: list[bool] = []
    reproduced = result_module._reproduced

    def counted(*args: object) -> object:
        verdict = reproduced(*args)
        answered.append(verdict is not None)
        return verdict

    monkeypatch.setattr(result_module, "_reproduced", counted)
    records = _replay(bundle, _Plain(), Tolerance(0.0, 0.0))
    assert all(r.match for r in records)
    assert len(answered) == len(records)
    assert all(answered)
    answered.clear()
    records = _replay(bundle, _Plain(late_change=True), Tolerance(0.0, 0.0))
    assert [r.name for r in records if not r.match] == ["output"]
    assert 0 < len(answered) < len(records)  # asked until the first difference, not after


class _Float8(nn.Module):
    """A float8 output, or its bits as uint8 (``as_bits``): the same bytes under another dtype."""

    def __init__(self, as_bits: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin, self.as_bits = nn.Linear(8, 8), as_bits

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.lin(x).detach().to(torch.float8_e4m3fn)
        return out.view(torch.uint8) if self.as_bits else out


@pytest.mark.parametrize("reference_bits", [True, False])
def test_the_same_bytes_under_another_dtype_are_another_dtype(tmp_path: Path, reference_bits: bool) -> None:
    """float8 and uint8 are both held as uint8 arrays: equal bytes, equal arrays, yet not the same record."""
    bundle = tmp_path / "float8.h5"
    capture_run(_Float8(as_bits=reference_bits), _inputs(), bundle, seed=0)
    records = {r.name: r for r in _replay(bundle, _Float8(as_bits=not reference_bits), Tolerance(0.0, 0.0))}
    output = records["output"]
    assert not output.match
    assert output.diff.problem is not None
    assert "dtype" in output.diff.problem
