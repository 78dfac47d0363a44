"""No identifier planted in the synthetic DICOM reaches MLflow, artifacts, caches, checkpoints or logs.

A tiny synthetic DICOM cohort (fake PatientName/ID, dates, accession number, UIDs in every header,
listed in ``planted_identifiers.json``) goes through the real stage-1 bundle in a subprocess with
the bundle's logging.conf; then every byte of the output folder (SQLite store, artifacts, bag
cache, checkpoints), every file name in it, and the captured stdout/stderr are scanned.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lungcal.data.synthetic import make_cohort

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def cohort(tmp_path_factory) -> Path:

    out = tmp_path_factory.mktemp("dicom_cohort")
    return Path(make_cohort(out, n_subjects=12, prevalence=0.5, seed=7, shape=(64, 64, 48), spacing=(5.0, 5.0, 5.0),
                            formats=("dicom",), progress=False))


def _identifiers(cohort: Path) -> set[str]:
    planted = json.loads((cohort.parent / "planted_identifiers.json").read_text())["cts"]
    ids: set[str] = set()
    for ct in planted:
        for key, value in ct.items():
            value = str(value)
            ids.add(value)
            if key == "PatientName":  # each name component on its own too
                ids.update(part for part in value.split("^") if len(part) >= 4)
    assert len(ids) > 5 * len(planted)
    return ids


def test_no_planted_identifier_anywhere(cohort, tmp_path):
    out = tmp_path / "runs"
    cmd = [sys.executable, "-m", "monai.bundle", "run", "--config_file",
           "['bundles/nlst_focal.json','bundles/nlst_ce.json']",
           "--datalist", str(cohort), "--output_dir", str(out), "--epochs", "1", "--n_bootstrap", "10",
           "--num_workers", "0", "--batch_size", "4",
           "--spacing", "[5.0, 5.0, 5.0]", "--patch_size", "8",
           # the 5 mm cohort: series checks that accept its slices and pixels (the defaults refuse both)
           "--qc", json.dumps({"_target_": "lungcal.ct.qc.QCConfig", "max_slice_thickness_mm": 6.0,
                               "warn_slice_thickness_mm": 6.0, "max_pixel_mm": 6.0})]
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    logs = proc.stdout + proc.stderr
    assert proc.returncode == 0, logs[-3000:]
    assert "mlflow ui --backend-store-uri" in logs

    ids = _identifiers(cohort)
    files = [p for p in out.rglob("*") if p.is_file()]
    assert any(p.name == "mlflow.db" for p in files)
    assert any(p.suffix == ".npz" for p in files)           # bag cache
    assert any(p.name == "best.pt" for p in files)          # checkpoint
    assert any("mlartifacts" in p.parts for p in files)     # MLflow artifacts
    leaks = []
    for ident in ids:
        needle = ident.encode()
        if ident in logs:
            leaks.append(("logs", ident))
        for p in files:
            if ident in str(p.relative_to(out)) or needle in p.read_bytes():
                leaks.append((str(p.relative_to(out)), ident))
    assert not leaks, leaks[:10]
