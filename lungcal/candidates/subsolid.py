"""A detector for solid *and* subsolid nodules: the LoG blob search run twice, on the CT as windowed
and on a ground-glass window, merged into one ranking.

Ground glass (-800 to -300 HU) stands 60-560 HU above the parenchyma (about -860 HU). In the
pipeline's window (the CT bundles' -1000 to 400 HU mapped to [0, 1]) that is a contrast of 0.04-0.4, against
0.64 for a solid nodule and the vessels, so :class:`~lungcal.candidates.detector.LoGBlobDetector`
ranks faint nodules below vessel crossings and the bag's top K leaves them out.
:class:`SubsolidLoGDetector` adds a *low-density channel*:

1. **solid channel**: :class:`LoGBlobDetector` with the settings ``solid`` on the image as given
   (its top ``top_k``);
2. **ground-glass channel**: the same detector on the image re-windowed to ``glass_window_hu``
   (default -900 to -300 HU: ground glass spans most of [0, 1]) where every voxel denser than
   ``solid_hu`` (vessels, solid nodules, solid cores, with their one-voxel partial-volume rim) is
   filled in from the lung around it, so a blob's score measures its contrast against the lung
   around it in the ground-glass range, and a vessel next to or through a faint nodule neither
   outshines nor suppresses it (setting them to the lung's level instead leaves their rims as
   rings that outrank the nodules; saturating them lets a vessel's peak suppress the nodule).
   Of its peaks only the *faint* ones are kept, those whose centre (the CT smoothed by a Gaussian
   of ``centre_sigma_mm``) is at most ``faint_max_hu``: a vessel, a solid nodule or a solid core
   is left to the solid channel, where it belongs, so the vessels that saturate this window do not
   come in twice;
3. **merge**: both lists, the faint ones' scores times ``faint_weight``, sorted by score; a
   candidate whose sphere overlaps a better one's (``max(min_distance_mm, r1 + r2)``, as inside the
   LoG detector) is dropped; the best ``top_k`` are returned.

It plugs into a bundle's ``detector`` section with ``_target_``
(``lungcal.candidates.subsolid.SubsolidLoGDetector``) and rebuilds from its :meth:`config`; the
default pipeline keeps :class:`LoGBlobDetector`. ``hu_window`` must be the window the
pipeline applied (``BagParams.hu_window``; the default is the CT bundles'), since the detector
sees only the windowed image. About twice the LoG detector's time.

Its source is not part of the bag cache's code fingerprint of every bag (so that adding it left
the default pipeline's cached bags valid); the bags it makes hash it in their key instead
(:data:`lungcal.candidates.cache.OPT_IN_DETECTORS`).

Limits at the default preset (2.5 mm voxels, 20 HU noise; docs/phantoms.md, guarded by
``tests/candidates/test_subsolid.py``): ground glass of -400 HU from 4 mm, -500 HU from 8 mm,
-600 HU from 10 mm is in the bag (K = 8) in at least 5 of 6 placements; -700 HU and fainter is
not in it up to 14 mm. Solid nodules from 3 mm, as the LoG detector. Measured on phantoms with
part-solid and ground-glass nodules and on the real scans: ``docs/results.md`` (issue 34); the
lesions the phantoms hold: ``docs/phantoms.md``.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from scipy import ndimage

from lungcal.candidates.detector import Candidates, LoGBlobDetector, _as_volume
from lungcal.ct.masking import Spacing

__all__ = ["SubsolidLoGDetector", "merge_candidates"]


def _fill_solid(glass: np.ndarray, hu: np.ndarray, lung: np.ndarray, solid_hu: float, sigma_mm: float,
                spacing: np.ndarray) -> np.ndarray:
    """The ground-glass channel with its solid voxels (``hu > solid_hu``, grown by one voxel) replaced
    by the Gaussian-weighted mean of the other voxels around them (normalised convolution); the
    lung's median level where none is near."""
    solid = ndimage.binary_dilation(hu > np.float32(solid_hu))
    if not solid.any():
        return glass
    keep = (~solid).astype(np.float32)
    sig = sigma_mm / spacing
    num = ndimage.gaussian_filter(glass * keep, sig, truncate=2.5)
    den = ndimage.gaussian_filter(keep, sig, truncate=2.5)
    level = np.float32(np.median(glass[lung & ~solid])) if (lung & ~solid).any() else np.float32(0)
    fill = np.where(den > 1e-3, num / np.maximum(den, np.float32(1e-3)), level)
    return np.where(solid, fill, glass).astype(np.float32)


def merge_candidates(lists: Sequence[Candidates], spacing: Spacing, top_k: int,
                     min_distance_mm: float = 5.0) -> Candidates:
    """Merge candidate lists into one ranking by score: greedy suppression of every candidate whose
    sphere overlaps a better one's (closer than ``max(min_distance_mm, r_better + r_weaker)``, voxel
    distances in mm), then the best ``top_k``."""
    lists = [c for c in lists if len(c)]
    if not lists or top_k <= 0:
        return Candidates()
    vox = np.concatenate([c.voxel for c in lists])
    world = np.concatenate([c.world for c in lists])
    radius = np.concatenate([c.radius_mm for c in lists])
    score = np.concatenate([c.score for c in lists])
    order = np.argsort(-score, kind="stable")
    vox, world, radius, score = vox[order], world[order], radius[order], score[order]
    pos = vox * np.asarray(spacing, np.float64).reshape(3)
    suppressed = np.zeros(len(score), bool)
    kept: list[int] = []
    for i in range(len(score)):
        if suppressed[i]:
            continue
        kept.append(i)
        if len(kept) >= top_k:
            break
        reach = np.maximum(min_distance_mm, radius[i] + radius[i + 1:])
        suppressed[i + 1:] |= np.sum((pos[i + 1:] - pos[i]) ** 2, axis=1) < reach ** 2
    k = np.asarray(kept, np.int64)
    return Candidates(vox[k], world[k], radius[k], score[k])


@dataclass
class SubsolidLoGDetector:
    """Solid and ground-glass channels of the LoG blob detector, merged (see the module docstring).

    Args:
        solid: keyword arguments of :class:`LoGBlobDetector` for both channels (its ``top_k`` is
            ignored); empty: its defaults.
        top_k: candidates returned.
        hu_window: the HU window that mapped the image to [0, 1]: the pipeline's ``hu_window``
            (default: the CT bundles', -1000 to 400 HU; a bundle passes ``"@hu_window"``).
        glass_window_hu: the ground-glass channel's window (HU mapped to [0, 1]).
        faint_max_hu: a ground-glass peak is kept when the smoothed CT at its centre is at most
            this (HU).
        solid_hu: in the ground-glass channel, voxels denser than this (HU), grown by one voxel
            (their partial-volume rim), are filled in from the voxels around them (a normalised
            Gaussian convolution of width ``fill_sigma_mm``), so that vessels and solid nodules are
            no blobs there and cannot suppress a faint nodule next to them before the faint test;
            None keeps them (saturated at 1).
        fill_sigma_mm: the width of that fill (mm).
        centre_sigma_mm: the Gaussian (mm) that smooths the CT for that test.
        faint_weight: the factor on the ground-glass channel's scores before the merge (0.6: chosen
            on 30 CTs of a phantom cohort with a third of each type, among 1, 0.6 and 0.4: 1 let
            faint candidates push solid and part-solid nodules out of the bag, 0.4 gave back the
            ground-glass gain).
        glass_log_weight: the ground-glass channel's ``log_weight`` (None: the solid channel's).
            A vessel through ground glass makes its Hessian indefinite (dot score 0), so the LoG
            term carries more of a faint nodule's score there.
        glass_radii_mm: the ground-glass channel's blob radii (mm): from 3.5 mm, since at 2.5 mm
            voxels the smallest scale finds mostly single partial-volume voxels of small vessels.
    """

    solid: Mapping[str, Any] = field(default_factory=dict)
    top_k: int = 32
    hu_window: Sequence[float] = (-1000.0, 400.0)
    glass_window_hu: Sequence[float] = (-900.0, -300.0)
    faint_max_hu: float | None = -300.0
    solid_hu: float | None = -250.0
    fill_sigma_mm: float = 3.75
    centre_sigma_mm: float = 1.5
    faint_weight: float = 0.6
    glass_radii_mm: Sequence[float] = (3.5, 5.0, 7.0, 10.0, 14.0)
    glass_log_weight: float | None = None

    def __post_init__(self) -> None:
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0")
        if not (self.hu_window[1] > self.hu_window[0] and self.glass_window_hu[1] > self.glass_window_hu[0]):
            raise ValueError(f"windows must have hi > lo, got {self.hu_window} and {self.glass_window_hu}")
        self.solid = dict(self.solid)
        self.hu_window = [float(v) for v in self.hu_window]
        self.glass_window_hu = [float(v) for v in self.glass_window_hu]
        self.glass_radii_mm = [float(v) for v in self.glass_radii_mm]
        LoGBlobDetector(**self.solid)  # fails early on a bad setting

    def config(self) -> dict[str, Any]:
        """The arguments that rebuild it (JSON): the bag cache's key and a checkpoint's record."""
        return {"_target_": f"{type(self).__module__}.{type(self).__qualname__}",
                **{f.name: getattr(self, f.name) for f in dataclasses.fields(self)}}

    def _log(self, top_k: int) -> LoGBlobDetector:
        return LoGBlobDetector(**{**self.solid, "top_k": top_k})

    def detect(self, image, lung_mask, spacing: Spacing, affine) -> Candidates:
        """Candidates of both channels, merged; at most ``top_k``, by decreasing score."""
        vol = _as_volume(image).astype(np.float32, copy=False)
        mask = _as_volume(lung_mask)
        sp = np.asarray(spacing, np.float64).reshape(3)
        solid = self._log(self.top_k).detect(vol, mask, sp, affine)
        lo, hi = self.hu_window
        glo, ghi = self.glass_window_hu
        hu = vol * np.float32(hi - lo) + np.float32(lo)
        glass = np.clip((hu - np.float32(glo)) / np.float32(ghi - glo), 0, 1)
        if self.solid_hu is not None:
            glass = _fill_solid(glass, hu, mask > 0, float(self.solid_hu), float(self.fill_sigma_mm), sp)
        glass_kw = {"top_k": 4 * self.top_k, "radii_mm": self.glass_radii_mm}
        if self.glass_log_weight is not None:
            glass_kw["log_weight"] = self.glass_log_weight
        faint = LoGBlobDetector(**{**self.solid, **glass_kw}).detect(glass, mask, sp, affine)
        del glass
        if len(faint) and self.faint_max_hu is not None:
            centre = ndimage.gaussian_filter(hu, self.centre_sigma_mm / sp, truncate=2.5) \
                if self.centre_sigma_mm > 0 else hu
            v = faint.voxel
            ok = centre[v[:, 0], v[:, 1], v[:, 2]] <= self.faint_max_hu
            faint = Candidates(v[ok], faint.world[ok], faint.radius_mm[ok], faint.score[ok] * self.faint_weight)
        min_d = float(self._log(1).min_distance_mm)
        return merge_candidates([solid, faint], sp, self.top_k, min_d)
