"""Synthetic chest-CT cohorts: the built-in default data and the test bed for everything downstream.

- :mod:`.nodules`: the nodule model (class-conditional features), its exact Bayes posterior and AUC.
- :mod:`.phantom`: one chest phantom in HU (anatomy, vessels, airways, bones, nodules, scanner).
- :mod:`.scanners`: scanner mixes (named profiles each CT draws its slices, pixels, kernel and noise from).
- :mod:`.writers`: DICOM series with planted fake identifiers, NIfTI.
- :mod:`.cohort`: a cohort on disk (images, annotations, truth, datalist) and its presets (demo, study).
"""
from .cohort import (
    COHORT_PRESETS,
    DEMO_DEFAULTS,
    STUDY_DEFAULTS,
    cohort_bayes_auc,
    cohort_datalist_path,
    ensure_cohort,
    ensure_demo_cohort,
    ensure_study_cohort,
    make_cohort,
)
from .nodules import (
    ATTENUATIONS,
    MARGINS,
    NODULE_MODEL,
    Nodule,
    bayes_auc,
    bayes_posterior,
    likelihood_ratio,
    sample_nodule_features,
)
from .phantom import ScannerProfile, lung_masks, make_phantom, place_nodules, sample_anatomy
from .scanners import (
    FOUR_VENDORS,
    SCANNER_MIXES,
    Acquisition,
    ScannerMix,
    ScannerModel,
    draw_acquisition,
    kernel_name,
)
from .writers import fake_identifiers, write_dicom_series, write_nifti

_write_nifti = write_nifti  # its name before the package split; scripts/bench_ct.py still imports it

__all__ = [
    "ScannerProfile",
    "ScannerMix",
    "ScannerModel",
    "Acquisition",
    "FOUR_VENDORS",
    "SCANNER_MIXES",
    "draw_acquisition",
    "kernel_name",
    "Nodule",
    "NODULE_MODEL",
    "MARGINS",
    "ATTENUATIONS",
    "DEMO_DEFAULTS",
    "STUDY_DEFAULTS",
    "COHORT_PRESETS",
    "sample_nodule_features",
    "likelihood_ratio",
    "bayes_posterior",
    "bayes_auc",
    "make_phantom",
    "sample_anatomy",
    "place_nodules",
    "lung_masks",
    "make_cohort",
    "cohort_datalist_path",
    "ensure_cohort",
    "ensure_demo_cohort",
    "ensure_study_cohort",
    "cohort_bayes_auc",
    "fake_identifiers",
    "write_dicom_series",
    "write_nifti",
]
