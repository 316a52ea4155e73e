"""What the ``parity`` fixture does: find the golden bundle, regenerate it, or assert parity."""

from __future__ import annotations

import hashlib
import os
import re
import warnings
from pathlib import Path
from typing import Any, Final

import pytest
import torch

from parity_harness.capture.record.recorder import capture_run
from parity_harness.replay.assertions import assert_parity
from parity_harness.replay.result import ComparisonResult

__all__ = ["ParityFixture", "ParityRegenerated", "file_name"]


_PLAIN: Final = re.compile(r"[A-Za-z0-9_]+(\[[A-Za-z0-9_.=+-]*\])?")
"""A test name written as a file name as it is (the brackets of its parameter id dropped): a function's name, and the
characters of an id that no other id can stand for."""


_LONGEST: Final = 120
"""Characters of a test name kept as they are in its file name (file systems take 255 bytes)."""


def file_name(test_name: str) -> str:
    """``test_name`` (``test_x[id]``) as a file name that no other test's name gives: ``test_x-id``; a name with any
    other character (an id ``a/b``, which ``a_b`` would also give), or longer than :data:`_LONGEST`, has them replaced
    or is cut, and a digest of the name added."""
    if _PLAIN.fullmatch(test_name) and len(test_name) <= _LONGEST:
        return test_name.replace("[", "-").removesuffix("]")
    readable = re.sub(r"[^A-Za-z0-9_.=+-]", "_", test_name.replace("[", "-").removesuffix("]"))[:80]
    return f"{readable}-{hashlib.sha256(test_name.encode()).hexdigest()[:10]}"


class ParityRegenerated(UserWarning):
    """A golden bundle was (re)captured instead of compared."""


class ParityFixture:
    """Bound to one test: knows its default bundle path, tolerances and whether to regenerate."""

    def __init__(self, request: pytest.FixtureRequest, regenerated: dict[str, str]) -> None:
        self._request, self._regenerated = request, regenerated
        self._checks = 0  # this test's parity.check calls without bundle= so far

    def default_bundle(self, check: int = 1) -> Path:
        """The golden bundle of this test's ``check``-th ``parity.check`` without ``bundle=``:
        ``<bundle dir or test file dir>/<test module>/[<class>/]<test name>.h5``, ``~2``, ``~3``... before ``.h5``
        for the later checks. Under ``parity_bundle_dir`` the test module's path below the root folder is kept, so
        two test files of one name in two folders keep apart."""
        node = self._request.node
        test_file = Path(node.path)
        base = self._request.config.getini("parity_bundle_dir")
        if base:
            rootpath = Path(self._request.config.rootpath)
            # A test file outside the root folder keeps its whole path (its name alone could be another's).
            below = test_file.relative_to(rootpath if test_file.is_relative_to(rootpath) else test_file.anchor)
            folder = Path(rootpath, str(base), below.with_suffix(""))
        else:
            folder = test_file.parent / test_file.stem
        classes = node.nodeid.removesuffix(node.name).split("::")[1:-1]  # nested ones too: identifiers
        name = file_name(node.name) + (f"~{check}" if check > 1 else "")
        return folder.joinpath(*classes, f"{name}.h5")

    def _former_default_hint(self, bundle: object, path: Path) -> str:
        """A line on the bundle at the default path earlier versions gave this test, if one is there: that
        path left out the test's class and folder (two tests could share it), so it is not read in this one's place."""
        if bundle is not None or self._checks > 1:
            return ""
        test_file = Path(self._request.node.path)
        base = self._request.config.getini("parity_bundle_dir")
        folder = Path(self._request.config.rootpath, base) if base else test_file.parent
        name = self._request.node.name.replace("/", "_").replace("[", "-").replace("]", "")
        former = folder / test_file.stem / f"{name}.h5"
        if former == path or not former.exists():
            return ""
        return (
            f"\n({former} is where earlier versions put this test's golden bundle, and where another test of the same "
            "name in another class or folder could have put its own: move it here if it is this test's)"
        )

    def _tolerances(self, atol: float | None, rtol: float | None) -> tuple[float | None, float | None]:
        """The first of the call, the ``parity`` marker and the ini that gives atol and rtol (each must give both or
        neither); neither anywhere: the defaults, with the rounding check."""
        marker = self._request.node.get_closest_marker("parity")
        marked = marker.kwargs if marker else {}
        unknown = sorted(set(marked) - {"atol", "rtol"})
        if marker is not None and (marker.args or unknown):  # never a silent default in place of what was written
            given = [repr(a) for a in marker.args] + [f"{k}=..." for k in unknown]
            pytest.fail(
                f"@pytest.mark.parity({', '.join(given)}): the marker takes atol= and rtol= by keyword only, e.g. "
                "@pytest.mark.parity(atol=1e-4, rtol=1e-4)",
                pytrace=False,
            )
        config = self._request.config
        sources = [
            ("parity.check()", atol, rtol),
            ("@pytest.mark.parity", marked.get("atol"), marked.get("rtol")),
            (
                "the parity_atol/parity_rtol ini options",
                config.getini("parity_atol") or None,
                config.getini("parity_rtol") or None,
            ),
        ]
        for where, given_atol, given_rtol in sources:
            if (given_atol is None) != (given_rtol is None):
                pytest.fail(
                    f"{where} gives atol={given_atol!r}, rtol={given_rtol!r}: give both or neither", pytrace=False
                )
            if given_atol is not None:
                return float(given_atol), float(given_rtol)  # type: ignore[arg-type]
        return None, None

    def check(
        self,
        model: torch.nn.Module,
        inputs: Any = None,
        *,
        bundle: str | os.PathLike[str] | None = None,
        atol: float | None = None,
        rtol: float | None = None,
        seed: int = 42,
        **options: Any,
    ) -> ComparisonResult | None:
        """Assert that ``model`` matches the golden bundle (or capture it with ``--parity-regen``).

        Args:
            model: the model under test.
            inputs: what to call it with when (re)capturing; comparison feeds the recorded inputs.
            bundle: the golden bundle; default :meth:`default_bundle`.
            atol, rtol: override the marker and the ini defaults.
            seed: seed of a (re)capture.
            options: passed to :func:`replay.assert_parity` (``map``, ``isolate``, ``forward``...).
        """
        __tracebackhide__ = True
        if bundle is None:
            self._checks += 1
        path = Path(bundle) if bundle is not None else self.default_bundle(self._checks)
        if self._request.config.getoption("parity_regen"):
            self._regenerate(model, inputs, path, seed, options)
            return None
        if not path.exists():
            pytest.fail(
                f"golden bundle {path} does not exist; create it in the reference environment with\n"
                f"    pytest {self._request.node.nodeid} --parity-regen\n"
                f"or with capture-run ... --out {path}{self._former_default_hint(bundle, path)}",
                pytrace=False,
            )
        atol_, rtol_ = self._tolerances(atol, rtol)
        return assert_parity(model, path, atol=atol_, rtol=rtol_, **options)

    def _regenerate(self, model: torch.nn.Module, inputs: Any, path: Path, seed: int, options: dict[str, Any]) -> None:
        if inputs is None:
            pytest.fail("--parity-regen needs the inputs: parity.check(model, inputs)", pytrace=False)
        nodeid, key = self._request.node.nodeid, str(path.absolute())
        earlier = self._regenerated.get(key)
        if earlier not in (None, nodeid):  # its capture would replace the earlier one: a test would compare wrongly
            pytest.fail(
                f"--parity-regen: {path} was regenerated by {earlier} in this run already; give one of the two "
                "checks its own bundle=",
                pytrace=False,
            )
        path.parent.mkdir(parents=True, exist_ok=True)
        capture_run(
            model, inputs, path, seed=seed, overwrite=True, forward=options.get("forward"), loss=options.get("loss"),
            allow_tf32=options.get("allow_tf32", False),
        )  # fmt: skip
        self._regenerated[key] = nodeid
        warnings.warn(ParityRegenerated(f"golden bundle regenerated: {path}"), stacklevel=2)
        return
