"""experiments/site_check_power.py: a draw's verdict is the site check's on the pool's scored rows; the table gives
each verdict's rate with its exact CI and the share right per change; a one-vendor site is drawn from one vendor."""
from __future__ import annotations

import numpy as np
import pytest

from lungcal.ctapp.evaluate.site_assessment import COMPARABLE, PREVALENCE_SHIFT, SCANNER_SHIFT, Reference
from tests.experiments.conftest import load_script


def _model(rng):
    y = (rng.random(200) < 0.4).astype(int)
    s = np.clip(0.4 * y + rng.normal(0.3, 0.15, 200), 0, 1)
    ref = Reference(s, y, rng.normal(size=(200, 6)) + y[:, None], "test").check()
    return {"reference": ref, "summary": None}


def test_a_draw_from_a_pool_like_the_reference_is_comparable_and_a_moved_one_is_not():
    power = load_script("site_check_power")
    rng = np.random.default_rng(0)
    model = _model(rng)
    y = (rng.random(150) < 0.4).astype(int)
    like = {"scores": np.clip(0.4 * y + rng.normal(0.3, 0.15, 150), 0, 1),
            "features": rng.normal(size=(150, 6)) + y[:, None], "acq": [None] * 150}
    idx = np.arange(60)
    assert power.verdict_of(model, like, idx, seed=0)["verdict"] == COMPARABLE
    moved = {**like, "features": like["features"] + 1.5}  # the embeddings moved, the outputs did not
    found = power.verdict_of(model, moved, idx, seed=0)
    assert found["verdict"] == SCANNER_SHIFT and found["reasons"] == ["embeddings beyond prevalence"]


def test_the_table_gives_each_verdicts_rate_with_its_exact_ci_and_the_share_right():
    power = load_script("site_check_power")
    results = {f"same||30|{d}": {"verdict": COMPARABLE if d else SCANNER_SHIFT,
                                 "reasons": [] if d else ["noise_hu"]} for d in range(10)}
    results |= {f"prevalence|0.11|60|{d}": {"verdict": PREVALENCE_SHIFT if d % 2 else COMPARABLE} for d in range(4)}
    results |= {f"noise|40 HU|30|{d}": {"verdict": SCANNER_SHIFT} for d in range(5)}
    lines = power.rate_table(results).splitlines()
    assert lines[2].startswith("| same |  | 30 | 10 | 9/10 [55, 100] % | 0/10 [0, 31] % | 1/10 [0, 45] % | "
                               "90 % [55, 100]")
    assert lines[2].endswith("| noise_hu 1 |")
    assert lines[3].endswith("| 100 % [40, 100] | - |")  # comparable and prevalence_shift are both right there
    assert lines[4].startswith("| noise | 40 HU | 30 | 5 | 0/5 [0, 52] % | 0/5 [0, 52] % | 5/5 [48, 100] %")


def test_one_vendor_is_the_mix_without_the_others():
    power = load_script("site_check_power")
    mix = power.one_vendor("vendor_d")
    assert [m.name for m in mix.models] == ["vendor_d"] and mix.models[0].frequency == pytest.approx(1.0)
