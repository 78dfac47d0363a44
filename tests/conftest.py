"""Test-wide settings shared by every package's tests.

- Plots render headless.
- Anything a test run would write under the project's default ``runs/`` goes to a temporary
  ``LUNGCAL_HOME`` instead, so the suite never touches a user's store.
- torch uses at most two threads (CI has two cores).
"""
from __future__ import annotations

import csv
import os
from pathlib import Path

import pytest
import torch

from lungcal.data.synthetic import make_cohort
from lungcal.data.synthetic.insertion import Background, load_background

os.environ.setdefault("MPLBACKEND", "Agg")

SHARED = Path(__file__).resolve().parents[1].parent / "shared"


@pytest.fixture(scope="session", autouse=True)
def _isolated_lungcal_home(tmp_path_factory):
    home = tmp_path_factory.mktemp("lungcal_home")
    old = os.environ.get("LUNGCAL_HOME")
    os.environ["LUNGCAL_HOME"] = str(home)
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    yield home
    if old is None:
        os.environ.pop("LUNGCAL_HOME", None)
    else:
        os.environ["LUNGCAL_HOME"] = old


@pytest.fixture(scope="session")
def shared_dir() -> Path:
    """The read-only ``../shared`` folder beside the checkout (skips when absent)."""
    if not SHARED.is_dir():
        pytest.skip(f"../shared is not beside this checkout (looked for {SHARED})")
    return SHARED


@pytest.fixture(scope="session")
def tiny_cohort(tmp_path_factory) -> Path:
    """15 synthetic DICOM CTs at 5 mm (seed 1), made once per session; tests only read it."""
    out = tmp_path_factory.mktemp("tiny_cohort")
    return Path(make_cohort(out, n_subjects=15, prevalence=0.5, seed=1, shape=(64, 64, 48), spacing=(5.0, 5.0, 5.0),
                            formats=("dicom",), progress=False))


@pytest.fixture(scope="session")
def lidc_background(shared_dir) -> Background:
    """LIDC-IDRI-0001 (a real 2.5 mm chest CT, ../shared/data/ct) read once as a lesion-insertion background,
    its 3 cm nodule kept clear of, where lesions go computed once; tests must not change it."""
    case = shared_dir / "data" / "ct" / "LIDC-IDRI-0001"
    if not (case / "ct.nii.gz").is_file():
        pytest.skip(f"the real CT LIDC-IDRI-0001 is not in {case.parent}")
    with open(case / "nodules_consensus.csv", newline="") as fh:  # LPS mm -> RAS
        reals = [((-float(r["lps_x_mm"]), -float(r["lps_y_mm"]), float(r["lps_z_mm"])),
                  float(r["mean_max_xy_extent_mm"]) / 2) for r in csv.DictReader(fh)]
    return load_background(case / "ct.nii.gz", case.name, reals)
