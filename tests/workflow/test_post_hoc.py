"""The post-hoc step of the shared skeleton (:func:`lungcal.workflow.post_hoc_runs`): one linked run per
calibrator, the clinical measures in its test report, the source prevalence for later prior adjustment,
the stored JSON calibrator, the no-signal tag, the paired difference to stage 1.

Oracles: the calibrators fitted directly on the validation logits, scikit-learn's unpenalised
logistic regression for the calibration slope / intercept, the label means for the prevalences.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from mlflow.tracking import MlflowClient
from sklearn.linear_model import LogisticRegression

from lungcal.calibration.metrics import paired_bootstrap_diff
from lungcal.calibration.scaling import PlattScaler, TemperatureScaler, probabilities
from lungcal.ctapp.evaluate.calibrators import load_calibrator, reference_calibrator
from lungcal.ctapp.evaluate.reports import evaluate_probs
from lungcal.tracking import TAG_CALIBRATOR, TAG_FIT_WARNING, RunTracker, linked_calibrator
from lungcal.workflow import Evaluation, SplitScores, Store, post_hoc_runs


def _logits(n, seed, scale=3.0, prevalence=0.3):
    rng = np.random.default_rng(seed)
    y = (rng.random(n) < prevalence).astype(int)
    margin = rng.normal(0.8, 1.5, n) * np.where(y == 1, 1, -1)
    return torch.tensor(np.stack([np.zeros(n), scale * margin], 1), dtype=torch.float32), torch.tensor(y)


class _Host:
    """The smallest owner of post-hoc runs: what :func:`post_hoc_runs` asks of a stage-1 run."""

    experiment, run_name, method = "nlst", "s1", "ce"

    def __init__(self, tmp_path, names):
        self.store = Store(output_dir=tmp_path, tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
        self.evaluation = Evaluation(n_bins=10, n_bootstrap=100, seed=0, post_hoc=names)
        self.logged = []

    def tags(self, stage2):
        return {"lungcal.stage1": "ce", "lungcal.stage2": stage2, "lungcal.site": "site-a"}

    def params(self):
        return {"method": "ce"}

    def log_post_hoc(self, tracker, name, calibrator, probs, report, scores, *, reference, threshold):
        tracker.log_report("test", report)
        self.logged.append((name, reference, threshold))


def _post_hoc(tmp_path, names, val, test, train_labels=None):
    host = _Host(tmp_path, names)
    with RunTracker("nlst", "s1", tracking_uri=host.store.uri,
                    tags={"lungcal.stage1": "ce", "lungcal.stage2": "none"}) as tr:
        stage1 = tr.run_id
    zt, yt = test
    p_stage1 = probabilities(zt)
    scores = SplitScores(val[0], val[1].numpy(), zt, yt.numpy(), p_stage1, evaluate_probs(p_stage1, yt),
                         extra={} if train_labels is None else {"train_labels": train_labels})
    res = post_hoc_runs(host, stage1, scores)
    assert [n for n, *_ in host.logged] == list(names) and sum(ref for _, ref, _ in host.logged) == 1
    for r in res:  # the paired difference to stage 1, on the same test cases
        want = paired_bootstrap_diff("ece", r["probs"], p_stage1, yt.numpy(), n_bootstrap=100, seed=0, n_bins=10)
        assert r["ece_diff"]["diff"] == pytest.approx(want["diff"]) and r["ece_diff"]["ci_low"] == want["ci_low"]
    return host.store.uri, stage1, res


def _logit(p):
    p = np.clip(p, 1e-8, 1 - 1e-8)
    return np.log(p / (1 - p))


def test_each_calibrator_gets_a_linked_run_with_clinical_measures_and_its_json(tmp_path):
    val, test = _logits(300, 1), _logits(400, 2)
    train_y = torch.tensor([0, 1, 1, 0, 0, 0, 0, 1])
    uri, stage1, res = _post_hoc(tmp_path, ["ts", "platt"], val, test, train_labels=train_y)
    client = MlflowClient(uri)
    s1 = client.get_run(stage1)
    assert s1.data.metrics["val/prevalence"] == pytest.approx(float(val[1].float().mean()))
    assert s1.data.metrics["train/prevalence"] == pytest.approx(3 / 8)
    zt, yt = test
    fitted = {"ts": TemperatureScaler().fit(*val), "platt": PlattScaler().fit(*val)}
    expected = {"ts": probabilities(zt, fitted["ts"].temperature),
                "platt": np.asarray(fitted["platt"].predict_proba(zt.numpy()))}
    for r in res:
        run = client.get_run(r["run_id"])
        m, name = run.data.metrics, r["name"]
        assert run.data.tags[TAG_CALIBRATOR] == name and TAG_FIT_WARNING not in run.data.tags
        assert m["source_prior"] == pytest.approx(float(val[1].float().mean()))
        # the clinical measures pass through evaluate_probs into {split}/... with CIs
        p1 = expected[name][:, 1]
        lr = LogisticRegression(C=np.inf, tol=1e-10, max_iter=1000).fit(_logit(p1)[:, None], yt.numpy())
        assert m["test/cal_slope"] == pytest.approx(float(lr.coef_[0, 0]), abs=1e-4)
        assert m["test/oe_ratio"] == pytest.approx(float(yt.sum()) / p1.sum(), rel=1e-9)
        for key in ("cal_slope", "cal_intercept", "oe_ratio"):
            assert r["test"][key] == pytest.approx(m[f"test/{key}"])
            assert m[f"test/{key}_ci_low"] <= m[f"test/{key}"] <= m[f"test/{key}_ci_high"]
        # the stored JSON is the fitted calibrator
        loaded = linked_calibrator(uri, s1, load=load_calibrator) if name == "ts" else None
        if loaded is not None:
            assert loaded[0] == "ts"
            np.testing.assert_allclose(loaded[1].predict_proba(zt.numpy()), expected["ts"], atol=1e-10)
    # of several reference calibrators, ts is the reference one (platt was logged later)
    assert reference_calibrator(uri, s1).name == "ts"
    assert res[0]["temperature"] == pytest.approx(fitted["ts"].temperature, rel=1e-9)


def test_only_platt_is_the_reference_when_there_is_no_ts(tmp_path):
    val, test = _logits(300, 3), _logits(200, 4)
    uri, stage1, _ = _post_hoc(tmp_path, ["platt"], val, test)
    s1 = MlflowClient(uri).get_run(stage1)
    ref = reference_calibrator(uri, s1)
    assert ref.name == "platt"
    np.testing.assert_allclose(ref.predict_proba(test[0].numpy()),
                               PlattScaler().fit(*val).predict_proba(test[0].numpy()), atol=1e-12)
    assert "train/prevalence" not in s1.data.metrics


def test_a_no_signal_fit_is_tagged(tmp_path):
    rng = np.random.default_rng(5)
    y = torch.tensor((rng.random(200) < 0.4).astype(int))
    noise = torch.tensor(np.stack([np.zeros(200), rng.normal(0, 0.2, 200)], 1), dtype=torch.float32)
    uri, _, res = _post_hoc(tmp_path, ["ts"], (noise, y), _logits(100, 6))
    run = MlflowClient(uri).get_run(res[0]["run_id"])
    assert "~ chance" in run.data.tags[TAG_FIT_WARNING] and res[0]["warnings"]
    assert "CIs are wide" not in run.data.tags[TAG_FIT_WARNING]  # few events alone is not "no signal"


def test_evaluate_probs_reports_the_clinical_measures_with_cis():
    zt, yt = _logits(300, 7)
    rep = evaluate_probs(probabilities(zt), yt, n_bins=10, n_bootstrap=50)
    for key in ("cal_slope", "cal_intercept", "oe_ratio"):
        assert np.isfinite(rep[key]) and rep[f"{key}_ci_low"] <= rep[f"{key}_ci_high"]
