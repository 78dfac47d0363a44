"""The exit hook finds a LungcalError however deep MONAI wrapped it, and leaves other exceptions alone."""
from __future__ import annotations

import subprocess
import sys

from lungcal.errors import DataError
from lungcal.runtime.exit_hook import find_lungcal_error


def _wrapped() -> BaseException:
    try:
        try:
            raise DataError("datalist not found", file="x.json", field="datalist", fix="pass one")
        except DataError as inner:
            raise RuntimeError("Failed to evaluate ConfigExpression") from inner
    except RuntimeError as outer:
        try:
            raise ValueError("while handling") from None
        except ValueError as last:
            last.__context__ = outer  # implicit chaining, as an except block that raises again
            return last


def test_finds_the_error_through_cause_and_context():
    found = find_lungcal_error(_wrapped())
    assert isinstance(found, DataError) and "x.json" in str(found)
    assert find_lungcal_error(RuntimeError("plain")) is None
    assert find_lungcal_error(None) is None


def test_other_exceptions_keep_their_traceback():
    code = "import lungcal.runtime.exit_hook\nraise KeyError('boom')"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "Traceback" in proc.stderr and "KeyError" in proc.stderr


def test_a_lungcal_error_is_one_line_and_exit_code_2():
    code = ("import lungcal.runtime.exit_hook\nfrom lungcal.errors import ConfigError\n"
            "try:\n    raise ConfigError('bad', field='epochs', fix='set 1')\n"
            "except ConfigError as e:\n    raise RuntimeError('wrapped') from e")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == ["lungcal: error: field 'epochs': bad. Fix: set 1."]
