"""The ``parity`` pytest fixture (registered through the ``pytest11`` entry point).

Kept thin and cheap to load: torch and the replay machinery are imported only when a test uses
the fixture (:mod:`parity_harness.replay.testing.fixture`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from parity_harness.replay.testing.fixture import ParityFixture

REGENERATED = pytest.StashKey[dict[str, str]]()
"""The golden bundles --parity-regen wrote in this run: path -> the test that wrote it."""


def pytest_addoption(parser: pytest.Parser) -> None:
    """Options in a ``parity`` group, with ini defaults."""
    group = parser.getgroup("parity", "model parity against recorded bundles (parity-harness)")
    group.addoption(
        "--parity-regen",
        action="store_true",
        help="Capture the golden bundles from the given models instead of comparing.",
    )
    parser.addini("parity_atol", "atol of the parity fixture (with parity_rtol; unset: the defaults).", default="")
    parser.addini("parity_rtol", "rtol of the parity fixture (with parity_atol; unset: the defaults).", default="")
    parser.addini("parity_bundle_dir", "Folder of golden bundles (default: beside each test file).", default="")


def pytest_configure(config: pytest.Config) -> None:
    """Declare the marker and prepare the list of regenerated bundles."""
    config.addinivalue_line("markers", "parity(atol=None, rtol=None): per-test tolerances of the parity fixture")
    config.stash[REGENERATED] = {}


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    """List the golden bundles written by --parity-regen."""
    regenerated = config.stash.get(REGENERATED, {})
    if regenerated:
        terminalreporter.section("parity: golden bundles regenerated")
        for path in regenerated:
            terminalreporter.line(path)


@pytest.fixture
def parity(request: pytest.FixtureRequest) -> ParityFixture:
    """Check that a model matches its golden bundle: ``parity.check(model, inputs)``."""
    from parity_harness.replay.testing.fixture import ParityFixture

    return ParityFixture(request, request.config.stash[REGENERATED])
