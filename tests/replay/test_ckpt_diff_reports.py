"""ckpt-diff's reports: every format lists the same tensors in the --sort-by order, honours --show-unchanged,
carries the summary with totals and the insights, and --shape-only reads no values."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import numpy as np
import pytest
import yaml
from click.testing import CliRunner

from parity_harness.replay.cli.ckpt_diff import main

FORMATS = ("text", "json", "yaml", "markdown", "csv", "html")


@pytest.fixture
def pair(tmp_path: Path) -> tuple[str, str]:
    """Two .npz checkpoints: four tensors moved by different amounts, one unchanged, one reshaped, one added,
    and two non-tensor-like arrays kept aside (npz holds arrays only)."""
    generator = np.random.default_rng(0)
    a = {f"layers.{i}.weight": generator.standard_normal((8, 8)).astype(np.float32) for i in range(4)}
    a["frozen.weight"] = np.ones(5, np.float32)
    a["head.weight"] = np.zeros((3, 4), np.float32)
    b = {name: value + np.float32(0.01 * (i + 1)) for i, (name, value) in enumerate(a.items()) if "layers" in name}
    b["frozen.weight"] = a["frozen.weight"].copy()
    b["head.weight"] = np.zeros((3, 5), np.float32)
    b["extra.bias"] = np.ones(2, np.float32)
    np.savez(tmp_path / "a.npz", **a)
    np.savez(tmp_path / "b.npz", **b)
    return str(tmp_path / "a.npz"), str(tmp_path / "b.npz")


def run(pair: tuple[str, str], *options: str) -> str:
    """The report on stdout; the exit code is 1 (the pair differs)."""
    result = CliRunner().invoke(main, [*pair, *options])
    assert result.exit_code == 1, result.output
    return result.stdout


def names_in(report: str, output_format: str) -> list[str]:
    """The tensor names a report lists, in its order."""
    if output_format == "json":
        return [t["name"] for t in json.loads(report)["tensors"]]
    if output_format == "yaml":
        return [t["name"] for t in yaml.safe_load(report)["tensors"]]
    if output_format == "csv":
        return [row["name"] for row in csv.DictReader(io.StringIO(report))]
    if output_format == "html":
        import re

        return re.findall(r'<tr class="tensor" data-name="([^"]+)"', report)
    known = ("layers.0.weight", "layers.1.weight", "layers.2.weight", "layers.3.weight", "frozen.weight")
    known += ("head.weight", "extra.bias")
    table = report.split("== Summary ==")[0] if output_format == "text" else report.split("```")[0]
    rows = [line for line in table.splitlines() if any(f" {n} " in line for n in known)]
    return [next(n for n in known if f" {n} " in row) for row in rows]


@pytest.mark.parametrize("output_format", FORMATS)
def test_every_format_lists_the_same_tensors_in_sort_order(pair: tuple[str, str], output_format: str) -> None:
    """--sort-by l2 puts the most moved tensor first in every format; unchanged tensors appear only with
    --show-unchanged; shape changes and additions are listed either way."""
    listed = names_in(run(pair, "--format", output_format, "--sort-by", "l2"), output_format)
    moved = ["layers.3.weight", "layers.2.weight", "layers.1.weight", "layers.0.weight"]
    assert listed[:4] == moved
    assert set(listed) == {*moved, "head.weight", "extra.bias"}
    by_name = names_in(run(pair, "--format", output_format, "--sort-by", "name", "--show-unchanged"), output_format)
    assert by_name == sorted(by_name)
    assert "frozen.weight" in by_name


def test_json_and_yaml_carry_summary_totals_and_insights(pair: tuple[str, str]) -> None:
    """Both documents hold the verdict, per-status counts, parameter and byte totals (A, B, delta), the insights
    with severities and the patterns; the YAML reads back (PyYAML) as the JSON does."""
    document = json.loads(run(pair, "--format", "json"))
    assert yaml.safe_load(run(pair, "--format", "yaml")) == document
    assert document["verdict"] == "DIFFERENT"
    totals = document["summary"]["totals"]
    assert totals["parameters"] == {"a": 4 * 64 + 5 + 12, "b": 4 * 64 + 5 + 15 + 2, "delta": 5}
    assert totals["bytes"] == {"a": 4 * (4 * 64 + 17), "b": 4 * (4 * 64 + 22), "delta": 20}
    assert document["summary"]["counts"] == {
        "changed": 4,
        "unchanged": 1,
        "added": 1,
        "removed": 0,
        "shape_changed": 1,
    }
    kinds = {(i["kind"], i["severity"]) for i in document["insights"]}
    assert {("shape_changed", "warning"), ("added", "warning"), ("frozen", "info")} <= kinds
    assert document["a"]["path"].endswith("a.npz")
    assert document["a"]["kind"] == "npz"


def test_yaml_floats_read_back_as_floats() -> None:
    """Small and large floats (1e-05, 1e+20) are floats to YAML 1.1 readers, not strings."""
    from parity_harness.replay.report.ckpt_diff.structured import render_yaml

    values = {"tiny": 1e-05, "huge": 1e20, "plain": 0.5, "whole": 3.0, "text": "1e-05", "none": None, "list": [1e-7]}
    assert yaml.safe_load(render_yaml(values)) == values


def test_text_shows_old_and_new_shape_and_the_totals(pair: tuple[str, str]) -> None:
    """A reshaped tensor reads '3x4 -> 3x5'; the summary gives parameters and bytes of A, B and the delta."""
    text = run(pair)
    row = next(line for line in text.splitlines() if " head.weight " in line)
    assert "3x4 -> 3x5" in row
    assert "parameters: A 273, B 278, delta +5" in text
    assert text.rstrip().endswith("RESULT: DIFFERENT")


def test_shape_only_reads_no_values(pair: tuple[str, str], tmp_path: Path) -> None:
    """--shape-only compares names, shapes and dtypes: equal values or not, same structure is EQUAL (exit 0); no
    statistics are reported; a dtype change is DIFFERENT there."""
    a, _ = pair
    moved = dict(np.load(a))
    moved["layers.0.weight"] = moved["layers.0.weight"] + np.float32(1)
    np.savez(tmp_path / "moved.npz", **moved)
    result = CliRunner().invoke(main, [a, str(tmp_path / "moved.npz"), "--shape-only", "--format", "json"])
    assert result.exit_code == 0, result.output
    document = json.loads(result.stdout)
    assert document["options"]["shape_only"] is True
    assert document["equal"] is True
    moved["layers.0.weight"] = moved["layers.0.weight"].astype(np.float64)
    np.savez(tmp_path / "cast.npz", **moved)
    cast = CliRunner().invoke(main, [a, str(tmp_path / "cast.npz"), "--shape-only"])
    assert cast.exit_code == 1
    assert "F32->F64" in cast.stdout
    assert CliRunner().invoke(main, [*pair, "--shape-only", "--format", "json"]).exit_code == 1


def test_non_tensor_values_are_compared_and_listed(tmp_path: Path) -> None:
    """A training checkpoint's epoch, step and learning rate are compared: equal weights with another epoch are
    DIFFERENT, and the values are listed with both sides in text and JSON."""
    import torch

    weights = {"layer.weight": torch.ones(3, 3)}
    torch.save({"state_dict": weights, "epoch": 3, "lr": 0.1, "name": "run"}, tmp_path / "a.pt")
    torch.save({"state_dict": weights, "epoch": 4, "lr": 0.1, "name": "run"}, tmp_path / "b.pt")
    args = [str(tmp_path / "a.pt"), str(tmp_path / "b.pt")]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 1
    row = next(line for line in result.stdout.splitlines() if " epoch " in line)
    assert row.split()[-2:] == ["3", "4"]
    entries = json.loads(CliRunner().invoke(main, [*args, "--format", "json"]).stdout)["entries"]
    assert entries == [{"name": "epoch", "status": "changed", "a": 3, "b": 4}]
    everything = json.loads(CliRunner().invoke(main, [*args, "--format", "json", "--show-unchanged"]).stdout)
    assert {"name": "lr", "status": "unchanged", "a": 0.1, "b": 0.1} in everything["entries"]
    rows = list(csv.DictReader(io.StringIO(CliRunner().invoke(main, [*args, "--format", "csv"]).stdout)))
    assert [(r["kind"], r["name"], r["value_a"], r["value_b"]) for r in rows if r["kind"] == "value"] == [
        ("value", "epoch", "3", "4")
    ]
