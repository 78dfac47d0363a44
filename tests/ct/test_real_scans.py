"""Real chest CTs (../shared/data/ct, see its PROVENANCE.md) through load -> series checks -> lung mask
-> candidates.

- LIDC-IDRI-0001: a full chest CT (2.5 mm, NIfTI) with a ~3 cm nodule on the posterior pleura;
- LungPETCTDx-A0002_8mm: a DICOM chest CT at 8 mm with a 3-4 cm right perihilar / lower-lobe mass
  (per-slice boxes).

Candidates use the CT bundles' bag settings (bundles/nlst_focal.json ``bag_params``: 2.5 mm voxels,
HU window [-1000, 400], K = 8). Each lesion's rank among the candidates and its distance are printed
(``pytest -s``) and recorded as test properties.
"""
from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest
from scipy import ndimage as ndi

from lungcal.candidates.cache import BagParams, compute_bag
from lungcal.candidates.detector import LoGBlobDetector
from lungcal.ct.io import load_ct
from lungcal.ct.masking import LungMasker
from lungcal.ct.qc import check_series
from lungcal.ct.transforms import preprocess_ct
from lungcal.errors import DataError

BAG = {"spacing": (2.5, 2.5, 2.5), "hu_window": (-1000.0, 400.0), "margin_mm": 10.0}
K = 8  # the bundles' bag size
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def ct_dir(shared_dir):
    d = shared_dir / "data" / "ct"
    if not (d / "LIDC-IDRI-0001" / "ct.nii.gz").is_file() or not (d / "LungPETCTDx-A0002_8mm" / "dicom").is_dir():
        pytest.skip(f"the real CT scans are not in {d}")
    return d


@pytest.fixture(scope="module")
def lidc(ct_dir):
    return load_ct(ct_dir / "LIDC-IDRI-0001" / "ct.nii.gz")


@pytest.fixture(scope="module")
def ct8(ct_dir):
    return load_ct(ct_dir / "LungPETCTDx-A0002_8mm" / "dicom")


def _lidc_lesion(ct_dir):
    """(centre RAS mm, diameter mm) of the LIDC consensus nodule (>= 3 mm, 4 readers)."""
    with open(ct_dir / "LIDC-IDRI-0001" / "nodules_consensus.csv", newline="") as fh:
        row = next(csv.DictReader(fh))
    lps = np.array([float(row["lps_x_mm"]), float(row["lps_y_mm"]), float(row["lps_z_mm"])])
    return lps * [-1, -1, 1], float(row["mean_max_xy_extent_mm"])


def _boxes_8mm(ct_dir, half_slice_mm=4.0):
    """The tumour's per-slice boxes as RAS ``(lo (N, 3), hi (N, 3))``, each over its 8 mm slice."""
    with open(ct_dir / "LungPETCTDx-A0002_8mm" / "tumor_bboxes.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    x = np.array([[-float(r["lps_xmax_mm"]), -float(r["lps_xmin_mm"])] for r in rows])
    y = np.array([[-float(r["lps_ymax_mm"]), -float(r["lps_ymin_mm"])] for r in rows])
    z = np.array([float(r["lps_z_mm"]) for r in rows])
    lo = np.stack([x[:, 0], y[:, 0], z - half_slice_mm], axis=1)
    hi = np.stack([x[:, 1], y[:, 1], z + half_slice_mm], axis=1)
    return lo, hi


def _candidates(path):
    out = preprocess_ct(path, **BAG)
    affine = np.asarray(out["image"].affine, np.float64)
    spacing = np.linalg.norm(affine[:3, :3], axis=0)
    det = LoGBlobDetector()
    cands = det.detect(out["image"], out["lung_mask"], spacing, affine)
    return out, cands, spacing, det


def test_full_chest_ct_passes_every_check_with_an_adult_lung_volume(lidc):
    report = check_series(lidc)
    print("\n" + report.format())
    assert report.verdict == "pass", report.format()
    assert 2500 < report.lung_volume_ml < 8500


def test_8mm_series_fails_the_slice_thickness_check_only(ct8):
    report = check_series(ct8)
    print("\n" + report.format())
    assert [c.name for c in report.failed] == ["slice_thickness"], report.format()
    assert report["slice_thickness"].value.startswith("8.00 mm")
    assert report["series_type"].verdict == "pass" and report["lung_coverage"].verdict == "pass"
    assert 1500 < report.lung_volume_ml < 8500
    with pytest.raises(DataError, match="slice_thickness.*8.00 mm"):
        report.raise_if_failed("S8mm")


def test_scoring_refuses_the_8mm_series_through_the_preprocessing(ct_dir):
    with pytest.raises(DataError, match="series check 'slice_thickness' failed") as err:
        preprocess_ct(ct_dir / "LungPETCTDx-A0002_8mm" / "dicom", qc=True, **BAG)
    assert "LungPETCTDx-A0002_8mm" in str(err.value) and err.value.field == "qc.slice_thickness"


def test_a_scan_of_the_abdomen_with_the_lung_bases_fails_coverage(lidc):
    # the lowest 50 slices: upper abdomen plus the lung bases, as an abdominal CT catches them
    arr = np.ascontiguousarray(lidc[0, :, :, :50].numpy())
    report = check_series(arr, spacing=np.asarray(lidc.pixdim)[:3])
    print("\n" + report.format())
    assert report["lung_coverage"].verdict == "fail" and "top" in report["lung_coverage"].reason
    assert report["lung_volume"].verdict == "fail"  # and too little lung for a chest CT


def test_a_field_of_view_cutting_the_lungs_keeps_them_and_is_reported(lidc):
    arr = np.ascontiguousarray(lidc[0, 130:382, 100:412, :].numpy())  # a 177 x 219 mm field of view
    spacing = np.asarray(lidc.pixdim)[:3]
    mask = LungMasker()(arr, spacing)
    visible = mask.sum() * np.prod(spacing) / 1000
    assert visible > 2000  # the "no lungs found (3 mL)" case: the cut lungs are kept
    report = check_series(arr, spacing=spacing, mask=mask)
    print("\n" + report.format())
    assert report["field_of_view"].verdict == "fail" and report["lung_coverage"].verdict == "pass"


@pytest.mark.parametrize("scan", ["LIDC-IDRI-0001", "LungPETCTDx-A0002_8mm"])
def test_annotated_lesions_are_in_the_bag(ct_dir, scan, record_property):
    if scan == "LIDC-IDRI-0001":
        out, cands, spacing, det = _candidates(ct_dir / scan / "ct.nii.gz")
        centre, diameter = _lidc_lesion(ct_dir)
        dist = np.linalg.norm(cands.world - centre, axis=1)
        hits = dist <= diameter / 2
    else:
        out, cands, spacing, det = _candidates(ct_dir / scan / "dicom")
        lo, hi = _boxes_8mm(ct_dir)
        inside = ((cands.world[:, None] >= lo[None]) & (cands.world[:, None] <= hi[None])).all(axis=-1)
        hits = inside.any(axis=1)
        centres = (lo + hi) / 2
        dist = np.linalg.norm(cands.world[:, None] - centres[None], axis=-1).min(axis=1)  # to the nearest box centre
        diameter = float(np.max(hi[:, :2] - lo[:, :2]))  # the largest box side (the mass is 3-4 cm)
    assert hits.any(), f"no candidate on the {scan} lesion"
    rank = int(np.argmax(hits))
    print(f"\n{scan}: lesion (extent up to {diameter:.0f} mm): rank {rank} of {len(cands)} candidates, "
          f"{dist[rank]:.1f} mm away, candidate radius {cands.radius_mm[rank]:.1f} mm")
    record_property("lesion_rank", rank)
    record_property("lesion_distance_mm", round(float(dist[rank]), 1))
    assert rank < K  # a lesion of 10 mm or more must be in the bag
    # every candidate lies in the lung mask or in what the detector's closing adds to it (lesions
    # attached to the pleura or hilum)
    mask = out["lung_mask"][0].numpy() > 0
    outside = ndi.distance_transform_edt(~mask, sampling=spacing)
    assert outside[tuple(cands.voxel.T)].max() <= det.mask_closing_mm + 1e-6


def test_the_lidc_lesion_is_in_the_bag_at_the_full_resolution_preset(ct_dir):
    """bundles/fullres.json (1 mm, K = 16, P = 32), whose resampling of this 2.5 mm scan to 1 mm now runs
    axis by axis in bounded memory (SeparableSpacingd): the ~30 mm nodule is still near the top of the bag."""
    fullres = json.loads((ROOT / "bundles" / "fullres.json").read_text())
    params = BagParams.from_any({"spacing": fullres["spacing"], "hu_window": [-1000, 400], "k": fullres["k"],
                                 "patch_size": fullres["patch_size"]})
    entry = compute_bag(str(ct_dir / "LIDC-IDRI-0001" / "ct.nii.gz"), params)
    centre, diameter = _lidc_lesion(ct_dir)
    dist = np.linalg.norm(entry["world"] - centre, axis=1)
    hits = (dist <= diameter / 2) & entry["mask"].astype(bool)
    assert hits.any(), f"the lesion is not among the {params.k} candidates (nearest {dist.min():.1f} mm)"
    rank = int(np.argmax(hits))
    print(f"\nLIDC-IDRI-0001 at 1 mm: lesion rank {rank} of {params.k}, {dist[rank]:.1f} mm from its centre")
    assert rank <= 2
