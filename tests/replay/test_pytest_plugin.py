"""The parity fixture's whole lifecycle through pytester, and assert_parity outside pytest."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from parity_harness.common.errors import ParityMismatch
from parity_harness.replay.assertions import assert_parity
from tests.conftest import ROOT
from tests.models import build_tiny

MODEL = """
import pytest
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Linear(4, 8)
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        return self.head(torch.tanh(self.encoder(x)))


def build():
    torch.manual_seed(0)
    net = Net()
    with torch.no_grad():
        net.head.weight[0, 0] += {delta}
    return net


{marker}
def test_model(parity):
    parity.check(build(), (torch.randn(3, 4, generator=torch.Generator().manual_seed(0)),))
"""


def _write(pytester: pytest.Pytester, delta: float = 0.0, marker: str = "") -> Path:
    return pytester.makepyfile(test_lifecycle=MODEL.format(delta=delta, marker=marker))


def test_golden_lifecycle(pytester: pytest.Pytester) -> None:
    """Missing golden fails with the command; --parity-regen writes it; then pass; a changed module fails by name."""
    _write(pytester)
    missing = pytester.runpytest()
    missing.assert_outcomes(failed=1)
    missing.stdout.fnmatch_lines(["*golden bundle*test_lifecycle/test_model.h5 does not exist*", "*--parity-regen*"])

    regen = pytester.runpytest("--parity-regen")
    regen.assert_outcomes(passed=1, warnings=1)
    regen.stdout.fnmatch_lines(["*parity: golden bundles regenerated*", "*test_lifecycle/test_model.h5"])
    assert (pytester.path / "test_lifecycle" / "test_model.h5").is_file()

    pytester.runpytest().assert_outcomes(passed=1)

    _write(pytester, delta=0.01)
    changed = pytester.runpytest()
    changed.assert_outcomes(failed=1)
    changed.stdout.fnmatch_lines(
        ["*port does not match*", "*first divergence (forward): head*", "*would have passed: atol=*"]
    )
    assert "def assert_parity" not in changed.stdout.str()  # the plugin's frames are hidden


def test_marker_and_ini_tolerances(pytester: pytest.Pytester) -> None:
    """@pytest.mark.parity(atol=...) and the parity_atol ini option loosen the check."""
    _write(pytester)
    pytester.runpytest("--parity-regen").assert_outcomes(passed=1, warnings=1)
    _write(pytester, delta=0.01, marker="@pytest.mark.parity(atol=1.0, rtol=0.0)")
    pytester.runpytest().assert_outcomes(passed=1)
    _write(pytester, delta=0.01)
    pytester.runpytest().assert_outcomes(failed=1)
    pytester.makeini("[pytest]\nparity_atol = 1.0\nparity_rtol = 0\n")
    pytester.runpytest().assert_outcomes(passed=1)


def test_atol_without_rtol_is_refused_everywhere(pytester: pytest.Pytester) -> None:
    """One of atol/rtol alone would silently keep the other's default: in the ini, the marker or the call, the
    test fails saying to give both."""
    _write(pytester)
    pytester.runpytest("--parity-regen").assert_outcomes(passed=1, warnings=1)
    pytester.makeini("[pytest]\nparity_atol = 1.0\n")
    ini = pytester.runpytest()
    ini.assert_outcomes(failed=1)
    ini.stdout.fnmatch_lines(
        ["*parity_atol/parity_rtol ini options gives atol='1.0', rtol=None: give both or neither*"]
    )
    pytester.makeini("[pytest]\n")
    _write(pytester, marker="@pytest.mark.parity(rtol=0.1)")
    marked = pytester.runpytest()
    marked.assert_outcomes(failed=1)
    marked.stdout.fnmatch_lines(["*@pytest.mark.parity gives atol=None, rtol=0.1: give both or neither*"])
    for written in ("@pytest.mark.parity(1.0, 1.0)", "@pytest.mark.parity(tol=1.0)"):  # never the defaults instead
        _write(pytester, delta=0.01, marker=written)
        positional = pytester.runpytest()
        positional.assert_outcomes(failed=1)
        positional.stdout.fnmatch_lines(["*the marker takes atol= and rtol= by keyword only*"])


@pytest.mark.slow
def test_golden_captured_by_capture_run_in_another_process(pytester: pytest.Pytester) -> None:
    """A golden bundle written by capture-run in another process is what the fixture compares with."""
    test_file = _write(pytester)
    golden = pytester.path / "test_lifecycle" / "test_model.h5"
    golden.parent.mkdir()
    args = ["--model", f"{test_file}:build", "--out", str(golden), "--batch-size", "3", "--seq-len", "4"]
    done = subprocess.run(
        [sys.executable, "-c", "from parity_harness.capture.cli.capture_run import main; main()", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    pytester.runpytest().assert_outcomes(passed=1)


def test_plugin_loads_without_torch(pytester: pytest.Pytester) -> None:
    """Loading the plugin imports neither torch nor the replay machinery (only using the fixture does)."""
    pytester.makepyfile(
        test_cheap="import sys\n\ndef test_cheap(pytestconfig):\n"
        "    assert pytestconfig.pluginmanager.has_plugin('parity')\n"
        "    assert 'parity_harness.replay.testing.fixture' not in sys.modules and 'torch' not in sys.modules\n"
    )
    pytester.runpytest_subprocess().assert_outcomes(passed=1)


def test_assert_parity_outside_pytest(tiny_bundle: Path) -> None:
    """assert_parity returns the comparison on a match and raises ParityMismatch naming the module otherwise."""
    assert assert_parity(build_tiny(), tiny_bundle).match
    model = build_tiny()
    with torch.no_grad():
        model.blocks[1].lin.weight[0, 0] += 0.01
    with pytest.raises(ParityMismatch, match=r"(?s)first divergence \(forward\): blocks\.1\.lin.*first origin"):
        assert_parity(model, tiny_bundle, isolate=True)


def test_layers_and_waive_given_as_strings_mean_one_glob(tiny_bundle: Path) -> None:
    """``layers="inp"`` and ``waive="glob"`` by hand are one glob each (``layers`` raised AttributeError; a waive
    string was read character by character: "waiver 'b' matches no record")."""
    from parity_harness.common.errors import InputError

    result = assert_parity(build_tiny(), tiny_bundle, layers="inp")
    assert result.match
    assert {r.module for r in result.records if r.module} == {"inp"}
    assert assert_parity(build_tiny(), tiny_bundle, layers=("inp", "head")).match
    with pytest.raises(InputError, match=r"waiver 'nothing\.here/\*' \(--waive"):
        assert_parity(build_tiny(), tiny_bundle, waive="nothing.here/*")
    with pytest.raises(InputError, match="layers=3: expected module globs"):
        assert_parity(build_tiny(), tiny_bundle, layers=3)


ALLOW_TF32 = """
import torch
from parity_harness.replay.reader import BundleReader


def test_model(parity):
    torch.manual_seed(0)
    parity.check(torch.nn.Linear(4, 2), (torch.ones(3, 4),), allow_tf32=True)
    with BundleReader(parity.default_bundle()) as reader:
        assert reader.provenance()["tf32_cudnn"] == str(torch.backends.cudnn.allow_tf32) == "True"
"""


def test_regen_records_with_the_tf32_setting_the_check_compares_with(pytester: pytest.Pytester) -> None:
    """parity.check(..., allow_tf32=True) with --parity-regen captured with TF32 off and compared with it on: the
    golden bundle and its comparisons ran differently."""
    pytester.makepyfile(test_tf32=ALLOW_TF32)
    pytester.runpytest("--parity-regen").assert_outcomes(passed=1, warnings=1)
    pytester.runpytest().assert_outcomes(passed=1)


NAMESAKES = """
import pytest
import torch
from torch import nn

# The reference, or (PORT_WRONG set) a port wrong on the short inputs only: it drops a third feature that the
# long inputs never have (zero there).
PORT_WRONG = {wrong}


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(3, 2)

    def forward(self, x):
        return self.lin(x * torch.tensor([1.0, 1.0, 0.0]) if PORT_WRONG else x)


def build():
    return Net()


def inputs(third):
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(0))
    x[:, 2] = third
    return (x,)


class TestLong:
    def test_parity(self, parity):
        parity.check(build(), inputs(0.0))


class TestShort:
    def test_parity(self, parity):
        parity.check(build(), inputs(1.0))


@pytest.mark.parametrize("case", ["a/b", "a_b", "c" * 300], ids=["a/b", "a_b", "c" * 300])
def test_case(parity, case):
    parity.check(build(), inputs(0.0 if case != "a_b" else 1.0))


def test_two_checks(parity):
    parity.check(build(), inputs(0.0))
    parity.check(nn.Linear(3, 5), inputs(1.0))
"""


def test_tests_that_share_a_name_keep_their_golden_bundles_apart(pytester: pytest.Pytester) -> None:
    """Two classes' methods of one name, parameter ids that differ only in a character a file name cannot hold, and
    two checks in one test each get a golden bundle of their own: they shared one (the last regenerated), so a port
    wrong on one test's inputs passed against the other's bundle, and a second check failed against the first's. A
    300-character id is cut (it ended the test in "File name too long")."""
    pytester.makepyfile(test_namesakes=NAMESAKES.format(wrong=False))
    regen = pytester.runpytest("--parity-regen")
    regen.assert_outcomes(passed=6, warnings=7)
    written = sorted(p.relative_to(pytester.path).as_posix() for p in pytester.path.rglob("*.h5"))
    assert len(written) == 7, written  # a 300-character id too: cut, with its digest
    assert all(len(Path(name).name) < 160 for name in written), written
    assert "test_namesakes/TestLong/test_parity.h5" in written
    assert "test_namesakes/test_two_checks~2.h5" in written
    pytester.runpytest().assert_outcomes(passed=6)
    pytester.makepyfile(test_namesakes=NAMESAKES.format(wrong=True))
    wrong = pytester.runpytest("-q")
    wrong.assert_outcomes(passed=4, failed=2)  # each on its own inputs: only TestShort's and test_case[a_b] differ
    assert "FAILED test_namesakes.py::TestShort::test_parity" in wrong.stdout.str()
    assert "FAILED test_namesakes.py::test_case[a_b]" in wrong.stdout.str()


def test_bundle_dir_keeps_test_files_of_one_name_apart(pytester: pytest.Pytester) -> None:
    """Under ``parity_bundle_dir`` the default path keeps the test file's folder: two ``test_parity.py`` files in two
    folders wrote one bundle, and the one regenerated first then compared with the other's."""
    pytester.makeini("[pytest]\nparity_bundle_dir = golden\n")
    for folder, width in (("encoder", 2), ("decoder", 5)):
        pytester.mkpydir(folder).joinpath("test_parity.py").write_text(
            "import torch\n\n\ndef test_model(parity):\n    torch.manual_seed(0)\n"
            f"    parity.check(torch.nn.Linear(3, {width}), (torch.ones(2, 3),))\n"
        )
    pytester.runpytest("--parity-regen").assert_outcomes(passed=2, warnings=2)
    assert (pytester.path / "golden" / "encoder" / "test_parity" / "test_model.h5").is_file()
    assert (pytester.path / "golden" / "decoder" / "test_parity" / "test_model.h5").is_file()
    pytester.runpytest().assert_outcomes(passed=2)


def test_regenerating_one_bundle_from_two_tests_fails_the_second(pytester: pytest.Pytester) -> None:
    """Two tests naming one ``bundle=`` with inputs of their own: the second regeneration would replace the first's
    bundle, so it fails, naming the first test."""
    pytester.makepyfile(
        test_shared="import torch\n\n\n"
        "def test_first(parity):\n    parity.check(torch.nn.Linear(3, 2), (torch.ones(2, 3),), bundle='one.h5')\n\n\n"
        "def test_second(parity):\n    parity.check(torch.nn.Linear(3, 2), (torch.zeros(2, 3),), bundle='one.h5')\n"
    )
    regen = pytester.runpytest("--parity-regen")
    regen.assert_outcomes(passed=1, failed=1, warnings=1)
    regen.stdout.fnmatch_lines(["*one.h5 was regenerated by test_shared.py::test_first in this run already*"])


def test_a_missing_bundle_names_where_earlier_versions_put_it(pytester: pytest.Pytester) -> None:
    """A golden bundle at the default path earlier versions gave (no class in it) is not read in a class's test's
    place (another test could have written it); the failure says where it is."""
    pytester.makepyfile(
        test_moved="import torch\n\n\nclass TestA:\n    def test_model(self, parity):\n"
        "        parity.check(torch.nn.Linear(3, 2), (torch.ones(2, 3),))\n"
    )
    former = pytester.path / "test_moved" / "test_model.h5"
    former.parent.mkdir()
    former.write_bytes(b"")
    missing = pytester.runpytest()
    missing.assert_outcomes(failed=1)
    missing.stdout.fnmatch_lines(
        ["*test_moved/TestA/test_model.h5 does not exist*", "*test_moved/test_model.h5 is where earlier versions*"]
    )


def test_a_test_file_outside_the_root_folder_keeps_its_whole_path(tmp_path: Path) -> None:
    """Under ``parity_bundle_dir``, test files of one name outside the root folder (a sibling checkout) kept only
    their name, and shared a folder of bundles."""
    from types import SimpleNamespace

    from parity_harness.replay.testing.fixture import ParityFixture

    def default_bundle(test_file: Path) -> Path:
        config = SimpleNamespace(getini=lambda name: "golden", rootpath=tmp_path / "root")
        node = SimpleNamespace(path=test_file, nodeid=f"{test_file.name}::test_model", name="test_model")
        return ParityFixture(SimpleNamespace(node=node, config=config), {}).default_bundle()  # type: ignore[arg-type]

    one, two = default_bundle(tmp_path / "a" / "test_p.py"), default_bundle(tmp_path / "b" / "test_p.py")
    assert one != two
    assert (
        default_bundle(tmp_path / "root" / "tests" / "test_p.py") == tmp_path / "root/golden/tests/test_p/test_model.h5"
    )
