"""experiments/monitor_sites.py at a tiny size: the simulated site, a year of chunks, the tables."""
from __future__ import annotations

import numpy as np

from tests.experiments.conftest import load_script

ms = load_script("monitor_sites")


def test_a_simulated_site_and_its_months_carry_what_the_tables_print():
    rng = np.random.default_rng(0)
    s, f, p, y, acq = ms.population(rng, 400)
    assert s.shape == (400,) and f.shape == (400, ms.D) and len(acq) == 400 and 0.2 < y.mean() < 0.4
    assert abs(p.mean() - y.mean()) < 0.05  # the go-live posterior: calibrated
    _, _, p_new, y_new, acq_new = ms.population(rng, 400, scanner=ms.NEW)
    assert np.median([a.noise_hu for a in acq_new]) > 25 and np.median([a.edge_sigma_mm for a in acq_new]) > 1.0
    site = ms.make_site(rng, "all")
    assert site.reference.features is not None and 0 < site.threshold < 1
    rows = ms.run_year(rng, site, 30, view="all", scanner_from=2, months=3, old_rule=True, n_subsamples=2,
                       n_bootstrap=50, n_draws=100)
    assert [r["month"] for r in rows] == [1, 2, 3]
    assert rows[1]["verdict"] == "scanner_shift" and not rows[1]["valid"] and rows[1]["old_alert"]
    assert any(k.endswith("_hu") or k.endswith("_mm") for k in rows[1]["fired"])
    assert all(0 <= r["true"] <= 1 and set(r) >= {"est", "interval", "alerts", "why"} for r in rows)


def test_the_script_prints_its_tables(capsys):
    ms.main(["stable", "--sizes", "20", "--years", "1", "--subsamples", "2"])
    ms.main(["prevalence", "--sizes", "20", "--sites", "1", "--subsamples", "2"])
    out = capsys.readouterr().out
    assert "### Stable years (1 per size" in out and "| 20 | " in out
    assert "### Prevalence doubling in month 6" in out and "| month | true prevalence |" in out
