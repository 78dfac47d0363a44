"""``lungcal --help`` and argument errors answer without loading torch, MLflow or matplotlib (issue 35 item 7).

Not a timing test: it checks which modules building the CLI imports, in a fresh interpreter.
"""
from __future__ import annotations

import subprocess
import sys

HEAVY = ("torch", "mlflow", "matplotlib", "monai", "SimpleITK")


def test_building_the_cli_imports_none_of_the_heavy_libraries():
    code = ("import sys\nfrom lungcal.cli import build_parser\nbuild_parser()\n"
            f"print(','.join(m for m in {HEAVY!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"building the CLI imported {out.stdout.strip()}"


def test_the_tracking_names_load_at_once_and_the_tracker_on_first_use():
    code = ("import sys\nimport lungcal.tracking as t\nassert t.TAG_STAGE1 == 'lungcal.stage1'\n"
            "assert 'mlflow' not in sys.modules\nassert t.RunTracker.__name__ == 'RunTracker'\n"
            "assert 'mlflow' in sys.modules\nprint('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "ok", out.stderr
