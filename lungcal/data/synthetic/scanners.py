"""Scanner mixes: each synthetic CT draws its acquisition from named scanner profiles.

Real screening cohorts come from many scanners: NLST mixed four vendors, soft and sharp
reconstruction kernels and 1-3 mm slices. A cohort made with ``make_cohort(scanner_mix=...)``
(``lungcal synth --scanner-mix``) does the same: each CT draws a profile by its frequency, then,
within it, a slice thickness, an in-plane pixel size, a kernel and a noise level
(:func:`draw_acquisition`, from its own generator ``default_rng([seed, index, 9])``, so the patient,
label and nodules of CT ``index`` are those of the single-scanner cohort with the same seed).

The shipped mix, :data:`FOUR_VENDORS` (``"four_vendors"``), on the demo's synthetic scale (the demo
renders at 2.5 mm; the mix keeps NLST's spread of slices and kernels around that, not real
sub-millimetre pixels, so that a mixed cohort costs about 1.3x a single-scanner one):

=========  =========  ==================  ===============  ==========================  ==========
profile    frequency  slices (mm, p)      pixel (mm)       kernel sigma (mm, p)        noise_ref
=========  =========  ==================  ===============  ==========================  ==========
vendor_a   0.35       1.25 (0.4), 2.5     U(2.2, 2.6)      soft 1.2 (0.5), sharp 0.6   18 HU
vendor_b   0.30       2.0 (0.5), 3.0      U(2.3, 2.7)      soft 1.0 (0.6), sharp 0.5   20 HU
vendor_c   0.20       2.0                 U(2.0, 2.5)      soft 1.5 (0.7), sharp 0.7   22 HU
vendor_d   0.15       2.5 (0.5), 3.0      U(2.4, 2.8)      soft 1.0 (0.5), sharp 0.5   25 HU
=========  =========  ==================  ===============  ==========================  ==========

Noise follows the usual CT scaling, thinner slices and smaller pixels being noisier and sharp kernels
noisier than soft ones: ``noise_hu = noise_ref * sqrt(2.5 / slice) * (2.5 / pixel) * (1.4 if
sharp) * exp(N(0, 0.15))``, clipped to [5, 60] HU (16-42 HU for 90% of a 600-CT cohort). The slice
profile blurs along z as a Gaussian of ``slice / sqrt(12)`` on top of the kernel
(:attr:`~.phantom.ScannerProfile.slice_mm`). The field of view stays the preset's (``shape x
spacing``, 320 x 320 x 240 mm for the demo), so the number of voxels follows the pixel and slice
sizes. A kernel is called ``sharp`` when its sigma is below :data:`SHARP_BELOW_MM` (1.0 mm), else
``soft``; a pinned scanner's rows are named the same way.

The profile names and DICOM ``Manufacturer`` values (``LUNGCAL-SIM-A`` ...) are made up: they say
which profile a CT came from, never who or which machine. The frequencies and ranges are this
project's choice in NLST's spirit (four vendors, soft and sharp kernels, thin and thick slices),
not NLST's measured shares.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

import numpy as np

from lungcal.errors import ConfigError

from .phantom import ScannerProfile

__all__ = ["ScannerModel", "ScannerMix", "Acquisition", "FOUR_VENDORS", "SCANNER_MIXES", "SHARP_BELOW_MM",
           "kernel_name", "draw_acquisition", "pinned_acquisition", "resolve_mix", "ct_grid", "mix_summary"]

#: a kernel sigma (mm) below this is called ``sharp``, else ``soft``
SHARP_BELOW_MM = 1.0
_REFERENCE_MM = 2.5  # the demo's grid: noise_ref is the noise of a 2.5 mm pixel and slice, soft kernel
_SHARP_NOISE = 1.4
_NOISE_JITTER = 0.15
_NOISE_RANGE = (5.0, 60.0)


@dataclass(frozen=True)
class ScannerModel:
    """One named scanner profile of a mix.

    Attributes:
        name: the profile name written into each row (made up, manufacturer-like).
        manufacturer: written to DICOM ``Manufacturer``.
        frequency: the share of CTs from this profile (the mix's frequencies sum to 1).
        slices_mm, slice_p: the slice thicknesses (= slice spacing) and their probabilities.
        pixel_mm: ``(low, high)`` of a uniform in-plane pixel size.
        soft_mm, sharp_mm: the Gaussian sigma of its soft and sharp kernels; ``p_soft`` of soft.
        noise_ref: noise SD (HU) at a 2.5 mm pixel and slice with the soft kernel.
    """

    name: str
    manufacturer: str
    frequency: float
    slices_mm: tuple[float, ...]
    slice_p: tuple[float, ...]
    pixel_mm: tuple[float, float]
    soft_mm: float
    sharp_mm: float
    p_soft: float
    noise_ref: float


@dataclass(frozen=True)
class ScannerMix:
    """A named mix of :class:`ScannerModel` s (their frequencies sum to 1)."""

    name: str
    models: tuple[ScannerModel, ...]

    def __post_init__(self) -> None:
        freq = [m.frequency for m in self.models]
        if not self.models or min(freq) < 0 or not math.isclose(sum(freq), 1.0, abs_tol=1e-9):
            raise ConfigError(f"scanner mix {self.name!r}: frequencies {freq} must be >= 0 and sum to 1",
                              field="scanner_mix", fix="give each profile a share, the shares summing to 1")
        for m in self.models:
            if len(m.slices_mm) != len(m.slice_p) or not math.isclose(sum(m.slice_p), 1.0, abs_tol=1e-9):
                raise ConfigError(f"profile {m.name!r}: slice probabilities {m.slice_p} must match {m.slices_mm} "
                                  "and sum to 1", field="scanner_mix", fix="one probability per slice thickness")

    def table(self) -> list[dict]:
        """The profiles as plain dicts (what ``cohort.json`` records)."""
        return [asdict(m) for m in self.models]


@dataclass(frozen=True)
class Acquisition:
    """How one CT was acquired: what its datalist row records (``row["acquisition"]``), no identifier.

    ``profile`` is the scanner profile's name (``"pinned"`` for a cohort from one pinned scanner).
    """

    profile: str
    manufacturer: str
    slice_thickness_mm: float
    pixel_mm: float
    kernel: str
    kernel_sigma_mm: float
    noise_hu: float
    hu_offset: float = 0.0

    def row(self) -> dict:
        """The row's ``acquisition`` field (numbers rounded for the datalist)."""
        d = asdict(self)
        for k in ("slice_thickness_mm", "pixel_mm", "kernel_sigma_mm", "noise_hu", "hu_offset"):
            d[k] = round(float(d[k]), 4)
        return d

    def scanner(self, site: str) -> ScannerProfile:
        """The :class:`ScannerProfile` that renders this acquisition (with its slice profile)."""
        return ScannerProfile(site=site, noise_hu=self.noise_hu, kernel_sigma_mm=self.kernel_sigma_mm,
                              hu_offset=self.hu_offset, manufacturer=self.manufacturer,
                              slice_mm=self.slice_thickness_mm)


def _model(name, manufacturer, frequency, slices, slice_p, pixel, soft, sharp, p_soft, noise_ref) -> ScannerModel:
    return ScannerModel(name, manufacturer, frequency, tuple(slices), tuple(slice_p), tuple(pixel), soft, sharp,
                        p_soft, noise_ref)


#: the shipped mix (see the module docstring's table)
FOUR_VENDORS = ScannerMix("four_vendors", (
    _model("vendor_a", "LUNGCAL-SIM-A", 0.35, (1.25, 2.5), (0.4, 0.6), (2.2, 2.6), 1.2, 0.6, 0.5, 18.0),
    _model("vendor_b", "LUNGCAL-SIM-B", 0.30, (2.0, 3.0), (0.5, 0.5), (2.3, 2.7), 1.0, 0.5, 0.6, 20.0),
    _model("vendor_c", "LUNGCAL-SIM-C", 0.20, (2.0,), (1.0,), (2.0, 2.5), 1.5, 0.7, 0.7, 22.0),
    _model("vendor_d", "LUNGCAL-SIM-D", 0.15, (2.5, 3.0), (0.5, 0.5), (2.4, 2.8), 1.0, 0.5, 0.5, 25.0),
))

#: the mixes ``make_cohort(scanner_mix=...)`` and ``lungcal synth --scanner-mix`` know by name
SCANNER_MIXES: dict[str, ScannerMix] = {FOUR_VENDORS.name: FOUR_VENDORS}


def kernel_name(sigma_mm: float) -> str:
    """``sharp`` below :data:`SHARP_BELOW_MM`, else ``soft``."""
    return "sharp" if float(sigma_mm) < SHARP_BELOW_MM else "soft"


def resolve_mix(mix: str | ScannerMix | None) -> ScannerMix | None:
    """A mix by name (:data:`SCANNER_MIXES`), a :class:`ScannerMix` as it is, or None (one scanner)."""
    if mix is None or isinstance(mix, ScannerMix):
        return mix
    if str(mix) not in SCANNER_MIXES:
        raise ConfigError(f"unknown scanner mix {mix!r}", field="scanner_mix",
                          fix=f"use one of {sorted(SCANNER_MIXES)}, or leave it empty for one pinned scanner")
    return SCANNER_MIXES[str(mix)]


def draw_acquisition(mix: ScannerMix, rng: np.random.Generator, hu_offset: float = 0.0) -> Acquisition:
    """One CT's acquisition from ``mix``: profile, slice, pixel, kernel, noise (a fixed number of draws)."""
    u = rng.random(5)
    z = float(rng.standard_normal())
    cum = np.cumsum([m.frequency for m in mix.models])
    m = mix.models[min(int(np.searchsorted(cum, u[0], side="right")), len(mix.models) - 1)]
    slice_mm = m.slices_mm[min(int(np.searchsorted(np.cumsum(m.slice_p), u[1], side="right")), len(m.slices_mm) - 1)]
    pixel = m.pixel_mm[0] + u[2] * (m.pixel_mm[1] - m.pixel_mm[0])
    soft = bool(u[3] < m.p_soft)
    sigma = m.soft_mm if soft else m.sharp_mm
    noise = (m.noise_ref * math.sqrt(_REFERENCE_MM / slice_mm) * (_REFERENCE_MM / pixel)
             * (1.0 if soft else _SHARP_NOISE) * math.exp(_NOISE_JITTER * z))
    noise = float(np.clip(noise, *_NOISE_RANGE))
    return Acquisition(m.name, m.manufacturer, float(slice_mm), round(float(pixel), 3), kernel_name(sigma),
                       float(sigma), round(noise, 2), float(hu_offset))


def pinned_acquisition(scanner: ScannerProfile, spacing: Sequence[float]) -> Acquisition:
    """The acquisition of every CT of a single-scanner cohort (profile ``"pinned"``)."""
    return Acquisition("pinned", scanner.manufacturer, float(spacing[2]), float(np.mean(spacing[:2])),
                       kernel_name(scanner.kernel_sigma_mm), float(scanner.kernel_sigma_mm), float(scanner.noise_hu),
                       float(scanner.hu_offset))


def ct_grid(acq: Acquisition, fov_mm: Sequence[float]) -> tuple[tuple[int, int, int], tuple[float, float, float]]:
    """``(shape, spacing)`` of a CT with ``acq``'s pixel and slice over the field of view ``fov_mm`` (x, y, z)."""
    spacing = (acq.pixel_mm, acq.pixel_mm, acq.slice_thickness_mm)
    shape = tuple(max(16, int(round(f / s))) for f, s in zip(fov_mm, spacing))
    return shape, spacing  # type: ignore[return-value]


def mix_summary(mix: ScannerMix) -> Mapping[str, object]:
    """``{"name", "profiles"}``: the mix as ``cohort.json`` records it."""
    return {"name": mix.name, "profiles": mix.table()}
