"""The lesion test bed: lesions inserted into real CTs, and what each detector puts in the bag.

For each background CT (a real scan, read once), lesions of every kind and place are planned
(:func:`lungcal.data.synthetic.insertion.plan_lesions`, a few to a scan, masses alone) and inserted
in HU on the scan's own grid; each inserted scan then goes through the pipeline's preprocessing
(lung mask, crop, resampling to the preset's voxels, HU window) in memory, and each detector's
candidates are scored per lesion (:func:`lungcal.candidates.sensitivity.lesion_ranks`: in the bag,
rank). A mass also records the share of its volume inside the lung mask the detector was given.

The real lesions of the backgrounds (the annotation files beside the shared scans) are scored the
same way on the scans as they are (:func:`real_lesions`, :func:`score_real`).

``lungcal lesion-bed`` runs it and prints the tables (:func:`sensitivity_table`).
"""
from __future__ import annotations

import csv
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from monai.data import MetaTensor

from lungcal.candidates.detector_config import detector_from_config
from lungcal.candidates.sensitivity import lesion_ranks, wilson_interval
from lungcal.ct.transforms import build_preprocess
from lungcal.data.synthetic.insertion import (
    KINDS,
    PLACES,
    Background,
    InsertedLesion,
    insert_lesions,
    load_background,
    plan_lesions,
)

__all__ = ["PRESETS", "Preset", "bed_rows", "real_lesions", "score_real", "score_scan", "sensitivity_table",
           "shared_backgrounds", "size_band", "summary"]


@dataclass(frozen=True)
class Preset:
    """The bag's geometry: voxel size (mm), K candidates, patches of P voxels."""

    name: str
    spacing: float
    k: int
    patch_size: int


#: the bag geometry of bundles/nlst_focal.json (``default``) and with bundles/fullres.json (``fullres``)
PRESETS = {"default": Preset("default", 2.5, 16, 16), "fullres": Preset("fullres", 1.0, 16, 32)}
#: the CT bundles' HU window (bundles/nlst_focal.json ``hu_window``), which the detectors see
HU_WINDOW = (-1000.0, 400.0)
#: size bands (mm) of the tables: nodules, then masses
BANDS = ((0, 6), (6, 8), (8, 10), (10, 15), (15, 20), (20, 30), (30, 45), (45, 70))


def size_band(d: float) -> str:
    for lo, hi in BANDS:
        if lo <= d < hi:
            return f"{lo}-{hi}"
    return f">={BANDS[-1][1]}"


@dataclass(frozen=True)
class RealLesion:
    """A lesion annotated on a real scan: centre (RAS mm), diameter (mm), and where it comes from."""

    case: str
    centre_ras: tuple[float, float, float]
    diameter_mm: float
    source: str


def _lps_to_ras(x: float | str, y: float | str, z: float | str) -> tuple[float, float, float]:
    return (-float(x), -float(y), float(z))


def real_lesions(case_dir: str | Path) -> list[RealLesion]:
    """The annotated lesions of one shared case folder (``../shared/data/ct/<case>``), from whichever
    of its annotation files it has: LIDC ``nodules_consensus.csv``, LUNA16 ``luna16_annotation.csv``,
    ``lesions.csv`` (RT structure bounding boxes), ``tumor_bboxes.csv`` (per-slice boxes)."""
    d = Path(case_dir)
    out: list[RealLesion] = []

    def rows(name: str) -> list[dict[str, str]]:
        with open(d / name, newline="") as fh:
            return list(csv.DictReader(fh))

    if (d / "nodules_consensus.csv").exists():
        for r in rows("nodules_consensus.csv"):
            out.append(RealLesion(d.name, _lps_to_ras(r["lps_x_mm"], r["lps_y_mm"], r["lps_z_mm"]),
                                  float(r["mean_max_xy_extent_mm"]), "nodules_consensus.csv"))
    if (d / "luna16_annotation.csv").exists():
        for r in rows("luna16_annotation.csv"):
            out.append(RealLesion(d.name, _lps_to_ras(r["coordX"], r["coordY"], r["coordZ"]),
                                  float(r["diameter_mm"]), "luna16_annotation.csv"))
    if (d / "lesions.csv").exists():
        for r in rows("lesions.csv"):
            ext = [float(r[f"lps_{a}max_mm"]) - float(r[f"lps_{a}min_mm"]) for a in "xyz"]
            out.append(RealLesion(d.name, _lps_to_ras(r["lps_x_mm"], r["lps_y_mm"], r["lps_z_mm"]),
                                  float(np.mean(ext)), f"lesions.csv ({r.get('roi', '')})"))
    if (d / "tumor_bboxes.csv").exists():  # one box per annotated slice: the lesion is their union
        rs = rows("tumor_bboxes.csv")
        if rs:
            x = [float(r[k]) for r in rs for k in ("lps_xmin_mm", "lps_xmax_mm")]
            y = [float(r[k]) for r in rs for k in ("lps_ymin_mm", "lps_ymax_mm")]
            z = [float(r["lps_z_mm"]) for r in rs]
            lo, hi = np.array([min(x), min(y), min(z)]), np.array([max(x), max(y), max(z)])
            out.append(RealLesion(d.name, _lps_to_ras(*((lo + hi) / 2)), float(np.mean((hi - lo)[:2])),
                                  "tumor_bboxes.csv"))
    return out


def _image_of(case_dir: Path) -> Path:
    nii = case_dir / "ct.nii.gz"
    return nii if nii.exists() else case_dir / "dicom"


def shared_backgrounds(ct_dir: str | Path, names: Sequence[str] | None = None) -> list[tuple[Path, list[RealLesion]]]:
    """``(image, real lesions)`` of the case folders under ``ct_dir`` (all, or ``names``)."""
    root = Path(ct_dir)
    cases = [root / n for n in names] if names else sorted(p for p in root.iterdir() if p.is_dir())
    return [(_image_of(c), real_lesions(c)) for c in cases]


def _preprocessed(hu: np.ndarray, bg: Background, preset: Preset, hu_window: Sequence[float]):
    img = MetaTensor(torch.from_numpy(np.ascontiguousarray(hu[None], np.float32)),
                     affine=torch.as_tensor(bg.affine))
    chain = build_preprocess((preset.spacing,) * 3, hu_window, load=False)
    out = chain({"image": img})
    image, lung = out["image"], out["lung_mask"]
    affine = np.asarray(image.affine.detach().cpu().numpy(), np.float64)
    return image, np.asarray(lung[0].detach().cpu().numpy()) > 0, affine


def _mask_share(lung: np.ndarray, affine: np.ndarray, centre: np.ndarray, radius: float) -> float:
    """The share of a sphere's volume inside ``lung`` (on the grid of ``affine``)."""
    sp = np.linalg.norm(affine[:3, :3], axis=0)
    c = (np.asarray(centre) - affine[:3, 3]) @ np.linalg.inv(affine[:3, :3]).T
    r = radius / sp
    lo = np.maximum(np.floor(c - r).astype(int), 0)
    hi = np.minimum(np.ceil(c + r).astype(int) + 1, lung.shape)
    if np.any(hi <= lo):
        return 0.0
    g = np.stack(np.meshgrid(*[np.arange(a, b) for a, b in zip(lo, hi)], indexing="ij"), -1)
    inside = np.linalg.norm((g - c) * sp, axis=-1) <= radius
    sub = lung[tuple(slice(a, b) for a, b in zip(lo, hi))]
    return float(sub[inside].mean()) if inside.any() else 0.0


def score_scan(hu: np.ndarray, bg: Background, centres: np.ndarray, radii: np.ndarray, is_mass: np.ndarray,
               detectors: Mapping[str, Any], preset: Preset,
               hu_window: Sequence[float] = HU_WINDOW) -> dict[str, dict[str, Any]]:
    """Preprocess one HU volume at ``preset`` and score each detector's candidates against the lesions:
    per detector ``{"rank": (L,), "n": candidates, "seconds": detection time, "mask_share": (L,)}``."""
    image, lung, affine = _preprocessed(hu, bg, preset, hu_window)
    spacing = np.linalg.norm(affine[:3, :3], axis=0)
    share = np.array([_mask_share(lung, affine, c, r) for c, r in zip(centres, radii)])
    res = {}
    for name, det in detectors.items():
        t = time.perf_counter()
        cands = det.detect(image, lung, spacing, affine)
        sec = time.perf_counter() - t
        ranks = lesion_ranks(centres, radii, is_mass, cands.voxel, cands.world, affine, preset.patch_size)
        res[name] = {"rank": ranks, "n": len(cands), "seconds": sec, "mask_share": share}
    return res


def _background(image: Path | Background, reals: Sequence[RealLesion]) -> Background:
    """``image`` read as a background (its real lesions kept clear of), or as it is when already read."""
    if isinstance(image, Background):
        return image
    return load_background(image, image.parent.name if image.name in ("ct.nii.gz", "dicom") else image.name,
                           [(r.centre_ras, r.diameter_mm / 2) for r in reals])


def bed_rows(backgrounds: Iterable[tuple[Path | Background, list[RealLesion]]],
             detectors: Mapping[str, Mapping[str, Any]], presets: Sequence[Preset],
             cells: Mapping[tuple[str, str], int], seed: int = 0, per_scan: int = 2,
             progress: Callable[[str], None] | None = None,
             on_scan: Callable[[Background, str, list[InsertedLesion]], None] | None = None
             ) -> Iterator[dict[str, Any]]:
    """One row per inserted lesion, preset and detector (see the module docstring); the ``cells``
    ({(kind, place): count}) are shared out over the backgrounds as evenly as they have room.
    ``detectors``: name -> detector config (``{"_target_": ...}`` or LoG keyword arguments).
    A background is a CT path (read here) or a :class:`Background` already read. ``on_scan(bg, scan,
    lesions)`` is called with each inserted scan's name and lesions (e.g. to write it)."""
    dets = {n: detector_from_config(dict(c)) for n, c in detectors.items()}
    bgs = list(backgrounds)
    rng = np.random.default_rng(seed)
    for b, (image, reals) in enumerate(bgs):
        share = {cell: n // len(bgs) + (1 if b < n % len(bgs) else 0) for cell, n in cells.items()}
        bg = _background(image, reals)
        scans = plan_lesions(bg, share, rng, per_scan=per_scan)
        for i, lesions in enumerate(scans):
            if on_scan is not None:
                on_scan(bg, f"{bg.name}-{i:03d}", lesions)
            hu = insert_lesions(bg, lesions)
            centres = np.array([x.centre_ras for x in lesions])
            radii = np.array([x.radius_mm for x in lesions])
            mass = np.array([x.kind == "mass" for x in lesions])
            for preset in presets:
                scored = score_scan(hu, bg, centres, radii, mass, dets, preset)
                for det, s in scored.items():
                    for j, x in enumerate(lesions):
                        yield _row(bg.name, f"{bg.name}-{i:03d}", x, preset, det, s, j)
            if progress:
                progress(f"{bg.name}: scan {i + 1}/{len(scans)}")
        del bg


def _row(bg: str, scan: str, x: InsertedLesion, preset: Preset, det: str, s: Mapping[str, Any], j: int) -> dict:
    rank = int(s["rank"][j])
    return {"background": bg, "scan": scan, "preset": preset.name, "detector": det, "kind": x.kind,
            "place": x.place, "diameter_mm": x.diameter_mm, "band": size_band(x.diameter_mm), "gg_hu": x.gg_hu,
            "core_frac": x.core_frac, "posterior": x.posterior, "rank": rank,
            "in_bag": bool(0 < rank <= preset.k), "n_candidates": int(s["n"]),
            "mask_share": round(float(s["mask_share"][j]), 3), "seconds": round(float(s["seconds"]), 3)}


def score_real(backgrounds: Iterable[tuple[Path | Background, list[RealLesion]]],
               detectors: Mapping[str, Mapping[str, Any]], presets: Sequence[Preset]) -> list[dict[str, Any]]:
    """The real lesions of the backgrounds, each on its own scan as it is: one row per lesion, preset
    and detector (rank, in the bag, candidates; lesions of 30 mm or more are judged as masses)."""
    dets = {n: detector_from_config(dict(c)) for n, c in detectors.items()}
    out = []
    for image, reals in backgrounds:
        if not reals:
            continue
        bg = image if isinstance(image, Background) else load_background(image, reals[0].case)
        centres = np.array([r.centre_ras for r in reals])
        radii = np.array([r.diameter_mm / 2 for r in reals])
        mass = np.array([r.diameter_mm >= 30 for r in reals])
        for preset in presets:
            for det, s in score_scan(bg.hu, bg, centres, radii, mass, dets, preset).items():
                for j, r in enumerate(reals):
                    rank = int(s["rank"][j])
                    out.append({"case": r.case, "lesion": r.source, "diameter_mm": round(r.diameter_mm, 1),
                                "preset": preset.name, "detector": det, "rank": rank,
                                "in_bag": bool(0 < rank <= preset.k), "n_candidates": int(s["n"]),
                                "mask_share": round(float(s["mask_share"][j]), 3)})
    return out


def _pct(k: int, n: int) -> str:
    if n == 0:
        return "-"
    lo, hi = wilson_interval(k, n)
    return f"{k}/{n} {100 * k / n:.0f} % [{100 * lo:.0f}, {100 * hi:.0f}]"


def sensitivity_table(rows: Sequence[Mapping[str, Any]], by: Sequence[str] = ("kind", "place"),
                      where: Callable[[Mapping[str, Any]], bool] | None = None) -> str:
    """A markdown table: per preset and detector (columns) and the ``by`` fields (rows), the lesions in
    the bag (count, share, Wilson 95 % CI), their median rank where reached."""
    sel = [r for r in rows if where is None or where(r)]
    cols = sorted({(r["preset"], r["detector"]) for r in sel})
    groups: dict[tuple, dict[tuple, list]] = defaultdict(lambda: defaultdict(list))
    for r in sel:
        groups[tuple(r[b] for b in by)][(r["preset"], r["detector"])].append(r)

    def order(key: tuple) -> tuple:
        ranks: list[Any] = []
        for b, v in zip(by, key):
            ref: Sequence[str] | None = {"kind": KINDS, "place": PLACES}.get(b)
            if ref and v in ref:
                ranks.append(ref.index(v))
            elif b == "band":
                ranks.append(float(str(v).split("-")[0].lstrip(">=")))
            else:
                ranks.append(v)
        return tuple(ranks)

    head = "| " + " | ".join(by) + " | " + " | ".join(f"{p} {d}" for p, d in cols) + " |"
    lines = [head, "|" + "---|" * (len(by) + len(cols))]
    for key in sorted(groups, key=order):
        cells = []
        for c in cols:
            rs = groups[key].get(c, [])
            k = sum(r["in_bag"] for r in rs)
            reached = [int(r["rank"]) for r in rs if int(r["rank"]) > 0]
            cells.append(_pct(k, len(rs)) + (f", rank {np.median(reached):g}" if reached else ""))
        lines.append("| " + " | ".join(str(v) for v in key) + " | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def summary(rows: Sequence[Mapping[str, Any]]) -> dict[tuple[str, str], dict[str, float]]:
    """Per (preset, detector): candidates per scan (median), detection seconds per scan (median)."""
    per: dict[tuple[str, str], dict[str, dict[str, Any]]] = defaultdict(dict)
    for r in rows:
        per[(r["preset"], r["detector"])][r["scan"]] = dict(r)
    return {k: {"scans": len(v), "candidates_median": float(np.median([r["n_candidates"] for r in v.values()])),
                "seconds_median": float(np.median([r["seconds"] for r in v.values()]))} for k, v in per.items()}
