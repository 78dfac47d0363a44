"""Post-hoc scalers: TS recovers a known temperature, keeps argmax, refuses probabilities."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from lungcal.calibration.metrics import ece, nll
from lungcal.calibration.scaling import (
    HistogramBinning,
    IsotonicCalibrator,
    MatrixScaler,
    TemperatureScaler,
    VectorScaler,
)
from lungcal.errors import DataError


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
    import lungcal.calibration.scaling as S

    z, y = _sample(2.5, n=5000)
    t_newton = TemperatureScaler().fit(z, y).temperature
    monkeypatch.setattr(S, "_newton_log_t", lambda *a, **k: None)
    ts = TemperatureScaler().fit(z, y)
    assert ts.method == "bounded"
    assert ts.temperature == pytest.approx(t_newton, rel=1e-6)


def test_ts_objective_derivatives_match_finite_differences():
    import lungcal.calibration.scaling as S

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
    from scipy.optimize import minimize_scalar

    ref = minimize_scalar(lambda u: float(torch.nn.functional.cross_entropy(z / np.exp(u), y)),
                          bounds=(-3, 3), method="bounded", options={"xatol": 1e-10})
    assert ts.log_temperature == pytest.approx(ref.x, abs=1e-6)
    assert ts.nll_after <= ref.fun + 1e-12


def test_ts_refuses_probabilities_with_a_fix():
    z, y = _sample(1.0, n=100)
    with pytest.raises(DataError, match="look like probabilities.*Fix"):
        TemperatureScaler().fit(torch.softmax(z, 1), y)
    with pytest.raises(DataError, match="every value in"):
        TemperatureScaler().fit(torch.rand(100, 2), y % 2)
    with pytest.raises(DataError, match="labels"):
        TemperatureScaler().fit(z, y + 10)


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
