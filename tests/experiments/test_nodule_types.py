"""experiments/nodule_types.py on a tiny typed cohort: per-type counts, ranks and CPM intervals."""
from __future__ import annotations

import numpy as np

from lungcal.candidates.detector import Candidates
from lungcal.data.synthetic import make_cohort
from tests.experiments.conftest import load_script


def test_per_type_summary_on_a_tiny_cohort(tmp_path):
    nt = load_script("nodule_types")
    path = make_cohort(tmp_path, n_subjects=3, prevalence=0.5, seed=2, shape=(64, 64, 40), spacing=(5.0, 5.0, 6.0),
                       formats=("nifti",), nodule_types="even", masses=1.0, num_workers=1, progress=False)
    per, summary = nt.run_cohort(path, ["log", "subsolid"])
    truth = nt._truth(path.parent / "annotations.csv")
    n_nodules = sum(len(v) for v in truth.values())
    assert len(per) == 2 * n_nodules
    for p in per:
        assert p["in_bag"] <= p["hit"] and (p["rank"] > 0) == bool(p["hit"])
    for key, v in summary.items():
        if key.endswith("seconds_per_ct"):
            continue
        assert v["in_bag"] <= v["found"] <= v["n"]
        lo, hi = v["cpm_ci"]
        assert 0 <= v["cpm"] <= 1 and (np.isnan(lo) or 0 <= lo <= hi <= 1)
    assert any(p["mask_cover"] != "" for p in per) == any(n["contact"] for v in truth.values() for n in v)


def test_score_ranks_the_first_hit():
    nt = load_script("nodule_types")
    c = Candidates([[0, 0, 0]] * 3, [[20.0, 0, 0], [1.0, 0, 0], [0.5, 0, 0]], [2.0] * 3, [3.0, 2.0, 1.0])
    nods = [{"ras": np.zeros(3), "d": 4.0}, {"ras": np.array([50.0, 0, 0]), "d": 4.0}]
    assert nt._score(c, nods) == [(True, 2, 0.5), (False, 0, 30.0)]
