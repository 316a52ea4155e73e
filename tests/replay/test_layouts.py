"""A port with other names, split projections and another layout passes via a map file and via --map auto."""

from __future__ import annotations

from pathlib import Path

import pytest

from parity_harness.capture.record.recorder import capture_run
from parity_harness.common.numerics.tolerances import Tolerance, ToleranceTable
from parity_harness.replay.compare.runner import compare_run
from parity_harness.replay.naming.alignment import align_modules
from parity_harness.replay.naming.mapping import RenameMap, parse_map
from parity_harness.replay.reader import BundleReader
from tests.models import SPLIT_PORT_MAP, build_fused_ref, frames, split_port_from, split_port_to_reference

TOLERANCE = ToleranceTable(Tolerance(1e-5, 1e-5))


@pytest.fixture
def fused_bundle(tmp_path: Path) -> Path:
    """A capture of the fused-qkv reference."""
    path = tmp_path / "fused.h5"
    capture_run(build_fused_ref(), frames(), path)
    return path


# The fused qkv projection has no counterpart in the split port (its q, k, v are mapped to "-").
FUSED_QKV = ("attn.qkv*",)


def _replay(
    bundle: Path,
    rename: RenameMap,
    *,
    isolate: bool = False,
    transform: bool = True,
    waive: tuple[str, ...] = FUSED_QKV,
):
    with BundleReader(bundle) as reader:
        return compare_run(
            split_port_from(build_fused_ref()),
            reader,
            tolerances=TOLERANCE,
            rename=rename,
            isolate=isolate,
            to_reference=split_port_to_reference if transform else None,
            waive=waive,
        )


def test_split_port_passes_with_a_map_file(fused_bundle: Path) -> None:
    """With the map file and the layout transform, every compared record matches, the mixer's included."""
    result = _replay(fused_bundle, parse_map(SPLIT_PORT_MAP))
    assert result.match, [r.name for r in result.records if not r.match]
    names = {r.name for r in result.records}
    assert {"mixer/0/output", "mixer/0/grad_output", "attn.out/0/output", "head.weight"} <= names
    assert "attn.qkv.weight" in result.waived  # split on the port side: waived, not compared
    assert result.complete


def test_a_split_projection_left_unwaived_makes_the_run_incomplete(fused_bundle: Path) -> None:
    """Without the waiver the fused projection's gradient and records are uncompared: INCOMPLETE, never MATCH."""
    result = _replay(fused_bundle, parse_map(SPLIT_PORT_MAP), waive=())
    assert all(r.match for r in result.records)
    assert (result.verdict, result.match) == ("INCOMPLETE", False)
    coverage = result.coverage()
    assert "attn.qkv.weight" in coverage["param_grad"].missing
    assert "attn.qkv/0/output" in coverage["forward"].missing


def test_layout_difference_without_transform_is_a_shape_mismatch(fused_bundle: Path) -> None:
    """Without the adapter's to_reference, the channels-first output is a shape mismatch naming both shapes."""
    result = _replay(fused_bundle, parse_map(SPLIT_PORT_MAP), transform=False)
    record = next(r for r in result.records if r.name == "mixer/0/output")
    assert record.diff.problem == "shape (2, 16, 6) != expected (2, 6, 16)"


def test_map_auto_proposes_the_hand_written_map(fused_bundle: Path) -> None:
    """--map auto pairs renamed modules (the mixer despite its layout) and leaves the split projections out."""
    with BundleReader(fused_bundle) as reader:
        proposal = align_modules(split_port_from(build_fused_ref()), reader)
    assert proposal.pairs == {
        "inp": "proj",
        "attention.o": "attn.out",
        "attention": "attn",
        "mix.conv": "mixer.conv",
        "mix": "mixer",
        "classifier": "head",
    }
    assert sorted(proposal.unmatched) == ["attention.k", "attention.q", "attention.v"]
    assert proposal.evidence["mix"] == "weights below"  # a container of the same weights
    assert proposal.evidence["attention.o"] == "weights"
    assert proposal.fused["attn.qkv.weight"] == ("attention.q.weight", "attention.k.weight", "attention.v.weight")
    assert _replay(fused_bundle, proposal.rename_map()).match


def test_saved_auto_map_round_trips(fused_bundle: Path) -> None:
    """The saved proposal parses as a map file and renames exactly as the proposal does."""
    with BundleReader(fused_bundle) as reader:
        proposal = align_modules(split_port_from(build_fused_ref()), reader)
    reparsed = parse_map(proposal.to_text())
    for module in [*proposal.pairs, *proposal.unmatched]:
        assert reparsed.module(module) == proposal.rename_map().module(module)


def test_isolation_through_a_layout_transform(fused_bundle: Path) -> None:
    """Isolating the channels-first mixer compares its output and input gradient in the reference's layout."""
    result = _replay(fused_bundle, parse_map(SPLIT_PORT_MAP), isolate=True)
    assert result.not_isolated == {}
    verdicts = {r.name: (r.verdict, r.local) for r in result.records}
    assert verdicts["mixer/0/output"][0] == "ok"
    assert verdicts["mixer/0/grad_input.x"][1] is not None
    assert verdicts["mixer/0/grad_input.x"][1].match


def test_cli_map_auto_saves_a_map_equivalent_to_the_examples(
    ref_bundle: Path, ref_checkpoint: Path, tmp_path: Path
) -> None:
    """replay-compare --map auto on the example port passes and saves a map renaming like the hand-written one."""
    from click.testing import CliRunner

    from parity_harness.replay.cli.replay_compare import main
    from parity_harness.replay.naming.mapping import read_map
    from tests.conftest import PORT_DIR, PORT_MAP

    saved = tmp_path / "auto.map"
    args = ["--bundle", str(ref_bundle), "--ckpt", str(ref_checkpoint), "--adapter", str(PORT_DIR / "adapter.py")]
    waivers = [
        w
        for line in PORT_MAP.read_text().splitlines()
        if line.startswith("waive ")
        for w in ("--waive", line.split()[1])
    ]
    result = CliRunner().invoke(
        main,
        [*args, "--map", "auto", "--save-map", str(saved), "--atol", "1e-4", "--rtol", "1e-4", *waivers],
    )
    assert result.exit_code == 0, result.output
    assert "Module map proposed by --map auto" in result.stdout
    auto, manual = read_map(saved), read_map(PORT_MAP)
    port_modules = [
        line.split("$")[0].lstrip("^").replace("\\", "")
        for line in saved.read_text().splitlines()
        if line.startswith("^")
    ]
    assert len(port_modules) > 50
    assert all(auto.module(m) == manual.module(m) for m in port_modules)
    misuse = CliRunner().invoke(main, [*args, "--map", str(PORT_MAP), "--save-map", str(saved)])
    assert misuse.exit_code == 2
    assert "--save-map needs --map auto" in misuse.stderr
