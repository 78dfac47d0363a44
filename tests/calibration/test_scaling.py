"""Post-hoc calibrators: TS recovers a known temperature, keeps argmax, refuses probabilities;
Platt equals scikit-learn's logistic regression; JSON state round-trips; selection by CV NLL;
fit diagnostics."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from scipy.optimize import minimize_scalar

import lungcal.calibration.calibrators.temperature as T
import lungcal.calibration.scaling as S
from lungcal.calibration.metrics import auroc, ece, nll
from lungcal.calibration.scaling import (
    CALIBRATORS,
    HistogramBinning,
    IsotonicCalibrator,
    MatrixScaler,
    PlattScaler,
    TemperatureScaler,
    VectorScaler,
    calibrator_from_json,
    fit_warnings,
    make_calibrator,
    select_calibrator,
)
from lungcal.errors import ConfigError, DataError


def _sample(t_star, n=20000, c=10, seed=0):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, c, generator=g, dtype=torch.float64) * 3
    y = torch.multinomial(torch.softmax(z / t_star, 1), 1, generator=g)[:, 0]
    return z, y


@pytest.mark.parametrize("t_star", [0.5, 1.0, 2.5])
def test_ts_recovers_known_temperature(t_star):
    z, y = _sample(t_star)
    ts = TemperatureScaler().fit(z, y)
    assert ts.temperature == pytest.approx(t_star, rel=0.05)
    assert ts.method == "newton"
    assert ts.nll_after <= ts.nll_before
    assert ts.nll_after == pytest.approx(nll(ts.predict_proba(z), y), rel=1e-9)


def test_ts_never_changes_argmax_and_keeps_types():
    z, y = _sample(2.0, n=2000)
    ts = TemperatureScaler().fit(z.numpy(), y.numpy())
    p = ts.predict_proba(z.float())
    assert isinstance(p, torch.Tensor) and p.dtype == torch.float32
    assert torch.equal(p.argmax(1), z.argmax(1))
    pn = ts.predict_proba(z.numpy())
    assert isinstance(pn, np.ndarray) and np.allclose(pn.sum(1), 1)
    np.testing.assert_allclose(ts.transform(z.numpy()), z.numpy() / ts.temperature)
    assert ece(pn, y.numpy()) < ece(torch.softmax(z, 1).numpy(), y.numpy())


def test_ts_bounded_fallback_when_newton_fails(monkeypatch):
    z, y = _sample(2.5, n=5000)
    t_newton = TemperatureScaler().fit(z, y).temperature
    monkeypatch.setattr(T, "_newton_log_t", lambda *a, **k: None)  # where TemperatureScaler.fit looks it up
    ts = TemperatureScaler().fit(z, y)
    assert ts.method == "bounded"
    assert ts.temperature == pytest.approx(t_newton, rel=1e-6)


def test_ts_objective_derivatives_match_finite_differences():
    z, y = _sample(1.7, n=3000)
    zn, yn = z.numpy(), y.numpy()
    zy, zmax = zn[np.arange(3000), yn], zn.max(1)
    for u in (-1.0, 0.0, 0.4, 1.5):
        f, g, h = S._ts_objective(zn, zy, zmax, u)
        assert f == pytest.approx(float(torch.nn.functional.cross_entropy(z / np.exp(u), y)), rel=1e-12)
        eps = 1e-5
        fp, gp, _ = S._ts_objective(zn, zy, zmax, u + eps)
        fm, gm, _ = S._ts_objective(zn, zy, zmax, u - eps)
        assert g == pytest.approx((fp - fm) / (2 * eps), rel=1e-6, abs=1e-9)
        assert h == pytest.approx((gp - gm) / (2 * eps), rel=1e-6, abs=1e-9)


def test_ts_newton_hits_the_nll_minimum():
    z, y = _sample(0.8, n=4000)
    ts = TemperatureScaler().fit(z, y)
    ref = minimize_scalar(lambda u: float(torch.nn.functional.cross_entropy(z / np.exp(u), y)),
                          bounds=(-3, 3), method="bounded", options={"xatol": 1e-10})
    assert ts.log_temperature == pytest.approx(ref.x, abs=1e-6)
    assert ts.nll_after <= ref.fun + 1e-12


def test_ts_refuses_probabilities_with_a_fix():
    z, y = _sample(1.0, n=100)
    with pytest.raises(DataError, match="look like probabilities.*Fix"):
        TemperatureScaler().fit(torch.softmax(z, 1), y)
    with pytest.raises(DataError, match="labels"):
        TemperatureScaler().fit(z, y + 10)
    # TS is invariant to a per-row shift, so only rows that sum to 1 are taken for probabilities:
    # a weak model's genuine logits in [0, 1] are fitted (as the engine's centring allowed before).
    weak = torch.rand(100, 2, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    assert TemperatureScaler().fit(weak, y % 2).n_classes == 2
    # calibrators that are not shift-invariant, and (N,) input, still refuse any input in [0, 1]
    with pytest.raises(DataError, match="every value in"):
        VectorScaler().fit(weak, y % 2)
    with pytest.raises(DataError, match="every value in"):
        TemperatureScaler().fit(weak[:, 1], y % 2)


def test_ts_state_dict_roundtrip(tmp_path):
    z, y = _sample(1.7, n=3000)
    ts = TemperatureScaler().fit(z, y)
    torch.save(ts.state_dict(), tmp_path / "ts.pt")
    other = TemperatureScaler().load_state_dict(torch.load(tmp_path / "ts.pt", weights_only=True))
    assert other.temperature == ts.temperature and other.nll_after == ts.nll_after
    torch.testing.assert_close(other.predict_proba(z), ts.predict_proba(z))


def test_ts_close_to_netcal():
    scaling = pytest.importorskip("netcal.scaling")
    z, y = _sample(2.0, n=5000)
    net = scaling.TemperatureScaling()
    net.fit(torch.softmax(z, 1).numpy(), y.numpy())  # netcal takes float64 probabilities
    t_net = 1.0 / float(np.ravel(net.temperature)[0])  # netcal stores the multiplier 1/T
    ts = TemperatureScaler().fit(z, y)
    assert ts.temperature == pytest.approx(t_net, rel=1e-3)


@pytest.mark.parametrize("cls", [VectorScaler, MatrixScaler, HistogramBinning, IsotonicCalibrator])
def test_other_calibrators_interface(cls, tmp_path):
    z, y = _sample(2.0, n=4000, c=4)
    zt, yt = _sample(2.0, n=4000, c=4, seed=1)
    cal = cls().fit(z, y)
    p = cal.predict_proba(zt)
    assert p.shape == (4000, 4) and torch.allclose(p.sum(1), torch.ones(4000, dtype=p.dtype))
    torch.testing.assert_close(torch.softmax(cal.transform(zt), 1), p)
    # held-out calibration improves over the over-confident raw model
    raw = torch.softmax(zt, 1)
    assert ece(p, yt) < ece(raw, yt)
    assert nll(p, yt) < nll(raw, yt)
    torch.save(cal.state_dict(), tmp_path / "c.pt")
    other = cls().load_state_dict(torch.load(tmp_path / "c.pt", weights_only=True))
    torch.testing.assert_close(other.predict_proba(zt), p)
    with pytest.raises(DataError):
        cal.fit(raw, y)


def test_isotonic_equals_sklearn_per_class():
    iso_mod = pytest.importorskip("sklearn.isotonic")
    z, y = _sample(2.0, n=3000, c=3)
    cal = IsotonicCalibrator().fit(z, y)
    p = torch.softmax(z, 1).numpy()
    for k in range(3):
        ref = iso_mod.IsotonicRegression(out_of_bounds="clip").fit(p[:, k], (y.numpy() == k)).predict(p[:, k])
        np.testing.assert_allclose(np.interp(p[:, k], cal.x[k].numpy(), cal.y[k].numpy()), ref, atol=1e-9)


def test_vector_scaler_reduces_to_ts_family():
    z, y = _sample(0.5, n=5000, c=3)
    vs = VectorScaler().fit(z, y)
    assert vs.weight.mean().item() == pytest.approx(2.0, rel=0.1)
    assert vs.nll_after <= TemperatureScaler().fit(z, y).nll_after + 1e-6


# ----------------------------------------------------------------------------- TS absorbs the engine's centring
def _fit_temperature_oracle(logits, labels) -> float:
    """lungcal.ctapp.model.heads.fit_temperature before issue 14: float32 logits, each row centred,
    then the NLL minimum over log T in the scaler's bounds (here by an independent bounded search)."""
    z = torch.as_tensor(np.asarray(logits)).to(torch.float32)
    z = (z - z.mean(dim=1, keepdim=True)).to(torch.float64)
    y = torch.as_tensor(np.asarray(labels)).long()
    ref = minimize_scalar(lambda u: float(F.cross_entropy(z / math.exp(u), y)),
                          bounds=(math.log(1e-2), math.log(1e2)), method="bounded", options={"xatol": 1e-11})
    return math.exp(ref.x)


@pytest.mark.parametrize("case", ["offset", "weak", "multiclass"])
def test_ts_gives_the_temperature_of_the_old_engine_path(case):
    rng = np.random.default_rng(11)
    if case == "multiclass":
        z = (rng.normal(size=(2000, 5)) * 3).astype(np.float32)
        y = np.array([rng.choice(5, p=np.exp(r / 2) / np.exp(r / 2).sum()) for r in z])
    else:
        s = rng.normal(size=2000)
        y = (rng.random(2000) < 1 / (1 + np.exp(-s))).astype(int)
        if case == "offset":  # logits with a large common offset per row
            z = np.stack([-2 * s + 40, 2 * s + 40], 1).astype(np.float32)
        else:  # a weak model whose genuine logits all lie in [0, 1]
            z = np.stack([0.2 + 0.05 * rng.random(2000), 0.5 + 0.1 * s], 1).clip(0, 1).astype(np.float32)
    ts = TemperatureScaler().fit(z, y)
    assert ts.temperature == pytest.approx(_fit_temperature_oracle(z, y), rel=1e-6)
    # same T whether or not the caller centres (in float32) first
    zc = z - z.mean(1, keepdims=True)
    assert TemperatureScaler().fit(zc, y).temperature == pytest.approx(ts.temperature, rel=1e-6)
    # transform is z / T, and predict_proba its softmax, for raw and centred logits alike
    np.testing.assert_allclose(ts.transform(z), z.astype(np.float64) / ts.temperature, rtol=1e-12)
    np.testing.assert_allclose(ts.predict_proba(z), ts.predict_proba(zc), atol=1e-6)
    np.testing.assert_allclose(ts.predict_proba(z), torch.softmax(torch.as_tensor(z, dtype=torch.float64)
                                                                  / ts.temperature, 1).numpy(), atol=1e-12)
    assert np.array_equal(ts.predict_proba(z).argmax(1), z.argmax(1))


def test_ts_binary_single_logit_input():
    rng = np.random.default_rng(2)
    s = rng.normal(size=3000) * 4
    y = (rng.random(3000) < 1 / (1 + np.exp(-s / 2))).astype(int)
    ts1, ts2 = TemperatureScaler().fit(s, y), TemperatureScaler().fit(np.stack([np.zeros_like(s), s], 1), y)
    assert ts1.temperature == pytest.approx(ts2.temperature, rel=1e-9)
    assert ts1.temperature == pytest.approx(2.0, rel=0.1)
    p = ts1.predict_proba(s)
    assert p.shape == (3000,) and np.allclose(p, ts2.predict_proba(np.stack([0 * s, s], 1))[:, 1])
    assert np.allclose(ts1.transform(s), s / ts1.temperature)


# ----------------------------------------------------------------------------- Platt
def _binary(n=3000, seed=0, slope=0.5, shift=-1.0):
    """(N, 2) logits whose binary logit z has true calibration map sigmoid(shift + slope z)."""
    rng = np.random.default_rng(seed)
    z = rng.normal(size=n) * 2.5
    y = (rng.random(n) < 1 / (1 + np.exp(-(shift + slope * z)))).astype(int)
    lo = rng.normal(size=n)  # an arbitrary per-row offset: only z1 - z0 matters
    return np.stack([lo, lo + z], 1), y, z


def test_platt_equals_sklearn_logistic_regression():
    lm = pytest.importorskip("sklearn.linear_model")
    logits, y, z = _binary()
    cal = PlattScaler().fit(logits, y)
    ref = lm.LogisticRegression(C=np.inf, tol=1e-12, max_iter=10_000).fit(z[:, None], y)
    assert cal.slope == pytest.approx(float(ref.coef_[0, 0]), abs=1e-6)
    assert cal.intercept == pytest.approx(float(ref.intercept_[0]), abs=1e-6)
    assert cal.fit_info["converged"] and not cal.fit_info["at_bound"]
    np.testing.assert_allclose(cal.predict_proba(logits)[:, 1], ref.predict_proba(z[:, None])[:, 1], atol=1e-8)
    # (N,) input: the same fit; shapes follow the input
    c1 = PlattScaler().fit(z, y)
    assert c1.slope == pytest.approx(cal.slope, abs=1e-10) and c1.intercept == pytest.approx(cal.intercept, abs=1e-10)
    assert c1.predict_proba(z).shape == (3000,) and c1.transform(z).shape == (3000,)
    t = cal.transform(logits)
    assert t.shape == (3000, 2) and np.all(t[:, 0] == 0)
    np.testing.assert_allclose(torch.softmax(torch.as_tensor(t), 1).numpy(), cal.predict_proba(logits), atol=1e-12)
    assert cal.nll_after < cal.nll_before
    assert auroc(cal.predict_proba(logits), y) == auroc(torch.softmax(torch.as_tensor(logits), 1).numpy(), y)
    with pytest.raises(DataError, match="binary"):
        PlattScaler().fit(np.random.default_rng(0).normal(size=(50, 3)), np.arange(50) % 3)


def test_platt_on_separated_classes_is_flagged():
    z = np.r_[np.linspace(-3, -1, 20), np.linspace(1, 3, 20)]
    y = np.r_[np.zeros(20, int), np.ones(20, int)]
    cal = PlattScaler().fit(z, y)
    assert not cal.fit_info["converged"] and cal.fit_info["separated"]
    assert np.isfinite(cal.slope) and cal.slope > 1
    assert any("did not converge" in w for w in fit_warnings(cal, z, y))


# ----------------------------------------------------------------------------- registry and JSON state
def _json_types_only(v) -> bool:
    if isinstance(v, dict):
        return all(isinstance(k, str) and _json_types_only(x) for k, x in v.items())
    if isinstance(v, list):
        return all(_json_types_only(x) for x in v)
    return v is None or isinstance(v, bool | int | float | str)


@pytest.mark.parametrize("name", [*CALIBRATORS, "matrix"])
def test_json_round_trip_gives_identical_probabilities(name):
    logits, y, _ = _binary(n=1500, seed=3)
    test_logits, _, _ = _binary(n=500, seed=4)
    cal = (MatrixScaler() if name == "matrix" else make_calibrator(name)).fit(logits, y)
    sd = cal.state_dict()
    assert sd["name"] == name and _json_types_only(sd)
    text = cal.to_json()
    assert json.loads(text) == json.loads(json.dumps(sd))
    other = calibrator_from_json(text)
    assert type(other) is type(cal) and other.fit_info == cal.fit_info
    np.testing.assert_array_equal(other.predict_proba(test_logits), cal.predict_proba(test_logits))
    np.testing.assert_array_equal(other.transform(test_logits), cal.transform(test_logits))
    # the in-memory state works too, and a state of another class is refused by name
    np.testing.assert_array_equal(type(cal)().load_state_dict(sd).predict_proba(test_logits),
                                  cal.predict_proba(test_logits))
    wrong = next(c for n, c in CALIBRATORS.items() if n != name)
    with pytest.raises(DataError, match="calibrator_from_json"):
        wrong().load_state_dict(sd)


def test_registry_and_bad_json():
    assert set(CALIBRATORS) == {"ts", "platt", "vector", "isotonic", "histogram"}
    assert isinstance(make_calibrator("histogram", n_bins=7), HistogramBinning)
    assert make_calibrator("histogram", n_bins=7).n_bins == 7
    with pytest.raises(ConfigError, match="ts, platt, vector, isotonic, histogram"):
        make_calibrator("beta")
    with pytest.raises(DataError, match="does not parse"):
        calibrator_from_json("{not json")
    with pytest.raises(DataError, match="known names"):
        calibrator_from_json('{"name": "beta"}')


# ----------------------------------------------------------------------------- selection
def _shifted(n, seed):
    """Right spread, wrong prevalence: model log-odds = truth + 2. TS cannot move a constant."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=n) * 1.5
    y = (rng.random(n) < 1 / (1 + np.exp(-(x - 2.0)))).astype(int)
    return np.stack([-x / 2, x / 2], 1), y


def _overconfident(n, seed):
    """Log-odds three times too large, nothing else wrong: TS fixes it exactly."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=n) * 1.5
    y = (rng.random(n) < 1 / (1 + np.exp(-x))).astype(int)
    return np.stack([-1.5 * x, 1.5 * x], 1), y


def test_select_calibrator_picks_platt_for_a_prevalence_shift():
    logits, y = _shifted(1000, seed=0)
    for rule in ("1se", "min"):
        name, cal, cv = select_calibrator(logits, y, rule=rule)
        assert name == "platt" and isinstance(cal, PlattScaler), rule
        assert cv["platt"] < cv["ts"] and set(cv) == {"ts", "platt", "isotonic"}
        assert all(np.isfinite(v) for v in cv.values())
    assert cal.intercept == pytest.approx(-2.0, abs=0.3) and cal.slope == pytest.approx(1.0, abs=0.2)
    # refitted on all cases: the same as a direct fit
    assert cal.slope == PlattScaler().fit(logits, y).slope
    assert cal.fit_info["selection"]["folds"] == 5 and cal.fit_info["selection"]["cv_nll"] == cv


def test_select_calibrator_picks_ts_for_overconfidence():
    logits, y = _overconfident(1000, seed=0)
    name, cal, cv = select_calibrator(logits, y)
    assert name == "ts" and cal.temperature == pytest.approx(3.0, rel=0.25)  # 3.5 on this draw (N = 1000)
    # platt nests ts: its CV NLL may be a hair lower, but not by more than one standard error
    se = cal.fit_info["selection"]["cv_se"]
    assert cv["ts"] - min(cv.values()) <= se["ts"]


def test_select_calibrator_scores_binning_finitely_and_validates():
    logits, y = _shifted(200, seed=1)
    name, cal, cv = select_calibrator(logits, y, candidates=("histogram", "isotonic", "vector"), folds=4, seed=3)
    assert name in cv and all(np.isfinite(v) for v in cv.values())
    with pytest.raises(ConfigError, match="valid|one of"):
        select_calibrator(logits, y, candidates=("ts", "beta"))
    with pytest.raises(ConfigError, match="folds"):
        select_calibrator(logits, y, folds=1)
    with pytest.raises(DataError, match="one class only.*Fix"):
        select_calibrator(logits, np.zeros_like(y))
    with pytest.raises(ConfigError, match="platt"):
        select_calibrator(np.random.default_rng(0).normal(size=(30, 3)), np.arange(30) % 3)
    # folds are stratified: with 3 events, 3 folds, each holding one
    y3 = np.zeros(60, int)
    y3[[5, 17, 40]] = 1
    fold = S._fold_ids(y3, 3, seed=0)
    assert sorted(fold[y3 == 1]) == [0, 1, 2] and np.bincount(fold).tolist() == [20, 20, 20]
    assert select_calibrator(logits[:60], y3, folds=5)[2]  # folds lowered to the 3 events


# ----------------------------------------------------------------------------- fit diagnostics
def test_fit_warnings_flag_no_signal_and_few_events():
    rng = np.random.default_rng(0)
    z = rng.normal(size=(400, 2)) * 3
    y = (rng.random(400) < 0.3).astype(int)  # labels independent of the logits
    ts = TemperatureScaler().fit(z, y)
    assert ts.fit_info["at_bound"] and ts.temperature == pytest.approx(100, rel=1e-2)
    warns = fit_warnings(ts, z, y)
    assert any(w.startswith("temperature at its bound 100") and "no signal" in w for w in warns)
    assert any("~ chance" in w for w in warns)
    # separated classes with timid logits: T runs to its lower bound
    zs = np.r_[np.linspace(-1e-3, -1e-4, 150), np.linspace(1e-4, 1e-3, 150)]
    ys = (zs > 0).astype(int)
    ts_low = TemperatureScaler().fit(zs, ys)
    assert ts_low.fit_info["at_bound"] and ts_low.temperature == pytest.approx(0.01, rel=1e-2)
    assert any(w.startswith("temperature at its bound 0.01") and "separated" in w
               for w in fit_warnings(ts_low, zs, ys))
    # a model with signal and enough events: nothing to flag
    logits, y2, _ = _binary(n=3000, seed=5, slope=1.0, shift=0.0)
    ts2 = TemperatureScaler().fit(logits, y2)
    assert not ts2.fit_info["at_bound"] and fit_warnings(ts2, logits, y2) == []
    # few events: warned, still fitted
    few = np.zeros(3000, int)
    few[np.argsort(logits[:, 1] - logits[:, 0])[-40:]] = 1
    assert any("only 40 cases" in w for w in fit_warnings(PlattScaler().fit(logits, few), logits, few))


@pytest.mark.parametrize("name", [*CALIBRATORS, "matrix"])
def test_one_class_labels_raise_with_a_fix(name):
    logits, _, _ = _binary(n=100)
    cal = MatrixScaler() if name == "matrix" else make_calibrator(name)
    with pytest.raises(DataError, match="one class only.*Fix: fit on a split that holds both outcomes"):
        cal.fit(logits, np.ones(100, int))
