"""The smallest volume lungcal masks and searches for nodules, checked as soon as a CT is loaded.

A volume below these limits (one slice, a few slices, a small matrix, a crop) is refused by
:func:`require_extent` with one :class:`~lungcal.errors.DataError` naming the file, its voxels,
voxel size and extent, and the minimum, before the lung mask or the detector runs
(:class:`~lungcal.ct.transforms.LoadCTd` and :class:`~lungcal.ct.transforms.LungMaskd` call it):

- **every axis holds at least** :data:`MIN_VOXELS` **(3) voxels.** The detector's peaks are maxima
  over a 3x3x3 neighbourhood in space (and scale), its Laplacian and Hessian are central
  differences, and the lung masker's components are face-connected in 3D: with fewer voxels along
  an axis the search is a 2D one with replicated edges.
- **every axis spans at least** :data:`MIN_EXTENT_MM` **(50 mm).** That is the largest lesion the
  built-in detector probes (``LoGBlobDetector.radii_mm`` up to 25 mm, a 50 mm mass): a thinner
  volume cuts such a lesion, and its scale-space peak moves to a smaller scale or vanishes.
  Measured on the real LIDC-IDRI-0001 scan (2.5 mm slices, 2.5 mm bag voxels): slabs of 15 and 20 mm
  centred on its 34 mm nodule lose it (the nearest candidate is 50 mm away), slabs of 30 mm and
  more rank it first. A chest CT spans 200-350 mm from apex to bases and 300-500 mm across.

What these limits replace: a single slice of 1.5 mm or less crashed inside the lung masker
(``RuntimeError: applying transform LungMaskd``: its ~3 mm sub-sampled grid kept no plane of it),
and a slice or a few slices thicker than that were masked and searched as if they were a chest (one
10 mm slice through both lungs holds the 150 mL of lung the masker asks for). The series checks
(:mod:`lungcal.ct.qc`, ``geometry``: 16 voxels per axis) refuse such volumes too, where they run;
these limits hold wherever a CT is preprocessed, with or without the checks.
"""
from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np

from lungcal.errors import DataError

__all__ = ["MIN_VOXELS", "MIN_EXTENT_MM", "extent_problem", "require_extent"]

#: voxels along every axis (a 3x3x3 neighbourhood, central differences, 3D components)
MIN_VOXELS = 3
#: millimetres along every axis: the largest lesion the built-in detector probes (2 x 25 mm)
MIN_EXTENT_MM = 50.0
_AXES = ("x (left-right)", "y (front-back)", "z (slices)")
_FIX = "export the whole axial chest CT series (apex to bases), not a single slice, a scout or a cropped region"


def extent_problem(shape: Sequence[int], spacing: Sequence[float] | np.ndarray,
                   min_voxels: int = MIN_VOXELS, min_mm: float = MIN_EXTENT_MM) -> str | None:
    """Why a volume of ``shape`` voxels (X, Y, Z) of ``spacing`` mm is too small, or None when it is not."""
    shape = [int(s) for s in shape][-3:]
    sp = np.abs(np.asarray(spacing, np.float64).reshape(-1)[:3])
    if len(shape) != 3 or sp.size != 3:
        return f"not a 3D volume ({len(shape)} axes)"
    extent = [n * s for n, s in zip(shape, sp)]
    short = [f"{_AXES[i]}: {shape[i]} voxel{'s' if shape[i] != 1 else ''}, {extent[i]:.1f} mm"
             for i in range(3) if shape[i] < min_voxels or extent[i] < min_mm - 1e-6]
    if not short:
        return None
    dims = "x".join(str(s) for s in shape)
    vox = "x".join(f"{s:.2f}" for s in sp)
    return (f"the volume is too small for the lung mask and the nodule detector ({dims} voxels of {vox} mm; "
            f"too thin along {'; '.join(short)}): every axis needs at least {min_voxels} voxels and "
            f"{min_mm:g} mm")


def require_extent(shape: Sequence[int], spacing: Sequence[float] | np.ndarray,
                   file: str | os.PathLike | None = None) -> None:
    """Raise a :class:`DataError` naming ``file`` when :func:`extent_problem` finds the volume too small."""
    why = extent_problem(shape, spacing)
    if why is not None:
        raise DataError(why, file=file, fix=_FIX)
