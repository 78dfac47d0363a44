"""lungcal.ctapp.evaluate.reports.log_split: the referral metrics of a binary split reach the tracker."""
from __future__ import annotations

import numpy as np
import pytest

from lungcal.calibration.metrics import calibration_report
from lungcal.calibration.selective import aurc, metrics_at_coverage
from lungcal.ctapp.evaluate.reports import log_split


class _Tracker:
    def __init__(self):
        self.metrics, self.figures, self.artifacts = {}, [], []

    def log_report(self, split, report):
        self.metrics.update({f"{split}/{k}": v for k, v in report.items()})

    def log_figure(self, fig, name):
        self.figures.append(name)

    def log_artifact(self, path, artifact_path=None):
        self.artifacts.append(path)


def test_log_split_logs_aurc_and_cov90_metrics_for_binary_tasks(tmp_path):
    rng = np.random.default_rng(0)
    y = rng.integers(0, 2, 120)
    p1 = np.clip(0.5 + (y - 0.5) * rng.uniform(-0.5, 1.0, 120), 0, 1)
    probs = np.stack([1 - p1, p1], 1)
    tr = _Tracker()
    log_split(tr, "test", probs, y, calibration_report(probs, y, n_bins=10, n_bootstrap=0), n_bins=10,
              subjects=[f"ct{i:04d}" for i in range(120)], workdir=tmp_path)
    at = metrics_at_coverage(probs, y, 0.9)
    full = metrics_at_coverage(probs, y, 1.0)
    m = tr.metrics
    assert m["test/aurc"] == pytest.approx(aurc(probs, y))
    for k in ("acc", "sensitivity", "specificity", "referred_cancer_share"):
        assert m[f"test/{k}_cov90"] == pytest.approx(at[k])
    assert m["test/n_referred_cov90"] == 12
    assert m["test/sensitivity"] == pytest.approx(full["sensitivity"])
    assert m["test/acc_cov90"] >= m["test/acc"]  # confident cases are easier here
    assert sorted(tr.figures) == ["plots/test_reliability.png", "plots/test_risk_coverage.png"]
