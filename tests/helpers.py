"""Checks shared by the tests of the command line (imported as ``from tests.helpers import ...``)."""

from __future__ import annotations


def one_error(result, exit_code: int, *needles: str) -> str:
    """The output of a refused CliRunner run: `exit_code`, a SystemExit (no traceback), exactly one line starting
    `error:`, and each needle in the whitespace-normalised output, which is returned."""
    assert result.exit_code == exit_code, result.output
    assert isinstance(result.exception, SystemExit), result.exception
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result.output
    text = " ".join(result.output.split())
    for needle in needles:
        assert needle in text, result.output
    return text
