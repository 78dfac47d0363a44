"""lungcal.data.synthetic.scanners and scanner-mix cohorts: the documented mix, deterministic draws, the same
patients as the single-scanner cohort of the same seed, rows that record each CT's acquisition, the CLI pins."""
from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path

import numpy as np
import pydicom
import pytest

from lungcal.cli import main
from lungcal.ct.io import load_ct
from lungcal.ct.qc import check_series
from lungcal.data.manifest import load_manifest
from lungcal.data.synthetic import (
    FOUR_VENDORS,
    SCANNER_MIXES,
    ScannerMix,
    ScannerModel,
    draw_acquisition,
    kernel_name,
    make_cohort,
)
from lungcal.errors import ConfigError

SMALL = dict(shape=(48, 48, 32), spacing=(6.0, 6.0, 8.0), formats=("dicom",), progress=False)  # 288 x 288 x 256 mm
ROW_FIELDS = {"profile", "manufacturer", "slice_thickness_mm", "pixel_mm", "kernel", "kernel_sigma_mm", "noise_hu",
              "hu_offset"}


def test_the_shipped_mix_is_four_named_vendors_with_the_documented_draws():
    assert SCANNER_MIXES == {"four_vendors": FOUR_VENDORS}
    assert [m.name for m in FOUR_VENDORS.models] == ["vendor_a", "vendor_b", "vendor_c", "vendor_d"]
    assert [m.frequency for m in FOUR_VENDORS.models] == [0.35, 0.30, 0.20, 0.15]
    draws = [draw_acquisition(FOUR_VENDORS, np.random.default_rng([0, i, 9])) for i in range(4000)]
    share = Counter(a.profile for a in draws)
    for m in FOUR_VENDORS.models:
        assert share[m.name] / 4000 == pytest.approx(m.frequency, abs=0.03)
        mine = [a for a in draws if a.profile == m.name]
        assert {a.slice_thickness_mm for a in mine} == set(m.slices_mm)
        assert all(m.pixel_mm[0] <= a.pixel_mm <= m.pixel_mm[1] for a in mine)
        assert {a.kernel_sigma_mm for a in mine} == {m.soft_mm, m.sharp_mm}
        assert np.mean([a.kernel == "soft" for a in mine]) == pytest.approx(m.p_soft, abs=0.06)
    slices = {a.slice_thickness_mm for a in draws}
    assert min(slices) == 1.25 and max(slices) == 3.0  # NLST's 1-3 mm spread
    noise = np.array([a.noise_hu for a in draws])
    assert 5 <= noise.min() and noise.max() <= 60 and 15 < np.median(noise) < 35
    # noisier when thinner and when sharper, as the documented model says
    a = [d for d in draws if d.profile == "vendor_a" and d.kernel == "soft"]
    thin, thick = ([d.noise_hu for d in a if d.slice_thickness_mm == s] for s in (1.25, 2.5))
    assert np.median(thin) / np.median(thick) == pytest.approx(math.sqrt(2), rel=0.1)
    sharp = [d.noise_hu for d in draws
             if d.profile == "vendor_a" and d.kernel == "sharp" and d.slice_thickness_mm == 2.5]
    assert np.median(sharp) / np.median(thick) == pytest.approx(1.4, rel=0.1)
    assert draw_acquisition(FOUR_VENDORS, np.random.default_rng(7)) == draw_acquisition(FOUR_VENDORS,
                                                                                        np.random.default_rng(7))
    assert kernel_name(0.99) == "sharp" and kernel_name(1.0) == "soft"


def test_a_mix_whose_shares_do_not_sum_to_one_is_refused():
    m = ScannerModel("x", "X", 0.5, (2.5,), (1.0,), (2.0, 2.5), 1.0, 0.5, 0.5, 20.0)
    with pytest.raises(ConfigError, match="sum to 1"):
        ScannerMix("bad", (m,))
    with pytest.raises(ConfigError, match="unknown scanner mix"):
        make_cohort("/tmp/unused", 2, scanner_mix="five_vendors")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """The same 6 subjects (seed 2) from one pinned scanner and from the four-vendor mix."""
    root = tmp_path_factory.mktemp("mix")
    pinned = make_cohort(root / "pinned", 6, prevalence=0.5, seed=2, num_workers=1, **SMALL)
    mixed = make_cohort(root / "mixed", 6, prevalence=0.5, seed=2, num_workers=2, scanner_mix="four_vendors", **SMALL)
    return root, load_manifest(pinned), load_manifest(mixed)


def test_a_mixed_cohort_holds_the_same_patients_each_on_its_own_scanner(pair):
    root, pinned, mixed = pair
    assert [(r["subject"], r["label"], r["split"]) for r in pinned] == [(r["subject"], r["label"], r["split"])
                                                                       for r in mixed]
    for r in pinned:
        assert r["acquisition"] == {"profile": "pinned", "manufacturer": "LUNGCAL-SIM", "slice_thickness_mm": 8.0,
                                    "pixel_mm": 6.0, "kernel": "sharp", "kernel_sigma_mm": 0.7, "noise_hu": 20.0,
                                    "hu_offset": 0.0}
    for r in mixed:
        acq = r["acquisition"]
        assert set(acq) == ROW_FIELDS and acq["profile"].startswith("vendor_")
        img = load_ct(r["image"])  # the CT is written at its own pixel and slice size over the preset's field of view
        np.testing.assert_allclose(np.asarray(img.pixdim)[:3], [acq["pixel_mm"]] * 2 + [acq["slice_thickness_mm"]],
                                   rtol=1e-5)
        np.testing.assert_allclose(np.asarray(img.shape[1:]) * np.asarray(img.pixdim)[:3], (288, 288, 256), atol=3.0)
        ds = pydicom.dcmread(next(Path(r["image"]).iterdir()), stop_before_pixels=True)
        assert ds.Manufacturer == acq["manufacturer"] and float(ds.SliceThickness) == acq["slice_thickness_mm"]
    # the nodules are the same (centres in mm, sizes, kinds): only the acquisition differs
    ann = {name: (root / name / "annotations.csv").read_text().splitlines() for name in ("pinned", "mixed")}
    strip = [[",".join(line.split(",")[1:]) for line in lines] for lines in ann.values()]  # without the fake UID
    assert strip[0] == strip[1]
    assert (root / "pinned" / "truth.csv").read_text() == (root / "mixed" / "truth.csv").read_text()
    doc = json.loads((root / "mixed" / "cohort.json").read_text())
    assert doc["scanner_mix"]["name"] == "four_vendors" and len(doc["scanner_mix"]["profiles"]) == 4


def test_a_mixed_cohort_is_deterministic_by_seed_whatever_the_workers(pair, tmp_path):
    root, _, mixed = pair
    again = load_manifest(make_cohort(tmp_path, 6, prevalence=0.5, seed=2, num_workers=1,
                                      scanner_mix="four_vendors", **SMALL))
    assert [r["acquisition"] for r in again] == [r["acquisition"] for r in mixed]
    np.testing.assert_array_equal(load_ct(again[3]["image"]).numpy(), load_ct(mixed[3]["image"]).numpy())


def test_the_series_checks_measure_what_each_ct_was_acquired_with(pair):
    _, _, mixed = pair
    measured = [check_series(r["image"], max_slice_thickness_mm=6.0, max_pixel_mm=6.0).acquisition for r in mixed]
    for r, m in zip(mixed, measured):
        assert m.slice_thickness_mm == r["acquisition"]["slice_thickness_mm"]
        assert m.pixel_mm == pytest.approx(r["acquisition"]["pixel_mm"], abs=1e-4)
        assert m.noise_hu == pytest.approx(r["acquisition"]["noise_hu"], rel=0.2)
    soft = [m.edge_sigma_mm for r, m in zip(mixed, measured) if r["acquisition"]["kernel"] == "soft"]
    sharp = [m.edge_sigma_mm for r, m in zip(mixed, measured) if r["acquisition"]["kernel"] == "sharp"]
    if soft and sharp:
        assert min(soft) > max(sharp)


def test_synth_pins_one_scanner_unless_a_mix_is_asked_and_refuses_both(tmp_path, capsys):
    out = tmp_path / "mix"
    assert main(["synth", "--out", str(out), "--n", "2", "--shape", "64,64,48", "--workers", "1", "--formats", "nifti",
                 "--scanner-mix", "four_vendors"]) == 0
    rows = json.loads((out / "datalist.json").read_text())["rows"]
    assert all(r["acquisition"]["profile"].startswith("vendor_") for r in rows)
    capsys.readouterr()
    assert main(["synth", "--out", str(tmp_path / "x"), "--n", "2", "--scanner-mix", "four_vendors",
                 "--noise-hu", "30"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--noise-hu" in err and "--scanner-mix" in err and "Fix:" in err
    assert main(["synth", "--out", str(tmp_path / "y"), "--n", "2", "--scanner-mix", "nine_vendors"]) == 2
    assert "four_vendors" in capsys.readouterr().err
