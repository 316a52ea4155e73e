"""BundleReader: a good bundle opens and reads back bit-exactly; every kind of damage is refused clearly."""

from __future__ import annotations

import re
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import h5py
import msgpack
import numpy as np
import pytest
import torch

from parity_harness.capture.record.provenance import snapshot
from parity_harness.capture.record.tf32 import full_float32
from parity_harness.common.errors import BundleFormatError, BundleNotFoundError, ParityError, UnsupportedBundleVersion
from parity_harness.common.format.bundle.version import FORMAT_MINOR, FORMAT_VERSION, HARNESS_VERSION
from parity_harness.replay import reader as reader_module
from parity_harness.replay.reader import BundleReader
from parity_harness.replay.report.tables import render_provenance
from tests.models import build_tiny, tiny_inputs

# --------------------------------------------------------------------------- helpers


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two CPU tensors have the same dtype, shape and bytes (so -0.0 != 0.0 and NaN == NaN)."""
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and a.detach().contiguous().numpy().tobytes() == b.detach().contiguous().numpy().tobytes()
    )


def damaged_copy(bundle: Path, mutate: Callable[[h5py.File], None]) -> Path:
    """A copy of ``bundle`` changed in place by ``mutate`` (opened with h5py in r+ mode)."""
    copy = bundle.with_name("damaged.h5")
    shutil.copyfile(bundle, copy)
    with h5py.File(copy, "r+") as file:
        mutate(file)
    return copy


def open_error(path: Path) -> ParityError:
    """Open ``path`` expecting a ParityError; check it is one line naming the file and return it."""
    with pytest.raises(ParityError) as caught:
        BundleReader(path)
    message = str(caught.value)
    assert "\n" not in message, message
    assert str(path) in message, message
    return caught.value


def replace_index(raw: bytes) -> Callable[[h5py.File], None]:
    """A mutation storing ``raw`` as the /index bytes."""

    def mutate(file: h5py.File) -> None:
        del file["index"]
        file.create_dataset("index", data=np.frombuffer(raw, dtype=np.uint8))

    return mutate


def replace_dataset(path: str, array: np.ndarray, tag: str | None) -> Callable[[h5py.File], None]:
    """A mutation replacing dataset ``path`` by ``array`` (with dtype attribute ``tag`` unless None)."""

    def mutate(file: h5py.File) -> None:
        del file[path]
        dataset = file.create_dataset(path, data=array)
        if tag is not None:
            dataset.attrs["dtype"] = tag

    return mutate


def set_attr(name: str, value: object) -> Callable[[h5py.File], None]:
    """A mutation setting a root attribute."""

    def mutate(file: h5py.File) -> None:
        file.attrs[name] = value

    return mutate


def del_attr(name: str) -> Callable[[h5py.File], None]:
    """A mutation deleting a root attribute."""

    def mutate(file: h5py.File) -> None:
        del file.attrs[name]

    return mutate


def truncate_index(file: h5py.File) -> None:
    """Keep only the first half of the index bytes (a write cut short)."""
    raw = file["index"][()].tobytes()
    replace_index(raw[: len(raw) // 2])(file)


def index_as_text(file: h5py.File) -> None:
    """Store the index as a string dataset instead of uint8 bytes."""
    del file["index"]
    file["index"] = "not an index"


LOGITS = "outputs/output.logits"  # a (2, 5, 3) float32 dataset TinyNet's bundle always has

# --------------------------------------------------------------------------- a good bundle


def test_fresh_bundle_root_attributes_are_pinned(tiny_bundle: Path) -> None:
    """A fresh bundle names the format and its version at the root, readable with plain h5py."""
    with h5py.File(tiny_bundle, "r") as file:
        attrs = file.attrs
        assert attrs["format"] == "parity-harness-bundle"
        assert isinstance(attrs["format_version"], (int, np.integer))
        assert isinstance(attrs["format_minor"], (int, np.integer))
        assert (int(attrs["format_version"]), int(attrs["format_minor"])) == (1, 6)
        assert (FORMAT_VERSION, FORMAT_MINOR) == (1, 6), "format version bumped: add a golden bundle and a migration"


def test_fresh_bundle_index_is_1d_uint8_msgpack(tiny_bundle: Path) -> None:
    """/index is a 1-D uint8 dataset holding a msgpack map, decodable without this project."""
    with h5py.File(tiny_bundle, "r") as file:
        index = file["index"]
        assert isinstance(index, h5py.Dataset)
        assert index.dtype == np.uint8
        assert index.ndim == 1
        document = msgpack.unpackb(index[()].tobytes(), raw=False, strict_map_key=False)
    assert isinstance(document, dict)
    assert {"run", "inputs", "outputs", "params", "grads", "calls"} <= set(document)


def test_good_bundle_opens_with_its_version(tiny_bundle: Path) -> None:
    """A fresh bundle validates and reports the current format version, with no warning."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with BundleReader(tiny_bundle) as reader:
            assert (reader.format_version, reader.format_minor) == (FORMAT_VERSION, FORMAT_MINOR)
            assert reader.index.run.seed == 42
            assert reader.index.run.train_mode is False


def test_inputs_rebuild_bit_exact(tiny_bundle: Path) -> None:
    """The recorded inputs rebuild as the same dict of bit-identical tensors."""
    with BundleReader(tiny_bundle) as reader:
        inputs = reader.rebuild(reader.index.inputs)
    expected = tiny_inputs()
    assert isinstance(inputs, dict)
    assert set(inputs) == set(expected) == {"x"}
    assert same_bits(inputs["x"], expected["x"])


def test_params_read_bit_exact(tiny_bundle: Path) -> None:
    """Every parameter reads back with the model's exact dtype and bits."""
    state = build_tiny().state_dict()
    with BundleReader(tiny_bundle) as reader:
        assert set(reader.index.params) == set(state)
        for name, ref in reader.index.params.items():
            assert same_bits(reader.read_tensor(ref), state[name]), name


def test_outputs_and_grads_read_bit_exact(tiny_bundle: Path) -> None:
    """Outputs (float and int) and parameter gradients equal an uninstrumented rerun bit for bit."""
    model = build_tiny().eval()
    outputs = model(**tiny_inputs())
    with BundleReader(tiny_bundle) as reader:
        recorded = reader.rebuild(reader.index.outputs)
        assert reader.index.cotangent is not None
        cotangent = reader.rebuild(reader.index.cotangent)
        grads = {name: reader.read_tensor(ref) for name, ref in reader.index.grads.items()}
    assert set(recorded) == {"logits", "label"}
    assert recorded["label"].dtype == torch.int64
    assert same_bits(recorded["logits"], outputs["logits"].detach())
    assert same_bits(recorded["label"], outputs["label"])
    outputs["logits"].backward(cotangent["output.logits"])
    assert set(grads) == {name for name, _ in model.named_parameters()}
    for name, param in model.named_parameters():
        assert param.grad is not None
        assert same_bits(grads[name], param.grad), name


def test_read_float64_matches_tensor(tiny_bundle: Path) -> None:
    """read_float64 gives the same values as float64."""
    with BundleReader(tiny_bundle) as reader:
        ref = reader.index.params["head.weight"]
        values = reader.read_float64(ref)
        assert values.dtype == np.float64
        np.testing.assert_array_equal(values, reader.read_tensor(ref).double().numpy())


def test_provenance_names_the_environment(tiny_bundle: Path) -> None:
    """Provenance records the torch and harness versions as strings."""
    with BundleReader(tiny_bundle) as reader:
        provenance = reader.provenance()
    assert provenance["torch"] == torch.__version__
    assert provenance["harness"] == HARNESS_VERSION
    assert all(isinstance(value, str) for value in provenance.values())


def test_provenance_shows_a_replay_with_the_other_tf32_convolutions(
    tiny_bundle: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """cuDNN's TF32 switch (on by default: float32 convolutions rounded to TF32 on a GPU) is recorded beside the
    matmul one, as the run used them (off, unless --allow-tf32), so a replay that ran with the other setting says so
    among the environment's differences."""
    with BundleReader(tiny_bundle) as reader:
        recorded = reader.provenance()
    assert (recorded["tf32_cudnn"], recorded["tf32_matmul"]) == ("False", "False")
    with full_float32():
        assert "tf32_cudnn" not in render_provenance(recorded, snapshot())
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", True)  # a replay with --allow-tf32, at torch's default
    assert "tf32_cudnn" in render_provenance(recorded, snapshot())
    older = {key: value for key, value in recorded.items() if key != "tf32_cudnn"}  # a bundle from before the key
    line = next(row for row in render_provenance(older, snapshot()).splitlines() if row.startswith("tf32_cudnn"))
    assert "not recorded" in line


def test_find_call_distinguishes_repeated_calls(tiny_bundle: Path) -> None:
    """A module called twice has calls 0 and 1; a module called once has no call 1."""
    with BundleReader(tiny_bundle) as reader:
        first, second = reader.find_call("blocks.0", 0), reader.find_call("blocks.0", 1)
        assert first is not None
        assert second is not None
        assert first[0] < second[0]
        assert (second[1].module, second[1].call) == ("blocks.0", 1)
        assert reader.find_call("blocks.1", 1) is None
        assert reader.find_call("no.such.module", 0) is None


# --------------------------------------------------------------------------- not a bundle


def test_missing_path_is_not_found(tmp_path: Path) -> None:
    """A path with nothing there raises BundleNotFoundError (also a FileNotFoundError)."""
    error = open_error(tmp_path / "absent.h5")
    assert isinstance(error, BundleNotFoundError)
    assert isinstance(error, FileNotFoundError)


def test_folder_is_refused(tmp_path: Path) -> None:
    """A folder is refused as not a bundle file."""
    folder = tmp_path / "bundle.h5"
    folder.mkdir()
    error = open_error(folder)
    assert type(error) is BundleFormatError
    assert "folder" in str(error)


def test_text_file_is_not_hdf5(tmp_path: Path) -> None:
    """A text file is refused as not HDF5."""
    path = tmp_path / "notes.h5"
    path.write_text("max diff 0.001\n")
    error = open_error(path)
    assert type(error) is BundleFormatError
    assert "not an HDF5 file" in str(error)


def test_plain_hdf5_is_not_a_bundle(tmp_path: Path) -> None:
    """An HDF5 file without the format attribute is 'not a parity-harness bundle', said before anything about its
    datasets (here a chunked, compressed one that no bundle holds)."""
    path = tmp_path / "other.h5"
    with h5py.File(path, "w") as file:
        file.create_dataset("weights", data=np.arange(3000), chunks=(100,), compression="gzip")
    error = open_error(path)
    assert type(error) is BundleFormatError
    assert "not a parity-harness bundle" in str(error)


# --------------------------------------------------------------------------- damaged bundles

DAMAGE = [
    pytest.param(del_attr("format"), BundleFormatError, "not a parity-harness bundle", id="format-attr-deleted"),
    pytest.param(
        set_attr("format", "someone-elses-format"), BundleFormatError, "someone-elses-format", id="format-attr-wrong"
    ),
    pytest.param(set_attr("format_version", "1"), BundleFormatError, "version attribute", id="version-is-text"),
    pytest.param(set_attr("format_version", 1.5), BundleFormatError, "version attribute", id="version-is-fraction"),
    pytest.param(del_attr("format_version"), BundleFormatError, "format_version", id="version-attr-missing"),
    pytest.param(lambda f: f.__delitem__("index"), BundleFormatError, "capture did not finish", id="index-missing"),
    pytest.param(index_as_text, BundleFormatError, "/index", id="index-not-uint8"),
    pytest.param(replace_index(b"\xc1\xff\x00 garbage bytes"), BundleFormatError, "/index", id="index-garbage"),
    pytest.param(truncate_index, BundleFormatError, "/index", id="index-truncated"),
    pytest.param(replace_index(b""), BundleFormatError, "/index", id="index-empty"),
    pytest.param(replace_index(msgpack.packb(42)), BundleFormatError, "expected dict", id="index-decodes-to-int"),
    pytest.param(
        replace_index(msgpack.packb({"run": {}})), BundleFormatError, "missing fields", id="index-missing-fields"
    ),
    pytest.param(
        lambda f: f.__delitem__("modules/head/0/output"),
        BundleFormatError,
        "/modules/head/0/output",
        id="dataset-deleted",
    ),
    pytest.param(
        lambda f: (f.__delitem__("modules/head/0/output"), f.create_group("modules/head/0/output")),
        BundleFormatError,
        "missing",
        id="dataset-replaced-by-group",
    ),
    pytest.param(
        replace_dataset(LOGITS, np.zeros((2, 5, 4), np.float32), "F32"),
        BundleFormatError,
        "shape",
        id="dataset-other-shape",
    ),
    pytest.param(
        replace_dataset(LOGITS, np.zeros((2, 5, 3), np.float64), "F32"),
        BundleFormatError,
        "float64",
        id="dataset-other-storage-dtype",
    ),
    pytest.param(
        replace_dataset(LOGITS, np.zeros((2, 5, 3), np.float32), None),
        BundleFormatError,
        "dtype tag",
        id="dataset-dtype-attr-missing",
    ),
    pytest.param(
        lambda f: f[LOGITS].attrs.__setitem__("dtype", "F16"), BundleFormatError, "F16", id="dtype-attr-changed"
    ),
    pytest.param(
        lambda f: f.create_dataset("modules/head/0/smuggled", data=np.zeros(3, np.float32)),
        BundleFormatError,
        "/modules/head/0/smuggled",
        id="orphan-under-modules",
    ),
    pytest.param(
        lambda f: f.create_dataset("stray", data=np.zeros(3, np.float32)),
        BundleFormatError,
        "/stray",
        id="orphan-at-root",
    ),
]


@pytest.mark.parametrize(("mutate", "error", "detail"), DAMAGE)
def test_damaged_bundle_is_refused(
    tiny_bundle: Path, mutate: Callable[[h5py.File], None], error: type[ParityError], detail: str
) -> None:
    """Each kind of damage raises the right error in one line naming the file and the problem."""
    path = damaged_copy(tiny_bundle, mutate)
    raised = open_error(path)
    assert type(raised) is error, repr(raised)
    assert detail in str(raised)


def _renamed_in_index(edit: Callable[[dict[str, Any]], None]) -> Callable[[h5py.File], None]:
    """A mutation editing the decoded /index document, stored back as msgpack."""

    def mutate(file: h5py.File) -> None:
        document = msgpack.unpackb(file["index"][()].tobytes(), raw=False, strict_map_key=False)
        edit(document)
        replace_index(msgpack.packb(document, use_bin_type=True))(file)

    return mutate


_FORGED = "head\n\nRESULT: MATCH (atol=1e-05, rtol=1e-05)"


def _forge_module(document: dict[str, Any]) -> None:
    document["calls"][0]["module"] = _FORGED


def _forge_parameter(document: dict[str, Any]) -> None:
    document["params"][0][0] = _FORGED


def _forge_gradient_slot(document: dict[str, Any]) -> None:
    call = next(call for call in document["calls"] if call.get("grad_outputs"))
    call["grad_outputs"][0][0] = _FORGED


def _forge_argument(document: dict[str, Any]) -> None:
    inputs = document["inputs"]  # TinyNet is called with keywords: a dict node of [key, value] pairs
    inputs[1][0][0] = _FORGED


def _forge_order(document: dict[str, Any]) -> None:
    document["forward_order"][0][1] = "inputs\r"


@pytest.mark.parametrize(
    "forge", [_forge_module, _forge_parameter, _forge_gradient_slot, _forge_argument, _forge_order]
)
def test_a_name_holding_a_control_character_is_refused(
    tiny_bundle: Path, forge: Callable[[dict[str, Any]], None]
) -> None:
    """Names from a bundle reach the reports as they are: one holding a line break printed a line of its own (a
    forged ``RESULT: MATCH`` in a MISMATCH report). A bundle naming a module, parameter or slot with a control
    character is refused when its index is read, in one line saying where."""
    raised = open_error(damaged_copy(tiny_bundle, _renamed_in_index(forge)))
    assert type(raised) is BundleFormatError, repr(raised)
    assert "holds a control character" in str(raised)
    assert "\n" not in str(raised)


def test_newer_major_version_names_both_versions(tiny_bundle: Path) -> None:
    """A newer major version raises UnsupportedBundleVersion naming the bundle's and the reader's versions."""
    path = damaged_copy(tiny_bundle, set_attr("format_version", FORMAT_VERSION + 1))
    error = open_error(path)
    assert isinstance(error, UnsupportedBundleVersion)
    message = str(error)
    assert re.search(rf"\b{FORMAT_VERSION + 1}\.\d", message), message
    assert re.search(rf"\b{FORMAT_VERSION}\.(x|\d)", message), message


def test_version_gate_runs_before_the_index_is_read(tiny_bundle: Path) -> None:
    """A newer-version bundle is refused for its version even when its index is not readable by us."""

    def newer_and_unreadable(file: h5py.File) -> None:
        set_attr("format_version", FORMAT_VERSION + 1)(file)
        replace_index(b"\xc1 a future index encoding")(file)

    error = open_error(damaged_copy(tiny_bundle, newer_and_unreadable))
    assert isinstance(error, UnsupportedBundleVersion)


def test_newer_minor_version_warns_and_reads(tiny_bundle: Path) -> None:
    """A newer minor version warns, naming the file and both versions, and still reads."""
    path = damaged_copy(tiny_bundle, set_attr("format_minor", FORMAT_MINOR + 1))
    with pytest.warns(UserWarning, match=re.escape(f"{FORMAT_VERSION}.{FORMAT_MINOR + 1}")) as record:
        reader = BundleReader(path)
    with reader:
        assert reader.format_minor == FORMAT_MINOR + 1
        assert same_bits(reader.rebuild(reader.index.inputs)["x"], tiny_inputs()["x"])
    assert any(str(path) in str(w.message) for w in record)


def test_refused_bundle_is_closed(tiny_bundle: Path) -> None:
    """A bundle refused during validation is not left open (it can be reopened for writing)."""
    path = damaged_copy(tiny_bundle, lambda f: f.__delitem__("modules/head/0/output"))
    with pytest.raises(BundleFormatError) as caught:
        BundleReader(path)
    # the caller still holds the error (and so the half-built reader in its traceback), as a log or REPL would
    with h5py.File(path, "r+") as file:  # HDF5 refuses this while a read-only handle is still open
        assert "index" in file
    assert caught.value.__traceback__ is not None


def test_closed_reader_releases_the_file(tiny_bundle: Path) -> None:
    """Leaving the reader's with-block closes the file."""
    with BundleReader(tiny_bundle) as reader:
        pass
    with h5py.File(tiny_bundle, "r+") as file:
        assert "index" in file
    with pytest.raises((ValueError, KeyError, RuntimeError, OSError)):
        reader.read_array(reader.index.params["head.weight"])


def test_read_array_is_a_read_only_view_with_the_stored_bits(tiny_bundle: Path) -> None:
    """Contiguous tensors come back without a copy, read-only, equal to what h5py reads."""
    with BundleReader(tiny_bundle) as reader:
        for name, ref in reader.index.params.items():
            array = reader.read_array(ref)
            with h5py.File(tiny_bundle, "r") as file:
                np.testing.assert_array_equal(array, file[ref.path][()], err_msg=name)
            assert not array.flags.writeable
    first = next(iter(reader.index.params.values()))
    with BundleReader(tiny_bundle) as reader:
        kept = reader.read_array(first)
        reader.read_array(next(reversed(reader.index.params.values())))  # drops the first one's pages
    np.testing.assert_array_equal(kept, BundleReader(tiny_bundle).read_tensor(first).numpy())  # still readable


def flip_data_byte(bundle: Path, record: str) -> Path:
    """A copy of ``bundle`` with one bit flipped inside the stored bytes of dataset ``record``."""
    with h5py.File(bundle, "r") as file:
        offset = file[record].id.get_offset()
    copy = bundle.with_name("flipped.h5")
    data = bytearray(bundle.read_bytes())
    data[offset + 5] ^= 0x10
    copy.write_bytes(bytes(data))
    return copy


def test_every_tensor_has_a_checksum_that_matches(tiny_bundle: Path) -> None:
    """A fresh bundle records a CRC-32 per tensor dataset and for the RNG state, each equal to the CRC-32 of its
    bytes."""
    import zlib

    with BundleReader(tiny_bundle) as reader, h5py.File(tiny_bundle, "r") as file:
        paths = [ref.path for ref in reader.index.tensor_refs()] + ["/rng/torch_cpu"]
        assert set(paths) == set(reader.index.checksums)
        for path in paths:
            assert reader.index.checksums[path] == zlib.crc32(file[path][()].tobytes()), path


def test_a_flipped_bit_in_tensor_data_is_caught_and_named(tiny_bundle: Path) -> None:
    """One flipped bit in a parameter's bytes: reading it fails naming the dataset; --no-verify reads it."""
    flipped = flip_data_byte(tiny_bundle, "params/head.weight")
    with BundleReader(flipped) as reader:
        ref = reader.index.params["head.weight"]
        with pytest.raises(
            BundleFormatError, match=r"/params/head\.weight: checksum mismatch .* changed after capture"
        ):
            reader.read_array(ref)
        reader.read_array(reader.index.params["head.bias"])  # the others still read
    with BundleReader(flipped, verify=False) as reader:
        original = BundleReader(tiny_bundle).read_array(reader.index.params["head.weight"])
        assert not np.array_equal(reader.read_array(reader.index.params["head.weight"]), original)


def test_a_checksum_left_for_later_raises_when_settled(tiny_bundle: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A large record's checksum runs on the second thread: verify returns, settle names the damaged dataset, and
    a record verified once is not checked again."""
    monkeypatch.setattr(reader_module, "VERIFY_LATER_FROM", 0)
    flipped = flip_data_byte(tiny_bundle, "params/head.weight")
    with BundleReader(flipped) as reader:
        ref = reader.index.params["head.weight"]
        array = reader.read_array(ref, verify=False)
        assert reader.verify(ref, array, later=True) is array
        with pytest.raises(BundleFormatError, match=r"/params/head\.weight: checksum mismatch"):
            reader.settle()
        reader.settle()
        intact = reader.index.params["head.bias"]
        reader.verify(intact, reader.read_array(intact, verify=False), later=True)
        reader.settle()


def test_a_damaged_record_compared_last_fails_the_replay(tiny_bundle: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every gradient record damaged (the last records a replay compares), checksums left to the second thread:
    compare_run raises before it returns a result; no checksum is left unclaimed behind the verdict."""
    from parity_harness.replay.compare.runner import compare_run

    monkeypatch.setattr(reader_module, "VERIFY_LATER_FROM", 0)
    damaged = tiny_bundle
    with BundleReader(tiny_bundle) as reader:
        gradients = [ref.path.lstrip("/") for ref in reader.index.grads.values()]
    for path in gradients:
        damaged = flip_data_byte(damaged, path)
    with BundleReader(damaged) as reader, pytest.raises(BundleFormatError, match=r"/grads/.*: checksum mismatch"):
        compare_run(build_tiny(), reader)


@pytest.mark.parametrize("later", [False, True], ids=["checked at once", "checked on the second thread"])
def test_replay_cli_reports_a_damaged_tensor_in_one_line(
    tiny_bundle: Path, tiny_ckpt: Path, later: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """replay-compare on a bundle altered after capture: exit 2, one line naming the record, also when the
    record's checksum was left to the second thread (records from 1 MiB)."""
    from click.testing import CliRunner

    from parity_harness.replay.cli.replay_compare import main
    from tests.cli_helpers import one_error_line

    if later:
        monkeypatch.setattr(reader_module, "VERIFY_LATER_FROM", 0)

    flipped = flip_data_byte(tiny_bundle, "params/head.weight")
    args = ["--bundle", str(flipped), "--model", "tests.models:build_tiny", "--ckpt", str(tiny_ckpt), "--quiet"]
    line = one_error_line("replay-compare", CliRunner().invoke(main, args))
    assert "params/head.weight: checksum mismatch" in line
    result = CliRunner().invoke(main, [*args, "--no-verify"])
    assert result.exit_code == 1, result.output  # read anyway: the altered weight differs, a mismatch
    assert "MISMATCH: 1 of 12 parameters differ from the reference's weights (head.weight)" in result.output


def test_a_bundle_without_checksums_is_unverified(tmp_path: Path) -> None:
    """capture-run --no-checksums (or checksums removed by hand): refused as unverified unless verification is off;
    read with verify=False, damage goes unnoticed, and replay-compare --no-verify says the bundle is unverified."""
    from click.testing import CliRunner

    from parity_harness.capture.record.recorder import capture_run
    from parity_harness.replay.cli.replay_compare import main
    from tests.cli_helpers import one_error_line

    out = tmp_path / "plain.h5"
    capture_run(build_tiny(), tiny_inputs(), out, checksums=False)
    with pytest.raises(BundleFormatError, match="unverified: the bundle has no checksums"):
        BundleReader(out)
    with BundleReader(out, verify=False) as reader:
        assert reader.index.checksums == {}
        assert not reader.verified
        flipped = flip_data_byte(out, "params/head.weight")
    with BundleReader(flipped, verify=False) as reader:
        reader.read_array(reader.index.params["head.weight"])  # damage goes unnoticed without checksums
    args = ["--bundle", str(out), "--model", "tests.models:build_tiny", "--quiet"]
    assert "unverified" in one_error_line("replay-compare", CliRunner().invoke(main, args))
    result = CliRunner().invoke(main, [*args[:-1], "--no-verify"])
    assert result.exit_code == 0, result.output
    assert "WARNING: unverified bundle: it has no checksums" in result.output


def test_the_rng_state_is_checksummed(tiny_bundle: Path) -> None:
    """The stored RNG state carries a checksum like every tensor; altered, the bundle is refused at open."""
    with BundleReader(tiny_bundle) as reader:
        assert any(path.startswith("/rng/") for path in reader.index.checksums)
    with h5py.File(tiny_bundle, "r+") as file:
        file["rng/torch_cpu"][0] ^= 1
    with pytest.raises(BundleFormatError, match="rng/torch_cpu: checksum mismatch"):
        BundleReader(tiny_bundle)
    BundleReader(tiny_bundle, verify=False).close()


@pytest.mark.parametrize("change", ["drop-rng-checksum", "stray-checksum"])
def test_from_format_1_4_the_checksums_cover_exactly_the_datasets(tiny_bundle: Path, change: str) -> None:
    """A 1.4 bundle whose index lost the RNG state's checksum, or names a checksum for no dataset, was altered."""
    with h5py.File(tiny_bundle, "r+") as file:
        document = msgpack.unpackb(file["index"][()].tobytes(), raw=False, strict_map_key=False)
        if change == "drop-rng-checksum":
            del document["checksums"]["/rng/torch_cpu"]
        else:
            document["checksums"]["/nowhere"] = 7
        del file["index"]
        file.create_dataset("index", data=np.frombuffer(msgpack.packb(document, use_bin_type=True), dtype=np.uint8))
    expected = "no checksum in the index" if change == "drop-rng-checksum" else "which is no dataset"
    with pytest.raises(BundleFormatError, match=expected):
        BundleReader(tiny_bundle)


def _mapped_rss(path: Path) -> int:
    """Bytes of ``path``'s mappings resident in this process (Linux smaps), summed."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
            inside = line.rstrip().endswith(str(path))
        elif inside and line.startswith("Rss:"):
            total += int(line.split()[1]) * 1024
    return total


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="needs Linux smaps")
def test_reading_every_record_keeps_at_most_twice_the_largest_resident(tmp_path: Path) -> None:
    """Records are read from the mapped file and their pages dropped in batches: however many records are read,
    this process holds at most about twice the largest record of the bundle, or the largest and two 2 MiB blocks
    where records are smaller than that (the pages stay in the OS cache)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(256, 256) for _ in range(12)))
    path = tmp_path / "many.h5"
    from parity_harness.capture.record.recorder import capture_run

    capture_run(model, (torch.randn(1024, 256),), path, seed=0)
    with BundleReader(path) as reader:
        refs = [ref for ref in reader.index.tensor_refs() if reader.summary(ref) is None]
        largest = max(int(np.prod(ref.shape)) * 4 for ref in refs)
        budget = max(largest, 2 * (2 << 20))
        assert sum(int(np.prod(ref.shape)) * 4 for ref in refs) > 8 * budget  # many drops' worth
        peak = 0
        for ref in refs:
            assert reader.read_array(ref).size == int(np.prod(ref.shape))
            peak = max(peak, _mapped_rss(path))
    assert peak <= budget + largest + (64 << 10)


@pytest.mark.parametrize("change", ["stray-checksum", "missing-dataset"])
def test_a_crafted_name_in_the_index_makes_a_short_message(tiny_bundle: Path, change: str) -> None:
    """A checksum, or a tensor, named by a 100,000-character path is refused in one short line."""
    long_path = "/" + "x" * 100_000
    with h5py.File(tiny_bundle, "r+") as file:
        document = msgpack.unpackb(file["index"][()].tobytes(), raw=False, strict_map_key=False)
        if change == "stray-checksum":
            document["checksums"][long_path] = 7
        else:
            document["outputs"] = ["T", long_path, "F32", [2], False]
            document["checksums"][long_path] = 7
        del file["index"]
        file.create_dataset("index", data=np.frombuffer(msgpack.packb(document, use_bin_type=True), dtype=np.uint8))
    expected = "which is no dataset" if change == "stray-checksum" else "is missing"
    with pytest.raises(BundleFormatError, match=expected) as caught:
        BundleReader(tiny_bundle)
    assert len(str(caught.value)) < len(str(tiny_bundle)) + 400


def test_recorded_objects_come_back_readable_as_objects(tmp_path: Path) -> None:
    """A model taking a dataclass or a named tuple (a ``Batch(audio, scale)``, common in ASR code) replays on the
    recorded inputs unchanged: they come back with attribute access (a dict and a plain tuple made the same model
    fail with AttributeError), and a named tuple's capture no longer fails moving it to the device."""
    import collections
    import dataclasses

    import torch

    from parity_harness.capture.record.recorder import capture_run
    from parity_harness.replay.compare.runner import compare_run

    @dataclasses.dataclass
    class Batch:
        audio: torch.Tensor
        scale: float

    Pair = collections.namedtuple("Pair", "audio scale")

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, batch: Any) -> torch.Tensor:
            return self.lin(batch.audio) * batch.scale

    from parity_harness.replay.compare.precision import Precision

    for kind in (Batch, Pair):
        path = tmp_path / f"{kind.__name__}.h5"
        capture_run(Model(), (kind(torch.randn(2, 4), 0.5),), path, seed=0, noise_floor=True)
        with BundleReader(path) as reader:
            (batch,) = reader.rebuild(reader.index.inputs)
            assert batch.scale == 0.5
            assert compare_run(Model(), reader).match
            assert compare_run(Model(), reader, precision=Precision(dtype="fp32")).match  # inputs cast, kept objects
            isolated = compare_run(Model(), reader, isolate=True)
            assert isolated.match
            assert isolated.not_isolated == {}
    assert type(batch).__name__ == "Pair"
    assert tuple(batch._fields) == ("audio", "scale")
