"""What the ``parity`` fixture does: find the golden bundle, regenerate it, or assert parity."""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from parity_harness.capture.record.recorder import capture_run
from parity_harness.replay.assertions import assert_parity
from parity_harness.replay.result import ComparisonResult

__all__ = ["ParityFixture", "ParityRegenerated"]


class ParityRegenerated(UserWarning):
    """A golden bundle was (re)captured instead of compared."""


class ParityFixture:
    """Bound to one test: knows its default bundle path, tolerances and whether to regenerate."""

    def __init__(self, request: pytest.FixtureRequest, regenerated: list[str]) -> None:
        self._request, self._regenerated = request, regenerated

    def default_bundle(self) -> Path:
        """``<bundle dir or test file dir>/<test module>/<test name>.h5``."""
        test_file = Path(self._request.node.path)
        base = self._request.config.getini("parity_bundle_dir")
        folder = Path(self._request.config.rootpath, base) if base else test_file.parent
        name = self._request.node.name.replace("/", "_").replace("[", "-").replace("]", "")
        return folder / test_file.stem / f"{name}.h5"

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
        path = Path(bundle) if bundle is not None else self.default_bundle()
        if self._request.config.getoption("parity_regen"):
            self._regenerate(model, inputs, path, seed, options)
            return None
        if not path.exists():
            pytest.fail(
                f"golden bundle {path} does not exist; create it in the reference environment with\n"
                f"    pytest {self._request.node.nodeid} --parity-regen\n"
                f"or with capture-run ... --out {path}",
                pytrace=False,
            )
        atol_, rtol_ = self._tolerances(atol, rtol)
        return assert_parity(model, path, atol=atol_, rtol=rtol_, **options)

    def _regenerate(self, model: torch.nn.Module, inputs: Any, path: Path, seed: int, options: dict[str, Any]) -> None:
        if inputs is None:
            pytest.fail("--parity-regen needs the inputs: parity.check(model, inputs)", pytrace=False)
        path.parent.mkdir(parents=True, exist_ok=True)
        capture_run(
            model, inputs, path, seed=seed, overwrite=True, forward=options.get("forward"), loss=options.get("loss"),
            allow_tf32=options.get("allow_tf32", False),
        )  # fmt: skip
        self._regenerated.append(str(path))
        warnings.warn(ParityRegenerated(f"golden bundle regenerated: {path}"), stacklevel=2)
        return
