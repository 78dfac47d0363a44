"""``scripts/bench_cifar.py`` runs against the bundles as they are: it builds the bundle's ``train#trainer`` with an
in-memory data object in place of the ``data`` section, and the bundles' recorded settings read that section's
config (a change to the bundles broke it once, with "``@data::imb_factor`` is not defined")."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_cifar_runs_on_the_bundles() -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_cifar.py"), "--steps", "1", "--repeats", "1",
                           "--no-plain", "--threads", "1"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "trainer/loop" in proc.stdout
