"""ckpt-diff verdict holes and hostile files found by a review, each kept as a test: two different checkpoints
never come out EQUAL, and a crafted file cannot make the tool read without end or trust corrupted bytes."""

from __future__ import annotations

import io
import json
import struct
import subprocess
import sys
import warnings
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import save_file

from parity_harness.replay import ckpt_diff
from parity_harness.replay.cli.ckpt_diff import main
from tests.cli_helpers import one_error_line


def npz_pair(tmp_path: Path, a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> tuple[Path, Path]:
    """Both sides as uncompressed .npz files."""
    np.savez(tmp_path / "a.npz", **a)
    np.savez(tmp_path / "b.npz", **b)
    return tmp_path / "a.npz", tmp_path / "b.npz"


@pytest.mark.parametrize(
    ("dtype", "value"),
    [(np.int64, 2**60), (np.uint64, 2**63 + 2), (np.int64, -(2**62))],
    ids=["int64", "uint64", "negative-int64"],
)
def test_wide_integers_are_compared_exactly(tmp_path: Path, dtype: type, value: int) -> None:
    """Integers float64 cannot tell apart (2**60 against 2**60 + 1) are different, also within an epsilon below 1;
    their distances are taken exactly too (L1, L2 and max |B-A| were 0 beside one changed element)."""
    a, b = np.array([value, 5], dtype=dtype), np.array([value + 1, 5], dtype=dtype)
    result = ckpt_diff.diff(*npz_pair(tmp_path, {"step": a}, {"step": b}))
    assert not result.equal
    assert result.tensors[0].elements_changed == 1
    assert (result.tensors[0].l1, result.tensors[0].l2, result.tensors[0].max_abs) == (1.0, 1.0, 1.0)
    assert not ckpt_diff.diff(tmp_path / "a.npz", tmp_path / "b.npz", epsilon=0.5).equal
    assert ckpt_diff.diff(tmp_path / "a.npz", tmp_path / "b.npz", epsilon=2.0).equal


@pytest.mark.parametrize(
    ("a", "b"),
    [
        (np.array([2**62], np.int64), np.array([2**62 + 3], np.int64)),
        (np.array([2**62], np.int64), np.array([2**62 + 500], np.int64)),
        (np.array([2**63 + 10], np.uint64), np.array([2**63 + 2], np.uint64)),
        (np.array([2**60 + 5], np.int64), np.array([2.0**60])),
    ],
    ids=["int64+3", "int64+500", "uint64-8", "int64-against-float64"],
)
def test_an_epsilon_from_1_takes_wide_integers_distance_exactly(tmp_path: Path, a: np.ndarray, b: np.ndarray) -> None:
    """At --epsilon 1 and more the distance was taken in float64, where 2**62 and 2**62 + 500 are one float apart:
    values 3, 8 or 500 apart were equal."""
    for first, second in ((a, b), (b, a)):
        result = ckpt_diff.diff(*npz_pair(tmp_path, {"step": first}, {"step": second}), epsilon=1.0)
        assert result.tensors[0].elements_changed == 1
        assert not result.equal
    assert ckpt_diff.diff(*npz_pair(tmp_path, {"step": a}, {"step": b}), epsilon=1000.0).equal


@pytest.mark.parametrize(
    ("integers", "floats", "changed"),
    [
        (np.array([2**60 + 1, 3], np.int64), np.array([2.0**60, 3.0]), 1),  # float64 rounds 2**60 + 1 away
        (np.array([2**60, 3], np.int64), np.array([2.0**60, 3.0]), 0),  # a cast that keeps every value
        (np.array([2**64 - 1], np.uint64), np.array([2.0**64]), 1),  # past the integers' range
        (np.array([7, 8], np.int32), np.array([7.0, np.nan], np.float32), 1),
        (np.array([True, False]), np.array([1.0, 0.5], np.float32), 1),
        (np.array([2**53 + 1, 3], np.int64), np.array([2.0**53, 3.0], np.complex128), 1),  # was widened to complex
        (np.array([2**53, 3, 4], np.int64), np.array([2.0**53, 3.0, 4 + 1e-9j], np.complex128), 1),
        (np.array([5, 6], np.int16), np.array([5, 6 + 0j], np.complex64), 0),
    ],
    ids=[
        "int64-past-2**53",
        "int64-kept",
        "uint64-max",
        "nan",
        "bool",
        "complex-past-2**53",
        "complex-imag",
        "complex-kept",
    ],
)
def test_a_cast_between_integers_and_floats_is_compared_exactly(
    tmp_path: Path, integers: np.ndarray, floats: np.ndarray, changed: int
) -> None:
    """An integer tensor against a float one is equal element by element only where the float is that very integer
    (float64 cannot tell 2**60 from 2**60 + 1: that cast changed a value), in either order."""
    for a, b in ((integers, floats), (floats, integers)):
        result = ckpt_diff.diff(*npz_pair(tmp_path, {"step": a}, {"step": b}))
        assert result.tensors[0].elements_changed == changed
        assert result.equal is (changed == 0)


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64])
def test_an_epsilon_is_a_bound_on_the_exact_distance_whatever_the_dtype(tmp_path: Path, dtype: type) -> None:
    """|B-A| > epsilon was decided in float32 for float32 and float16 pairs: 0 against float32 0.1 (0.10000000149)
    was within --epsilon 0.1, and -0.5 against 0.50000006 within 1, where the same values in float64 were not.
    Each element past epsilon counts, among 100,000 others (some near it, within and beyond)."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal(100_000).astype(dtype)
    step = 0.25 if dtype == np.float16 else 0.1
    b = a.copy()
    b[:3] = a[:3] + dtype(step)  # exactly what float arithmetic gives, slightly above or below step
    exact = np.abs(b.astype(np.float64) - a.astype(np.float64))
    result = ckpt_diff.diff(*npz_pair(tmp_path, {"w": a}, {"w": b}), epsilon=step)
    assert result.tensors[0].elements_changed == int(np.count_nonzero(exact > step))
    pairs = [
        (np.array([0.0], dtype), np.array([0.1], dtype), 0.1),
        (np.array([-0.5], dtype), np.array([0.50000006], dtype), 1.0),
    ]
    for first, second, epsilon in pairs:
        beyond = abs(float(second[0]) - float(first[0])) > epsilon
        assert ckpt_diff.diff(*npz_pair(tmp_path, {"w": first}, {"w": second}), epsilon=epsilon).equal is not beyond


@pytest.mark.parametrize(
    ("array_a", "array_b"),
    [
        (np.zeros(2000), np.where(np.arange(2000) == 1000, 1.0, 0.0)),  # differs inside the elided middle
        (np.array([1.0]), np.array([1.0000000001])),  # differs past the shown digits
        (np.array([1, 2], np.int64), np.array([1, 2], np.int32)),
    ],
    ids=["elided", "rounded", "dtype"],
)
def test_numpy_arrays_in_a_trusted_pickle_are_compared_whole(
    tmp_path: Path, array_a: np.ndarray, array_b: np.ndarray
) -> None:
    """NumPy arrays a --trust-pickle load finds beside the tensors compare by their bytes, dtype and shape, not by
    their printed form (which elides and rounds): any difference is DIFFERENT; the same array is EQUAL."""
    weights = {"w": torch.ones(2)}
    torch.save({"model": weights, "extra": array_a}, tmp_path / "a.pt")
    torch.save({"model": weights, "extra": array_b}, tmp_path / "b.pt")
    torch.save({"model": weights, "extra": array_a.copy()}, tmp_path / "c.pt")
    assert not ckpt_diff.diff(tmp_path / "a.pt", tmp_path / "b.pt", trust_pickle=True).equal
    assert ckpt_diff.diff(tmp_path / "a.pt", tmp_path / "c.pt", trust_pickle=True).equal


@pytest.mark.parametrize(
    ("value_a", "value_b"),
    [
        ("x" * 300 + "a", "x" * 300 + "b"),
        (b"\0" * 300 + b"a", b"\0" * 300 + b"b"),
        (["y" * 300 + "a"], ["y" * 300 + "b"]),
    ],
    ids=["long-text", "bytes", "list-of-long-texts"],
)
def test_long_values_differing_past_their_shown_prefix_differ(tmp_path: Path, value_a: object, value_b: object) -> None:
    """A non-tensor value is compared whole, though shown shortened."""
    weights = {"w": torch.ones(2)}
    torch.save({"state_dict": weights, "note": value_a}, tmp_path / "a.pt")
    torch.save({"state_dict": weights, "note": value_b}, tmp_path / "b.pt")
    result = ckpt_diff.diff(tmp_path / "a.pt", tmp_path / "b.pt")
    assert [e.status for e in result.entries] == ["changed"]
    assert len(json.dumps(result.entries[0].to_json())) < 1000


def test_overlapping_safetensors_entries_are_refused(tmp_path: Path) -> None:
    """Entries sharing bytes could make a small file demand terabytes of reading: exit 2 naming both."""
    data = np.zeros(1024, np.float32).tobytes()
    header = {f"t{i}": {"dtype": "F32", "shape": [1024], "data_offsets": [0, len(data)]} for i in range(3)}
    raw = json.dumps(header).encode()
    (tmp_path / "x.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    path = str(tmp_path / "x.safetensors")
    line = one_error_line("ckpt-diff", CliRunner().invoke(main, [path, path]))
    assert "'t0' and 't1' overlap" in line


def test_a_corrupted_stored_npz_member_fails_its_crc(tmp_path: Path) -> None:
    """A byte flipped inside an uncompressed .npz member read in place is caught by the zip's CRC-32: exit 2."""
    a, _ = npz_pair(tmp_path, {"w": np.arange(100_000, dtype=np.float32)}, {"w": np.zeros(1, np.float32)})
    raw = bytearray(a.read_bytes())
    with zipfile.ZipFile(a) as archive:
        info = archive.getinfo("w.npy")
    raw[info.header_offset + 30 + len("w.npy") + 128 + 4000] ^= 0xFF  # inside the array, past the .npy header
    broken = tmp_path / "broken.npz"
    broken.write_bytes(bytes(raw))
    line = one_error_line("ckpt-diff", CliRunner().invoke(main, [str(a), str(broken)]))
    assert "fails its CRC-32" in line


def test_an_equal_of_the_selected_tensors_says_what_was_left_out(tmp_path: Path) -> None:
    """--include ^fc over checkpoints whose body.weight differs gave EQUAL, counting only the kept tensor and
    saying nothing of the other. The verdict stays the selection's, and the text, the sides' notes and the JSON
    options say what it left out."""
    a, b = npz_pair(
        tmp_path,
        {"fc.weight": np.ones(2, np.float32), "body.weight": np.ones(2, np.float32)},
        {"fc.weight": np.ones(2, np.float32), "body.weight": np.zeros(2, np.float32)},
    )
    text = CliRunner().invoke(main, [str(a), str(b), "--include", "^fc"])
    assert text.exit_code == 0
    assert "--include/--exclude leave out 1 of its tensors: they are not compared" in text.stdout
    assert text.stdout.rstrip().endswith("RESULT: EQUAL (of the tensors and values --include/--exclude select)")
    report = tmp_path / "r.json"
    CliRunner().invoke(main, [str(a), str(b), "--exclude", "^body", "--format", "json", "--out", str(report)])
    document = json.loads(report.read_text())
    assert (document["options"]["include"], document["options"]["exclude"]) == (None, "^body")
    assert document["a"]["notes"] == ["--include/--exclude leave out 1 of its tensors: they are not compared"]


@pytest.mark.parametrize(
    ("a", "b", "epsilon", "equal"),
    [
        (np.array([-(2.0**-60)]), np.array([1.0]), 1.0, False),  # float64 rounds 1 + 2**-60 to 1
        (np.array([-(2.0**-60)], np.float32), np.array([1.0], np.float32), 1.0, False),
        (np.array([0.0]), np.array([1.0]), 1.0, True),
        (np.array([0], np.int64), np.array([0.3 + 0.3j]), 0.4, True),  # parts apart, as two complex tensors
        (np.array([0j]), np.array([0.3 + 0.3j]), 0.4, True),
        (np.array([2**53 + 1], np.int64), np.array([2.0**53 + 1e-300j]), 0.5, False),  # the real part, exactly
    ],
    ids=["float64-tie", "float32-tie", "float64-at-epsilon", "int-complex", "complex-complex", "int-complex-2**53"],
)
def test_an_epsilon_is_decided_exactly_at_its_bound(
    tmp_path: Path, a: np.ndarray, b: np.ndarray, epsilon: float, equal: bool
) -> None:
    """A difference rounded to epsilon itself is settled by its rounding error; an integer against a complex value
    is compared part by part, as two complex tensors are, each real part exactly."""
    assert ckpt_diff.diff(*npz_pair(tmp_path, {"w": a}, {"w": b}), epsilon=epsilon).equal is equal


def _npy_bytes(values: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, values)
    return buffer.getvalue()


def test_an_npz_holding_a_member_twice_is_refused(tmp_path: Path) -> None:
    """Two members named w.npy (zipfile writes them, with a warning): the first, which differs, was shadowed by the
    second and the pair came out EQUAL. Refused in one line, as safetensors headers with a key twice are."""
    doubled = tmp_path / "doubled.npz"
    with warnings.catch_warnings(), zipfile.ZipFile(doubled, "w") as archive:
        warnings.simplefilter("ignore")  # zipfile's "Duplicate name"
        archive.writestr("w.npy", _npy_bytes(np.array([9.0, 9.0], np.float32)))
        archive.writestr("w.npy", _npy_bytes(np.array([1.0, 2.0], np.float32)))
    np.savez(tmp_path / "b.npz", w=np.array([1.0, 2.0], np.float32))
    line = one_error_line("ckpt-diff", CliRunner().invoke(main, [str(doubled), str(tmp_path / "b.npz")]))
    assert "the member 'w.npy' appears more than once" in line


def test_an_npz_member_that_is_no_array_is_refused_before_numpy_reads_it(tmp_path: Path) -> None:
    """A member 'w' beside 'w.npy': the size check read w.npy's header while numpy's archive['w'] reads 'w' (64 MB
    from a 65 KB file past PARITY_NEMO_MAX_BYTES in capture-run --inputs). Only .npy members are accepted."""
    from parity_harness.common.errors import CheckpointError
    from parity_harness.common.format.tensor_files import check_npz_sizes

    crafted = tmp_path / "crafted.npz"
    with zipfile.ZipFile(crafted, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("w", _npy_bytes(np.zeros(1 << 20, np.float32)))
        archive.writestr("w.npy", _npy_bytes(np.zeros(1, np.float32)))
    with np.load(crafted) as loaded, pytest.raises(CheckpointError, match="the member 'w' is no array"):
        check_npz_sizes(loaded, crafted)


def test_values_beyond_1e154_give_no_error_and_no_false_direction(tmp_path: Path) -> None:
    """float64 squares overflow past 1e154: the diff still runs (exit 1), B = 2A is not called a reversed tensor."""
    a = np.array([1e200, 1e200, 3e160], dtype=np.float64)
    result = ckpt_diff.diff(*npz_pair(tmp_path, {"w": a}, {"w": 2 * a}))
    change = result.tensors[0]
    assert change.status == "changed"
    assert not change.cosine < 0
    assert not [i for i in ckpt_diff.analyse(result).insights if i.kind == "low_cosine"]


def test_infinite_distances_are_inf_in_json_and_sort_first_in_html(tmp_path: Path) -> None:
    """An infinity appearing in B: JSON says "inf" (null would mean not computed), and the HTML table's L2 column
    sorts it as the largest."""
    a = {"w": np.ones(4, np.float32), "v": np.ones(4, np.float32)}
    b = {"w": np.array([1, 1, np.inf, 1], np.float32), "v": np.full(4, 2.0, np.float32)}
    result = ckpt_diff.diff(*npz_pair(tmp_path, a, b))
    document = json.loads(ckpt_diff.render(result, "json", sort_by="l2"))
    by_name = {t["name"]: t for t in document["tensors"]}
    assert by_name["w"]["l2"] == "inf"
    assert by_name["w"]["max_abs"] == "inf"
    assert [t["name"] for t in document["tensors"]] == ["w", "v"]
    page = ckpt_diff.render(result, "html", sort_by="l2")
    assert 'data-value="Infinity"' in page


def test_optimizer_state_is_no_depth_and_top_level_layers_are(tmp_path: Path) -> None:
    """optimizer.state.N is numbered by parameter, not depth; an nn.Sequential's 0.weight is depth 0."""
    weights = {f"{i}.weight": torch.ones(3) * (i + 1) for i in range(4)}
    torch.save({"state_dict": weights, "optimizer": {"state": {0: {"exp_avg": torch.ones(3)}}}}, tmp_path / "a.pt")
    moved = {k: v * 1.1 for k, v in weights.items()}
    torch.save({"state_dict": moved, "optimizer": {"state": {0: {"exp_avg": torch.ones(3) * 2}}}}, tmp_path / "b.pt")
    result = ckpt_diff.diff(tmp_path / "a.pt", tmp_path / "b.pt")
    depths = {c.name: (c.stack, c.depth) for c in result.tensors}
    assert depths["optimizer.state.0.exp_avg"] == (None, None)
    assert depths["2.weight"] == ("", 2)
    assert {p.scope for p in ckpt_diff.analyse(result).patterns if "depth" in p.name} == {"(top level)"}


def test_an_invalid_include_pattern_names_its_option(tmp_path: Path) -> None:
    """--include '(' is exit 2 naming --include and the regex error."""
    a, b = npz_pair(tmp_path, {"w": np.ones(2, np.float32)}, {"w": np.ones(2, np.float32)})
    line = one_error_line("ckpt-diff", CliRunner().invoke(main, [str(a), str(b), "--include", "("]))
    assert "--include" in line
    assert "invalid regex" in line


def test_a_map_that_drops_tensors_says_so(tmp_path: Path) -> None:
    """Tensors of B the map gives no counterpart are named in the side's notes, in JSON too."""
    save_file({"w": torch.ones(2), "extra": torch.ones(1)}, str(tmp_path / "a.safetensors"))
    save_file({"w": torch.ones(2), "extra": torch.ones(1)}, str(tmp_path / "b.safetensors"))
    (tmp_path / "m.map").write_text("^extra$ => -\n")
    result = ckpt_diff.diff(tmp_path / "a.safetensors", tmp_path / "b.safetensors", map_file=tmp_path / "m.map")
    assert any("no counterpart" in note for note in result.b.notes)
    assert [c.status for c in result.tensors if c.name == "extra"] == ["removed"]


def test_a_step_tensor_beside_the_model_state_dict_keeps_the_model_names(tmp_path: Path) -> None:
    """A training checkpoint saving its step as a tensor beside ``model`` is still one: the weights keep their own
    names and pair with a plain state dict's (they were all listed as removed and added under two names)."""
    weights = {"lin.weight": torch.ones(2, 2), "lin.bias": torch.zeros(2)}
    torch.save({"model": weights, "step": torch.tensor(5)}, tmp_path / "a.pt")
    torch.save(weights, tmp_path / "b.pt")
    result = ckpt_diff.diff(tmp_path / "a.pt", tmp_path / "b.pt")
    status = {change.name: change.status for change in result.tensors}
    assert status == {"lin.weight": "unchanged", "lin.bias": "unchanged", "step": "removed"}


def test_the_safetensors_format_marker_is_not_a_difference(tmp_path: Path) -> None:
    """The same weights as a torch.save file and as safetensors written with ``{"format": "pt"}`` (as every
    save_pretrained writes it) are EQUAL, the marker noted; other metadata is still compared."""
    weights = {"lin.weight": torch.ones(2, 2), "lin.bias": torch.zeros(2)}
    torch.save(weights, tmp_path / "a.pt")
    save_file(weights, str(tmp_path / "b.safetensors"), metadata={"format": "pt"})
    save_file(weights, str(tmp_path / "c.safetensors"), metadata={"format": "pt", "note": "other"})
    result = ckpt_diff.diff(tmp_path / "a.pt", tmp_path / "b.safetensors")
    assert result.equal
    assert not ckpt_diff.diff(tmp_path / "b.safetensors", tmp_path / "c.safetensors").equal


def test_the_wrapper_prefix_comes_off_a_state_dicts_other_values_too(tmp_path: Path) -> None:
    """A DDP state dict (every name under ``module.``) holding a non-tensor value pairs with the plain one: the
    value loses the prefix with the tensors (it was listed as removed and added under two names)."""
    plain = {"lin.weight": torch.ones(2, 2), "lin._extra_state": 3}
    torch.save(plain, tmp_path / "a.pt")
    torch.save({f"module.{name}": value for name, value in plain.items()}, tmp_path / "b.pt")
    result = ckpt_diff.diff(tmp_path / "a.pt", tmp_path / "b.pt")
    assert result.equal
    assert [entry.name for entry in result.entries] == ["lin._extra_state"]


def test_a_quantized_tensor_is_one_line_with_no_torch_warning_before_it(tmp_path: Path) -> None:
    """A quantized tensor (a dtype ckpt-diff does not compare): one error line saying so, in a process of its own so
    that torch's deprecation warnings, printed while loading, would show on stderr (pytest would catch them here)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quantized = torch.quantize_per_tensor(torch.ones(4), scale=0.1, zero_point=0, dtype=torch.qint8)
    torch.save({"w": quantized}, tmp_path / "quant.pt")
    torch.save({"w": torch.ones(4)}, tmp_path / "plain.pt")
    command = [sys.executable, "-c", "from parity_harness.replay.cli.ckpt_diff import main; main()"]
    done = subprocess.run([*command, "quant.pt", "plain.pt"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2
    expected = (
        "ckpt-diff: error: quant.pt: tensor 'w' is torch.qint8, which ckpt-diff does not compare (quantized and other "
        "special dtypes); dequantize or convert it first"
    )
    assert done.stderr.splitlines() == [expected]
