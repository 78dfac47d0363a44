"""The study's claims as paired differences, read back from the runs' logged predictions."""
from __future__ import annotations

import numpy as np
import pytest
from mlflow.tracking import MlflowClient

from lungcal.calibration.metrics import accuracy, auroc, ece
from lungcal.ctapp.evaluate.reports import write_predictions
from lungcal.study.differences import collect_claims, confidence_gap, paper_says, render_claims
from lungcal.study.report import build_report
from lungcal.tracking import RunTracker, default_tracking_uri

N = 300


def _probs(seed: int, sharp: float, shift: float = 0.0):
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 2, N)
    z = (2 * y - 1) * 1.2 + rng.normal(0, 1.5, N)
    p = 1 / (1 + np.exp(-(sharp * z + shift)))
    return np.stack([1 - p, p], 1), y


def _log(uri, tmp, s1, s2, seed, probs, y):
    subjects = [f"S{i:04d}" for i in range(N)]
    with RunTracker("nlst", f"{s1}-{s2}-{seed}", tracking_uri=uri,
                    tags={"lungcal.dataset": "synthetic", "lungcal.stage1": s1, "lungcal.stage2": s2}) as tr:
        tr.log_params({"seed": seed})
        tr.log_metrics({"test/ece": ece(probs, y, n_bins=10)})
        path = write_predictions(tmp / f"{s1}-{s2}-{seed}" / "test_predictions.csv", subjects, y, probs)
        tr.log_artifact(path, "predictions")


@pytest.fixture()
def store(tmp_path):
    uri = default_tracking_uri(tmp_path)
    for seed in (0, 1):
        base, y = _probs(seed, sharp=8.0)  # over-confident
        ts, _ = _probs(seed, sharp=1.0)  # the same ranking, softer
        _log(uri, tmp_path, "ce", "none", seed, base, y)
        _log(uri, tmp_path, "ce", "ts", seed, ts, y)
        _log(uri, tmp_path, "focal", "none", seed, _probs(seed, sharp=1.0)[0], y)
    fm, y = _probs(5, sharp=0.3)  # under-confident
    _log(uri, tmp_path, "focal_mixup", "none", 0, fm, y)
    return uri


def test_claims_are_paired_differences_on_the_same_cases(store):
    client = MlflowClient(store)
    exp = client.get_experiment_by_name("nlst").experiment_id
    claims = {c.name: c for c in collect_claims(client, exp, n_bootstrap=300)}
    ts = claims["ΔECE(ce+TS − ce)"]
    assert sorted(ts.per_seed) == ["0", "1"]
    for seed in (0, 1):
        base, y = _probs(seed, sharp=8.0)
        soft, _ = _probs(seed, sharp=1.0)
        want = ece(soft, y, n_bins=10) - ece(base, y, n_bins=10)  # CT: 10 bins
        got = ts.per_seed[str(seed)]
        assert got["diff"] == pytest.approx(want, abs=1e-6)  # CSV rounding to 1e-6
        assert got["ci_low"] <= got["diff"] <= got["ci_high"] < 0 and got["significant"]
    assert ts.mean == pytest.approx(np.mean([ts.per_seed[s]["diff"] for s in "01"]))
    auc = claims["ΔAUC(focal − ce)"].per_seed["0"]
    # a monotone transform keeps the ranking; the CSV's 6 decimals tie a few saturated probabilities
    assert auc["diff"] == pytest.approx(0.0, abs=1e-3)
    assert auroc(*_probs(0, 1.0)) == pytest.approx(auroc(*_probs(0, 8.0)))
    gap = claims["confidence − accuracy (focal_mixup)"].per_seed["0"]
    fm, y = _probs(5, sharp=0.3)
    assert gap["diff"] == pytest.approx(fm.max(1).mean() - accuracy(fm, y), abs=1e-5)
    assert gap["ci_high"] < 0  # under-confident
    assert confidence_gap(fm[:, 1], y) == pytest.approx(confidence_gap(fm, y))
    text = "\n".join(render_claims(claims.values()))
    assert "ΔAUC(focal − ce)" in text and "(not significant)" in text
    # a CT cohort: TS and the focal AUC are the paper's claims there, Focal+Mixup's under-confidence is not
    assert ts.paper.startswith("TS lowers ECE") and "on CT" in claims["ΔAUC(focal − ce)"].paper
    row = next(line for line in text.splitlines() if "confidence − accuracy (focal_mixup)" in line)
    assert "no claim on this dataset" in row and "balanced CIFAR-10 only" in row


@pytest.mark.parametrize(("dataset", "kind", "stage1", "says"), [
    ("cifar10", "gap", "", "under-confident"),
    ("cifar10lt", "gap", "", "no claim"),
    ("nlst", "las", "ce", "raises ECE on CT"),
    ("cifar10lt", "las", "mixup", "ECE rises 1.72 -> 5.18"),
    ("cifar10lt", "las", "ce", "no claim"),
    ("cifar10", "auc", "", "no claim"),
])
def test_paper_says_what_the_paper_states_per_dataset(dataset, kind, stage1, says):
    assert says in paper_says(dataset, kind, stage1)


def test_report_carries_the_claims(store, tmp_path):
    res = build_report("nlst", tmp_path / "r", tracking_uri=store, log_run=False)
    md = res["markdown"].read_text()
    assert "## Paired differences" in md and "ΔECE(ce+TS − ce)" in md
