"""Assertions shared by the CLI tests of both tools."""

from __future__ import annotations

from click.testing import Result


def one_error_line(program: str, result: Result) -> str:
    """Check exit 2 with one error line on stderr, no traceback, nothing on stdout; return the line."""
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    assert "Traceback" not in result.output
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"{program}: error: "), lines[0]
    return lines[0]
