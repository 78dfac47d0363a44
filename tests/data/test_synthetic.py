"""lungcal.data.synthetic: determinism, outputs, planted identifiers, Bayes difficulty."""
from __future__ import annotations

import csv
import json

import numpy as np
import pydicom
import pytest

from lungcal.ct.io import load_ct
from lungcal.data.manifest import load_manifest
from lungcal.data.synthetic import (NODULE_MODEL, ScannerProfile, bayes_auc, bayes_posterior, ensure_demo_cohort,
                                    make_cohort, sample_nodule_features)

SMALL = dict(shape=(64, 64, 40), spacing=(5.0, 5.0, 6.0))


@pytest.fixture(scope="module")
def cohort(tmp_path_factory):
    out = tmp_path_factory.mktemp("cohort")
    path = make_cohort(out, n_subjects=10, prevalence=0.5, seed=3, num_workers=1, progress=False,
                       scanner=ScannerProfile(site="siteA", noise_hu=30), **SMALL)
    return out, path


def test_outputs_and_rows(cohort):
    out, path = cohort
    rows = load_manifest(path)
    assert len(rows) == 10
    assert {r["site"] for r in rows} == {"siteA"}
    assert {r["split"] for r in rows} <= {"train", "val", "test"}
    for r in rows:
        assert r["subject"].startswith("S") and r["ct"].startswith(r["subject"])
    img = load_ct(rows[0]["image"])  # the datalist points at DICOM series folders
    assert img.shape == (1, 64, 64, 40)
    np.testing.assert_allclose(np.asarray(img.pixdim)[:3], SMALL["spacing"])
    nii = load_ct(out / "nifti" / f"{rows[0]['ct']}.nii.gz")
    np.testing.assert_array_equal(nii.numpy(), img.numpy())
    np.testing.assert_allclose(nii.affine.numpy(), img.affine.numpy(), atol=1e-4)
    # CT label = has a malignant nodule, consistent between datalist and annotations
    with open(out / "annotations.csv") as fh:
        ann = list(csv.DictReader(fh))
    assert {"seriesuid", "coordX", "coordY", "coordZ", "diameter_mm", "malignant", "ct", "subject"} <= set(ann[0])
    malignant_cts = {a["ct"] for a in ann if a["malignant"] == "1"}
    assert malignant_cts == {r["ct"] for r in rows if r["label"] == 1}
    assert all(4.0 <= float(a["diameter_mm"]) <= 30.0 for a in ann)


def test_nodule_is_in_the_image_at_its_world_position(cohort):
    out, path = cohort
    rows = {r["ct"]: r for r in load_manifest(path)}
    with open(out / "annotations.csv") as fh:
        ann = max(csv.DictReader(fh), key=lambda a: float(a["diameter_mm"]))
    img = load_ct(rows[ann["ct"]]["image"])
    ras = np.array([float(ann["rasX"]), float(ann["rasY"]), float(ann["rasZ"])])
    lps = np.array([float(ann["coordX"]), float(ann["coordY"]), float(ann["coordZ"])])
    np.testing.assert_allclose(ras[:2], -lps[:2])
    vox = np.round(np.linalg.solve(img.affine.numpy(), np.append(ras, 1))[:3]).astype(int)
    assert float(img[0][tuple(vox)]) > -300  # soft tissue / ground glass / calcium, not lung (-860)


def test_dicom_geometry_and_planted_identifiers(cohort):
    out, path = cohort
    planted = json.loads((out / "planted_identifiers.json").read_text())["cts"]
    assert len(planted) == 10
    rows = load_manifest(path)
    folder = rows[0]["image"]
    files = sorted(p for p in __import__("pathlib").Path(folder).iterdir())
    ds = pydicom.dcmread(files[1])
    assert ds.Modality == "CT" and float(ds.RescaleIntercept) == -1024 and float(ds.SliceThickness) == 6.0
    assert [float(v) for v in ds.PixelSpacing] == [5.0, 5.0]
    ids = next(p for p in planted if p["SeriesInstanceUID"] == ds.SeriesInstanceUID)
    assert str(ds.PatientName) == ids["PatientName"] and ds.PatientID == ids["PatientID"]
    assert ds.AccessionNumber == ids["AccessionNumber"] and ds.PatientBirthDate == ids["PatientBirthDate"]
    # no identifier reaches the datalist or any file/folder name
    text = (out / "datalist.json").read_text()
    names = " ".join(str(p.relative_to(out)) for p in out.rglob("*"))
    for p in planted:
        for key in ("PatientName", "PatientID", "AccessionNumber", "StudyInstanceUID", "SeriesInstanceUID"):
            assert p[key] not in text and p[key] not in names
    assert "planted_identifiers" not in text


def test_deterministic_by_seed(cohort, tmp_path):
    out, path = cohort
    again = make_cohort(tmp_path, n_subjects=10, prevalence=0.5, seed=3, num_workers=2, progress=False,
                        scanner=ScannerProfile(site="siteA", noise_hu=30), formats=("dicom",), **SMALL)
    a, b = json.loads(path.read_text()), json.loads(again.read_text())
    assert a["rows"] == b["rows"]
    assert (out / "annotations.csv").read_text() == (tmp_path / "annotations.csv").read_text()
    r = a["rows"][4]
    np.testing.assert_array_equal(load_ct(out / r["image"]).numpy(), load_ct(tmp_path / r["image"]).numpy())
    other = make_cohort(tmp_path / "s4", n_subjects=3, prevalence=0.5, seed=4, num_workers=1, progress=False,
                        formats=("nifti",), **SMALL)
    assert json.loads(other.read_text())["rows"][0]["subject"] not in {x["subject"] for x in a["rows"]}


def test_bayes_auc_in_target_band():
    auc = bayes_auc(n=60_000, prevalence=0.11, seed=1)
    assert 0.84 <= auc <= 0.91, auc
    # the AUC does not depend on the prevalence (the posterior is monotone in the likelihood ratio)
    assert abs(bayes_auc(n=60_000, prevalence=0.4, seed=1) - auc) < 0.01


def test_bayes_posterior_is_calibrated():
    # simulate CTs from the generative model and check the posterior against the labels in bins
    rng = np.random.default_rng(0)
    prev, n = 0.3, 6000
    ps, ys = [], []
    for _ in range(n):
        y = rng.random() < prev
        d, m, a = sample_nodule_features(rng, False, rng.poisson(NODULE_MODEL["lam"]))
        if y:
            d2, m2, a2 = sample_nodule_features(rng, True, 1)
            d, m, a = np.r_[d, d2], np.r_[m, m2], np.r_[a, a2]
        ps.append(bayes_posterior(d, m, a, prev))
        ys.append(y)
    ps, ys = np.array(ps), np.array(ys)
    bins = np.digitize(ps, [0.2, 0.4, 0.6, 0.8])
    for b in range(5):
        sel = bins == b
        if sel.sum() > 200:
            assert abs(ps[sel].mean() - ys[sel].mean()) < 0.05


def test_benign_smaller_than_malignant():
    rng = np.random.default_rng(0)
    db, _, ab = sample_nodule_features(rng, False, 4000)
    dm, _, am = sample_nodule_features(rng, True, 4000)
    assert np.median(dm) > np.median(db) + 3
    assert (ab == 2).mean() > (am == 2).mean()  # calcified is a benign sign
    assert db.min() >= 4 and dm.max() <= 30


def test_ensure_demo_cohort_generates_once(tmp_path):
    p = ensure_demo_cohort(tmp_path, progress=False, n_subjects=3, shape=(48, 48, 32), spacing=(6.0, 6.0, 8.0),
                           num_workers=1)
    mtime = p.stat().st_mtime_ns
    assert ensure_demo_cohort(tmp_path, progress=False, n_subjects=3, shape=(48, 48, 32), spacing=(6.0, 6.0, 8.0),
                              num_workers=1) == p
    assert p.stat().st_mtime_ns == mtime
    assert not [q for q in tmp_path.iterdir() if q.name.startswith(".")]  # no temp folder left
    assert len(load_manifest(p)) == 3


def test_bad_parameters():
    from lungcal.errors import ConfigError

    with pytest.raises(ConfigError, match="formats"):
        make_cohort("/tmp/unused", 2, formats=("png",))
    with pytest.raises(ConfigError, match="prevalence"):
        make_cohort("/tmp/unused", 2, prevalence=1.5)
