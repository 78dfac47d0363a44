"""Performance at a site's threshold by subgroup: the groups read off the rows and annotations, the numbers by hand."""
from __future__ import annotations

import math

import numpy as np
import pytest
from scipy.stats import binomtest

from lungcal.ctapp.site.subgroups import ct_groups, size_band, subgroup_rows, subgroup_text


def test_groups_come_from_the_rows_and_the_annotations_beside_the_datalist(tmp_path):
    (tmp_path / "annotations.csv").write_text(
        "ct,subject,diameter_mm,malignant,nodule_type\n"
        "c1,s1,6.0,0,solid\nc1,s1,14.0,1,part-solid\nc1,s1,25.0,0,solid\n"  # a cancer: its largest malignant
        "c2,s2,8.0,0,ground-glass\nc2,s2,4.0,0,solid\n")                    # no cancer: its largest nodule
    rows = [{"ct": "c1", "subject": "s1", "label": 1, "acquisition": {"profile": "vendor_a"}},
            {"ct": "c2", "subject": "s2", "label": 0, "acquisition": {"manufacturer": "ACME"}},
            {"ct": "c3", "subject": "s3", "label": 0, "scanner": "CT-3", "nodule_type": "solid", "nodule_mm": 35},
            {"ct": "c4", "subject": "s4", "label": 1}]
    g = ct_groups(rows, tmp_path / "datalist.json")
    assert g["scanner"] == ["vendor_a", "ACME", "CT-3", "unknown"]
    assert g["nodule type"] == ["part-solid", "ground-glass", "solid", "unknown"]
    assert g["nodule size"] == ["10-20 mm", "6-10 mm", ">=30 mm", "unknown"]
    assert ct_groups(rows[:1])["nodule size"] == ["unknown"]  # no annotations: unknown
    assert size_band(5.99) == "<6 mm" and size_band(6.0) == "6-10 mm" and size_band(float("nan")) == "unknown"


def test_rates_and_cis_per_group_by_hand():
    p = np.array([0.9, 0.4, 0.05, 0.3, 0.02, 0.6])
    y = np.array([1, 1, 0, 1, 0, 0])
    groups = {"scanner": ["a", "a", "a", "b", "b", "b"]}
    rows = subgroup_rows(p, y, groups, threshold=0.3, n_bootstrap=200, seed=1)
    a, b = rows
    assert (a["group"], a["n"], a["n_cancers"]) == ("a", 3, 2)
    assert a["work_up_rate"] == pytest.approx(2 / 3) and a["sensitivity"] == pytest.approx(1.0)
    ci = binomtest(2, 3).proportion_ci(confidence_level=0.95, method="exact")
    assert a["work_up_ci"] == pytest.approx((ci.low, ci.high))
    assert a["oe"] == pytest.approx(2 / 1.35)
    lo, hi = a["oe_ci"]
    assert lo <= hi
    assert b["work_up_rate"] == pytest.approx(2 / 3) and b["sensitivity"] == pytest.approx(1.0)  # 0.3 >= 0.3
    none = subgroup_rows(p[[2, 4]], y[[2, 4]], {"scanner": ["c", "c"]}, 0.3)[0]
    assert none["n_cancers"] == 0 and math.isnan(none["sensitivity"])
    text = subgroup_text(rows, "test", 0.3)
    assert text[0].startswith("  by subgroup   on the test split at p(cancer) >= 0.3000")
    assert "scanner" in text[2] and "67% [" in text[2] and "100% [" in text[2]
    with pytest.raises(ValueError, match="2 groups for 6 CTs"):
        subgroup_rows(p, y, {"scanner": ["a", "b"]}, 0.3)
