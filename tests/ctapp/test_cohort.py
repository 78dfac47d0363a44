"""The bag-extraction step keeps the cache key of the name-based bundles and refuses what the cache cannot key;
the lung masker is keyed by its settings; series checks skip failing rows (checked once per CT) and refuse them
when scoring."""
from __future__ import annotations

import csv
import io
import json
import logging
import shutil
from pathlib import Path

import numpy as np
import pydicom
import pytest
from monai.bundle import ConfigParser

from lungcal.candidates.cache import BagCache, BagParams, build_bags, load_bag, masker_config, masker_from_config
from lungcal.candidates.detector import LoGBlobDetector
from lungcal.candidates.lesions import LesionDetector
from lungcal.ct.masking import LungMasker
from lungcal.ct.qc import QCCheck, QCConfig, QCReport
from lungcal.ct.transforms import build_preprocess
from lungcal.ctapp.data import series_qc
from lungcal.ctapp.data.bagbuild import bag_tasks
from lungcal.ctapp.data.cohort import CTCohort, chain_masker
from lungcal.ctapp.model.checkpoint import bag_params_of
from lungcal.data.synthetic import cohort_datalist_path, make_cohort
from lungcal.errors import ConfigError, DataError
from tests.candidates.test_detector_config import FixedPoints

ROOT = Path(__file__).resolve().parents[2]
#: the cohort below is at 5 mm: thresholds that accept its slices and pixels
TINY_QC = {"max_slice_thickness_mm": 6.0, "warn_slice_thickness_mm": 6.0, "max_pixel_mm": 6.0}

#: the ``bag_params`` of bundles/nlst_*.json before the pipeline moved into config
NAME_BASED = {"spacing": [2.5, 2.5, 2.5], "hu_window": [-1000, 400], "k": 8, "patch_size": 16}


def test_default_objects_give_the_cache_key_of_the_name_based_bundles(tmp_path):
    cohort = CTCohort(None, detector=LoGBlobDetector(), output_dir=tmp_path)
    assert BagParams.from_any(cohort.bag_params).resolved() == BagParams.from_any(NAME_BASED).resolved()
    tuned = CTCohort(None, detector=LoGBlobDetector(top_k=16), output_dir=tmp_path)
    assert BagParams.from_any(tuned.bag_params).resolved()["detector"]["top_k"] == 16


def test_a_detector_the_cache_cannot_key_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match=r"field 'detector': the detector object has no detect\(\) and no config\(\)"
                                          r".*Fix: give it detect\(image, lung_mask, spacing, affine\)"):
        CTCohort(None, detector=object(), output_dir=tmp_path)


def test_missing_datalist_is_a_data_error(tmp_path):
    with pytest.raises(DataError, match="datalist not found"):
        CTCohort(str(tmp_path / "none.json"), output_dir=tmp_path).load()


# --- the lung masker in the cache key ---------------------------------------------------------------------------
def test_the_default_masker_object_keeps_the_key_and_another_masker_changes_it(tmp_path):
    default = CTCohort(None, preprocessing=build_preprocess((2.5, 2.5, 2.5), (-1000, 400), masker=LungMasker()),
                       detector=LoGBlobDetector(), output_dir=tmp_path)
    assert chain_masker(default.preprocess.chain) == LungMasker()
    assert BagParams.from_any(default.bag_params).resolved() == BagParams.from_any(NAME_BASED).resolved()
    other = CTCohort(None, preprocessing=build_preprocess((2.5, 2.5, 2.5), (-1000, 400),
                                                          masker=LungMasker(threshold=-450)),
                     detector=LoGBlobDetector(), output_dir=tmp_path)
    assert other.bag_params["preprocess"]["masker"]["threshold"] == -450.0
    image = tmp_path / "ct.nii.gz"
    image.write_bytes(b"same source")
    cache = BagCache(tmp_path / "bags")
    assert cache.key(image, other.bag_params) != cache.key(image, default.bag_params)
    # the stored bag_params (a checkpoint's JSON) rebuild the same masker for inference
    stored = BagParams.from_any(json.loads(json.dumps(other.bag_params)))
    assert stored.preprocess_kwargs()["masker"] == LungMasker(threshold=-450)
    assert cache.key(image, stored) == cache.key(image, other.bag_params)
    assert masker_config(LungMasker(threshold=-400)) is None  # an int from JSON is still the default


def test_the_bundle_sections_hold_the_documented_defaults():
    common = json.loads((ROOT / "bundles" / "nlst_focal.json").read_text())
    inference = json.loads((ROOT / "bundles" / "inference.json").read_text())
    parser = ConfigParser({"qc": common["qc"], "masker": common["preprocessing"]["masker"]})
    assert parser.get_parsed_content("qc") == QCConfig()
    assert parser.get_parsed_content("masker") == LungMasker()
    assert common["cohort"]["qc"] == inference["workflow"]["qc"] == "@qc"
    assert inference["qc"] == "%bundles/nlst_focal.json#qc"  # inference checks series as training does


# --- series checks over a datalist -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cut_cohort(tmp_path_factory) -> tuple[Path, str]:
    """A 6-CT synthetic cohort at 5 mm whose first train CT lost its top 40 mm (the apices)."""
    root = tmp_path_factory.mktemp("cohort6")
    path = Path(make_cohort(root, n_subjects=6, prevalence=0.5, seed=3, shape=(64, 64, 48), spacing=(5.0, 5.0, 5.0),
                            formats=("dicom",), progress=False))
    data = json.loads(path.read_text())
    row = next(r for r in data["rows"] if r["split"] == "train")
    src, dst = path.parent / row["image"], root / "apexless_ct"
    dst.mkdir()
    files = sorted(src.iterdir(), key=_z_of)  # the top (superior) slices last
    for f in files[:-8]:
        shutil.copy(f, dst / f.name)
    row["image"] = str(dst)
    path.write_text(json.dumps(data))
    return path, row["subject"]


def _z_of(f: Path) -> float:
    return float(pydicom.dcmread(f, stop_before_pixels=True).ImagePositionPatient[2])


class _Tracker:
    def __init__(self):
        self.logged = {}

    def log_artifact(self, path, artifact_path=None):
        self.logged[Path(path).name] = Path(path).read_text()


def test_failing_rows_are_skipped_with_a_reason_table_and_checked_once(cut_cohort, tmp_path, capsys, monkeypatch):
    path, cut = cut_cohort
    cohort = CTCohort(str(path), spacing=(5.0, 5.0, 5.0), patch_size=8, output_dir=tmp_path, num_workers=0,
                      qc=TINY_QC).load()
    out = capsys.readouterr().out
    assert "1 of 6 CT(s) skipped" in out and "lung_coverage" in out and "apex" in out
    assert cohort.skipped == [cut]
    used = [s for split in cohort.splits.values() for s in split["subjects"]]
    assert len(used) == 5 and cut not in used
    tracker = _Tracker()
    cohort.log_qc(tracker)
    rows = list(csv.DictReader(io.StringIO(tracker.logged["qc.csv"])))
    assert set(rows[0]) == {"pseudonym", "check", "verdict", "value"} and len(rows) == 6 * 8
    assert {(r["check"], r["verdict"]) for r in rows if r["pseudonym"] == cut} >= {("lung_coverage", "fail")}
    assert str(path.parent) not in tracker.logged["qc.csv"] and "apexless" not in tracker.logged["qc.csv"]
    assert len(list((tmp_path / "cache" / "qc").glob("*.json"))) == 6
    # warm: the stored reports are read back, nothing is checked again
    monkeypatch.setattr(series_qc, "check_series", lambda *a, **k: pytest.fail("checked a CT twice"))
    again = CTCohort(str(path), spacing=(5.0, 5.0, 5.0), patch_size=8, output_dir=tmp_path, num_workers=2,
                     qc=TINY_QC).load()
    assert again.skipped == [cut] and again.qc_rows == cohort.qc_rows
    # other thresholds are another report: the default 3 mm limit refuses every 5 mm CT
    monkeypatch.undo()
    with pytest.raises(DataError, match="no 'train' rows"):
        CTCohort(str(path), spacing=(5.0, 5.0, 5.0), output_dir=tmp_path, num_workers=0, qc={}).split("train")
    assert "6 of 6 CT(s) skipped" in capsys.readouterr().out


def test_scoring_refuses_a_failing_series_naming_pseudonym_check_and_value(cut_cohort, tmp_path, caplog):
    path, cut = cut_cohort
    rows = json.loads(path.read_text())["rows"]
    for r in rows:
        r["image"] = str(Path(r["image"]) if Path(r["image"]).is_absolute() else path.parent / r["image"])
    reports = series_qc.screen(rows, TINY_QC, tmp_path / "qc")
    with pytest.raises(DataError) as info:
        series_qc.refuse_failed(rows, reports)
    text = str(info.value)
    assert cut in text and "lung_coverage" in text and "top 10" in text and "apexless" not in text
    ok = [r for r, rep in zip(rows, reports) if not rep.failed]
    series_qc.refuse_failed(ok, [rep for rep in reports if not rep.failed])  # nothing failed: no error
    warned = QCConfig(warn_slice_thickness_mm=4.0, max_slice_thickness_mm=6.0, max_pixel_mm=6.0)
    with caplog.at_level(logging.WARNING, logger="lungcal.ctapp.data.series_qc"):
        assert series_qc.log_warnings(ok, series_qc.screen(ok, warned, tmp_path / "qc")) == len(ok)
    assert all(str(path.parent) not in m for m in caplog.messages) and ok[0]["subject"] in caplog.text


def test_a_plugged_in_masker_is_keyed_by_its_settings_and_scoring_cannot_rebuild_it(tmp_path):
    class Wrapped:  # a learned segmenter's wrapper: plain settings plus an unpicklable model
        def __init__(self):
            self.weights, self.model = "/models/unet.pth", object()

        def __call__(self, hu, spacing):
            return hu < -400

    cohort = CTCohort(None, preprocessing=build_preprocess(2.5, (-1000, 400), masker=Wrapped()), output_dir=tmp_path)
    key = cohort.bag_params["preprocess"]["masker"]
    assert key["class"].endswith("Wrapped") and key["weights"] == "/models/unet.pth" and "model" not in key
    stored = BagParams.from_any(json.loads(json.dumps(cohort.bag_params)))
    stand_in = stored.preprocess_kwargs()["masker"]  # the bag builder gets the cohort's own chain: never called
    with pytest.raises(ConfigError, match="cannot rebuild"):
        stand_in(None, None)
    with pytest.raises(ConfigError, match="cannot rebuild"):
        masker_from_config(key)


def test_many_warnings_are_one_line_per_check_with_count_and_first_case(caplog):
    rows = [{"subject": f"s{i:03d}", "image": f"/site/patient_{i}.nii.gz"} for i in range(30)]
    thick = QCCheck("slice_thickness", "warn", "3.00 mm", "slices of 3.0 mm are thicker than 2.5 mm")
    reports = [QCReport([thick]) for _ in rows[:25]] + [None] * 5
    with caplog.at_level(logging.WARNING, logger="lungcal.ctapp.data.series_qc"):
        assert series_qc.log_warnings(rows, reports) == 25
    assert len(caplog.records) == 1
    assert "slice_thickness warns for 25 of 30 CT(s) (first: s000" in caplog.text and "patient_" not in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="lungcal.ctapp.data.series_qc"):
        assert series_qc.log_warnings(rows[:3], reports[:3]) == 3  # few: each CT on its own line
    assert [r.getMessage().split(":")[0] for r in caplog.records] == [
        f"series check slice_thickness warns for s00{i}" for i in range(3)]


# --- scanner-kernel augmentation: the train split only --------------------------------------------------------------
def test_the_kernel_augmentation_softens_train_bags_only_and_stays_out_of_the_stored_bag_params(cut_cohort, tmp_path):
    path, _ = cut_cohort
    plain = CTCohort(str(path), output_dir=tmp_path / "plain", num_workers=0, qc=None)
    aug = CTCohort(str(path), output_dir=tmp_path / "aug", num_workers=0, qc=None, kernel_augment_mm=[3.0, 3.0, 4.0])
    assert aug.bag_params == plain.bag_params  # what a checkpoint stores for inference
    assert aug.train_bag_params["kernel_aug_mm"] == [3.0, 3.0, 4.0]
    assert CTCohort(None, output_dir=tmp_path, kernel_augment_mm=0).train_bag_params == plain.bag_params
    plain.load(), aug.load()
    for split in ("val", "test"):
        assert (aug.splits[split]["bags"] == plain.splits[split]["bags"]).all()
    a, p = aug.splits["train"], plain.splits["train"]
    assert [str(s) for s in a["subjects"]] == [str(s) for s in p["subjects"]]
    assert not np.array_equal(np.asarray(a["bags"]), np.asarray(p["bags"]))
    # each cache entry records its draw: train entries one width per axis within the maximum, the others none
    metas = [json.loads(str(load_bag(f)["meta"])) for f in sorted((tmp_path / "aug").glob("cache/bags/*.npz"))]
    widths = [m["params"]["kernel_sigma_mm"] for m in metas if "kernel_sigma_mm" in m["params"]]
    n_train = len(a["subjects"])
    assert len(metas) == 6 and len(widths) == n_train > 0
    for w in widths:
        frac = np.asarray(w) / [3.0, 3.0, 4.0]
        assert np.allclose(frac, frac[0], atol=1e-5) and 0 <= frac[0] <= 1
    with pytest.raises(ConfigError, match="augment_kernel_mm"):
        CTCohort(None, output_dir=tmp_path, kernel_augment_mm=[-1.0])


def test_build_bags_tasks_give_train_rows_the_augmented_parameters(tmp_path):
    cohort = CTCohort(None, output_dir=tmp_path, kernel_augment_mm=1.5)
    rows = [{"image": "a.nii.gz", "split": "train"}, {"image": "b.nii.gz", "split": "val"}]
    (_, train, *_), (_, val, *_) = bag_tasks(cohort, rows)
    assert train.resolved()["kernel_aug_mm"] == [1.5, 1.5, 1.5] and "kernel_aug_mm" not in val.resolved()


# --- resolution harmonization: every split, and stored in the bag parameters ----------------------------------------
def test_harmonization_goes_into_the_stored_bag_params_for_every_split(cut_cohort, tmp_path):
    path, _ = cut_cohort
    plain = CTCohort(str(path), output_dir=tmp_path / "plain", num_workers=0, qc=None)
    harm = CTCohort(str(path), output_dir=tmp_path / "harm", num_workers=0, qc=None, harmonize_mm=1.5)
    assert "harmonize_mm" not in plain.bag_params
    assert harm.bag_params == {**plain.bag_params, "harmonize_mm": [1.5, 1.5, 1.5]}  # what a checkpoint stores
    assert harm.train_bag_params == harm.bag_params
    assert CTCohort(None, output_dir=tmp_path, harmonize_mm=0).bag_params == plain.bag_params
    plain.load(), harm.load()
    for split in ("train", "val", "test"):
        assert not np.array_equal(np.asarray(harm.splits[split]["bags"]), np.asarray(plain.splits[split]["bags"]))
    with pytest.raises(ConfigError, match="harmonize_mm"):
        CTCohort(None, output_dir=tmp_path, harmonize_mm=[-1.0])


# --- a plugged-in detector: the bundle section, the cache key, a checkpoint's bag parameters --------------------------
def test_the_bundle_detector_section_swaps_and_changes_the_key(tmp_path):
    target = "tests.candidates.test_detector_config.FixedPoints"
    cohorts = {}
    for name, detector in (("default", None), ("fixed", {"_target_": target, "points": [[2, 2, 2]]})):
        parser = ConfigParser()
        parser.read_config(str(ROOT / "bundles" / "nlst_focal.json"))
        parser["output_dir"], parser["datalist"] = str(tmp_path / name), None
        if detector is not None:
            parser["detector"] = detector
        cohorts[name] = parser.get_parsed_content("cohort")
        if detector is None:  # the section holds the default detector: LesionDetector in the bundle's HU window
            assert parser.get_parsed_content("detector") == LesionDetector(hu_window=[-1000, 400])
    assert cohorts["default"].bag_params["detector"] == LesionDetector(hu_window=[-1000, 400]).config()
    assert cohorts["default"].bag_params["k"] == 16
    assert cohorts["fixed"].bag_params["detector"] == {"_target_": target, "points": [[2, 2, 2]], "radius_mm": 3.0}
    image = tmp_path / "ct.nii.gz"
    image.write_bytes(b"same source")
    cache = BagCache(tmp_path / "bags")
    assert cache.key(image, cohorts["fixed"].bag_params) != cache.key(image, cohorts["default"].bag_params)
    # the former default (the solid LoG search, K 8) keys the bags it always did
    assert cache.key(image, cohorts["default"].bag_params) != cache.key(image, NAME_BASED)


def test_a_plugged_in_detector_builds_the_bags_and_a_checkpoint_rebuilds_it(cut_cohort, tmp_path):
    path, _ = cut_cohort
    points = [[2, 3, 4], [5, 5, 5]]  # inside every cropped CT
    cohort = CTCohort(str(path), detector=FixedPoints(points, radius_mm=2.0), output_dir=tmp_path, num_workers=0,
                      qc=None).load()
    for split in ("train", "val", "test"):  # every bag holds the detector's two points
        for c in cohort.splits[split]["candidates"]:
            assert np.allclose(c["radius_mm"], 2.0) and len(c["world"]) == 2
    entries = sorted((tmp_path / "cache" / "bags").glob("*.npz"))
    first = load_bag(entries[0])
    assert sorted(first["voxel"].tolist()) == points and len(entries) == 6
    stamps = {f: f.stat().st_mtime_ns for f in entries}
    # a stage-1 checkpoint stores bag_params as JSON; LAS (with_bag_params) and inference/recalibration
    # (score_rows -> build_bags) rebuild the detector from it and find the same entries, building none
    stored = bag_params_of({"bag_params": json.dumps(cohort.bag_params)})
    rebuilt = BagParams.from_any(stored).make_detector()
    assert type(rebuilt) is FixedPoints and rebuilt.config() == FixedPoints(points, 2.0).config()
    las = CTCohort.with_bag_params(str(path), stored, output_dir=tmp_path, num_workers=0).load()
    assert [str(s) for s in las.splits["test"]["subjects"]] == [str(s) for s in cohort.splits["test"]["subjects"]]
    rows = cohort.rows(("test",))
    scored = build_bags(rows, stored, cohort.cache_dir, num_workers=0, progress=False)
    assert {Path(r["bag"]) for r in scored} <= set(entries)
    assert {f: f.stat().st_mtime_ns for f in sorted((tmp_path / "cache" / "bags").glob("*.npz"))} == stamps


# --- acquisition statistics: measured by the series checks, cached with them, summarised per split --------------------
class _DictTracker:
    def __init__(self):
        self.dicts = {}

    def log_dict(self, data, name):
        self.dicts[name] = json.loads(json.dumps(data))


def test_the_train_splits_acquisition_summary_has_no_identifier_and_comes_from_the_cached_checks(cut_cohort, tmp_path,
                                                                                                 monkeypatch):
    path, cut = cut_cohort
    cohort = CTCohort(str(path), spacing=(5.0, 5.0, 5.0), patch_size=8, output_dir=tmp_path, num_workers=0,
                      qc=TINY_QC).load()
    tracker = _DictTracker()
    cohort.log_acquisition(tracker)
    summary = tracker.dicts["data/acquisition.json"]
    n_train = len(cohort.splits["train"]["subjects"])  # the CT that failed a check is not among them
    assert summary["split"] == "train" and summary["measured"] and summary["n"] == summary["n_measured"] == n_train
    assert summary["profiles"] == {"pinned": n_train} and summary["kernels"] == {"sharp": n_train}
    fields = summary["fields"]
    assert set(fields) == {"slice_thickness_mm", "slice_spacing_mm", "pixel_mm", "air_hu", "noise_hu", "edge_sigma_mm"}
    assert fields["slice_thickness_mm"]["quantiles"]["0.5"] == 5.0 and fields["pixel_mm"]["mean"] == 5.0
    assert fields["air_hu"]["n"] == n_train and -1010 < fields["air_hu"]["mean"] < -990
    assert 15 < fields["noise_hu"]["quantiles"]["0.5"] < 25  # the cohort's scanner: 20 HU
    text = json.dumps(summary)
    subjects = [r["subject"] for r in json.loads(path.read_text())["rows"]]
    assert not any(s in text for s in subjects) and str(path.parent) not in text and "dicom" not in text
    # the numbers come from the series-check cache: a warm cohort measures nothing again and finds the same
    monkeypatch.setattr(series_qc, "check_series", lambda *a, **k: pytest.fail("checked a CT twice"))
    warm = CTCohort(str(path), spacing=(5.0, 5.0, 5.0), patch_size=8, output_dir=tmp_path, num_workers=0,
                    qc=TINY_QC).load()
    assert warm.acquisition_summary() == summary
    assert cohort.acquisition_summary("test")["n"] == len(cohort.splits["test"]["subjects"])


def test_without_series_checks_the_summary_counts_the_rows_profiles_only(cut_cohort, tmp_path):
    path, _ = cut_cohort
    cohort = CTCohort(str(path), spacing=(5.0, 5.0, 5.0), patch_size=8, output_dir=tmp_path, num_workers=0, qc=None)
    cohort.rows()
    summary = cohort.acquisition_summary()
    n_train = sum(r["split"] == "train" for r in json.loads(path.read_text())["rows"])
    assert not summary["measured"] and summary["n"] == n_train and summary["n_measured"] == 0
    assert summary["profiles"] == {"pinned": n_train} and summary["fields"]["noise_hu"]["n"] == 0


def test_a_qc_v1_cache_entry_is_checked_again_and_the_new_entry_holds_the_acquisition(cut_cohort, tmp_path):
    path, _ = cut_cohort
    rows = [r for r in json.loads(path.read_text())["rows"] if r["split"] == "val"][:1]
    for r in rows:
        r["image"] = str(path.parent / r["image"]) if not Path(r["image"]).is_absolute() else r["image"]
    cache = tmp_path / "qc"
    (first,) = series_qc.screen(rows, TINY_QC, cache, progress=False)
    assert first.acquisition is not None and first.acquisition.slice_thickness_mm == 5.0
    (entry,) = cache.glob("*.json")
    stored = json.loads(entry.read_text())
    assert stored["version"] == series_qc.QC_VERSION == "qc-v2" and stored["acquisition"]["noise_hu"] > 0
    entry.write_text(json.dumps({**stored, "version": "qc-v1", "acquisition": None}))  # as written before issue 32
    (again,) = series_qc.screen(rows, TINY_QC, cache, progress=False)
    assert again.acquisition == first.acquisition and json.loads(entry.read_text())["version"] == "qc-v2"


# --- the demo cohort's scanner mix (the bundles' default; bundles/nlst_scanner_mix.json changes nothing) -------------
def test_the_bundle_variant_gives_the_demo_cohort_its_scanner_mix(tmp_path):
    parser = ConfigParser()
    parser.read_config([str(ROOT / "bundles" / "nlst_focal.json"), str(ROOT / "bundles" / "nlst_scanner_mix.json")])
    parser["output_dir"] = str(tmp_path)
    cohort = parser.get_parsed_content("cohort")
    assert cohort.demo_scanner_mix == "four_vendors"
    assert parser.get_parsed_content("settings")["demo_scanner_mix"] == "four_vendors"  # in the run's params
    expected = cohort_datalist_path("demo", tmp_path / "data", scanner_mix="four_vendors")
    assert expected.parent.name == "synthetic_scanner_mix-four_vendors_types-screening_masses-0.15"
    base = ConfigParser()
    base.read_config(str(ROOT / "bundles" / "nlst_focal.json"))
    base["output_dir"] = str(tmp_path)
    assert base.get_parsed_content("cohort").demo_scanner_mix == "four_vendors"  # the default since issue 43
    single = ConfigParser()
    single.read_config(str(ROOT / "bundles" / "nlst_focal.json"))
    single["output_dir"], single["demo_scanner_mix"] = str(tmp_path), None  # --demo_scanner_mix None
    assert single.get_parsed_content("cohort").demo_scanner_mix is None
    with pytest.raises(ConfigError, match="unknown scanner mix"):
        CTCohort(None, output_dir=tmp_path, demo_scanner_mix="nine_vendors")
