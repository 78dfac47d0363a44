"""Do masses against the chest wall or the mediastinum stay inside the lung mask? (issue 43 item 3)

Lesions are inserted into the real CTs of ``../shared/data/ct``
(:mod:`lungcal.data.synthetic.insertion`): masses of 30-70 mm against the costal pleura and
against the mediastinum, and solid nodules at the pleura. They are planned once, on the mask
*before* the change (:class:`~lungcal.ct.masking.LungMasker` with ``mass_chord_mm=0`` and
``lesion_closing_sideways_mm=0``: no step 5, the rolling ball in the axial slices only), so that both
maskers see the same lesions. Each inserted scan goes through the pipeline's preprocessing (2.5 mm,
the bag's crop) with each masker, and the share of each lesion's sphere inside the preprocessed
lung mask is measured as the lesion bed measures it (``mask_share``). ``ceiling`` is the share
inside the mask of the scan without the lesion: what a mask that knew the lung before the lesion
grew could give (the part of a sphere beyond the pleura is never lung).

On the scans as they are (no lesion inserted), per masker: lung volume (mL), the volume the change
adds, how much of it is soft tissue (> -300 HU: the heart, the liver dome or the hilum would show
here), the masker's time; on NSCLC-Radiomics-LUNG1-002 its RT structures (``rtstruct.dcm``): the
share of the real 10 cm tumour (GTV) inside the mask and the heart's volume inside it; and each
annotated real lesion's share.

    python experiments/mass_mask.py --ct-dir ../shared/data/ct --out runs/mass_mask
    python experiments/mass_mask.py --ct-dir ../shared/data/ct --seed 43 --seed-step 0 --out runs/mass_mask_dev

The first line is the hold-out draw (a seed per background); the second the draw the settings were
tuned on (one seed for all three).
"""
from __future__ import annotations

import argparse
import csv
import json
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import pydicom
import torch
from monai.data import MetaTensor
from skimage.draw import polygon

from lungcal.ct.masking import LungMasker
from lungcal.ct.transforms import DEFAULT_HU_WINDOW, build_preprocess
from lungcal.ctapp.evaluate.lesion_bed import _mask_share, shared_backgrounds
from lungcal.data.synthetic.insertion import insert_lesions, load_background, plan_lesions
from lungcal.errors import LungcalError

CASES = ("LIDC-IDRI-0001", "LIDC-IDRI-0314", "NSCLC-Radiomics-LUNG1-002")
CELLS = {("mass", "pleura"): 7, ("mass", "mediastinum"): 7, ("solid", "pleura"): 8, ("solid", "mediastinum"): 4}
SPACING = 2.5  # the default preset's voxels
#: before: without step 5 and with the rolling ball in the axial slices only (the masker the lesions are placed on,
#: as the lesion bed's ``PLANNING_MASKER`` does); after: as shipped
MASKERS = {"before": LungMasker(mass_chord_mm=0, lesion_closing_sideways_mm=0.0), "after": LungMasker()}


def _preprocessed_mask(hu: np.ndarray, affine: np.ndarray, masker: LungMasker) -> tuple[np.ndarray, np.ndarray]:
    img = MetaTensor(torch.from_numpy(np.ascontiguousarray(hu[None], np.float32)), affine=torch.as_tensor(affine))
    out = build_preprocess((SPACING,) * 3, DEFAULT_HU_WINDOW, load=False, masker=masker)({"image": img})
    return np.asarray(out["lung_mask"][0].numpy()) > 0, np.asarray(out["image"].affine.numpy(), np.float64)


def _structures(rtstruct: Path, shape: tuple[int, ...], affine: np.ndarray, names: set[str]) -> dict[str, np.ndarray]:
    """The named closed contours of an RT structure set rasterised on the (RAS) grid of ``affine``."""
    ds = pydicom.dcmread(str(rtstruct))
    roi = {r.ROINumber: r.ROIName for r in ds.StructureSetROISequence}
    inv = np.linalg.inv(affine)
    out = {}
    for c in ds.ROIContourSequence:
        name = roi[c.ReferencedROINumber]
        if name not in names:
            continue
        m = np.zeros(shape, bool)
        for s in getattr(c, "ContourSequence", []):
            p = np.asarray(s.ContourData, float).reshape(-1, 3)
            v = np.c_[-p[:, 0], -p[:, 1], p[:, 2], np.ones(len(p))] @ inv.T  # LPS -> RAS -> voxel
            k = int(round(float(v[0, 2])))
            if 0 <= k < shape[2]:
                rr, cc = polygon(v[:, 0], v[:, 1], shape[:2])
                plane = np.zeros(shape[:2], bool)
                plane[rr, cc] = True
                m[:, :, k] ^= plane  # a contour inside another is a hole
        out[name] = m
    return out


def run(ct_dir: Path, seed: int, seed_step: int, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    scans: list[dict] = []
    reals: list[dict] = []
    for b, (image, real) in enumerate(shared_backgrounds(ct_dir, CASES)):
        case = image.parent.name
        try:
            bg = load_background(image, case, [(r.centre_ras, r.diameter_mm / 2) for r in real])
        except LungcalError as e:
            print(f"{case}: skipped, the reader refuses it: {e}")
            continue
        spacing = bg.spacing
        vml = float(np.prod(spacing)) / 1000
        masks: dict[str, np.ndarray] = {}
        secs: dict[str, float] = {}
        for name, m in MASKERS.items():
            t = time.perf_counter()
            masks[name] = np.asarray(m(bg.hu, spacing), bool)
            secs[name] = time.perf_counter() - t
        bg.lung, bg.geometry = masks["before"], None  # lesions planned on the mask before the change
        soft = bg.hu > -300
        added = masks["after"] & ~masks["before"]
        row: dict[str, object] = {
            "case": case, "lung_ml_before": round(float(masks["before"].sum()) * vml),
            "lung_ml_after": round(float(masks["after"].sum()) * vml), "added_ml": round(float(added.sum()) * vml, 1),
            "added_soft_ml": round(float((added & soft).sum()) * vml, 1),
            "removed_ml": round(float((masks["before"] & ~masks["after"]).sum()) * vml, 1),
            "masker_s_before": round(secs["before"], 2), "masker_s_after": round(secs["after"], 2)}
        if (image.parent / "rtstruct.dcm").exists():
            rt = _structures(image.parent / "rtstruct.dcm", bg.hu.shape, bg.affine, {"GTV-1", "Heart"})
            for name in MASKERS:
                row[f"gtv_share_{name}"] = round(float(masks[name][rt["GTV-1"]].mean()), 3)
                row[f"heart_ml_{name}"] = round(float((masks[name] & rt["Heart"]).sum() * vml), 1)
        scans.append(row)
        print(row, flush=True)
        # the lung before any lesion: the ceiling of each share
        plain, plain_aff = _preprocessed_mask(bg.hu, bg.affine, MASKERS["before"])
        pre = {name: _preprocessed_mask(bg.hu, bg.affine, m) for name, m in MASKERS.items()}
        for r in real:
            reals.append({"case": case, "lesion": r.source, "diameter_mm": round(r.diameter_mm, 1),
                          **{f"share_{n}": round(_mask_share(m, a, np.asarray(r.centre_ras), r.diameter_mm / 2), 3)
                             for n, (m, a) in pre.items()}})
        plan = plan_lesions(bg, CELLS, np.random.default_rng(seed + seed_step * b), per_scan=2)
        for i, lesions in enumerate(plan):
            hu = insert_lesions(bg, lesions)
            shares = {}
            for name, m in MASKERS.items():
                mask, aff = _preprocessed_mask(hu, bg.affine, m)
                shares[name] = [_mask_share(mask, aff, np.asarray(x.centre_ras), x.radius_mm) for x in lesions]
            for j, x in enumerate(lesions):
                rows.append({"case": case, "scan": i, "kind": x.kind, "place": x.place, "diameter_mm": x.diameter_mm,
                             "posterior": x.posterior,
                             "ceiling": round(_mask_share(plain, plain_aff, np.asarray(x.centre_ras), x.radius_mm), 3),
                             **{f"share_{n}": round(v[j], 3) for n, v in shares.items()}})
            print(f"{case}: scan {i + 1}/{len(plan)}", flush=True)
    for name, data in (("lesions", rows), ("scans", scans), ("real_lesions", reals)):
        if data:
            with open(out / f"{name}.csv", "w", newline="") as fh:
                w = csv.DictWriter(fh, fieldnames=list(dict.fromkeys(k for r in data for k in r)))
                w.writeheader()
                w.writerows(data)
    print(summary(rows))


def summary(rows: list[dict]) -> str:
    """Per kind and place: n, median and minimum share before/after, the share with >= 0.5, the ceiling."""
    g: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for r in rows:
        g[(r["kind"], r["place"])].append(r)
    lines = ["| lesion | place | n | median before | median after | min before | min after | >= 0.5 before | "
             ">= 0.5 after | ceiling (median, min) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for (kind, place), rs in sorted(g.items()):
        b = np.array([r["share_before"] for r in rs])
        a = np.array([r["share_after"] for r in rs])
        c = np.array([r["ceiling"] for r in rs])
        lines.append(f"| {kind} | {place} | {len(rs)} | {np.median(b):.2f} | {np.median(a):.2f} | {b.min():.2f} | "
                     f"{a.min():.2f} | {np.mean(b >= 0.5):.0%} | {np.mean(a >= 0.5):.0%} | "
                     f"{np.median(c):.2f}, {c.min():.2f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ct-dir", type=Path, default=Path("../shared/data/ct"))
    ap.add_argument("--seed", type=int, default=4300)
    ap.add_argument("--seed-step", type=int, default=1, help="the seed of background b is seed + seed_step * b")
    ap.add_argument("--out", type=Path, default=Path("runs/mass_mask"))
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=JSON",
                    help="one more masker to score beside before/after, LungMasker(**JSON) (repeatable), e.g. "
                         "'dir7={\"mass_directions\": 7}': its share is the column share_NAME, its heart volume "
                         "heart_ml_NAME, and the last table gives each variant's >= 0.5 share and median")
    a = ap.parse_args()
    for v in a.variant:
        name, _, spec = v.partition("=")
        if not name or name in MASKERS:
            ap.error(f"--variant needs a new NAME=JSON, got {v!r}")
        MASKERS[name] = LungMasker(**json.loads(spec or "{}"))
    run(a.ct_dir, a.seed, a.seed_step, a.out)
    if a.variant:
        print(variant_table(list(csv.DictReader(open(a.out / "lesions.csv"))), list(MASKERS)))


def variant_table(rows: list[dict], names: list[str]) -> str:
    """Per kind and place: each masker's share of lesions at least half inside the mask, and the median share."""
    g: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for r in rows:
        g[(r["kind"], r["place"])].append(r)
    lines = ["| lesion | place | n | " + " | ".join(names) + " |", "|---|---|---|" + "---|" * len(names)]
    for (kind, place), rs in sorted(g.items()):
        cells = []
        for n in names:
            v = np.array([float(r[f"share_{n}"]) for r in rs])
            cells.append(f"{np.mean(v >= 0.5):.0%} ({np.median(v):.2f})")
        lines.append(f"| {kind} | {place} | {len(rs)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
