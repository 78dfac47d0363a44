"""A learned second stage for the default detector (issue 43 item 3): can a classifier over the candidates'
surroundings put more part-solid and ground-glass nodules into the K = 16 bag than the fixed ``SSSG`` slots?

Classical CAD finds candidates with a sensitive first stage and ranks them with a trained false-positive
reducer. Here the first stage is the shipped :class:`~lungcal.candidates.lesions.LesionDetector`'s two channels
(each one's best ``--pool``); each candidate gets a radial profile of the CT around it (mean, quartiles and lung
share of spherical shells in mm and in multiples of its radius), its channel, rank, score and radius, and its
depth in the lung mask; a scikit-learn ``HistGradientBoostingClassifier`` learns which candidates lie on an
inserted lesion (within its radius, at least 5 mm; each lesion weighs one); the bag is the candidates by
decreasing probability, overlapping ones dropped as in the detector.

The backgrounds are the same anatomy in every inserted scan of a draw, so a model tested on a background it
was trained on would be graded on memorised vessels: the evaluation is **leave one background out** (train on
the other backgrounds' scans, rank the held-out background's). Candidates near a background's own annotated
lesions are left out of training (they are lesions, not false positives).

    python experiments/glass_variants.py build --ct-dir ../shared/data/ct --seed 11 \\
        --kinds solid part-solid ground-glass mass --out runs/gv/seed11
    python experiments/learned_rerank.py features --cache runs/gv/seed11 --ct-dir ../shared/data/ct \\
        --out runs/gv/seed11_feat.npz
    python experiments/learned_rerank.py evaluate --features runs/gv/seed11_feat.npz --cache runs/gv/seed11 \
        --out runs/gv/seed11_learned.csv                  # --label bag: positives by the bag's own criterion
"""
from __future__ import annotations

import argparse
import csv
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
from scipy import ndimage
from sklearn.metrics import roc_auc_score
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))

from glass_variants import ShellLesionDetector, target  # noqa: E402

from lungcal.candidates.detector import Candidates  # noqa: E402
from lungcal.candidates.sensitivity import holds_centre, lesion_ranks  # noqa: E402
from lungcal.candidates.subsolid import merge_candidates  # noqa: E402
from lungcal.ctapp.evaluate.lesion_bed import PRESETS  # noqa: E402
from lungcal.ctapp.evaluate.lesion_bed_run import find_backgrounds  # noqa: E402

#: spherical shells in mm around a candidate's centre, and in multiples of its radius
SHELLS_MM = ((0, 2.5), (2.5, 5), (5, 7.5), (7.5, 10), (10, 15), (15, 20))
SHELLS_R = ((0, 0.5), (0.5, 1.0), (1.0, 1.5), (1.5, 2.0), (2.0, 3.0))


def _shell_stats(crop: np.ndarray, lung: np.ndarray, d: np.ndarray, lo: float, hi: float, level: float) -> list[float]:
    sel = (d >= lo) & (d < hi) if lo > 0 else d < hi
    if not sel.any():
        sel = d <= d.min()
    v = crop[sel] - level
    q1, q2, q3 = np.percentile(v, [25, 50, 75])
    return [float(v.mean()), float(q1), float(q2), float(q3), float(lung[sel].mean())]


def candidate_features(hu: np.ndarray, lung: np.ndarray, depth: np.ndarray, c: Candidates, channel: int,
                       spacing: np.ndarray, level: float) -> np.ndarray:
    """One row a candidate: channel, rank, score, radius, depth in the lung mask (mm; negative outside), and per
    shell the mean and quartiles of HU above the lung's level and the share of lung voxels."""
    rows = []
    shape = np.asarray(hu.shape)
    for rank, (v, r, s) in enumerate(zip(c.voxel, c.radius_mm, c.score)):
        reach = max(SHELLS_MM[-1][1], SHELLS_R[-1][1] * r)
        h = np.ceil(reach / spacing).astype(np.int64)
        lo, hi = np.maximum(v - h, 0), np.minimum(v + h + 1, shape)
        sl = tuple(slice(int(a), int(b)) for a, b in zip(lo, hi))
        g = np.meshgrid(*[(np.arange(a, b) - cc) * ss for a, b, cc, ss in zip(lo, hi, v, spacing)], indexing="ij")
        d = np.sqrt(g[0] ** 2 + g[1] ** 2 + g[2] ** 2)
        crop, lc = hu[sl], lung[sl]
        f = [channel, rank, float(s), float(r), float(depth[tuple(v)]), float(hu[tuple(v)] - level)]
        for a, b in SHELLS_MM:
            f += _shell_stats(crop, lc, d, a, b, level)
        for a, b in SHELLS_R:
            f += _shell_stats(crop, lc, d, a * r, max(b * r, a * r + 2.5), level)
        rows.append(f)
    return np.asarray(rows, np.float32).reshape(-1, 6 + 5 * (len(SHELLS_MM) + len(SHELLS_R)))


def scan_candidates(img: np.ndarray, lung: np.ndarray, aff: np.ndarray, pool: int):
    """The two channels' best ``pool`` each: their features, voxels, world positions and radii."""
    sp = np.linalg.norm(aff[:3, :3], axis=0)
    lists = ShellLesionDetector().pools(img, lung, sp, aff, pool=pool)
    hu = img.astype(np.float32) * 1400.0 - 1000.0
    level = float(np.median(hu[lung])) if lung.any() else -860.0
    depth = ndimage.distance_transform_edt(lung, sampling=sp) - ndimage.distance_transform_edt(~lung, sampling=sp)
    feats, parts = [], []
    for ch, name in enumerate("SG"):
        c = lists[name]
        feats.append(candidate_features(hu, lung, depth, c, ch, sp, level))
        parts.append(c)
    return (np.concatenate(feats), np.concatenate([p.voxel for p in parts]).reshape(-1, 3),
            np.concatenate([p.world for p in parts]).reshape(-1, 3), np.concatenate([p.radius_mm for p in parts]))


def features(cache: Path, ct_dir: Path, out: Path, pool: int = 64) -> None:
    info = json.loads((cache / "meta.json").read_text())
    bgs, _ = find_backgrounds(ct_dir)
    reals = {bg.name: [(np.asarray(r.centre_ras, float), r.diameter_mm / 2) for r in rl] for bg, rl in bgs}
    X, y, scan, vox, world, rad, lesion = [], [], [], [], [], [], []
    for i, m in enumerate(tqdm(info["scans"], desc="features", unit="scan")):
        z = np.load(cache / m["file"])
        img, lung, aff = z["image"], z["lung"] > 0, z["affine"]
        f, cv, cw, cr = scan_candidates(img, lung, aff, pool)
        lab = np.zeros(len(cv), np.int8)
        les = np.full(len(cv), -1, np.int64)
        for j, (cen, r) in enumerate(zip(m["centres"], m["radii"])):
            on = np.linalg.norm(cw - np.asarray(cen), axis=1) <= max(r, 5.0)
            lab[on] = 1
            les[on] = 100 * i + j
        for cen, r in reals.get(m["background"], []):  # a background's own lesions: left out of training
            dist = np.linalg.norm(cw - cen, axis=1)
            lab[(dist <= r + 10.0) & (lab == 0)] = -1
        X.append(f)
        y.append(lab)
        scan.append(np.full(len(cv), i, np.int32))
        vox.append(cv)
        world.append(cw)
        rad.append(cr)
        lesion.append(les)
    np.savez_compressed(out, X=np.concatenate(X), y=np.concatenate(y), scan=np.concatenate(scan),
                        lesion=np.concatenate(lesion),
                        voxel=np.concatenate(vox), world=np.concatenate(world), radius=np.concatenate(rad))


def _fit(X: np.ndarray, y: np.ndarray, lesion: np.ndarray, seed: int = 0):
    """A gradient-boosted classifier of "on a lesion"; each lesion weighs one in all (a mass's many candidates
    do not outweigh a nodule's one), the negatives as much as all lesions together."""
    from sklearn.ensemble import HistGradientBoostingClassifier  # noqa: PLC0415

    keep = y >= 0
    w = np.ones(len(y))
    ids, inv, cnt = np.unique(lesion[y == 1], return_inverse=True, return_counts=True)
    w[y == 1] = 1.0 / cnt[inv]
    w[y == 0] = len(ids) / max(int((y == 0).sum()), 1)
    model = HistGradientBoostingClassifier(max_iter=300, learning_rate=0.05, max_leaf_nodes=15,
                                           l2_regularization=1.0, random_state=seed)
    return model.fit(X[keep], y[keep], sample_weight=w[keep])


def bag_labels(info: dict, cache: Path, z, patch_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Labels by the bag's own criterion: a candidate is on a lesion when its patch holds the lesion's centre 5 mm
    inside its faces (a mass: or the candidate lies on it), as :func:`lesion_ranks` counts; the rest as stored."""
    y, lesion = z["y"].copy(), z["lesion"].copy()
    scan, vox, world = z["scan"], z["voxel"], z["world"]
    for i, m in enumerate(info["scans"]):
        sel = np.flatnonzero(scan == i)
        aff = np.load(cache / m["file"])["affine"]
        sp = np.linalg.norm(aff[:3, :3], axis=0)
        cen = np.array(m["centres"])
        ok = holds_centre((cen - aff[:3, 3]) @ np.linalg.inv(aff[:3, :3]).T, vox[sel], patch_size, sp)
        on = np.linalg.norm(world[sel][None] - cen[:, None], axis=2) <= np.array(m["radii"])[:, None]
        ok = np.where(np.array(m["mass"])[:, None], ok | on, ok)
        for j in range(len(cen)):
            new = ok[j] & (y[sel] != 1)
            y[sel[new]] = 1
            lesion[sel[new]] = 100 * i + j
    return y, lesion


def evaluate(feat: Path, cache: Path, k: int = 16, min_distance_mm: float = 5.0, label: str = "centre"
             ) -> list[dict]:
    """Leave one background out: each background's scans ranked by a model fitted on the others'. ``label``:
    ``centre`` (a candidate within the lesion's radius, at least 5 mm) or ``bag`` (:func:`bag_labels`)."""
    info = json.loads((cache / "meta.json").read_text())
    preset = PRESETS[info["preset"]]
    z = np.load(feat)
    X, y, scan, lesion = z["X"], z["y"], z["scan"], z["lesion"]
    centred = lesion
    if label == "bag":
        y, lesion = bag_labels(info, cache, z, preset.patch_size)
    bg_of = np.array([info["scans"][i]["background"] for i in scan])
    prob = np.zeros(len(y))
    for b in sorted(set(bg_of)):
        test = bg_of == b
        model = _fit(X[~test], y[~test], lesion[~test])
        prob[test] = model.predict_proba(X[test])[:, 1]
        ok = test & (y >= 0)
        print(f"held out {b}: trained on {int((~test).sum())} candidates ({int((y[~test] == 1).sum())} on "
              f"lesions); ROC AUC on it {roc_auc_score(y[ok], prob[ok]):.3f}")
    rows = []
    for i, m in enumerate(info["scans"]):
        sel = np.flatnonzero(scan == i)
        aff = np.load(cache / m["file"])["affine"]
        sp = np.linalg.norm(aff[:3, :3], axis=0)
        order = sel[np.argsort(-prob[sel], kind="stable")]
        c = Candidates(z["voxel"][order], z["world"][order], z["radius"][order], prob[order])
        bag = merge_candidates([c], sp, k, min_distance_mm)
        ranks = lesion_ranks(np.array(m["centres"]), np.array(m["radii"]), np.array(m["mass"]), bag.voxel,
                             bag.world, aff, preset.patch_size)
        for j, (x, r) in enumerate(zip(m["lesions"], ranks)):
            rows.append({"variant": "learned", "background": m["background"], "kind": x["kind"], "place": x["place"],
                         "diameter_mm": x["diameter_mm"], "gg_hu": x["gg_hu"], "rank": int(r),
                         "in_bag": bool(0 < r <= k), "centred_in_pool": bool((centred[sel] == 100 * i + j).any())})
    return rows


def table(rows: list[dict]) -> str:
    count: dict[tuple, list[int]] = defaultdict(lambda: [0, 0])
    for x in rows:
        if not target(x["kind"], float(x["diameter_mm"]), float(x["gg_hu"])):
            continue
        for place in ("all", x["place"]):
            count[(x["kind"], place)][0] += bool(x["in_bag"])
            count[(x["kind"], place)][1] += 1
    places = ("all", "free", "pleura", "mediastinum", "vessel")
    lines = ["| kind | " + " | ".join(places) + " | misses with a candidate centred on them in the pool |",
             "|---|" + "---|" * (len(places) + 1)]
    for kind in sorted({k for k, _ in count}):
        miss = [x for x in rows if x["kind"] == kind and not x["in_bag"]
                and target(x["kind"], float(x["diameter_mm"]), float(x["gg_hu"]))]
        lines.append(f"| {kind} | " + " | ".join(f"{count[(kind, p)][0]}/{count[(kind, p)][1]}" for p in places)
                     + f" | {sum(x['centred_in_pool'] for x in miss)}/{len(miss)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("features")
    f.add_argument("--cache", type=Path, required=True)
    f.add_argument("--ct-dir", type=Path, default=Path("../shared/data/ct"))
    f.add_argument("--pool", type=int, default=64)
    f.add_argument("--out", type=Path, required=True)
    e = sub.add_parser("evaluate")
    e.add_argument("--features", type=Path, required=True)
    e.add_argument("--cache", type=Path, required=True)
    e.add_argument("--out", type=Path, default=None, help="rows CSV (one a lesion)")
    e.add_argument("--label", choices=("centre", "bag"), default="centre",
                   help="what a positive candidate is: within the lesion (centre) or its patch holds it (bag)")
    a = ap.parse_args(argv)
    t = time.perf_counter()
    if a.cmd == "features":
        features(a.cache, a.ct_dir, a.out, a.pool)
    else:
        rows = evaluate(a.features, a.cache, label=a.label)
        if a.out is not None:
            a.out.parent.mkdir(parents=True, exist_ok=True)
            with open(a.out, "w", newline="") as fh:
                w = csv.DictWriter(fh, fieldnames=list(rows[0]))
                w.writeheader()
                w.writerows(rows)
        print(table(rows))
    print(f"{time.perf_counter() - t:.0f} s")


if __name__ == "__main__":
    main()
