"""Metrics against independent oracles: netcal, torchmetrics, MONAI, scikit-learn, scipy and plain loops."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from monai.metrics import CalibrationErrorMetric
from scipy.optimize import minimize
from scipy.special import expit, logit

from lungcal.calibration import metrics as M
from lungcal.calibration.metrics import ece_consistency_pvalue
from lungcal.errors import ConfigError, DataError

netcal_metrics = pytest.importorskip("netcal.metrics")
tm = pytest.importorskip("torchmetrics.functional.classification")
skm = pytest.importorskip("sklearn.metrics")
sk_linear = pytest.importorskip("sklearn.linear_model")


def _softmax(z):
    e = np.exp(z - z.max(1, keepdims=True))
    return e / e.sum(1, keepdims=True)


@pytest.fixture
def multiclass():
    rng = np.random.default_rng(0)
    p = _softmax(rng.normal(size=(3000, 10)) * 2.5)
    y = np.where(rng.uniform(size=3000) < 0.6, p.argmax(1), rng.integers(0, 10, 3000))
    return p, y


@pytest.fixture
def saturated():
    rng = np.random.default_rng(1)
    p = _softmax(rng.normal(size=(2000, 5)) * 40.0)  # many rows with confidence exactly 1.0
    y = np.where(rng.uniform(size=2000) < 0.8, p.argmax(1), rng.integers(0, 5, 2000))
    assert (p.max(1) == 1.0).sum() > 100
    return p, y


@pytest.mark.parametrize("n_bins", [10, 15])
@pytest.mark.parametrize("data", ["multiclass", "saturated"])
def test_ece_equals_netcal(data, n_bins, request):
    p, y = request.getfixturevalue(data)
    ref = netcal_metrics.ECE(bins=n_bins).measure(p, y)
    assert M.ece(p, y, n_bins) == pytest.approx(ref, abs=1e-6)
    assert M.ece(torch.from_numpy(p), torch.from_numpy(y), n_bins) == pytest.approx(ref, abs=1e-6)


def test_ece_equals_torchmetrics_without_confidence_one(multiclass):
    p, y = multiclass
    assert (p.max(1) < 1.0).all()
    for norm in ("l1", "l2", "max"):
        ref = tm.multiclass_calibration_error(torch.from_numpy(p), torch.from_numpy(y), 10,
                                              n_bins=15, norm=norm).item()
        assert M.ece(p, y, 15, norm=norm) == pytest.approx(ref, abs=1e-6)


def test_confidence_one_differs_from_torchmetrics_by_design():
    preds, target = np.array([0.95, 1.0]), np.array([1, 0])
    ours = M.ece(preds, target, n_bins=10)
    theirs = tm.binary_calibration_error(torch.tensor(preds), torch.tensor(target), n_bins=10).item()
    assert ours == pytest.approx(0.475, abs=1e-12)
    assert theirs == pytest.approx(0.525, abs=1e-6)
    assert M.ece(preds, target, n_bins=10, mode="positive_class") == pytest.approx(0.475)


def _monai_classwise_ece(p, y, n_bins, right=False):
    """MONAI's ``CalibrationErrorMetric`` over the cases as the spatial dimension: ``(N, C)`` -> ``(1, C, N)``."""
    pt = torch.as_tensor(p, dtype=torch.float32).T[None].contiguous()  # (1, C, N): one "image" of N voxels
    onehot = torch.nn.functional.one_hot(torch.as_tensor(y), p.shape[1]).to(torch.float32).T[None].contiguous()
    metric = CalibrationErrorMetric(num_bins=n_bins, include_background=True, calibration_reduction="expected",
                                    metric_reduction="mean", right=right)
    metric(y_pred=pt, y=onehot)
    return float(metric.aggregate())


@pytest.mark.parametrize("n_bins", [10, 15])
def test_classwise_ece_equals_monai(multiclass, n_bins):
    """Our :func:`classwise_ece` equals MONAI's ``CalibrationErrorMetric`` (monai.metrics.calibration) with
    ``include_background=True`` (every class), ``calibration_reduction="expected"`` (per class, the
    count-weighted mean gap over bins: our per-class l1 ECE), ``metric_reduction="mean"`` (the mean over
    the C channels: our mean over classes) and ``right=False``, on probabilities reshaped from ``(N, C)`` to
    ``(1, C, N)`` and one-hot labels likewise (class-wise over the spatial dimension).

    ``right=False`` is MONAI's ``torch.bucketize(p, edges[1:], right=False)``, which puts p into the bin
    with ``lo < p <= hi``: our ``(lo, hi]`` bins, 0 in the first (its docstring says ``[left, right)``,
    the code does the opposite). Its top edge is ``1 + eps32`` and it bins and sums in float32, so it
    agrees to float32 rounding, not to the last digit, and could differ for a p within ~1e-7 of an edge.
    """
    p, y = multiclass
    assert M.classwise_ece(p, y, n_bins) == pytest.approx(_monai_classwise_ece(p, y, n_bins), abs=1e-6)


def test_classwise_ece_on_bin_edges_matches_monai_right_false_only():
    """Probabilities exactly on the edges 0, 0.3, 0.5 and 1: ``(lo, hi]`` is MONAI's ``right=False``;
    ``right=True`` (``[lo, hi)``) moves 0.3 and 0.5 up a bin and changes the value."""
    p1 = np.array([0.0, 0.3, 0.3, 0.5, 0.5, 0.25, 1.0, 0.95])
    p = np.stack([1.0 - p1, p1], axis=1)
    y = np.array([0, 1, 0, 1, 1, 0, 1, 0])
    ours = M.classwise_ece(p, y, 10)
    assert ours == pytest.approx(_monai_classwise_ece(p, y, 10), abs=1e-7)
    assert abs(ours - _monai_classwise_ece(p, y, 10, right=True)) > 1e-3


def test_zero_confidence_goes_to_first_bin():
    p = np.array([0.0, 0.0, 0.05])
    r = M.reliability_bins(p, np.array([0, 1, 1]), n_bins=10, mode="positive_class")
    assert r["count"][0] == 3 and r["count"].sum() == 3
    assert r["confidence"][0] == pytest.approx(0.05 / 3)


def test_bin_edges_are_right_closed():
    # 0.5 belongs to (0.4, 0.5], not (0.5, 0.6]
    r = M.reliability_bins(np.array([0.5, 0.6]), np.array([1, 1]), n_bins=10, mode="positive_class")
    assert r["count"][4] == 1 and r["count"][5] == 1 and r["count"][6] == 0


def test_positive_class_mode_and_binary_shapes():
    rng = np.random.default_rng(3)
    q = rng.uniform(size=500)
    y = (rng.uniform(size=500) < q**2).astype(int)
    # positive_class: reliability of p(y=1) = a loop over bins written out by hand
    edges = np.linspace(0, 1, 11)
    gap = 0.0
    for lo, hi in zip(edges[:-1], edges[1:]):
        sel = (q > lo) & (q <= hi) if lo > 0 else (q <= hi)
        if sel.any():
            gap += sel.sum() / 500 * abs(q[sel].mean() - y[sel].mean())
    assert M.ece(q, y, 10, mode="positive_class") == pytest.approx(gap, abs=1e-12)
    both = np.stack([1 - q, q], 1)
    assert M.ece(both, y, 10, mode="positive_class") == pytest.approx(gap, abs=1e-12)
    # top-label on (N,) equals top-label on (N, 2)
    assert M.ece(q, y, 10) == pytest.approx(M.ece(both, y, 10), abs=1e-12)
    with pytest.raises(DataError, match="positive_class"):
        M.ece(np.full((4, 3), 1 / 3), np.zeros(4, int), mode="positive_class")


def test_mce_and_l2(multiclass):
    p, y = multiclass
    r = M.reliability_bins(p, y, 15)
    ok = r["count"] > 0
    gaps = np.abs(r["confidence"][ok] - r["accuracy"][ok])
    assert M.mce(p, y, 15) == pytest.approx(gaps.max())
    w = r["count"][ok] / r["count"].sum()
    assert M.ece(p, y, 15, norm="l2") == pytest.approx(np.sqrt((w * gaps**2).sum()))
    assert M.ece(p, y, 15) == pytest.approx(r["ece"])


def test_adaptive_ece_equal_mass(multiclass):
    p, y = multiclass
    conf, hit = p.max(1), (p.argmax(1) == y)
    order = np.argsort(conf, kind="stable")
    ref = sum(abs(conf[order][g].sum() - hit[order][g].sum())
              for g in np.array_split(np.arange(len(conf)), 15)) / len(conf)
    assert M.adaptive_ece(p, y, 15) == pytest.approx(ref, abs=1e-12)


def test_classwise_ece_is_mean_of_per_class_positive_ece(multiclass):
    p, y = multiclass
    per = [M.ece(p[:, k], (y == k).astype(int), 15, mode="positive_class") for k in range(10)]
    assert M.classwise_ece(p, y, 15) == pytest.approx(np.mean(per), abs=1e-12)


def test_brier_nll_acc_auc_equal_sklearn(multiclass):
    p, y = multiclass
    assert M.nll(p, y) == pytest.approx(skm.log_loss(y, p), rel=1e-9)
    assert M.accuracy(p, y) == pytest.approx(skm.accuracy_score(y, p.argmax(1)))
    assert M.auroc(p, y) == pytest.approx(skm.roc_auc_score(y, p, multi_class="ovr"), abs=1e-12)
    onehot = np.eye(10)[y]
    assert M.brier_score(p, y) == pytest.approx(((p - onehot) ** 2).sum(1).mean())
    rng = np.random.default_rng(5)
    q = np.round(rng.uniform(size=800), 2)  # many ties
    yb = (rng.uniform(size=800) < q).astype(int)
    assert M.auroc(q, yb) == pytest.approx(skm.roc_auc_score(yb, q), abs=1e-12)
    assert M.brier_score(q, yb) == pytest.approx(skm.brier_score_loss(yb, q), abs=1e-12)
    assert M.nll(q.clip(1e-3, 1 - 1e-3), yb) == pytest.approx(skm.log_loss(yb, q.clip(1e-3, 1 - 1e-3)))


def test_auc_single_class_is_nan_not_error():
    assert np.isnan(M.auroc(np.array([0.2, 0.7]), np.array([1, 1])))


def test_inputs_validated():
    with pytest.raises(DataError, match="softmax"):
        M.ece(np.array([[2.0, -1.0]]), np.array([0]))
    with pytest.raises(DataError, match="labels"):
        M.ece(np.array([[0.5, 0.5]]), np.array([2]))
    with pytest.raises(DataError, match="rows"):
        M.ece(np.array([[0.5, 0.5]]), np.array([0, 1]))


def test_report_keys_and_point_values(multiclass):
    p, y = multiclass
    r = M.calibration_report(p, y, n_bins=15, n_bootstrap=50, seed=1)
    for k in M.REPORT_METRICS:
        assert k in r and f"{k}_ci_low" in r and f"{k}_ci_high" in r
        assert r[f"{k}_ci_low"] <= r[f"{k}_ci_high"]
    assert r["n"] == 3000 and r["n_bins"] == 15 and r["ece_mode"] == "top_label"
    assert r["ece"] == M.ece(p, y, 15) and r["auc"] == M.auroc(p, y)
    assert r["ece_ci_low"] <= r["ece"] <= r["ece_ci_high"]


@pytest.mark.parametrize("binary", [False, True])
def test_vectorised_bootstrap_equals_loop(binary):
    rng = np.random.default_rng(7)
    if binary:
        p = rng.uniform(size=300)
        y = (rng.uniform(size=300) < p).astype(int)
        P = np.stack([1 - p, p], 1)
    else:
        P = _softmax(rng.normal(size=(300, 4)) * 2)
        y = rng.integers(0, 4, 300)
    idx = rng.integers(0, 300, size=(20, 300))
    reps = M._bootstrap_replicates(P, y, 10, "top_label", idx)
    fns = {"acc": M.accuracy, "auc": M.auroc, "brier": M.brier_score, "nll": M.nll,
           "ece": lambda a, b: M.ece(a, b, 10), "mce": lambda a, b: M.mce(a, b, 10),
           "adaptive_ece": lambda a, b: M.adaptive_ece(a, b, 10),
           "classwise_ece": lambda a, b: M.classwise_ece(a, b, 10),
           "mean_confidence": lambda a, b: a.max(1).mean()}
    if binary:  # the batched Newton fits of every replicate against one fit per replicate
        fns.update(cal_slope=lambda a, b: M.calibration_slope_intercept(a, b)[0],
                   cal_intercept=lambda a, b: M.calibration_slope_intercept(a, b)[1], oe_ratio=M.oe_ratio)
    else:
        assert not set(M.BINARY_REPORT_METRICS) & set(reps)
    for key, fn in fns.items():
        loop = np.array([fn(P[i], y[i]) for i in idx])
        np.testing.assert_allclose(reps[key], loop, atol=1e-10, err_msg=key)


def test_bootstrap_single_class_replicates_do_not_crash():
    # 1 positive in 40: many resamples have no positive -> AUC undefined there, skipped
    p = np.linspace(0.01, 0.99, 40)
    y = np.zeros(40, int)
    y[-1] = 1
    r = M.calibration_report(p, y, n_bins=10, n_bootstrap=200, seed=0)
    assert r["auc"] == 1.0 and r["auc_ci_high"] == 1.0
    assert np.isfinite(r["ece_ci_low"])


def test_report_positive_class_mode():
    rng = np.random.default_rng(2)
    p = rng.uniform(size=400)
    y = (rng.uniform(size=400) < p).astype(int)
    r = M.calibration_report(p, y, n_bins=10, n_bootstrap=20, mode="positive_class")
    assert r["ece_mode"] == "positive_class"
    assert r["ece"] == M.ece(p, y, 10, mode="positive_class")
    assert r["mean_confidence"] == pytest.approx(p.mean())


@pytest.mark.parametrize("n_bins", [1, 3, 7, 10, 15])
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_bin_index_is_exact_at_float64_edges(n_bins, dtype):
    # values on, just below and just above every float64 linspace edge, in the input dtype:
    # binning must equal the float64 (lo, hi] rule with 0 -> first bin, whatever the dtype
    edges = np.linspace(0.0, 1.0, n_bins + 1)
    near = np.concatenate([edges, np.nextafter(edges, -1), np.nextafter(edges, 2)])
    x = np.clip(near, 0, 1).astype(dtype)
    x = np.concatenate([x, np.nextafter(x, dtype(-1)), np.nextafter(x, dtype(2))]).clip(0, 1)
    ref = np.clip(np.searchsorted(edges, x.astype(np.float64), side="left") - 1, 0, n_bins - 1)
    np.testing.assert_array_equal(M._bin_index(x, n_bins), ref)
    # the same through ece (positive-class mode bins p(y=1) directly): dtype does not matter
    y = np.arange(x.shape[0]) % 2
    assert M.ece(x, y, n_bins, mode="positive_class") == pytest.approx(
        M.ece(x.astype(np.float64), y, n_bins, mode="positive_class"), abs=1e-12)


def test_top_label_ties_go_to_lowest_index_on_every_path():
    p = np.array([[0.4, 0.4, 0.2], [0.2, 0.4, 0.4], [0.1, 0.1, 0.8]], dtype=np.float32)
    y = np.array([1, 1, 2])
    assert M.accuracy(p, y) == pytest.approx(2 / 3)
    r = M.reliability_bins(p, y, n_bins=10)
    assert r["count"][4] == 2 and r["accuracy"][4] == pytest.approx(0.5)  # float32 0.4 > 0.4
    # a negative-stride view (numpy fallback path) gives the same answers
    pr, yr = p[::-1], y[::-1]
    assert M.accuracy(pr, yr) == pytest.approx(2 / 3)
    assert M.ece(pr, yr, 10) == pytest.approx(M.ece(p, y, 10), abs=1e-15)


def test_ece_float32_equals_float64_input(multiclass):
    p, y = multiclass
    p32 = p.astype(np.float32)
    assert M.ece(p32, y, 15) == pytest.approx(M.ece(p32.astype(np.float64), y, 15), abs=1e-12)
    assert M.ece(torch.from_numpy(p32), torch.from_numpy(y), 15) == M.ece(p32, y, 15)


def test_ece_consistency_pvalue_is_a_valid_test_with_power():
    rng = np.random.default_rng(0)
    n = 300
    p1 = rng.beta(2, 5, n)
    probs = np.stack([1 - p1, p1], 1)
    # observed value is the ECE itself
    y = (rng.random(n) < p1).astype(int)
    assert ece_consistency_pvalue(probs, y, n_bins=10, n_resamples=200)[0] == pytest.approx(M.ece(probs, y, n_bins=10))
    # calibrated outcomes: p-values roughly uniform, so ~5% below 0.05 (binomial bound over 200 sets)
    pv = np.array([ece_consistency_pvalue(probs, (np.random.default_rng(s).random(n) < p1).astype(int), n_bins=10,
                                          n_resamples=300, seed=s)[1] for s in range(200)])
    assert 0.01 <= (pv < 0.05).mean() <= 0.10 and 0.35 <= pv.mean() <= 0.65
    # a model that over-predicts the positive class 2.5x is flagged
    y_shift = (rng.random(n) < 0.4 * p1).astype(int)
    assert ece_consistency_pvalue(probs, y_shift, n_bins=10, n_resamples=500)[1] < 0.01


# ----------------------------------------------------------------------------- clinical measures
def _miscalibrated(n=4000, seed=0, slope=0.6, shift=-0.7):
    """p of a model whose log-odds are too extreme (true slope 0.6) and too high (shift -0.7)."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=n) * 2.0
    p = expit(x)
    y = (rng.random(n) < expit(shift + slope * x)).astype(int)
    return p, y


def _offset_intercept_oracle(x, y):
    """MLE of a' in logit P(y=1) = a' + x (x an offset), by scipy.optimize on the NLL."""
    def f(t):
        eta = t[0] + x
        return float(np.sum(np.logaddexp(0.0, eta) - y * eta))
    return float(minimize(f, [0.0], method="BFGS", options={"gtol": 1e-12}).x[0])


@pytest.mark.parametrize("seed", [0, 1])
def test_slope_intercept_equal_independent_fits(seed):
    p, y = _miscalibrated(seed=seed)
    slope, intercept = M.calibration_slope_intercept(p, y)
    x = logit(np.clip(p, M.LOGIT_EPS, 1 - M.LOGIT_EPS))
    ref = sk_linear.LogisticRegression(C=np.inf, tol=1e-12, max_iter=10_000).fit(x[:, None], y)
    assert slope == pytest.approx(float(ref.coef_[0, 0]), abs=1e-4)
    assert intercept == pytest.approx(_offset_intercept_oracle(x, y), abs=1e-4)
    # the truth is a = -0.7, b = 0.6: both measures see the miscalibration
    assert 0.5 < slope < 0.7 and intercept < -0.3
    # (N, 2) and (N,) inputs agree; torch input too
    assert M.calibration_slope_intercept(np.stack([1 - p, p], 1), y) == (slope, intercept)
    assert M.calibration_slope_intercept(torch.from_numpy(p), torch.from_numpy(y)) == (slope, intercept)


def test_slope_intercept_of_a_calibrated_model_are_one_and_zero():
    rng = np.random.default_rng(3)
    p = rng.uniform(0.02, 0.98, 50_000)
    y = (rng.random(50_000) < p).astype(int)
    slope, intercept = M.calibration_slope_intercept(p, y)
    assert slope == pytest.approx(1.0, abs=0.05) and intercept == pytest.approx(0.0, abs=0.03)


def test_slope_intercept_edge_cases():
    p = np.array([0.1, 0.4, 0.6, 0.9])
    assert all(np.isnan(M.calibration_slope_intercept(p, np.zeros(4, int))))
    # separated outcomes: no finite MLE, but a finite (large) answer and no exception
    slope, intercept = M.calibration_slope_intercept(p, np.array([0, 0, 1, 1]))
    assert np.isfinite(slope) and slope > 5 and np.isfinite(intercept)
    # p of exactly 0 and 1 are clipped, not infinite
    assert np.isfinite(M.calibration_slope_intercept(np.array([0.0, 0.3, 0.7, 1.0]), np.array([0, 1, 0, 1]))).all()
    with pytest.raises(DataError, match="binary"):
        M.calibration_slope_intercept(np.full((4, 3), 1 / 3), np.array([0, 1, 2, 0]))


def test_oe_ratio_closed_form():
    p = np.array([0.2, 0.4, 0.6, 0.8])
    assert M.oe_ratio(p, np.array([0, 1, 1, 1])) == pytest.approx(3 / 2.0)
    assert M.oe_ratio(np.stack([1 - p, p], 1), np.array([0, 0, 0, 1])) == pytest.approx(1 / 2.0)
    assert np.isnan(M.oe_ratio(np.zeros(3), np.zeros(3, int)))
    with pytest.raises(DataError, match="binary"):
        M.oe_ratio(np.full((4, 3), 1 / 3), np.array([0, 1, 2, 0]))


def test_report_has_clinical_measures_for_binary_tasks_only(multiclass):
    p, y = _miscalibrated(n=1500)
    r = M.calibration_report(p, y, n_bootstrap=200, seed=0)
    slope, intercept = M.calibration_slope_intercept(p, y)
    assert r["cal_slope"] == slope and r["cal_intercept"] == intercept and r["oe_ratio"] == M.oe_ratio(p, y)
    for k in M.BINARY_REPORT_METRICS:
        assert r[f"{k}_ci_low"] < r[k] < r[f"{k}_ci_high"], k
    assert r["cal_slope_ci_high"] < 1.0 and r["oe_ratio_ci_high"] < 1.0  # over-predicting, too extreme
    rm = M.calibration_report(*multiclass, n_bootstrap=10)
    assert not any(k.startswith(M.BINARY_REPORT_METRICS) for k in rm)


# ----------------------------------------------------------------------------- paired bootstrap
def test_paired_bootstrap_diff_point_ci_and_paths():
    p, y = _miscalibrated(n=800, seed=4)
    q = expit(-0.7 + 0.6 * logit(p))  # the recalibrated model (the truth)
    for name, fn in (("ece", M.ece), ("auc", M.auroc), ("nll", M.nll), ("cal_slope",
                     lambda a, b: M.calibration_slope_intercept(a, b)[0])):
        r = M.paired_bootstrap_diff(name, q, p, y, n_bootstrap=300, seed=1)
        assert r["diff"] == pytest.approx(fn(q, y) - fn(p, y), abs=1e-12), name
        assert r["ci_low"] <= r["diff"] <= r["ci_high"], name
        # the vectorised named path resamples exactly as the per-replicate callable path
        rc = M.paired_bootstrap_diff(fn, q, p, y, n_bootstrap=300, seed=1)
        assert rc["ci_low"] == pytest.approx(r["ci_low"], abs=1e-8), name
        assert rc["ci_high"] == pytest.approx(r["ci_high"], abs=1e-8), name
        assert rc["p_value"] == r["p_value"], name
    # recalibration is a monotone map: AUC unchanged in every replicate
    r_auc = M.paired_bootstrap_diff("auc", q, p, y, n_bootstrap=100)
    assert r_auc["ci_low"] == r_auc["ci_high"] == 0.0 and not r_auc["significant"]
    # the true model has a clearly lower ECE and NLL
    for name in ("ece", "nll"):
        r = M.paired_bootstrap_diff(name, q, p, y, n_bootstrap=300)
        assert r["significant"] and r["ci_high"] < 0 and r["p_value"] < 0.01, name


def test_paired_bootstrap_diff_identical_models_and_bad_input():
    p, y = _miscalibrated(n=300, seed=5)
    r = M.paired_bootstrap_diff("ece", p, p, y, n_bootstrap=200)
    assert r["diff"] == 0.0 and r["ci_low"] == r["ci_high"] == 0.0
    assert r["p_value"] == 1.0 and not r["significant"] and r["n_bootstrap"] == 200
    with pytest.raises(ConfigError, match="one of"):
        M.paired_bootstrap_diff("f1", p, p, y)
    with pytest.raises(ConfigError, match="cal_slope"):  # binary-only names are not offered for C > 2
        M.paired_bootstrap_diff("cal_slope", np.full((3, 3), 1 / 3), np.full((3, 3), 1 / 3), [0, 1, 2])
    with pytest.raises(DataError, match="shape"):
        M.paired_bootstrap_diff("ece", p, np.stack([1 - p, p, 0 * p], 1), y)


# ----------------------------------------------------------------------------- two-level bootstrap (draws)
def test_draws_bootstrap_diff_one_draw_is_the_paired_bootstrap():
    p, y = _miscalibrated(n=400, seed=6)
    q = expit(-0.7 + 0.6 * logit(p))
    for name in ("ece", "auc", "cal_slope"):
        r1 = M.paired_bootstrap_diff(name, q, p, y, n_bootstrap=300, seed=2, n_bins=10)
        for b in (p, p[None]):  # a fixed arm as (N,) or (1, N)
            rd = M.draws_bootstrap_diff(name, q[None], b, y, n_bootstrap=300, seed=2, n_bins=10)
            assert rd["n_draws"] == 1 and set(r1) | {"n_draws"} == set(rd), name
            for k in ("diff", "ci_low", "ci_high", "p_value", "n_bootstrap", "significant"):
                assert rd[k] == pytest.approx(r1[k], abs=1e-12), (name, k)
    # multiclass (D, N, C) with a fixed (N, C) arm
    pm = _softmax(np.random.default_rng(0).normal(size=(200, 3)) * 2)
    ym = np.random.default_rng(1).integers(0, 3, 200)
    r1 = M.paired_bootstrap_diff("nll", pm, np.full_like(pm, 1 / 3), ym, n_bootstrap=100)
    rd = M.draws_bootstrap_diff("nll", pm[None], np.full_like(pm, 1 / 3), ym, n_bootstrap=100)
    assert (rd["ci_low"], rd["ci_high"]) == pytest.approx((r1["ci_low"], r1["ci_high"]), abs=1e-12)


def test_draws_bootstrap_diff_known_answer_and_pairing():
    """Constant probabilities per draw: the cases cannot move the metric, only the draws can."""
    y = np.arange(50) % 2
    a = np.array([0.6, 0.8])[:, None] * np.ones(50)  # mean confidence 0.6 and 0.8
    r = M.draws_bootstrap_diff("mean_confidence", a, None, y, n_bootstrap=1000, seed=0)
    assert r["diff"] == pytest.approx(0.7) and r["n_draws"] == 2
    # the mean of 2 draws resampled: 0.6, 0.7 or 0.8 with probabilities 1/4, 1/2, 1/4
    assert (r["ci_low"], r["ci_high"]) == pytest.approx((0.6, 0.8))
    rc = M.draws_bootstrap_diff(lambda p, _: float(np.maximum(p[:, 0], p[:, 1]).mean()), a, None, y,
                                n_bootstrap=1000, seed=0)
    assert (rc["ci_low"], rc["ci_high"], rc["p_value"]) == pytest.approx((r["ci_low"], r["ci_high"], r["p_value"]))
    # paired by draw, B = A - 0.05: every replicate is exactly +0.05 (the draw noise cancels) ...
    rp = M.draws_bootstrap_diff("mean_confidence", a, a - 0.05, y, n_bootstrap=500)
    assert (rp["diff"], rp["ci_low"], rp["ci_high"]) == pytest.approx((0.05, 0.05, 0.05)) and rp["significant"]
    # ... against a fixed arm it does not
    rf = M.draws_bootstrap_diff("mean_confidence", a, np.full(50, 0.65), y, n_bootstrap=1000)
    assert rf["diff"] == pytest.approx(0.05) and (rf["ci_low"], rf["ci_high"]) == pytest.approx((-0.05, 0.15))


def test_draws_bootstrap_diff_covers_training_noise():
    p, y = _miscalibrated(n=2000, seed=7, slope=1.0, shift=0.0)  # p is calibrated
    a = np.stack([expit(logit(p) + off) for off in (0.0, 0.7, 1.5)])  # three trainings, very different ECEs
    rd = M.draws_bootstrap_diff("ece", a, p, y, n_bootstrap=500, seed=3, n_bins=10)
    assert rd["diff"] == pytest.approx(np.mean([M.ece(x, y, 10) for x in a]) - M.ece(p, y, 10), abs=1e-12)
    widths = [M.paired_bootstrap_diff("ece", x, p, y, n_bootstrap=500, seed=3, n_bins=10) for x in a]
    assert rd["ci_high"] - rd["ci_low"] > 1.5 * max(w["ci_high"] - w["ci_low"] for w in widths)
    assert rd["ci_low"] <= rd["diff"] <= rd["ci_high"]


def test_draws_bootstrap_diff_bad_input():
    p, y = _miscalibrated(n=60, seed=8)
    a = np.stack([p, p, p])
    with pytest.raises(DataError, match="draws") as e:
        M.draws_bootstrap_diff("ece", a, a[:2], y)
    assert e.value.fix
    with pytest.raises(DataError, match="same test cases"):
        M.draws_bootstrap_diff("ece", a, p[:50], y)
    with pytest.raises(DataError, match=r"\(D, N\)"):
        M.draws_bootstrap_diff("ece", p, None, y)
    with pytest.raises(DataError, match="rows"):
        M.draws_bootstrap_diff("ece", a, None, y[:50])
    with pytest.raises(ConfigError, match="one of"):
        M.draws_bootstrap_diff("f1", a, None, y)
    with pytest.raises(ConfigError, match="alpha"):
        M.draws_bootstrap_diff("ece", a, None, y, alpha=1.5)
