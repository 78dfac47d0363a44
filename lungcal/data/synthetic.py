"""Synthetic chest-CT cohort: the built-in default data and the test bed for everything downstream.

Each CT is a phantom in HU: body outline (fat over muscle), two lungs with parenchymal texture, a
heart, a vessel tree and the airways (trachea, main bronchi), ribs and a spine, blurred by a
scanner kernel and overlaid with noise, then nodules.

Labels (the generative model, exact and documented so the Bayes limit is known)
    A CT's label ``y ~ Bernoulli(prevalence)``. A negative CT has ``n ~ Poisson(lam)`` benign
    nodules; a positive CT has one malignant nodule plus ``Poisson(lam)`` benign ones. Each nodule
    has three independent features whose distribution depends on its class
    (:data:`NODULE_MODEL`): diameter (log-normal, 4-30 mm), margin (smooth / lobulated /
    spiculated) and attenuation (solid / part-solid / calcified). The classes overlap, so the
    best possible classifier that sees every nodule's exact features has the posterior
    ``P(y=1 | x) = odds / (1 + odds)``, ``odds = prevalence / (1 - prevalence) * (1/lam) * sum_j r(x_j)``
    with ``r = f_malignant / f_benign`` (derivation: the malignant nodule sits at a uniformly
    random position among the ``n`` nodules). :func:`bayes_auc` simulates that model and reports
    the AUC of this posterior: about 0.87, independent of the prevalence.

Outputs of :func:`make_cohort` (folder ``out_dir``)
    * ``dicom/<ct>/slice_XXXX.dcm``: one series per CT, CT modality, correct geometry
      (ImagePositionPatient/ImageOrientationPatient/PixelSpacing/SliceThickness), stored as
      unsigned HU+1024 with ``RescaleIntercept=-1024``; planted *fake* identifiers (PatientName,
      PatientID, PatientBirthDate, AccessionNumber, study/series dates, UIDs);
    * ``nifti/<ct>.nii.gz`` (if ``"nifti"`` in ``formats``);
    * ``annotations.csv``: LUNA16 style ``seriesuid, coordX, coordY, coordZ, diameter_mm`` (world
      mm, LPS as in LUNA16/ITK) plus ``malignant, margin, attenuation, subject, ct, rasX, rasY, rasZ``.
      ``seriesuid`` is a (fake) DICOM UID: key ground truth by ``ct`` / ``subject`` (pseudonyms),
      never by the UID, in anything that is logged;
    * ``truth.csv``: per CT ``ct, subject, label, bayes_p, n_nodules`` (the Bayes posterior);
    * ``datalist.json``: rows ``{image, label, subject, site, split, ct}``, split by patient,
      stratified, seeded;
    * ``planted_identifiers.json``: every planted identifier, so privacy tests can scan logs, MLflow
      runs and caches for them. Nothing references this file.

Folder and file names use pseudonyms only. Everything is deterministic by ``seed`` (and
independent of the number of worker processes).
"""
from __future__ import annotations

import csv
import json
import logging
import math
import os
import shutil
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np
from scipy import ndimage as ndi

from lungcal.errors import ConfigError

from ..paths import lungcal_home
from .manifest import save_manifest
from .splits import apply_splits, pseudonym

__all__ = [
    "ScannerProfile",
    "Nodule",
    "NODULE_MODEL",
    "DEMO_DEFAULTS",
    "sample_nodule_features",
    "bayes_posterior",
    "bayes_auc",
    "make_phantom",
    "make_cohort",
    "ensure_demo_cohort",
    "write_dicom_series",
]

log = logging.getLogger(__name__)

# ------------------------------------------------------------------------------------------------
# the nodule model
# ------------------------------------------------------------------------------------------------
MARGINS = ("smooth", "lobulated", "spiculated")
ATTENUATIONS = ("solid", "part-solid", "calcified")

#: class-conditional feature distributions: diameter ~ clip(exp(N(log median, sigma)), 4, 30) mm
NODULE_MODEL = {
    "lam": 1.2,  # mean number of benign nodules per CT
    "benign": {"median_mm": 6.5, "sigma": 0.45, "margin": (0.62, 0.30, 0.08),
               "attenuation": (0.78, 0.08, 0.14)},
    "malignant": {"median_mm": 11.0, "sigma": 0.50, "margin": (0.30, 0.40, 0.30),
                  "attenuation": (0.70, 0.28, 0.02)},
}
_D_MIN, _D_MAX = 4.0, 30.0


@dataclass
class ScannerProfile:
    """Scanner/site parameters of a synthetic cohort.

    Attributes:
        site: the site name written into the datalist rows.
        noise_hu: standard deviation of the image noise in HU.
        kernel_sigma_mm: Gaussian blur of the reconstruction kernel (mm); 0 = sharp.
        hu_offset: a calibration offset added to every voxel (HU).
        manufacturer: written to DICOM ``Manufacturer``.
    """

    site: str = "synthetic"
    noise_hu: float = 20.0
    kernel_sigma_mm: float = 0.7
    hu_offset: float = 0.0
    manufacturer: str = "LUNGCAL-SIM"


@dataclass
class Nodule:
    """One planted nodule (centre in LPS world mm)."""

    center_lps: tuple[float, float, float]
    diameter_mm: float
    malignant: bool
    margin: str
    attenuation: str


#: the built-in demo cohort (see :func:`ensure_demo_cohort`)
DEMO_DEFAULTS = {
    "n_subjects": 1000,
    "prevalence": 0.4,
    "seed": 0,
    "shape": (128, 128, 96),
    "spacing": (2.5, 2.5, 2.5),
    "formats": ("dicom",),
}


def _diameter_pdf(d: np.ndarray, median: float, sigma: float) -> np.ndarray:
    # log-normal truncated to [4, 30] mm
    from scipy.stats import norm

    z = (np.log(d) - math.log(median)) / sigma
    mass = norm.cdf((math.log(_D_MAX) - math.log(median)) / sigma) - norm.cdf((math.log(_D_MIN) - math.log(median)) / sigma)
    return norm.pdf(z) / (sigma * d * mass)


def sample_nodule_features(rng: np.random.Generator, malignant: bool, n: int = 1):
    """Draw ``n`` nodules' (diameter_mm, margin index, attenuation index) for one class."""
    p = NODULE_MODEL["malignant" if malignant else "benign"]
    lo, hi = math.log(_D_MIN), math.log(_D_MAX)
    d = np.empty(n)
    todo = np.arange(n)
    while todo.size:  # truncated log-normal by rejection (acceptance > 95 %)
        x = rng.normal(math.log(p["median_mm"]), p["sigma"], todo.size)
        ok = (x >= lo) & (x <= hi)
        d[todo[ok]] = np.exp(x[ok])
        todo = todo[~ok]
    margin = rng.choice(3, size=n, p=p["margin"])
    att = rng.choice(3, size=n, p=p["attenuation"])
    return d, margin, att


def _likelihood_ratio(d: np.ndarray, margin: np.ndarray, att: np.ndarray) -> np.ndarray:
    b, m = NODULE_MODEL["benign"], NODULE_MODEL["malignant"]
    r = _diameter_pdf(d, m["median_mm"], m["sigma"]) / _diameter_pdf(d, b["median_mm"], b["sigma"])
    r = r * np.asarray(m["margin"])[margin] / np.asarray(b["margin"])[margin]
    return r * np.asarray(m["attenuation"])[att] / np.asarray(b["attenuation"])[att]


def bayes_posterior(diameters, margins, attenuations, prevalence: float) -> float:
    """Exact ``P(y=1 | all nodules' features)`` of one CT under :data:`NODULE_MODEL`."""
    d = np.asarray(diameters, float)
    if d.size == 0:
        return 0.0
    lr = _likelihood_ratio(d, np.asarray(margins, int), np.asarray(attenuations, int)).sum() / NODULE_MODEL["lam"]
    odds = prevalence / (1 - prevalence) * lr
    return float(odds / (1 + odds))


def _rank_auc(scores: np.ndarray, labels: np.ndarray) -> float:
    from scipy.stats import rankdata

    ranks = rankdata(scores)
    pos = labels == 1
    n1, n0 = pos.sum(), (~pos).sum()
    return float((ranks[pos].sum() - n1 * (n1 + 1) / 2) / (n1 * n0))


def bayes_auc(n: int = 200_000, prevalence: float = 0.11, seed: int = 12345) -> float:
    """AUC of the Bayes-optimal CT-level posterior over ``n`` simulated CTs (features only).

    This is the ceiling for any model that sees the nodules perfectly; the synthetic cohort is
    tuned so it is about 0.87 (it does not depend on the prevalence).
    """
    rng = np.random.default_rng(seed)
    y = rng.random(n) < prevalence
    nb = rng.poisson(NODULE_MODEL["lam"], n)
    nm = y.astype(int)
    # flatten all nodules, tag with their CT
    ct_b = np.repeat(np.arange(n), nb)
    ct_m = np.repeat(np.arange(n), nm)
    db, mb, ab = sample_nodule_features(rng, False, ct_b.size)
    dm, mm, am = sample_nodule_features(rng, True, ct_m.size)
    lr = np.concatenate([_likelihood_ratio(db, mb, ab), _likelihood_ratio(dm, mm, am)])
    ct = np.concatenate([ct_b, ct_m])
    score = np.bincount(ct, weights=lr, minlength=n) / NODULE_MODEL["lam"]
    odds = prevalence / (1 - prevalence) * score
    return _rank_auc(odds / (1 + odds), y.astype(int))


# ------------------------------------------------------------------------------------------------
# the phantom
# ------------------------------------------------------------------------------------------------
def _grid(shape, spacing, origin):
    ax = [np.float32(origin[i]) + np.arange(shape[i], dtype=np.float32) * np.float32(spacing[i]) for i in range(3)]
    return ax[0][:, None, None], ax[1][None, :, None], ax[2][None, None, :]


def _smooth_noise(rng, shape, sigma_vox, amp):
    n = rng.standard_normal(shape, dtype=np.float32)
    n = ndi.gaussian_filter(n, sigma_vox, mode="wrap", truncate=2.5)
    n *= np.float32(amp / (n.std() + 1e-6))
    return n


def _segment_tube(vol, lo_mask, p0, p1, radius, value, spacing, origin, soft=True):
    """Paint a tube between world points p0 and p1 (LPS mm) into ``vol`` inside its bounding box."""
    spacing = np.asarray(spacing, np.float32)
    origin = np.asarray(origin, np.float32)
    lo = np.floor((np.minimum(p0, p1) - radius - 1 - origin) / spacing).astype(int)
    hi = np.ceil((np.maximum(p0, p1) + radius + 1 - origin) / spacing).astype(int) + 1
    lo = np.clip(lo, 0, vol.shape)
    hi = np.clip(hi, 0, vol.shape)
    if (hi <= lo).any():
        return
    sl = tuple(slice(a, b) for a, b in zip(lo, hi))
    x, y, z = _grid(hi - lo, spacing, origin + lo * spacing)
    d = np.asarray(p1, np.float32) - np.asarray(p0, np.float32)
    L2 = float(d @ d) + 1e-6
    t = np.clip(((x - p0[0]) * d[0] + (y - p0[1]) * d[1] + (z - p0[2]) * d[2]) / L2, 0, 1)
    dist = np.sqrt((x - p0[0] - t * d[0]) ** 2 + (y - p0[1] - t * d[1]) ** 2 + (z - p0[2] - t * d[2]) ** 2)
    vox = float(spacing.min())
    alpha = np.clip(0.5 - (dist - radius) / vox, 0, 1) if soft else (dist <= radius).astype(np.float32)
    if lo_mask is not None:
        alpha = alpha * lo_mask[sl]
    sub = vol[sl]
    sub += alpha * (value - sub)


def _render_nodule(vol, nod: Nodule, rng, spacing, origin):
    spacing = np.asarray(spacing, np.float32)
    origin = np.asarray(origin, np.float32)
    R = nod.diameter_mm / 2
    c = np.asarray(nod.center_lps, np.float32)
    ext = R * (2.2 if nod.margin == "spiculated" else 1.4) + 2
    lo = np.clip(np.floor((c - ext - origin) / spacing).astype(int), 0, vol.shape)
    hi = np.clip(np.ceil((c + ext - origin) / spacing).astype(int) + 1, 0, vol.shape)
    if (hi <= lo).any():
        return
    sl = tuple(slice(a, b) for a, b in zip(lo, hi))
    x, y, z = _grid(hi - lo, spacing, origin + lo * spacing)
    dx, dy, dz = x - c[0], y - c[1], z - c[2]
    r = np.sqrt(dx * dx + dy * dy + dz * dz) + 1e-6
    radius = np.full(r.shape, R, np.float32)
    if nod.margin != "smooth":  # lobulation: a few low-order bumps of the surface
        k = 3 if nod.margin == "lobulated" else 2
        for _ in range(k):
            v = rng.standard_normal(3).astype(np.float32)
            v /= np.linalg.norm(v)
            cosang = (dx * v[0] + dy * v[1] + dz * v[2]) / r
            radius = radius + R * (0.22 if nod.margin == "lobulated" else 0.12) * np.cos(rng.integers(2, 4) * np.arccos(np.clip(cosang, -1, 1)))
    vox = float(spacing.min())
    alpha = np.clip(0.5 - (r - radius) / vox, 0, 1)
    sub = vol[sl]
    if nod.attenuation == "part-solid":
        core = np.clip(0.5 - (r - 0.5 * radius) / vox, 0, 1)
        target = -480 + core * (520)  # ground glass (-480 HU) around a solid core (+40)
    elif nod.attenuation == "calcified":
        core = np.clip(0.5 - (r - 0.6 * radius) / vox, 0, 1)
        target = 40 + core * 560  # dense central calcification (+600 HU)
    else:
        target = np.float32(35)
    sub += alpha * (target - sub)
    if nod.margin == "spiculated":  # thin radiating spicules
        for _ in range(int(rng.integers(6, 11))):
            v = rng.standard_normal(3)
            v /= np.linalg.norm(v)
            L = R * rng.uniform(1.6, 2.2)
            _segment_tube(vol, None, c + v * R * 0.6, c + v * L, max(0.6, 0.07 * R), 20.0, spacing, origin)


def _lung_masks(shape, spacing, origin, anat):
    x, y, z = _grid(shape, spacing, origin)
    masks = []
    for side in (-1, 1):  # -1: right lung (LPS x < 0), +1: left lung
        cx = side * anat["lung_dx"]
        ph = anat["bump_phase"]
        bumps = 1 + 0.06 * np.sin(ph[0] + side + z / np.float32(23)) * np.cos(ph[1] - side + y / np.float32(31))
        e = ((x - cx) / anat["lung_a"]) ** 2 + ((y - anat["lung_cy"]) / anat["lung_b"]) ** 2 + ((z - anat["lung_cz"]) / anat["lung_c"]) ** 2
        lung = e < bumps
        # flat diaphragmatic base (dome): cut below a paraboloid
        base = anat["lung_cz"] - 0.72 * anat["lung_c"] + 0.004 * ((x - cx) ** 2 + (y - anat["lung_cy"]) ** 2)
        lung &= z > base
        masks.append(lung)
    # the heart indents the left lung
    heart = (((x - anat["heart_x"]) / 55) ** 2 + ((y - anat["heart_y"]) / 48) ** 2 + ((z - anat["heart_z"]) / 60) ** 2) < 1
    masks[1] &= ~heart
    masks[0] &= ~heart
    return masks, heart


def make_phantom(rng: np.random.Generator, shape: Sequence[int], spacing: Sequence[float],
                 nodules: Sequence[Nodule] = (), scanner: ScannerProfile | None = None,
                 lungs: bool = True, anat: dict | None = None):
    """Render one chest phantom.

    Args:
        rng: the random generator (all randomness of the CT comes from it).
        shape: ``(X, Y, Z)`` voxels; X = patient left (LPS +x), Y = posterior, Z = superior.
        spacing: ``(dx, dy, dz)`` mm.
        nodules: nodules to plant (centres in LPS mm); see :func:`place_nodules`.
        scanner: noise and kernel; default :class:`ScannerProfile`.
        lungs: False renders an abdomen-like slab without lungs (for tests).
        anat: anatomy parameters (from :func:`sample_anatomy`); drawn from ``rng`` when None.

    Returns:
        ``(hu int16 (X, Y, Z), origin_lps (3,), lung_mask bool (X, Y, Z))``.
    """
    scanner = scanner or ScannerProfile()
    shape = tuple(int(s) for s in shape)
    spacing = np.asarray(spacing, np.float32)
    origin = -(np.asarray(shape) - 1) / 2 * spacing
    anat = anat or sample_anatomy(rng, shape, spacing)
    x, y, z = _grid(shape, spacing, origin)
    vol = np.full(shape, -1000, np.float32)
    # body: fat shell over muscle (elliptic cylinder)
    rho = np.sqrt((x / anat["body_a"]) ** 2 + ((y - anat["body_cy"]) / anat["body_b"]) ** 2)  # (X,Y,1)
    body2d = rho < 1
    fat = body2d & (rho > 1 - anat["fat_frac"])
    vol[np.broadcast_to(body2d, shape)] = 45.0
    vol[np.broadcast_to(fat, shape)] = -100.0
    # soft-tissue texture
    tex = _smooth_noise(rng, shape, 2.0, 12.0)
    tex *= body2d
    vol += tex
    lung_mask = np.zeros(shape, bool)
    if lungs:
        (lr, ll), heart = _lung_masks(shape, spacing, origin, anat)
        lung_mask = lr | ll
        tex = _smooth_noise(rng, shape, 1.2, 28.0)
        vol[lung_mask] = -860.0 + tex[lung_mask]
        vol[heart & np.broadcast_to(body2d, shape)] = 40.0
        # vessel tree: branching tubes from each hilum, only inside the lungs
        for side, lmask in ((-1, lr), (1, ll)):
            hilum = np.array([side * (anat["lung_dx"] - 0.55 * anat["lung_a"]), anat["lung_cy"], anat["lung_cz"]], np.float32)
            stack = [(hilum, np.array([side, 0.2 * rng.standard_normal(), dz], np.float32), 3.5, 0)
                     for dz in (1.2, 0.1, -1.0)]
            while stack:
                p, d, rad, depth = stack.pop()
                d = np.asarray(d, np.float32)
                d[0] = abs(d[0]) * side  # grow outwards, towards the pleura
                d /= np.linalg.norm(d)
                length = rng.uniform(22, 38) * (0.78 ** depth)
                q = p + d * length
                _segment_tube(vol, lmask, p, q, rad, 40.0, spacing, origin)
                if depth < 3 and rad > 0.8:
                    for _ in range(2):
                        stack.append((q, d + 0.7 * rng.standard_normal(3), rad * 0.72, depth + 1))
        # airways: trachea down to the carina, then the two main bronchi (air with a soft-tissue wall)
        top = np.array([0, anat["trachea_y"], z.max() + 5], np.float32)
        carina = np.array([0, anat["trachea_y"], anat["lung_cz"] + 0.15 * anat["lung_c"]], np.float32)
        _segment_tube(vol, None, top, carina, 10.0, 30.0, spacing, origin)
        _segment_tube(vol, None, top, carina, 8.0, -1000.0, spacing, origin)
        for side in (-1, 1):
            end = np.array([side * (anat["lung_dx"] - 0.6 * anat["lung_a"]), anat["lung_cy"], carina[2] - 25], np.float32)
            _segment_tube(vol, None, carina, end, 6.0, 30.0, spacing, origin)
            _segment_tube(vol, None, carina, end, 4.5, -1000.0, spacing, origin)
    # spine: vertebral bodies (cancellous 250 HU, cortex 650) with discs, spinal canal
    sx, sy = 0.0, anat["body_cy"] + anat["body_b"] - anat["spine_back"]
    rs = np.sqrt((x - sx) ** 2 + (y - sy) ** 2)
    vert = rs < 17
    disc = (np.mod(z - anat["disc_phase"], 27.0) < 5.0)
    vol[np.broadcast_to(vert & ~disc, shape)] = 250.0
    vol[np.broadcast_to((rs > 14.5) & vert & ~disc, shape)] = 650.0
    vol[np.broadcast_to(vert & disc, shape)] = 80.0
    canal = np.sqrt((x - sx) ** 2 + (y - sy - 28) ** 2) < 8
    vol[np.broadcast_to(canal, shape)] = 10.0
    ring = np.sqrt((x - sx) ** 2 + (y - sy - 28) ** 2)
    vol[np.broadcast_to((ring >= 8) & (ring < 13), shape)] = 500.0
    # ribs: bands just inside the body outline, sloping down anteriorly
    theta = np.arctan2(y - anat["body_cy"], x)  # y>0 = posterior (LPS)
    post = np.float32(1) + np.sin(theta)  # 2 at the back, 0 at the front
    rib_r = (rho > 1 - anat["fat_frac"] - 0.09) & (rho < 1 - anat["fat_frac"] - 0.035)
    not_front = np.abs(x) > 25
    # 12 rib pairs, periodic in z (one vectorised pass): u is z shifted so every rib is flat in u
    u = z - (2 - post) * 12 - (z.max() - 15)  # (X, Y, Z); 0 at the first rib
    step = np.float32(anat["rib_step"])
    ph = np.mod(u + 5, step)  # within +-5 mm of a rib centre <=> ph < 10
    band = (rib_r & not_front) & (ph < 10) & (u <= 5) & (u >= -(11 * step) - 5)
    vol[band] = 700.0
    # scanner: kernel blur, calibration offset, noise
    if scanner.kernel_sigma_mm > 0:
        vol = ndi.gaussian_filter(vol, scanner.kernel_sigma_mm / spacing, truncate=3.0)
    for nod in nodules:
        _render_nodule(vol, nod, rng, spacing, origin)
    if scanner.hu_offset:
        vol += np.float32(scanner.hu_offset)
    if scanner.noise_hu > 0:
        vol += rng.standard_normal(shape, dtype=np.float32) * np.float32(scanner.noise_hu)
    hu = np.clip(np.rint(vol), -1024, 3071).astype(np.int16)
    return hu, origin.astype(np.float64), lung_mask


def sample_anatomy(rng: np.random.Generator, shape, spacing) -> dict:
    """Random patient anatomy (mm) scaled to fit the field of view."""
    fov = np.asarray(shape) * np.asarray(spacing)
    body_a = min(rng.uniform(0.40, 0.46) * fov[0], 170.0)
    body_b = min(body_a * rng.uniform(0.68, 0.78), 0.47 * fov[1])
    zc = 0.06 * fov[2]
    return {
        "body_a": body_a, "body_b": body_b, "body_cy": 0.0, "fat_frac": rng.uniform(0.06, 0.14),
        "lung_dx": body_a * rng.uniform(0.40, 0.46), "lung_a": body_a * rng.uniform(0.30, 0.34),
        "lung_b": body_b * rng.uniform(0.62, 0.70), "lung_cy": body_b * 0.02,
        "lung_c": 0.50 * fov[2] * rng.uniform(0.9, 1.0), "lung_cz": zc,
        "heart_x": body_a * 0.12, "heart_y": -body_b * 0.22, "heart_z": zc - 0.30 * fov[2],
        "trachea_y": -body_b * 0.15, "spine_back": body_b * 0.42,
        "disc_phase": rng.uniform(0, 27), "rib_step": rng.uniform(20, 25),
        "bump_phase": rng.uniform(0, 6.3, 2),
    }


def place_nodules(rng, lung_mask, spacing, origin, features) -> list[Nodule]:
    """Place nodules with ``features = [(diameter, margin_idx, att_idx, malignant), ...]`` inside
    the lungs: the centre is a random lung voxel whose box of half-size ~0.6 radius lies in the lung
    (rejection sampling; juxtapleural nodules are allowed)."""
    if not features:
        return []
    spacing = np.asarray(spacing, float)
    cand = np.flatnonzero(lung_mask.ravel())
    out = []
    for d, m, a, mal in features:
        half = np.maximum(np.round(0.6 * d / 2 / spacing).astype(int), 1)
        idx = np.unravel_index(cand[rng.integers(cand.size)], lung_mask.shape)
        for _ in range(200):
            i = np.unravel_index(cand[rng.integers(cand.size)], lung_mask.shape)
            box = tuple(slice(max(c - h, 0), c + h + 1) for c, h in zip(i, half))
            if lung_mask[box].all():
                idx = i
                break
        c = np.asarray(origin) + np.asarray(idx) * spacing
        out.append(Nodule(tuple(float(v) for v in c), float(d), bool(mal), MARGINS[m], ATTENUATIONS[a]))
    return out


# ------------------------------------------------------------------------------------------------
# writers
# ------------------------------------------------------------------------------------------------
def _uid(rng: np.random.Generator) -> str:
    from pydicom.uid import generate_uid

    return generate_uid(entropy_srcs=[str(int(v)) for v in rng.integers(0, 2**62, 4)])


def fake_identifiers(rng: np.random.Generator) -> dict:
    """Planted fake identifiers of one CT (names, IDs, dates, UIDs)."""
    first = ["ALEX", "SAM", "JO", "KIM", "LEE", "PAT", "ROBIN", "CASEY", "DANA", "MORGAN"]
    last = ["QUILLFEATHER", "MARBLETON", "ZEPHYRWOOD", "OAKENSHAW", "BRAMBLECOTT", "FENWICKE"]
    y = int(rng.integers(1930, 1960))
    sy = int(rng.integers(2000, 2003))
    return {
        "PatientName": f"{last[rng.integers(len(last))]}^{first[rng.integers(len(first))]}^FAKE{int(rng.integers(10**6)):06d}",
        "PatientID": f"LCSIM{int(rng.integers(10**9)):09d}",
        "PatientBirthDate": f"{y}{int(rng.integers(1, 13)):02d}{int(rng.integers(1, 29)):02d}",
        "AccessionNumber": f"ACC{int(rng.integers(10**10)):010d}",
        "StudyDate": f"{sy}{int(rng.integers(1, 13)):02d}{int(rng.integers(1, 29)):02d}",
        "StudyInstanceUID": _uid(rng),
        "SeriesInstanceUID": _uid(rng),
        "FrameOfReferenceUID": _uid(rng),
    }


def write_dicom_series(hu: np.ndarray, origin_lps, spacing, folder: str | os.PathLike, ids: dict,
                       rng: np.random.Generator | None = None, manufacturer: str = "LUNGCAL-SIM",
                       transfer_syntax: str | None = None) -> list[Path]:
    """Write an ``(X, Y, Z)`` int16 HU volume as an axial CT series, one file per slice.

    Geometry: ImageOrientationPatient ``[1,0,0,0,1,0]``, ImagePositionPatient of slice ``k`` =
    ``origin + k * dz`` along z, PixelSpacing ``[dy, dx]`` (row spacing, column spacing), stored as
    unsigned ``HU + 1024`` with RescaleSlope 1 / RescaleIntercept -1024. ``ids`` supplies the
    (fake) patient identifiers and UIDs (see :func:`fake_identifiers`); ``transfer_syntax`` may be
    RLE Lossless (``"1.2.840.10008.1.2.5"``) to write compressed data.
    """
    from pydicom.dataset import Dataset, FileMetaDataset
    from pydicom.uid import CTImageStorage, ExplicitVRLittleEndian, RLELossless

    rng = rng or np.random.default_rng(0)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    dx, dy, dz = (float(s) for s in spacing)
    stored = (np.clip(hu.astype(np.int32), -1024, 3071) + 1024).astype(np.uint16)
    common = Dataset()  # elements shared by every slice (never mutated below)
    common.SOPClassUID = CTImageStorage
    common.Modality = "CT"
    common.ImageType = ["ORIGINAL", "PRIMARY", "AXIAL"]
    common.Manufacturer = manufacturer
    for key in ("PatientName", "PatientID", "PatientBirthDate", "AccessionNumber", "StudyDate",
                "StudyInstanceUID", "SeriesInstanceUID", "FrameOfReferenceUID"):
        setattr(common, key, ids[key])
    common.SeriesDate = common.AcquisitionDate = common.ContentDate = ids["StudyDate"]
    common.StudyTime = common.SeriesTime = "101500"
    common.PatientSex = "O"
    common.SeriesNumber = 2
    common.ImageOrientationPatient = [1.0, 0.0, 0.0, 0.0, 1.0, 0.0]
    common.PixelSpacing = [dy, dx]
    common.SliceThickness = dz
    common.SamplesPerPixel = 1
    common.PhotometricInterpretation = "MONOCHROME2"
    common.Rows, common.Columns = int(hu.shape[1]), int(hu.shape[0])
    common.BitsAllocated, common.BitsStored, common.HighBit = 16, 12, 11
    common.PixelRepresentation = 0
    common.RescaleSlope, common.RescaleIntercept, common.RescaleType = 1, -1024, "HU"
    common.WindowCenter, common.WindowWidth = -600, 1500
    def slice_ds(k: int, sop: str, fixed: bool) -> Dataset:
        meta = FileMetaDataset()
        meta.MediaStorageSOPClassUID = CTImageStorage
        meta.MediaStorageSOPInstanceUID = sop
        meta.TransferSyntaxUID = ExplicitVRLittleEndian
        ds = Dataset(dict(common))
        ds.file_meta = meta
        ds.SOPInstanceUID = sop
        z = float(origin_lps[2] + k * dz)
        if fixed:  # fixed-width strings, so later slices can be patched in place (see below)
            ds.InstanceNumber = 100000 + k + 1  # 6 digits in the template; patched as right-aligned "{k+1:>6}"
            ds.ImagePositionPatient = [_ds13(origin_lps[0]), _ds13(origin_lps[1]), _ds13(z)]
            ds.SliceLocation = _ds13(z)
        else:
            ds.InstanceNumber = k + 1
            ds.ImagePositionPatient = [float(origin_lps[0]), float(origin_lps[1]), z]
            ds.SliceLocation = z
        return ds

    n = hu.shape[2]
    paths = [folder / f"slice_{k:04d}.dcm" for k in range(n)]
    if transfer_syntax == RLELossless:
        for k, p in enumerate(paths):
            ds = slice_ds(k, _uid(rng), fixed=False)
            ds.compress(RLELossless, np.ascontiguousarray(stored[:, :, k].T))
            ds.save_as(p, enforce_file_format=True)
        return paths
    # Uncompressed: encode slice 0 with pydicom, then write every slice as that byte template with
    # its SOPInstanceUID, InstanceNumber, ImagePositionPatient, SliceLocation and pixels patched in
    # place (all fixed width). ~20x faster than one dcmwrite per slice; the tests read it back.
    from pydicom.filebase import DicomBytesIO
    from pydicom.filewriter import dcmwrite

    sops = [_fixed_uid(rng) for _ in range(n)]
    buf = DicomBytesIO()
    first = slice_ds(0, sops[0], fixed=True)
    first.PixelData = np.ascontiguousarray(stored[:, :, 0].T).tobytes()
    dcmwrite(buf, first, enforce_file_format=True)
    template = bytes(buf.getvalue())
    pix_off = len(template) - stored.shape[0] * stored.shape[1] * 2
    fields = {"meta_sop": _elem(template, 0x0002, 0x0003, b"UI"), "sop": _elem(template, 0x0008, 0x0018, b"UI"),
              "inst": _elem(template, 0x0020, 0x0013, b"IS"), "ipp": _elem(template, 0x0020, 0x0032, b"DS"),
              "loc": _elem(template, 0x0020, 0x1041, b"DS")}
    for k, p in enumerate(paths):
        z = float(origin_lps[2] + k * dz)
        values = {"meta_sop": sops[k], "sop": sops[k], "inst": f"{k + 1:>6}",
                  "ipp": "\\".join([_ds13(origin_lps[0]), _ds13(origin_lps[1]), _ds13(z)]), "loc": _ds13(z)}
        out = bytearray(template)
        for key, (off, length) in fields.items():
            v = values[key].encode("ascii")
            if len(v) > length or len(v) < length - 1:
                raise AssertionError(f"DICOM template field {key} has length {length}, value {len(v)}")
            out[off: off + length] = v.ljust(length, b"\0" if key.endswith("sop") else b" ")
        out[pix_off:] = np.ascontiguousarray(stored[:, :, k].T).tobytes()
        p.write_bytes(out)
    return paths


def _ds13(v: float) -> str:
    return f"{float(v):+.6e}"  # 13 characters, a valid DS


def _fixed_uid(rng: np.random.Generator) -> str:
    a, b, c = int(rng.integers(10**12, 10**13)), int(rng.integers(0, 10**13)), int(rng.integers(0, 10**12))
    return f"2.25.{a}{b:013d}{c:012d}"  # 2.25.<38 digits> (< 2**128), always 43 characters


def _elem(data: bytes, group: int, element: int, vr: bytes) -> tuple[int, int]:
    """(value offset, value length) of a short-form explicit-VR little-endian element."""
    import struct

    key = struct.pack("<HH", group, element) + vr
    pos = data.find(key)
    if pos < 0:
        raise AssertionError(f"element ({group:04X},{element:04X}) not in the DICOM template")
    (length,) = struct.unpack("<H", data[pos + 6: pos + 8])
    return pos + 8, length


def _write_nifti(hu: np.ndarray, origin_lps, spacing, path: Path) -> None:
    import SimpleITK as sitk

    img = sitk.GetImageFromArray(np.ascontiguousarray(hu.transpose(2, 1, 0)))
    img.SetSpacing(tuple(float(s) for s in spacing))
    img.SetOrigin(tuple(float(o) for o in origin_lps))
    path.parent.mkdir(parents=True, exist_ok=True)
    sitk.WriteImage(img, str(path), useCompression=True)


# ------------------------------------------------------------------------------------------------
# the cohort
# ------------------------------------------------------------------------------------------------
def _make_one(task: dict) -> dict:
    seed, i = task["seed"], task["index"]
    rng = np.random.default_rng([seed, i, 7])
    shape, spacing, prevalence = task["shape"], task["spacing"], task["prevalence"]
    scanner = ScannerProfile(**task["scanner"])
    label = int(rng.random() < prevalence)
    nb = int(rng.poisson(NODULE_MODEL["lam"]))
    db, mb, ab = sample_nodule_features(rng, False, nb)
    feats = [(db[j], mb[j], ab[j], False) for j in range(nb)]
    if label:
        dm, mm, am = sample_nodule_features(rng, True, 1)
        feats.insert(int(rng.integers(nb + 1)), (dm[0], mm[0], am[0], True))
    anat = sample_anatomy(rng, shape, spacing)
    origin = -(np.asarray(shape) - 1) / 2 * np.asarray(spacing, np.float32)
    lung_mask, _ = _lung_masks(tuple(shape), np.asarray(spacing, np.float32), origin, anat)
    nodules = place_nodules(rng, lung_mask[0] | lung_mask[1], spacing, origin, feats)
    hu, origin, _ = make_phantom(np.random.default_rng([seed, i, 8]), shape, spacing, nodules, scanner, anat=anat)
    ids = fake_identifiers(rng)
    subject_id = f"SIM-{seed}-{i:05d}"
    subject = pseudonym(subject_id, task["salt"])
    ct = f"{subject}_T0"
    out = Path(task["out_dir"])
    images = {}
    if "dicom" in task["formats"]:
        write_dicom_series(hu, origin, spacing, out / "dicom" / ct, ids, rng, scanner.manufacturer)
        images["dicom"] = f"dicom/{ct}/"
    if "nifti" in task["formats"]:
        _write_nifti(hu, origin, spacing, out / "nifti" / f"{ct}.nii.gz")
        images["nifti"] = f"nifti/{ct}.nii.gz"
    p = bayes_posterior([f[0] for f in feats], [f[1] for f in feats], [f[2] for f in feats], prevalence)
    return {"subject": subject, "ct": ct, "label": label, "images": images, "ids": ids, "bayes_p": p,
            "nodules": [asdict(n) for n in nodules]}


def make_cohort(
    out_dir: str | os.PathLike,
    n_subjects: int = 200,
    prevalence: float = 0.11,
    seed: int = 0,
    shape: Sequence[int] = (128, 128, 96),
    spacing: Sequence[float] = (2.5, 2.5, 2.5),
    formats: Sequence[str] = ("dicom", "nifti"),
    *,
    scanner: ScannerProfile | dict | None = None,
    splits: Sequence[float] = (0.6, 0.2, 0.2),
    image_format: str | None = None,
    salt: str | None = None,
    num_workers: int | None = None,
    progress: bool = True,
) -> Path:
    """Generate a synthetic cohort (one CT per subject) into ``out_dir``; return the datalist path.

    Args:
        out_dir: output folder (created; existing files of the same names are overwritten).
        n_subjects: number of subjects (= CTs).
        prevalence: P(label = 1); NLST-like 0.11, the demo uses 0.4.
        seed: everything is deterministic by seed.
        shape: ``(X, Y, Z)`` voxels per CT.
        spacing: ``(dx, dy, dz)`` mm.
        formats: any of ``"dicom"``, ``"nifti"``.
        scanner: :class:`ScannerProfile` (or its dict): site name, noise, kernel, HU offset.
        splits: train/val/test fractions (patient-level, stratified, seeded).
        image_format: which format the datalist points to (default: the first of ``formats``).
        salt: pseudonym salt (default ``"synthetic-<seed>"`` so a cohort is reproducible).
        num_workers: processes (default: all CPUs).
        progress: show a tqdm bar.
    """
    from tqdm import tqdm

    formats = tuple(formats)
    if not formats or any(f not in ("dicom", "nifti") for f in formats):
        raise ConfigError(f"formats must be a non-empty subset of ('dicom', 'nifti'), got {formats}", field="formats",
                          fix="use formats=('dicom',) or ('dicom', 'nifti')")
    image_format = image_format or formats[0]
    if image_format not in formats:
        raise ConfigError(f"image_format {image_format!r} is not among formats {formats}", field="image_format",
                          fix="add it to formats")
    if not 0 < prevalence < 1:
        raise ConfigError(f"prevalence must be in (0, 1), got {prevalence}", field="prevalence", fix="e.g. 0.11")
    if n_subjects < 1:
        raise ConfigError("n_subjects must be at least 1", field="n_subjects", fix="e.g. 200")
    if len(shape) != 3 or len(spacing) != 3 or min(shape) < 16:
        raise ConfigError(f"shape {shape} / spacing {spacing} must be 3 numbers each, shape >= 16 voxels",
                          field="shape", fix="e.g. shape=(128,128,96), spacing=(2.5,2.5,2.5)")
    scanner = ScannerProfile(**scanner) if isinstance(scanner, dict) else (scanner or ScannerProfile())
    out = Path(out_dir).absolute()
    out.mkdir(parents=True, exist_ok=True)
    salt = salt if salt is not None else f"synthetic-{seed}"
    tasks = [{"seed": int(seed), "index": i, "shape": tuple(int(s) for s in shape),
              "spacing": tuple(float(s) for s in spacing), "prevalence": float(prevalence),
              "scanner": asdict(scanner), "formats": formats, "out_dir": str(out), "salt": salt}
             for i in range(n_subjects)]
    workers = num_workers if num_workers is not None else (os.cpu_count() or 1)
    t0 = time.perf_counter()
    bar = tqdm(total=n_subjects, desc="synth", unit="ct", disable=not progress)
    results = []
    if workers > 1 and n_subjects > 1:
        with ProcessPoolExecutor(max_workers=min(workers, n_subjects)) as pool:
            for res in pool.map(_make_one, tasks, chunksize=max(1, n_subjects // (8 * workers))):
                results.append(res)
                bar.update()
    else:
        for t in tasks:
            results.append(_make_one(t))
            bar.update()
    bar.close()

    rows = [{"image": r["images"][image_format], "label": r["label"], "subject": r["subject"],
             "site": scanner.site, "split": "", "ct": r["ct"]} for r in results]
    rows = apply_splits(rows, splits, seed=seed, keep_existing=False)
    with open(out / "annotations.csv", "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["seriesuid", "coordX", "coordY", "coordZ", "diameter_mm", "malignant", "margin", "attenuation",
                    "subject", "ct", "rasX", "rasY", "rasZ"])
        for r in results:
            for n in r["nodules"]:
                c = n["center_lps"]
                w.writerow([r["ids"]["SeriesInstanceUID"], f"{c[0]:.3f}", f"{c[1]:.3f}", f"{c[2]:.3f}",
                            f"{n['diameter_mm']:.3f}", int(n["malignant"]), n["margin"], n["attenuation"],
                            r["subject"], r["ct"], f"{-c[0]:.3f}", f"{-c[1]:.3f}", f"{c[2]:.3f}"])
    with open(out / "truth.csv", "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["ct", "subject", "label", "bayes_p", "n_nodules"])
        for r in results:
            w.writerow([r["ct"], r["subject"], r["label"], f"{r['bayes_p']:.6f}", len(r["nodules"])])
    (out / "planted_identifiers.json").write_text(json.dumps(
        {"note": "fake identifiers planted in the synthetic DICOM headers; none may appear in logs, "
                 "MLflow or cache names", "cts": [r["ids"] for r in results]}, indent=1))
    elapsed = time.perf_counter() - t0
    params = {"n_subjects": n_subjects, "prevalence": prevalence, "seed": seed, "shape": list(shape),
              "spacing": list(spacing), "formats": list(formats), "scanner": asdict(scanner),
              "splits": list(splits), "image_format": image_format}
    (out / "cohort.json").write_text(json.dumps({**params, "nodule_model": NODULE_MODEL,
                                                 "generation_seconds": round(elapsed, 2)}, indent=1))
    log.info("synthetic cohort: %d CTs in %.1f s -> %s", n_subjects, elapsed, out)
    return save_manifest(rows, out / "datalist.json", source="synthetic", site=scanner.site)


def ensure_demo_cohort(root: str | os.PathLike | None = None, progress: bool = True, **overrides) -> Path:
    """Return the datalist of the built-in demo cohort, generating it once.

    The demo (:data:`DEMO_DEFAULTS`): 1000 subjects (600/200/200 train/val/test), prevalence 0.4,
    seed 0, 128x128x96 voxels at 2.5 mm, DICOM series in the datalist (so the real DICOM reader is
    exercised); about 2 min on two cores and 3.5 GB on disk; preprocessing one of its CTs takes
    ~0.3 s on one core. The MIL model is data-hungry: with 120 training CTs it learns nothing (test
    AUC ~0.45), with 360 it reached 0.64-0.71, with 600 0.69-0.70 (same model; single-orientation
    logits), and 200 test CTs give a 95% CI of about +-0.07 instead of +-0.09. It lives in
    ``<root>/synthetic_demo_<n_subjects>`` (``root`` defaults to ``$LUNGCAL_HOME/data`` or
    ``./runs/data``), so a change of the default never reuses an older demo; it is generated in a
    temporary sibling folder and renamed into place, so an interrupted run never leaves a
    half-written cohort. ``overrides`` change the defaults and the folder name.
    """
    if root is None:
        root = lungcal_home() / "data"
    root = Path(root).absolute()
    def _same(a, b):
        return list(a) == list(b) if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) else a == b

    overrides = {k: v for k, v in overrides.items() if k not in DEMO_DEFAULTS or not _same(v, DEMO_DEFAULTS[k])}
    params = {**DEMO_DEFAULTS, **overrides}
    name = f"synthetic_demo_{DEMO_DEFAULTS['n_subjects']}" if not overrides else "synthetic_" + "_".join(
        f"{k}-{'x'.join(map(str, v)) if isinstance(v, (list, tuple)) else v}" for k, v in sorted(overrides.items()))
    final = root / name
    datalist = final / "datalist.json"
    if datalist.is_file():
        return datalist
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=root))
    try:
        make_cohort(tmp, progress=progress, **params)
        try:
            os.rename(tmp, final)
        except OSError:  # another process won the race
            if not datalist.is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return datalist
