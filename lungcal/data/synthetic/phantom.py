"""The chest phantom: one synthetic CT in HU, rendered from a random anatomy and planted nodules.

Body outline (fat over muscle), two lungs with parenchymal texture, a heart, a vessel tree and the
airways (trachea, main bronchi), ribs and a spine, blurred by a scanner kernel
(:class:`ScannerProfile`) and overlaid with noise, then nodules (:class:`~.nodules.Nodule`).
Every random draw comes from the generator passed in, in a fixed order, so a CT is a pure
function of its seed. Axes are ``(X, Y, Z)`` = LPS (patient left, posterior, superior), in mm.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy import ndimage as ndi

from .nodules import ATTENUATIONS, MARGINS, Nodule

__all__ = ["make_phantom", "sample_anatomy", "place_nodules", "lung_masks", "ScannerProfile"]


def make_phantom(rng: np.random.Generator, shape: Sequence[int], spacing: Sequence[float] | np.ndarray,
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
        (lr, ll), heart = lung_masks(shape, spacing, origin, anat)
        lung_mask = lr | ll
        tex = _smooth_noise(rng, shape, 1.2, 28.0)
        vol[lung_mask] = -860.0 + tex[lung_mask]
        vol[heart & np.broadcast_to(body2d, shape)] = 40.0
        # vessel tree: branching tubes from each hilum, only inside the lungs
        for side, lmask in ((-1, lr), (1, ll)):
            hilum = np.array([side * (anat["lung_dx"] - 0.55 * anat["lung_a"]), anat["lung_cy"], anat["lung_cz"]],
                             np.float32)
            stack: list[tuple[np.ndarray, np.ndarray, float, int]] = [  # (start, direction, radius, depth)
                (hilum, np.array([side, 0.2 * rng.standard_normal(), dz], np.float32), 3.5, 0)
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
            end = np.array([side * (anat["lung_dx"] - 0.6 * anat["lung_a"]), anat["lung_cy"], carina[2] - 25],
                           np.float32)
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
    # scanner: kernel blur (and the slice profile along z), calibration offset, noise
    if scanner.slice_mm > 0:
        sigma = np.full(3, float(scanner.kernel_sigma_mm))
        sigma[2] = np.sqrt(sigma[2] ** 2 + float(scanner.slice_mm) ** 2 / 12.0)
        vol = ndi.gaussian_filter(vol, sigma / spacing, truncate=3.0)
    elif scanner.kernel_sigma_mm > 0:  # exactly as before slice profiles (pinned cohorts stay bit-identical)
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
        cx, cy, cz = (float(v) for v in np.asarray(origin) + np.asarray(idx) * spacing)
        out.append(Nodule((cx, cy, cz), float(d), bool(mal), MARGINS[m], ATTENUATIONS[a]))
    return out



def lung_masks(shape, spacing, origin, anat):
    x, y, z = _grid(shape, spacing, origin)
    masks = []
    for side in (-1, 1):  # -1: right lung (LPS x < 0), +1: left lung
        cx = side * anat["lung_dx"]
        ph = anat["bump_phase"]
        bumps = 1 + 0.06 * np.sin(ph[0] + side + z / np.float32(23)) * np.cos(ph[1] - side + y / np.float32(31))
        e = (((x - cx) / anat["lung_a"]) ** 2 + ((y - anat["lung_cy"]) / anat["lung_b"]) ** 2
             + ((z - anat["lung_cz"]) / anat["lung_c"]) ** 2)
        lung = e < bumps
        # flat diaphragmatic base (dome): cut below a paraboloid
        base = anat["lung_cz"] - 0.72 * anat["lung_c"] + 0.004 * ((x - cx) ** 2 + (y - anat["lung_cy"]) ** 2)
        lung &= z > base
        masks.append(lung)
    # the heart indents the left lung
    heart = (((x - anat["heart_x"]) / 55) ** 2 + ((y - anat["heart_y"]) / 48) ** 2
             + ((z - anat["heart_z"]) / 60) ** 2) < 1
    masks[1] &= ~heart
    masks[0] &= ~heart
    return masks, heart


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
            radius = radius + R * (0.22 if nod.margin == "lobulated" else 0.12) * np.cos(
                rng.integers(2, 4) * np.arccos(np.clip(cosang, -1, 1)))
    vox = float(spacing.min())
    alpha = np.clip(0.5 - (r - radius) / vox, 0, 1)
    sub = vol[sl]
    if nod.gg_hu is not None:  # typed subsolid: ground glass over the parenchyma (vessels stay), a solid core
        gg = np.float32(nod.gg_hu)
        glass = np.full(r.shape, gg, np.float32)
        if nod.core_frac:  # part-solid: a solid core (+40 HU) of core_frac x the diameter
            glass += np.clip(0.5 - (r - np.float32(nod.core_frac) * radius) / vox, 0, 1) * (40 - gg)
        sub += alpha * np.maximum(glass - sub, 0)
    else:
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



@dataclass
class ScannerProfile:
    """Scanner/site parameters of a synthetic cohort.

    Attributes:
        site: the site name written into the datalist rows.
        noise_hu: standard deviation of the image noise in HU.
        kernel_sigma_mm: Gaussian blur of the reconstruction kernel (mm); 0 = sharp.
        hu_offset: a calibration offset added to every voxel (HU).
        manufacturer: written to DICOM ``Manufacturer``.
        slice_mm: the slice thickness whose profile blurs along z, as a Gaussian of
            ``slice_mm / sqrt(12)`` added in quadrature to the kernel's (mm); 0 (the default, and
            every cohort made before scanner mixes): the slices are sampled, not averaged.
    """

    site: str = "synthetic"
    noise_hu: float = 20.0
    kernel_sigma_mm: float = 0.7
    hu_offset: float = 0.0
    manufacturer: str = "LUNGCAL-SIM"
    slice_mm: float = 0.0
