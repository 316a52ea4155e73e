"""The architecture as a test: which package may import what, read from every import statement of the
source (those inside functions included), plus an import with click, tabulate and pytest made unimportable."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import ROOT

TOPS = ("common", "capture", "replay")
NAMESPACE = "parity_harness"


def module_name(path: Path) -> str:
    """``capture/record/recorder.py`` -> ``parity_harness.capture.record.recorder``."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join((NAMESPACE, *parts))


def project_modules() -> dict[str, Path]:
    """Every installed module of the project by its dotted name."""
    return {module_name(path): path for top in TOPS for path in sorted((ROOT / top).rglob("*.py"))}


MODULES = project_modules()


def imports_of(path: Path) -> Iterator[str]:
    """Every absolute module name an ``import`` statement of the file names (``from a import b``: a.b if
    that is a module of ours, else a)."""
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}: relative import; use the parity_harness.* name"
            assert node.module is not None
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                yield sub if sub in MODULES else node.module


IMPORTS = {name: sorted(set(imports_of(path))) for name, path in MODULES.items()}


def within(name: str, *packages: str) -> bool:
    """Whether ``name`` is one of ``packages`` (dotted, below the namespace) or inside one."""
    return any(name == f"{NAMESPACE}.{p}" or name.startswith(f"{NAMESPACE}.{p}.") for p in packages)


def offenders(importer: str, predicate: object) -> list[str]:
    return [
        f"{name} imports {target}"
        for name, targets in IMPORTS.items()
        for target in targets
        if within(name, importer) and predicate(target)
    ]  # type: ignore[operator]


def top(target: str) -> str:
    return target.split(".")[0]


def test_every_project_import_goes_through_the_namespace() -> None:
    """No module imports a bare ``common``/``capture``/``replay``: installed, those names are someone else's."""
    bad = [f"{name} imports {t}" for name, targets in IMPORTS.items() for t in targets if top(t) in TOPS]
    assert bad == []


@pytest.mark.parametrize(
    ("importer", "forbidden"),
    [
        ("common", ("capture", "replay")),
        ("capture", ("replay",)),
    ],
    ids=["common-imports-neither-side", "capture-never-imports-replay"],
)
def test_dependencies_point_one_way(importer: str, forbidden: tuple[str, ...]) -> None:
    """common <- capture <- replay."""
    assert offenders(importer, lambda t: within(t, *forbidden)) == []


RENDERING = ("replay.report", "replay.cli", "replay.testing", "capture.cli")
FACADES = (f"{NAMESPACE}.replay", f"{NAMESPACE}.replay.ckpt_diff")
"""Package fronts that re-export a library's whole API, its report renderer included, each name on first use."""
PRESENTERS = (*RENDERING, "replay.assertions")


def test_computation_never_imports_rendering() -> None:
    """Only the shells (cli, report, testing, assert_parity's message) reach the rendering and CLI modules."""
    bad = [
        f"{name} imports {t}"
        for name, targets in IMPORTS.items()
        for t in targets
        if within(t, *RENDERING) and not within(name, *PRESENTERS) and name not in FACADES
    ]
    assert bad == []


@pytest.mark.parametrize(
    ("library", "allowed_in"),
    [
        ("click", ("capture.cli", "replay.cli")),
        ("tabulate", ("replay.report",)),
        ("matplotlib", ("replay.report",)),
        ("pytest", ("replay.testing",)),
    ],
    ids=["click", "tabulate", "matplotlib", "pytest"],
)
def test_presentation_libraries_stay_in_their_package(library: str, allowed_in: tuple[str, ...]) -> None:
    """click only in cli/, tabulate and matplotlib only in report/, pytest only in testing/."""
    bad = [
        f"{name} imports {t}"
        for name, targets in IMPORTS.items()
        for t in targets
        if top(t) == library and not within(name, *allowed_in)
    ]
    assert bad == []


CAPTURE_THIRD_PARTY = {"torch", "numpy", "h5py", "msgpack"}
# Imported lazily by the built-in adapters only, in the environment that has the framework.
BUILTIN_ONLY = {"transformers", "nemo", "omegaconf", "lightning", "yaml"}
# Optional, imported lazily where needed: a .nemo's model_config.yaml (the nemo-config extra).
MODELS_OPTIONAL = {"yaml"}


# Optional, imported by name where installed: the same CRC-32 as zlib's, faster (the fast extra). A name import
# is invisible to the scan above, so it is pinned here.
CHECKSUM_OPTIONAL = "isal"


def test_the_only_imports_by_name_in_common_are_the_crc32_accelerator() -> None:
    from parity_harness.common.numerics.checksum import ACCELERATOR

    assert ACCELERATOR.split(".")[0] == CHECKSUM_OPTIONAL
    by_name = sorted(
        str(path.relative_to(ROOT))
        for path in (ROOT / "common").rglob("*.py")
        if "import_module(" in path.read_text(encoding="utf-8")
    )
    # common/__init__.py imports its own modules by name, lazily (their targets are checked there).
    assert by_name == ["common/__init__.py", "common/numerics/checksum.py"]
    from parity_harness.common import _LAZY

    assert all(target.startswith(f"{NAMESPACE}.common.") for target in _LAZY.values())


def test_capture_side_imports_only_its_light_dependencies() -> None:
    """capture/ and common/ import torch, numpy, h5py, msgpack and the standard library (click in cli/)."""
    allowed = set(sys.stdlib_module_names) | CAPTURE_THIRD_PARTY | {NAMESPACE}
    bad = []
    for name, targets in IMPORTS.items():
        if not within(name, "capture", "common"):
            continue
        extra = {"click"} if within(name, "capture.cli") else set()
        extra |= BUILTIN_ONLY if within(name, "capture.models.builtin") else set()
        extra |= MODELS_OPTIONAL if within(name, "capture.models") else set()
        bad += [f"{name} imports {t}" for t in targets if top(t) not in allowed | extra]
    assert bad == []


def find_cycle(graph: dict[str, list[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a path that ends where it starts, or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in graph.get(node, []):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in graph:
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_no_import_cycles() -> None:
    """No module reaches itself through the project's imports (package __init__ re-exports aside)."""
    graph = {
        name: [t for t in targets if t in MODULES and MODULES[t].name != "__init__.py"]
        for name, targets in IMPORTS.items()
        if MODULES[name].name != "__init__.py"
    }
    assert find_cycle(graph) is None


def test_the_cycle_finder_finds_cycles() -> None:
    """The cycle check can fail: a two-module loop and a self-import are found."""
    assert find_cycle({"a": ["b"], "b": ["a"]}) == ["a", "b", "a"]
    assert find_cycle({"a": ["a"]}) == ["a", "a"]
    assert find_cycle({"a": ["b"], "b": []}) is None


BLOCKED = ("click", "tabulate", "pytest", "matplotlib")


def capture_side_modules() -> list[str]:
    return [n for n in MODULES if within(n, "common", "capture") and not within(n, "capture.cli")]


@pytest.mark.parametrize(
    "modules",
    [[f"{NAMESPACE}.common"], [f"{NAMESPACE}.capture"], capture_side_modules()],
    ids=["common", "capture", "every-capture-side-module"],
)
def test_capture_side_needs_no_cli_or_test_packages(modules: list[str]) -> None:
    """The capture side imports with click, tabulate, pytest and matplotlib made unimportable."""
    block = "; ".join(f"sys.modules[{name!r}] = None" for name in BLOCKED)
    imports = "; ".join(f"import {module}" for module in modules if not within(module, "capture.models.builtin"))
    code = f"import sys; {block}; {imports}; print('ok')"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/", check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


@pytest.mark.parametrize("package", TOPS)
def test_installed_packages_resolve_to_this_checkout(package: str) -> None:
    """``parity_harness.common`` (and the others) are this repository's directories, imported by that name."""
    module = __import__(f"{NAMESPACE}.{package}", fromlist=["_"])
    assert module.__file__ is not None
    assert Path(module.__file__).resolve().parent == ROOT / package


@pytest.mark.parametrize(
    ("product", "absent"),
    [
        (
            "replay.cli.ckpt_diff",
            ("capture.record.recorder", "capture.storage", "capture.observe.hooks", "replay.compare"),
        ),
        ("replay.cli.train_diff", ("capture.record.recorder", "capture.storage", "replay.compare", "replay.diagnose")),
        ("replay.testing.pytest_plugin", ("capture.record", "replay.compare", "torch")),
    ],
    ids=["ckpt-diff", "parity-train-diff", "pytest-plugin"],
)
def test_a_product_loads_only_what_it_uses(product: str, absent: tuple[str, ...]) -> None:
    """Importing one product's entry point does not load another product's machinery (nor torch, for the plugin)."""
    code = (
        f"import sys, {NAMESPACE}.{product}; print('\\n'.join(n.removeprefix('parity_harness.') for n in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/", check=False)
    assert done.returncode == 0, done.stderr
    loaded = set(done.stdout.split())
    assert [m for m in loaded if any(m == a or m.startswith(f"{a}.") for a in absent)] == []
