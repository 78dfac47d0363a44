"""Detector settings against the lesion bed's subsolid misses (issue 43 item 3): does any setting of the
ground-glass channel, or contrast against the local lung background, bring more part-solid and
ground-glass nodules into the default bag?

Inserting lesions and preprocessing dominate a lesion-bed run, so this script does both once: ``build``
draws the lesion bed (as :func:`~lungcal.ctapp.evaluate.lesion_bed.bed_rows`: the same planner, seed and
backgrounds, the kinds asked for) and keeps each inserted scan as the default preset preprocessed it;
``score`` runs each named detector on the kept scans and prints the share in the K = 16 bag at the
issue's target sizes (part-solid and solid >= 8 mm, ground glass >= 10 mm at -700 HU or denser, masses),
per kind and place, and writes one row per lesion and detector.

Detectors are given as in ``lungcal lesion-bed --detector``: a JSON object of a detector's config. Besides
the library's, :class:`LocalContrastLesionDetector` (this file) is the shipped detector whose ground-glass
channel subtracts the local lung level (a Gaussian mean over the lung of ``background_mm``, optionally of
the image clipped at ``clip_hu`` above the lung's median, so the lesion itself does not raise it) before
the window.

    python experiments/glass_variants.py build --ct-dir ../shared/data/ct --seed 11 \\
        --kinds part-solid ground-glass --out runs/glass_variants/seed11
    python experiments/glass_variants.py score --cache runs/glass_variants/seed11 --variants VARIANTS.json \\
        --out runs/glass_variants/seed11_rows.csv

``VARIANTS.json`` maps a name to a detector config, e.g. ``{"shipped": {"_target_":
"lungcal.candidates.lesions.LesionDetector"}, "bg12": {"_target_": "glass_variants.LocalContrastLesionDetector",
"glass": {"background_mm": 12}}}`` (this folder is put on the import path). The tuning draw is ``--seed 11``;
the lesion bed's tables in docs/results.md use seed 0.
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import sys
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from scipy import ndimage
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))  # variants name classes of this file

from lungcal.candidates.detector import Candidates, LoGBlobDetector, MaskMemo, _as_volume  # noqa: E402
from lungcal.candidates.detector_config import detector_from_config  # noqa: E402
from lungcal.candidates.lesions import (  # noqa: E402
    SOLID_PYRAMID_SIGMA_VOX,
    SOLID_RADII_MM,
    GlassChannel,
    LesionDetector,
    _coarse,
    _fill_dense,
    interleave,
    median_filter,
)
from lungcal.candidates.sensitivity import lesion_ranks  # noqa: E402
from lungcal.ct.transforms import preprocess_ct  # noqa: E402
from lungcal.ctapp.evaluate.lesion_bed import HU_WINDOW, PRESETS, _background, _preprocessed  # noqa: E402
from lungcal.ctapp.evaluate.lesion_bed_run import cells_of, find_backgrounds  # noqa: E402
from lungcal.data.manifest import load_manifest  # noqa: E402
from lungcal.data.synthetic.insertion import insert_lesions, plan_lesions  # noqa: E402
from lungcal.runtime.parallel import gaussian_filter_  # noqa: E402


@dataclass
class LocalContrastGlass(GlassChannel):
    """:class:`GlassChannel` with the local lung level taken out before the window (module docstring)."""

    background_mm: float = 0.0
    clip_hu: float | None = None
    dense_grow: int = 1  # the dense voxels are grown by this many voxels before the fill (shipped: 1)

    def detect(self, image, lung_mask, spacing, affine, *, memo=None) -> Candidates:
        vol = _as_volume(image).astype(np.float32, copy=False)
        mask = _as_volume(lung_mask) > 0
        sp = np.asarray(spacing, np.float64).reshape(3)
        affine = np.asarray(affine, np.float64)
        lo, hi = self.hu_window
        small, m, step = _coarse(vol, mask, sp, self.grid_mm)
        hu = small * np.float32(hi - lo) + np.float32(lo)
        gsp = sp * step
        size = np.maximum(1, np.round(self.median_mm / gsp).astype(np.int64)) | 1
        med = median_filter(hu, tuple(int(s) for s in size)) if (size > 1).any() else hu
        dense = med > np.float32(self.dense_hu)
        if self.dense_grow > 0:
            dense = ndimage.binary_dilation(dense, iterations=self.dense_grow)
        rest = m & ~dense
        level = float(np.median(med[rest])) if rest.any() else float(self.window_hu[0])
        glass = _fill_dense(med, dense, self.fill_sigma_mm / gsp, level)
        if self.background_mm > 0:
            src = glass if self.clip_hu is None else np.minimum(glass, np.float32(level + self.clip_hu))
            w = m.astype(np.float32)
            s = self.background_mm / gsp
            num = gaussian_filter_(src * w, s, mode="reflect", truncate=2.5)
            den = gaussian_filter_(w, s, mode="reflect", truncate=2.5)
            local = np.where(den > 0.05, num / np.maximum(den, np.float32(0.05)), np.float32(level))
            glass = (glass - local + np.float32(level)).astype(np.float32)
        glo, ghi = self.window_hu
        np.clip((glass - np.float32(glo)) / np.float32(ghi - glo), 0, 1, out=glass)
        gaff = affine.copy()
        gaff[:3, :3] = affine[:3, :3] * step[None, :]
        gaff[:3, 3] = affine[:3, 3] + affine[:3, :3] @ ((step - 1) / 2.0)
        found = LoGBlobDetector(**{**self.log, "radii_mm": self.radii_mm, "top_k": self.top_k}).detect(
            glass, m, gsp, gaff, memo=memo)
        vox = np.rint((found.world - affine[:3, 3]) @ np.linalg.inv(affine[:3, :3]).T).astype(np.int64)
        vox = np.clip(vox.reshape(-1, 3), 0, np.asarray(vol.shape) - 1)
        return Candidates(vox, found.world, found.radius_mm, found.score)


@dataclass
class LocalContrastLesionDetector(LesionDetector):
    """The shipped :class:`LesionDetector` with :class:`LocalContrastGlass` as its ground-glass channel."""

    def _channels(self) -> dict:
        solid = {"radii_mm": SOLID_RADII_MM, "pyramid_sigma_vox": SOLID_PYRAMID_SIGMA_VOX, **self.solid}
        return {"S": LoGBlobDetector(**{**solid, "top_k": self.top_k}),
                "G": LocalContrastGlass(**{**self.glass, "hu_window": self.hu_window, "top_k": self.top_k})}


def shell_bright_fraction(hu: np.ndarray, lung: np.ndarray, vox: np.ndarray, radius_mm: np.ndarray,
                          spacing: np.ndarray, level: float, inner: float = 0.5,
                          shell: tuple[float, float] = (1.5, 2.0), min_shell_mm: float = 2.5) -> np.ndarray:
    """Per candidate, the share of its surroundings that is as dense as itself: of the lung voxels on a shell
    ``shell`` times its radius (at least ``min_shell_mm`` thick) around its centre, those above half-way between
    the lung level and the candidate's interior (the mean within ``inner`` times its radius). A vessel crossing's
    branches leave through the shell; a nodule's shell is lung, whatever wall it lies against (the wall is not
    lung). NaN where the shell holds no lung voxel."""
    out = np.full(len(vox), np.nan)
    shape = np.asarray(hu.shape)
    for i, (v, r) in enumerate(zip(vox, radius_mm)):
        r1, r2 = shell[0] * r, max(shell[1] * r, shell[0] * r + min_shell_mm)
        h = np.ceil(r2 / spacing).astype(np.int64) + 1
        lo, hi = np.maximum(v - h, 0), np.minimum(v + h + 1, shape)
        sl = tuple(slice(int(a), int(b)) for a, b in zip(lo, hi))
        grid = np.meshgrid(*[(np.arange(a, b) - c) * s for a, b, c, s in zip(lo, hi, v, spacing)], indexing="ij")
        d = np.sqrt(sum(g * g for g in grid))
        crop = hu[sl]
        core = crop[d <= max(inner * r, 0.6 * float(spacing.min()))]
        ring = crop[(d >= r1) & (d <= r2) & lung[sl]]
        if len(core) == 0 or len(ring) == 0:
            continue
        cut = 0.5 * (float(core.mean()) + level)
        out[i] = float((ring > cut).mean()) if cut > level else 1.0
    return out


@dataclass
class ShellLesionDetector(LesionDetector):
    """The shipped :class:`LesionDetector` with each channel's best ``pool`` re-ranked by what surrounds each
    candidate: its score times ``(1 - f) ** power``, ``f`` the :func:`shell_bright_fraction` (a vessel
    crossing's branches leave through its shell; a nodule's shell is lung), then interleaved as shipped."""

    pool: int = 64
    power: float = 1.0
    shell: Sequence[float] = (1.5, 2.0)
    inner: float = 0.5
    channels_: str = "SG"  # the channels re-ranked

    def pools(self, image, lung_mask, spacing, affine, pool: int | None = None) -> dict[str, Candidates]:
        """Each channel's best ``pool`` candidates, as shipped."""
        vol = _as_volume(image).astype(np.float32, copy=False)
        mask = _as_volume(lung_mask) > 0
        sp = np.asarray(spacing, np.float64).reshape(3)
        chans = {k: dataclasses.replace(d, top_k=pool or self.pool) for k, d in self._channels().items()}
        memo = MaskMemo()
        return {ch: det.detect(vol, mask, sp, affine, memo=memo) for ch, det in chans.items()}

    def rerank(self, lists: dict[str, Candidates], image, lung_mask, spacing) -> Candidates:
        """The channels' candidates (their best ``pool``) re-scored by their shells, interleaved."""
        vol = _as_volume(image).astype(np.float32, copy=False)
        mask = _as_volume(lung_mask) > 0
        sp = np.asarray(spacing, np.float64).reshape(3)
        lo, hi = self.hu_window
        hu = vol * np.float32(hi - lo) + np.float32(lo)
        level = float(np.median(hu[mask])) if mask.any() else -860.0
        lists = {ch: c.top(self.pool) for ch, c in lists.items()}
        for ch in self.channels_:
            c = lists[ch]
            if len(c) == 0:
                continue
            f = shell_bright_fraction(hu, mask, c.voxel, c.radius_mm, sp, level, inner=self.inner,
                                      shell=tuple(self.shell))
            f = np.nan_to_num(f, nan=0.0)
            s = c.score * (1.0 - f) ** self.power
            o = np.argsort(-s, kind="stable")
            lists[ch] = Candidates(c.voxel[o], c.world[o], c.radius_mm[o], s[o])
        min_d = float(self._channels()["S"].min_distance_mm)
        return interleave(lists, self.pattern, sp, self.top_k, min_d, reference="S")

    def detect(self, image, lung_mask, spacing, affine) -> Candidates:
        return self.rerank(self.pools(image, lung_mask, spacing, affine), image, lung_mask, spacing)


def lesion_rows(m: dict, variant: str, c: Candidates, aff: np.ndarray, preset) -> list[dict]:
    """One row per lesion of the kept scan ``m``: its rank in the candidates ``c`` and whether it is in the bag."""
    ranks = lesion_ranks(np.array(m["centres"]), np.array(m["radii"]), np.array(m["mass"]), c.voxel, c.world, aff,
                         preset.patch_size)
    return [{"variant": variant, "background": m["background"], "scan": m["file"], "kind": x["kind"],
             "place": x["place"], "diameter_mm": x["diameter_mm"], "gg_hu": x["gg_hu"], "core_frac": x["core_frac"],
             "rank": int(r), "in_bag": bool(0 < r <= preset.k)} for x, r in zip(m["lesions"], ranks)]


def rerank_rows(cache: Path, settings: dict[str, dict], pool: int = 128) -> list[dict]:
    """As :func:`score` for :class:`ShellLesionDetector` settings (name -> its keyword arguments), with each
    scan's channels run once (their best ``pool``) and only the re-ranking per setting."""
    info = json.loads((cache / "meta.json").read_text())
    preset = PRESETS[info["preset"]]
    dets = {n: ShellLesionDetector(**c) for n, c in settings.items()}
    base = ShellLesionDetector()
    rows = []
    for m in tqdm(info["scans"], desc="rerank", unit="scan"):
        z = np.load(cache / m["file"])
        img, lung, aff = z["image"], z["lung"] > 0, z["affine"]
        sp = np.linalg.norm(aff[:3, :3], axis=0)
        lists = base.pools(img, lung, sp, aff, pool=pool)
        for name, det in dets.items():
            c = det.rerank(lists, img, lung, sp).top(preset.k)
            rows += lesion_rows(m, name, c, aff, preset)
    return rows


def target(kind: str, d: float, gg_hu: float) -> bool:
    """The lesions item 3's targets count."""
    if kind in ("solid", "part-solid"):
        return d >= 8
    if kind == "ground-glass":
        return d >= 10 and gg_hu >= -700
    return kind == "mass"


def build(ct_dir: Path, seed: int, kinds: list[str], per_cell: int, out: Path, preset: str = "default") -> None:
    """Draw the bed and keep each inserted scan, preprocessed at ``preset``, under ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    bgs, _ = find_backgrounds(ct_dir)
    cells = cells_of(kinds, None, per_cell)
    rng = np.random.default_rng(seed)
    meta = []
    for b, (image, reals) in enumerate(bgs):
        share = {c: n // len(bgs) + (1 if b < n % len(bgs) else 0) for c, n in cells.items()}
        bg = _background(image, reals)
        for i, lesions in enumerate(tqdm(plan_lesions(bg, share, rng, per_scan=2), desc=bg.name, unit="scan")):
            img, lung, aff = _preprocessed(insert_lesions(bg, lesions), bg, PRESETS[preset], HU_WINDOW)
            name = f"{bg.name}-{i:03d}.npz"
            np.savez(out / name, image=np.asarray(img[0]), lung=lung, affine=aff)
            meta.append({"file": name, "background": bg.name, "lesions": [x.row() for x in lesions],
                         "centres": [[float(v) for v in x.centre_ras] for x in lesions],
                         "radii": [float(x.radius_mm) for x in lesions], "mass": [x.kind == "mass" for x in lesions]})
    (out / "meta.json").write_text(json.dumps({"seed": seed, "preset": preset, "scans": meta}))


def score(cache: Path, variants: dict[str, dict]) -> list[dict]:
    """One row per kept lesion and variant: its rank in the variant's candidates and whether it is in the bag."""
    info = json.loads((cache / "meta.json").read_text())
    preset = PRESETS[info["preset"]]
    dets = {n: detector_from_config(dict(c)) for n, c in variants.items()}
    rows = []
    for m in tqdm(info["scans"], desc="score", unit="scan"):
        z = np.load(cache / m["file"])
        img, lung, aff = z["image"], z["lung"], z["affine"]
        sp = np.linalg.norm(aff[:3, :3], axis=0)
        for name, det in dets.items():
            c = det.detect(img[None], lung, sp, aff)
            rows += lesion_rows(m, name, c, aff, preset)
    return rows


#: the bag sizes the ``channels`` summary reads off the merged ranking
KS = (16, 32, 64, 128)


def channels(cache: Path, solid_k: int = 3000, glass_k: int = 1000) -> list[dict]:
    """One row per kept lesion: its rank in the shipped detector's solid channel alone (its best ``solid_k``),
    in its ground-glass channel alone (best ``glass_k``), and in the merged ranking (``SSSG``) of their best
    ``max(KS)`` each, so that a larger K or more ground-glass slots can be read off without a rerun."""
    info = json.loads((cache / "meta.json").read_text())
    preset = PRESETS[info["preset"]]
    chans = LesionDetector()._channels()
    rows = []
    for m in tqdm(info["scans"], desc="channels", unit="scan"):
        z = np.load(cache / m["file"])
        img, lung, aff = z["image"], z["lung"] > 0, z["affine"]
        sp = np.linalg.norm(aff[:3, :3], axis=0)
        memo = MaskMemo()
        s = dataclasses.replace(chans["S"], top_k=solid_k).detect(img, lung, sp, aff, memo=memo)
        g = dataclasses.replace(chans["G"], top_k=glass_k).detect(img, lung, sp, aff, memo=memo)
        merged = interleave({"S": s.top(max(KS)), "G": g.top(max(KS))}, LesionDetector.pattern, sp, max(KS),
                            float(chans["S"].min_distance_mm), reference="S")
        les = (np.array(m["centres"]), np.array(m["radii"]), np.array(m["mass"]))
        ranks = [lesion_ranks(*les, c.voxel, c.world, aff, preset.patch_size) for c in (s, g, merged)]
        for x, rs, rg, rm in zip(m["lesions"], *ranks):
            rows.append({"background": m["background"], "scan": m["file"], "kind": x["kind"], "place": x["place"],
                         "diameter_mm": x["diameter_mm"], "gg_hu": x["gg_hu"], "core_frac": x["core_frac"],
                         "rank_solid": int(rs), "rank_glass": int(rg), "rank_merged": int(rm)})
    return rows


def phantoms(datalists: list[Path], variants: dict[str, dict]) -> list[dict]:
    """Per synthetic cohort, variant and nodule type: in the bag (K 8, as the phantom tables) and the CPM with
    its 95 % CI over CTs (``experiments/nodule_types.py``): the solid CPM must not fall by more than its CI."""
    import nodule_types  # noqa: PLC0415 (experiments/nodule_types.py, on the path set above)

    dets = {n: detector_from_config(dict(c)) for n, c in variants.items()}
    rows = []
    for dl in datalists:
        truth = nodule_types._truth(dl.parent / "annotations.csv")
        scans: dict[str, list] = {n: [] for n in dets}
        per: dict[tuple, list[int]] = defaultdict(lambda: [0, 0])
        for r in tqdm(load_manifest(dl, check_files=False), desc=f"phantoms {dl.parent.name}", unit="CT"):
            o = preprocess_ct(dl.parent / r["image"], **nodule_types.BAG)
            aff = np.asarray(o["image"].affine, np.float64)
            sp = np.linalg.norm(aff[:3, :3], axis=0)
            nods = truth.get(r["ct"], [])
            for name, det in dets.items():
                c = det.detect(o["image"], o["lung_mask"], sp, aff)
                scans[name].append((c.world, c.score, nods))
                for n, (_hit, rank, _) in zip(nods, nodule_types._score(c, nods)):
                    per[(name, n["type"])][0] += int(0 < rank <= nodule_types.K)
                    per[(name, n["type"])][1] += 1
        for name in dets:
            for kind in sorted({k for v, k in per if v == name}):
                cpm, lo, hi = nodule_types._type_cpm(scans[name], kind, np.random.default_rng(0))
                inb, tot = per[(name, kind)]
                rows.append({"cohort": dl.parent.name, "variant": name, "type": kind, "n": tot, "in_bag": inb,
                             "cpm": round(cpm, 3), "cpm_lo": round(lo, 3), "cpm_hi": round(hi, 3)})
    return rows


def channels_table(rows: list[dict], k: int = 16) -> str:
    """Per kind, at the target sizes: in the bag of K = 16, 32, 64, 128 (the merged ranking), and where the
    misses at ``k`` rank in each channel alone (median; within the channel's first 16 and 64; not found)."""
    lines = ["| kind | " + " | ".join(f"K {n}" for n in KS) + f" | misses at K {k} | their solid rank: median, "
             "<= 64, none | their ground-glass rank: median, <= 16, <= 64, none |", "|---|" + "---|" * (len(KS) + 3)]
    for kind in sorted({x["kind"] for x in rows}):
        t = [x for x in rows if x["kind"] == kind and target(kind, float(x["diameter_mm"]), float(x["gg_hu"]))]
        if not t:
            continue
        ins = [f"{sum(0 < int(x['rank_merged']) <= n for x in t)}/{len(t)}" for n in KS]
        miss = [x for x in t if not 0 < int(x["rank_merged"]) <= k]

        def desc(key: str, cuts: tuple[int, ...], miss: list[dict] = miss) -> str:
            r = np.array([int(x[key]) for x in miss])
            found = r[r > 0]
            med = f"{np.median(found):.0f}" if len(found) else "-"
            return ", ".join([med, *(str(int(((r > 0) & (r <= c)).sum())) for c in cuts), str(int((r == 0).sum()))])
        lines.append(f"| {kind} | " + " | ".join(ins) + f" | {len(miss)} | {desc('rank_solid', (64,))} | "
                     f"{desc('rank_glass', (16, 64))} |")
    return "\n".join(lines)


def table(rows: list[dict]) -> str:
    """In the bag at the target sizes, per variant x kind (all places, then each place)."""
    count: dict[tuple, list[int]] = defaultdict(lambda: [0, 0])
    for x in rows:
        if not target(x["kind"], float(x["diameter_mm"]), float(x["gg_hu"])):
            continue
        for place in ("all", x["place"]):
            count[(x["variant"], x["kind"], place)][0] += bool(x["in_bag"])
            count[(x["variant"], x["kind"], place)][1] += 1
    places = ("all", "free", "pleura", "mediastinum", "vessel")
    kinds = sorted({k for _, k, _ in count})
    lines = ["| variant | kind | " + " | ".join(places) + " |", "|---|---|" + "---|" * len(places)]
    for v in dict.fromkeys(x["variant"] for x in rows):
        for k in kinds:
            cells = [f"{count[(v, k, p)][0]}/{count[(v, k, p)][1]}" for p in places]
            lines.append(f"| {v} | {k} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="draw the bed and keep its preprocessed scans")
    b.add_argument("--ct-dir", type=Path, default=Path("../shared/data/ct"))
    b.add_argument("--seed", type=int, default=11)
    b.add_argument("--kinds", nargs="+", default=["part-solid", "ground-glass"])
    b.add_argument("--per-cell", type=int, default=30)
    b.add_argument("--preset", default="default", choices=sorted(PRESETS))
    b.add_argument("--out", type=Path, required=True)
    s = sub.add_parser("score", help="run detector variants on the kept scans")
    s.add_argument("--cache", type=Path, required=True)
    s.add_argument("--variants", type=Path, required=True, help="JSON: name -> detector config")
    s.add_argument("--out", type=Path, required=True, help="rows CSV")
    ph = sub.add_parser("phantoms", help="in the bag and the CPM per nodule type on synthetic cohorts")
    ph.add_argument("datalists", nargs="+", type=Path, help="lungcal synth cohorts' datalist.json")
    ph.add_argument("--variants", type=Path, required=True, help="JSON: name -> detector config")
    ph.add_argument("--out", type=Path, required=True, help="rows CSV")
    rr = sub.add_parser("rerank", help="ShellLesionDetector settings on the kept scans, channels run once")
    rr.add_argument("--cache", type=Path, required=True)
    rr.add_argument("--settings", type=Path, required=True, help="JSON: name -> ShellLesionDetector arguments")
    rr.add_argument("--out", type=Path, required=True, help="rows CSV")
    c = sub.add_parser("channels", help="each lesion's rank in each channel alone and in the merged ranking")
    c.add_argument("--cache", type=Path, required=True)
    c.add_argument("--out", type=Path, required=True, help="rows CSV")
    a = ap.parse_args(argv)
    if a.cmd == "build":
        build(a.ct_dir, a.seed, a.kinds, a.per_cell, a.out, a.preset)
        return
    t = time.perf_counter()
    if a.cmd == "phantoms":
        rows = phantoms(a.datalists, json.loads(a.variants.read_text()))
    elif a.cmd == "rerank":
        rows = rerank_rows(a.cache, json.loads(a.settings.read_text()))
    elif a.cmd == "channels":
        rows = channels(a.cache)
    else:
        rows = score(a.cache, json.loads(a.variants.read_text()))
    a.out.parent.mkdir(parents=True, exist_ok=True)
    with open(a.out, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    if a.cmd == "phantoms":
        print("\n".join(f"| {x['cohort']} | {x['variant']} | {x['type']} | {x['in_bag']}/{x['n']} | "
                        f"{x['cpm']:.3f} [{x['cpm_lo']:.3f}, {x['cpm_hi']:.3f}] |" for x in rows))
    else:
        print(channels_table(rows) if a.cmd == "channels" else table(rows))
    print(f"{len(rows)} rows in {time.perf_counter() - t:.0f} s -> {a.out}")


if __name__ == "__main__":
    main()
