"""The ground-glass channel's slots and gate (issue 43 item 3): which interleave ``pattern`` and which
``GlassChannel.min_score`` keep ground glass in the bag and give the solid CPM on phantoms back?

:class:`~lungcal.candidates.lesions.LesionDetector` interleaves a solid and a ground-glass ranking. On a CT
without ground glass the ground-glass channel's best blobs are false positives that take their slots, so
with ``SG`` and place-counted scores the solid CPM on phantoms fell from 0.903 to 0.689 (docs/results.md,
2026-12-06). Two knobs: the pattern (how early the first ground-glass slot comes) and a gate on the channel's
own score (``min_score``), which lets it return nothing where nothing is ground-glass-like. This script runs
each channel once per CT with no gate of its own, then for each pattern and gate (the merged ranking scored
by the solid channel, ``interleave(..., reference="S")``):

- **phantoms** (synthetic cohorts, ``lungcal synth``): per nodule type, the share in the bag (K 8) and the
  CPM with its 95 % CI over CTs (as ``experiments/nodule_types.py``);
- **the lesion bed** (lesions inserted into the real CTs of ``../shared/data/ct`` that pass the series
  checks, :mod:`lungcal.ctapp.evaluate.lesion_bed`, default preset): in the bag per kind at the issue's
  target sizes, and the candidates of the ground-glass channel left per CT.

    lungcal synth --out runs/phantoms/classic --n 60 --seed 34 --formats nifti
    lungcal synth --out runs/phantoms/even --n 60 --seed 34 --formats nifti --nodule-types even
    python experiments/glass_gate.py --phantoms runs/phantoms/classic/datalist.json runs/phantoms/even/datalist.json \
        --patterns SG SSG SSSG --gates 0.04 0.06 0.08 0.1 0.12 --out runs/glass_gate_ph
    python experiments/glass_gate.py --bed ../shared/data/ct --seed 11 --per-cell 12 \
        --patterns SG SSG SSSG --gates 0.04 0.06 0.08 0.1 0.12 --out runs/glass_gate_bed

The tuning draw is ``--seed 11``; the lesion bed's tables in docs/results.md use seed 0.
"""
from __future__ import annotations

import argparse
import csv
import importlib.util
import json
from collections import defaultdict
from pathlib import Path

import numpy as np
from tqdm import tqdm

from lungcal.candidates.detector import Candidates
from lungcal.candidates.lesions import LesionDetector, interleave
from lungcal.candidates.sensitivity import lesion_ranks
from lungcal.ct.transforms import preprocess_ct
from lungcal.ctapp.evaluate.lesion_bed import PRESETS, _background, _preprocessed
from lungcal.ctapp.evaluate.lesion_bed_run import find_backgrounds
from lungcal.data.manifest import load_manifest
from lungcal.data.synthetic.insertion import insert_lesions, plan_lesions

_spec = importlib.util.spec_from_file_location("nodule_types", Path(__file__).with_name("nodule_types.py"))
assert _spec is not None and _spec.loader is not None
nodule_types = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(nodule_types)

GATES = (None, 0.04, 0.06, 0.08, 0.10, 0.12, 0.15, 0.20, float("inf"))  # inf: the solid channel alone
K = 8


def _gated(glass: Candidates, gate: float | None) -> Candidates:
    if gate is None:
        return glass
    keep = glass.score >= gate
    return Candidates(glass.voxel[keep], glass.world[keep], glass.radius_mm[keep], glass.score[keep])


class Channels:
    """Runs both channels of a :class:`LesionDetector` once per CT (gate off) and keeps their lists."""

    def __init__(self, top_k: int = 32) -> None:
        self.det = LesionDetector(hu_window=nodule_types.BAG["hu_window"], top_k=top_k, glass={"min_score": None})

    def raw(self, image, mask, spacing, affine) -> tuple[Candidates, Candidates, float]:
        ch = self.det._channels()
        solid = ch["S"].detect(image, mask, spacing, affine)
        glass = ch["G"].detect(image, mask, spacing, affine)
        return solid, glass, float(ch["S"].min_distance_mm)


PATTERNS = ["SG"]


def merged(solid: Candidates, glass: Candidates, gate: float | None, spacing, min_d: float, top_k: int = 32,
           pattern: str = "SG") -> Candidates:
    return interleave({"S": solid, "G": _gated(glass, gate)}, pattern, spacing, top_k, min_d, reference="S")


def phantoms(datalists: list[Path], out: Path) -> list[dict]:
    ch = Channels()
    rows = []
    for dl in datalists:
        manifest = load_manifest(dl, check_files=False)
        truth = nodule_types._truth(dl.parent / "annotations.csv")
        cached = []
        for r in tqdm(manifest, desc=f"phantoms {dl.parent.name}", unit="CT"):
            o = preprocess_ct(dl.parent / r["image"], **nodule_types.BAG)
            aff = np.asarray(o["image"].affine, np.float64)
            sp = np.linalg.norm(aff[:3, :3], axis=0)
            solid, glass, min_d = ch.raw(np.asarray(o["image"][0]), np.asarray(o["lung_mask"][0]), sp, aff)
            cached.append((solid, glass, sp, min_d, truth.get(r["ct"], [])))
        for pattern, gate in [(p, g) for p in PATTERNS for g in GATES]:
            rng = np.random.default_rng(0)
            scans, per_type = [], defaultdict(lambda: [0, 0])
            n_glass = []
            for solid, glass, sp, min_d, nods in cached:
                c = merged(solid, glass, gate, sp, min_d, pattern=pattern)
                n_glass.append(len(_gated(glass, gate)))
                scans.append((c.world, c.score, nods))
                for n, (_hit, rank, _) in zip(nods, nodule_types._score(c, nods)):
                    per_type[n["type"]][0] += int(0 < rank <= K)
                    per_type[n["type"]][1] += 1
            for kind, (inb, tot) in sorted(per_type.items()):
                cpm, lo, hi = nodule_types._type_cpm(scans, kind, rng)
                rows.append({"cohort": dl.parent.name, "pattern": pattern, "gate": gate, "type": kind, "n": tot,
                             "in_bag": inb,
                             "cpm": round(cpm, 3), "cpm_lo": round(lo, 3), "cpm_hi": round(hi, 3),
                             "glass_per_ct": round(float(np.mean(n_glass)), 2)})
                print(rows[-1], flush=True)
    return rows


def target(kind: str, d: float, gg_hu: float | None) -> bool:
    if kind in ("solid", "part-solid"):
        return d >= 8
    if kind == "ground-glass":
        return d >= 10 and gg_hu is not None and gg_hu >= -700
    return True


def bed(ct_dir: Path, seed: int, per_cell: int) -> list[dict]:
    """The lesion bed's draw (as :func:`~lungcal.ctapp.evaluate.lesion_bed.bed_rows`), each inserted scan
    through the default preset's preprocessing, both channels once, then every gate."""
    ch = Channels()
    bgs, _ = find_backgrounds(ct_dir)  # the CTs that pass the series checks (not the 8 mm one)
    cells = {(k, p): per_cell for k in ("solid", "part-solid", "ground-glass", "mass")
             for p in ("free", "pleura", "mediastinum", "vessel")}
    preset = PRESETS["default"]
    rng = np.random.default_rng(seed)
    cached = []
    for b, (image, reals) in enumerate(bgs):
        share = {cell: n // len(bgs) + (1 if b < n % len(bgs) else 0) for cell, n in cells.items()}
        bg = _background(image, reals)
        for lesions in tqdm(plan_lesions(bg, share, rng, per_scan=2), desc=f"bed {bg.name}", unit="scan"):
            hu = insert_lesions(bg, lesions)
            img, lung, aff = _preprocessed(hu, bg, preset, nodule_types.BAG["hu_window"])
            sp = np.linalg.norm(aff[:3, :3], axis=0)
            solid, glass, min_d = ch.raw(np.asarray(img).squeeze(), np.asarray(lung).squeeze(), sp, aff)
            cached.append((bg.name, lesions, solid, glass, aff, min_d))
    rows = []
    for pattern, gate in [(p, g) for p in PATTERNS for g in GATES]:
        for name, lesions, solid, glass, aff, min_d in cached:
            sp = np.linalg.norm(aff[:3, :3], axis=0)
            c = merged(solid, glass, gate, sp, min_d, pattern=pattern)
            ranks = lesion_ranks(np.array([x.centre_ras for x in lesions]), np.array([x.radius_mm for x in lesions]),
                                 np.array([x.kind == "mass" for x in lesions]), c.voxel, c.world, aff,
                                 preset.patch_size)
            g = _gated(glass, gate)
            best = lesion_ranks(np.array([x.centre_ras for x in lesions]), np.array([x.radius_mm for x in lesions]),
                                np.array([x.kind == "mass" for x in lesions]), g.voxel, g.world, aff,
                                preset.patch_size)
            for x, r, rg in zip(lesions, ranks, best):
                rows.append({"pattern": pattern, "gate": gate, "background": name, "kind": x.kind, "place": x.place,
                             "diameter_mm": x.diameter_mm, "gg_hu": x.gg_hu,
                             "target": target(x.kind, x.diameter_mm, x.gg_hu),
                             "rank": int(r), "in_bag": bool(0 < r <= preset.k),
                             "glass_score": float(g.score[rg - 1]) if rg else None,
                             "glass_per_ct": len(g)})
    for pattern, gate in [(p, g) for p in PATTERNS for g in GATES]:
        sel = [r for r in rows if r["pattern"] == pattern and r["gate"] == gate and r["target"]]
        by = defaultdict(lambda: [0, 0])
        for r in sel:
            by[r["kind"]][0] += r["in_bag"]
            by[r["kind"]][1] += 1
        print(pattern, gate, {k: f"{a}/{n}" for k, (a, n) in sorted(by.items())}, flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--phantoms", nargs="*", type=Path, default=[])
    ap.add_argument("--bed", type=Path, default=None)
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument("--per-cell", type=int, default=12)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--patterns", nargs="+", default=PATTERNS, help="interleave patterns to try (S solid, G glass)")
    ap.add_argument("--gates", nargs="+", type=float, default=None, help="gates to try (default: the sweep)")
    a = ap.parse_args()
    PATTERNS[:] = a.patterns
    if a.gates:
        global GATES
        GATES = (None, *a.gates)
    a.out.mkdir(parents=True, exist_ok=True)
    if a.phantoms:
        rows = phantoms(a.phantoms, a.out)
        with open(a.out / "phantoms.csv", "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    if a.bed:
        rows = bed(a.bed, a.seed, a.per_cell)
        (a.out / "bed.json").write_text(json.dumps(rows))


if __name__ == "__main__":
    main()
