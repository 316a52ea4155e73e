"""Selection: which modules and kinds a capture records, and sizes given on the command line."""

from __future__ import annotations

import pytest

from parity_harness.common.errors import BundleFormatError, InputError
from parity_harness.common.format.bundle.selection import RECORD_KINDS, Selection, parse_byte_size, parse_selection


@pytest.mark.parametrize(
    ("layers", "skip", "path", "recorded"),
    [
        ((), (), "encoder.layers.0.attn", True),
        (("encoder.layers.1*",), (), "encoder.layers.1.attn.q", True),
        (("encoder.layers.1*",), (), "encoder.layers.0", False),
        (("encoder",), (), "encoder.layers.0.attn", True),  # a parent matches
        (("encoder",), (), "decoder", False),
        ((), ("*.dropout",), "encoder.layers.0.dropout", False),
        ((), ("encoder.layers.0",), "encoder.layers.0.attn.q", False),  # a skipped parent skips children
        (("encoder*",), ("encoder.layers.0",), "encoder.layers.0", False),  # skip wins
        (("encoder*",), ("encoder.layers.0",), "encoder.layers.10", True),  # no accidental prefix match
    ],
)
def test_modules_selected_by_globs(layers: tuple[str, ...], skip: tuple[str, ...], path: str, recorded: bool) -> None:
    """--layers includes a module when it or a parent matches; --skip-layers excludes likewise and wins."""
    assert Selection(layers=layers, skip_layers=skip).records_module(path) is recorded


def test_default_records_everything_in_full() -> None:
    """The default selection records every kind, every module, nothing as statistics."""
    selection = Selection()
    assert selection.is_everything
    assert all(selection.records(kind) for kind in RECORD_KINDS)
    assert not selection.as_statistics(1 << 40)
    assert selection.describe() == "everything"


def test_statistics_by_size_or_everywhere() -> None:
    """--max-tensor-bytes summarises only larger tensors; --summary-only all of them."""
    assert Selection(max_tensor_bytes=100).as_statistics(101)
    assert not Selection(max_tensor_bytes=100).as_statistics(100)
    assert Selection(summary_only=True).as_statistics(1)


def test_unknown_kind_is_refused() -> None:
    """A typo in --record is an input error listing the known kinds."""
    with pytest.raises(InputError, match=r"unknown record kind\(s\) \['gards'\]; expected some of inputs, outputs"):
        Selection(kinds=("gards",))


def test_selection_round_trips_and_damage_is_refused() -> None:
    """to_dict/parse_selection round-trip; a damaged section is a BundleFormatError."""
    selection = Selection(("outputs",), ("a*",), ("a.b",), True, 64)
    assert parse_selection(selection.to_dict()) == selection
    for damaged in ([], {"kinds": "outputs"}, {"kinds": ["bogus"]}, {"max_tensor_bytes": -1}):
        with pytest.raises(BundleFormatError, match="selection"):
            parse_selection(damaged)


@pytest.mark.parametrize(
    ("text", "size"), [("4096", 4096), ("64MB", 64 << 20), ("1g", 1 << 30), ("1.5K", 1536), (" 2M ", 2 << 20)]
)
def test_byte_sizes(text: str, size: int) -> None:
    """Sizes take plain bytes or binary K/M/G units."""
    assert parse_byte_size(text) == size


@pytest.mark.parametrize("text", ["", "MB", "12XB", "-5", "ten"])
def test_bad_byte_sizes(text: str) -> None:
    """Anything else is an input error that shows an example."""
    with pytest.raises(InputError, match=r"e\.g\. 4096, 64MB or 1G"):
        parse_byte_size(text)
