"""ckpt-diff's torch-free readers and streamed metrics: every metric against a float64 recomputation, every
supported layout loaded, torch never imported for safetensors/NumPy files, hostile files refused in one line,
and memory bounded by blocks, not tensors."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import struct
import subprocess
import sys
import textwrap
import time
import warnings
from collections.abc import Callable
from fractions import Fraction
from pathlib import Path
from typing import Any, Final

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from safetensors.numpy import save_file as save_numpy
from safetensors.torch import save_file as save_torch

from parity_harness.capture.models.checkpoints import load_torch_object
from parity_harness.common.errors import CheckpointError
from parity_harness.replay import ckpt_diff
from parity_harness.replay.ckpt_diff.compare import TensorChange, diff_sources
from parity_harness.replay.ckpt_diff.kinds import open_source
from parity_harness.replay.ckpt_diff.metrics import BLOCK_ELEMENTS
from parity_harness.replay.cli.ckpt_diff import main
from parity_harness.replay.cli.train_diff import main as train_diff_main
from tests.cli_helpers import one_error_line

N: Final = 400_000
"""Six full 65536-element blocks and a partial seventh."""
assert N > 6 * BLOCK_ELEMENTS
NAN, INF = math.nan, math.inf
PLANTED: Final[dict[str, list[tuple[int, float, float]]]] = {
    # (index, A, B): blocks 0, 2, 4 and 6 take the careful path, blocks 1, 3 and 5 stay on the fast one.
    "matched": [(10, NAN, NAN), (140_000, INF, INF), (270_000, -INF, -INF), (399_990, NAN, NAN)],
    "mismatched": [
        (10, NAN, NAN),
        (20, NAN, 1.5),
        (140_000, INF, INF),
        (140_010, 2.0, NAN),
        (270_000, -INF, -INF),
        (270_010, INF, -INF),
        (399_000, -INF, 0.5),
        (399_001, 3.0, INF),
    ],
    # float32 overflows (B-A and the squares) in blocks 1 and 3: those blocks are redone in float64.
    "overflow": [(70_000, 3e38, -3e38), (200_000, 1e30, 1e30), (200_001, 1e30, -1e30)],
}
EXACT_TOLERANCE: Final = 1e-9
FLOAT32_TOLERANCE: Final = 1e-4
"""16/32-bit pairs are summed in float32 within a 65536-element block (then in float64 across blocks): rounding
grows like sqrt(65536) * 2**-24 ~ 1.5e-5 relative for random-signed errors; 1e-4 leaves room for BLAS's order."""
COSINE_ULP: Final = 2.0**-53
"""Spacing of float64 just below 1: ``1 - cosine`` read off a float64 cosine cannot be closer than half of it."""


# ------------------------------------------------------------------ writing files


def _save(path: Path, tensors: dict[str, np.ndarray], tag: str, metadata: dict[str, str] | None = None) -> Path:
    """Write float64/int64 arrays as safetensors in dtype ``tag`` (bf16 through torch, the rest through NumPy)."""
    if tag == "BF16":
        save_torch({k: torch.from_numpy(v).to(torch.bfloat16) for k, v in tensors.items()}, str(path), metadata)
    else:
        dtype = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I64": np.int64}[tag]
        save_numpy({k: v.astype(dtype) for k, v in tensors.items()}, str(path), metadata)
    return path


def _stored(values: np.ndarray, tag: str) -> np.ndarray:
    """The values a file of dtype ``tag`` holds, exactly, as float64."""
    if tag == "BF16":
        return torch.from_numpy(values).to(torch.bfloat16).float().numpy().astype(np.float64)
    dtype = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I64": np.int64}[tag]
    with np.errstate(over="ignore"):
        return values.astype(dtype).astype(np.float64)


def _pair(tag: str, variant: str, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Seeded A and B (30% of B's elements moved), with ``variant``'s non-finite or huge values planted."""
    rng = np.random.default_rng(seed)
    moved = rng.random(N) < 0.3
    if tag == "I64":
        a = rng.integers(-1000, 1000, N)
        b = a.copy()
        b[moved] += rng.integers(1, 5, int(moved.sum()))
        return a, b
    a = rng.standard_normal(N)
    b = a.copy()
    b[moved] += 0.05 * rng.standard_normal(int(moved.sum()))
    for index, value_a, value_b in PLANTED.get(variant, []):
        a[index], b[index] = value_a, value_b
    return a, b


def _safetensors_raw(path: Path, header: dict[str, Any], data: bytes) -> Path:
    """A safetensors file with exactly this header and data (no validation: for crafted files)."""
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path


# ------------------------------------------------------------------ float64 reference


def _expected_stats(x: np.ndarray) -> dict[str, float]:
    """Statistics over the finite elements; NaN and infinities counted apart."""
    values = x[np.isfinite(x)]
    return {
        "mean": float(values.mean()),
        "std": float(values.std()),
        "min": float(values.min()),
        "max": float(values.max()),
        "norm": float(np.sqrt(values @ values)),
        "nan": int(np.isnan(x).sum()),
        "inf": int(np.isinf(x).sum()),
    }


def _expected_change(a: np.ndarray, b: np.ndarray, epsilon: float) -> dict[str, float]:
    """Distances as compare.py/metrics.py define them, in float64."""
    with np.errstate(invalid="ignore", over="ignore"):
        same = (a == b) | (np.isnan(a) & np.isnan(b))
        delta = np.where(same, 0.0, b - a)
    finite = np.isfinite(delta)
    magnitude = np.abs(delta[finite])
    nonfinite = int(delta.size - finite.sum())
    l2 = math.inf if nonfinite else float(np.sqrt(magnitude @ magnitude))
    both = np.isfinite(a) & np.isfinite(b)
    xa, xb = a[both], b[both]
    differing = nonfinite + int(np.count_nonzero(magnitude > epsilon))
    return {
        "l1": float(magnitude.sum()),
        "l2": l2,
        "max_abs": math.inf if nonfinite else float(magnitude.max()),
        "mean_abs": float(magnitude.sum() / finite.sum()),
        "cosine": float(xa @ xb / (np.linalg.norm(xa) * np.linalg.norm(xb))),
        "relative_change": l2 / _expected_stats(a)["norm"],
        "elements_changed": differing,
        "fraction_changed": differing / a.size,
    }


def _stats_mismatches(side: str, got: object, x: np.ndarray, rel: float) -> list[str]:
    """Every statistic of ``got`` (a TensorStats) that differs from the float64 recomputation."""
    wrong = []
    expected = _expected_stats(x)
    scale = float(np.abs(x[np.isfinite(x)]).mean())
    for key, value in expected.items():
        actual = getattr(got, key)
        if key in ("min", "max", "nan", "inf"):
            ok = actual == value
        elif key == "mean":  # a sum near zero: its rounding is relative to the sum of magnitudes
            ok = actual == pytest.approx(value, rel=rel, abs=rel * scale)
        else:
            ok = actual == pytest.approx(value, rel=rel)
        if not ok:
            wrong.append(f"stats_{side}.{key}: got {actual!r}, expected {value!r}")
    return wrong


def _change_mismatches(change: TensorChange, a: np.ndarray, b: np.ndarray, epsilon: float, rel: float) -> list[str]:
    """Every metric of ``change`` that differs from the float64 recomputation (all listed, not the first)."""
    wrong = _stats_mismatches("a", change.stats_a, a, rel) + _stats_mismatches("b", change.stats_b, b, rel)
    for key, value in _expected_change(a, b, epsilon).items():
        actual = getattr(change, key)
        if key in ("elements_changed", "fraction_changed"):
            ok = actual == value
        elif key == "max_abs":  # one rounding of B-A to the compute precision
            ok = actual == pytest.approx(value, rel=max(rel * 1e-2, 1e-12))
        elif key == "cosine":
            ok = actual == pytest.approx(value, abs=rel)
        else:
            ok = actual == pytest.approx(value, rel=rel)
        if not ok:
            wrong.append(f"{key}: got {actual!r}, expected {value!r}")
    return wrong


# ------------------------------------------------------------------ 1. metrics


METRIC_CASES: Final = [
    ("F32", "clean"),
    ("F32", "matched"),
    ("F32", "mismatched"),
    ("F32", "overflow"),
    ("F16", "clean"),
    ("F16", "mismatched"),
    ("BF16", "clean"),
    ("BF16", "mismatched"),
    ("F64", "clean"),
    ("F64", "matched"),
    ("F64", "mismatched"),
    ("I64", "clean"),
]


@pytest.mark.parametrize(("tag", "variant"), METRIC_CASES, ids=[f"{t}-{v}" for t, v in METRIC_CASES])
def test_every_metric_matches_a_float64_recomputation(tmp_path: Path, tag: str, variant: str) -> None:
    """Statistics, distances, cosine and counts equal a float64 NumPy recomputation, NaN and infinities included."""
    a_values, b_values = _pair(tag, variant)
    path_a = _save(tmp_path / "a.safetensors", {"w": a_values, "only_a": a_values}, tag)
    path_b = _save(tmp_path / "b.safetensors", {"w": b_values}, tag)
    a, b = _stored(a_values, tag), _stored(b_values, tag)
    rel = EXACT_TOLERANCE if tag in ("F64", "I64") else FLOAT32_TOLERANCE
    epsilon = 2.5 if tag == "I64" else 0.02
    for eps in (0.0, epsilon):
        result = ckpt_diff.diff(path_a, path_b, epsilon=eps)
        changes = {change.name: change for change in result.tensors}
        assert changes["w"].status == "changed"
        assert changes["only_a"].status == "removed"
        wrong = _change_mismatches(changes["w"], a, b, eps, rel)
        wrong += _stats_mismatches("only_a", changes["only_a"].stats_a, a, rel)
        assert not wrong, f"epsilon={eps}:\n" + "\n".join(wrong)
    with ckpt_diff.load(path_b) as loaded:
        assert not _stats_mismatches("loaded", loaded.statistics("w"), b, rel)
        np.testing.assert_array_equal(loaded.array("w").astype(np.float64), b)


@pytest.mark.parametrize("tag", ["F32", "F64"])
def test_layernorm_std_keeps_its_digits(tmp_path: Path, tag: str) -> None:
    """A LayerNorm-like weight (mean 1, std 1e-4) gets its standard deviation to 1e-6 relative, in diff and load."""
    rng = np.random.default_rng(1)
    a_values = 1.0 + 1e-4 * rng.standard_normal(N)
    b_values = a_values + 1e-5 * rng.standard_normal(N)
    path_a = _save(tmp_path / "a.safetensors", {"norm.weight": a_values}, tag)
    path_b = _save(tmp_path / "b.safetensors", {"norm.weight": b_values}, tag)
    a, b = _stored(a_values, tag), _stored(b_values, tag)
    change = ckpt_diff.diff(path_a, path_b).tensors[0]
    assert change.stats_a.std == pytest.approx(a.std(), rel=1e-6)
    assert change.stats_b.std == pytest.approx(b.std(), rel=1e-6)
    with ckpt_diff.load(path_a) as loaded:
        assert loaded.statistics("norm.weight").std == pytest.approx(a.std(), rel=1e-6)


def test_extreme_values_report_without_runtime_warnings(tmp_path: Path) -> None:
    """Float32 values whose difference or squares overflow, and +inf with -inf in one tensor, warn nothing on stderr."""
    a, b, only = np.ones(1000), np.ones(1000), np.ones(10)
    a[5], b[5] = -3e38, 3e38
    only[1], only[2] = INF, -INF
    _save(tmp_path / "a.safetensors", {"w": a, "only_a": only}, "F32")
    _save(tmp_path / "b.safetensors", {"w": b}, "F32")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = CliRunner().invoke(main, [str(tmp_path / "a.safetensors"), str(tmp_path / "b.safetensors")])
    assert result.exit_code == 1, result.output
    assert [f"{w.filename}:{w.lineno}: {w.message}" for w in caught] == []


def _one_minus_cosine(a: np.ndarray, b: np.ndarray) -> float:
    """``1 - cos`` in float64 without cancellation: ``(|d|^2 - (|A|-|B|)^2) / (2|A||B|)`` with
    ``|A|-|B| = -d.(A+B) / (|A|+|B|)``."""
    d, s = b - a, a + b
    norm_a, norm_b = np.linalg.norm(a), np.linalg.norm(b)
    return float((d @ d - (d @ s / (norm_a + norm_b)) ** 2) / (2 * norm_a * norm_b))


def _weights_plus_noise(rng: np.random.Generator, size: int) -> tuple[np.ndarray, np.ndarray]:
    """Weights and the same weights plus 1e-7 absolute noise."""
    a = rng.standard_normal(size)
    return a, a + 1e-7 * rng.standard_normal(size)


def _layernorm_times_noise(rng: np.random.Generator, size: int) -> tuple[np.ndarray, np.ndarray]:
    """A LayerNorm weight near 1 and the same weight scaled by 1 + 1e-6 noise."""
    a = 1 + 0.01 * rng.standard_normal(size)
    return a, a * (1 + 1e-6 * rng.standard_normal(size))


NEARLY_EQUAL: Final = {"weights+1e-7": _weights_plus_noise, "layernorm*(1+1e-6)": _layernorm_times_noise}


@pytest.mark.parametrize("case", list(NEARLY_EQUAL))
def test_cosine_of_nearly_equal_tensors_keeps_its_digits(tmp_path: Path, case: str) -> None:
    """For B = A + tiny noise (float32), 1 - cosine matches float64 to 1e-3 relative, within one float64 ulp."""
    wrong = []
    for size, seed in ((size, seed) for size in (300_000, N) for seed in range(4)):
        a_values, b_values = NEARLY_EQUAL[case](np.random.default_rng(seed), size)
        path_a = _save(tmp_path / "a.safetensors", {"w": a_values}, "F32")
        path_b = _save(tmp_path / "b.safetensors", {"w": b_values}, "F32")
        expected = _one_minus_cosine(_stored(a_values, "F32"), _stored(b_values, "F32"))
        got = 1.0 - ckpt_diff.diff(path_a, path_b).tensors[0].cosine
        # Sound: 1 - cos = (|d|^2 - (|A|-|B|)^2) / (2|A||B|) with |A|-|B| = -d.(A+B) / (|A|+|B|), the dot products
        # summed in float32 per block, carries ~1e-5 relative error (on these cases it stays within 0.4 of this
        # tolerance); 1e-3 is 100x that. A float64 cosine near 1 is spaced 2**-53: one such ulp is allowed on top.
        if abs(got - expected) > 1e-3 * expected + COSINE_ULP:
            error = (got - expected) / COSINE_ULP
            wrong.append(f"{size} elements, seed {seed}: 1-cos {got:.6g}, expected {expected:.6g} ({error:+.1f} ulp)")
    assert not wrong, "\n".join(wrong)


# ------------------------------------------------------------------ 2. loading


def test_npy_in_c_and_fortran_order_reads_the_same_values(tmp_path: Path) -> None:
    """An .npy in C or Fortran order loads as one tensor named 'array' with the same values; the two diff equal."""
    values = np.random.default_rng(2).standard_normal((700, 300)).astype(np.float32)
    np.save(tmp_path / "c.npy", np.ascontiguousarray(values))
    np.save(tmp_path / "f.npy", np.asfortranarray(values))
    for name in ("c.npy", "f.npy"):
        with ckpt_diff.load(tmp_path / name) as loaded:
            assert (loaded.kind, loaded.names, loaded.parameter_count) == ("npy", ["array"], values.size)
            np.testing.assert_array_equal(loaded.array("array"), values)
            assert loaded.statistics("array").max == float(values.max())
    result = ckpt_diff.diff(tmp_path / "c.npy", tmp_path / "f.npy")
    assert result.equal
    assert result.tensors[0].elements_changed == 0


def test_npz_compressed_and_stored_members_read_the_same_values(tmp_path: Path) -> None:
    """np.savez and np.savez_compressed archives load the same tensors; the two diff equal, a change is measured."""
    rng = np.random.default_rng(3)
    arrays = {"big": rng.standard_normal(300_000).astype(np.float32), "idx": np.arange(10, dtype=np.int64)}
    np.savez(tmp_path / "stored.npz", **arrays)
    np.savez_compressed(tmp_path / "packed.npz", **arrays)
    for name in ("stored.npz", "packed.npz"):
        with ckpt_diff.load(tmp_path / name) as loaded:
            assert (loaded.kind, sorted(loaded.names)) == ("npz", ["big", "idx"])
            for member, values in arrays.items():
                np.testing.assert_array_equal(loaded.array(member), values)
    assert CliRunner().invoke(main, [str(tmp_path / "stored.npz"), str(tmp_path / "packed.npz")]).exit_code == 0
    moved = dict(arrays, big=arrays["big"] + np.float32(0.5))
    np.savez_compressed(tmp_path / "moved.npz", **moved)
    change = next(t for t in ckpt_diff.diff(tmp_path / "stored.npz", tmp_path / "moved.npz").tensors if t.name == "big")
    assert change.l2 == pytest.approx(np.linalg.norm(moved["big"].astype(np.float64) - arrays["big"]), rel=1e-5)


def test_nested_torch_dicts_are_named_by_dotted_paths(tmp_path: Path) -> None:
    """A torch.save of nested dicts names each tensor by its path: {'encoder': {'layer': {'weight': t}}}."""
    weight = torch.randn(4, 3, generator=torch.Generator().manual_seed(4))
    torch.save({"encoder": {"layer": {"weight": weight, "bias": torch.zeros(4)}}}, tmp_path / "nested.pt")
    with ckpt_diff.load(tmp_path / "nested.pt") as loaded:
        assert loaded.kind == "torch"
        assert loaded.names == ["encoder.layer.weight", "encoder.layer.bias"]
        assert loaded.layer_names() == ["encoder.layer"]
        np.testing.assert_array_equal(loaded.array("encoder.layer.weight"), weight.numpy())


def test_dataparallel_prefix_is_taken_off_and_noted(tmp_path: Path) -> None:
    """A 'module.'-prefixed state dict diffs equal to the unprefixed one, and its side says the prefix was removed."""
    state = {"fc.weight": torch.randn(5, 5, generator=torch.Generator().manual_seed(5)), "fc.bias": torch.ones(5)}
    torch.save(state, tmp_path / "plain.pt")
    torch.save({f"module.{k}": v for k, v in state.items()}, tmp_path / "wrapped.pt")
    result = ckpt_diff.diff(tmp_path / "plain.pt", tmp_path / "wrapped.pt")
    assert result.equal
    assert [t.name for t in result.tensors] == ["fc.bias", "fc.weight"]
    assert any("'module.'" in note for note in result.b.notes), result.b.notes
    assert not result.a.notes


def _lightning(epoch: int) -> dict[str, object]:
    """A Lightning-style training checkpoint (same weights whatever the epoch)."""
    generator = torch.Generator().manual_seed(6)
    weight = torch.randn(3, 3, generator=generator)
    optimizer = {
        "state": {0: {"exp_avg": torch.zeros(3, 3), "step": torch.tensor(100.0)}},
        "param_groups": [{"lr": 0.1}],
    }
    return {
        "state_dict": {"model.fc.weight": weight},
        "epoch": epoch,
        "global_step": 100,
        "optimizer_states": [optimizer],
        "lr": 0.1,
    }


def test_training_checkpoints_compare_their_other_values(tmp_path: Path) -> None:
    """Equal weights but another epoch: not equal, exit 1, with 'epoch' listed as changed from 3 to 4."""
    torch.save(_lightning(3), tmp_path / "e3.ckpt")
    torch.save(_lightning(4), tmp_path / "e4.ckpt")
    result = ckpt_diff.diff(tmp_path / "e3.ckpt", tmp_path / "e4.ckpt")
    assert all(t.status == "unchanged" for t in result.tensors)
    assert "model.fc.weight" in {t.name for t in result.tensors}
    assert not result.equal
    entries = {e.name: e for e in result.entries}
    assert (entries["epoch"].status, entries["epoch"].value_a, entries["epoch"].value_b) == ("changed", 3, 4)
    assert entries["global_step"].status == entries["lr"].status == "unchanged"
    report = tmp_path / "report.json"
    cli = [str(tmp_path / "e3.ckpt"), str(tmp_path / "e4.ckpt"), "--format", "json", "--out", str(report)]
    assert CliRunner().invoke(main, cli).exit_code == 1
    assert {"name": "epoch", "status": "changed", "a": 3, "b": 4} in json.loads(report.read_text())["entries"]


def test_safetensors_metadata_is_compared_as_entries(tmp_path: Path) -> None:
    """Safetensors __metadata__ strings are entries: same tensors with another 'step' is not equal."""
    tensors = {"w": np.arange(6, dtype=np.float64)}
    _save(tmp_path / "a.safetensors", tensors, "F32", {"format": "pt", "step": "1"})
    _save(tmp_path / "b.safetensors", tensors, "F32", {"format": "pt", "step": "2"})
    result = ckpt_diff.diff(tmp_path / "a.safetensors", tmp_path / "b.safetensors")
    assert result.tensors[0].status == "unchanged"
    assert not result.equal
    entries = {e.name: (e.status, e.value_a, e.value_b) for e in result.entries}
    assert entries == {"__metadata__.step": ("changed", "1", "2")}  # format, the container marker, is not compared


def test_sharded_huggingface_folder_reads_like_one_file(tmp_path: Path) -> None:
    """A config.json folder of safetensors shards and an index loads every shard's tensors, equal to one file."""
    rng = np.random.default_rng(7)
    shards = [
        {"embed.weight": rng.standard_normal((100, 8)), "layers.0.weight": rng.standard_normal((8, 8))},
        {"layers.1.weight": rng.standard_normal((8, 8)), "head.weight": rng.standard_normal((4, 8))},
    ]
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "toy"}))
    weight_map = {}
    for number, shard in enumerate(shards, start=1):
        name = f"model-{number:05d}-of-00002.safetensors"
        _save(folder / name, shard, "F32", {"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    _save(tmp_path / "single.safetensors", {**shards[0], **shards[1]}, "F32", {"format": "pt"})
    with ckpt_diff.load(folder) as loaded:
        assert loaded.kind == "huggingface"
        assert sorted(loaded.names) == sorted(weight_map)
        np.testing.assert_array_equal(loaded.array("head.weight"), shards[1]["head.weight"].astype(np.float32))
    result = ckpt_diff.diff(folder, tmp_path / "single.safetensors")
    assert result.equal
    assert result.counts()["unchanged"] == 4


@dataclasses.dataclass
class _Hyperparameters:
    """A user's own class: unpickling it imports and calls code."""

    lr: float


def test_pickle_that_runs_code_is_refused_without_trust_pickle(tmp_path: Path) -> None:
    """A checkpoint holding a custom object is exit 2 naming --trust-pickle; with --trust-pickle it is compared."""
    path = tmp_path / "custom.pt"
    torch.save({"w": torch.ones(3), "hparams": _Hyperparameters(0.1), "ratio": Fraction(1, 3)}, path)
    line = one_error_line("ckpt-diff", CliRunner().invoke(main, [str(path), str(path)]))
    assert "--trust-pickle" in line
    assert "running code" in line
    with pytest.raises(CheckpointError, match="trust-pickle"):
        ckpt_diff.load(path)
    trusted = CliRunner().invoke(main, [str(path), str(path), "--trust-pickle"])
    assert trusted.exit_code == 0, trusted.output


def test_torch_files_are_loaded_with_weights_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without --trust-pickle, torch.load is called with weights_only=True (no code runs from the file)."""
    calls: list[dict[str, object]] = []
    real_load = torch.load

    def spy(*args: Any, **kwargs: Any) -> Any:
        calls.append(kwargs)
        return real_load(*args, **kwargs)

    monkeypatch.setattr(torch, "load", spy)
    torch.save({"w": torch.ones(2)}, tmp_path / "plain.pt")
    with ckpt_diff.load(tmp_path / "plain.pt") as loaded:
        assert loaded.names == ["w"]
    assert calls
    assert all(call.get("weights_only") is True for call in calls), calls


# ------------------------------------------------------------------ 3. torch-free


CHILD_IMPORTS: Final = textwrap.dedent(
    """
    import json, sys
    from parity_harness.replay.cli.ckpt_diff import main
    try:
        code = main(sys.argv[1:], standalone_mode=False)
    except SystemExit as stop:
        code = stop.code
    print(json.dumps({"code": code, "torch": "torch" in sys.modules, "h5py": "h5py" in sys.modules}))
    """
)


def _write_plain(tmp_path: Path, kind: str) -> tuple[Path, Path]:
    """Two files of ``kind`` (safetensors through NumPy, npz, npy) that differ in one element."""
    a = np.random.default_rng(8).standard_normal(1000).astype(np.float32)
    b = a.copy()
    b[7] += 1
    paths = (tmp_path / f"a.{kind}", tmp_path / f"b.{kind}")
    for path, values in zip(paths, (a, b), strict=True):
        if kind == "safetensors":
            save_numpy({"w": values}, str(path))
        elif kind == "npz":
            np.savez(path, w=values)
        else:
            np.save(path, values)
    return paths


@pytest.mark.parametrize("kind", ["safetensors", "npz", "npy"])
def test_cli_imports_neither_torch_nor_h5py_for_plain_files(tmp_path: Path, kind: str) -> None:
    """ckpt-diff on safetensors, .npz or .npy files runs without importing torch or h5py."""
    path_a, path_b = _write_plain(tmp_path, kind)
    report = tmp_path / "report.json"
    argv = [str(path_a), str(path_b), "--format", "json", "--out", str(report)]
    done = subprocess.run(
        [sys.executable, "-c", CHILD_IMPORTS, *argv], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[-1]) == {"code": 1, "torch": False, "h5py": False}
    assert json.loads(report.read_text())["equal"] is False


# ------------------------------------------------------------------ 4. hostile files


def _offsets_past_end(tmp_path: Path) -> Path:
    header = {"w": {"dtype": "F32", "shape": [1000], "data_offsets": [0, 4000]}}
    return _safetensors_raw(tmp_path / "past_end.safetensors", header, b"\0" * 16)


def _npy_huge_shape(tmp_path: Path) -> Path:
    path = tmp_path / "huge.npy"
    with path.open("wb") as handle:
        header = {"descr": "<f4", "fortran_order": False, "shape": (10**9, 10**9)}
        np.lib.format.write_array_header_1_0(handle, header)
        handle.write(b"\0" * 64)
    return path


def _npz_pickled_objects(tmp_path: Path) -> Path:
    path = tmp_path / "objects.npz"
    np.savez(path, w=np.zeros(3, dtype=np.float32), objects=np.array([{"run": "os.system"}], dtype=object))
    return path


def _folder_without_config(tmp_path: Path) -> Path:
    folder = tmp_path / "no_config"
    folder.mkdir()
    save_numpy({"w": np.zeros(3, dtype=np.float32)}, str(folder / "model.safetensors"))
    return folder


def _nested(depth: int, key: str) -> Callable[[Path], Path]:
    def build(tmp_path: Path) -> Path:
        value: object = {"weight": torch.ones(2)}
        for _ in range(depth):
            value = {"inner": value}
        limit = sys.getrecursionlimit()
        sys.setrecursionlimit(max(limit, 20 * depth))  # torch.save itself recurses once per level
        try:
            torch.save({key: value}, tmp_path / "deep.pt")
        finally:
            sys.setrecursionlimit(limit)
        return tmp_path / "deep.pt"

    return build


def _many_entries(tmp_path: Path) -> Path:
    torch.save({"w": torch.ones(2), "values": [0] * 3_000_000}, tmp_path / "many.pt")
    return tmp_path / "many.pt"


HOSTILE: Final[list[Any]] = [
    pytest.param(_offsets_past_end, "damaged", id="safetensors-offsets-past-end"),
    pytest.param(_npy_huge_shape, "declares", id="npy-huge-shape"),
    pytest.param(_npz_pickled_objects, "pickle", id="npz-pickled-objects"),
    pytest.param(_folder_without_config, "config.json", id="folder-without-config"),
    pytest.param(_nested(100, "extra"), "nested deeper", id="nested-100-deep"),
    pytest.param(_nested(100, "state_dict"), "nested deeper", id="nested-100-deep-state-dict"),
    pytest.param(_nested(600, "state_dict"), "nested deeper", id="nested-600-deep-state-dict"),
    pytest.param(_many_entries, "more than", id="3M-entries", marks=pytest.mark.slow),
]


@pytest.mark.parametrize(("build", "expected"), HOSTILE)
def test_hostile_file_is_one_error_line(tmp_path: Path, build: Callable[[Path], Path], expected: str) -> None:
    """A crafted or damaged checkpoint is exit 2 with one 'ckpt-diff: error:' line saying what is wrong."""
    good = tmp_path / "good.safetensors"
    save_numpy({"w": np.zeros(3, dtype=np.float32)}, str(good))
    hostile = build(tmp_path)
    for argv in ([str(hostile), str(good)], [str(good), str(hostile)]):
        line = one_error_line("ckpt-diff", CliRunner().invoke(main, argv))
        assert expected in line, line
        assert "RecursionError" not in line


def test_file_truncated_after_opening_is_a_checkpoint_error(tmp_path: Path) -> None:
    """A safetensors file that shrinks between opening and reading is a CheckpointError saying 'truncated'."""
    values = np.random.default_rng(9).standard_normal(3 * BLOCK_ELEMENTS).astype(np.float32)
    save_numpy({"w": values}, str(tmp_path / "a.safetensors"))
    save_numpy({"w": values}, str(tmp_path / "b.safetensors"))
    with open_source(tmp_path / "a.safetensors") as source_a, open_source(tmp_path / "b.safetensors") as source_b:
        os.truncate(tmp_path / "b.safetensors", (tmp_path / "b.safetensors").stat().st_size - values.nbytes // 2)
        with pytest.raises(CheckpointError, match="truncated"):
            diff_sources(source_a, source_b)


SPECIAL_FILE_CHILD: Final = "import sys; from parity_harness.replay.cli.ckpt_diff import main; main(sys.argv[1:])"


@pytest.mark.parametrize("special", ["fifo", "dev-zero"])
def test_special_files_are_refused_without_reading(tmp_path: Path, special: str) -> None:
    """A FIFO (which would block) or /dev/zero (which never ends) is exit 2 in one line, promptly."""
    good = tmp_path / "good.safetensors"
    save_numpy({"w": np.zeros(3, dtype=np.float32)}, str(good))
    if special == "fifo":
        os.mkfifo(tmp_path / "pipe")
        argv = [str(good), str(tmp_path / "pipe")]
    else:
        argv = ["/dev/zero", str(good)]
    done = subprocess.run(
        [sys.executable, "-c", SPECIAL_FILE_CHILD, *argv], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 2, done.stderr
    assert done.stdout == ""
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("ckpt-diff: error: ")
    assert "not a regular file" in lines[0]


# ------------------------------------------------------------------ 5. bounded memory


BIG_ELEMENTS: Final = 100_000_000
CHUNK: Final = 1 << 22
MEMORY_CHILD: Final = textwrap.dedent(
    """
    import atexit, sys
    from parity_harness.replay.cli.ckpt_diff import main

    def peak() -> None:
        with open("/proc/self/status") as status:
            line = next(line for line in status if line.startswith("VmHWM:"))
        print(f"PEAK_KB {line.split()[1]}", file=sys.stderr)

    atexit.register(peak)
    main(sys.argv[1:])
    """
)


def _write_big(path: Path, seed: int, shift_every: int) -> None:
    """One 400 MB float32 tensor written chunk by chunk (never whole in memory); every ``shift_every``-th chunk
    shifted by 0.5 so that A and B differ in some blocks."""
    _safetensors_raw(path, {"w": {"dtype": "F32", "shape": [BIG_ELEMENTS], "data_offsets": [0, BIG_ELEMENTS * 4]}}, b"")
    rng = np.random.default_rng(seed)
    with path.open("ab") as handle:
        for number, first in enumerate(range(0, BIG_ELEMENTS, CHUNK)):
            chunk = rng.standard_normal(min(CHUNK, BIG_ELEMENTS - first), dtype=np.float32)
            if shift_every and number % shift_every == 0:
                chunk += np.float32(0.5)
            chunk.tofile(handle)


def test_diff_of_400_mb_tensors_stays_under_200_mb(tmp_path: Path) -> None:
    """Diffing two 400 MB single-tensor safetensors files keeps the process's peak RSS under 200 MB."""
    _write_big(tmp_path / "a.safetensors", seed=10, shift_every=0)
    _write_big(tmp_path / "b.safetensors", seed=10, shift_every=5)
    argv = [str(tmp_path / "a.safetensors"), str(tmp_path / "b.safetensors"), "--format", "json"]
    argv += ["--out", str(tmp_path / "report.json")]
    done = subprocess.run(
        [sys.executable, "-c", MEMORY_CHILD, *argv], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 1, done.stderr
    peak_kb = int(done.stderr.split("PEAK_KB")[-1].split()[0])
    assert peak_kb < 200 * 1024, f"peak RSS {peak_kb / 1024:.0f} MB"
    change = json.loads((tmp_path / "report.json").read_text())["tensors"][0]
    assert change["elements_changed"] == sum(
        min(CHUNK, BIG_ELEMENTS - first) for n, first in enumerate(range(0, BIG_ELEMENTS, CHUNK)) if n % 5 == 0
    )


@pytest.mark.parametrize(
    "view",
    [
        pytest.param(lambda: torch.zeros(1).expand(1 << 29), id="expanded"),
        pytest.param(lambda: torch.zeros(8).as_strided((1 << 26, 8), (0, 1)), id="overlapping-rows"),
    ],
)
def test_a_view_far_larger_than_its_storage_is_refused(tmp_path: Path, view: Callable[[], torch.Tensor]) -> None:
    """A 1.5 KB file holding ``zeros(1).expand(2**29)`` made ckpt-diff copy out 2 GiB per side; every loader of
    torch.save files refuses it now, in one line, before any copy."""
    path = tmp_path / "bomb.pt"
    torch.save({"w": view()}, path)
    line = one_error_line("ckpt-diff", CliRunner().invoke(main, [str(path), str(path)]))
    assert "(an expanded or overlapping view)" in line
    small = tmp_path / "mask.pt"  # a broadcast mask or position ids of ordinary size still loads
    torch.save({"position_ids": torch.arange(8).expand(1, -1), "mask": torch.ones(1).expand(64)}, small)
    assert CliRunner().invoke(main, [str(small), str(small)]).exit_code == 0


def _raw_safetensors(path: Path, header_json: str, data: bytes) -> Path:
    header = header_json.encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)
    return path


@pytest.mark.parametrize(
    ("header", "expected"),
    [
        pytest.param(
            '{"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},'
            ' "w": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}',
            "the key 'w' appears twice",
            id="duplicate-name",
        ),
        pytest.param(
            '{"w": {"dtype": "F32", "shape": [' + "9" * 5000 + '], "data_offsets": [0, 8]}}',
            "safetensors header is not JSON (ValueError",
            id="5000-digit-shape",
        ),
    ],
)
def test_a_safetensors_header_json_would_misread_is_refused(tmp_path: Path, header: str, expected: str) -> None:
    """json keeps the last of two equal keys: a header naming a tensor twice got a verdict about the second one's
    bytes (the safetensors library refuses it); a 5000-digit number reached the catch-all error line."""
    path = _raw_safetensors(tmp_path / "w.safetensors", header, struct.pack("<2f", 1.0, 2.0))
    line = one_error_line("ckpt-diff", CliRunner().invoke(main, [str(path), str(path)]))
    assert expected in line


def test_many_names_viewing_one_storage_are_refused(tmp_path: Path) -> None:
    """20,000 names viewing one 16 MiB storage made ckpt-diff compare 320 GiB (a hang from a 17 MB file); tied
    weights (a few names for one storage) still load."""
    shared = torch.zeros(1 << 18)  # 1 MiB
    torch.save({f"w{i}": shared for i in range(80)}, tmp_path / "aliases.pt")
    line = one_error_line("ckpt-diff", CliRunner().invoke(main, [str(tmp_path / "aliases.pt")] * 2))
    assert "more than 32 places holding the same tensor or list" in line
    torch.save({"embed.weight": shared, "head.weight": shared}, tmp_path / "tied.pt")
    assert CliRunner().invoke(main, [str(tmp_path / "tied.pt")] * 2).exit_code == 0


def test_a_view_is_checked_however_many_values_come_before_it(tmp_path: Path) -> None:
    """The check stopped after a million values: a list of 1.1 million ints saved beside ``zeros(1).expand(2**28)``
    hid the view, and ckpt-diff copied out 1 GiB per side from a 2 MB file."""
    path = tmp_path / "hidden.pt"
    torch.save({"w": torch.zeros(1).expand(1 << 28), "pad": [0] * 1_100_000}, path)
    line = one_error_line("ckpt-diff", CliRunner().invoke(main, [str(path), str(path)]))
    assert "(an expanded or overlapping view)" in line


def test_names_viewing_one_storage_are_counted_through_shared_lists(tmp_path: Path) -> None:
    """A pickle holds one list many times through its memo: 1000 references to a list of 7 names for one 1 MiB
    tensor are 7000 names to compare, counted as such though the list is walked once; a list inside itself (a
    cycle) adds nothing and still loads."""
    shared = torch.zeros(1 << 18)
    torch.save({"x": [[shared] * 7] * 1000}, tmp_path / "memo.pt")  # 7000 names: past 32 for one storage
    line = one_error_line("ckpt-diff", CliRunner().invoke(main, [str(tmp_path / "memo.pt")] * 2))
    assert "more than 32 places holding the same tensor or list" in line
    looped: list[object] = [torch.ones(3)]
    looped.append(looped)
    torch.save({"loop": looped}, tmp_path / "loop.pt")
    assert load_torch_object(tmp_path / "loop.pt", False)["loop"][1] is not None


def test_numbers_shown_many_times_through_shared_lists_are_refused(tmp_path: Path) -> None:
    """A 12 KB dump holding one list of 1000 numbers a thousand times, that list ten times, is ten million numbers:
    parity-train-diff walked them for 81 s (650 MB) and a hundred such lists never ended. Numbers count as tensors'
    bytes do, per place; a list held in a few places (param groups sharing a list) still loads."""
    numbers = [0.5] * 1000
    torch.save({"model_state_dict": {"w": torch.ones(2)}, "history": [[numbers] * 1000] * 10}, tmp_path / "a.pt")
    for program, cli in (("ckpt-diff", main), ("parity-train-diff", train_diff_main)):
        started = time.perf_counter()
        line = one_error_line(program, CliRunner().invoke(cli, [str(tmp_path / "a.pt")] * 2))
        assert "more than 32 places holding the same tensor or list" in line
        assert time.perf_counter() - started < 60  # refused before the walk, not after it
    torch.save({"model_state_dict": {"w": torch.ones(2)}, "groups": [numbers] * 4}, tmp_path / "shared.pt")
    assert CliRunner().invoke(train_diff_main, [str(tmp_path / "shared.pt")] * 2).exit_code == 0


@pytest.mark.parametrize("zipped", [True, False], ids=["zip", "legacy"])
def test_a_tuple_key_shown_many_times_is_refused_before_it_is_printed(tmp_path: Path, zipped: bool) -> None:
    """A tuple of references to a tuple of references... as a dict key: a few KB whose name as text is gigabytes
    (ckpt-diff: 47 s, 2.3 GB, then MemoryError). The pickle's keys are counted before torch loads it, in either of
    torch's formats; and what was loaded is walked, keys as values, before any reader prints a name."""
    key: tuple[object, ...] = ("x",)
    for _ in range(3):
        key = (key,) * 128  # 2 million values: past the 1 million a key may hold
    torch.save({"w": torch.ones(2), "extra": {key: 1.0}}, tmp_path / "a.pt", _use_new_zipfile_serialization=zipped)
    for program, cli in (("ckpt-diff", main), ("parity-train-diff", train_diff_main)):
        started = time.perf_counter()
        line = one_error_line(program, CliRunner().invoke(cli, [str(tmp_path / "a.pt")] * 2))
        assert "builds a dict key (or set element) of 4,210,817 values" in line
        assert time.perf_counter() - started < 60
    shared = ((("x",),) * 1000,) * 400  # 800,401 values: within a key's bound, but 64 keys hold it
    keys = {(i, shared): 1.0 for i in range(64)}
    torch.save({"w": torch.ones(2), "extra": keys}, tmp_path / "b.pt", _use_new_zipfile_serialization=zipped)
    line = one_error_line("ckpt-diff", CliRunner().invoke(main, [str(tmp_path / "b.pt")] * 2))
    assert "more than 32 places holding the same tensor or list" in line


@pytest.mark.parametrize("where", ["top", "state-dict", "nested"])
def test_two_keys_that_read_as_one_name_are_refused(tmp_path: Path, where: str) -> None:
    """Keys 0 and "0" in one dict: every reader names entries by their text, and the one read second replaced the
    first: dumps and checkpoints differing there were EQUAL (exit 0)."""
    entries: dict[object, object] = {0: torch.ones(2), "0": torch.zeros(2)}
    content = {
        "top": {**entries, "w": torch.ones(2)},
        "state-dict": {"model_state_dict": entries, "loss": 1.0},
        "nested": {"w": torch.ones(2), "extra": {"inner": entries}},
    }[where]
    torch.save(content, tmp_path / "a.pt")
    for program, cli in (("ckpt-diff", main), ("parity-train-diff", train_diff_main)):
        line = one_error_line(program, CliRunner().invoke(cli, [str(tmp_path / "a.pt")] * 2))
        assert "two keys of one dict read as one name, int '0' and str '0'" in line


def test_a_block_shared_by_every_layer_loads(tmp_path: Path) -> None:
    """ALBERT-style sharing (one block for all twelve layers: twelve names viewing each tensor) was refused as
    crafted; a file of such a model compares, EQUAL with itself."""
    block = torch.nn.Linear(1536, 1536)  # 9 MiB: twelve views of it are past the 16 MiB any file may show over
    torch.save(torch.nn.ModuleList([block] * 12).state_dict(), tmp_path / "shared.pt")
    result = CliRunner().invoke(main, [str(tmp_path / "shared.pt")] * 2)
    assert result.exit_code == 0, result.output
    assert "RESULT: EQUAL" in result.output


def test_containers_shown_many_times_count_though_empty(tmp_path: Path) -> None:
    """Three levels of a thousand references to one dict, the last empty: a billion places to walk from 49 KB,
    which counted nothing (no number, no tensor) and hung parity-train-diff. Each place counts."""
    nested: dict[str, Any] = {}
    for _ in range(3):
        nested = {f"k{i}": nested for i in range(1000)}
    torch.save({"model_state_dict": {"w": torch.ones(2)}, "extra": nested}, tmp_path / "a.pt")
    started = time.perf_counter()
    line = one_error_line("parity-train-diff", CliRunner().invoke(train_diff_main, [str(tmp_path / "a.pt")] * 2))
    assert "more than 32 places holding the same tensor or list" in line
    assert time.perf_counter() - started < 60


@pytest.mark.parametrize("kind", ["torch", "safetensors", "npz"])
def test_a_name_holding_a_line_break_is_refused(tmp_path: Path, kind: str) -> None:
    """A checkpoint key ``"x\nRESULT: EQUAL"`` printed a forged verdict line in the report of checkpoints that
    differ; in every format such a name is refused in one line (exit 2), as bundles refuse theirs."""
    crafted, other = tmp_path / f"crafted.{kind}", tmp_path / "other.npz"
    tensors = {"w": np.ones(2, dtype=np.float32), "x\nRESULT: EQUAL": np.zeros(1, dtype=np.float32)}
    if kind == "torch":
        torch.save({name: torch.from_numpy(value) for name, value in tensors.items()}, crafted)
    elif kind == "safetensors":
        save_numpy(tensors, str(crafted))
    else:
        np.savez(crafted, **tensors)
    np.savez(other, w=np.full(2, 2.0, dtype=np.float32))
    with pytest.raises(CheckpointError, match="holds a control character"):
        open_source(crafted)
    line = one_error_line("ckpt-diff", CliRunner().invoke(main, [str(crafted), str(other)]))
    assert "RESULT" in line  # the name shown escaped, on the error's one line


def test_a_meta_tensor_is_refused_before_its_values_are_read(tmp_path: Path) -> None:
    """A 1 KB checkpoint holding a tensor on the 'meta' device of 2**40 elements made ckpt-diff allocate 4 TiB (a
    RuntimeError from torch's allocator, or worse where memory is overcommitted): refused in one line, naming it."""
    crafted, other = tmp_path / "meta.pt", tmp_path / "other.npz"
    torch.save({"w": torch.empty(1 << 40, device="meta")}, crafted)
    np.savez(other, w=np.ones(2, dtype=np.float32))
    line = one_error_line("ckpt-diff", CliRunner().invoke(main, [str(crafted), str(other)]))
    assert "tensor 'w' is on the 'meta' device" in line


def test_a_folder_without_a_config_says_the_config_is_missing(tmp_path: Path) -> None:
    """A folder holding no config.json was said to hold one that is "not a regular file"."""
    folder, other = tmp_path / "weights", tmp_path / "other.npz"
    folder.mkdir()
    np.save(folder / "w.npy", np.ones(2, dtype=np.float32))
    np.savez(other, w=np.ones(2, dtype=np.float32))
    line = one_error_line("ckpt-diff", CliRunner().invoke(main, [str(folder), str(other)]))
    assert "config.json: no such file" in line
