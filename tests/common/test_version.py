"""The version gate: a bundle's format name and version decide whether this reader may read it."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from parity_harness.common.errors import BundleFormatError, UnsupportedBundleVersion
from parity_harness.common.format.bundle.version import (
    FORMAT_MINOR,
    FORMAT_NAME,
    FORMAT_VERSION,
    check_compatible,
    parse_format_version,
)


def test_format_constants() -> None:
    """The released format is parity-harness-bundle 1.6 (1.1 added the noise floor, 1.2 selection and summaries,
    1.3 arguments named after the forward's parameters, 1.4 the RNG's checksum, 1.5 buffers, 1.6 input gradients)."""
    assert (FORMAT_NAME, FORMAT_VERSION, FORMAT_MINOR) == ("parity-harness-bundle", 1, 6)


@pytest.mark.parametrize(
    ("value", "expected"),
    [(1, 1), (0, 0), (np.int64(3), 3), (np.uint8(2), 2)],
    ids=["int", "zero", "numpy-int64", "numpy-uint8"],
)
def test_parse_format_version_accepts(value: object, expected: int) -> None:
    """Non-negative integers, including the NumPy scalars h5py returns for attributes, are accepted."""
    number = parse_format_version(value, where="b.h5")
    assert number == expected
    assert type(number) is int


@pytest.mark.parametrize(
    "value",
    [None, "1", b"1", 1.5, -1, [1], np.float64(2.5), float("nan")],
    ids=["None", "str", "bytes", "fraction", "negative", "list", "numpy-fraction", "nan"],
)
def test_parse_format_version_refuses(value: object) -> None:
    """Anything but a non-negative integer raises BundleFormatError naming the file and the value."""
    with pytest.raises(BundleFormatError, match=r"^b\.h5: version attribute is"):
        parse_format_version(value, where="b.h5")


@pytest.mark.parametrize("value", [float("inf"), np.float64("-inf")], ids=["inf", "numpy-minus-inf"])
def test_parse_format_version_refuses_infinity(value: object) -> None:
    """An infinite version attribute is a damaged bundle."""
    with pytest.raises(BundleFormatError, match=r"b\.h5"):
        parse_format_version(value, where="b.h5")


def test_parse_format_version_refuses_bool() -> None:
    """A boolean version attribute is refused."""
    with pytest.raises(BundleFormatError):
        parse_format_version(True, where="b.h5")


def test_check_compatible_current() -> None:
    """The current version is accepted silently."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_compatible(FORMAT_NAME, FORMAT_VERSION, FORMAT_MINOR, where="b.h5")


@pytest.mark.parametrize(
    "name", ["safetensors", "", None, b"parity-harness-bundle"], ids=["other", "empty", "None", "bytes"]
)
def test_check_compatible_wrong_format_name(name: object) -> None:
    """A file whose format attribute is not the bundle's is refused as not a bundle (not as a version issue)."""
    with pytest.raises(BundleFormatError, match=r"^b\.h5: not a parity-harness bundle") as info:
        check_compatible(name, FORMAT_VERSION, FORMAT_MINOR, where="b.h5")
    assert not isinstance(info.value, UnsupportedBundleVersion)
    assert repr(name) in str(info.value)


@pytest.mark.parametrize(("major", "minor"), [(FORMAT_VERSION + 1, 0), (FORMAT_VERSION + 7, 3)], ids=["next", "far"])
def test_check_compatible_newer_major(major: int, minor: int) -> None:
    """A newer major version raises UnsupportedBundleVersion naming the bundle's and the reader's versions."""
    with pytest.raises(UnsupportedBundleVersion) as info:
        check_compatible(FORMAT_NAME, major, minor, where="b.h5")
    message = str(info.value)
    assert message.startswith("b.h5:")
    assert f"{major}.{minor}" in message
    assert f"{FORMAT_VERSION}.x" in message
    assert "upgrade" in message


def test_unsupported_version_is_a_format_error() -> None:
    """UnsupportedBundleVersion can be caught as BundleFormatError and ValueError."""
    with pytest.raises(BundleFormatError):
        check_compatible(FORMAT_NAME, FORMAT_VERSION + 1, 0, where="b.h5")
    with pytest.raises(ValueError, match="is not supported by this reader"):
        check_compatible(FORMAT_NAME, FORMAT_VERSION + 1, 0, where="b.h5")


@pytest.mark.parametrize("major", [0, -1], ids=["zero", "negative"])
def test_check_compatible_major_below_one(major: int) -> None:
    """Major version 0 or below never existed and is refused."""
    with pytest.raises(UnsupportedBundleVersion, match=rf"{major}\.0"):
        check_compatible(FORMAT_NAME, major, 0, where="b.h5")


def test_check_compatible_newer_minor_warns() -> None:
    """A newer minor version of the same major is read with a warning naming both versions."""
    newer = f"{FORMAT_VERSION}.{FORMAT_MINOR + 1}"
    with pytest.warns(UserWarning, match=rf"^b\.h5: bundle format {newer} is newer than this reader's") as record:
        check_compatible(FORMAT_NAME, FORMAT_VERSION, FORMAT_MINOR + 1, where="b.h5")
    assert f"{FORMAT_VERSION}.{FORMAT_MINOR}" in str(record[0].message)
