"""The series checks inside the bag pass: one read per CT, and the very reports and bags of the two passes."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pydicom
import pytest

from lungcal.candidates.cache import BagParams, build_bags, load_bag
from lungcal.ct import transforms
from lungcal.ct.masking import LungMasker
from lungcal.ct.qc import QCConfig
from lungcal.ct.transforms import build_preprocess
from lungcal.ctapp.data import checked_bags, series_qc
from lungcal.ctapp.data.checked_bags import check_and_bag, check_and_bag_rows
from lungcal.ctapp.data.cohort import ChainPreprocess
from lungcal.ctapp.data.runners import LocalRunner

#: the tiny cohort is at 5 mm: thresholds that accept its slices and pixels
TINY_QC = QCConfig.from_any({"max_slice_thickness_mm": 6.0, "warn_slice_thickness_mm": 6.0, "max_pixel_mm": 6.0})
PARAMS = BagParams.from_any({"spacing": [5.0, 5.0, 5.0], "hu_window": [-1000, 400], "k": 8, "patch_size": 8})


def _z_of(f: Path) -> float:
    return float(pydicom.dcmread(f, stop_before_pixels=True).ImagePositionPatient[2])


@pytest.fixture(scope="module")
def rows(tiny_cohort, tmp_path_factory) -> list[dict]:
    """Four CTs of the tiny cohort and a copy of the first without its top 40 mm (fails lung coverage)."""
    data = json.loads(Path(tiny_cohort).read_text())
    picked = [dict(r, image=str(Path(tiny_cohort).parent / r["image"])) for r in data["rows"][:4]]
    cut = tmp_path_factory.mktemp("apexless") / "ct"
    cut.mkdir()
    for f in sorted(Path(picked[0]["image"]).iterdir(), key=_z_of)[:-8]:
        shutil.copy(f, cut / f.name)
    return picked + [dict(picked[0], image=str(cut), subject="apexless")]


def _chain():
    return ChainPreprocess(build_preprocess((5.0, 5.0, 5.0), (-1000, 400), masker=LungMasker()))


def _same_bag(a: str, b: str) -> None:
    x, y = load_bag(a), load_bag(b)
    assert x.keys() == y.keys()
    for k in x:
        np.testing.assert_array_equal(x[k], y[k], err_msg=k)


def test_one_read_gives_the_reports_and_bags_of_the_two_passes(rows, tmp_path, monkeypatch):
    masker, pre = LungMasker(), _chain()
    reports = series_qc.screen(rows, TINY_QC, tmp_path / "a" / "qc", masker=masker, progress=False)
    kept = [r for r, rep in zip(rows, reports) if not rep.failed]
    two = build_bags(kept, PARAMS, tmp_path / "a" / "bags", num_workers=0, progress=False, preprocess=pre)

    reads = []
    real_load = checked_bags.load_ct
    monkeypatch.setattr(checked_bags, "load_ct", lambda *a, **k: reads.append(a[0]) or real_load(*a, **k))
    monkeypatch.setattr(transforms, "load_ct", lambda *a, **k: pytest.fail("the bag pass read a CT again"))
    monkeypatch.setattr(series_qc, "check_series", lambda *a, **k: pytest.fail("the checks read a CT again"))
    one, errors = check_and_bag_rows(rows, [PARAMS] * len(rows), TINY_QC, masker, str(tmp_path / "b" / "qc"),
                                     str(tmp_path / "b" / "bags"), pre, progress=False)
    assert not errors and sorted(reads) == sorted(r["image"] for r in rows)  # one read each
    assert all(c.one_read for c in one)
    assert [c.report.as_rows("x") for c in one] == [rep.as_rows("x") for rep in reports]
    assert [c.report.acquisition for c in one] == [rep.acquisition for rep in reports]
    assert one[-1].bag is None and one[-1].report.failed  # the cut CT: checked, skipped, no bag
    for entry, c in zip(two, one[:-1]):
        assert Path(entry["bag"]).name == Path(c.bag).name and c.built  # the same cache key
        _same_bag(entry["bag"], c.bag)
    # the same report files, under the same keys, as lungcal qc and inference read them
    assert sorted(p.name for p in (tmp_path / "a" / "qc").iterdir()) == \
        sorted(p.name for p in (tmp_path / "b" / "qc").iterdir())

    # warm: nothing is read
    monkeypatch.setattr(checked_bags, "load_ct", lambda *a, **k: pytest.fail("a warm pass read a CT"))
    again, errors = check_and_bag_rows(rows, [PARAMS] * len(rows), TINY_QC, masker, str(tmp_path / "b" / "qc"),
                                       str(tmp_path / "b" / "bags"), pre, progress=False)
    assert not errors and not any(c.built or c.one_read for c in again)
    assert [c.bag for c in again] == [c.bag for c in one]
    # two worker processes give the same
    monkeypatch.undo()
    pooled, errors = check_and_bag_rows(rows, [PARAMS] * len(rows), TINY_QC, masker, str(tmp_path / "c" / "qc"),
                                        str(tmp_path / "c" / "bags"), pre, runner=LocalRunner(2), progress=False)
    assert not errors and all(c.one_read for c in pooled)
    for a, b in zip(one[:-1], pooled[:-1]):
        _same_bag(a.bag, b.bag)


def test_a_cached_report_or_bag_is_not_made_again(rows, tmp_path, monkeypatch):
    masker, pre, row = LungMasker(), _chain(), rows[1]
    qc_root, bag_root = str(tmp_path / "qc"), str(tmp_path / "bags")
    first = check_and_bag(row["image"], None, TINY_QC, masker, qc_root, PARAMS, bag_root, pre)
    # the report cached, the bag gone: the bag alone is built (the two-pass bag path), no check runs
    Path(first.bag).unlink()
    monkeypatch.setattr(checked_bags, "check_series", lambda *a, **k: pytest.fail("checked a cached CT again"))
    monkeypatch.setattr(series_qc, "check_series", lambda *a, **k: pytest.fail("checked a cached CT again"))
    bag_only = check_and_bag(row["image"], None, TINY_QC, masker, qc_root, PARAMS, bag_root, pre)
    assert bag_only.built and not bag_only.one_read and bag_only.bag == first.bag
    # the bag cached, the report gone: the checks alone run
    monkeypatch.undo()
    for p in Path(qc_root).iterdir():
        p.unlink()
    monkeypatch.setattr(transforms, "load_ct", lambda *a, **k: pytest.fail("rebuilt a cached bag"))
    checks_only = check_and_bag(row["image"], None, TINY_QC, masker, qc_root, PARAMS, bag_root, pre)
    assert not checks_only.built and not checks_only.one_read
    assert checks_only.report.as_rows("x") == first.report.as_rows("x")


def test_a_row_that_names_a_series_goes_the_two_pass_way(rows, tmp_path):
    uid = pydicom.dcmread(next(Path(rows[2]["image"]).iterdir()), stop_before_pixels=True).SeriesInstanceUID
    got = check_and_bag(rows[2]["image"], uid, TINY_QC, LungMasker(), str(tmp_path / "qc"), PARAMS,
                        str(tmp_path / "bags"), _chain())
    assert not got.one_read and got.bag is not None and got.built


def test_an_unreadable_ct_raises_the_bag_error_with_no_report(tmp_path):
    bad = tmp_path / "ct.nii.gz"
    bad.write_bytes(b"not a volume")
    results, errors = check_and_bag_rows([{"image": str(bad)}], [PARAMS], TINY_QC, LungMasker(), str(tmp_path / "qc"),
                                         str(tmp_path / "bags"), _chain(), progress=False)
    assert results == [None] and list(errors) == [0]


def test_a_real_scan_gives_the_same_report_and_bag_on_one_read(shared_dir, tmp_path):
    """LIDC-IDRI-0001 (a real 2.5 mm chest CT) at the demo's preset: the one-read bag is the two-pass bag."""
    ct = shared_dir / "data" / "ct" / "LIDC-IDRI-0001" / "ct.nii.gz"
    if not ct.is_file():
        pytest.skip(f"{ct} is not in ../shared")
    params = BagParams.from_any({"spacing": [2.5, 2.5, 2.5], "hu_window": [-1000, 400], "k": 8, "patch_size": 16})
    pre = ChainPreprocess(build_preprocess((2.5, 2.5, 2.5), (-1000, 400), masker=LungMasker()))
    cfg, masker = QCConfig(), LungMasker()
    report = series_qc.screen_one(str(ct), None, cfg, masker, str(tmp_path / "a"))
    assert not report.failed
    two = build_bags([{"image": str(ct)}], params, tmp_path / "a" / "bags", num_workers=0, progress=False,
                     preprocess=pre)
    one = check_and_bag(str(ct), None, cfg, masker, str(tmp_path / "b"), params, str(tmp_path / "b" / "bags"), pre)
    assert one.one_read and one.report.as_rows("x") == report.as_rows("x")
    _same_bag(two[0]["bag"], one.bag)
