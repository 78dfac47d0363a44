"""Inserted lesions beside the real lesions of ../shared/data/ct, measured alike (docs/phantoms.md, "Lesions
inserted into real CTs").

Four lesions are inserted (:mod:`lungcal.data.synthetic.insertion`) into the scans whose real lesions they
are compared with: a solid nodule of 15.5 mm, a part-solid nodule (24 mm, a core of 30 %, -600 HU) and a
ground-glass nodule (16 mm, -600 HU) free in the lung
of LIDC-IDRI-0314 (1 mm slices; its real 15.5 mm nodule), and a 34 mm mass on the posterior chest wall of
LIDC-IDRI-0001 (2.5 mm; its real 34 mm nodule on the posterior pleura). The real lesions are LIDC-IDRI-0001's,
LIDC-IDRI-0314's and, where the DICOM reader accepts its planning export, NSCLC-Radiomics-LUNG1-002's tumour.
Each lesion is measured the same way on the HU volume:

- **HU at the centre**: the median within 0.3 r of the centre (a part-solid nodule: of its core);
- **noise inside**: the robust spread (1.4826 x the median absolute deviation, so that a vessel through
  ground glass does not count) of the HU within 0.5 r (a part-solid nodule: its ground-glass halo);
- **noise beside**: the same spread in 6 mm cubes of aerated lung (all inside the lung mask, median below
  -700 HU) centred 7 mm beyond the lesion's radius in 26 directions; the median over the cubes;
- **edge width**: 72 rays in the axial plane from the centre, sampled every 0.1 mm (trilinear); a ray counts
  where it leaves the lesion into aerated lung (the lesion's level 2-6 mm inside its 50 % point, the lung's
  2-6 mm outside); its profile is aligned on its own 50 % point, the aligned profiles are averaged (the edge
  spread function, free of the lesion's shape and of most of the noise), and the width is the distance
  between its 90 % and 10 % levels. A Gaussian blur of sigma s gives 2.56 s.

Writes the figure (axial crops at -1000..400 HU, the HU profile through each centre, the averaged edges, the
table) and prints the table as Markdown; ``--json`` keeps the numbers.

    python experiments/insertion_figure.py --ct ../shared/data/ct --out docs/phantoms_insertion.png
"""
from __future__ import annotations

import argparse
import io
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from PIL import Image
from scipy import ndimage

from lungcal.ct.acquisition import acquisition_stats
from lungcal.ctapp.evaluate.lesion_bed import real_lesions
from lungcal.data.synthetic.insertion import Background, InsertedLesion, choose_centre, insert_lesions, load_background
from lungcal.errors import LungcalError

WINDOW = (-1000.0, 400.0)
STEP_MM = 0.1
N_RAYS = 72
ALIGN_MM = 6.0  # the aligned edge profile spans +-6 mm around each ray's 50 % point


class Shown:
    """One lesion as measured: its volume (inserted or as scanned), centre, size and the level its edge rises to
    (``level`` None: measured at its centre); ``inside_mm`` the shell whose spread is "noise inside" (None:
    0-0.5 r); ``core_mm`` a part-solid nodule's core radius (its centre HU is read there). A plain class:
    the script is loaded by path in its test, where a dataclass cannot resolve its module."""

    def __init__(self, label: str, scan: str, bg: Background, hu: np.ndarray, centre: np.ndarray,
                 diameter_mm: float, level: float | None = None, inside_mm: tuple[float, float] | None = None,
                 core_mm: float = 0.0, inserted: bool = True) -> None:
        self.label, self.scan, self.bg, self.hu = label, scan, bg, hu
        self.centre, self.diameter_mm, self.level = np.asarray(centre, float), float(diameter_mm), level
        self.inside_mm, self.core_mm, self.inserted = inside_mm, core_mm, inserted
        self.numbers: dict[str, Any] = {}

    @property
    def radius_mm(self) -> float:
        return self.diameter_mm / 2


def _to_vox(bg: Background, ras: np.ndarray) -> np.ndarray:
    return (np.asarray(ras, float) - bg.affine[:3, 3]) @ np.linalg.inv(bg.affine[:3, :3]).T


def _ball(bg: Background, centre: np.ndarray, r_lo: float, r_hi: float) -> tuple[tuple[slice, ...], np.ndarray]:
    """(box, mask) of the voxels whose centres lie between ``r_lo`` and ``r_hi`` mm of ``centre``."""
    c = _to_vox(bg, centre)
    half = r_hi / bg.spacing
    lo = np.maximum(np.floor(c - half).astype(int), 0)
    hi = np.minimum(np.ceil(c + half).astype(int) + 1, bg.hu.shape)
    box = tuple(slice(int(a), int(b)) for a, b in zip(lo, hi))
    g = np.stack(np.meshgrid(*[np.arange(s.start, s.stop) for s in box], indexing="ij"), -1)
    d = np.linalg.norm((g - c) * bg.spacing, axis=-1)
    return box, (d >= r_lo) & (d <= r_hi)


def robust_std(x: np.ndarray) -> float:
    x = np.asarray(x, float)
    return float(1.4826 * np.median(np.abs(x - np.median(x)))) if x.size else float("nan")


def rays(hu: np.ndarray, bg: Background, centre: np.ndarray, dirs: np.ndarray, length_mm: float) -> np.ndarray:
    """HU along rays from ``centre`` in the RAS directions ``dirs`` (n, 3), every STEP_MM up to ``length_mm``."""
    s = np.arange(0.0, length_mm + STEP_MM / 2, STEP_MM)
    pts = centre[None, None] + s[None, :, None] * dirs[:, None, :]  # (n, m, 3) RAS
    vox = _to_vox(bg, pts.reshape(-1, 3)).T
    return ndimage.map_coordinates(hu, vox, order=1, mode="nearest").reshape(len(dirs), len(s))


def in_plane_dirs(n: int = N_RAYS) -> np.ndarray:
    a = np.arange(n) * 2 * np.pi / n
    return np.stack([np.cos(a), np.sin(a), np.zeros(n)], 1)


def lung_level(bg: Background, hu: np.ndarray, centre: np.ndarray, radius: float) -> float:
    """The aerated lung around the lesion: the median HU of lung voxels below -500 HU, 4-12 mm beyond it."""
    box, shell = _ball(bg, centre, radius + 4, radius + 12)
    v = hu[box][shell & bg.lung[box] & (hu[box] < -500)]
    return float(np.median(v)) if v.size else -850.0


def edge(hu: np.ndarray, bg: Background, centre: np.ndarray, radius: float, level: float, lung: float
         ) -> dict[str, Any]:
    """The edge width (mm, 10-90 %) of the averaged aligned edge profile of the rays that leave the lesion
    into aerated lung (module docstring), with the profile itself."""
    prof = rays(hu, bg, centre, in_plane_dirs(), 1.8 * radius + 2 * ALIGN_MM)
    smooth = ndimage.gaussian_filter1d(prof, 0.5 / STEP_MM, axis=1)
    half, contrast = (level + lung) / 2, level - lung
    s = np.arange(prof.shape[1]) * STEP_MM
    t = np.arange(-ALIGN_MM, ALIGN_MM + STEP_MM / 2, STEP_MM)
    aligned, valid = [], np.zeros(len(prof), bool)
    for i, (p, q) in enumerate(zip(prof, smooth)):
        below = np.flatnonzero((s >= 0.3 * radius) & (q < half))
        if not len(below) or below[0] == 0:
            continue
        j = below[0]
        x50 = s[j - 1] + (q[j - 1] - half) / (q[j - 1] - q[j]) * STEP_MM  # where the smoothed profile crosses 50 %
        if x50 - ALIGN_MM < 0 or x50 + ALIGN_MM > s[-1]:
            continue
        inner = p[(s >= x50 - ALIGN_MM) & (s <= x50 - 2)].mean()
        outer = p[(s >= x50 + 2) & (s <= x50 + ALIGN_MM)].mean()
        if inner > half + 0.3 * contrast and outer < half - 0.3 * contrast and outer < -600:
            aligned.append(np.interp(x50 + t, s, p))
            valid[i] = True
    if len(aligned) < 3:
        return {"edge_mm": float("nan"), "rays": len(aligned), "t": t, "esf": np.full(len(t), np.nan),
                "valid": valid}
    esf = np.mean(aligned, axis=0)
    hi, lo = esf[t <= -3.5].mean(), esf[t >= 3.5].mean()
    e = (esf - lo) / (hi - lo)
    return {"edge_mm": _crossing(t, e, 0.1) - _crossing(t, e, 0.9), "rays": len(aligned), "t": t, "esf": e,
            "valid": valid}


def _crossing(t: np.ndarray, e: np.ndarray, level: float) -> float:
    """The first ``t`` where the falling profile ``e`` drops below ``level`` (linear between samples)."""
    j = int(np.flatnonzero(e < level)[0])
    return float(t[j - 1] + (e[j - 1] - level) / (e[j - 1] - e[j]) * (t[j] - t[j - 1]))


def beside_noise(hu: np.ndarray, bg: Background, centre: np.ndarray, radius: float, side_mm: float = 6.0
                 ) -> tuple[float, int]:
    """The median robust spread of aerated-lung cubes 7 mm beyond the lesion (module docstring), and their count."""
    dirs = np.array([(i, j, k) for i in (-1, 0, 1) for j in (-1, 0, 1) for k in (-1, 0, 1) if (i, j, k) != (0, 0, 0)],
                    float)
    dirs /= np.linalg.norm(dirs, axis=1, keepdims=True)
    half = np.maximum(np.round(side_mm / 2 / bg.spacing).astype(int), 1)
    spreads = []
    for d in dirs:
        c = np.rint(_to_vox(bg, centre + (radius + 7.0) * d)).astype(int)
        lo, hi = c - half, c + half + 1
        if np.any(lo < 0) or np.any(hi > bg.hu.shape):
            continue
        box = tuple(slice(int(a), int(b)) for a, b in zip(lo, hi))
        v = hu[box]
        if bg.lung[box].all() and np.median(v) < -700:
            spreads.append(robust_std(v))
    return (float(np.median(spreads)) if spreads else float("nan")), len(spreads)


def measure(x: Shown) -> dict[str, Any]:
    r = x.radius_mm
    box, core = _ball(x.bg, x.centre, 0.0, 0.3 * (x.core_mm if x.core_mm else r))
    centre_hu = float(np.median(x.hu[box][core]))
    lo, hi = x.inside_mm if x.inside_mm else (0.0, 0.5 * r)
    box, shell = _ball(x.bg, x.centre, lo, hi)
    inside = robust_std(x.hu[box][shell])
    level = x.level if x.level is not None else centre_hu
    lung = lung_level(x.bg, x.hu, x.centre, r)
    e = edge(x.hu, x.bg, x.centre, r, level, lung)
    beside, n_cubes = beside_noise(x.hu, x.bg, x.centre, r)
    x.numbers = {"lesion": x.label, "scan": x.scan, "voxel_mm": [round(float(v), 3) for v in x.bg.spacing],
                 "diameter_mm": round(x.diameter_mm, 1), "centre_hu": round(centre_hu), "lung_hu": round(lung),
                 "noise_inside_hu": round(inside, 1), "noise_beside_hu": round(beside, 1), "beside_cubes": n_cubes,
                 "edge_mm": round(e["edge_mm"], 2), "edge_rays": e["rays"],
                 "psf_sigma_mm": [round(float(v), 2) for v in x.bg.psf_sigma_mm]}
    x.numbers["_edge"] = e
    return x.numbers


def _inserted(bg: Background, kind: str, place: str, diameter: float, seed: int, posterior: bool | None = None,
              **kw: Any) -> tuple[np.ndarray, InsertedLesion]:
    rng = np.random.default_rng(seed)
    got = choose_centre(bg, place, diameter, rng, posterior=posterior)
    if got is None:
        raise SystemExit(f"no room for a {diameter} mm {kind} lesion ({place}) on {bg.name}")
    x, y, z = (float(v) for v in got[0])
    lesion = InsertedLesion(kind, place, diameter, (x, y, z), posterior=got[1], seed=seed, **kw)
    return insert_lesions(bg, [lesion]), lesion


def lesions(ct: Path, seed: int = 0) -> list[Shown]:
    """The lesions of the figure (module docstring): the inserted ones first, then the real ones."""
    out: list[Shown] = []
    read: dict[str, tuple[Background, list]] = {}
    for case, image in (("LIDC-IDRI-0314", "ct.nii.gz"), ("LIDC-IDRI-0001", "ct.nii.gz"),
                        ("NSCLC-Radiomics-LUNG1-002", "dicom")):
        try:
            reals = real_lesions(ct / case)
            read[case] = (load_background(ct / case / image, case, [(r.centre_ras, r.diameter_mm / 2) for r in reals]),
                          reals)
        except (LungcalError, OSError) as exc:
            print(f"skipped {case}: {exc}")
    if "LIDC-IDRI-0314" in read:
        bg = read["LIDC-IDRI-0314"][0]
        hu, les = _inserted(bg, "solid", "free", 15.5, seed + 1)
        out.append(Shown("inserted solid", bg.name, bg, hu, np.asarray(les.centre_ras), les.diameter_mm, 40.0))
        hu, les = _inserted(bg, "part-solid", "free", 24.0, seed + 2, core_frac=0.3, gg_hu=-600.0)
        core = 0.3 * 12.0  # its core's radius: the halo is 8.4 mm thick, room for the edge's 6 mm inside
        out.append(Shown("inserted part-solid", bg.name, bg, hu, np.asarray(les.centre_ras), les.diameter_mm, -600.0,
                         inside_mm=(core + 1.5, 0.8 * 12.0), core_mm=core))
        hu, les = _inserted(bg, "ground-glass", "free", 16.0, seed + 3, core_frac=0.0, gg_hu=-600.0)
        out.append(Shown("inserted ground glass", bg.name, bg, hu, np.asarray(les.centre_ras), les.diameter_mm, -600.0))
    if "LIDC-IDRI-0001" in read:
        bg = read["LIDC-IDRI-0001"][0]
        hu, les = _inserted(bg, "mass", "pleura", 34.0, seed + 4, posterior=True, lobulation=0.1)
        out.append(Shown("inserted mass, chest wall", bg.name, bg, hu, np.asarray(les.centre_ras), les.diameter_mm,
                         40.0))
    for case in ("LIDC-IDRI-0001", "LIDC-IDRI-0314", "NSCLC-Radiomics-LUNG1-002"):
        if case in read:
            bg, reals = read[case]
            for r in reals:
                out.append(Shown(f"real {r.diameter_mm:.0f} mm", case, bg, bg.hu, np.asarray(r.centre_ras),
                                 r.diameter_mm, None, inserted=False))
    return out


def _line_dir(x: Shown) -> np.ndarray:
    """The in-plane direction of the profile drawn: one whose both ends leave the lesion into lung, if any."""
    valid = x.numbers["_edge"]["valid"]
    n = len(valid)
    both = [i for i in range(n) if valid[i] and valid[(i + n // 2) % n]]
    pick = both[len(both) // 2] if both else (int(np.flatnonzero(valid)[0]) if valid.any() else 0)
    return in_plane_dirs(n)[pick]


def _short(scan: str) -> str:
    return scan.replace("-Radiomics-LUNG1", "")


def figure(shown: Sequence[Shown], path: Path, max_kb: int = 300) -> None:
    n = len(shown)
    fig = Figure(figsize=(2.1 * n, 6.8), dpi=80)
    FigureCanvasAgg(fig)
    grid = fig.add_gridspec(3, n, height_ratios=[1.0, 0.62, 1.0], hspace=0.42, wspace=0.35,
                            left=0.045, right=0.99, top=0.94, bottom=0.06)
    for i, x in enumerate(shown):
        r = x.radius_mm
        half = max(1.7 * r, 14.0)
        d = _line_dir(x)
        # the axial slice through the centre, resampled to 0.5 mm, radiological view (patient's right on the left)
        u = np.arange(-half, half + 0.25, 0.5)
        gx, gy = np.meshgrid(u, u, indexing="xy")
        pts = x.centre[None] + np.stack([gx.ravel(), gy.ravel(), np.zeros(gx.size)], 1)
        img = ndimage.map_coordinates(x.hu, _to_vox(x.bg, pts).T, order=1, mode="nearest").reshape(gx.shape)
        ax = fig.add_subplot(grid[0, i])
        ax.imshow(img, cmap="gray", vmin=WINDOW[0], vmax=WINDOW[1], origin="lower",
                  extent=(-half, half, -half, half), interpolation="nearest")
        ax.plot([-1.6 * r * d[0], 1.6 * r * d[0]], [-1.6 * r * d[1], 1.6 * r * d[1]], color="tab:orange", lw=0.8)
        ax.set_title(f"{x.label}\n{_short(x.scan)}, {x.diameter_mm:.1f} mm", fontsize=7.5)
        ax.tick_params(labelsize=6)
        # the HU profile through the centre along that line
        s = np.arange(-1.6 * r, 1.6 * r + STEP_MM / 2, STEP_MM)
        prof = ndimage.map_coordinates(x.hu, _to_vox(x.bg, x.centre[None] + s[:, None] * d[None]).T, order=1,
                                       mode="nearest")
        ax = fig.add_subplot(grid[1, i])
        ax.plot(s, prof, color="tab:blue" if x.inserted else "tab:red", lw=0.8)
        ax.set_ylim(-1050, 250)
        ax.axvline(-r, color="0.7", lw=0.5)
        ax.axvline(r, color="0.7", lw=0.5)
        ax.set_xlabel("mm from the centre", fontsize=6.5)
        if i == 0:
            ax.set_ylabel("HU", fontsize=7)
        ax.tick_params(labelsize=6)
    ax = fig.add_subplot(grid[2, : max(n // 3, 2)])
    for x in shown:
        e = x.numbers["_edge"]
        if e["rays"] >= 3:
            ax.plot(e["t"], e["esf"], "--" if x.inserted else "-", lw=1.0,
                    label=f"{x.label} ({_short(x.scan)}): {x.numbers['edge_mm']:.2f} mm")
    ax.set_xlabel("mm from each ray's 50 % point (outwards)", fontsize=7)
    ax.set_ylabel("edge, lesion = 1, lung = 0", fontsize=7)
    ax.set_title("averaged edge profiles into the lung (10-90 % width)", fontsize=8)
    ax.tick_params(labelsize=6)
    ax.legend(fontsize=5.5, loc="lower left")
    ax = fig.add_subplot(grid[2, max(n // 3, 2):])
    ax.axis("off")
    cols = ["lesion", "scan, voxel (mm)", "d mm", "HU centre", "noise inside", "noise beside", "edge 10-90 mm"]
    cells = [[x.numbers["lesion"],
              f"{_short(x.scan)}, {x.bg.spacing[0]:.2f} x {x.bg.spacing[2]:g}",
              f"{x.diameter_mm:.1f}", f"{x.numbers['centre_hu']}", f"{x.numbers['noise_inside_hu']}",
              f"{x.numbers['noise_beside_hu']}", f"{x.numbers['edge_mm']} ({x.numbers['edge_rays']} rays)"]
             for x in shown]
    table = ax.table(cellText=cells, colLabels=cols, loc="center", cellLoc="left",
                     colWidths=[0.2, 0.26, 0.07, 0.09, 0.1, 0.1, 0.18])
    table.auto_set_font_size(False)
    table.set_fontsize(6.5)
    table.scale(1.0, 1.25)
    ax.set_title("HU at the centre; noise = robust HU spread inside / in aerated lung beside; at -1000..400 HU",
                 fontsize=8)
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    png = Image.open(io.BytesIO(buf.getvalue()))
    small = png.convert("RGB").quantize(colors=96, method=Image.Quantize.MEDIANCUT)  # a palette PNG: a few 100 KB
    path.parent.mkdir(parents=True, exist_ok=True)
    small.save(path, optimize=True)
    kb = path.stat().st_size / 1024
    print(f"figure: {path} ({kb:.0f} KB)")
    if kb > max_kb:
        raise SystemExit(f"the figure is {kb:.0f} KB, over {max_kb} KB")


def table(shown: Sequence[Shown]) -> str:
    lines = ["| lesion | scan | voxel (mm) | diameter (mm) | HU at centre | noise inside (HU) | noise beside (HU) "
             "| edge 10-90 % (mm) | rays | scan PSF sigma (mm) | scan noise (HU) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for x in shown:
        v = x.numbers
        lines.append(f"| {v['lesion']} | {v['scan']} | {' x '.join(f'{s:g}' for s in v['voxel_mm'])} | "
                     f"{v['diameter_mm']} | {v['centre_hu']} | {v['noise_inside_hu']} | {v['noise_beside_hu']} | "
                     f"{v['edge_mm']} | {v['edge_rays']} | {' / '.join(f'{s:g}' for s in v['psf_sigma_mm'][1:])} | "
                     f"{v['scan_noise_hu']} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ct", default="../shared/data/ct", help="the shared real CTs (default ../shared/data/ct)")
    ap.add_argument("--out", default="docs/phantoms_insertion.png", help="the figure (PNG)")
    ap.add_argument("--json", default=None, help="also write the numbers here")
    ap.add_argument("--seed", type=int, default=0, help="seed of the inserted lesions' places")
    args = ap.parse_args(argv)
    shown = lesions(Path(args.ct), args.seed)
    noise = {}
    for x in shown:
        if x.scan not in noise:
            noise[x.scan] = round(float(acquisition_stats(x.bg.hu, x.bg.spacing).noise_hu), 1)
        measure(x)
        x.numbers["scan_noise_hu"] = noise[x.scan]
    print(table(shown))
    figure(shown, Path(args.out))
    if args.json:
        Path(args.json).write_text(json.dumps([{k: v for k, v in x.numbers.items() if not k.startswith("_")}
                                               for x in shown], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
