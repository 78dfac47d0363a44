"""The lesion test bed (lungcal.ctapp.evaluate.lesion_bed): a small run on LIDC-IDRI-0001 (../shared; skipped
where it is absent), the real lesions' annotation files, and the tables."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from lungcal.candidates.sensitivity import wilson_interval
from lungcal.ctapp.evaluate.lesion_bed import (
    PRESETS,
    bed_rows,
    real_lesions,
    score_real,
    sensitivity_table,
    size_band,
    summary,
)

#: the fields of a bed row (bed_rows' docstring: kind, place, size, rank, in the bag, candidates, mask share)
ROW_FIELDS = {"background", "scan", "preset", "detector", "kind", "place", "diameter_mm", "band", "gg_hu",
              "core_frac", "posterior", "rank", "in_bag", "n_candidates", "mask_share", "seconds"}


def test_a_small_bed_run_gives_one_row_per_lesion_with_the_documented_fields(lidc_background):
    preset = PRESETS["default"]
    cells = {("solid", "free"): 1, ("ground-glass", "pleura"): 1}
    seen = []
    rows = list(bed_rows([(lidc_background, [])], {"log": {}}, [preset], cells, seed=1,
                         on_scan=lambda bg, scan, lesions: seen.append((scan, lesions))))
    assert [scan for scan, _ in seen] == ["LIDC-IDRI-0001-000"] and len(seen[0][1]) == 2  # two to a scan
    assert len(rows) == 2 and all(set(r) == ROW_FIELDS for r in rows)
    assert sorted((r["kind"], r["place"]) for r in rows) == [("ground-glass", "pleura"), ("solid", "free")]
    for r, lesion in zip(rows, seen[0][1]):
        assert (r["kind"], r["diameter_mm"], r["scan"]) == (lesion.kind, lesion.diameter_mm, "LIDC-IDRI-0001-000")
        assert (r["background"], r["preset"], r["detector"]) == ("LIDC-IDRI-0001", "default", "log")
        assert r["band"] == size_band(r["diameter_mm"])
        assert r["in_bag"] == (0 < r["rank"] <= preset.k)
        assert 1 <= r["n_candidates"] <= 32 and r["seconds"] > 0 and 0 <= r["mask_share"] <= 1
    solid = next(r for r in rows if r["kind"] == "solid")
    assert solid["mask_share"] > 0.95  # free in the lung: inside the mask the detector is given
    if solid["diameter_mm"] >= 8:  # a solid nodule of 8 mm or more free in the lung is ranked by the default detector
        assert solid["rank"] > 0


def test_score_real_puts_the_lidc_nodule_in_the_default_bag(lidc_background, shared_dir):
    reals = real_lesions(shared_dir / "data" / "ct" / "LIDC-IDRI-0001")
    rows = score_real([(lidc_background, reals)], {"log": {}}, [PRESETS["default"]])
    assert len(rows) == 1
    r = rows[0]
    assert r["case"] == "LIDC-IDRI-0001" and r["diameter_mm"] == 33.8  # judged as a mass (>= 30 mm)
    assert r["in_bag"] and 1 <= r["rank"] <= 8 and r["mask_share"] > 0.5


def test_real_lesions_reads_each_annotation_file_lps_to_ras(tmp_path):
    (tmp_path / "nodules_consensus.csv").write_text(
        "cluster,n_readers,lps_x_mm,lps_y_mm,lps_z_mm,col_x,row_y,slice_k,mean_max_xy_extent_mm,malignancy_scores\n"
        "0,4,56.4,86.4,-115.8,316.3,367.0,89.7,33.8,5;5;5;4\n")
    (tmp_path / "luna16_annotation.csv").write_text(
        "seriesuid,coordX,coordY,coordZ,diameter_mm\nx,-57.4,131.2,-520.4,15.5\n")
    (tmp_path / "lesions.csv").write_text(
        "roi,lps_x_mm,lps_y_mm,lps_z_mm,lps_xmin_mm,lps_ymin_mm,lps_zmin_mm,lps_xmax_mm,lps_ymax_mm,lps_zmax_mm\n"
        "GTV-1,-72.2,14.4,-12.7,-124.7,-29.9,-49.4,-27.0,66.8,25.6\n")
    (tmp_path / "tumor_bboxes.csv").write_text(
        "dicom_file,lps_z_mm,class,lps_xmin_mm,lps_ymin_mm,lps_xmax_mm,lps_ymax_mm\n"
        "1.dcm,176.0,A,-78.8,-109.9,-39.4,-77.6\n2.dcm,184.0,A,-86.5,-117.0,-33.5,-75.7\n")
    got = {r.source.split()[0]: r for r in real_lesions(tmp_path)}
    assert set(got) == {"nodules_consensus.csv", "luna16_annotation.csv", "lesions.csv", "tumor_bboxes.csv"}
    assert got["nodules_consensus.csv"].centre_ras == (-56.4, -86.4, -115.8)
    assert got["nodules_consensus.csv"].diameter_mm == 33.8 and got["nodules_consensus.csv"].case == tmp_path.name
    assert got["luna16_annotation.csv"].centre_ras == (57.4, -131.2, -520.4)
    assert got["lesions.csv"].centre_ras == (72.2, -14.4, -12.7)
    assert got["lesions.csv"].diameter_mm == pytest.approx(np.mean([97.7, 96.7, 75.0]))  # the box's mean extent
    assert got["lesions.csv"].source == "lesions.csv (GTV-1)"
    # per-slice boxes: their union, centred, its mean in-plane extent
    np.testing.assert_allclose(got["tumor_bboxes.csv"].centre_ras, (60.0, 96.35, 180.0))
    assert got["tumor_bboxes.csv"].diameter_mm == pytest.approx(np.mean([53.0, 41.3]))
    assert real_lesions(tmp_path / "nothing") == []


def _row(kind, place, d, rank, preset="default", det="log", scan="s0", n=32, sec=1.0):
    k = {"default": 8, "fullres": 16}[preset]
    return {"kind": kind, "place": place, "diameter_mm": d, "band": size_band(d), "rank": rank,
            "in_bag": 0 < rank <= k, "preset": preset, "detector": det, "scan": scan, "n_candidates": n,
            "seconds": sec}


def test_sensitivity_table_counts_shares_cis_and_ranks_in_kind_and_place_order():
    rows = [_row("mass", "pleura", 40, 1), _row("solid", "free", 12, 1), _row("solid", "free", 9, 3),
            _row("solid", "free", 5, 0), _row("solid", "pleura", 25, 12),
            _row("solid", "free", 12, 2, preset="fullres")]
    lines = sensitivity_table(rows).splitlines()
    assert lines[0] == "| kind | place | default log | fullres log |"
    lo, hi = wilson_interval(2, 3)
    assert lines[2] == (f"| solid | free | 2/3 67 % [{100 * lo:.0f}, {100 * hi:.0f}], rank 2 "
                        "| 1/1 100 % [21, 100], rank 2 |")
    assert lines[3] == "| solid | pleura | 0/1 0 % [0, 79], rank 12 | - |"  # reached, but past K = 8
    assert lines[4].startswith("| mass | pleura | 1/1")  # KINDS order: solid before mass
    bands = sensitivity_table(rows, ("kind", "band"), where=lambda r: r["preset"] == "default").splitlines()
    assert [b.split("|")[2].strip() for b in bands[2:]] == ["0-6", "8-10", "10-15", "20-30", "30-45"]


def test_summary_takes_medians_per_scan_and_size_bands_have_edges():
    rows = [_row("solid", "free", 10, 1, scan="a", n=10, sec=1.0), _row("solid", "free", 12, 1, scan="a", n=10),
            _row("solid", "free", 10, 1, scan="b", n=20, sec=3.0), _row("solid", "free", 10, 1, scan="c", sec=2.0)]
    assert summary(rows) == {("default", "log"): {"scans": 3, "candidates_median": 20.0, "seconds_median": 2.0}}
    assert [size_band(d) for d in (4.0, 5.99, 6.0, 29.9, 30.0, 69.9, 70.0)] == \
        ["0-6", "0-6", "6-8", "20-30", "30-45", "45-70", ">=70"]


def test_the_presets_are_the_bundles_bag_geometry():
    """The bed measures the bags the bundles build: bundles/nlst_focal.json, and with bundles/fullres.json."""
    bundles = Path(__file__).resolve().parents[2] / "bundles"
    base = json.loads((bundles / "nlst_focal.json").read_text())
    full = {**base, **json.loads((bundles / "fullres.json").read_text())}
    for name, cfg in (("default", base), ("fullres", full)):
        p = PRESETS[name]
        assert (p.spacing, p.k, p.patch_size) == (cfg["spacing"][0], cfg["k"], cfg["patch_size"]), name
        assert len(set(cfg["spacing"])) == 1
