"""lungcal.ct.masking on a real CT: a mass inserted against the chest wall or the mediastinum of
LIDC-IDRI-0001 (2.5 mm, ../shared/data/ct) stays in the lung mask (step 5 of the masker), and the
scan without a mass is left as it was: the heart, the liver dome and the hila are not added.

The lesions come from the lesion test bed (:mod:`lungcal.data.synthetic.insertion`), placed on the
mask without step 5, so that both maskers see the same mass; the share is that of the mass's sphere
on the scan's own grid. ``experiments/mass_mask.py`` measures the same over many masses and three
scans."""
from __future__ import annotations

import numpy as np
import pytest

from lungcal.ct.masking import LungMasker
from lungcal.ctapp.evaluate.lesion_bed import real_lesions
from lungcal.data.synthetic.insertion import InsertedLesion, choose_centre, draw_lesion, insert_lesions, load_background

BEFORE = LungMasker(mass_chord_mm=0)  # the masker without step 5


@pytest.fixture(scope="module")
def background(shared_dir):
    case = shared_dir / "data" / "ct" / "LIDC-IDRI-0001"
    if not (case / "ct.nii.gz").is_file():
        pytest.skip(f"the real CT LIDC-IDRI-0001 is not in {case.parent}")
    bg = load_background(case / "ct.nii.gz", case.name, [(r.centre_ras, r.diameter_mm / 2) for r in real_lesions(case)])
    bg.lung, bg.geometry = BEFORE(bg.hu, bg.spacing), None  # the lesions are planned on the mask before step 5
    return bg


def _share(mask: np.ndarray, bg, lesion: InsertedLesion) -> float:
    """The share of the lesion's sphere inside ``mask`` (the scan's grid)."""
    sp = bg.spacing
    c = np.linalg.solve(bg.affine[:3, :3], np.asarray(lesion.centre_ras) - bg.affine[:3, 3])
    lo = np.maximum(np.floor(c - lesion.radius_mm / sp).astype(int), 0)
    hi = np.minimum(np.ceil(c + lesion.radius_mm / sp).astype(int) + 1, mask.shape)
    g = np.stack(np.meshgrid(*[np.arange(a, b) for a, b in zip(lo, hi)], indexing="ij"), -1)
    inside = np.linalg.norm((g - c) * sp, axis=-1) <= lesion.radius_mm
    return float(mask[tuple(slice(a, b) for a, b in zip(lo, hi))][inside].mean())


@pytest.mark.parametrize("place", ["pleura", "mediastinum"])
def test_a_mass_against_the_chest_wall_or_the_mediastinum_stays_in_the_mask(background, place, record_property):
    rng = np.random.default_rng(0)
    spec = draw_lesion("mass", rng, diameter_mm=55.0)
    got = choose_centre(background, place, 55.0, rng)
    assert got is not None
    centre, posterior = got
    mass = InsertedLesion(place=place, centre_ras=tuple(float(v) for v in centre), posterior=posterior, seed=0, **spec)
    hu = insert_lesions(background, [mass])
    before = BEFORE(hu, background.spacing)
    after = LungMasker()(hu, background.spacing)
    shares = {"ceiling": _share(background.lung, background, mass), "before": _share(before, background, mass),
              "after": _share(after, background, mass)}
    record_property("mask_share", shares)
    print(place, {k: round(v, 3) for k, v in shares.items()})
    assert shares["before"] < 0.35  # the rolling ball keeps its rim only
    # the lung around it brings most of it in (the ceiling: the lung before it; on the hold-out draw of
    # experiments/mass_mask.py the median share is 0.75 against the pleura, 0.91 at the mediastinum)
    assert shares["after"] >= 0.5 and shares["after"] >= shares["before"] + 0.4, shares
    assert not (before & ~after).any()  # step 5 only adds: nodules the mask held stay in


def test_without_a_mass_the_mask_is_unchanged(background, record_property):
    """No mass core on the real scan: nothing added (the heart, the liver dome, the hila would show as
    soft tissue), the lung volume as before."""
    after = LungMasker()(background.hu, background.spacing)
    ml = float(np.prod(background.spacing)) / 1000
    added = after & ~background.lung
    soft_ml = float((added & (background.hu > -300)).sum()) * ml
    record_property("added_ml", float(added.sum()) * ml)
    assert not (background.lung & ~after).any()
    assert soft_ml < 5.0, soft_ml  # measured 0 on the three shared scans
    assert added.sum() < 0.002 * background.lung.sum()
