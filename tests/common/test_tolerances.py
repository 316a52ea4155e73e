"""Tolerances: validation, per-record glob overrides, and parsing of GLOB=ATOL,RTOL specs."""

from __future__ import annotations

import math

import pytest

from parity_harness.common.errors import InputError
from parity_harness.common.numerics.tolerances import (
    DEFAULT_ATOL,
    DEFAULT_RTOL,
    Tolerance,
    ToleranceTable,
    parse_override,
)


def test_default_tolerance() -> None:
    """The default tolerance uses the documented defaults and does not treat NaNs as equal."""
    assert Tolerance() == Tolerance(DEFAULT_ATOL, DEFAULT_RTOL, False)


@pytest.mark.parametrize(
    ("atol", "rtol"),
    [(0.0, 0.0), (1e-4, 0.0), (0.0, 1.0), (math.inf, math.inf), (3, 0)],
    ids=["zero", "atol-only", "rtol-only", "infinite", "ints"],
)
def test_tolerance_accepts(atol: float, rtol: float) -> None:
    """Non-negative numbers (zero and infinity included) are valid tolerances."""
    tolerance = Tolerance(atol, rtol)
    assert (tolerance.atol, tolerance.rtol) == (atol, rtol)


@pytest.mark.parametrize(
    ("atol", "rtol", "name"),
    [
        (-1e-9, 0.0, "atol"),
        (0.0, -1.0, "rtol"),
        (math.nan, 0.0, "atol"),
        (0.0, math.nan, "rtol"),
        (-math.inf, 0, "atol"),
    ],
    ids=["negative-atol", "negative-rtol", "nan-atol", "nan-rtol", "minus-inf-atol"],
)
def test_tolerance_refuses(atol: float, rtol: float, name: str) -> None:
    """A negative or NaN tolerance raises InputError naming the bad field."""
    with pytest.raises(InputError, match=rf"tolerance {name}="):
        Tolerance(atol, rtol)


def test_tolerance_is_frozen() -> None:
    """A Tolerance cannot be changed after validation."""
    tolerance = Tolerance()
    with pytest.raises(AttributeError):
        tolerance.atol = -1.0  # type: ignore[misc]


LOOSE, LOOSER, EXACT = Tolerance(1e-3, 1e-3), Tolerance(1e-1, 1e-1), Tolerance(0.0, 0.0)
TABLE = ToleranceTable(
    default=EXACT,
    overrides=(("encoder.*", LOOSE), ("encoder.layers.*.attn*", LOOSER), ("*.norm", LOOSE)),
)


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("decoder.out", EXACT),
        ("encoder.layers.0.ff", LOOSE),
        ("encoder.layers.3.attn.q_proj", LOOSER),
        ("decoder.norm", LOOSE),
        ("Encoder.layers.0.ff", EXACT),
        ("encoder", EXACT),
    ],
    ids=["default", "first-glob", "last-matching-wins", "suffix-glob", "case-sensitive", "glob-needs-the-dot"],
)
def test_tolerance_table_for_record(name: str, expected: Tolerance) -> None:
    """The last glob that matches the record name wins; without a match the default applies."""
    assert TABLE.for_record(name) is expected


def test_tolerance_table_order_matters() -> None:
    """Reversing the overrides makes the broader glob win."""
    table = ToleranceTable(EXACT, (("encoder.layers.*.attn*", LOOSER), ("encoder.*", LOOSE)))
    assert table.for_record("encoder.layers.3.attn") is LOOSE


def test_empty_tolerance_table() -> None:
    """An empty table applies the default Tolerance everywhere."""
    assert ToleranceTable().for_record("anything") == Tolerance()


@pytest.mark.parametrize(
    ("spec", "pattern", "atol", "rtol"),
    [
        ("*.attn*=1e-4,1e-3", "*.attn*", 1e-4, 1e-3),
        ("encoder.layers.0=0,0", "encoder.layers.0", 0.0, 0.0),
        ("a=b=1, 2", "a=b", 1.0, 2.0),
        ("*=inf,0.5", "*", math.inf, 0.5),
    ],
    ids=["glob", "zeros", "pattern-with-equals-and-space", "infinite"],
)
def test_parse_override(spec: str, pattern: str, atol: float, rtol: float) -> None:
    """GLOB=ATOL,RTOL parses into the glob and a Tolerance (the last '=' separates them)."""
    assert parse_override(spec) == (pattern, Tolerance(atol, rtol))


def test_parse_override_equal_nan() -> None:
    """equal_nan is carried into the parsed Tolerance."""
    assert parse_override("*=1,1", equal_nan=True)[1].equal_nan is True


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("*.attn*", "expected GLOB=ATOL,RTOL"),
        ("=1e-4,1e-4", "expected GLOB=ATOL,RTOL"),
        ("*=1e-4", "expected GLOB=ATOL,RTOL"),
        ("*=1e-4,1e-4,1", "expected GLOB=ATOL,RTOL"),
        ("*=a,b", "must be numbers"),
        ("*=1e-4,", "must be numbers"),
        ("*=-1,0", "atol=-1.0 is invalid"),
        ("*=0,nan", "rtol=nan is invalid"),
        ("", "expected GLOB=ATOL,RTOL"),
    ],
    ids=[
        "no-equals",
        "no-glob",
        "one-number",
        "three-numbers",
        "not-numbers",
        "empty-rtol",
        "negative",
        "nan",
        "empty",
    ],
)
def test_parse_override_refuses(spec: str, message: str) -> None:
    """A bad override raises InputError (also a ValueError) saying what is wrong."""
    with pytest.raises(InputError, match=message) as info:
        parse_override(spec)
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    ("tag", "expected"),
    [
        ("F32", (1e-5, 1.3e-6)),
        ("BF16", (1e-5, 1.6e-2)),
        ("F16", (1e-5, 1e-3)),
        ("F64", (1e-7, 1e-7)),
        ("I64", (0.0, 0.0)),
    ],
    ids=["f32", "bf16", "f16", "f64", "int-exact"],
)
def test_torch_preset_uses_assert_close_defaults_per_dtype(tag: str, expected: tuple[float, float]) -> None:
    """The torch preset gives each record torch.testing.assert_close's tolerance for its reference dtype."""
    tolerance = ToleranceTable.torch_preset().for_record("any.record", tag)
    assert (tolerance.atol, tolerance.rtol) == expected


def test_glob_override_beats_the_dtype_preset() -> None:
    """A --tol glob override wins over the per-dtype preset."""
    table = ToleranceTable.torch_preset(overrides=(("enc.*", Tolerance(1.0, 2.0)),))
    assert table.for_record("enc.x", "F32") == Tolerance(1.0, 2.0)
    assert table.for_record("dec.x", "F32") == Tolerance(1e-5, 1.3e-6)


def test_noise_floor_becomes_a_per_record_absolute_tolerance() -> None:
    """with_noise_floor gives a floored record atol + factor * floor and rtol 0; others keep the default."""
    table = ToleranceTable(Tolerance(1e-6, 1e-3)).with_noise_floor({"a/0/output": 2e-6}, 4.0)
    assert table.for_record("a/0/output", "F32") == Tolerance(1e-6 + 8e-6, 0.0)
    assert table.for_record("b/0/output", "F32") == Tolerance(1e-6, 1e-3)
    with pytest.raises(InputError):
        ToleranceTable().with_noise_floor({}, -1.0)


@pytest.mark.parametrize("tag", ["I64", "I32", "U8", "BOOL"])
@pytest.mark.parametrize(
    "table",
    [ToleranceTable(), ToleranceTable(Tolerance(5e-2, 5e-2)), ToleranceTable.torch_preset()],
    ids=["default", "bf16-preset", "torch-preset"],
)
def test_integer_and_bool_records_are_exact_unless_named(tag: str, table: ToleranceTable) -> None:
    """A default or preset tolerance is for rounding: integer and bool records get atol = rtol = 0 from it (a length
    of 1000 against 1040 must not pass a bf16 preset), float records keep it."""
    assert table.for_record("output.length", tag) == Tolerance(0.0, 0.0)
    assert table.for_record("output.logits", "F32") != Tolerance(0.0, 0.0)


def test_a_glob_or_a_record_entry_still_loosens_an_integer_record() -> None:
    """The user's own rule for a record (a --tol glob, a per-record entry) applies to integers as asked."""
    table = ToleranceTable(
        overrides=(("output.len*", Tolerance(1.0, 0.0)),), per_record={"output.count": Tolerance(2.0, 0.0)}
    )
    assert table.for_record("output.length", "I64") == Tolerance(1.0, 0.0)
    assert table.for_record("output.count", "I64") == Tolerance(2.0, 0.0)
    assert table.for_record("output.ids", "I64") == Tolerance(0.0, 0.0)
