"""Lesions inserted into real chest CTs: the detector's test bed on real anatomy.

A phantom is kinder than a patient: its parenchyma is flat, its vessels are tubes, its pleura is a
smooth surface. This module plants lesions with known truth into *real* CT volumes (the scans of
``../shared/data/ct``, or a site's own), so that what the bag holds can be judged per lesion type,
place and size on the anatomy a detector meets at a hospital.

**The lesion.** Four kinds:

- ``solid``: a soft-tissue nodule (``solid_hu``, default 40 HU) of 4-30 mm;
- ``part-solid``: ground glass (``gg_hu``) around a solid core of ``core_frac`` (0-0.6) of the
  diameter;
- ``ground-glass``: ground glass alone (``core_frac`` 0);
- ``mass``: a solid lobulated mass of 30-70 mm.

Each has a slightly irregular surface: the radius varies with direction by a few low-order
harmonics (``lobulation`` of the radius, 4 % for a nodule, 10 % for a mass).

**How it is imaged** (:func:`lesion_delta`). The lesion is rasterised on the scan's own voxel grid
with 3 x 3 x 3 sub-samples per voxel (its partial volume): ``share`` is the part of each voxel the
lesion fills; ``b`` is the local tissue level (the CT smoothed by a Gaussian of 1.5 mm, inside the
lung over lung voxels only, so the chest wall does not raise it). ``PSF`` is the scanner's point
spread: a Gaussian of the scan's measured in-plane edge width (:func:`lungcal.ct.acquisition.edge_sigma`,
floor 0.4 mm) across the slice, and of the slice profile along it (FWHM = the slice spacing).

- ground glass (and the halo of a part-solid nodule) *lifts* a voxel to its density,
  ``PSF * (share * max(0, L - b))`` added to the scan, and leaves denser tissue as it is: vessels run
  through it, as on real CT, and the scan's own noise and texture stay in place under it;
- a solid nodule, a mass and a part-solid core *replace* the lung they fill, vessels included: with
  ``a = PSF * (share inside the lung mask)``, the voxel becomes ``(1 - a) * scan + a * (L + n)``, where
  ``n`` is noise of the scan's measured level (``noise_hu``, the HU spread in its soft tissue) and
  blur (white noise through the PSF), drawn from the lesion's seed. A solid lesion is no smoother than
  soft tissue on that scan, and the lung's own texture (vessels, their edges) does not show through
  it. Outside the lung a solid lesion adds density only where the tissue is lighter
  (``PSF * (share * max(0, L - b))``): against the chest wall or the mediastinum it merges with them
  and never darkens a rib.

**Where** (:func:`choose_centre`), on the scan's lung mask (:data:`PLANNING_MASKER`, fixed whatever the
default masker is):

- ``free``: deep in the lung, at least the radius plus 5 mm from the pleura and from vessels;
- ``pleura``: against the chest wall: the centre ``0.7 r`` inside the costal pleura (anterior,
  lateral or posterior: the nearest surface faces neither the midline nor down or up, so neither the
  mediastinum nor the diaphragm or apex; ``posterior`` in the truth says whether it lies on the
  dependent, posterior wall);
- ``mediastinum``: against the mediastinum or hilum: the same, on the medial pleura (the nearest
  surface faces the midline, within the inner 60 % of the lung's half-width);
- ``vessel``: touching a vessel: the centre between ``0.5 r`` and ``r`` from a vessel of at least
  3 mm, away from the pleura.

The real lesions of a background are kept clear of (``exclude``: centres and radii).

:func:`insert_lesions` returns the new HU volume; :func:`write_lesion_bed` writes NIfTI scans with a
``truth.csv`` beside them (centre in RAS mm, diameter, kind, place, densities) and a datalist; the
``lungcal lesion-bed`` command runs it.
"""
from __future__ import annotations

import csv
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import nibabel as nib
import numpy as np
from scipy import ndimage

from lungcal.ct.acquisition import acquisition_stats
from lungcal.ct.io import load_ct
from lungcal.ct.masking import LungMasker, fill_holes_2d

#: the lung mask lesions are placed on: the built-in masker with its per-slice closing in the axial slices
#: only (its default before 2026-12-08). Fixed, so that a change of the default masker, which the lesion bed
#: measures, does not move the lesions it is measured on (the draws behind docs/results stay as they were).
PLANNING_MASKER = LungMasker(lesion_closing_sideways_mm=0.0)

__all__ = ["KINDS", "PLACES", "Background", "InsertedLesion", "choose_centre", "draw_lesion", "insert_lesions",
           "lesion_delta", "load_background", "PLANNING_MASKER", "plan_lesions", "read_truth", "write_lesion_bed"]

KINDS = ("solid", "part-solid", "ground-glass", "mass")
PLACES = ("free", "pleura", "mediastinum", "vessel")
SOLID_HU = 40.0
#: the diameters drawn (mm): nodules log-uniform in 4-30, masses uniform in 30-70
NODULE_MM = (4.0, 30.0)
MASS_MM = (30.0, 70.0)
#: the ground-glass density drawn (HU): uniform in this range
GG_HU = (-800.0, -300.0)


@dataclass(frozen=True)
class InsertedLesion:
    """One lesion planted into a background: what the truth file records."""

    kind: str
    place: str
    diameter_mm: float
    centre_ras: tuple[float, float, float]
    core_frac: float = 1.0
    gg_hu: float = SOLID_HU
    solid_hu: float = SOLID_HU
    lobulation: float = 0.04
    posterior: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown lesion kind {self.kind!r}; use one of {KINDS}")
        if self.place not in PLACES:
            raise ValueError(f"unknown place {self.place!r}; use one of {PLACES}")
        if not self.diameter_mm > 0 or not 0.0 <= self.core_frac <= 1.0:
            raise ValueError(f"diameter must be > 0 and core_frac in [0, 1], got {self.diameter_mm}, {self.core_frac}")

    @property
    def radius_mm(self) -> float:
        return self.diameter_mm / 2

    def row(self) -> dict[str, Any]:
        d = asdict(self)
        x, y, z = d.pop("centre_ras")
        return {"rasX": round(x, 3), "rasY": round(y, 3), "rasZ": round(z, 3), **d}


@dataclass
class Background:
    """A real CT read once, in HU on the RAS grid, with what insertion needs of it."""

    name: str
    hu: np.ndarray  #: (X, Y, Z) float32 HU, RAS-ordered axes
    affine: np.ndarray  #: 4x4 voxel -> RAS mm
    lung: np.ndarray  #: (X, Y, Z) bool lung mask
    psf_sigma_mm: np.ndarray  #: (3,) the Gaussian point spread (mm) per axis
    exclude: list[tuple[np.ndarray, float]] = field(default_factory=list)  #: real lesions: (centre RAS, radius)
    meta: Any = None  #: the loader's MetaTensor metadata, to rebuild one around a new volume
    geometry: Any = field(default=None, repr=False)  #: where lesions can go (computed once, on first use)
    noise_hu: float = 20.0  #: the scan's noise (HU std in soft tissue), which a solid lesion carries

    @property
    def spacing(self) -> np.ndarray:
        return np.linalg.norm(self.affine[:3, :3], axis=0)


def _psf_and_noise(hu: np.ndarray, spacing: np.ndarray) -> tuple[np.ndarray, float]:
    """The scanner's point spread as Gaussian sigmas (mm): in-plane from the measured skin-air edge
    width (at least 0.4 mm; 0.7 mm where none can be measured), along z a slice profile of FWHM
    the slice spacing; and its noise (HU std in soft tissue; 20 HU where none can be measured)."""
    stats = acquisition_stats(hu, spacing)
    edge = float(stats.edge_sigma_mm) if stats is not None and np.isfinite(stats.edge_sigma_mm) else 0.7
    edge = max(edge, 0.4)
    noise = float(stats.noise_hu) if stats is not None and np.isfinite(stats.noise_hu) else 20.0
    return np.array([edge, edge, float(spacing[2]) / 2.355]), noise


def load_background(path: str | Path, name: str | None = None,
                    exclude: Iterable[tuple[Sequence[float], float]] = ()) -> Background:
    """Read a CT (any format :func:`lungcal.ct.io.load_ct` reads) as a background.

    ``exclude``: the real lesions of this scan, ``(centre RAS mm, radius mm)``, which inserted
    lesions keep clear of (by their radius plus 15 mm)."""
    img = load_ct(str(path))
    hu = np.asarray(img[0].detach().cpu().numpy() if hasattr(img, "detach") else img[0], np.float32)
    affine = np.asarray(img.affine.detach().cpu().numpy() if hasattr(img.affine, "detach") else img.affine,
                        np.float64)
    spacing = np.linalg.norm(affine[:3, :3], axis=0)
    lung = np.asarray(PLANNING_MASKER(hu, spacing), bool)
    psf, noise = _psf_and_noise(hu, spacing)
    return Background(name or Path(path).name, hu, affine, lung, psf,
                      [(np.asarray(c, np.float64), float(r)) for c, r in exclude], getattr(img, "meta", None),
                      noise_hu=noise)


def _harmonics(lobulation: float, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """The lesion's surface: a few random low-order harmonics (axes, frequencies, phases; None: a sphere)."""
    if lobulation <= 0:
        return None
    axes = rng.normal(size=(5, 3))
    axes /= np.linalg.norm(axes, axis=1, keepdims=True)
    return axes, rng.integers(2, 5, size=5), rng.uniform(0, 2 * np.pi, size=5)


def _radius_field(dirs: np.ndarray, lobulation: float,
                  harmonics: tuple[np.ndarray, np.ndarray, np.ndarray] | None) -> np.ndarray:
    """A smooth relative radius ``1 + lobulation * f(direction)`` over unit vectors ``dirs`` (N, 3):
    the ``harmonics`` (cosines of projections on random axes), ``f`` in [-1, 1], so the radius lies
    within ``1 -/+ lobulation``."""
    if harmonics is None:
        return np.ones(len(dirs))
    axes, freq, phase = harmonics
    f = np.cos(freq[None] * np.arccos(np.clip(dirs @ axes.T, -1, 1)) + phase[None]).sum(axis=1) / np.sqrt(5)
    return 1.0 + lobulation * np.clip(f, -2, 2) / 2


def _shares(shape: tuple[int, ...], lo: np.ndarray, centre_vox: np.ndarray, spacing: np.ndarray,
            radii: Sequence[float], lobulation: float, harmonics: tuple[np.ndarray, np.ndarray, np.ndarray] | None,
            sub: int, chunk: int = 16384) -> list[np.ndarray]:
    """The share of each voxel of a box (``shape``, first voxel ``lo``) inside the lobulated surface
    of each radius in ``radii`` (mm), on ``sub``^3 samples per voxel. A voxel wholly inside or outside
    the surface's range of radii is decided from its centre; only those the surface may cross are
    sampled, ``chunk`` voxels at a time (the memory of a 7 cm mass at 1 mm stays small)."""
    o = (np.arange(sub) + 0.5) / sub - 0.5  # sub-voxel sample offsets, in voxels, centred in each voxel
    offs = np.stack(np.meshgrid(o, o, o, indexing="ij"), -1).reshape(1, -1, 3)
    grid = np.stack(np.meshgrid(*[np.arange(n) for n in shape], indexing="ij"), -1).reshape(-1, 3).astype(np.float64)
    d0 = np.linalg.norm((grid + lo - centre_vox) * spacing, axis=1)  # each voxel centre's distance (mm)
    spread = float(np.linalg.norm(o.max() * spacing)) + 1e-6  # the farthest a sample lies from its voxel's centre
    lob = max(float(lobulation), 0.0) if harmonics is not None else 0.0
    out, todo = [], np.zeros(len(grid), bool)
    for r in radii:
        share = np.zeros(len(grid))
        share[d0 + spread < r * (1 - lob) * (1 - 1e-9)] = 1.0
        todo |= (d0 + spread >= r * (1 - lob) * (1 - 1e-9)) & (d0 - spread <= r * (1 + lob) * (1 + 1e-9))
        out.append(share)
    idx = np.flatnonzero(todo)
    for start in range(0, len(idx), chunk):
        sel = idx[start:start + chunk]
        pts = (grid[sel, None, :] + offs + lo) - centre_vox  # (n, S, 3) voxel offsets from the centre
        mm = pts * spacing  # the affine is a rotation of the voxel axes (RAS-ordered): distances are per-axis mm
        dist = np.linalg.norm(mm, axis=-1)
        dirs = mm.reshape(-1, 3) / np.maximum(dist.reshape(-1, 1), 1e-9)
        rel = _radius_field(dirs, lobulation, harmonics).reshape(dist.shape)
        for share, r in zip(out, radii):
            share[sel] = (dist <= r * rel).mean(axis=1)
    return [share.reshape(shape) for share in out]


def _tissue_level(hu: np.ndarray, lung: np.ndarray, sigma_vox: np.ndarray) -> np.ndarray:
    """The local tissue level: the HU smoothed by a Gaussian, inside the lung over lung voxels only
    (a normalised convolution), so the chest wall next to a juxtapleural lesion does not raise the
    level its lift is measured from."""
    h = hu.astype(np.float64)
    plain = ndimage.gaussian_filter(h, sigma_vox, mode="nearest")
    if not lung.any():
        return plain
    w = lung.astype(np.float64)
    num = ndimage.gaussian_filter(h * w, sigma_vox, mode="nearest")
    den = ndimage.gaussian_filter(w, sigma_vox, mode="nearest")
    return np.where(lung & (den > 1e-3), num / np.maximum(den, 1e-3), plain)


def lesion_delta(bg: Background, lesion: InsertedLesion, sub: int = 3) -> tuple[tuple[slice, ...], np.ndarray]:
    """The HU the lesion adds to ``bg``: ``(box, delta)`` with ``delta`` on ``bg.hu[box]`` (module
    docstring: partial volume on ``sub``^3 samples per voxel, a lift over the local tissue, blurred by
    the scanner's point spread)."""
    spacing = bg.spacing
    centre_vox = np.linalg.solve(bg.affine[:3, :3], np.asarray(lesion.centre_ras) - bg.affine[:3, 3])
    r_max = lesion.radius_mm * (1 + 1.5 * lesion.lobulation)
    reach = r_max + 3 * bg.psf_sigma_mm + 2 * spacing
    lo = np.maximum(np.floor(centre_vox - reach / spacing).astype(int), 0)
    hi = np.minimum(np.ceil(centre_vox + reach / spacing).astype(int) + 1, np.asarray(bg.hu.shape))
    box = tuple(slice(int(a), int(b)) for a, b in zip(lo, hi))
    shape = tuple(int(b - a) for a, b in zip(lo, hi))
    if min(shape) <= 0:
        raise ValueError(f"lesion centre {lesion.centre_ras} lies outside the scan {bg.name}")
    harmonics = _harmonics(lesion.lobulation, np.random.default_rng(lesion.seed))
    radii = [lesion.radius_mm] + ([lesion.radius_mm * lesion.core_frac] if lesion.core_frac > 0 else [])
    outer, *rest = _shares(shape, lo, centre_vox, spacing, radii, lesion.lobulation, harmonics, sub)
    core = rest[0] if rest else np.zeros(shape)
    lung = bg.lung[box]
    hu = bg.hu[box].astype(np.float64)
    tissue = _tissue_level(hu, lung, 1.5 / spacing)
    sigma = bg.psf_sigma_mm / spacing

    def blur(x: np.ndarray) -> np.ndarray:
        return ndimage.gaussian_filter(x, sigma, mode="constant")

    if lesion.core_frac >= 1:  # solid: outside the lung (the chest wall, the mediastinum) it adds density only
        delta = blur(outer * ~lung * np.maximum(lesion.solid_hu - tissue, 0.0))  # where that is lighter
        solid = outer * lung
    else:  # ground glass lifts the lung to its density and leaves denser tissue (vessels) as it is
        delta = blur(outer * np.maximum(lesion.gg_hu - tissue, 0.0))
        solid = core * lung
    if solid.any():  # the solid part replaces the lung it fills, vessels included, and carries the scan's noise
        share = blur(solid)
        noise = ndimage.gaussian_filter(np.random.default_rng([lesion.seed, 1]).standard_normal(shape), sigma)
        noise *= bg.noise_hu / max(float(noise.std()), 1e-6)
        delta += share * (lesion.solid_hu + noise - (hu + delta))
    return box, delta.astype(np.float32)


def insert_lesions(bg: Background, lesions: Sequence[InsertedLesion]) -> np.ndarray:
    """A copy of ``bg.hu`` with ``lesions`` inserted (their lifts add; see :func:`lesion_delta`)."""
    out = bg.hu.copy()
    for lesion in lesions:
        box, delta = lesion_delta(bg, lesion)
        out[box] += delta
    return out


@dataclass
class _Geometry:
    """What :func:`choose_centre` reads off a background, once, on a grid of about 2 mm voxels
    (the centre voxel of each block of the scan's grid)."""

    step: np.ndarray  #: (3,) the scan's voxels per grid voxel
    ras: np.ndarray  #: (N, 3) RAS mm of the grid's lung voxels
    depth_mm: np.ndarray  #: (N,) distance to the outside of the lung mask (mm)
    vessel_mm: np.ndarray  #: (N,) distance to the nearest vessel of at least ~3 mm (mm)
    medial: np.ndarray  #: (N,) the nearest pleura is the mediastinal one
    costal: np.ndarray  #: (N,) the nearest pleura is the chest wall's (facing out, front or back; not down or up)
    posterior: np.ndarray  #: (N,) the nearest pleura faces back (the dependent, posterior wall)
    z_room_mm: np.ndarray  #: (N,) distance to the first or last slice (mm)


def _geometry(bg: Background, voxel_mm: float = 2.0) -> _Geometry:
    if isinstance(bg.geometry, _Geometry):
        return bg.geometry
    sp0 = bg.spacing
    step = np.maximum(1, np.floor(voxel_mm / sp0 + 1e-6)).astype(int)
    cut = tuple(slice(int(s) // 2, None, int(s)) for s in step)
    sp = sp0 * step
    smooth = ndimage.gaussian_filter(bg.hu, 1.0 / sp0)[cut]
    # the aerated lung, tight to the pleura (the masker's mask is generous by a few mm there), with
    # the vessels inside it filled in slice by slice
    lung = fill_holes_2d(bg.lung[cut] & (smooth < -400))
    depth, idx = ndimage.distance_transform_edt(lung, sampling=sp, return_indices=True)
    pts = np.argwhere(lung)
    out_pts = idx[(slice(None), pts[:, 0], pts[:, 1], pts[:, 2])].T  # nearest voxel outside the lung
    del idx
    to_ras = bg.affine[:3, :3] * step[None, :]
    origin = bg.affine[:3, 3] + bg.affine[:3, :3] @ (step // 2)
    ras = pts @ to_ras.T + origin
    normal = (out_pts - pts) @ to_ras.T
    normal /= np.maximum(np.linalg.norm(normal, axis=1, keepdims=True), 1e-6)
    vessels = (smooth > -400) & ndimage.binary_erosion(lung)
    vessels = ndimage.binary_opening(vessels)  # at least ~3 voxels (about 6 mm) across drops; tubes of 3+ mm stay
    vessel_mm = ndimage.distance_transform_edt(~vessels, sampling=sp) if vessels.any() \
        else np.full(lung.shape, 1e9)
    midline = float(np.median(ras[:, 0]))
    half = np.abs(ras[:, 0] - midline)
    towards_mid = np.sign(midline - ras[:, 0]) * normal[:, 0]
    sideways = np.abs(normal[:, 2]) < 0.7  # not the diaphragm below nor the apex above
    medial = (towards_mid > 0.5) & (half < 0.6 * half.max()) & sideways
    costal = (towards_mid < 0.3) & sideways
    z = pts[:, 2] * sp[2]
    geo = _Geometry(step, ras, depth[tuple(pts.T)].astype(np.float32), vessel_mm[tuple(pts.T)].astype(np.float32),
                    medial, costal, normal[:, 1] < -0.6, np.minimum(z, (lung.shape[2] - 1) * sp[2] - z))
    bg.geometry = geo
    return geo


def choose_centre(bg: Background, place: str, diameter_mm: float, rng: np.random.Generator,
                  taken: Sequence[tuple[np.ndarray, float]] = (), posterior: bool | None = None
                  ) -> tuple[np.ndarray, bool] | None:
    """A lesion centre (RAS mm) in ``place`` for a lesion of ``diameter_mm``, clear of ``taken``
    lesions and the background's real ones; with ``posterior`` True/False, on that side of a
    ``pleura`` place. Returns ``(centre, posterior)`` or None where the place has no room."""
    if place not in PLACES:
        raise ValueError(f"unknown place {place!r}; use one of {PLACES}")
    geo = _geometry(bg)
    r = diameter_mm / 2
    grid_mm = float((bg.spacing * geo.step).max())
    if place == "free":
        ok = (geo.depth_mm >= r + 5) & (geo.vessel_mm >= min(r + 1, 6.0))  # a large one cannot miss every vessel
    elif place == "vessel":
        ok = (geo.depth_mm >= r + 4) & (geo.vessel_mm >= 0.5 * r) & (geo.vessel_mm <= max(r, 0.5 * r + grid_mm))
    else:  # against the pleura: the centre 0.7 r inside it, the nearest pleura of that kind
        ok = np.abs(geo.depth_mm - 0.7 * r) <= max(grid_mm, 0.15 * r)
        ok &= geo.medial if place == "mediastinum" else geo.costal
        if place == "pleura" and posterior is not None:
            ok &= geo.posterior if posterior else ~geo.posterior
    ok &= geo.z_room_mm >= r + 5  # the whole lesion inside the scan's z range
    for c, rr in [*bg.exclude, *taken]:
        ok &= np.linalg.norm(geo.ras - c, axis=1) > rr + r + 15.0
    if not ok.any():
        return None
    i = int(rng.choice(np.flatnonzero(ok)))
    jitter = rng.uniform(-0.5, 0.5, 3) * bg.spacing * geo.step
    return geo.ras[i] + jitter, bool(place == "pleura" and geo.posterior[i])


def draw_lesion(kind: str, rng: np.random.Generator, diameter_mm: float | None = None,
                gg_hu: float | None = None, core_frac: float | None = None) -> dict[str, Any]:
    """The size and densities of a lesion of ``kind`` (those given are kept): nodules log-uniform in
    4-30 mm, masses uniform in 30-70 mm; ground glass uniform in -800 to -300 HU; a part-solid
    core of 10-60 % of the diameter (0 for ground glass, 1 for solid nodules and masses)."""
    if kind not in KINDS:
        raise ValueError(f"unknown lesion kind {kind!r}; use one of {KINDS}")
    if diameter_mm is None:
        diameter_mm = float(rng.uniform(*MASS_MM)) if kind == "mass" else \
            float(np.exp(rng.uniform(np.log(NODULE_MM[0]), np.log(NODULE_MM[1]))))
    out: dict[str, Any] = {"kind": kind, "diameter_mm": round(float(diameter_mm), 2),
                           "lobulation": 0.10 if kind == "mass" else 0.04}
    if kind in ("solid", "mass"):
        out.update(core_frac=1.0, gg_hu=SOLID_HU)
    else:
        out["gg_hu"] = round(float(gg_hu if gg_hu is not None else rng.uniform(*GG_HU)), 1)
        if kind == "ground-glass":
            out["core_frac"] = 0.0
        else:
            out["core_frac"] = round(float(core_frac if core_frac is not None else rng.uniform(0.1, 0.6)), 3)
    return out


def write_lesion_bed(bg: Background, inserted: Sequence[tuple[str, Sequence[InsertedLesion]]],
                     out_dir: str | Path) -> Path:
    """Write each ``(name, lesions)`` as ``out_dir/<name>.nii.gz`` (int16 HU, the background's
    affine) with ``truth.csv`` (one row per lesion, ``ct`` naming its scan) and ``datalist.json``
    (images only, ``split`` test) beside them; returns the truth file."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    truth = out / "truth.csv"
    rows, items = [], []
    for name, lesions in inserted:
        hu = insert_lesions(bg, lesions)
        path = out / f"{name}.nii.gz"
        # NIfTI stores LPS-flipped RAS: nibabel's affine is RAS already
        nib.save(nib.Nifti1Image(np.clip(np.rint(hu), -32768, 32767).astype(np.int16), bg.affine), str(path))
        items.append({"image": path.name, "subject": name, "label": 1, "split": "test", "background": bg.name})
        rows += [{"ct": name, "background": bg.name, **lesion.row()} for lesion in lesions]
    new = not truth.exists()
    with open(truth, "a", newline="") as fh:
        if rows:
            w = csv.DictWriter(fh, fieldnames=list(rows[0]))
            if new:
                w.writeheader()
            w.writerows(rows)
    dl = out / "datalist.json"
    old = json.loads(dl.read_text())["data"] if dl.exists() else []
    dl.write_text(json.dumps({"data": [*old, *items]}, indent=1))
    return truth


def read_truth(path: str | Path) -> dict[str, list[InsertedLesion]]:
    """``truth.csv`` back into lesions, per scan name."""
    out: dict[str, list[InsertedLesion]] = {}
    with open(path, newline="") as fh:
        for r in csv.DictReader(fh):
            lesion = InsertedLesion(r["kind"], r["place"], float(r["diameter_mm"]),
                                    (float(r["rasX"]), float(r["rasY"]), float(r["rasZ"])), float(r["core_frac"]),
                                    float(r["gg_hu"]), float(r["solid_hu"]), float(r["lobulation"]),
                                    r["posterior"] in ("True", "true", "1"), int(r["seed"]))
            out.setdefault(r["ct"], []).append(lesion)
    return out


def plan_lesions(bg: Background, cells: Mapping[tuple[str, str], int], rng: np.random.Generator,
                 per_scan: int = 2) -> list[list[InsertedLesion]]:
    """Lesions for ``cells`` ({(kind, place): count}) on ``bg``, grouped ``per_scan`` to an inserted
    scan (masses one to a scan), each clear of the others in its scan; a lesion whose place has no
    room on this background is left out (the returned groups say what was placed)."""
    todo = [(k, p) for (k, p), n in cells.items() for _ in range(n)]
    order = rng.permutation(len(todo))
    scans: list[list[InsertedLesion]] = []
    current: list[InsertedLesion] = []
    for i in order:
        kind, place = todo[i]
        spec = draw_lesion(kind, rng)
        if place == "pleura":  # a third of the chest-wall lesions on the dependent, posterior wall
            side: bool | None = bool(rng.random() < 1 / 3)
        else:
            side = None
        cap = 1 if kind == "mass" else per_scan
        if current and (len(current) >= cap or kind == "mass" or any(x.kind == "mass" for x in current)):
            scans.append(current)
            current = []
        taken = [(np.asarray(x.centre_ras), x.radius_mm) for x in current]
        got = choose_centre(bg, place, spec["diameter_mm"], rng, taken, side)
        if got is None:
            continue
        centre, post = got
        current.append(InsertedLesion(place=place, centre_ras=(float(centre[0]), float(centre[1]), float(centre[2])),
                                      posterior=post,
                                      seed=int(rng.integers(2**31)), **spec))
    if current:
        scans.append(current)
    return scans
