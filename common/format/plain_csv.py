"""A plain CSV split into its columns in blocks: the fast way to read the files that writers and loggers produce.

"Plain" is the subset of CSV where splitting at commas and line ends is all that ``csv.reader`` would do: UTF-8
text without quotes, NUL characters, blank lines or carriage returns other than ``\\r\\n`` line ends, and every
row with the header's number of fields. A file outside that subset is not read here (``None``): its caller reads
it row by row, whose errors name the line, so that what reads fast and what reads slow can never disagree on a
file (the row reader stays the one authority on everything unusual).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import BinaryIO, Final

import numpy as np

__all__ = ["read_plain_blocks", "read_plain_header"]

_BLOCK_BYTES: Final = 16 << 20
"""Bytes split at once (then up to the next line end): the field lists of one block are what the split holds
beside the columns it returns."""
_BOM: Final = b"\xef\xbb\xbf"
_NEWLINE: Final = 10
_COMMA: Final = 44


def read_plain_header(raw: BinaryIO, *, max_line_bytes: int, max_columns: int) -> list[str] | None:
    """The first line's cells, or None when that line is not plain CSV, is longer than ``max_line_bytes`` or has
    more than ``max_columns`` cells."""
    line = raw.readline(max_line_bytes + 1).removeprefix(_BOM)
    header = _split_block(_ended(raw, line, max_line_bytes), None, max_line_bytes)
    return None if header is None or len(header) > max_columns else header


def read_plain_blocks(raw: BinaryIO, width: int, *, max_line_bytes: int) -> Iterator[list[list[str]] | None]:
    """The rest of the file, a block of whole lines at a time, as each column's fields in that block (``width``
    columns); a None, and nothing after it, when a block is not plain CSV, has a row of another width or a line
    longer than ``max_line_bytes``."""
    while block := raw.read(_BLOCK_BYTES):
        fields = _split_block(_ended(raw, block + raw.readline(max_line_bytes + 1), max_line_bytes), width,
                              max_line_bytes)  # fmt: skip
        if fields is None:
            yield None
            return
        yield [fields[position::width] for position in range(width)]


def _ended(raw: BinaryIO, block: bytes, max_line_bytes: int) -> bytes | None:
    """``block`` ending in a line end (one added at the end of the file), or None when its last line is longer
    than the limit (more of it remains unread)."""
    if block.endswith(b"\n") or not block:
        return block
    return block + b"\n" if len(block.rpartition(b"\n")[2]) <= max_line_bytes and not raw.read(1) else None


def _split_block(block: bytes | None, width: int | None, max_line_bytes: int) -> list[str] | None:
    """A block of whole lines as one list of fields, row after row, when each line is plain and has ``width``
    fields (the header: any number, and exactly one line); None otherwise."""
    if not block or b'"' in block or b"\0" in block:
        return None
    if b"\r" in block:
        block = block.replace(b"\r\n", b"\n")
        if b"\r" in block:
            return None
    data = np.frombuffer(block, dtype=np.uint8)
    ends = np.flatnonzero(data == _NEWLINE)
    starts = np.concatenate(([0], ends[:-1] + 1))
    lengths = ends - starts
    if width is None and len(ends) != 1:
        return None
    if lengths.min() == 0 or lengths.max() > max_line_bytes:
        return None  # a blank line (csv skips it: the row reader numbers lines) or a line beyond the bounds
    commas = np.diff(np.searchsorted(np.flatnonzero(data == _COMMA), ends), prepend=0)
    if width is not None and np.any(commas != width - 1):
        return None
    try:
        text = block.decode("utf-8")
    except UnicodeDecodeError:
        return None
    return text[:-1].replace("\n", ",").split(",")
