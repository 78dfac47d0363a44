"""SubsolidLoGDetector: every nodule type of the phantoms trips it, its config rebuilds it, its bags are
keyed by its own source while the default pipeline's keys stay as they were; the size and density
limits of docs/phantoms.md."""
from __future__ import annotations

import csv
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from monai.bundle import ConfigParser

from lungcal.candidates.cache import BagCache, BagParams, code_fingerprint, detector_code
from lungcal.candidates.detector import Candidates, LoGBlobDetector
from lungcal.candidates.detector_config import detector_bag_params, detector_config, detector_from_config
from lungcal.candidates.subsolid import SubsolidLoGDetector, merge_candidates
from lungcal.ct.transforms import preprocess_ct
from lungcal.data.synthetic import make_phantom, place_nodules, sample_anatomy

SHAPE, SPACING = (80, 80, 56), (2.5, 2.5, 2.5)
WINDOW = (-1000.0, 400.0)  # the CT bundles' window, the detector's default


def _case(seed, specs):
    """A phantom at the default preset's voxel size and scanner with nodules ``(type, diameter, gg_hu,
    core_frac)``; returns the windowed image, the phantom's lung mask, the affine (LPS world) and the
    nodules."""
    rng = np.random.default_rng(seed)
    anat = sample_anatomy(rng, SHAPE, SPACING)
    _, origin, lung = make_phantom(np.random.default_rng([seed, 1]), SHAPE, SPACING, anat=anat)
    base = place_nodules(rng, lung, SPACING, origin, [(d, 0, 0, False) for _, d, _, _ in specs])
    nods = [replace(n, attenuation="solid" if kind == "solid" else kind, nodule_type=kind, gg_hu=gg, core_frac=core)
            for n, (kind, _, gg, core) in zip(base, specs)]
    hu, origin, lung = make_phantom(np.random.default_rng([seed, 1]), SHAPE, SPACING, nods, anat=anat)
    img = np.clip((hu.astype(np.float32) - WINDOW[0]) / (WINDOW[1] - WINDOW[0]), 0, 1)
    affine = np.diag([*SPACING, 1.0])
    affine[:3, 3] = origin
    return img, lung, affine, nods


def _ranks(c: Candidates, nods):
    """1-based rank of the best candidate within each nodule's radius (0: none)."""
    out = []
    for n in nods:
        hit = np.linalg.norm(c.world - np.asarray(n.center_lps), axis=1) <= n.diameter_mm / 2
        out.append(int(np.argmax(hit)) + 1 if hit.any() else 0)
    return out


@pytest.mark.parametrize("seed", [0, 1, 5])
def test_solid_part_solid_and_ground_glass_nodules_are_in_the_bag(seed):
    specs = [("solid", 8.0, None, None), ("part-solid", 12.0, -600.0, 0.4), ("ground-glass", 12.0, -600.0, 0.0)]
    img, lung, affine, nods = _case(seed, specs)
    c = SubsolidLoGDetector().detect(img, lung, SPACING, affine)
    assert np.all(np.diff(c.score) <= 0) and len(c) <= 32
    ranks = _ranks(c, nods)
    assert all(0 < r <= 8 for r in ranks), ranks  # each type within the bag's K = 8
    # the plain LoG detector ranks this ground-glass nodule lower (or misses it)
    plain = _ranks(LoGBlobDetector().detect(img, lung, SPACING, affine), nods)
    assert plain[2] == 0 or plain[2] > ranks[2]


@pytest.mark.parametrize("seed", [11, 12])
def test_limits_smallest_and_faintest_found_at_the_default_preset(seed):
    """The limits docs/phantoms.md states (2.5 mm voxels, 20 HU noise, 0.7 mm kernel): ground glass
    of 8 mm at -500 HU and of 14 mm at -600 HU is in the bag and a 3 mm solid nodule is found
    (the sweep found each in 6 of 6 placements)."""
    specs = [("ground-glass", 8.0, -500.0, 0.0), ("ground-glass", 14.0, -600.0, 0.0), ("solid", 3.0, None, None)]
    img, lung, affine, nods = _case(seed, specs)
    ranks = _ranks(SubsolidLoGDetector().detect(img, lung, SPACING, affine), nods)
    assert all(0 < r <= 8 for r in ranks[:2]), ranks
    assert ranks[2] > 0, ranks


def test_merge_keeps_the_better_of_overlapping_candidates():
    a = Candidates([[10, 10, 10], [30, 30, 30]], [[10, 10, 10], [30, 30, 30]], [3.0, 3.0], [0.9, 0.2])
    b = Candidates([[11, 10, 10], [50, 50, 50]], [[11, 10, 10], [50, 50, 50]], [4.0, 2.0], [0.5, 0.4])
    m = merge_candidates([a, b], (1.0, 1.0, 1.0), top_k=10)
    np.testing.assert_array_equal(m.voxel, [[10, 10, 10], [50, 50, 50], [30, 30, 30]])
    np.testing.assert_allclose(m.score, [0.9, 0.4, 0.2])
    assert len(merge_candidates([a, b], (1.0, 1.0, 1.0), top_k=1)) == 1
    assert len(merge_candidates([Candidates()], (1.0, 1.0, 1.0), top_k=4)) == 0


def test_config_rebuilds_it_and_keys_its_bags_by_its_source():
    det = SubsolidLoGDetector(solid={"top_k": 5, "threshold": 0.04}, faint_weight=0.8, hu_window=[-1000, 400])
    cfg = detector_config(det)
    assert cfg["_target_"] == "lungcal.candidates.subsolid.SubsolidLoGDetector"
    again = detector_from_config(cfg)
    assert isinstance(again, SubsolidLoGDetector) and detector_config(again) == cfg
    assert detector_bag_params(det) == cfg
    resolved = BagParams(detector=cfg).resolved()
    assert detector_code(resolved["detector"]) is not None  # its bags hash subsolid.py
    assert detector_code(BagParams().resolved()["detector"]) is None  # the default key as it was
    cache = BagCache("unused")
    assert cache.key(__file__, BagParams(detector=cfg)) != cache.key(__file__, BagParams())
    assert len(code_fingerprint()) == 64
    with pytest.raises(ValueError):
        SubsolidLoGDetector(glass_window_hu=(-300, -900))


def test_the_bundle_variant_plugs_it_in_with_the_bundles_window():
    bundles = Path(__file__).resolve().parents[2] / "bundles"
    parser = ConfigParser()
    parser.read_config([str(bundles / "nlst_focal.json"), str(bundles / "nlst_subsolid.json")])
    det = parser.get_parsed_content("detector")
    assert isinstance(det, SubsolidLoGDetector)
    assert det.hu_window == [float(v) for v in parser.get_parsed_content("hu_window")]
    assert detector_config(det)["_target_"] == "lungcal.candidates.subsolid.SubsolidLoGDetector"


def test_the_real_scans_lesions_are_in_its_bag(shared_dir):
    """The two real scans of ../shared/data/ct (PROVENANCE.md): the LIDC nodule (~3 cm) and the 3-4 cm
    mass of the 8 mm series are in the bag (K = 8) of the subsolid detector, as of the LoG detector
    (measured: rank 1, 1.4 mm away; rank 2, 3.2 mm from the nearest box centre)."""
    ct = shared_dir / "data" / "ct"
    if not (ct / "LIDC-IDRI-0001" / "ct.nii.gz").is_file() or not (ct / "LungPETCTDx-A0002_8mm" / "dicom").is_dir():
        pytest.skip(f"the real CT scans are not in {ct}")
    bag = {"spacing": (2.5, 2.5, 2.5), "hu_window": WINDOW, "margin_mm": 10.0}
    with open(ct / "LIDC-IDRI-0001" / "nodules_consensus.csv", newline="") as fh:
        row = next(csv.DictReader(fh))
    lidc = np.array([-float(row["lps_x_mm"]), -float(row["lps_y_mm"]), float(row["lps_z_mm"])])
    with open(ct / "LungPETCTDx-A0002_8mm" / "tumor_bboxes.csv", newline="") as fh:
        boxes = list(csv.DictReader(fh))
    lo = np.array([[-float(b["lps_xmax_mm"]), -float(b["lps_ymax_mm"]), float(b["lps_z_mm"]) - 4] for b in boxes])
    hi = np.array([[-float(b["lps_xmin_mm"]), -float(b["lps_ymin_mm"]), float(b["lps_z_mm"]) + 4] for b in boxes])
    for path in (ct / "LIDC-IDRI-0001" / "ct.nii.gz", ct / "LungPETCTDx-A0002_8mm" / "dicom"):
        out = preprocess_ct(path, **bag)
        affine = np.asarray(out["image"].affine, np.float64)
        c = SubsolidLoGDetector().detect(out["image"], out["lung_mask"], np.linalg.norm(affine[:3, :3], axis=0),
                                         affine)
        if path.name == "ct.nii.gz":
            hit = np.linalg.norm(c.world - lidc, axis=1) <= float(row["mean_max_xy_extent_mm"]) / 2
        else:
            hit = ((c.world[:, None] >= lo[None]) & (c.world[:, None] <= hi[None])).all(axis=-1).any(axis=1)
        assert hit[:8].any(), path
