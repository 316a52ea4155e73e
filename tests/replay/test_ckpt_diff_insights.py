"""ckpt-diff's analysis on pairs built to show each pattern and each insight: what a user reads to learn where a
checkpoint changed, and which tensors need a look."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from parity_harness.replay import ckpt_diff
from parity_harness.replay.ckpt_diff.analysis import Analysis, spearman
from parity_harness.replay.ckpt_diff.compare import CheckpointDiff

LAYERS = 8


def gpt2_like(seed: int = 0) -> dict[str, np.ndarray]:
    """GPT-2's naming with weights, zero-initialised biases and LayerNorm weights at one."""
    generator = np.random.default_rng(seed)
    tensors = {"transformer.wte.weight": generator.standard_normal((64, 16), dtype=np.float32)}
    for layer in range(LAYERS):
        prefix = f"transformer.h.{layer}"
        tensors[f"{prefix}.ln_1.weight"] = np.ones(16, dtype=np.float32)
        tensors[f"{prefix}.attn.c_attn.weight"] = generator.standard_normal((16, 48), dtype=np.float32)
        tensors[f"{prefix}.attn.c_attn.bias"] = np.zeros(48, dtype=np.float32)
        tensors[f"{prefix}.mlp.c_fc.weight"] = generator.standard_normal((16, 64), dtype=np.float32)
        tensors[f"{prefix}.mlp.c_fc.bias"] = np.zeros(64, dtype=np.float32)
    return tensors


def moved(tensors: dict[str, np.ndarray], scale_of_layer: object, seed: int = 1) -> dict[str, np.ndarray]:
    """Every tensor of every layer moved by noise of ``scale_of_layer(layer)`` times its own typical size."""
    generator = np.random.default_rng(seed)
    result = {}
    for name, array in tensors.items():
        layer = int(name.split(".")[2]) if ".h." in name else 0
        size = float(np.abs(array).mean()) or 1.0
        noise = generator.standard_normal(array.shape).astype(np.float32)
        result[name] = array + np.float32(scale_of_layer(layer) * size) * noise  # type: ignore[operator]
    return result


def analysed(tmp_path: Path, a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> tuple[CheckpointDiff, Analysis]:
    """Save both as .npz and diff them through the public API."""
    np.savez(tmp_path / "a.npz", **a)
    np.savez(tmp_path / "b.npz", **b)
    result = ckpt_diff.diff(tmp_path / "a.npz", tmp_path / "b.npz")
    return result, ckpt_diff.analyse(result)


def patterns(analysis: Analysis) -> dict[str, str]:
    """Pattern name -> its scope."""
    return {p.name: p.scope for p in analysis.patterns}


@pytest.mark.parametrize(
    ("scale", "expected", "absent"),
    [
        (lambda layer: 0.1 / (1 + layer), "gradient", "inverse gradient"),
        (lambda layer: 0.01 * (1 + layer), "inverse gradient", "gradient"),
        (lambda layer: 0.01, "flat depth profile", "gradient"),
    ],
    ids=["earlier-layers-more", "later-layers-more", "same-everywhere"],
)
def test_depth_patterns_follow_their_definitions(tmp_path: Path, scale: object, expected: str, absent: str) -> None:
    """gradient = earlier layers changed more, inverse gradient = later layers more, named with their stack, on a
    GPT-2-shaped pair whose zero biases and unit LayerNorm weights would hide a per-tensor trend."""
    _, analysis = analysed(tmp_path, gpt2_like(), moved(gpt2_like(), scale))
    found = patterns(analysis)
    assert found.get(expected) == "transformer.h"
    assert absent not in found
    pattern = next(p for p in analysis.patterns if p.name == expected)
    assert f"{LAYERS} depths (0..{LAYERS - 1})" in pattern.evidence
    depths = [d for d in analysis.depths if d.stack == "transformer.h"]
    assert [d.depth for d in depths] == list(range(LAYERS))


def test_spearman_is_rank_correlation() -> None:
    """Monotone but curved profiles correlate fully; ties share ranks; a constant profile has no correlation."""
    assert spearman([0, 1, 2, 3], [1, 4, 9, 100]) == pytest.approx(1.0)
    assert spearman([0, 1, 2, 3], [5, 3, 2, 1]) == pytest.approx(-1.0)
    assert spearman([0, 1, 2], [1, 1, 2]) == pytest.approx(np.corrcoef([0, 1, 2], [0.5, 0.5, 2])[0, 1])
    assert np.isnan(spearman([0, 1, 2], [3, 3, 3]))


def test_a_row_permutation_is_a_critical_low_cosine(tmp_path: Path) -> None:
    """Rows shuffled keep mean and std (a statistics-only diff sees nothing) but cosine drops: a critical insight
    naming the tensor, listed before any warning or info."""
    a = gpt2_like()
    b = {k: v.copy() for k, v in a.items()}
    b["transformer.h.3.attn.c_attn.weight"] = a["transformer.h.3.attn.c_attn.weight"][::-1].copy()
    b["transformer.h.5.mlp.c_fc.weight"] = a["transformer.h.5.mlp.c_fc.weight"] * 0.7 + 0.7 * np.random.default_rng(
        9
    ).standard_normal((16, 64)).astype(np.float32)
    result, analysis = analysed(tmp_path, a, b)
    permuted = next(c for c in result.tensors if c.name == "transformer.h.3.attn.c_attn.weight")
    assert permuted.stats_a is not None
    assert permuted.stats_b is not None
    assert permuted.stats_a.mean == pytest.approx(permuted.stats_b.mean)
    assert permuted.cosine < 0.5
    severities = [i.severity for i in analysis.insights]
    assert severities == sorted(severities, key=["critical", "warning", "info"].index)
    critical = next(i for i in analysis.insights if i.kind == "low_cosine" and i.severity == "critical")
    assert critical.tensors == ("transformer.h.3.attn.c_attn.weight",)
    warning = next(i for i in analysis.insights if i.kind == "low_cosine" and i.severity == "warning")
    assert warning.tensors == ("transformer.h.5.mlp.c_fc.weight",)


def test_zero_started_tensors_have_a_defined_change_and_do_not_fill_the_largest(tmp_path: Path) -> None:
    """A bias that starts at zero: relative change 1 (measured against B), flagged, said in an info insight, and
    left out of the largest relative changes, which name only tensors that moved."""
    a = gpt2_like()
    b = {k: v.copy() for k, v in a.items()}
    for layer in range(LAYERS):
        b[f"transformer.h.{layer}.attn.c_attn.bias"] += np.float32(1e-4)
    b["transformer.h.2.mlp.c_fc.weight"] *= np.float32(1.01)
    result, analysis = analysed(tmp_path, a, b)
    bias = next(c for c in result.tensors if c.name == "transformer.h.0.attn.c_attn.bias")
    assert bias.started_at_zero
    assert bias.relative_change == 1.0
    assert [c.name for c in analysis.largest] == ["transformer.h.2.mlp.c_fc.weight"]
    zero = next(i for i in analysis.insights if i.kind == "started_at_zero")
    assert len(zero.tensors) == LAYERS
    by_l2 = ckpt_diff.analyse(result, sort_by="l2")
    assert all(c.l2 > 0 for c in by_l2.largest)
    assert len(by_l2.largest) == LAYERS + 1


def test_nan_that_appears_is_critical_and_nan_on_both_sides_a_warning(tmp_path: Path) -> None:
    """NaN new in B: critical; NaN already in A: warning; each names its tensors."""
    a = gpt2_like()
    a["transformer.h.1.mlp.c_fc.weight"][0, 0] = np.nan
    b = {k: v.copy() for k, v in a.items()}
    b["transformer.h.4.attn.c_attn.weight"][2, 3] = np.inf
    _, analysis = analysed(tmp_path, a, b)
    insights = {(i.kind, i.severity): i.tensors for i in analysis.insights}
    assert insights[("nonfinite_appeared", "critical")] == ("transformer.h.4.attn.c_attn.weight",)
    assert insights[("nonfinite", "warning")] == ("transformer.h.1.mlp.c_fc.weight",)


def test_frozen_tensors_and_frozen_layer_types_are_named(tmp_path: Path) -> None:
    """Unchanged tensors while others moved are frozen (info); a layer type with every tensor frozen is said."""
    a = gpt2_like()
    b = moved(a, lambda layer: 0.01)
    for name in a:
        if "ln_" in name:
            b[name] = a[name].copy()
    _, analysis = analysed(tmp_path, a, b)
    frozen = next(i for i in analysis.insights if i.kind == "frozen")
    assert frozen.severity == "info"
    assert set(frozen.tensors) == {f"transformer.h.{layer}.ln_1.weight" for layer in range(LAYERS)}
    assert frozen.message.endswith("layer types frozen whole: norm")


def test_a_layer_type_is_heavy_only_beyond_its_share_of_the_weights(tmp_path: Path) -> None:
    """attention-heavy when attention alone moved; no -heavy pattern when every type moved alike."""
    a = gpt2_like()
    b = {k: (v * np.float32(1.05) if "attn" in k else v.copy()) for k, v in a.items()}
    assert "attention-heavy" in patterns(analysed(tmp_path, a, b)[1])
    even = {k: v * np.float32(1.05) for k, v in a.items()}
    assert not [p for p in patterns(analysed(tmp_path, a, even)[1]) if p.endswith("-heavy")]


def test_sparse_and_focused_changes(tmp_path: Path) -> None:
    """A few changed tensors is sparse; one tensor carrying almost all the change among many is focused."""
    a = gpt2_like()
    b = {k: v.copy() for k, v in a.items()}
    b["transformer.wte.weight"] = b["transformer.wte.weight"] * np.float32(3.0)
    for layer in range(LAYERS):
        b[f"transformer.h.{layer}.attn.c_attn.weight"] *= np.float32(1.0001)
        b[f"transformer.h.{layer}.mlp.c_fc.weight"] *= np.float32(1.0001)
    found = patterns(analysed(tmp_path, a, b)[1])
    assert "focused" in found
    only_one = {k: v.copy() for k, v in a.items()}
    only_one["transformer.wte.weight"] = only_one["transformer.wte.weight"] + np.float32(0.1)
    assert "sparse" in patterns(analysed(tmp_path, a, only_one)[1])


def test_structure_changes_are_warnings_and_a_cast_is_info(tmp_path: Path) -> None:
    """Removed, added and reshaped tensors are warnings; a dtype change with equal values is info and EQUAL."""
    a = {"w": np.arange(6, dtype=np.float32), "old": np.ones(2, np.float32), "shape": np.ones((2, 3), np.float32)}
    b = {"w": np.arange(6, dtype=np.float64), "new": np.ones(2, np.float32), "shape": np.ones((3, 2), np.float32)}
    result, analysis = analysed(tmp_path, a, b)
    kinds = {i.kind: i for i in analysis.insights}
    assert kinds["removed"].severity == kinds["added"].severity == kinds["shape_changed"].severity == "warning"
    assert kinds["dtype_changed"].severity == "info"
    cast_only = analysed(tmp_path, {"w": a["w"]}, {"w": b["w"]})[0]
    assert cast_only.equal
    assert cast_only.tensors[0].dtype_changed
    assert not result.equal


def test_the_python_api_describes_one_checkpoint_and_a_diff(tmp_path: Path) -> None:
    """load() gives names, parameter count, bytes, layer names, per-tensor statistics and values without reading
    the rest; diff() gives per-tensor records and a summary with totals; render() every format."""
    a = gpt2_like()
    np.savez(tmp_path / "a.npz", **a)
    with ckpt_diff.load(tmp_path / "a.npz") as checkpoint:
        assert checkpoint.kind == "npz"
        assert checkpoint.names == list(a)
        assert checkpoint.parameter_count == sum(v.size for v in a.values())
        assert checkpoint.nbytes == sum(v.nbytes for v in a.values())
        assert checkpoint.layer_names()[:3] == [
            "transformer.wte",
            "transformer.h.0.ln_1",
            "transformer.h.0.attn.c_attn",
        ]
        stats = checkpoint.statistics("transformer.wte.weight")
        assert stats.mean == pytest.approx(float(a["transformer.wte.weight"].astype(np.float64).mean()), rel=1e-6)
        assert stats.std == pytest.approx(float(a["transformer.wte.weight"].astype(np.float64).std()), rel=1e-6)
        assert np.array_equal(checkpoint.array("transformer.h.1.mlp.c_fc.weight"), a["transformer.h.1.mlp.c_fc.weight"])
    result, analysis = analysed(tmp_path, a, moved(a, lambda layer: 0.01))
    summary = result.summary()
    assert summary["counts"] == {"changed": len(a), "unchanged": 0, "added": 0, "removed": 0, "shape_changed": 0}
    assert summary["totals"]["parameters"] == {
        "a": checkpoint.parameter_count,
        "b": checkpoint.parameter_count,
        "delta": 0,
    }  # type: ignore[index]
    for output_format in ("text", "markdown", "json", "yaml", "csv", "html"):
        assert "transformer.h.0.mlp.c_fc.weight" in ckpt_diff.render(result, output_format, analysis=analysis)
    with pytest.raises(ValueError, match="unknown report format 'pdf'"):
        ckpt_diff.render(result, "pdf")
