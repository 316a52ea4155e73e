"""ckpt-diff: every kind of change reported with the right status and values, across formats."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import save_file

from parity_harness.replay.ckpt_diff import analyse, diff
from parity_harness.replay.ckpt_diff.compare import CheckpointDiff
from parity_harness.replay.cli.ckpt_diff import main
from tests.cli_helpers import one_error_line


def _base() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {
        "embed.weight": torch.randn(10, 4, generator=generator),
        "layers.0.attn.q_proj.weight": torch.randn(4, 4, generator=generator),
        "layers.0.norm.weight": torch.ones(4),
        "layers.0.mlp.fc.weight": torch.randn(8, 4, generator=generator),
        "head.weight": torch.randn(3, 4, generator=generator),
        "head.bias": torch.zeros(3),
        "old.weight": torch.randn(2, generator=generator),
        "half.weight": torch.randn(5, generator=generator).to(torch.bfloat16),
    }


EXPECTED_STATUS = {
    "embed.weight": "unchanged",
    "layers.0.attn.q_proj.weight": "changed",
    "layers.0.norm.weight": "unchanged",
    "layers.0.mlp.fc.weight": "changed",
    "head.weight": "shape_changed",
    "head.bias": "unchanged",
    "old.weight": "removed",
    "new.weight": "added",
    "half.weight": "unchanged",
}
"""The status of every tensor of _changed() against _base() (head.bias: zeros cast to float64, equal values)."""


def diff_checkpoints(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], **options: object) -> CheckpointDiff:
    """Diff two state dicts through files, as users do (safetensors keeps bf16)."""
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        save_file(a, f"{folder}/a.safetensors")
        save_file(b, f"{folder}/b.safetensors")
        return diff(f"{folder}/a.safetensors", f"{folder}/b.safetensors", **options)


def _changed() -> dict[str, torch.Tensor]:
    tensors = {k: v.clone() for k, v in _base().items()}
    tensors["layers.0.attn.q_proj.weight"] += 0.01  # changed everywhere
    tensors["layers.0.mlp.fc.weight"][0, 0] = float("nan")  # NaN injected
    tensors["head.weight"] = torch.randn(3, 5)  # shape change
    tensors["head.bias"] = tensors["head.bias"].double()  # dtype change
    del tensors["old.weight"]  # removed
    tensors["new.weight"] = torch.ones(2)  # added
    return tensors


def test_every_change_has_its_status_and_values() -> None:
    """Statuses and metrics match a numpy recomputation; unchanged tensors are called frozen."""
    result = diff_checkpoints(_base(), _changed())
    status = {c.name: c.status for c in result.tensors}
    assert status == EXPECTED_STATUS
    q = next(c for c in result.tensors if c.name == "layers.0.attn.q_proj.weight")
    a = _base()["layers.0.attn.q_proj.weight"].double().numpy()
    b = a + np.float32(0.01)
    assert q.l2 == pytest.approx(np.linalg.norm(b - a), rel=1e-5)
    assert q.relative_change == pytest.approx(np.linalg.norm(b - a) / np.linalg.norm(a), rel=1e-5)
    assert q.fraction_changed == 1.0
    assert q.layer_type == "attention"
    fc = next(c for c in result.tensors if c.name == "layers.0.mlp.fc.weight")
    assert fc.stats_a is not None
    assert fc.stats_b is not None
    assert (fc.stats_a.nan, fc.stats_b.nan) == (0, 1)
    bias = next(c for c in result.tensors if c.name == "head.bias")
    assert bias.dtype_changed
    assert (bias.dtype_a, bias.dtype_b) == ("F32", "F64")
    assert not result.equal


def test_epsilon_include_exclude_and_map() -> None:
    """--epsilon absorbs small changes; include/exclude filter names; a map renames B's tensors to A's."""
    a, b = _base(), {k: v.clone() for k, v in _base().items()}
    b["layers.0.attn.q_proj.weight"] += 1e-3
    assert diff_checkpoints(a, b, epsilon=1e-2).equal
    assert not diff_checkpoints(a, b).equal
    assert {c.name for c in diff_checkpoints(a, b, include=r"^head").tensors} == {"head.weight", "head.bias"}
    assert "embed.weight" not in {c.name for c in diff_checkpoints(a, b, exclude=r"embed").tensors}
    from parity_harness.replay.naming.mapping import parse_map

    renamed = {("tok_emb.weight" if k == "embed.weight" else k): v for k, v in a.items()}
    with_map = parse_map(r"^tok_emb$ => embed")
    assert diff_checkpoints(a, renamed).counts()["added"] == 1
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "map.txt").write_text(r"^tok_emb$ => embed" + "\n")
        save_file(a, f"{folder}/a.safetensors")
        save_file(renamed, f"{folder}/b.safetensors")
        assert diff(f"{folder}/a.safetensors", f"{folder}/b.safetensors", map_file=f"{folder}/map.txt").equal
    assert with_map.parameter("tok_emb.weight") == "embed.weight"


def test_same_weights_in_two_formats_are_equal(tmp_path: Path) -> None:
    """A state dict .pt and the same tensors as safetensors and .npz compare equal (exit 0)."""
    tensors = {k: v for k, v in _base().items() if v.dtype != torch.bfloat16}
    torch.save({"state_dict": tensors}, tmp_path / "a.pt")
    save_file(tensors, str(tmp_path / "b.safetensors"))
    np.savez(tmp_path / "c.npz", **{k: v.numpy() for k, v in tensors.items()})
    for other in ("b.safetensors", "c.npz"):
        result = CliRunner().invoke(main, [str(tmp_path / "a.pt"), str(tmp_path / other)])
        assert result.exit_code == 0, result.output
        assert "RESULT: EQUAL" in result.stdout
    from parity_harness.replay.ckpt_diff import load

    with load(tmp_path / "c.npz") as loaded:
        assert set(loaded.names) == set(tensors)


def test_cli_json_contract_and_exit_1(tmp_path: Path) -> None:
    """--format json holds equal and per-tensor status, l2, cosine, max_abs, nan counts; differences exit 1."""
    save_file(_base(), str(tmp_path / "a.safetensors"))
    save_file(_changed(), str(tmp_path / "b.safetensors"))
    report = tmp_path / "diff.json"
    result = CliRunner().invoke(
        main,
        [str(tmp_path / "a.safetensors"), str(tmp_path / "b.safetensors"), "--format", "json", "--out", str(report)],
    )
    assert result.exit_code == 1
    document = json.loads(report.read_text())
    assert document["equal"] is False
    fc = next(t for t in document["tensors"] if t["name"] == "layers.0.mlp.fc.weight")
    assert set(fc) >= {"name", "status", "l2", "cosine", "max_abs", "stats_a", "stats_b"}
    assert fc["stats_b"]["nan"] == 1
    assert document["summary"]["counts"]["added"] == 1
    text = CliRunner().invoke(main, [str(tmp_path / "a.safetensors"), str(tmp_path / "b.safetensors")]).stdout
    for expected in ("~ ", "+ ", "(frozen)", "NaN or Inf in B but not in A", "layer type"):
        assert expected in text


def test_bundle_parameters_and_errors(tiny_bundle: Path, tmp_path: Path) -> None:
    """A parity bundle's parameters diff against the model's state; a missing file is exit 2."""
    from tests.models import build_tiny

    torch.save(dict(build_tiny().named_parameters()), tmp_path / "tiny.pt")
    assert CliRunner().invoke(main, [str(tiny_bundle), str(tmp_path / "tiny.pt")]).exit_code == 0
    assert "no such checkpoint" in one_error_line(
        "ckpt-diff", CliRunner().invoke(main, [str(tiny_bundle), str(tmp_path / "nope.pt")])
    )


def _layers(
    scale_by_depth: float = 0.0, only: str | None = None
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(3)
    a = {}
    for layer in range(6):
        for part in ("attn.q_proj", "mlp.fc"):
            a[f"layers.{layer}.{part}.weight"] = torch.randn(8, 8, generator=generator)
    b = {}
    for name, tensor in a.items():
        layer = int(name.split(".")[1])
        factor = 0.01 * (1 + scale_by_depth * layer)
        b[name] = tensor * (1 + factor) if only is None or only in name else tensor.clone()
    return a, b


@pytest.mark.parametrize(
    ("depth", "only", "expected"),
    [(0.0, None, "uniform"), (2.0, None, "inverse gradient"), (0.0, "attn", "attention-heavy")],
    ids=["uniform", "deeper-layers-more", "attention-only"],
)
def test_change_patterns(depth: float, only: str | None, expected: str) -> None:
    """The change pattern names how the change is spread: evenly, by depth, or by layer type."""
    a, b = _layers(depth, only)
    assert expected in [p.name for p in analyse(diff_checkpoints(a, b)).patterns]


def test_html_report_escapes_names(tmp_path: Path) -> None:
    """--format html writes a page whose tensor names are escaped."""
    a = {"x<script>.weight": torch.zeros(2)}
    b = {"x<script>.weight": torch.ones(2)}
    save_file(a, str(tmp_path / "a.safetensors"))
    save_file(b, str(tmp_path / "b.safetensors"))
    page = tmp_path / "diff.html"
    result = CliRunner().invoke(
        main, [str(tmp_path / "a.safetensors"), str(tmp_path / "b.safetensors"), "--format", "html", "--out", str(page)]
    )
    assert result.exit_code == 1
    text = page.read_text()
    assert text.startswith("<!doctype html>")
    assert "x<script>" not in text
    assert "x&lt;script&gt;.weight" in text


def _write(tensors: dict[str, torch.Tensor], folder: Path, kind: str) -> Path:
    """The tensors saved as a checkpoint of ``kind``."""
    import io
    import tarfile

    folder.mkdir(parents=True, exist_ok=True)
    if kind == "pt":
        torch.save({"model_state_dict": tensors}, folder / "w.pt")
        return folder / "w.pt"
    if kind == "safetensors":
        save_file(tensors, str(folder / "w.safetensors"))
        return folder / "w.safetensors"
    if kind == "hf":
        (folder / "config.json").write_text("{}")
        save_file(tensors, str(folder / "model.safetensors"))
        return folder
    if kind == "npz":
        np.savez(folder / "w.npz", **{k: v.numpy() for k, v in tensors.items()})
        return folder / "w.npz"
    buffer = io.BytesIO()
    torch.save(tensors, buffer)
    with tarfile.open(folder / "w.nemo", "w") as archive:
        for name, data in (("model_config.yaml", b"x: 1\n"), ("model_weights.ckpt", buffer.getvalue())):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return folder / "w.nemo"


@pytest.mark.parametrize("kind", ["pt", "safetensors", "hf", "nemo", "npz"])
def test_every_change_kind_in_every_format(tmp_path: Path, kind: str) -> None:
    """NaN, added, removed, shape, dtype, frozen and changed tensors get the same statuses in each format."""

    def portable(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:  # numpy has no bf16
        return {k: v.float() if kind == "npz" and v.dtype == torch.bfloat16 else v for k, v in tensors.items()}

    a = _write(portable(_base()), tmp_path / "a", kind)
    b = _write(portable(_changed()), tmp_path / "b", kind)
    status = {c.name: c.status for c in diff(a, b).tensors}
    assert status == EXPECTED_STATUS


def test_layer_type_patterns_are_configurable(tmp_path: Path) -> None:
    """--layer-type NAME=REGEX replaces the default layer types; a bad spec is exit 2."""
    save_file(_base(), str(tmp_path / "a.safetensors"))
    save_file(_changed(), str(tmp_path / "b.safetensors"))
    args = [str(tmp_path / "a.safetensors"), str(tmp_path / "b.safetensors"), "--format", "json", "--show-unchanged"]
    result = CliRunner().invoke(main, [*args, "--layer-type", "projection=q_proj", "--layer-type", "classifier=^head"])
    kinds = {t["name"]: t["layer_type"] for t in json.loads(result.stdout)["tensors"]}
    assert kinds["layers.0.attn.q_proj.weight"] == "projection"
    assert kinds["head.bias"] == "classifier"
    assert kinds["embed.weight"] == "other"
    assert "NAME=REGEX" in one_error_line("ckpt-diff", CliRunner().invoke(main, [*args, "--layer-type", "nope"]))


def test_a_map_that_merges_or_drops_tensors_cannot_hide_them(tmp_path: Path) -> None:
    """Two of B's tensors mapped onto one name is exit 2 naming both; tensors the map drops are said in the report
    (they are not compared)."""
    a = {"w.weight": torch.ones(2)}
    save_file(a, str(tmp_path / "a.safetensors"))
    save_file({"x.weight": torch.ones(2), "y.weight": torch.zeros(2)}, str(tmp_path / "b.safetensors"))
    merging = tmp_path / "merge.map"
    merging.write_text("^x$ => w\n^y$ => w\n")
    args = [str(tmp_path / "a.safetensors"), str(tmp_path / "b.safetensors")]
    line = one_error_line("ckpt-diff", CliRunner().invoke(main, [*args, "--map", str(merging)]))
    assert "'x.weight' and 'y.weight'" in line
    dropping = tmp_path / "drop.map"
    dropping.write_text("^x$ => w\n^y$ => -\n")
    result = CliRunner().invoke(main, [*args, "--map", str(dropping)])
    assert result.exit_code == 0, result.output
    assert "--map gives 1 of its tensors no counterpart" in result.stdout


def test_a_map_renames_values_that_are_not_tensors_too(tmp_path: Path) -> None:
    """--map renamed B's tensors but not its other values: the same extra state under a renamed module was
    reported removed and added (DIFFERENT)."""
    weight = torch.arange(12.0).reshape(4, 3)
    torch.save({"enc.w": weight, "enc._extra_state": {"version": 2}}, tmp_path / "a.pt")
    torch.save({"encoder.w": weight, "encoder._extra_state": {"version": 2}}, tmp_path / "b.pt")
    rules = tmp_path / "m.map"
    rules.write_text("encoder => enc\n")
    args = [str(tmp_path / "a.pt"), str(tmp_path / "b.pt"), "--map", str(rules)]
    assert CliRunner().invoke(main, args).exit_code == 0
    torch.save({"encoder.w": weight, "encoder._extra_state": {"version": 3}}, tmp_path / "b.pt")
    result = CliRunner().invoke(main, [*args, "--format", "json"])
    assert result.exit_code == 1
    changed = [e["name"] for e in json.loads(result.stdout)["entries"] if e["status"] != "unchanged"]
    assert changed == ["enc._extra_state.version"]
