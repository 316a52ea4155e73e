"""The float32 screening gives the float64 comparison's figures exactly, on data built to sit on its edges."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import numpy as np
import pytest

from parity_harness.common.numerics import metrics, screening
from parity_harness.common.numerics.metrics import TensorDiff, diff_arrays
from parity_harness.common.numerics.running import RunningDiff
from parity_harness.common.numerics.screening import Screen, screenable
from parity_harness.common.numerics.tolerances import Tolerance

Pair = tuple[np.ndarray, np.ndarray]


def _float64_only(monkeypatch: pytest.MonkeyPatch, e: np.ndarray, a: np.ndarray, tolerance: Tolerance) -> TensorDiff:
    with monkeypatch.context() as patch:
        patch.setattr(metrics, "screenable", lambda _: False)
        return diff_arrays(e, a, tolerance, expected_dtype="F32", actual_dtype="F32")


SPECIAL = 0.05
"""Share of a chunk's elements that are built to sit on an edge; the rest agree to about 1e-7, so that chunks
stay sparse enough to be screened (a chunk mostly beyond atol goes to float64 whole)."""


def _base(rng: np.random.Generator, n: int, tolerance: Tolerance) -> Pair:
    """Agreeing elements: within 1e-7 relative, or equal bits when atol is zero (where any difference is beyond)."""
    e = rng.standard_normal(n).astype(np.float32)
    if tolerance.atol == 0.0:
        return e, e.copy()
    return e, (e * (1 + 1e-7 * rng.standard_normal(n))).astype(np.float32)


def _ratio_contest(rng: np.random.Generator, n: int, tolerance: Tolerance) -> Pair:
    """Ratios |a - e| / |e| equal to 2**-33 while float32 rounds the sum a - e to 2**-23: float32 orders them
    differently from float64."""
    e = (1 + rng.integers(0, 1 << 20, n) * 2.0**-23).astype(np.float32)
    return e, (-(e.astype(np.float64) * 2.0**-9 * 1.2345)).astype(np.float32)


def _slack_contest(rng: np.random.Generator, n: int, tolerance: Tolerance) -> Pair:
    """|a - e| - rtol * |e| nearly constant, cut so that the largest in float64 is not the largest in float32
    (the required atol comes out of a float32 cancellation)."""
    rtol = tolerance.rtol or 1e-5
    e = (1 + rng.random(8 * n)).astype(np.float32)
    a = (e.astype(np.float64) * (1 + rtol) + (tolerance.atol or 0.25) * 3.0).astype(np.float32)
    slack64 = np.abs(a.astype(np.float64) - e) - tolerance.rtol * np.abs(e.astype(np.float64))
    slack32 = np.abs(a - e) - np.float32(tolerance.rtol) * np.abs(e)
    order = np.argsort(slack64, kind="stable")
    below, above = order[:-1], order[1:]
    inverted = np.flatnonzero((slack32[below] > slack32[above]) & (slack64[below] < slack64[above]))
    keep = order[: inverted[-1] + 2] if inverted.size else order  # the top pair is inverted
    keep = keep[-n:] if keep.size >= n else np.resize(keep, n)
    shuffled = rng.permutation(keep)
    return e[shuffled], a[shuffled]


def _largest_contest(rng: np.random.Generator, n: int, tolerance: Tolerance) -> Pair:
    """Differences ``1 + d`` with ``d`` below float32's resolution at 1: every one is 1.0 in float32 while float64
    tells them apart, and the largest may sit in any chunk, after others float32 calls equal to it."""
    e = np.ones(n, dtype=np.float32)
    return e, (-(2.0 ** rng.uniform(-27, -25, n))).astype(np.float32)


def _ratio_over_rtol(rng: np.random.Generator, n: int, tolerance: Tolerance) -> Pair:
    """Ratios ``|a - e| / |e|`` just past rtol, only those that float32 rounds to below it where there are any
    (rtol just above a float32 value): they alone set the required atol, though their float32 ratios pass rtol."""
    rtol = tolerance.rtol or 1e-5
    e = (1 + rng.random(64 * n)).astype(np.float32)
    a = (e.astype(np.float64) * (1 + rtol)).astype(np.float32)
    a = np.where(_slack64(e, a, rtol) > 0, a, np.nextafter(a, np.float32(np.inf)))
    hidden = (np.abs(a - e) / e).astype(np.float64) < rtol
    keep = np.resize(rng.permutation(np.flatnonzero(hidden) if hidden.any() else np.arange(n)), n)
    return e[keep], a[keep]


def _slack64(e: np.ndarray, a: np.ndarray, rtol: float) -> np.ndarray:
    """``|a - e| - rtol * |e|`` as the float64 comparison computes it."""
    return np.abs(a.astype(np.float64) - e) - rtol * np.abs(e.astype(np.float64))


def _topped_by(score: np.ndarray, top: np.ndarray, rng: np.random.Generator, n: int) -> np.ndarray:
    """``n`` positions whose largest ``score`` is at one of the positions flagged in ``top`` (shuffled)."""
    chosen = int(np.flatnonzero(top)[np.argmax(score[top])]) if top.any() else int(np.argmax(score))
    below = np.flatnonzero(score < score[chosen])
    return rng.permutation(np.append(rng.choice(below, n - 1), chosen))


def _needs_nudges(rng: np.random.Generator, n: int, tolerance: Tolerance) -> Pair:
    """The largest (|a - e| - atol) / |e| is at an element where ``atol + q*|e| < |a - e|`` in float64: the
    closed form of the required rtol lands a step short. (The required atol's closed form never does on float32
    values: ``|a - e|`` has 24 significant bits.)"""
    e = (rng.standard_normal(16 * n) * 3).astype(np.float32)
    a = (e + rng.standard_normal(e.size) * 1e-3).astype(np.float32)
    d, m = np.abs(a.astype(np.float64) - e), np.abs(e.astype(np.float64))
    with np.errstate(all="ignore"):
        ratio = np.where(m > 0, (d - tolerance.atol) / m, -np.inf)
        keep = _topped_by(ratio, tolerance.atol + ratio * m < d, rng, n)
    return e[keep], a[keep]


def _on_the_rule(rng: np.random.Generator, n: int, tolerance: Tolerance) -> Pair:
    """Differences at atol + rtol*|e| as float32 gets closest to it (exactly, for dyadic tolerances and
    values), and one float32 step either side."""
    e = (rng.integers(-64, 65, n) * 2.0**-4).astype(np.float32)
    bound = tolerance.atol + tolerance.rtol * np.abs(e.astype(np.float64))
    a = (e + bound * rng.choice([-1.0, 1.0], n)).astype(np.float32)
    step = rng.integers(-1, 2, n)
    a = np.where(step > 0, np.nextafter(a, np.float32(np.inf)), a)
    return e, np.where(step < 0, np.nextafter(a, np.float32(-np.inf)), a).astype(np.float32)


def _ties(rng: np.random.Generator, n: int, tolerance: Tolerance) -> Pair:
    """Many equal largest differences and ratios, at positions where the first must win."""
    e = rng.choice(np.array([0.5, 1.0, 2.0, -1.0], dtype=np.float32), n)
    return e, (e + rng.choice(np.array([2.0**-3, -(2.0**-3)], dtype=np.float32), n)).astype(np.float32)


def _zeros_in_reference(rng: np.random.Generator, n: int, tolerance: Tolerance) -> Pair:
    """Exact zeros in the reference, the port's value small or zero there (no rtol passes a difference at 0)."""
    return np.zeros(n, dtype=np.float32), (rng.standard_normal(n) * rng.choice([0.0, 1e-6, 1e-3], n)).astype(np.float32)


def _matched_zeros(rng: np.random.Generator, n: int, tolerance: Tolerance) -> Pair:
    """Exact zeros on both sides (ReLU outputs, rows of an embedding's gradient), a few of them beside values that
    differ where the reference is 0."""
    e = np.zeros(n, dtype=np.float32)
    a = np.where(rng.random(n) < 0.01, rng.standard_normal(n) * 1e-6, 0.0).astype(np.float32)
    return e, a


def _matched_infinities(rng: np.random.Generator, n: int, tolerance: Tolerance) -> Pair:
    """Infinities equal on both sides (attention scores masked with -inf)."""
    e = rng.choice(np.array([-np.inf, np.inf], dtype=np.float32), n)
    return e, e.copy()


def _tiny(rng: np.random.Generator, n: int, tolerance: Tolerance) -> Pair:
    """Subnormal float32 values: products and differences that underflow float32."""
    e = (rng.standard_normal(n) * 1e-39).astype(np.float32)
    return e, (e + (rng.standard_normal(n) * 1e-44).astype(np.float32)).astype(np.float32)


def _huge(rng: np.random.Generator, n: int, tolerance: Tolerance) -> Pair:
    """Values near float32's largest: differences that overflow float32 but not float64."""
    e = (rng.choice([-1.0, 1.0], n) * 3e38).astype(np.float32)
    return e, (-e * rng.choice([1.0, 0.999999], n)).astype(np.float32)


def _wide_range(rng: np.random.Generator, n: int, tolerance: Tolerance) -> Pair:
    """Magnitudes from 1e-30 to 1e30: ratios whose float32 value overflows."""
    e = (rng.standard_normal(n) * 10.0 ** rng.uniform(-30, 30, n)).astype(np.float32)
    return e, (e * (1 + 1e-4 * rng.standard_normal(n)) + 1e-6 * rng.standard_normal(n)).astype(np.float32)


def _non_finite(rng: np.random.Generator, n: int, tolerance: Tolerance) -> Pair:
    e = rng.standard_normal(n).astype(np.float32)
    return e, np.where(rng.random(n) < 0.5, np.float32(np.nan), np.float32(np.inf)).astype(np.float32)


Builder = Callable[[np.random.Generator, int, Tolerance], Pair]
CASES: dict[str, Builder] = {
    "ratio contest": _ratio_contest,
    "largest contest": _largest_contest,
    "ratio just over rtol": _ratio_over_rtol,
    "slack contest": _slack_contest,
    "on the rule": _on_the_rule,
    "needs nudges": _needs_nudges,
    "ties": _ties,
    "zeros in the reference": _zeros_in_reference,
    "zeros the port matches": _matched_zeros,
    "infinities the port matches": _matched_infinities,
    "subnormals": _tiny,
    "near the float32 maximum": _huge,
    "wide range": _wide_range,
    "NaN and infinities": _non_finite,
}
HAIR_OVER = Tolerance(1e-4, float(np.float32(0.3183099)) * (1 + 2.0**-30))
"""An rtol a hair above a float32 value: ratios between the two round to that value, below rtol."""
TOLERANCES = [
    Tolerance(1e-5, 1e-5),
    Tolerance(2.0**-10, 2.0**-3),
    Tolerance(1e-4, 0.0),
    Tolerance(0.0, 1e-3),
    Tolerance(0.0, 0.0),
    Tolerance(1.0, 0.0),  # the largest contest's differences all 1.0 in float32, beyond atol in float64
    HAIR_OVER,
]


def _pair(case: str, tolerance: Tolerance, seed: int) -> Pair:
    """Agreeing elements with a share of ``case``'s elements at random positions, over two or three chunks."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(2, 4)) * 60_000
    e, a = _base(rng, n, tolerance)
    at = rng.choice(n, int(n * SPECIAL), replace=False)
    e[at], a[at] = CASES[case](rng, at.size, tolerance)
    return e, a


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("tolerance", TOLERANCES, ids=lambda t: f"atol={t.atol:g},rtol={t.rtol:g}")
def test_screened_figures_are_the_float64_figures(
    monkeypatch: pytest.MonkeyPatch, case: str, tolerance: Tolerance
) -> None:
    """Every figure but the cosine is the float64 fold's, bit for bit; 1 - cosine agrees to 1e-5 relative."""
    for seed in range(3):
        e, a = _pair(case, tolerance, seed)
        screened = diff_arrays(e, a, tolerance, expected_dtype="F32", actual_dtype="F32")
        exact = _float64_only(monkeypatch, e, a, tolerance)
        assert dataclasses.replace(screened, cosine=0.0) == dataclasses.replace(exact, cosine=0.0), (case, seed)
        if math.isfinite(exact.cosine):
            assert 1.0 - screened.cosine == pytest.approx(1.0 - exact.cosine, rel=1e-5, abs=1e-12)


SCREENED = {
    "needs nudges",
    "largest contest",
    "ratio just over rtol",
    "ratio contest",
    "slack contest",
    "on the rule",
    "ties",
    "zeros in the reference",
    "zeros the port matches",
    "infinities the port matches",
    "subnormals",
    "wide range",
}
"""Cases whose chunks the screening folds at the default tolerance (the others must go to float64)."""


def test_the_edge_cases_are_screened_and_do_sit_on_their_edges(monkeypatch: pytest.MonkeyPatch) -> None:
    """The comparison above compares two implementations only if the screening folded the chunks, and the data
    is adversarial only if float32 orders the contested quantities differently from float64 and some elements
    sit exactly on the rule."""
    folded: list[bool] = []
    fold = Screen.fold
    monkeypatch.setattr(Screen, "fold", lambda *args: folded.append(fold(*args)) or folded[-1])
    for case in CASES:
        folded.clear()
        diff_arrays(*_pair(case, Tolerance(1e-5, 1e-5), 0), Tolerance(1e-5, 1e-5))
        assert any(folded) is (case in SCREENED), case
    rule = Tolerance(2.0**-10, 2.0**-3)
    e, a = (x.astype(np.float64) for x in _pair("on the rule", rule, 0))
    diff, bound = np.abs(a - e), rule.atol + rule.rtol * np.abs(e)
    assert np.count_nonzero(diff == bound) > 100
    assert np.count_nonzero(diff > bound) > 100
    assert 0 < diff_arrays(*_pair("on the rule", rule, 0), rule).mismatched < e.size * SPECIAL
    e32, a32 = _pair("ratio contest", Tolerance(1e-5, 1e-5), 0)
    ratio64 = np.abs(a32.astype(np.float64) - e32) / np.abs(e32.astype(np.float64))
    ratio32 = np.abs(a32 - e32) / np.abs(e32)
    assert int(np.argmax(ratio64)) not in np.flatnonzero(ratio32 == ratio32.max())
    default = Tolerance(1e-5, 1e-5)
    e32, a32 = _pair("slack contest", default, 0)
    slack64 = np.abs(a32.astype(np.float64) - e32) - default.rtol * np.abs(e32.astype(np.float64))
    slack32 = np.abs(a32 - e32) - np.float32(default.rtol) * np.abs(e32)
    assert int(np.argmax(slack64)) not in np.flatnonzero(slack32 == slack32.max())
    e32, a32 = _pair("largest contest", default, 0)
    contested = np.abs(a32 - e32) == 1.0
    assert np.unique(np.abs(a32.astype(np.float64) - e32)[contested]).size > 100
    e32, a32 = _pair("ratio just over rtol", HAIR_OVER, 0)
    ratio32 = (np.abs(a32 - e32) / np.abs(e32)).astype(np.float64)
    hidden = (_slack64(e32, a32, HAIR_OVER.rtol) > 0) & (ratio32 < HAIR_OVER.rtol)
    assert np.count_nonzero(hidden) > 100


def test_screening_folds_the_chunks_it_can_and_leaves_the_others() -> None:
    """A chunk of near values is folded in float32; NaN, float32 overflow, or most elements beyond atol are not,
    and after a chunk mostly beyond atol the rest of the comparison goes to float64 unscreened."""
    tolerance = Tolerance(1e-5, 1e-5)
    with np.errstate(all="ignore"):
        for case, folded in (("ties", True), ("NaN and infinities", False), ("near the float32 maximum", False)):
            e, a = _pair(case, tolerance, 1)
            assert Screen(e.size, tolerance).fold(RunningDiff(tolerance), e, a, 0) is folded, case
        e, a = _base(np.random.default_rng(1), 1000, tolerance)
        screen = Screen(1000, tolerance)
        assert not screen.fold(RunningDiff(tolerance), e, a + np.float32(1.0), 0)
        assert not screen.fold(RunningDiff(tolerance), e, a, 0)


def test_differences_the_bound_calls_beyond_atol_and_float32_does_not(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every difference equal to the largest float32 value left out of the elements gathered as beyond atol (just
    under the default atol, within the rounding band of it): the record passes with the float64 figures, where the
    screening once raised on the empty gathering."""
    tolerance = Tolerance()
    t = np.float32(np.float32(tolerance.atol) * np.float32(1 - 2.0**-20))
    assert float(t) < tolerance.atol < float(t) * (1 + 2.0**-20)
    e = np.full(1000, t, dtype=np.float32)
    a = (e * 2).astype(np.float32)
    screened = diff_arrays(e, a, tolerance, expected_dtype="F32", actual_dtype="F32")
    assert screened == _float64_only(monkeypatch, e, a, tolerance)
    assert screened.match


def test_tolerances_outside_float32_are_not_screened() -> None:
    """An atol or rtol that float32 would round to zero or infinity leaves every chunk to float64."""
    assert screenable(Tolerance(1e-5, 1e-5))
    assert screenable(Tolerance(0.0, 0.0))
    assert not screenable(Tolerance(1e-40, 1e-5))
    assert not screenable(Tolerance(1e-5, 1e39))


def test_a_chunk_crowded_at_rtol_gives_the_float64_figures(monkeypatch: pytest.MonkeyPatch) -> None:
    """More than an eighth of the ratios within the band of rtol (a port off by rtol almost everywhere): the
    required atol comes from the slack of every element, computed from this record's own magnitudes, whatever the
    records compared before left in the reused buffers. The values are small enough (about atol / rtol) that
    few differences exceed atol, so the chunks are screened, not left to float64."""
    tolerance = Tolerance(1e-5, 1e-3)
    rng = np.random.default_rng(11)
    for scale in (4e-3, 1e-3, 2.5e-4):
        e = (rng.standard_normal(120_000) * scale).astype(np.float32)
        a = (e * (1 + tolerance.rtol * (1 + 1e-4 * rng.standard_normal(e.size)))).astype(np.float32)
        screened = diff_arrays(e, a, tolerance, expected_dtype="F32", actual_dtype="F32")
        exact = _float64_only(monkeypatch, e, a, tolerance)
        assert dataclasses.replace(screened, cosine=0.0) == dataclasses.replace(exact, cosine=0.0), scale
        assert screened.required_atol > 0.0


@pytest.mark.parametrize("differing_zeros", [0, 20], ids=["all zeros matched", "a few differ"])
@pytest.mark.parametrize("tolerance", [Tolerance(1e-5, 1e-5), Tolerance(1e-3, 1e-3), Tolerance(1e-4, 0.0)], ids=str)
def test_zeros_the_port_matches_stay_in_float32(
    monkeypatch: pytest.MonkeyPatch, tolerance: Tolerance, differing_zeros: int
) -> None:
    """A reference of many exact zeros that the port has too (ReLU outputs, sparse gradients), near values
    elsewhere, perhaps a few zeros where the port differs: every chunk is screened and only a handful of elements
    are recomputed in float64, where every matched zero once was (such a record was compared at a seventh of the
    speed), with the float64 figures."""
    rng = np.random.default_rng(5)
    e = rng.standard_normal(200_000).astype(np.float32)
    zeros = np.flatnonzero(rng.random(e.size) < 0.3)
    e[zeros] = 0.0
    a = (e * (1 + 1e-7 * rng.standard_normal(e.size))).astype(np.float32)
    a[rng.choice(zeros, differing_zeros, replace=False)] = 1e-6
    recomputed: list[int] = []
    exact = screening._exact
    monkeypatch.setattr(screening, "_exact", lambda e, a, at: recomputed.append(at.size) or exact(e, a, at))
    folded: list[bool] = []
    fold = Screen.fold
    monkeypatch.setattr(Screen, "fold", lambda *args: folded.append(fold(*args)) or folded[-1])
    screened = diff_arrays(e, a, tolerance, expected_dtype="F32", actual_dtype="F32")
    assert folded
    assert all(folded)
    assert sum(recomputed) < e.size // 1000
    assert dataclasses.replace(screened, cosine=0.0) == dataclasses.replace(
        _float64_only(monkeypatch, e, a, tolerance), cosine=0.0
    )


@pytest.mark.parametrize("share", [0.001, 0.2], ids=["one in a thousand", "a fifth"])
def test_infinities_the_port_matches_are_screened(monkeypatch: pytest.MonkeyPatch, share: float) -> None:
    """Attention scores masked with -inf on both sides, near values elsewhere: every chunk is screened (a single
    infinity once sent its whole chunk to the float64 fold's slow non-finite path), with the float64 figures; an
    infinity the port moved, or a NaN, still leaves its chunk to the float64 fold."""
    tolerance = Tolerance(1e-5, 1e-5)
    rng = np.random.default_rng(6)
    e = rng.standard_normal(200_000).astype(np.float32)
    a = (e * (1 + 1e-7 * rng.standard_normal(e.size))).astype(np.float32)
    masked = rng.random(e.size) < share
    e[masked] = a[masked] = -np.inf
    folded: list[bool] = []
    fold = Screen.fold
    monkeypatch.setattr(Screen, "fold", lambda *args: folded.append(fold(*args)) or folded[-1])
    screened = diff_arrays(e, a, tolerance, expected_dtype="F32", actual_dtype="F32")
    assert len(folded) >= 4  # a chunk with infinities is folded again without them: two calls
    assert all(folded)
    assert screened.match
    assert dataclasses.replace(screened, cosine=0.0) == dataclasses.replace(
        _float64_only(monkeypatch, e, a, tolerance), cosine=0.0
    )
    first = int(np.flatnonzero(masked)[0])
    for value in (np.float32(np.nan), np.float32(1.0)):
        changed = a.copy()
        changed[first] = value
        folded.clear()
        with np.errstate(all="ignore"):
            diff = diff_arrays(e, changed, tolerance, expected_dtype="F32", actual_dtype="F32")
        assert folded.count(False) == 1
        assert not diff.match
        assert dataclasses.replace(diff, cosine=0.0) == dataclasses.replace(
            _float64_only(monkeypatch, e, changed, tolerance), cosine=0.0
        )
