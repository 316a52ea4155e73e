"""Format evolution: every committed golden bundle still reads and replays; the spec matches what is written."""

from __future__ import annotations

import re
from pathlib import Path

import h5py
import pytest

from parity_harness.capture.record.recorder import capture_run
from parity_harness.common.format.packing import unpack
from parity_harness.common.numerics.tolerances import Tolerance, ToleranceTable
from parity_harness.replay.compare.runner import compare_run
from parity_harness.replay.reader import BundleReader
from tests.golden import DATA, GOLDEN_CASES, batchnorm_inputs, build_batchnorm, logits_loss
from tests.models import build_tiny, tiny_inputs

SPEC = Path(__file__).resolve().parent.parent / "docs" / "bundle-format.md"
GOLDEN_FILES = sorted(DATA.glob("golden-*.h5"))
CASES = {case.name: case for case in GOLDEN_CASES}


def test_there_are_golden_bundles_of_every_case() -> None:
    """scripts/make_golden_bundles.py was run for the current cases (at least one version each)."""
    names = {re.fullmatch(r"golden-\d+\.\d+-(.+)\.h5", path.name).group(1) for path in GOLDEN_FILES}  # type: ignore[union-attr]
    assert set(CASES) <= names


@pytest.mark.parametrize("path", GOLDEN_FILES, ids=[path.stem for path in GOLDEN_FILES])
def test_golden_bundle_reads_verifies_and_replays(path: Path) -> None:
    """The reader accepts it, every tensor passes its checksum, and the same model replays it."""
    version, name = re.fullmatch(r"golden-(\d+\.\d+)-(.+)\.h5", path.name).groups()  # type: ignore[union-attr]
    with BundleReader(path) as reader:
        assert f"{reader.format_version}.{reader.format_minor}" == version
        for ref in reader.index.tensor_refs():
            if reader.summary(ref) is None:
                reader.read_array(ref)  # verifies the CRC-32 where the version has them
        case = CASES[name]
        # Another machine's bundle: records kept as statistics may differ in their last bits (accepted, not proven).
        tolerance = ToleranceTable(Tolerance(1e-6, 1e-6))
        result = compare_run(case.build(), reader, loss=case.loss, tolerances=tolerance, accept_statistics=True)
    assert result.match, [r.name for r in result.records if not r.match][:5]
    assert (result.bundle_only, result.replay_only) == ([], [])


def _documented_rows(heading: str) -> list[str]:
    """The first cells of the markdown table under ``heading``."""
    text = SPEC.read_text()
    section = text[text.index(heading) :]
    rows = []
    for line in section.splitlines()[2:]:
        if line.startswith(("## ", "### ")):
            break
        if line.startswith("| `"):
            rows.append(line.split("|")[1].strip())
    return rows


@pytest.fixture(scope="module")
def fresh_bundles(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """Three fresh bundles: one with a seeded cotangent, one with a loss, one of a train-mode BatchNorm whose input
    requires grad."""
    folder = tmp_path_factory.mktemp("spec")
    capture_run(build_tiny(), tiny_inputs(), folder / "cotangent.h5", noise_floor=True)
    capture_run(build_tiny(), tiny_inputs(), folder / "loss.h5", loss=logits_loss)
    inputs = tuple(tensor.requires_grad_() for tensor in batchnorm_inputs())  # their gradients recorded too
    capture_run(build_batchnorm(), inputs, folder / "buffers.h5", train_mode=True)
    return [folder / "cotangent.h5", folder / "loss.h5", folder / "buffers.h5"]


def test_every_documented_path_exists_in_a_fresh_bundle(fresh_bundles: list[Path]) -> None:
    """Each row of the spec's 'Groups, datasets and attributes' table names something a capture writes."""
    documented = _documented_rows("## Groups, datasets and attributes")
    assert len(documented) >= 10
    names: set[str] = set()
    root_attrs: set[str] = set()
    for bundle in fresh_bundles:
        with h5py.File(bundle, "r") as file:
            file.visit(lambda name: names.add("/" + name))
            root_attrs |= set(file.attrs)
            provenance = set(file["provenance"].attrs)
            for name in names:
                node = file.get(name)
                if isinstance(node, h5py.Dataset) and name.startswith(("/params", "/modules", "/inputs")):
                    assert "dtype" in node.attrs, name
    for row in documented:
        root_attr = re.fullmatch(r"`/` attr `(\w+)`", row)
        if root_attr:
            assert root_attr.group(1) in root_attrs, f"documented root attribute {row} is not written"
            continue
        path = re.match(r"`([^`]+)`", row).group(1)  # type: ignore[union-attr]
        pattern = re.sub(r"<[^>]+>", "@", path).replace(".", r"\.").replace("@", ".+")
        assert any(re.fullmatch(pattern, name) for name in names), f"documented {row} is not in a fresh bundle"
    assert {"harness", "python", "torch", "numpy", "h5py", "msgpack", "device", "command_line"} <= provenance


def test_every_documented_index_key_exists_in_a_fresh_index(fresh_bundles: list[Path]) -> None:
    """Each key of the spec's index table is in a fresh index (optional ones included)."""
    documented = {key for row in _documented_rows("## The index") for key in re.findall(r"`([^`]+)`", row)}
    assert {"run", "calls", "checksums", "selection"} <= documented
    present: set[str] = set()
    for bundle in fresh_bundles:
        with h5py.File(bundle, "r") as file:
            present |= set(unpack(file["index"][()], where="index"))
    assert documented <= present, documented - present
