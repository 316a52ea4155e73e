"""A bundle opened again in one process (a test suite asserting parity test after test) decodes and checks its index
once; nothing of that vouches for another file, another walk or another verification setting, and no replay changes
an index once decoded."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest

from parity_harness.common.errors import BundleFormatError, InputError
from parity_harness.common.format.bundle.migrations import migrate
from parity_harness.common.format.bundle.schema import parse_index
from parity_harness.common.format.containment import file_identity
from parity_harness.common.format.packing import unpack
from parity_harness.replay import reader as reader_module
from parity_harness.replay.compare.runner import compare_run
from parity_harness.replay.reader import BundleReader
from tests.models import build_tiny, tiny_inputs


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """How often indexes are decoded and checked against a walk, in a process that remembers none yet."""
    monkeypatch.setattr(reader_module, "_decoded", reader_module._RecentIndexes(4, largest=2 << 20))
    counts = {"decoded": 0, "checked": 0}
    decode, check = reader_module.parse_index, BundleReader._check_datasets

    def counted_decode(document: Any) -> Any:
        counts["decoded"] += 1
        return decode(document)

    def counted_check(reader: BundleReader) -> None:
        counts["checked"] += 1
        check(reader)

    monkeypatch.setattr(reader_module, "parse_index", counted_decode)
    monkeypatch.setattr(BundleReader, "_check_datasets", counted_check)
    return counts


def raw_index(path: Path) -> bytes:
    with h5py.File(path, "r") as file:
        return bytes(file["index"][()].tobytes())


def test_an_unchanged_bundle_decodes_and_checks_its_index_once(tiny_bundle: Path, counted: dict[str, int]) -> None:
    """Three openings, one decoding and one check, one index shared; the same bytes in a copy are not decoded again
    but are checked against the copy's own walk, and a reader that verifies checksums checks again after one that
    did not."""
    indexes = []
    for _ in range(3):
        with BundleReader(tiny_bundle) as reader:
            indexes.append(reader.index)
    assert counted == {"decoded": 1, "checked": 1}
    assert indexes[0] is indexes[1] is indexes[2]
    copy = tiny_bundle.with_name("copy.h5")
    shutil.copyfile(tiny_bundle, copy)
    with BundleReader(copy) as reader:
        assert reader.index is indexes[0]
    assert counted == {"decoded": 1, "checked": 2}
    with BundleReader(copy, verify=False):
        pass
    assert counted == {"decoded": 1, "checked": 3}


def test_an_index_too_large_to_keep_is_decoded_at_each_opening(
    tiny_bundle: Path, counted: dict[str, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The process keeps only indexes of bounded size (their decoded objects are several times their bytes)."""
    monkeypatch.setattr(
        reader_module, "_decoded", reader_module._RecentIndexes(4, largest=len(raw_index(tiny_bundle)) - 1)
    )
    for _ in range(2):
        BundleReader(tiny_bundle).close()
    assert counted == {"decoded": 2, "checked": 2}


def _reshaped(file: h5py.File) -> None:
    label = file["params/head.weight"].attrs["dtype"]
    del file["params/head.weight"]
    file.create_dataset("params/head.weight", data=np.zeros((1, 1), dtype=np.float32)).attrs["dtype"] = label


def _orphan(file: h5py.File) -> None:
    file.create_dataset("params/extra", data=np.zeros(3, dtype=np.float32)).attrs["dtype"] = "F32"


def _rng_flipped(file: h5py.File) -> None:
    file["rng/torch_cpu"][0] ^= 1


@pytest.mark.parametrize(
    ("damage", "refused"),
    [
        (_reshaped, "shape \\(1, 1\\) != .* declared in the index"),
        (_orphan, "not named by the index, e.g. /params/extra"),
        (_rng_flipped, "rng/torch_cpu: checksum mismatch"),
    ],
)
def test_a_remembered_index_vouches_for_no_other_file(
    tiny_bundle: Path, counted: dict[str, int], damage: Callable[[h5py.File], None], refused: str
) -> None:
    """A file holding the same index bytes as one opened before, whose datasets do not agree with them, is refused
    as it would be in a fresh process."""
    BundleReader(tiny_bundle).close()
    copy = tiny_bundle.with_name("damaged.h5")
    shutil.copyfile(tiny_bundle, copy)
    with h5py.File(copy, "r+") as file:
        damage(file)
    assert raw_index(copy) == raw_index(tiny_bundle)
    for _ in range(2):  # and again: a check that failed vouches for nothing
        with pytest.raises(BundleFormatError, match=refused):
            BundleReader(copy)
    assert counted["decoded"] == 1


def test_a_bundle_without_checksums_stays_unverified_after_a_reading_without_verification(
    tmp_path: Path, counted: dict[str, int]
) -> None:
    """Read with verification off first, a bundle without checksums is still refused as unverified with it on."""
    from parity_harness.capture.record.recorder import capture_run

    out = tmp_path / "plain.h5"
    capture_run(build_tiny(), tiny_inputs(), out, checksums=False)
    BundleReader(out, verify=False).close()
    with pytest.raises(BundleFormatError, match="unverified: the bundle has no checksums"):
        BundleReader(out)


def test_no_replay_changes_the_index_it_shares(tiny_bundle: Path, counted: dict[str, int]) -> None:
    """Replays of every kind leave the shared index as its bytes decode: the next opening would otherwise start
    from what an earlier replay changed."""
    from parity_harness.replay.report.listing import render_listing

    raw = raw_index(tiny_bundle)
    with BundleReader(tiny_bundle) as reader:
        shared = reader.index
        assert compare_run(build_tiny(), reader).match
        assert compare_run(build_tiny(), reader, isolate=True).match
        off = build_tiny()
        off.head.weight.data.mul_(1 + 1e-6)
        compare_run(off, reader)  # fails narrowly: the rounding check's float64 rerun runs
        render_listing(reader)
    with BundleReader(tiny_bundle) as reader:
        assert reader.index is shared
    assert counted["decoded"] == 1
    fresh = parse_index(migrate(unpack(raw, where="index"), 1))
    assert shared.to_dict() == fresh.to_dict()


def test_the_rng_state_is_checked_at_every_opening(
    tiny_bundle: Path, counted: dict[str, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The RNG state's checksum is a matter of the file's bytes, not of its index: checked again at each opening,
    even one whose walk is remembered (a file rewritten within one tick of the file system's clock keeps its
    identity, so its walk is reused)."""
    with BundleReader(tiny_bundle):
        pass
    remembered = reader_module._walked.get(file_identity(tiny_bundle.stat()))
    assert remembered is not None
    with h5py.File(tiny_bundle, "r+") as file:
        _rng_flipped(file)
    monkeypatch.setattr(reader_module._walked, "get", lambda identity: remembered)
    monkeypatch.setattr(type(remembered), "describes", lambda self, status: True)
    with pytest.raises(BundleFormatError, match="rng/torch_cpu: checksum mismatch"):
        BundleReader(tiny_bundle)
    assert counted == {"decoded": 1, "checked": 1}


def test_another_index_is_decoded_as_its_own(tiny_bundle: Path, tmp_path: Path, counted: dict[str, int]) -> None:
    """Another bundle's index (here of the same model on a smaller batch) is decoded from its own bytes."""
    from parity_harness.capture.record.recorder import capture_run

    other = tmp_path / "other.h5"
    capture_run(build_tiny(), {"x": tiny_inputs()["x"][:1]}, other, seed=42)
    with BundleReader(tiny_bundle) as first, BundleReader(other) as second:
        assert first.index.to_dict() != second.index.to_dict()
        assert second.index.to_dict() == parse_index(migrate(unpack(raw_index(other), where="index"), 1)).to_dict()
    assert counted == {"decoded": 2, "checked": 2}


def test_what_the_process_keeps_is_bounded(tiny_bundle: Path, tmp_path: Path, counted: dict[str, int]) -> None:
    """Four indexes at most, each remembering at most the walks the process keeps (four), and none handed over for
    one opening only (a catalog given by the caller, as the command-line tools do)."""
    from parity_harness.capture.record.recorder import capture_run
    from parity_harness.replay.preflight import preflight

    bundles = []
    for batch in range(1, 7):
        path = tmp_path / f"b{batch}.h5"
        capture_run(build_tiny(), {"x": tiny_inputs()["x"].repeat(batch, 1, 1)}, path, seed=42)
        bundles.append(path)
        BundleReader(path).close()
    assert len(reader_module._decoded._entries) == 4
    copies = []
    for number in range(6):
        copy = tmp_path / f"copy{number}.h5"
        shutil.copyfile(bundles[-1], copy)
        copies.append(copy)
        BundleReader(copy).close()
    (entry,) = [e for e in reader_module._decoded._entries if e.raw == raw_index(bundles[-1])]
    assert len(entry.checked) == 4
    assert all(reader_module._walked.holds(walked) for walked, _ in entry.checked)
    catalog = preflight(copies[0], seconds=30, label="dtype")
    assert catalog is not None
    BundleReader(copies[0], catalog=catalog).close()
    assert not any(walked is catalog.datasets for walked, _ in entry.checked)


def test_what_is_built_from_an_index_is_built_once_for_it(
    tiny_bundle: Path, tmp_path: Path, counted: dict[str, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A replay's record plan is built once for a shared index, replay after replay, and for another index its own;
    an index too large to share gets one per opening. Replays sharing one compare every record alike."""
    from parity_harness.capture.record.recorder import capture_run
    from parity_harness.replay.compare.records import RecordPlan

    builds: list[int] = []
    make = RecordPlan.of

    def build(index: Any) -> RecordPlan:
        builds.append(id(index))
        return make(index)

    monkeypatch.setattr(RecordPlan, "of", staticmethod(build))
    results = []
    for _ in range(3):
        with BundleReader(tiny_bundle) as reader:
            results.append(sorted((r.name, r.match) for r in compare_run(build_tiny(), reader).records))
    assert len(builds) == 1
    assert results[0] == results[1] == results[2]
    assert all(match for _, match in results[0])
    other = tmp_path / "other.h5"
    capture_run(build_tiny(), {"x": tiny_inputs()["x"][:1]}, other, seed=42)
    with BundleReader(other) as reader:
        compare_run(build_tiny(), reader)
    assert len(builds) == 2
    monkeypatch.setattr(reader_module, "_decoded", reader_module._RecentIndexes(4, largest=0))
    for _ in range(2):
        with BundleReader(tiny_bundle) as reader:
            compare_run(build_tiny(), reader)
    assert len(builds) == 4


def test_what_is_derived_from_a_walk_is_derived_once_for_it(
    tiny_bundle: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The largest record and the names per dataset come from a kept walk once, opening after opening; a file
    changed since is walked, and its facts derived, anew; a walk not kept (too many files) derives them each time."""
    monkeypatch.setattr(reader_module, "_walked", reader_module._RecentWalks(1))
    derived: list[int] = []
    derive = reader_module._WalkFacts.of

    def counted(datasets: Any) -> Any:
        derived.append(len(datasets))
        return derive(datasets)

    monkeypatch.setattr(reader_module._WalkFacts, "of", staticmethod(counted))
    for _ in range(3):
        with BundleReader(tiny_bundle) as reader:
            assert reader.largest_record_bytes == max(s.nbytes for s in reader._stored.values())
    assert len(derived) == 1
    other = tmp_path / "other.h5"
    shutil.copy(tiny_bundle, other)
    for path in (other, tiny_bundle, other):  # one walk kept: each opening walks and derives again
        BundleReader(path).close()
    assert len(derived) == 4
    with h5py.File(tiny_bundle, "r+") as file:  # changed: another identity, another walk
        file.attrs["note"] = "changed"
    BundleReader(tiny_bundle).close()
    BundleReader(tiny_bundle).close()
    assert len(derived) == 5


def test_the_provenance_is_read_once_per_walk_and_never_stale(tiny_bundle: Path) -> None:
    """Openings of one file unchanged share its provenance as first read; a file written since shows what it holds
    now; what a caller does with the dict it gets changes nothing for the next opening."""
    from parity_harness.common.format.bundle.layout import PROVENANCE

    with BundleReader(tiny_bundle) as reader:
        first = reader.provenance()
        first["torch"] = "changed by a caller"
    with BundleReader(tiny_bundle) as reader:
        again = reader.provenance()
    assert again["torch"] != "changed by a caller"
    with h5py.File(tiny_bundle, "r+") as file:
        file[PROVENANCE].attrs["torch"] = "rewritten"
    with BundleReader(tiny_bundle) as reader:
        assert reader.provenance()["torch"] == "rewritten"
    with pytest.raises(InputError, match="the reader is closed"):  # not an empty provenance, kept for the next
        reader.provenance()
    with BundleReader(tiny_bundle) as reader:
        assert reader.provenance()["torch"] == "rewritten"
