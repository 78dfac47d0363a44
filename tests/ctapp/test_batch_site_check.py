"""predict --site checks its new CTs, as a whole, against the site's own calibration CTs."""
from __future__ import annotations

import numpy as np
from mlflow.tracking import MlflowClient

from lungcal.ct.acquisition import AcquisitionStats, summarize_acquisitions
from lungcal.ctapp.evaluate.reports import log_site_reference
from lungcal.ctapp.evaluate.site_assessment import COMPARABLE, MIN_SITE_CTS, SCANNER_SHIFT
from lungcal.ctapp.infer.ood import batch_check, batch_lines
from lungcal.tracking import ACQUISITION_ARTIFACT, RunTracker


def _cases(rng, n, noise=1.0, prevalence=0.4):
    y = (rng.random(n) < prevalence).astype(int)
    f = rng.normal(size=(n, 6)) * noise
    f[:, 0] += np.where(y == 1, 1.5, -1.5)
    s = f[:, 0] + 0.1 * f[:, 1]
    return np.stack([np.zeros(n), s], 1), f, y  # logits whose binary score is s


def _acq(rng, n, noise_hu=20.0):
    return [AcquisitionStats(1.0, 1.0, 0.7, -1000 + rng.normal(0, 3), noise_hu * rng.lognormal(0, 0.05), 0.8)
            for _ in range(n)]


def test_new_cts_like_the_calibration_cts_pass_and_another_scanner_is_warned_of(tmp_path):
    rng = np.random.default_rng(0)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    logits, feats, y = _cases(rng, 300)
    with RunTracker("nlst", "ce+ts@site-a", tracking_uri=uri) as tr:  # what recalibrate logs of its val CTs
        log_site_reference(tr, logits, y, feats, tmp_path / "work")
        tr.log_dict(summarize_acquisitions(_acq(rng, 300)), ACQUISITION_ARTIFACT)
        run_id = tr.run_id
    site_run = MlflowClient(uri).get_run(run_id)

    z, f, _ = _cases(rng, 80)
    same = batch_check(uri, site_run, "site-a", z, f, _acq(rng, 80))
    assert same["verdict"] == COMPARABLE and same["n"] == 80, same
    assert batch_lines(same, "site-a") == ["  site check    these 80 CTs against site site-a's calibration CTs: "
                                           "comparable"]

    z, f, _ = _cases(rng, 80, noise=1.5)
    shifted = batch_check(uri, site_run, "site-a", z, f, _acq(rng, 80, noise_hu=35.0))
    assert shifted["verdict"] == SCANNER_SHIFT and shifted["effect"]["large"]
    lines = batch_lines(shifted, "site-a")
    assert "scanner_shift (" in lines[0] and lines[1].startswith("  WARNING       these CTs differ")

    few = batch_check(uri, site_run, "site-a", z[:5], f[:5], _acq(rng, 5))
    assert few["verdict"] is None and f"needs {MIN_SITE_CTS}" in few["note"]
    assert batch_lines(few, "site-a")[0].startswith("  site check    not run on these CTs: 5 CT(s), too few")
    assert batch_lines(None, None) == []

    with RunTracker("nlst", "old recalibration", tracking_uri=uri) as tr:
        old = MlflowClient(uri).get_run(tr.run_id)
    none = batch_check(uri, old, "site-b", z, f, _acq(rng, 80))
    assert none["verdict"] is None and "logged no calibration CTs" in none["note"]
