"""Scanner-kernel augmentation: train on CTs softened as a softer kernel and thicker slices would.

A CT's sharpness depends on the scanner: the reconstruction kernel (soft kernels blur), the
slice thickness (thick slices average along z) and the resampling to the working grid. That
sharpness decides which false positives the LoG detector ranks in a CT's top-K: on a sharp
scan the top-K false positives are small, faint vessel and noise spots; on a soft,
thick-slice scan those fall below the threshold and larger, brighter spots along the pleura and
at vessel junctions take their slots (measured on the two-site phantoms, docs/results.md: false
positives of radius 6.3 vs 3.6 mm, half of them within 3 mm of the lung border). A model trained
on sharp scans only reads those unfamiliar bags as cancer. Additive noise cannot teach it
otherwise (noise alone leaves the candidates as they are), and a patch-level blur cannot either:
it is the *choice* of candidates that moves. So the augmentation acts on the whole CT, before
the detector: each training CT is smoothed with a Gaussian of its own random width (drawn once
per CT from a seed derived from the CT's cache key, so its bag stays a deterministic cache
entry), and its candidates and patches are those of the softened scan.

This is domain randomisation over the acquisition (Tobin et al. 2017) with the classic model of a
CT's resolution, a Gaussian point-spread function whose widths add in quadrature (a 3 mm slice
profile is close to a Gaussian of sigma 3 / sqrt(12) = 0.87 mm along z). Only the training split is
augmented; validation, test, recalibration and inference bags are never softened, and the
stage-1 checkpoint's ``bag_params`` (what inference rebuilds) do not include it.

The CT bundles ship it off (``augment_kernel_mm: 0.0``). Measured over seeds on the two synthetic
sites, [1.5, 1.5, 2.0] mm brings the other scanner's shipped ECE from 0.69-0.77 to 0.10-0.21, but
costs ranking on the model's own scanner (AUC 0.69-0.73 against 0.79-0.85; the headline demo
0.045 and 0.037 lower, paired) and raises the other's only a little (0.55-0.58 against 0.52);
docs/hospital.md says when to turn it on.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
from scipy import ndimage

if TYPE_CHECKING:  # annotations only: masking imports torch and MONAI
    from .masking import Spacing

__all__ = ["draw_kernel_sigma", "soften", "check_max_sigma"]


def check_max_sigma(max_sigma_mm: Sequence[float] | float | None) -> list[float] | None:
    """``max_sigma_mm`` as three non-negative floats (mm, per axis), or None when off (None or all 0).

    Raises:
        ValueError: a negative or non-finite width, or not 1 or 3 numbers.
    """
    if max_sigma_mm is None:
        return None
    arr = np.asarray(max_sigma_mm, float).reshape(-1)
    if arr.size not in (1, 3) or not np.all(np.isfinite(arr)) or np.any(arr < 0):
        raise ValueError(f"max_sigma_mm must be one or three non-negative widths in mm, got {max_sigma_mm!r}")
    arr = np.broadcast_to(arr, (3,))
    return None if not arr.any() else [float(a) for a in arr]


def draw_kernel_sigma(max_sigma_mm: Sequence[float], seed: int) -> np.ndarray:
    """The extra Gaussian widths (mm, per axis) of one training CT: one uniform draw in
    ``[0, 1]`` scaled by each axis's maximum (the axes soften together, as a softer kernel with
    thicker slices would), from ``numpy.random.default_rng(seed)``."""
    mx = np.asarray(check_max_sigma(max_sigma_mm) or (0.0, 0.0, 0.0), float)
    return mx * np.random.default_rng(int(seed)).uniform(0.0, 1.0)


def soften(volume: np.ndarray, sigma_mm: Spacing, spacing: Spacing) -> np.ndarray:
    """``volume`` (``(X, Y, Z)``) smoothed by a Gaussian of ``sigma_mm`` per axis on a grid of
    ``spacing`` mm (``scipy.ndimage.gaussian_filter``, edges replicated); float32. Zero widths
    return a float32 copy."""
    vol = np.asarray(volume, np.float32)
    # rounded so that 1.2 mm / 0.8 mm is 1.5 voxels, not 1.4999...: scipy's kernel radius
    # int(truncate * sigma + 0.5) would otherwise lose a voxel
    sig = np.round(np.asarray(sigma_mm, float) / np.asarray(spacing, float), 9)
    if not np.any(sig > 0):
        return vol.copy()
    return ndimage.gaussian_filter(vol, sigma=sig, mode="nearest", truncate=3.0).astype(np.float32, copy=False)
