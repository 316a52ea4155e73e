"""A value from a crafted file quoted in an error message keeps the message one short line: never megabytes
long, never a RecursionError from ``repr`` (the bundle index, a manifest, a format gate, a training file)."""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from pathlib import Path

import pytest

from parity_harness.common.errors import BundleFormatError, CheckpointError
from parity_harness.common.format.bundle.schema import parse_tree
from parity_harness.common.format.gate import parse_format_version
from parity_harness.common.format.manifest import read_manifest
from parity_harness.common.format.preview import SHOWN_CHARACTERS, shown
from parity_harness.common.format.tensor_files import read_safetensors_header
from parity_harness.common.format.training import parse_step_meta


def _nested(depth: int) -> list[object]:
    """A list nested ``depth`` deep (msgpack decodes up to about a thousand levels)."""
    outer: list[object] = []
    inner = outer
    for _ in range(depth):
        inner.append([])
        inner = inner[0]  # type: ignore[assignment]
    return outer


DEEP = _nested(1000)  # repr of it raises RecursionError under the default limit, inside a parser's frames
WIDE = list(range(200_000))
LONG = "x" * 1_000_000
ODD_VALUES = {"deep": DEEP, "wide": WIDE, "long": LONG}


@pytest.mark.parametrize("name", ODD_VALUES)
def test_shown_is_short_for_any_value(name: str) -> None:
    text = shown(ODD_VALUES[name])
    assert len(text) <= SHOWN_CHARACTERS + 3
    assert "\n" not in text


def _index_tree(value: object) -> None:
    parse_tree(["T", "/inputs/x", value, [2], False], "inputs")


def _training_step(value: object) -> None:
    meta = {"step": value, "loss": None, "metrics": {}, "batch": ["N"]}
    parse_step_meta(meta, "run.h5:/steps/000000001/meta", 1)


def _format_version(value: object) -> None:
    parse_format_version(value, where="bundle.h5: root attribute 'format_version'")


PARSERS: dict[str, Callable[[object], None]] = {
    "bundle index": _index_tree,
    "training step meta": _training_step,
    "format version": _format_version,
}


@pytest.mark.parametrize("value", ODD_VALUES)
@pytest.mark.parametrize("parser", PARSERS)
def test_messages_quoting_a_crafted_value_stay_short(parser: str, value: str) -> None:
    with pytest.raises(BundleFormatError) as caught:
        PARSERS[parser](ODD_VALUES[value])
    message = str(caught.value)
    assert len(message) < 500, message[:200]
    assert "\n" not in message


@pytest.mark.parametrize("field", ["world_size", "format", "backend"])
def test_a_manifest_field_holding_a_huge_value_gives_a_short_message(field: str, tmp_path: Path) -> None:
    """A manifest is JSON read whole (up to its size limit): a field holding a list of 200,000 numbers is quoted
    in a few dozen characters."""
    document = {"format": "parity-harness-manifest", "version": 1, "world_size": 2, "backend": "gloo", "ranks": []}
    document[field] = WIDE
    path = tmp_path / "run.manifest.json"
    path.write_text(json.dumps(document))
    with pytest.raises(BundleFormatError) as caught:
        read_manifest(path)
    assert len(str(caught.value)) < 500


@pytest.mark.parametrize(
    "entry",
    [
        {"dtype": "F32", "shape": [-1, *range(100_000)], "data_offsets": [0, 0]},
        {"dtype": "F32", "shape": [2], "data_offsets": list(range(100_000))},
        {"dtype": ["F32"] * 100_000, "shape": [2], "data_offsets": [0, 8]},
    ],
    ids=["shape", "data_offsets", "dtype"],
)
@pytest.mark.parametrize("name", ["w", "w" * 100_000])
def test_a_safetensors_header_holding_huge_values_gives_a_short_message(
    entry: dict[str, object], name: str, tmp_path: Path
) -> None:
    """A checkpoint from elsewhere: its header's entry (or the tensor's name) is quoted in a few dozen characters."""
    raw = json.dumps({name: entry}).encode()
    raw += b" " * (-len(raw) % 8)
    path = tmp_path / "model.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * 8)
    with pytest.raises(CheckpointError) as caught:
        read_safetensors_header(path)
    assert len(str(caught.value)) < len(str(path)) + 400
