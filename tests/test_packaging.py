"""The built wheel: one import name (``parity_harness``), no module forgotten, and, installed in a fresh
environment, a user project whose own ``replay``, ``common`` and ``capture`` packages (and another
distribution's top-level ``common``) live beside it while the ``parity`` fixture keeps working."""

from __future__ import annotations

import configparser
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

from tests.conftest import ROOT

NAMESPACE = "parity_harness"
TOPS = ("common", "capture", "replay")
CONSTRAINTS = ROOT / "scripts" / "constraints.txt"
SCRIPTS = {"capture-run", "replay-compare", "parity-train-diff", "ckpt-diff"}
PLUGIN = f"{NAMESPACE}.replay.testing.pytest_plugin"

# A user's project that happens to own top-level packages named like the harness's folders.
USER_PROJECT = {
    "pyproject.toml": """
        [project]
        name = "rl-agent"
        version = "0.1.0"

        [tool.pytest.ini_options]
        pythonpath = ["."]
        testpaths = ["tests"]
    """,
    "replay/__init__.py": '"""The project\'s own replay buffer."""\n',
    "replay/buffer.py": """
        class ReplayBuffer:
            def __init__(self, capacity):
                self.capacity = capacity
                self.items = []

            def push(self, item):
                self.items = [*self.items, item][-self.capacity :]
    """,
    "common/__init__.py": '"""The project\'s own helpers."""\n',
    "common/text.py": """
        def slug(name):
            return "-".join(name.lower().split())
    """,
    "capture/__init__.py": '"""The project\'s own frame capture."""\n',
    "capture/frames.py": """
        def every_nth(frames, n):
            return frames[::n]
    """,
    "tests/test_replay_buffer.py": """
        from pathlib import Path

        import replay
        from replay.buffer import ReplayBuffer

        PROJECT = Path(__file__).resolve().parents[1]


        def test_replay_buffer_keeps_the_latest():
            assert Path(replay.__file__).resolve() == PROJECT / "replay" / "__init__.py"
            buffer = ReplayBuffer(2)
            for item in range(3):
                buffer.push(item)
            assert buffer.items == [1, 2]
    """,
    "tests/test_common_text.py": """
        from pathlib import Path

        import common
        import parity_harness.common
        from common.text import slug

        PROJECT = Path(__file__).resolve().parents[1]


        def test_common_is_ours_beside_the_harness():
            assert Path(common.__file__).resolve() == PROJECT / "common" / "__init__.py"
            assert Path(parity_harness.common.__file__).resolve().parent != PROJECT / "common"
            assert slug("Replay Buffer") == "replay-buffer"
    """,
    "tests/test_capture_frames.py": """
        from pathlib import Path

        import capture
        from capture.frames import every_nth

        PROJECT = Path(__file__).resolve().parents[1]


        def test_capture_is_ours():
            assert Path(capture.__file__).resolve() == PROJECT / "capture" / "__init__.py"
            assert every_nth(list(range(7)), 3) == [0, 3, 6]
    """,
    "tests/test_model_parity.py": """
        import torch
        from torch import nn


        def build():
            torch.manual_seed(0)
            return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


        def test_model_matches_golden(parity, pytestconfig):
            inputs = (torch.randn(3, 4, generator=torch.Generator().manual_seed(0)),)
            result = parity.check(build(), inputs)
            if pytestconfig.getoption("parity_regen"):
                assert result is None
            else:
                assert result.match
    """,
}
USER_PROJECT_PASSED = 4
GOLDEN = "tests/test_model_parity/test_model_matches_golden.h5"

# Another distribution that owns a top-level ``common`` (shaped like PyPI's ``common`` 0.1.2), built locally.
OTHER_COMMON = {
    "pyproject.toml": """
        [build-system]
        requires = ["setuptools>=64"]
        build-backend = "setuptools.build_meta"

        [project]
        name = "common"
        version = "0.0.1"

        [tool.setuptools]
        packages = ["common", "common.term"]
    """,
    "common/__init__.py": 'OWNER = "common 0.0.1"\n',
    "common/term/__init__.py": "",
    "common/term/progress.py": "def bar(done, total):\n    return '#' * done + '.' * (total - done)\n",
}
IMPORT_BOTH = (
    "import json, common, common.term.progress, parity_harness.common; import " + PLUGIN + "\n"
    "print(json.dumps({'common': common.__file__, 'owner': common.OWNER, 'harness': parity_harness.common.__file__}))"
)


def _require(*modules: str) -> None:
    """Skip when the running interpreter genuinely lacks a tool the test builds with."""
    for name in modules:
        if importlib.util.find_spec(name) is None:
            pytest.skip(f"{name} is not importable by {sys.executable}; cannot build or install a wheel")


def _clean_env() -> dict[str, str]:
    """The caller's environment minus what could put other code on the path or change pytest's plugins."""
    env = {key: value for key, value in os.environ.items() if not key.startswith(("PYTHON", "PYTEST_", "VIRTUAL_ENV"))}
    return {**env, "PYTHONNOUSERSITE": "1"}


def _run(args: list[str], cwd: Path, what: str) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(args, cwd=cwd, env=_clean_env(), capture_output=True, text=True, timeout=900, check=False)
    assert done.returncode == 0, f"{what} failed ({done.returncode}):\n{done.stdout[-6000:]}\n{done.stderr[-6000:]}"
    return done


def _write_tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text).lstrip(), encoding="utf-8")
    return root


def _build_wheel(source: Path, out: Path) -> Path:
    """Build ``source`` through its declared backend, with what is installed here (no network)."""
    pip = [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "--no-index"]
    _run([*pip, "--wheel-dir", str(out), str(source)], source, f"building a wheel of {source}")
    (wheel,) = out.glob("*.whl")
    return wheel


def _pip_install(python: Path, *args: str) -> None:
    # --no-compile: byte-compiling torch's thousands of files would double the install time.
    pip = [sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet", "--no-compile"]
    _run([*pip, "--disable-pip-version-check", *args], python.parent, f"pip install {' '.join(args)}")


def _pytest(python: Path, project: Path, *args: str) -> dict[str, int]:
    """Run pytest in ``project`` under ``python``; return the summary's counts but warnings (``{"passed": 4}``)."""
    done = _run([str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", *args], project, "the user's pytest")
    summary = done.stdout.strip().splitlines()[-1]
    counts = re.findall(r"(\d+) (passed|failed|errors?|skipped|xfailed|xpassed|deselected)", summary)
    return {kind: int(n) for n, kind in counts}


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A snapshot of what a build reads, so that building never writes into (or reuses stale files of) the repo."""
    dest = tmp_path_factory.mktemp("source")
    for item in ROOT.iterdir():
        if item.is_file() and not item.name.startswith("."):
            shutil.copy2(item, dest / item.name)
    for top in TOPS:
        shutil.copytree(ROOT / top, dest / top, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info"))
    return dest


@pytest.fixture(scope="module")
def wheel(source: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """parity-harness's wheel, built from the snapshot."""
    _require("pip", "setuptools")
    return _build_wheel(source, tmp_path_factory.mktemp("dist"))


def _names(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as archive:
        return archive.namelist()


def _dist_info(wheel: Path) -> str:
    (info,) = {name.split("/")[0] for name in _names(wheel) if name.split("/")[0].endswith(".dist-info")}
    return info


def _read(wheel: Path, name: str) -> str:
    with zipfile.ZipFile(wheel) as archive:
        return archive.read(name).decode("utf-8")


def test_wheel_has_one_top_level_name(wheel: Path) -> None:
    """Installing parity-harness adds only the import name parity_harness, never a top-level common/replay/capture."""
    info = _dist_info(wheel)
    names = _names(wheel)
    assert [name for name in names if not name.startswith((f"{NAMESPACE}/", f"{info}/"))] == []
    assert [name for name in names if name.endswith(".py") and not name.startswith(f"{NAMESPACE}/")] == []
    if f"{info}/top_level.txt" in names:
        assert _read(wheel, f"{info}/top_level.txt").split() == [NAMESPACE]


def test_wheel_ships_every_module_and_py_typed(wheel: Path, source: Path) -> None:
    """Every module of common/, capture/ and replay/ is installed as parity_harness/<same path>, with py.typed."""
    expected = {
        f"{NAMESPACE}/{path.relative_to(source).as_posix()}" for top in TOPS for path in (source / top).rglob("*.py")
    }
    shipped = {name for name in _names(wheel) if name.endswith(".py")}
    assert sorted(expected - shipped) == [], "modules missing from the wheel (a package not listed in pyproject?)"
    assert sorted(shipped - expected) == [], "modules in the wheel that the repository does not have"
    assert {f"{NAMESPACE}/{top}/py.typed" for top in TOPS} <= set(_names(wheel))


def test_wheel_entry_points_name_shipped_modules(wheel: Path) -> None:
    """The console scripts and the pytest11 plugin keep their names and point at modules inside the wheel."""
    points = configparser.ConfigParser(interpolation=None)
    points.optionxform = str  # type: ignore[assignment,method-assign]
    points.read_string(_read(wheel, f"{_dist_info(wheel)}/entry_points.txt"))
    scripts = dict(points["console_scripts"])
    assert set(scripts) >= SCRIPTS
    assert dict(points["pytest11"]) == {"parity": PLUGIN}
    names = set(_names(wheel))
    for target in [*scripts.values(), PLUGIN]:
        module = target.split(":")[0].strip().replace(".", "/")
        assert {f"{module}.py", f"{module}/__init__.py"} & names, f"{target}: module not in the wheel"


@pytest.mark.slow
def test_user_project_with_its_own_common_replay_capture(wheel: Path, tmp_path: Path) -> None:
    """In a fresh venv, a project's own replay/common/capture and the parity fixture work, even beside a 2nd common."""
    _require("venv", "pip", "setuptools")
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], tmp_path, "creating a venv")
    python = venv / "bin" / "python"
    _pip_install(python, "-c", str(CONSTRAINTS), "torch")
    _pip_install(python, "-c", str(CONSTRAINTS), str(wheel), "pytest")

    project = _write_tree(tmp_path / "project", USER_PROJECT)
    assert _pytest(python, project, "--parity-regen") == {"passed": USER_PROJECT_PASSED}
    assert (project / GOLDEN).is_file()
    assert _pytest(python, project) == {"passed": USER_PROJECT_PASSED}

    other = _build_wheel(_write_tree(tmp_path / "other-common", OTHER_COMMON), tmp_path / "other-dist")
    _pip_install(python, "--no-index", "--no-deps", str(other))
    found = json.loads(_run([str(python), "-c", IMPORT_BOTH], tmp_path, "importing both").stdout)
    assert found["owner"] == "common 0.0.1"
    assert Path(found["common"]).resolve().is_relative_to(venv.resolve())
    assert Path(found["harness"]).resolve().is_relative_to(venv.resolve())
    assert _pytest(python, project) == {"passed": USER_PROJECT_PASSED}
