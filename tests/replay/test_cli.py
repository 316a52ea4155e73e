"""replay-compare end to end in-process: exit codes, the --json contract, error lines, --list and --show."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import h5py
import pytest
import torch
from click.testing import CliRunner, Result

from parity_harness.common.format.bundle.version import FORMAT_MINOR, FORMAT_VERSION
from parity_harness.replay.cli.replay_compare import PRECISION_NAMES, main
from parity_harness.replay.compare.precision import PRECISIONS
from tests.cli_helpers import one_error_line
from tests.conftest import REF_ADAPTER
from tests.models import build_tiny

MODELS = Path(__file__).resolve().parent.parent / "models.py"
TINY = f"{MODELS}:build_tiny"
KINDS = {"output", "param_grad", "forward", "backward"}  # the contract's (buffers are listed apart)
RECORD_KEYS = {"kind", "name", "match", "max_abs", "max_rel", "mismatched", "numel"}
PERTURBED = "blocks.1.lin.weight"

# --------------------------------------------------------------------------- helpers


def replay(*args: object, catch_exceptions: bool = True) -> Result:
    """Invoke replay-compare in-process with ``args``."""
    return CliRunner(catch_exceptions=catch_exceptions).invoke(main, [str(a) for a in args])


def strict_json(text: str) -> dict[str, Any]:
    """Parse JSON refusing NaN and Infinity (which strict JSON readers reject)."""

    def refuse(constant: str) -> None:
        raise ValueError(f"non-standard JSON constant {constant}")

    document = json.loads(text, parse_constant=refuse)
    assert isinstance(document, dict)
    return document


def table_rows(output: str, names: set[str]) -> list[str]:
    """Record names printed as table rows (a row starts with the record's name)."""
    return [line.split()[0] for line in output.splitlines() if line.split() and line.split()[0] in names]


@pytest.fixture
def perturbed_ckpt(tmp_path: Path) -> Path:
    """TinyNet's state dict with one weight nudged (a port with a wrong weight)."""
    state = build_tiny().state_dict()
    state[PERTURBED][0, 0] += 0.5
    path = tmp_path / "perturbed.pt"
    torch.save(state, path)
    return path


@pytest.fixture
def mismatch_report(tiny_bundle: Path, perturbed_ckpt: Path, tmp_path: Path) -> tuple[Result, dict[str, Any]]:
    """The result and JSON report of replaying the perturbed TinyNet on the tiny bundle."""
    report = tmp_path / "report.json"
    result = replay("--bundle", tiny_bundle, "--model", TINY, "--ckpt", perturbed_ckpt, "--json", report)
    return result, strict_json(report.read_text(encoding="utf-8"))


# --------------------------------------------------------------------------- exit 0 and 1


def test_same_model_exits_0(tiny_bundle: Path, tiny_ckpt: Path) -> None:
    """Replaying the captured model with its own checkpoint matches: exit 0, RESULT: MATCH."""
    result = replay("--bundle", tiny_bundle, "--model", TINY, "--ckpt", tiny_ckpt)
    assert result.exit_code == 0, result.output
    assert result.stderr == ""
    assert "RESULT: MATCH" in result.stdout
    assert "first divergence (forward): none" in result.stdout


def test_self_replay_is_exact_at_zero_tolerance(tiny_bundle: Path, tmp_path: Path) -> None:
    """--atol 0 --rtol 0 still matches on a self replay, with every max_abs exactly 0."""
    report = tmp_path / "exact.json"
    result = replay("--bundle", tiny_bundle, "--model", TINY, "--atol", 0, "--rtol", 0, "--json", report)
    assert result.exit_code == 0, result.output
    document = strict_json(report.read_text(encoding="utf-8"))
    assert document["match"] is True
    records = document["records"]
    assert isinstance(records, list)
    assert records
    assert {r["kind"] for r in records} == KINDS
    assert all(r["match"] and r["max_abs"] == 0 and r["mismatched"] == 0 for r in records)


def test_perturbed_weight_exits_1(mismatch_report: tuple[Result, dict[str, Any]]) -> None:
    """One nudged weight makes replay exit 1 and print RESULT: MISMATCH."""
    result, _ = mismatch_report
    assert result.exit_code == 1, result.output
    assert "RESULT: MISMATCH" in result.stdout
    assert "Traceback" not in result.output


def test_json_report_follows_the_contract(mismatch_report: tuple[Result, dict[str, Any]]) -> None:
    """The --json report has the contract's keys and per-record fields with the right types."""
    _, document = mismatch_report
    assert {"match", "first_divergence", "records", "unmatched"} <= set(document)
    assert document["match"] is False
    assert set(document["first_divergence"]) >= {"forward", "backward"}
    assert set(document["unmatched"]) >= {"bundle_only", "replay_only"}
    assert document["unmatched"] == {"bundle_only": [], "replay_only": []}
    records = document["records"]
    assert isinstance(records, list)
    assert records
    for record in records:
        assert set(record) >= RECORD_KEYS, record
        assert record["kind"] in KINDS
        assert isinstance(record["name"], str)
        assert record["name"]
        assert isinstance(record["match"], bool)
        assert isinstance(record["mismatched"], int)
        assert isinstance(record["numel"], int)
        assert 0 <= record["mismatched"] <= record["numel"]
        assert record["match"] == (record["mismatched"] == 0)
    assert any(not r["match"] for r in records)


def test_json_report_locates_the_perturbed_module(mismatch_report: tuple[Result, dict[str, Any]]) -> None:
    """The first forward divergence is the module whose weight was changed, named as in the bundle."""
    _, document = mismatch_report
    divergence = document["first_divergence"]
    assert isinstance(divergence, dict)
    assert divergence["forward"] == "blocks.1.lin"
    assert isinstance(divergence["backward"], str)
    grads = {r["name"]: r for r in document["records"] if r["kind"] == "param_grad"}
    assert set(grads) == {name for name, _ in build_tiny().named_parameters()}
    forward = {r["name"]: r["match"] for r in document["records"] if r["kind"] == "forward"}
    assert forward["blocks.1.lin/0/input.input"] is True
    assert forward["blocks.1.lin/0/output"] is False


def test_json_max_abs_and_max_rel_are_numbers(mismatch_report: tuple[Result, dict[str, Any]]) -> None:
    """Every record's max_abs and max_rel is a JSON number (null only where there is no value)."""
    _, document = mismatch_report
    for record in document["records"]:
        for key in ("max_abs", "max_rel"):
            value = record[key]
            assert value is None or (isinstance(value, (int, float)) and not isinstance(value, bool)), (
                record["name"],
                key,
                value,
            )


def test_json_report_is_strict_json_with_nan_weights(tiny_bundle: Path, tmp_path: Path) -> None:
    """A port producing NaN still yields a strict-JSON report (no NaN/Infinity literals) and exit 1."""
    state = build_tiny().state_dict()
    state["head.bias"][0] = float("nan")
    ckpt = tmp_path / "nan.pt"
    torch.save(state, ckpt)
    report = tmp_path / "nan.json"
    result = replay("--bundle", tiny_bundle, "--model", TINY, "--ckpt", ckpt, "--json", report)
    assert result.exit_code == 1, result.output
    document = strict_json(report.read_text(encoding="utf-8"))
    logits = next(r for r in document["records"] if r["name"] == "output.logits")
    assert logits["match"] is False
    for value in (logits["max_abs"], logits["max_rel"]):
        assert not (isinstance(value, float) and math.isnan(value))


# --------------------------------------------------------------------------- exit 2: one line


def newer_bundle(tmp_path: Path, bundle: Path) -> list[object]:
    """Arguments replaying a copy of the bundle stamped with the next major format version."""
    copy = tmp_path / "future.h5"
    shutil.copyfile(bundle, copy)
    with h5py.File(copy, "r+") as file:
        file.attrs["format_version"] = FORMAT_VERSION + 1
    return ["--bundle", copy, "--model", TINY]


def not_a_bundle(tmp_path: Path, bundle: Path) -> list[object]:
    """Arguments replaying a text file."""
    path = tmp_path / "notes.h5"
    path.write_text("not a bundle\n")
    return ["--bundle", path, "--model", TINY]


def adapter_file(text: str) -> Callable[[Path, Path], list[object]]:
    """Case builder: an adapter file with ``text`` as its source."""

    def build(tmp_path: Path, bundle: Path) -> list[object]:
        path = tmp_path / "my_adapter.py"
        path.write_text(text)
        return ["--bundle", bundle, "--adapter", path]

    return build


def bad_map(tmp_path: Path, bundle: Path) -> list[object]:
    """Arguments with a --map file whose second rule lacks '=>'."""
    path = tmp_path / "rules.map"
    path.write_text("# comment\n^blocks\\.(\\d+) => blocks.\\1\nthis line has no arrow\n")
    return ["--bundle", bundle, "--model", TINY, "--map", path]


ERRORS = [
    pytest.param(lambda t, b: ["--bundle", t / "absent.h5", "--model", TINY], "no such bundle", id="missing-bundle"),
    pytest.param(not_a_bundle, "not an HDF5 file", id="not-a-bundle"),
    pytest.param(newer_bundle, f"{FORMAT_VERSION + 1}.{FORMAT_MINOR}", id="newer-version"),
    pytest.param(
        lambda t, b: ["--bundle", b, "--adapter", t / "nowhere.py"], "no such file", id="adapter-path-missing"
    ),
    pytest.param(
        lambda t, b: ["--bundle", b, "--adapter", "no_such_adapter_module_xyz"],
        "no_such_adapter_module_xyz",
        id="adapter-module-missing",
    ),
    pytest.param(
        adapter_file("def make_inputs(seed, batch_size, seq_len):\n    return ()\n"),
        "load_model",
        id="adapter-without-load_model",
    ),
    pytest.param(
        adapter_file("raise RuntimeError('adapter exploded at import')\n"),
        "adapter exploded at import",
        id="adapter-raises-on-import",
    ),
    pytest.param(
        adapter_file("def load_model(ckpt, device):\n    return 'not a module'\n"),
        "torch.nn.Module",
        id="adapter-returns-non-module",
    ),
    pytest.param(lambda t, b: ["--bundle", b, "--model", "nocolon"], "MODULE:FACTORY", id="model-spec-no-colon"),
    pytest.param(
        lambda t, b: ["--bundle", b, "--model", f"{MODELS}:no_such_factory"],
        "no_such_factory",
        id="model-factory-missing",
    ),
    pytest.param(bad_map, "rules.map:3", id="bad-map-line"),
    pytest.param(
        lambda t, b: ["--bundle", b, "--model", TINY, "--adapter", REF_ADAPTER], "not both", id="adapter-and-model"
    ),
    pytest.param(lambda t, b: ["--bundle", b], "give --adapter", id="neither-adapter-nor-model"),
]


@pytest.mark.parametrize(("build", "detail"), ERRORS)
def test_error_exits_2_with_one_line(
    tmp_path: Path, tiny_bundle: Path, build: Callable[[Path, Path], list[object]], detail: str
) -> None:
    """A usage, input, bundle or adapter error exits 2 with one line on stderr naming the problem."""
    line = one_error_line("replay-compare", replay(*build(tmp_path, tiny_bundle)))
    assert detail in line


def test_newer_version_error_names_both_versions(tmp_path: Path, tiny_bundle: Path) -> None:
    """The newer-version error line names the bundle's version and this reader's."""
    line = one_error_line("replay-compare", replay(*newer_bundle(tmp_path, tiny_bundle)))
    assert f"{FORMAT_VERSION + 1}.{FORMAT_MINOR}" in line
    assert f"{FORMAT_VERSION}.x" in line


BAD_OPTIONS = [
    pytest.param(["--atol", "-1"], "--atol", id="negative-atol"),
    pytest.param(["--rtol", "nan"], "--rtol", id="nan-rtol"),
    pytest.param(["--show", "everything"], "--show", id="unknown-show"),
]


@pytest.mark.parametrize(("extra", "option"), BAD_OPTIONS)
def test_bad_option_value_is_one_line(tiny_bundle: Path, extra: list[str], option: str) -> None:
    """A bad option value exits 2 with one line on stderr naming the option, not click's usage block."""
    line = one_error_line("replay-compare", replay("--bundle", tiny_bundle, "--model", TINY, *extra))
    assert option in line


# --------------------------------------------------------------------------- --debug


def test_debug_shows_the_traceback_and_still_exits_2(tmp_path: Path) -> None:
    """--debug prints the traceback with the error, and still exits 2 so it is never read as a mismatch (1)."""
    args = ["--bundle", tmp_path / "absent.h5", "--model", TINY]
    assert "Traceback" not in one_error_line("replay-compare", replay(*args))
    result = replay(*args, "--debug")
    assert result.exit_code == 2, (result.exit_code, result.exception)
    assert result.stdout == ""
    assert "Traceback (most recent call last)" in result.stderr
    assert "BundleNotFoundError" in result.stderr
    assert str(tmp_path / "absent.h5") in result.stderr


def test_debug_traceback_shows_the_adapters_own_error(tmp_path: Path, tiny_bundle: Path) -> None:
    """With --debug an adapter failing at import shows the adapter's own exception and where it was raised."""
    path = tmp_path / "exploding.py"
    path.write_text("raise RuntimeError('adapter exploded at import')\n")
    result = replay("--bundle", tiny_bundle, "--adapter", path, "--debug")
    assert result.exit_code == 2, (result.exit_code, result.exception)
    assert "Traceback (most recent call last)" in result.stderr
    assert "RuntimeError: adapter exploded at import" in result.stderr
    assert str(path) in result.stderr


# --------------------------------------------------------------------------- --list


def test_list_shows_contents_without_a_model(tiny_bundle: Path) -> None:
    """--list needs no model and prints the format version, inputs, outputs and module records with shapes/dtypes."""
    result = replay("--bundle", tiny_bundle, "--list")
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert f"(format {FORMAT_VERSION}.{FORMAT_MINOR})" in out
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines() if line.split()}
    assert rows["input.x"][:2] == ["2x5x4", "F32"]
    assert rows["output.logits"][:2] == ["2x5x3", "F32"]
    assert rows["output.label"][:2] == ["2x5", "I64"]
    assert rows["blocks.0/1/output"][:2] == ["2x5x8", "F32"]
    assert rows["head/0/grad_output"][:2] == ["2x5x3", "F32"]
    assert rows["head.weight"][:2] == ["3x8", "F32"]
    assert "== Module calls (14)" in out


def test_a_huge_provenance_string_is_cut_where_it_is_read(tiny_bundle: Path) -> None:
    """A crafted bundle's 100 MB provenance attribute cost 2.4 GB and printed a 100 MB line in --list: a provenance
    string is cut to 4096 characters as it is read, saying how long it was."""
    from parity_harness.replay.reader import BundleReader

    with h5py.File(tiny_bundle, "r+") as file:
        file["provenance"].attrs["command_line"] = "y" * (8 << 20)
    with BundleReader(tiny_bundle) as reader:
        shown = reader.provenance()["command_line"]
    assert shown == "y" * 4096 + f"... ({8 << 20} characters)"
    result = replay("--bundle", tiny_bundle, "--list")
    assert result.exit_code == 0, result.output
    assert max(map(len, result.stdout.splitlines())) < 5000


def test_list_ignores_comparison_only_options(tiny_bundle: Path, tmp_path: Path) -> None:
    """--list runs nothing, so options of the comparison (--save-map without --map auto) do not stop it."""
    result = replay("--bundle", tiny_bundle, "--list", "--save-map", tmp_path / "m.map")
    assert result.exit_code == 0, result.output
    assert "== Module calls (14)" in result.stdout


def test_list_never_imports_torch(tiny_bundle: Path) -> None:
    """--list reads the bundle's metadata only: torch, whose import alone takes most of a second (more than the
    listing of a large bundle), is never imported."""
    code = "\n".join(
        [
            "import sys",
            "from parity_harness.replay.cli.replay_compare import main",
            "try:",
            "    main()",
            "except SystemExit as end:",
            "    print('exit', end.code, 'torch imported' if 'torch' in sys.modules else 'no torch')",
        ]
    )
    done = subprocess.run([sys.executable, "-c", code, "--bundle", str(tiny_bundle), "--list"], capture_output=True,
                          text=True, check=False)  # fmt: skip
    assert "== Module calls (14)" in done.stdout, done.stderr
    assert done.stdout.splitlines()[-1] == "exit 0 no torch"


def test_the_dtype_choices_are_the_precisions() -> None:
    """--dtype's choices, spelled out so that the command imports no torch, are exactly the replay's precisions."""
    assert tuple(PRECISIONS) == PRECISION_NAMES


def test_an_unwritable_report_is_one_line_naming_the_option(tiny_bundle: Path, tmp_path: Path) -> None:
    """A --json path in a missing folder is one error line naming the option, before anything runs (no table)."""
    target = tmp_path / "missing" / "r.json"
    result = replay("--bundle", tiny_bundle, "--model", TINY, "--json", target)
    assert result.exit_code == 2, result.output
    assert result.stdout == ""
    assert result.stderr.splitlines() == [result.stderr.strip()]
    assert result.stderr.startswith(f"replay-compare: error: --json {target}: the folder {target.parent} does not")


def test_list_of_a_damaged_bundle_exits_2(tmp_path: Path) -> None:
    """--list on a file that is not a bundle is an error line, exit 2."""
    path = tmp_path / "notes.h5"
    path.write_text("hello\n")
    assert "not an HDF5 file" in one_error_line("replay-compare", replay("--bundle", path, "--list"))


# --------------------------------------------------------------------------- --show / --max-rows


def test_show_all_prints_every_record(tiny_bundle: Path, tmp_path: Path) -> None:
    """--show all prints a row for every compared record, whatever --max-rows says."""
    report = tmp_path / "all.json"
    result = replay("--bundle", tiny_bundle, "--model", TINY, "--show", "all", "--max-rows", 3, "--json", report)
    assert result.exit_code == 0, result.output
    names = [r["name"] for r in strict_json(report.read_text(encoding="utf-8"))["records"]]
    assert sorted(table_rows(result.stdout, set(names))) == sorted(names)
    assert "not shown" not in result.stdout


def test_auto_hides_matching_rows_beyond_max_rows(tiny_bundle: Path, tmp_path: Path) -> None:
    """By default a table with more rows than --max-rows hides its matching rows and says how many."""
    report = tmp_path / "auto.json"
    result = replay("--bundle", tiny_bundle, "--model", TINY, "--max-rows", 3, "--json", report)
    assert result.exit_code == 0, result.output
    records = strict_json(report.read_text(encoding="utf-8"))["records"]
    names = {r["name"] for r in records}
    outputs = {r["name"] for r in records if r["kind"] == "output"}
    assert len(outputs) <= 3
    assert set(table_rows(result.stdout, names)) == outputs  # the 2-row outputs table is shown whole
    assert "(12 matching rows not shown; --show all prints every row)" in result.stdout


def test_auto_keeps_mismatching_rows(
    mismatch_report: tuple[Result, dict[str, Any]], tiny_bundle: Path, perturbed_ckpt: Path
) -> None:
    """When rows are hidden, mismatching rows are still printed and matching ones are not."""
    _, document = mismatch_report
    records = document["records"]
    grads = [r for r in records if r["kind"] == "param_grad"]
    failing = {r["name"] for r in grads if not r["match"]}
    assert failing
    assert len(failing) < len(grads)
    result = replay("--bundle", tiny_bundle, "--model", TINY, "--ckpt", perturbed_ckpt, "--max-rows", len(grads) - 1)
    assert result.exit_code == 1
    shown = set(table_rows(result.stdout, {r["name"] for r in grads}))
    assert shown == failing


def test_show_mismatched_prints_only_failing_rows(
    mismatch_report: tuple[Result, dict[str, Any]], tiny_bundle: Path, perturbed_ckpt: Path
) -> None:
    """--show mismatched prints exactly the failing records, even in short tables."""
    _, document = mismatch_report
    records = document["records"]
    failing = {r["name"] for r in records if not r["match"]}
    result = replay(
        "--bundle", tiny_bundle, "--model", TINY, "--ckpt", perturbed_ckpt, "--show", "mismatched", "--max-rows", 0
    )
    assert result.exit_code == 1
    assert set(table_rows(result.stdout, {r["name"] for r in records})) == failing


def test_default_max_rows_hides_matching_rows_of_a_big_model(ref_bundle: Path, ref_checkpoint: Path) -> None:
    """With default options a replay of the example reference hides its long matching tables."""
    result = replay("--bundle", ref_bundle, "--adapter", REF_ADAPTER, "--ckpt", ref_checkpoint)
    assert result.exit_code == 0, result.output
    forward = next(line for line in result.stdout.splitlines() if line.startswith("== Forward"))
    compared = int(forward.split(":")[-1].split("/")[1].split()[0])
    assert compared > 40
    assert f"({compared} matching rows not shown; --show all prints every row)" in result.stdout


@pytest.mark.parametrize(("given", "missing"), [("--atol", "--rtol"), ("--rtol", "--atol")])
def test_atol_and_rtol_come_together(tiny_bundle: Path, given: str, missing: str) -> None:
    """One tolerance without the other would silently keep the other's default: a usage error, exit 2."""
    line = one_error_line("replay-compare", replay("--bundle", tiny_bundle, "--model", TINY, given, "0"))
    assert f"{given} given without {missing}" in line


def test_tolerance_preset_excludes_explicit_atol(tiny_bundle: Path) -> None:
    """--tolerance-preset torch with --atol is a usage error (the preset sets atol per dtype)."""
    line = one_error_line(
        "replay-compare", replay("--bundle", tiny_bundle, "--model", TINY, "--tolerance-preset", "torch", "--atol", "1")
    )
    assert "drop --atol" in line


def test_tolerance_preset_reported_in_json(tiny_bundle: Path, tmp_path: Path) -> None:
    """With the torch preset, a self replay matches and the JSON report names the preset."""
    ckpt = tmp_path / "tiny.pt"
    torch.save(build_tiny().state_dict(), ckpt)
    report = tmp_path / "r.json"
    result = replay(
        "--bundle", tiny_bundle, "--model", TINY, "--ckpt", ckpt, "--tolerance-preset", "torch", "--json", report
    )
    assert result.exit_code == 0, result.output
    assert json.loads(report.read_text())["tolerance"]["preset"] == "torch"
    assert "torch.testing tolerances per dtype" in result.stdout


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        (["--params", "head"], "--params selects the weights of a training rerun: it needs --steps"),
        (["--compile-per-module"], "--compile-per-module needs --compile BACKEND"),
        (["--rank", "2"], "is one bundle, not a multi-rank capture; drop --rank"),
        (["--rank", "1", "--list"], "is one bundle, not a multi-rank capture; drop --rank"),
    ],
    ids=["params-without-steps", "per-module-without-compile", "rank-of-one-bundle", "rank-of-one-bundle-listed"],
)
def test_an_option_that_would_act_on_nothing_is_refused(tiny_bundle: Path, extra: list[str], expected: str) -> None:
    """An option whose mode is not on was silently ignored (the run went on without it): exit 2, one line."""
    result = replay("--bundle", tiny_bundle, "--model", "tests.models:build_tiny", *extra)
    assert result.exit_code == 2, result.output
    assert expected in one_error_line("replay-compare", result)


def test_a_newer_minor_version_is_one_warning_line(tiny_bundle: Path, tmp_path: Path) -> None:
    """A bundle of a newer minor printed Python's two-line warning, the second a source line of this project."""
    newer = tmp_path / "newer.h5"
    shutil.copyfile(tiny_bundle, newer)
    with h5py.File(newer, "r+") as file:
        file.attrs["format_minor"] = FORMAT_MINOR + 1
    result = replay("--bundle", newer, "--list")
    assert result.exit_code == 0, result.output
    expected = (
        f"replay-compare: warning: {newer}: bundle format {FORMAT_VERSION}.{FORMAT_MINOR + 1} is newer than this "
        f"reader's {FORMAT_VERSION}.{FORMAT_MINOR}; fields added since are ignored"
    )
    assert result.stderr.splitlines() == [expected]


def test_a_training_file_without_steps_says_to_add_steps(tmp_path: Path) -> None:
    """The message said 'pass a file written by capture-run' for a file capture-run --steps wrote."""
    from parity_harness.capture.record.training import TrainingRecorder

    model = build_tiny()
    with TrainingRecorder(tmp_path / "run.h5", model) as recorder:
        recorder.step(0, loss=1.0)
    line = one_error_line("replay-compare", replay("--bundle", tmp_path / "run.h5", "--model", TINY))
    assert "it is a training run (capture-run --steps): rerun a port on it with replay-compare --steps" in line
