"""Is there a peak on the lesion before the detector's suppression? (issue 43 item 3)

The lesion bed's misses at the targets' sizes have no candidate on them among each channel's best 64
(docs/results/ct-detection.md, "ranking by the surroundings"). A channel's candidates are its
scale-space maxima after a greedy suppression that drops every peak whose sphere overlaps a better one's
(closer than ``max(min_distance_mm, r_better + r_weaker)``): a nodule that touches a vessel, the
mediastinum or a mass-sized false blob at the hilum overlaps it by definition, so it is suppressed even
when its own peak exists. This script keeps every channel's peaks *before* the suppression (each
channel of the shipped :class:`~lungcal.candidates.lesions.LesionDetector` run once per kept scan, its
suppression replaced by none) and applies suppression rules to them offline:

- ``overlap``: the shipped rule, spheres may not overlap (``max(d_min, r1 + r2)``);
- ``centre``: a peak is dropped only when its centre lies inside a better one's sphere (``max(d_min, r_better)``);
- ``min``: only the minimum distance (``d_min``, 5 mm).

For each rule it reports, per kind at the targets' sizes: how many lesions have a peak on them (within their
radius, at least 5 mm) among each channel's first 64 and at all, and how many reach the merged ``SSSG`` bag
of K 16 (the bag's criterion, :func:`~lungcal.candidates.sensitivity.lesion_ranks`), the interleave's overlap
test following the same rule.

    python experiments/glass_variants.py build --ct-dir ../shared/data/ct --seed 11 \\
        --kinds solid part-solid ground-glass mass --out runs/gv/seed11          # the tuning draw, 6 min
    python experiments/candidate_pool.py peaks --cache runs/gv/seed11 --out runs/gv/seed11_peaks.npz
    python experiments/candidate_pool.py rules --cache runs/gv/seed11 --peaks runs/gv/seed11_peaks.npz \\
        --out runs/gv/seed11_rules.csv
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Mapping
from pathlib import Path
from unittest import mock

import numpy as np
from scipy import ndimage
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))

from glass_variants import target  # noqa: E402

from lungcal.candidates.detector import Candidates, LoGBlobDetector, MaskMemo  # noqa: E402
from lungcal.candidates.lesions import LesionDetector  # noqa: E402
from lungcal.candidates.sensitivity import lesion_ranks  # noqa: E402
from lungcal.ctapp.evaluate.lesion_bed import PRESETS  # noqa: E402

#: peaks kept per channel and scan (best first), before any suppression
N_PEAKS = {"S": 20000, "G": 5000}
RULES = ("overlap", "centre", "min")
KS = (16, 32)


def _keep_all(self: LoGBlobDetector, vox: np.ndarray, radius: np.ndarray, spacing: np.ndarray) -> np.ndarray:
    return np.arange(min(len(vox), self.top_k), dtype=np.int64)


_SHIPPED_MASKS = LoGBlobDetector._masks


def _centres_in_dilated(self: LoGBlobDetector, raw: np.ndarray, spacing: np.ndarray, memo: MaskMemo | None = None):
    """The variant ``dilated``: candidate centres anywhere the intensities are kept (the dilated mask), not only
    inside the closed mask; a juxtapleural or juxtamediastinal nodule that the lung mask cut out and the
    closing did not take back has its centre in the dilation's rim."""
    _, dilated = _SHIPPED_MASKS(self, raw, spacing, memo)
    return dilated, dilated


#: the mask variants ``peaks --variant`` knows: name -> (patched ``_masks`` or None, solid-channel settings)
VARIANTS: dict[str, tuple[Callable | None, dict]] = {
    "shipped": (None, {}),
    "dilated": (_centres_in_dilated, {}),
    "dilated8": (_centres_in_dilated, {"mask_dilation_mm": 8.0}),
}


@dataclasses.dataclass
class MaskVariantLesionDetector(LesionDetector):
    """The shipped :class:`~lungcal.candidates.lesions.LesionDetector` with a mask variant of :data:`VARIANTS`
    (its solid settings are given as ``solid``), as a detector config for ``glass_variants.py phantoms``:
    ``{"_target_": "candidate_pool.MaskVariantLesionDetector", "variant": "dilated"}``."""

    variant: str = "dilated"

    def detect(self, image, lung_mask, spacing, affine) -> Candidates:
        masks = VARIANTS[self.variant][0] or _SHIPPED_MASKS
        with mock.patch.object(LoGBlobDetector, "_masks", masks):
            return super().detect(image, lung_mask, spacing, affine)


def raw_peaks(img: np.ndarray, lung: np.ndarray, aff: np.ndarray, variant: str = "shipped") -> dict[str, Candidates]:
    """Each channel's scale-space peaks, best first, without the suppression (``N_PEAKS`` of each)."""
    masks, solid = VARIANTS[variant]
    chans = LesionDetector(solid=solid)._channels()
    sp = np.linalg.norm(aff[:3, :3], axis=0)
    memo = MaskMemo()
    with mock.patch.object(LoGBlobDetector, "_suppress", _keep_all), \
            mock.patch.object(LoGBlobDetector, "_masks", masks or _SHIPPED_MASKS):
        s = dataclasses.replace(chans["S"], top_k=N_PEAKS["S"]).detect(img, lung, sp, aff, memo=memo)
        # the ground-glass channel asks its LoG search for 4 x top_k, then keeps top_k
        g = dataclasses.replace(chans["G"], top_k=N_PEAKS["G"]).detect(img, lung, sp, aff, memo=memo)
    return {"S": s, "G": g}


def reach_fn(rule: str, d_min: float) -> Callable[[np.ndarray, np.ndarray], np.ndarray]:
    """``reach(r_better, r_weaker)``: a weaker peak closer than this to a kept one is dropped."""
    if rule == "overlap":
        return lambda rb, rw: np.maximum(d_min, rb + rw)
    if rule == "centre":
        return lambda rb, rw: np.maximum(d_min, rb + 0 * rw)
    if rule == "min":
        return lambda rb, rw: np.full(np.broadcast(rb, rw).shape, d_min)
    raise ValueError(rule)


def suppress(c: Candidates, sp: np.ndarray, reach, top_k: int) -> Candidates:
    """Greedy suppression of ``c`` (best first) by ``reach``; the first ``top_k`` kept."""
    pos = c.voxel * sp
    n = len(c)
    dropped = np.zeros(n, bool)
    kept: list[int] = []
    for i in range(n):
        if dropped[i]:
            continue
        kept.append(i)
        if len(kept) >= top_k:
            break
        r = reach(c.radius_mm[i], c.radius_mm[i + 1:])
        dropped[i + 1:] |= np.sum((pos[i + 1:] - pos[i]) ** 2, axis=1) < r ** 2
    k = np.asarray(kept, np.int64)
    return Candidates(c.voxel[k], c.world[k], c.radius_mm[k], c.score[k])


def interleave_by(lists: Mapping[str, Candidates], pattern: str, sp: np.ndarray, top_k: int, reach) -> Candidates:
    """:func:`lungcal.candidates.lesions.interleave` with the overlap test given by ``reach``."""
    pos = {ch: c.voxel * sp for ch, c in lists.items()}
    nxt = dict.fromkeys(lists, 0)
    picks: list[tuple[str, int]] = []
    tp: list[np.ndarray] = []
    tr: list[float] = []
    slot = 0
    while len(picks) < top_k:
        got = False
        for j in range(len(pattern)):
            ch = pattern[(slot + j) % len(pattern)]
            c = lists[ch]
            while nxt[ch] < len(c):
                i = nxt[ch]
                nxt[ch] += 1
                if tp and np.any(np.sum((np.asarray(tp) - pos[ch][i]) ** 2, axis=1)
                                 < reach(np.asarray(tr), c.radius_mm[i]) ** 2):
                    continue
                picks.append((ch, i))
                tp.append(pos[ch][i])
                tr.append(float(c.radius_mm[i]))
                got = True
                break
            if got:
                break
        if not got:
            break
        slot += 1
    if not picks:
        return Candidates()
    return Candidates(np.stack([lists[ch].voxel[i] for ch, i in picks]),
                      np.stack([lists[ch].world[i] for ch, i in picks]),
                      np.array([lists[ch].radius_mm[i] for ch, i in picks]),
                      np.arange(len(picks), 0, -1, dtype=np.float64))


def on_rank(centres: np.ndarray, radii: np.ndarray, c: Candidates) -> np.ndarray:
    """Each lesion's best rank (1-based, 0 none) among candidates within its radius (at least 5 mm) of its centre."""
    if len(c) == 0:
        return np.zeros(len(centres), np.int64)
    d = np.linalg.norm(c.world[None] - centres[:, None], axis=2)
    ok = d <= np.maximum(radii, 5.0)[:, None]
    return np.where(ok.any(axis=1), ok.argmax(axis=1) + 1, 0).astype(np.int64)


def peaks(cache: Path, out: Path, variant: str = "shipped") -> None:
    info = json.loads((cache / "meta.json").read_text())
    arrays: dict[str, np.ndarray] = {}
    for m in tqdm(info["scans"], desc="peaks", unit="scan"):
        z = np.load(cache / m["file"])
        found = raw_peaks(z["image"], z["lung"] > 0, z["affine"], variant)
        for ch, c in found.items():
            for f in ("voxel", "world", "radius_mm", "score"):
                arrays[f"{m['file']}|{ch}|{f}"] = np.asarray(getattr(c, f)).astype(
                    np.int32 if f == "voxel" else np.float32)
    out.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(out, **arrays)


def rules(cache: Path, peaks_file: Path, d_min: float = 5.0, names: tuple[str, ...] = RULES) -> list[dict]:
    info = json.loads((cache / "meta.json").read_text())
    preset = PRESETS[info["preset"]]
    z = np.load(peaks_file)
    rows = []
    for m in tqdm(info["scans"], desc="rules", unit="scan"):
        aff = np.asarray(np.load(cache / m["file"])["affine"], np.float64)
        sp = np.linalg.norm(aff[:3, :3], axis=0)
        raw = {ch: Candidates(*(z[f"{m['file']}|{ch}|{f}"].astype(np.int64 if f == "voxel" else np.float64)
                                for f in ("voxel", "world", "radius_mm", "score")))
               for ch in ("S", "G")}
        centres, radii, mass = np.array(m["centres"]), np.array(m["radii"]), np.array(m["mass"])
        raw_on = {ch: on_rank(centres, radii, c) for ch, c in raw.items()}
        for rule in names:
            reach = reach_fn(rule, d_min)
            kept = {ch: suppress(c, sp, reach, 3000 if ch == "S" else 1000) for ch, c in raw.items()}
            onr = {ch: on_rank(centres, radii, c) for ch, c in kept.items()}
            merged = interleave_by({ch: c.top(128) for ch, c in kept.items()}, LesionDetector.pattern, sp, max(KS),
                                   reach)
            bag = lesion_ranks(centres, radii, mass, merged.voxel, merged.world, aff, preset.patch_size)
            for j, x in enumerate(m["lesions"]):
                rows.append({"scan": m["file"], "background": m["background"], "kind": x["kind"], "place": x["place"],
                             "diameter_mm": x["diameter_mm"], "gg_hu": x["gg_hu"], "core_frac": x["core_frac"],
                             "rule": rule, "raw_on_S": int(raw_on["S"][j]), "raw_on_G": int(raw_on["G"][j]),
                             "on_S": int(onr["S"][j]), "on_G": int(onr["G"][j]), "bag_rank": int(bag[j])})
    return rows


def table(rows: list[dict], pool: int = 64) -> str:
    lines = ["| rule | kind (target) | n | a peak on it before suppression (S, G) | on it after, in the channel's "
             f"first {pool} (S, G) | on it after, at all (S, G) | in the bag, K 16 | K 32 |",
             "|---|---|---|---|---|---|---|---|"]
    groups: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for x in rows:
        if target(x["kind"], float(x["diameter_mm"]), float(x["gg_hu"])):
            groups[(x["rule"], x["kind"])].append(x)
    for (rule, kind), t in sorted(groups.items(), key=lambda kv: (RULES.index(kv[0][0]), kv[0][1])):
        def n(f, t: list[dict] = t) -> int:
            return sum(bool(f(x)) for x in t)
        lines.append(
            f"| {rule} | {kind} | {len(t)} | {n(lambda x: int(x['raw_on_S']) > 0)}, "
            f"{n(lambda x: int(x['raw_on_G']) > 0)} | "
            f"{n(lambda x: 0 < int(x['on_S']) <= pool)}, {n(lambda x: 0 < int(x['on_G']) <= pool)} | "
            f"{n(lambda x: int(x['on_S']) > 0)}, {n(lambda x: int(x['on_G']) > 0)} | "
            + " | ".join(f"{n(lambda x, k=k: 0 < int(x['bag_rank']) <= k)}" for k in KS) + " |")
    return "\n".join(lines)


def mask_shares(cache: Path, rows_csv: Path, rule: str = "overlap", k: int = 16) -> list[dict]:
    """Per lesion at the targets' sizes: the share of its sphere inside the preprocessed lung mask and inside the
    solid channel's closed mask (where candidate centres may lie), whether its centre is inside the closed mask,
    and whether it is in the bag of ``k`` (the ``rules`` rows of ``rule``)."""
    info = json.loads((cache / "meta.json").read_text())
    with open(rows_csv, newline="") as f:
        by_scan: dict[str, list[dict]] = defaultdict(list)
        for x in csv.DictReader(f):
            if x["rule"] == rule:
                by_scan[x["scan"]].append(x)
    solid = LesionDetector()._channels()["S"]
    out = []
    for m in tqdm(info["scans"], desc="mask shares", unit="scan"):
        rows = by_scan[m["file"]]
        keep = [target(x["kind"], float(x["diameter_mm"]), float(x["gg_hu"])) for x in rows]
        if not any(keep):
            continue
        z = np.load(cache / m["file"])
        aff, lung = np.asarray(z["affine"], np.float64), z["lung"] > 0
        sp = np.linalg.norm(aff[:3, :3], axis=0)
        inner, _ = solid._masks(lung, sp)
        inv = np.linalg.inv(aff[:3, :3])
        grad = np.gradient(ndimage.gaussian_filter(lung.astype(np.float32), 6.0 / sp), *sp)  # 6 mm: the pleura's way
        for x, t, c, rad in zip(rows, keep, m["centres"], m["radii"]):
            if not t:
                continue
            v = (np.asarray(c) - aff[:3, 3]) @ inv.T
            lo = np.maximum(0, np.floor(v - rad / sp - 1)).astype(int)
            hi = np.minimum(lung.shape, np.ceil(v + rad / sp + 2)).astype(int)
            grid = np.indices(hi - lo).reshape(3, -1).T + lo
            pts = tuple(grid[np.linalg.norm((grid - v) * sp, axis=1) <= rad].T)
            cv = tuple(np.clip(np.rint(v).astype(int), 0, np.asarray(lung.shape) - 1))
            out.append({"scan": m["file"], "kind": x["kind"], "place": x["place"], "diameter_mm": x["diameter_mm"],
                        "in_bag": 0 < int(x["bag_rank"]) <= k, "raw_on_S": int(x["raw_on_S"]),
                        "raw_on_G": int(x["raw_on_G"]), "share_lung": round(float(lung[pts].mean()), 3),
                        "share_closed": round(float(inner[pts].mean()), 3), "centre_in_closed": bool(inner[cv]),
                        "pleura_z": _facing_z(grad, cv)})
    return out


def _facing_z(grad: list[np.ndarray], v: tuple[int, ...]) -> float:
    """How far the lung surface nearest ``v`` faces up or down: ``|n_z|`` of the unit normal of the smoothed lung
    mask at ``v`` (1: the pleura is the apex's or the diaphragm's, seen only in coronal and sagittal slices; 0:
    it faces sideways, a notch in the axial slice); NaN deep in the lung, where the smoothed mask is flat."""
    g = np.array([float(a[v]) for a in grad])
    n = float(np.linalg.norm(g))
    return round(abs(g[2]) / n, 2) if n > 1e-3 else float("nan")


def misses_table(rows: list[dict]) -> str:
    """Per kind at the targets' sizes: the misses, how many have their centre outside the closed mask, the median
    share of their sphere in the lung mask (against the found ones'), how many have no peak before suppression,
    and, of those against the pleura or the mediastinum, the median ``pleura_z`` and how many have their nearest pleura
    facing up or down more than sideways (the apex, the diaphragm, the corners; ``pleura_z`` >= 0.5)."""
    lines = ["| kind (target) | in the bag | misses | centre outside the closed mask | median share in the lung mask: "
             "misses / in the bag | misses with no peak on them in S / in G / in either | at the pleura or "
             "mediastinum: median pleura_z, n >= 0.5 of n: misses / in the bag |", "|---|---|---|---|---|---|---|"]
    for kind in sorted({x["kind"] for x in rows}):
        t = [x for x in rows if x["kind"] == kind]
        miss = [x for x in t if not x["in_bag"]]
        found = [x for x in t if x["in_bag"]]

        def med(xs: list[dict]) -> str:
            return f"{np.median([x['share_lung'] for x in xs]):.2f}" if xs else "-"

        def up(xs: list[dict]) -> str:
            z = np.array([float(x["pleura_z"]) for x in xs if x["place"] in ("pleura", "mediastinum")])
            z = z[np.isfinite(z)]
            return f"{np.median(z):.2f}, {int((z >= 0.5).sum())} of {len(z)}" if len(z) else "-"
        outside = sum(not x["centre_in_closed"] for x in miss)
        lines.append(f"| {kind} | {len(found)}/{len(t)} | {len(miss)} | {outside} | "
                     f"{med(miss)} / {med(found)} | {sum(x['raw_on_S'] == 0 for x in miss)} / "
                     f"{sum(x['raw_on_G'] == 0 for x in miss)} / "
                     f"{sum(x['raw_on_S'] == 0 and x['raw_on_G'] == 0 for x in miss)} | {up(miss)} / {up(found)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("peaks", help="each channel's peaks before suppression, per kept scan")
    p.add_argument("--cache", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--variant", default="shipped", choices=sorted(VARIANTS),
                   help="the lung mask's part: shipped; dilated (centres in the dilated mask); dilated8 (and 8 mm)")
    r = sub.add_parser("rules", help="the suppression rules over the kept peaks")
    r.add_argument("--cache", type=Path, required=True)
    r.add_argument("--peaks", type=Path, required=True)
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--rules", nargs="+", default=list(RULES), choices=RULES)
    ms = sub.add_parser("misses", help="where the misses lie against the lung mask")
    ms.add_argument("--cache", type=Path, required=True)
    ms.add_argument("--rows", type=Path, required=True, help="a rules CSV")
    ms.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)
    t = time.perf_counter()
    if a.cmd == "peaks":
        peaks(a.cache, a.out, a.variant)
        print(f"peaks in {time.perf_counter() - t:.0f} s -> {a.out}")
        return
    if a.cmd == "misses":
        rows = mask_shares(a.cache, a.rows)
    else:
        rows = rules(a.cache, a.peaks, names=tuple(a.rules))
    a.out.parent.mkdir(parents=True, exist_ok=True)
    with open(a.out, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    print(misses_table(rows) if a.cmd == "misses" else table(rows))
    print(f"{len(rows)} rows in {time.perf_counter() - t:.0f} s -> {a.out}")


if __name__ == "__main__":
    main()
