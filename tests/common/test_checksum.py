"""The CRC-32 every checksum is taken with: zlib's value, whichever implementation computes it."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import types
import zlib

import numpy as np
import pytest

from parity_harness.common.numerics import checksum
from parity_harness.common.numerics.statistics import stored_crc32

ACCELERATED = [("isal", "isal.isal_zlib")]


def _implementation(module: str) -> checksum.Crc32:
    try:
        return importlib.import_module(module).crc32  # type: ignore[no-any-return]
    except ImportError:
        pytest.skip(f"{module} is not installed in this environment")


@pytest.mark.parametrize(("name", "module"), ACCELERATED)
@pytest.mark.parametrize("seed", range(3))
def test_every_implementation_gives_zlibs_crc32(name: str, module: str, seed: int) -> None:
    """Lengths across the block sizes fast implementations switch at, unaligned starts, running values carried
    in, and pieces chained: each gives the standard library's CRC-32."""
    crc32 = _implementation(module)
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, size=3 << 20, dtype=np.uint8)
    for length in (0, 1, 7, 31, 64, 1000, 4096, 65537, 1 << 20, (3 << 20) - 5):
        start = int(rng.integers(0, 5))
        piece = memoryview(data)[start : start + length]
        carried = int(rng.integers(0, 1 << 32))
        assert crc32(piece) == zlib.crc32(piece), (name, length, start)
        assert crc32(piece, carried) == zlib.crc32(piece, carried), (name, length, start)
    halves = crc32(memoryview(data)[(1 << 20) :], crc32(memoryview(data)[: 1 << 20]))
    assert halves == zlib.crc32(data)


def test_stored_checksums_are_zlibs_crc32_of_the_stored_bytes() -> None:
    """What a bundle holds for an array: zlib's CRC-32 of its bytes in C order, whichever implementation ran."""
    values = np.arange(3 * 5 * 7, dtype=np.float32).reshape(3, 5, 7).transpose(2, 0, 1)  # not C-contiguous
    assert stored_crc32(values) == zlib.crc32(np.ascontiguousarray(values).tobytes())


def test_an_installed_accelerator_is_used() -> None:
    _implementation("isal.isal_zlib")
    assert checksum._choose(None)[0] == "isal"


def test_asking_for_zlib_keeps_the_standard_librarys() -> None:
    assert checksum._choose("zlib") == ("zlib", zlib.crc32)


def test_a_misspelt_choice_is_said_and_the_fastest_used() -> None:
    with pytest.warns(UserWarning, match="PARITY_HARNESS_CRC32='ISA-L' names no CRC-32 implementation"):
        chosen = checksum._choose("ISA-L")
    assert chosen == checksum._choose(None)


def test_an_accelerator_that_disagrees_with_zlib_is_not_used(monkeypatch: pytest.MonkeyPatch) -> None:
    """An importable accelerator whose CRC-32 differs from zlib's on the probe (a broken build), that raises, or
    that fails to load is passed over: checksums never depend on which library a machine happens to have."""
    wrong = types.SimpleNamespace(crc32=lambda data, value=0: (zlib.crc32(data, value) + 1) & 0xFFFFFFFF)
    wrong_when_large = types.SimpleNamespace(crc32=lambda data, value=0: zlib.crc32(data[:65536], value))
    broken = types.SimpleNamespace(crc32=lambda data, value=0: 1 // 0)
    loaded: list[object] = []

    def fake_import(name: str) -> object:
        assert name == checksum.ACCELERATOR
        if isinstance(loaded[0], Exception):
            raise loaded[0]
        return loaded[0]

    monkeypatch.setattr(checksum.importlib, "import_module", fake_import)
    for module in (wrong, wrong_when_large, broken, ImportError("no isal"), OSError("bad build")):
        loaded[:] = [module]
        assert checksum._choose(None) == ("zlib", zlib.crc32), module
    loaded[:] = [types.SimpleNamespace(crc32=zlib.crc32)]
    assert checksum._choose(None)[0] == "isal"
    assert checksum._choose("zlib")[0] == "zlib"


@pytest.mark.parametrize(("name", "module"), [("zlib", "zlib"), *ACCELERATED])
def test_the_environment_variable_picks_the_implementation(name: str, module: str) -> None:
    """``PARITY_HARNESS_CRC32`` is honoured by a fresh interpreter (what the bench uses to compare)."""
    _implementation(module)
    code = "from parity_harness.common.numerics.checksum import CRC32_IMPLEMENTATION as n; print(n)"
    env = {**os.environ, "PARITY_HARNESS_CRC32": name}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120, check=True
    )
    assert done.stdout.strip() == name


@pytest.mark.slow
@pytest.mark.parametrize(("name", "module"), ACCELERATED)
def test_a_buffer_past_4_gib_gets_zlibs_crc32(name: str, module: str) -> None:
    """A tensor over 4 GiB (a large embedding's gradient): an implementation taking a 32-bit length would wrap."""
    crc32 = _implementation(module)
    data = np.zeros((1 << 32) + 4099, dtype=np.uint8)  # pages never written stay unallocated
    data[:64] = 7
    data[(1 << 32) - 3 : (1 << 32) + 3] = 9  # bytes on both sides of the 4 GiB mark
    data[-5:] = 11  # a length taken modulo 2**32 would leave these out
    assert crc32(data) == zlib.crc32(data), name
