"""Shared fixtures: tiny models, the example reference/port pair, and captured bundles."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
import torch._dynamo  # (see below)

from parity_harness.capture.models.adapters import load_adapter
from parity_harness.capture.record.recorder import capture_run
from parity_harness.common.format.bundle.migrations import migrate
from parity_harness.common.format.bundle.schema import parse_index
from parity_harness.common.format.packing import pack, unpack
from parity_harness.common.numerics import bytewise
from parity_harness.replay import reader as reader_module
from parity_harness.replay.compare.runner import compare_run
from parity_harness.replay.naming.mapping import read_map
from parity_harness.replay.reader import BundleReader
from parity_harness.replay.result import ComparisonResult
from tests.models import build_tiny, tiny_inputs

pytest_plugins = ["pytester"]
# Imported up front: an in-process pytester run drops the modules first imported inside it from
# sys.modules, and torch._dynamo's operator libraries cannot be registered a second time when a
# later test imports it again (RuntimeError: Only a single TORCH_LIBRARY ... _inductor_test).

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
REF_ADAPTER = EXAMPLES / "conformer_ref" / "adapter.py"
PORT_DIR = EXAMPLES / "conformer_port"
PORT_MAP = PORT_DIR / "port_to_ref.map"


_SHARED_INDEXES: dict[int, tuple[object, bytes]] = {}
"""Per index the readers of this process share (``replay.reader._RecentIndexes``): the index, and its plain form
packed (bytes: a NaN among its statistics compares equal to itself)."""


@pytest.fixture(autouse=True)
def shared_indexes_unchanged() -> Iterator[None]:
    """After every test: each index the readers share is still what its bytes decode to, and what was built from it
    (``BundleReader.derived``) what building it again gives, so that no code path (a replay, a report, a test's own)
    changes what later openings of the bundle start from."""
    yield
    for entry in reader_module._decoded._entries:
        now = pack(entry.index.to_dict()).tobytes()
        seen = _SHARED_INDEXES.get(id(entry.index))
        if seen is None or seen[0] is not entry.index:
            fresh = parse_index(migrate(unpack(entry.raw, where="index"), entry.version[0]))
            seen = _SHARED_INDEXES[id(entry.index)] = (entry.index, pack(fresh.to_dict()).tobytes())
        assert now == seen[1], "a shared bundle index was changed after it was decoded"
        for build, built in entry.derived.items():
            assert built == build(entry.index), f"what {build.__qualname__} built from a shared index was changed"
    walks = reader_module._walked
    for identity, derived in walks._derived.items():
        facts = derived.get("facts")
        fresh = reader_module._WalkFacts.of(walks._catalogs[identity].datasets)
        assert facts in (None, fresh), "the facts derived from a kept walk were changed"


@pytest.fixture(params=["memcmp", "fallback"])
def comparison(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Both ways bytes are compared: the C library's memcmp, and without it the caller's own way (torch.equal or
    NumPy on integer views), as where no C library is found."""
    if request.param == "fallback":
        monkeypatch.setattr(bytewise, "_MEMCMP", None)
    else:
        assert bytewise._MEMCMP is not None


@pytest.fixture
def restore_sys_path(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Adapter and factory files insert their folder into sys.path and cache their module; undo both after the
    test."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    before = set(sys.modules)
    yield
    for name in set(sys.modules) - before:
        if name.startswith("parity_adapter_"):
            del sys.modules[name]


@pytest.fixture
def tiny_bundle(tmp_path: Path) -> Path:
    """A bundle of ``TinyNet`` on ``tiny_inputs()``, seed 42."""
    out = tmp_path / "tiny.h5"
    capture_run(build_tiny(), tiny_inputs(), out, seed=42)
    return out


@pytest.fixture
def tiny_ckpt(tmp_path: Path) -> Path:
    """TinyNet's state dict, as a plain checkpoint for --model factories."""
    path = tmp_path / "tiny.pt"
    torch.save(build_tiny().state_dict(), path)
    return path


@pytest.fixture
def capture_model(tmp_path: Path) -> Callable[..., Path]:
    """Capture any model and inputs into a fresh bundle path; returns the path."""
    counter = iter(range(1000))

    def run(model: torch.nn.Module, inputs: object, **options: object) -> Path:
        out = tmp_path / f"bundle{next(counter)}.h5"
        capture_run(model, inputs, out, **options)  # type: ignore[arg-type]
        return out

    return run


@pytest.fixture(scope="session")
def ref_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The example reference's checkpoint (a plain state dict)."""
    sys.path.insert(0, str(EXAMPLES / "conformer_ref"))
    from nemo_like_conformer import build_reference

    path = tmp_path_factory.mktemp("ckpt") / "ref.pt"
    torch.save(build_reference().state_dict(), path)
    return path


@pytest.fixture(scope="session")
def ref_bundle(tmp_path_factory: pytest.TempPathFactory, ref_checkpoint: Path) -> Path:
    """A capture of the example reference (batch 2, 16000 samples, seed 42), made through the CLI."""
    from click.testing import CliRunner

    from parity_harness.capture.cli.capture_run import main

    out = tmp_path_factory.mktemp("bundles") / "ref.h5"
    result = CliRunner().invoke(main, ["--ckpt", str(ref_checkpoint), "--adapter", str(REF_ADAPTER), "--out", str(out)])
    assert result.exit_code == 0, result.output
    return out


def replay_with_adapter(
    bundle: Path, ckpt: Path, adapter_file: Path, *, with_map: bool = True, **options: object
) -> ComparisonResult:
    """Replay an example adapter (reference or port) on a bundle with the library API, as the CLI does."""
    adapter = load_adapter(str(adapter_file))
    with BundleReader(bundle) as reader:
        return compare_run(
            adapter.model(str(ckpt), "cpu"),
            reader,
            forward=adapter.forward,
            isolation_inputs=adapter.isolation_inputs,
            rename=read_map(PORT_MAP) if with_map else None,
            **options,  # type: ignore[arg-type]
        )
