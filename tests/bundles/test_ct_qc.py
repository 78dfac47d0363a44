"""The series-check policy of the CT bundles, end to end with ``monai.bundle run``.

A tiny datalist (the 15-CT synthetic cohort at 5 mm of the bundle tests) in which one train CT
lost its top 40 mm (the apices): the stage-1 bundle skips it, prints the count and the reason
table and logs ``qc.csv`` (and the train split's acquisition summary) to the stage-1 run; the
inference bundle refuses it, naming the pseudonym, the check and the measured value (never the
path), scores the 14 others and ends with one error line and exit code 2 (issue 34: one refused CT
no longer stops the others).
"""
from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pydicom
import pytest
from mlflow.tracking import MlflowClient
from monai.bundle import run

from lungcal.data.synthetic import make_cohort
from lungcal.tracking import TAG_STAGE2, default_tracking_uri, run_acquisition_summary

ROOT = Path(__file__).resolve().parents[2]
#: thresholds that accept the tiny cohort's 5 mm slices and pixels (the defaults refuse both)
TINY_QC = {"_target_": "lungcal.ct.qc.QCConfig", "max_slice_thickness_mm": 6.0, "warn_slice_thickness_mm": 6.0,
           "max_pixel_mm": 6.0}


def _z_of(f: Path) -> float:
    return float(pydicom.dcmread(f, stop_before_pixels=True).ImagePositionPatient[2])


@pytest.fixture(scope="module")
def datalist(tmp_path_factory) -> tuple[Path, str]:
    root = tmp_path_factory.mktemp("qc_cohort")
    path = Path(make_cohort(root, n_subjects=15, prevalence=0.5, seed=1, shape=(64, 64, 48), spacing=(5.0, 5.0, 5.0),
                            formats=("dicom",), progress=False))
    data = json.loads(path.read_text())
    row = next(r for r in data["rows"] if r["split"] == "train")
    src, dst = path.parent / row["image"], root / "apexless_ct"
    dst.mkdir()
    for f in sorted(src.iterdir(), key=_z_of)[:-8]:  # the top (superior) 8 slices = 40 mm are gone
        shutil.copy(f, dst / f.name)
    row["image"] = str(dst)
    path.write_text(json.dumps(data))
    return path, row["subject"]


def test_training_skips_the_failing_ct_and_logs_qc_csv_then_scoring_refuses_it(datalist, tmp_path, monkeypatch,
                                                                               capsys):
    path, cut = datalist
    store = tmp_path / "runs"
    monkeypatch.chdir(ROOT)  # % macros resolve from the working directory
    run(config_file="bundles/nlst_focal.json", logging_file=False, datalist=str(path), output_dir=str(store),
        epochs=1, n_bootstrap=20, num_workers=0, spacing=[5.0, 5.0, 5.0], patch_size=8, batch_size=4, qc=TINY_QC,
        run_name="t-qc")
    out = capsys.readouterr().out
    assert "1 of 15 CT(s) skipped" in out and "lung_coverage" in out and "apex" in out
    client = MlflowClient(default_tracking_uri(store))
    exp = client.get_experiment_by_name("nlst")
    s1 = [r for r in client.search_runs([exp.experiment_id], filter_string=f"tags.`{TAG_STAGE2}` = 'none'")
          if r.info.run_name == "t-qc"][0]
    n_train = sum(r["split"] == "train" for r in json.loads(path.read_text())["rows"])
    assert s1.data.params["n_ct.train"] == str(n_train - 1)
    local = client.download_artifacts(s1.info.run_id, "qc.csv", str(tmp_path))
    text = Path(local).read_text()
    rows = list(csv.DictReader(text.splitlines()))
    assert len({r["pseudonym"] for r in rows}) == 15 and set(rows[0]) == {"pseudonym", "check", "verdict", "value"}
    assert [r["verdict"] for r in rows if r["pseudonym"] == cut and r["check"] == "lung_coverage"] == ["fail"]
    assert str(path.parent) not in text and "apexless" not in text
    # the training split's acquisition, summarised without identifiers, for a site check (issue 32)
    acquisition = run_acquisition_summary(default_tracking_uri(store), s1.info.run_id)
    assert acquisition["split"] == "train" and acquisition["n"] == n_train - 1 == acquisition["n_measured"]
    assert acquisition["profiles"] == {"pinned": n_train - 1} and acquisition["fields"]["pixel_mm"]["mean"] == 5.0
    assert not any(r["pseudonym"] in json.dumps(acquisition) for r in rows)

    cmd = [sys.executable, "-m", "monai.bundle", "run", "--config_file", "bundles/inference.json",
           "--inputs", str(path), "--output_dir", str(store), "--num_workers", "0",
           "--output", str(tmp_path / "pred"), "--qc", json.dumps(TINY_QC)]
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("lungcal: error:")]
    assert len(errors) == 1, proc.stderr[-2000:]
    assert cut in errors[0] and "lung_coverage" in errors[0] and "top 10" in errors[0] and "Fix:" in errors[0]
    assert errors[0].startswith(f"lungcal: error: {tmp_path / 'pred' / 'inputs.csv'}: 1 of 15 CT(s) refused")
    assert str(path.parent) not in proc.stderr and "apexless" not in proc.stderr
    scored = [r["subject"] for r in csv.DictReader(open(tmp_path / "pred" / "predictions.csv"))]
    assert len(scored) == 14 and cut not in scored  # the others are scored and written
    key = {r["pseudonym"]: r["status"] for r in csv.DictReader(open(tmp_path / "pred" / "inputs.csv"))}
    assert key[cut].startswith("refused: series check 'lung_coverage' failed") and len(key) == 15
