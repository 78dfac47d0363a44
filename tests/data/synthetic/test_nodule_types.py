"""lungcal.data.synthetic.nodule_types: typed mixes (solid, part-solid, ground glass), masses, the exact
posterior, and the classic cohort kept as it was."""
from __future__ import annotations

import csv
import json

import numpy as np
import pytest

from lungcal.cli import main
from lungcal.data.synthetic import ScannerProfile, lung_masks, make_cohort, make_phantom, place_nodules, sample_anatomy
from lungcal.data.synthetic.nodule_types import (
    CORE_FRAC,
    NODULE_TYPE_MIXES,
    NODULE_TYPES,
    draw_mass,
    draw_types,
    type_likelihood_ratio,
    typed_bayes_posterior,
)
from lungcal.data.synthetic.nodules import Nodule, bayes_posterior
from lungcal.errors import ConfigError

TINY = dict(shape=(64, 64, 40), spacing=(5.0, 5.0, 6.0), num_workers=1, progress=False, formats=("nifti",))


def _rows(folder):
    with open(folder / "annotations.csv", newline="") as fh:
        return list(csv.DictReader(fh))


def test_draw_types_follow_the_mix_and_the_core_law():
    rng = np.random.default_rng(0)
    for mal in (False, True):
        t = draw_types(rng, "screening", [mal] * 20000)
        share = np.array([sum(x["type"] == k for x in t) for k in NODULE_TYPES]) / len(t)
        np.testing.assert_allclose(share, NODULE_TYPE_MIXES["screening"]["malignant" if mal else "benign"], atol=0.012)
        gg = np.array([x["gg_hu"] for x in t if x["type"] != "solid"])
        assert gg.min() >= -800 and gg.max() <= -300
        core = np.array([x["core_frac"] for x in t if x["type"] == "part-solid"])
        assert core.min() >= CORE_FRAC[0] and core.max() <= CORE_FRAC[1]
        assert all(x["core_frac"] == 0.0 for x in t if x["type"] == "ground-glass")
        # benign cores uniform (mean 0.35); malignant ones half uniform, half triangular (mean 0.1 + 2/3 * 0.5)
        assert core.mean() == pytest.approx(0.5 * 0.35 + 0.5 * (0.1 + 0.5 * 2 / 3) if mal else 0.35, abs=0.012)


def test_type_likelihood_ratios_average_to_one_under_the_benign_law():
    """E_benign[f_m / f_b] = 1 for each factor: the likelihood ratios are of proper densities."""
    rng = np.random.default_rng(1)
    t = draw_types(rng, "screening", [False] * 40000)
    # calcification: a benign nodule's classic draw is calcified with P = 0.14, whatever its type
    calc = rng.random(len(t)) < 0.14
    lr = [type_likelihood_ratio("screening", x["type"], bool(c), x["core_frac"]) for x, c in zip(t, calc)]
    assert np.mean(lr) == pytest.approx(1.0, abs=0.03)
    assert type_likelihood_ratio("screening", "part-solid", False, 0.6) == pytest.approx(1.5 * 0.26 / 0.05)
    assert type_likelihood_ratio("even", "ground-glass", False, 0.0) == pytest.approx(1.0)


def test_typed_posterior_is_classic_without_types_and_one_with_a_mass():
    d, m, a = [6.0, 14.0], [0, 2], [0, 1]
    assert typed_bayes_posterior(d, m, a, None, "classic", 0.2) == pytest.approx(bayes_posterior(d, m, a, 0.2))
    assert typed_bayes_posterior(d, m, a, None, "classic", 0.2, has_mass=True) == 1.0


def test_classic_cohort_unchanged_and_typed_cohort_paired(tmp_path):
    classic = make_cohort(tmp_path / "c", n_subjects=6, prevalence=0.5, seed=5, **TINY)
    typed = make_cohort(tmp_path / "t", n_subjects=6, prevalence=0.5, seed=5, nodule_types="even", **TINY)
    a, b = _rows(classic.parent), _rows(typed.parent)
    key = ("ct", "coordX", "coordY", "coordZ", "diameter_mm", "malignant", "margin")
    assert [tuple(r[k] for k in key) for r in a] == [tuple(r[k] for k in key) for r in b]  # same patients
    assert {r["nodule_type"] for r in a} <= {"solid", "part-solid"}  # classic part-solid: core 0.5, -480 HU
    assert all((r["core_frac"], r["gg_hu"]) == ("0.500", "-480.0") for r in a if r["nodule_type"] == "part-solid")
    assert {r["nodule_type"] for r in b} == set(NODULE_TYPES)
    assert json.loads((classic.parent / "datalist.json").read_text())["rows"] == \
        json.loads((typed.parent / "datalist.json").read_text())["rows"]
    assert "nodule_types" not in json.loads((classic.parent / "cohort.json").read_text())
    assert json.loads((typed.parent / "cohort.json").read_text())["nodule_types"] == "even"


def test_ground_glass_and_part_solid_are_rendered_faint_with_a_core():
    """Ground glass lifts the parenchyma to its density and leaves brighter tissue (vessels) as it was;
    a part-solid nodule's core is solid."""
    shape, spacing = (64, 64, 48), (2.5, 2.5, 2.5)
    quiet = ScannerProfile(noise_hu=0.0)
    rng = np.random.default_rng(2)
    anat = sample_anatomy(rng, shape, spacing)
    plain, origin, lung = make_phantom(np.random.default_rng(3), shape, spacing, anat=anat, scanner=quiet)
    base = place_nodules(rng, lung, spacing, origin, [(14.0, 0, 0, False), (14.0, 0, 0, True)])
    gg = Nodule(base[0].center_lps, 14.0, False, "smooth", "ground-glass", "ground-glass", -600.0, 0.0)
    ps = Nodule(base[1].center_lps, 14.0, True, "smooth", "part-solid", "part-solid", -600.0, 0.5)
    hu, _, _ = make_phantom(np.random.default_rng(3), shape, spacing, nodules=[gg, ps], anat=anat, scanner=quiet)
    g = np.indices(shape).transpose(1, 2, 3, 0) * np.asarray(spacing) + origin
    for n in (gg, ps):
        r = np.linalg.norm(g - np.asarray(n.center_lps), axis=-1)
        ring = (r > 4.5) & (r < 6.0)
        lifted = ring & (plain < -700)  # parenchyma under the ground glass
        assert lifted.sum() > 10 and np.abs(hu[lifted] + 600).max() <= 1
        bright = ring & (plain > -600)  # vessels show through
        np.testing.assert_array_equal(hu[bright], plain[bright])
        core = r < 3.0
        if n is ps:  # a solid core of 7 mm
            assert (hu[core] > -100).all()
        else:  # no core: ground glass or what shows through it
            assert np.abs(hu[core] - np.maximum(plain[core], -600)).max() <= 1


def test_masses_abut_the_mediastinum_or_the_pleura():
    shape, spacing = (128, 128, 96), (2.5, 2.5, 2.5)
    rng = np.random.default_rng(4)
    anat = sample_anatomy(rng, shape, spacing)
    origin = -(np.asarray(shape) - 1) / 2 * np.asarray(spacing)
    (lr, ll), _ = lung_masks(shape, np.asarray(spacing, np.float32), origin, anat)
    lung = lr | ll
    contacts = set()
    for k in range(10):
        centre, d, contact = draw_mass(np.random.default_rng(k), anat, (lr, ll), spacing, origin)
        assert 30 <= d <= 60
        contacts.add(contact)
        v = np.round((np.asarray(centre) - origin) / spacing).astype(int)
        assert lung[tuple(v)]  # centre in the lung
        g = np.indices(shape).reshape(3, -1).T * np.asarray(spacing) + origin
        inside = np.linalg.norm(g - np.asarray(centre), axis=1) < d / 2
        out = ~lung.ravel()[inside]
        assert 0.005 < out.mean() < 0.6  # it reaches past the lung's edge, mostly inside the lung
        medial = np.abs(g[inside][out, 0]).mean() < abs(centre[0])
        assert medial == (contact == "mediastinum")
    assert contacts == {"mediastinum", "pleura"}


def test_cohort_masses_and_cli(tmp_path, capsys):
    out = tmp_path / "m"
    assert main(["synth", "--out", str(out), "--n", "4", "--prevalence", "0.9", "--shape", "64,64,40",
                 "--spacing", "5,5,6", "--workers", "1", "--formats", "nifti", "--nodule-types", "screening",
                 "--masses", "1"]) == 0
    rows = _rows(out)
    masses = [r for r in rows if r["contact"]]
    assert masses and all(30 <= float(r["diameter_mm"]) <= 60 and r["malignant"] == "1" for r in masses)
    truth = {r["ct"]: float(r["bayes_p"]) for r in csv.DictReader(open(out / "truth.csv"))}
    assert all(truth[r["ct"]] == 1.0 for r in masses)
    with pytest.raises(ConfigError, match="nodule-type mix"):
        make_cohort(tmp_path / "x", n_subjects=1, nodule_types="lepidic", **TINY)
    capsys.readouterr()
    assert main(["synth", "--out", str(tmp_path / "y"), "--n", "1", "--masses", "2"]) == 2
    assert "masses" in capsys.readouterr().err
