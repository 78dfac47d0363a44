"""Which lesions the detectors find, per nodule type, on phantoms and on the real scans (issue 34).

For each CT of a synthetic cohort (its ``annotations.csv`` with ``nodule_type``, ``contact``): the
CT bundles' preprocessing (2.5 mm, HU window -1000..400), then each detector; per nodule: hit (a
candidate within its radius, LUNA16), rank of the best hitting candidate (1 = first), in the bag
(rank <= K = 8), distance of the nearest candidate. Per detector and type: found/total, share in
the bag, median rank, and the CPM over that type's nodules (candidates on other types' nodules are
neither hits nor false positives) with a 95 % bootstrap interval over CTs. ``--real`` adds the two
real scans of ``../shared/data/ct``.

The cohorts measured (issue 34), at the default preset (128x128x96 voxels at 2.5 mm)::

    lungcal synth --out even --n 60 --seed 34 --formats nifti --nodule-types even
    lungcal synth --out classic --n 60 --seed 34 --formats nifti
    lungcal synth --out masses --n 40 --seed 35 --prevalence 0.99 --formats nifti --masses 1
    python experiments/nodule_types.py even/datalist.json classic/datalist.json masses/datalist.json \
        --real ../shared/data/ct --limits --out runs/nodule_types
"""
from __future__ import annotations

import argparse
import csv
import json
import time
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

import numpy as np

from lungcal.candidates.detector import LoGBlobDetector
from lungcal.candidates.froc import candidate_hits, cpm
from lungcal.candidates.lesions import LesionDetector
from lungcal.candidates.subsolid import SubsolidLoGDetector
from lungcal.ct.transforms import preprocess_ct
from lungcal.data.manifest import load_manifest
from lungcal.data.synthetic import lung_masks, make_phantom, place_nodules, sample_anatomy, write_nifti

BAG = {"spacing": (2.5, 2.5, 2.5), "hu_window": (-1000.0, 400.0), "margin_mm": 10.0}
K = 8
DETECTORS = {"log": LoGBlobDetector, "subsolid": SubsolidLoGDetector, "lesion": LesionDetector}
WINDOWED = {"subsolid", "lesion"}  # the detectors told the pipeline's HU window


def _truth(path: Path) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = defaultdict(list)
    with open(path, newline="") as fh:
        for r in csv.DictReader(fh):
            out[r["ct"]].append({"ras": np.array([float(r["rasX"]), float(r["rasY"]), float(r["rasZ"])]),
                                 "d": float(r["diameter_mm"]), "type": r.get("nodule_type") or "solid",
                                 "contact": r.get("contact") or "", "gg_hu": r.get("gg_hu") or "",
                                 "core": r.get("core_frac") or "", "malignant": r["malignant"]})
    return out


def _score(cands, nods):
    """Per nodule: (hit, rank 1-based or 0, distance of the nearest candidate)."""
    res = []
    for n in nods:
        dist = np.linalg.norm(cands.world - n["ras"], axis=1) if len(cands) else np.zeros(0)
        hit = dist <= n["d"] / 2
        rank = int(np.argmax(hit)) + 1 if hit.any() else 0
        res.append((bool(hit.any()), rank, float(dist.min()) if dist.size else float("inf")))
    return res


def _mask_cover(out, nods, affine):
    """For masses (``contact`` set): the share of the mass's sphere inside the preprocessed lung mask."""
    res = {}
    mask = np.asarray(out["lung_mask"])[0] > 0
    for n in nods:
        if not n["contact"]:
            continue
        g = np.indices(mask.shape).reshape(3, -1).T
        world = g @ affine[:3, :3].T + affine[:3, 3]
        inside = np.linalg.norm(world - n["ras"], axis=1) < n["d"] / 2
        res[id(n)] = round(float(mask.reshape(-1)[inside].mean()), 3) if inside.any() else 0.0
    return res


def _type_cpm(scans, kind, rng, n_boot=300):
    """CPM over ``kind``'s nodules; candidates on other nodules are dropped; CTs resampled for the CI."""
    per = []
    for world, score, nods in scans:
        gw = np.array([n["ras"] for n in nods]).reshape(-1, 3)
        gd = np.array([n["d"] for n in nods])
        is_k = np.array([n["type"] == kind for n in nods], bool)
        other = candidate_hits(world, gw[~is_k], gd[~is_k]).any(axis=1) if (~is_k).any() else np.zeros(len(world), bool)
        per.append((world[~other], score[~other], gw[is_k], gd[is_k]))

    def value(idx):
        sel = [per[i] for i in idx]
        if sum(len(s[3]) for s in sel) == 0:
            return np.nan
        return cpm([s[0] for s in sel], [s[1] for s in sel], [s[2] for s in sel], [s[3] for s in sel])

    n = len(per)
    point = value(np.arange(n))
    boots = np.array([value(rng.integers(0, n, n)) for _ in range(n_boot)])
    boots = boots[np.isfinite(boots)]
    lo, hi = (np.percentile(boots, [2.5, 97.5]) if boots.size else (np.nan, np.nan))
    return point, float(lo), float(hi)


def run_cohort(datalist: Path, names, limit=None):
    rows = load_manifest(datalist, check_files=False)[:limit]
    truth = _truth(datalist.parent / "annotations.csv")
    dets = {k: DETECTORS[k](hu_window=BAG["hu_window"]) if k in WINDOWED else DETECTORS[k]() for k in names}
    per_nodule = []
    scans: dict[str, list] = {k: [] for k in names}
    secs = dict.fromkeys(names, 0.0)
    for r in rows:
        out = preprocess_ct(datalist.parent / r["image"], **BAG)
        affine = np.asarray(out["image"].affine, np.float64)
        spacing = np.linalg.norm(affine[:3, :3], axis=0)
        nods = truth.get(r["ct"], [])
        cover = _mask_cover(out, nods, affine)
        for k, det in dets.items():
            t0 = time.perf_counter()
            c = det.detect(out["image"], out["lung_mask"], spacing, affine)
            secs[k] += time.perf_counter() - t0
            scans[k].append((c.world, c.score, nods))
            for n, (hit, rank, dist) in zip(nods, _score(c, nods)):
                per_nodule.append({"detector": k, "ct": r["ct"], "type": n["type"], "contact": n["contact"],
                                   "diameter_mm": round(n["d"], 2), "gg_hu": n["gg_hu"], "core_frac": n["core"],
                                   "malignant": n["malignant"], "hit": int(hit), "rank": rank,
                                   "in_bag": int(0 < rank <= K), "nearest_mm": round(dist, 1),
                                   "mask_cover": cover.get(id(n), "")})
    rng = np.random.default_rng(0)
    summary = {}
    for k in names:
        for kind in sorted({p["type"] for p in per_nodule}):
            sel = [p for p in per_nodule if p["detector"] == k and p["type"] == kind]
            ranks = [p["rank"] for p in sel if p["rank"]]
            c, lo, hi = _type_cpm(scans[k], kind, rng)
            summary[f"{k}/{kind}"] = {"n": len(sel), "found": sum(p["hit"] for p in sel),
                                      "in_bag": sum(p["in_bag"] for p in sel),
                                      "median_rank": float(np.median(ranks)) if ranks else None,
                                      "cpm": round(c, 3), "cpm_ci": [round(lo, 3), round(hi, 3)]}
        summary[f"{k}/seconds_per_ct"] = round(secs[k] / max(len(rows), 1), 2)
    return per_nodule, summary


def run_real(ct_dir: Path, names):
    """The two real scans: rank and distance of the annotated lesion among each detector's candidates."""
    out_rows = []
    with open(ct_dir / "LIDC-IDRI-0001" / "nodules_consensus.csv", newline="") as fh:
        row = next(csv.DictReader(fh))
    lidc = (np.array([-float(row["lps_x_mm"]), -float(row["lps_y_mm"]), float(row["lps_z_mm"])]),
            float(row["mean_max_xy_extent_mm"]))
    with open(ct_dir / "LungPETCTDx-A0002_8mm" / "tumor_bboxes.csv", newline="") as fh:
        boxes = list(csv.DictReader(fh))
    lo = np.array([[-float(b["lps_xmax_mm"]), -float(b["lps_ymax_mm"]), float(b["lps_z_mm"]) - 4] for b in boxes])
    hi = np.array([[-float(b["lps_xmin_mm"]), -float(b["lps_ymin_mm"]), float(b["lps_z_mm"]) + 4] for b in boxes])
    for scan, path in (("LIDC-IDRI-0001", ct_dir / "LIDC-IDRI-0001" / "ct.nii.gz"),
                       ("LungPETCTDx-A0002_8mm", ct_dir / "LungPETCTDx-A0002_8mm" / "dicom")):
        out = preprocess_ct(path, **BAG)
        affine = np.asarray(out["image"].affine, np.float64)
        spacing = np.linalg.norm(affine[:3, :3], axis=0)
        for k in names:
            det = DETECTORS[k](hu_window=BAG["hu_window"]) if k in WINDOWED else DETECTORS[k]()
            c = det.detect(out["image"], out["lung_mask"], spacing, affine)
            if scan.startswith("LIDC"):
                dist = np.linalg.norm(c.world - lidc[0], axis=1)
                hits = dist <= lidc[1] / 2
            else:
                inside = ((c.world[:, None] >= lo[None]) & (c.world[:, None] <= hi[None])).all(axis=-1)
                hits = inside.any(axis=1)
                dist = np.linalg.norm(c.world[:, None] - ((lo + hi) / 2)[None], axis=-1).min(axis=1)
            rank = int(np.argmax(hits)) + 1 if hits.any() else 0
            out_rows.append({"scan": scan, "detector": k, "rank": rank, "in_bag": int(0 < rank <= K),
                             "nearest_mm": round(float(dist.min()), 1),
                             "hit_mm": round(float(dist[rank - 1]), 1) if rank else None, "n_candidates": len(c)})
    return out_rows


def run_limits(names, tmp: Path, n_ct: int = 2, per_ct: int = 3):
    """The smallest and faintest nodules found at the default preset (128x128x96 at 2.5 mm, noise
    20 HU, kernel 0.7 mm): ``per_ct`` nodules of one size and density in each of ``n_ct`` phantoms
    per cell; per detector, the share hit and the share in the bag (rank <= K)."""
    shape, spacing = (128, 128, 96), (2.5, 2.5, 2.5)
    cells = [("ground-glass", d, hu) for d in (4.0, 6.0, 8.0, 10.0, 14.0) for hu in (-800.0, -700.0, -600.0, -500.0,
                                                                                       -400.0)]
    cells += [("solid", d, 35.0) for d in (3.0, 4.0, 5.0, 6.0)]
    dets = {k: DETECTORS[k](hu_window=BAG["hu_window"]) if k in WINDOWED else DETECTORS[k]() for k in names}
    out = []
    origin = -(np.asarray(shape) - 1) / 2 * np.asarray(spacing, np.float32)
    for ci, (kind, d, hu) in enumerate(cells):
        tally = {k: [0, 0] for k in names}
        for rep in range(n_ct):
            rng = np.random.default_rng([34, ci, rep])
            anat = sample_anatomy(rng, shape, spacing)
            lr, ll = lung_masks(shape, np.asarray(spacing, np.float32), origin, anat)[0]
            base = place_nodules(rng, lr | ll, spacing, origin, [(d, 0, 0, False)] * per_ct)
            nods = [replace(n, nodule_type=kind, attenuation=kind, gg_hu=None if kind == "solid" else hu,
                            core_frac=None if kind == "solid" else 0.0) for n in base]
            hu_img, org, _ = make_phantom(np.random.default_rng([34, ci, rep, 8]), shape, spacing, nods, anat=anat)
            path = tmp / "limit.nii.gz"
            write_nifti(hu_img, org, spacing, path)
            pre = preprocess_ct(path, **BAG)
            affine = np.asarray(pre["image"].affine, np.float64)
            sp = np.linalg.norm(affine[:3, :3], axis=0)
            truth = [{"ras": np.array(n.center_lps) * [-1, -1, 1], "d": d} for n in nods]
            for k, det in dets.items():
                c = det.detect(pre["image"], pre["lung_mask"], sp, affine)
                for hit, rank, _ in _score(c, truth):
                    tally[k][0] += hit
                    tally[k][1] += 0 < rank <= K
        n = n_ct * per_ct
        for k in names:
            out.append({"type": kind, "diameter_mm": d, "hu": hu, "detector": k, "n": n,
                        "found": tally[k][0], "in_bag": tally[k][1]})
        print(out[-2:], flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("datalist", nargs="*", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--detectors", nargs="+", default=["log", "subsolid"], choices=sorted(DETECTORS))
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--real", type=Path, default=None, help="../shared/data/ct")
    ap.add_argument("--limits", action="store_true", help="the size x density sweep at the default preset")
    ap.add_argument("--spacing", type=float, default=2.5, help="bag voxel size in mm (fullres: 1)")
    ap.add_argument("--k", type=int, default=8, help="bag size K (fullres: 16)")
    a = ap.parse_args()
    global K
    K = a.k
    BAG["spacing"] = (a.spacing,) * 3
    a.out.mkdir(parents=True, exist_ok=True)
    result: dict = {}
    for dl in a.datalist:
        per, summary = run_cohort(dl, a.detectors, a.limit)
        name = dl.parent.name
        with open(a.out / f"{name}_nodules.csv", "w", newline="") as fh:
            w = csv.DictWriter(fh, fieldnames=list(per[0]))
            w.writeheader()
            w.writerows(per)
        result[name] = summary
    if a.real is not None:
        result["real"] = run_real(a.real, a.detectors)
    if a.limits:
        result["limits"] = run_limits(a.detectors, a.out)
    (a.out / "summary.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
