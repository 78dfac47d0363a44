"""The type check of ``.ci/run`` catches a wrong argument type (``[tool.mypy]`` in pyproject.toml).

mypy runs on a small file, with the project's configuration, from the repository root (so it reads
``lungcal`` from the source tree) and with the repository's cache (warm after ``mypy`` in .ci/run).
The wrong call sits in an unannotated function: ``check_untyped_defs`` is what makes mypy look there.
"""
from __future__ import annotations

from pathlib import Path

import pytest

api = pytest.importorskip("mypy.api")

ROOT = Path(__file__).resolve().parents[1]

SNIPPET = '''\
import numpy as np

from lungcal.calibration.metrics import ece


def good():
    return ece(np.zeros((4, 2)), np.zeros(4, int), n_bins=10)


def bad():
    return ece(np.zeros((4, 2)), np.zeros(4, int), n_bins="10")
'''


def test_mypy_reports_a_wrong_argument_type(tmp_path, monkeypatch):
    snippet = tmp_path / "wrong_argument.py"
    snippet.write_text(SNIPPET)
    monkeypatch.chdir(ROOT)
    out, err, status = api.run(["--config-file", str(ROOT / "pyproject.toml"), "--cache-dir",
                                str(ROOT / ".mypy_cache"), "--no-error-summary", "--hide-error-context",
                                str(snippet)])
    errors = [line for line in out.splitlines() if ": error:" in line]
    assert status == 1, out + err
    assert len(errors) == 1, out  # the good call passes
    assert f"{snippet.name}:11: error:" in errors[0], errors[0]  # (mypy's cache may name an earlier tmp_path)
    assert 'Argument "n_bins" to "ece" has incompatible type "str"; expected "int"' in errors[0]
    assert errors[0].endswith("[arg-type]")
