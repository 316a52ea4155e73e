"""Reports beyond the tables: the markdown report and the progress line."""

from __future__ import annotations

import io
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from parity_harness.replay.cli.replay_compare import main
from parity_harness.replay.compare.runner import compare_run
from parity_harness.replay.reader import BundleReader
from parity_harness.replay.report.progress import ProgressLine
from tests.models import build_tiny

TINY = f"{Path(__file__).resolve().parent.parent / 'models.py'}:build_tiny"


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_markdown_report_names_origin_and_worst_records(tiny_bundle: Path, tmp_path: Path) -> None:
    """--report writes markdown with the result, summary table, first origin and the worst records."""
    state = build_tiny().state_dict()
    state["blocks.1.lin.weight"][0, 0] += 0.01
    ckpt, report = tmp_path / "bad.pt", tmp_path / "report.md"
    torch.save(state, ckpt)
    result = CliRunner().invoke(
        main, ["--bundle", str(tiny_bundle), "--model", TINY, "--ckpt", str(ckpt), "--isolate", "--report", str(report)]
    )
    assert result.exit_code == 1, result.output
    text = report.read_text()
    assert text.startswith("# parity-harness replay report\n")
    assert "**RESULT: MISMATCH" in text
    assert "| kind       | compared   |" in text
    assert "- **first origin, forward**: `blocks.1.lin` (`blocks.1.lin/0/output`)" in text
    rows = [line for line in text.split("## Worst records", 1)[1].splitlines() if line.startswith("| ")]
    verdicts = [row.rstrip(" |").rsplit("|", 1)[1].strip() for row in rows[1:]]  # rows[0] is the header
    origins = verdicts.count("origin")
    assert origins >= 1
    assert set(verdicts[:origins]) == {"origin"}  # origins lead the list
    assert any("blocks.1.lin/0/output" in row for row in rows[1 : origins + 1])


def test_progress_line_draws_on_a_terminal_only() -> None:
    """The progress line is drawn (and erased) on a terminal, and stays silent elsewhere or with --quiet."""
    terminal = _Terminal()
    line = ProgressLine("replay-compare", terminal)
    line("forward", 10, 10)
    line.close()
    assert terminal.getvalue().startswith("\rreplay-compare: forward 10/10")
    assert terminal.getvalue().endswith("\r")
    for stream, enabled in ((io.StringIO(), True), (_Terminal(), False)):
        quiet = ProgressLine("replay-compare", stream, enabled=enabled)
        quiet("forward", 1, 1)
        quiet.close()
        assert stream.getvalue() == ""


def test_progress_counts_reach_the_bundle_totals(tiny_bundle: Path) -> None:
    """compare_run reports every forward and backward record and every isolated call, up to their totals."""
    seen: dict[str, tuple[int, int]] = {}
    with BundleReader(tiny_bundle) as reader:
        compare_run(
            build_tiny(), reader, isolate=True, progress=lambda phase, done, total: seen.update({phase: (done, total)})
        )
        calls = len(reader.index.calls)
        backward = len(reader.index.backward_order)
    assert seen["backward"] == (backward, backward)
    assert seen["isolate"] == (calls, calls)
    assert seen["forward"][0] == seen["forward"][1]


def test_plot_writes_a_png(tiny_bundle: Path, tmp_path: Path) -> None:
    """--plot draws the per-record errors to a PNG file."""
    pytest.importorskip("matplotlib")
    from parity_harness.replay.report.plot import plot_errors

    model = build_tiny()
    with torch.no_grad():
        model.blocks[1].lin.weight[0, 0] += 0.01
    with BundleReader(tiny_bundle) as reader:
        result = compare_run(model, reader, isolate=True)
    image = tmp_path / "errors.png"
    plot_errors(result, image)
    assert image.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert image.stat().st_size > 10_000


def test_a_plot_that_fails_to_write_leaves_the_earlier_image(
    tiny_bundle: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """savefig wrote in place: a write failing part way left a truncated PNG where the earlier plot was."""
    pytest.importorskip("matplotlib")
    import os

    from parity_harness.common.errors import InputError
    from parity_harness.replay.report.plot import plot_errors

    with BundleReader(tiny_bundle) as reader:
        result = compare_run(build_tiny(), reader)
    image = tmp_path / "errors.png"
    image.write_bytes(b"the earlier plot")

    def full_disk(source: object, target: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", full_disk)
    with pytest.raises(InputError, match="No space left on device"):
        plot_errors(result, image)
    assert image.read_bytes() == b"the earlier plot"
    assert sorted(path.name for path in tmp_path.iterdir()) == ["errors.png", "tiny.h5"]  # no temporary left


@pytest.mark.parametrize("name", ["errors", "errors.txt"])
def test_a_plot_path_without_an_image_suffix_is_refused_before_the_run(tiny_bundle: Path, name: str) -> None:
    """matplotlib wrote 'errors' to errors.png (exit 0), and refused .txt only after the whole comparison."""
    pytest.importorskip("matplotlib")
    result = CliRunner().invoke(main, ["--bundle", str(tiny_bundle), "--model", "nowhere:none", "--plot", name])
    assert result.exit_code == 2
    assert "expected a file name ending in .png, .svg, .pdf" in result.stderr


class _Dollars(torch.nn.Module):
    """A module named with matplotlib's math markup (a legal torch name), before a head."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.add_module("$\\nosuchcmd{$", torch.nn.Linear(4, 4))
        self.head = torch.nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(getattr(self, "$\\nosuchcmd{$")(x))


def test_plot_draws_module_names_as_written(tmp_path: Path) -> None:
    """A module name holding ``$...$`` is drawn as text, not parsed as math (which failed the whole --plot)."""
    pytest.importorskip("matplotlib")
    from parity_harness.capture.record.recorder import capture_run
    from parity_harness.replay.report.plot import plot_errors

    bundle = tmp_path / "dollars.h5"
    capture_run(_Dollars(0), {"x": torch.randn(2, 4, generator=torch.Generator().manual_seed(1))}, bundle, seed=0)
    with BundleReader(bundle) as reader:
        result = compare_run(_Dollars(1), reader, isolate=True)
    assert not result.match
    image = tmp_path / "errors.png"
    plot_errors(result, image)
    assert image.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_marks_the_first_divergence_the_report_names(tiny_bundle: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A record the rounding rule left undecided is no divergence found: the plot marked the first record that did
    not match, an undecided one before the real failure included, where the report names the real failure."""
    pytest.importorskip("matplotlib")
    import dataclasses

    from parity_harness.replay.report import plot
    from parity_harness.replay.result import RoundingCheck

    model = build_tiny()
    with torch.no_grad():
        model.blocks[1].lin.weight[0, 0] += 0.01
    with BundleReader(tiny_bundle) as reader:
        result = compare_run(model, reader)
    forward = result.of_kind("forward")
    failing = [i for i, r in enumerate(forward) if not r.match]
    assert failing
    first = forward[failing[0]]
    # An earlier record of another module, made undecided: out of atol/rtol, the rounding rule unable to judge it.
    earlier = next(r for r in reversed(forward[: failing[0]]) if r.module != first.module)
    undecided = dataclasses.replace(
        earlier,
        diff=dataclasses.replace(earlier.diff, match=False),
        rounding=RoundingCheck(None, 0.0, False, "the float64 rerun did not run", decided=False),
    )
    result.records[result.records.index(earlier)] = undecided
    assert undecided.undecided
    assert result.first_divergence("forward") is first
    from matplotlib.axes import Axes

    marked: list[str] = []
    draw = Axes.axvline

    def spy(axes: Axes, *args: object, **kwargs: object) -> object:
        marked.append(str(kwargs.get("label", "")))
        return draw(axes, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(Axes, "axvline", spy)
    plot.plot_errors(result, tiny_bundle.with_suffix(".png"))
    marked = [label for label in marked if label.startswith("first divergence")]
    assert marked[0] == f"first divergence: {first.module}"


def test_plot_without_matplotlib_says_how_to_get_it(
    tiny_bundle: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without matplotlib, --plot fails with exit 2 and the install command."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    result = CliRunner().invoke(
        main, ["--bundle", str(tiny_bundle), "--model", TINY, "--plot", str(tmp_path / "e.png")]
    )
    assert result.exit_code == 2
    assert "pip install 'parity-harness[plot]'" in result.stderr


def test_a_result_with_nothing_compared_is_never_a_match() -> None:
    """A bundle holding nothing the port produced (crafted, or emptied) compares no record: INCOMPLETE, not MATCH,
    and the RESULT line says nothing was compared."""
    from parity_harness.replay.report.tables import result_line
    from parity_harness.replay.result import ComparisonResult

    empty = ComparisonResult()
    assert empty.verdict == "INCOMPLETE"
    assert not empty.match
    assert "nothing was compared" in result_line(empty)


def test_listing_escapes_control_characters_from_the_bundle(tiny_bundle: Path) -> None:
    """A provenance string with a terminal escape and a newline cannot drive the terminal or forge a line."""
    import h5py

    from parity_harness.replay.reader import BundleReader
    from parity_harness.replay.report.listing import render_listing

    with h5py.File(tiny_bundle, "r+") as file:
        file["provenance"].attrs["host"] = "box\x1b]0;owned\x07\nRESULT: MATCH (forged)"
    with BundleReader(tiny_bundle) as reader:
        listing = render_listing(reader)
    assert "\x1b" not in listing
    assert not any(line.startswith("RESULT:") for line in listing.splitlines())
    assert "box\\x1b]0;owned\\x07\\nRESULT: MATCH (forged)" in listing
