"""Detector candidates on site-A-like vs site-B-like phantoms (the slow two-site test's scanners), per variant.

For each variant (LoGBlobDetector keyword arguments, plus ``_smooth``: a Gaussian width in mm applied to
the preprocessed CT before detection, as ``harmonize_mm`` does), prints per site the share of cancers and
of all nodules among the 8 bag candidates, and the false positives' mean radius, centre intensity and
share within 3 mm of the closed lung mask's border (docs/results.md, "Resolution harmonization"):

    python scripts/two_site_detector.py 20 '{"shipped": {}, "lw0.02": {"log_weight": 0.02}, "s1.5": {"_smooth": 1.5}}'

The phantoms (prevalence 0.5, seed 11) are generated once under ``$LUNGCAL_SCRATCH`` (default
``/tmp/two_site_detector``).
"""
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
from scipy import ndimage

from lungcal.candidates.detector import LoGBlobDetector
from lungcal.candidates.evaluate import read_nodule_truth
from lungcal.ct.kernel import soften
from lungcal.ct.transforms import preprocess_ct
from lungcal.data.manifest import load_manifest
from lungcal.data.synthetic import make_cohort

N = int(sys.argv[1]) if len(sys.argv) > 1 else 20
root = Path(os.environ.get("LUNGCAL_SCRATCH", "/tmp/two_site_detector"))
A = dict(prevalence=0.5, seed=11, shape=(128, 128, 96), spacing=(2.5, 2.5, 2.5),
         scanner={"site": "site-a", "noise_hu": 20.0, "kernel_sigma_mm": 0.7, "hu_offset": 0.0})
B = dict(prevalence=0.5, seed=11, shape=(176, 176, 80), spacing=(1.8, 1.8, 3.0),
         scanner={"site": "site-b", "noise_hu": 40.0, "kernel_sigma_mm": 1.2, "hu_offset": 0.0})
VARIANTS = json.loads(sys.argv[2]) if len(sys.argv) > 2 else {"shipped": {}}

def load(name, cfg):
    d = root / name
    dl = d / "datalist.json"
    if not dl.exists():
        dl = make_cohort(d, n_subjects=N, formats=("nifti",), progress=False, num_workers=2, splits=(1, 0, 0), **cfg)
    rows = load_manifest(dl)
    truth = read_nodule_truth(Path(dl).parent / "annotations.csv")
    out = []
    for r in rows:
        p = preprocess_ct(r["image"], spacing=(2.5, 2.5, 2.5), hu_window=(-1000, 400))
        img = p["image"][0].numpy()
        lung = p["lung_mask"][0].numpy() > 0
        aff = np.asarray(p["image"].affine, float)
        out.append((r, img, lung, aff, truth.get(str(r.get("ct")), (np.zeros((0, 3)), np.zeros(0), np.zeros(0, bool)))))
    return out


def stats(cts, det, smooth_mm=0.0):
    res = {"cancer_in_bag": [], "nod_in_bag": [], "fp_r": [], "fp_int": [], "fp_border": []}
    for _, img, lung, aff, (c, d, mal) in cts:
        sp = np.linalg.norm(aff[:3, :3], axis=0)
        if smooth_mm:
            img = soften(img, (smooth_mm,) * 3, sp)  # the very function harmonize_mm applies
        cand = det.detect(img, lung, sp, aff).top(8)
        inner, _ = LoGBlobDetector()._masks(lung, sp)
        depth = ndimage.distance_transform_edt(inner, sampling=sp)
        hit_any = np.zeros(len(cand), bool)
        for j in range(len(c)):
            dist = np.linalg.norm(cand.world - c[j], axis=1)
            hits = dist < max(d[j] / 2, 3.0)
            hit_any |= hits
            res["nod_in_bag"].append(bool(hits.any()))
            if mal[j]:
                res["cancer_in_bag"].append(bool(hits.any()))
        fp = ~hit_any
        v = cand.voxel[fp]
        res["fp_r"] += cand.radius_mm[fp].tolist()
        res["fp_int"] += img[v[:, 0], v[:, 1], v[:, 2]].tolist()
        res["fp_border"] += (depth[v[:, 0], v[:, 1], v[:, 2]] < 3.0).tolist()
    return {k: round(float(np.mean(v)), 3) if v else None for k, v in res.items()}

t = time.time()
sites = {"A": load(f"A{N}", A), "B": load(f"B{N}", B)}
print("loaded", round(time.time() - t), "s", flush=True)
for name, kw in VARIANTS.items():
    smooth = kw.pop("_smooth", 0.0)
    det = LoGBlobDetector(**kw)
    for s, cts in sites.items():
        print(name, s, json.dumps(stats(cts, det, smooth)), flush=True)
