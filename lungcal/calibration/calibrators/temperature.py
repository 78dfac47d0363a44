"""Temperature scaling: ``softmax(z / T)`` with one scalar T > 0, fitted by a safeguarded Newton method on log T."""
from __future__ import annotations

import math

import numpy as np
import torch
from scipy.optimize import minimize_scalar

from lungcal.calibration.calibrators.base import Calibrator, _nll, _num

__all__ = ["TemperatureScaler"]


def _ts_objective(z: np.ndarray, zy: np.ndarray, zmax: np.ndarray, u: float):
    """Mean NLL of ``softmax(z / T)`` at ``u = log T`` and its first two derivatives in u.

    With ``s = z / T`` and ``p = softmax(s)``, ``NLL(u) = mean(logsumexp(s) - s_y)`` and, since
    ``ds/du = -s``::

        dNLL/du   = mean(s_y - E_p[s])
        d2NLL/du2 = mean(Var_p[s]) - dNLL/du

    (float64, vectorised over samples; checked against finite differences in the tests).
    """
    beta = math.exp(-u)
    s = z * beta
    e = np.exp(s - (zmax * beta)[:, None])
    zsum = e.sum(1)
    es = (e * s).sum(1) / zsum
    es2 = (e * s * s).sum(1) / zsum
    sy = zy * beta
    nll = float(np.mean(zmax * beta + np.log(zsum) - sy))
    g = float(np.mean(sy - es))
    h = float(np.mean(es2 - es * es)) - g
    return nll, g, h


def _newton_log_t(z: np.ndarray, y: np.ndarray, lo: float, hi: float,
                  max_iter: int = 100, tol: float = 1e-10) -> float | None:
    """Safeguarded Newton on ``u = log T`` from u = 0: Newton steps where the curvature is
    positive, gradient steps otherwise, each backtracked until the NLL does not increase and
    kept inside ``[lo, hi]``. Returns u, or None when it does not converge."""
    zy = z[np.arange(z.shape[0]), y]
    zmax = z.max(1)
    u = 0.0
    f, g, h = _ts_objective(z, zy, zmax, u)
    for _ in range(max_iter):
        step = -g / h if h > 0 else -g
        step = max(min(step, 2.0), -2.0)  # at most a factor e^2 in T per iteration
        for _ in range(60):
            un = min(max(u + step, lo), hi)
            fn, gn, hn = _ts_objective(z, zy, zmax, un)
            if fn <= f + 1e-15 * abs(f):
                break
            step *= 0.5
        else:  # no decrease left within float64 rounding: stationary if the slope is ~0
            return u if abs(g) < 1e-8 else None
        done = abs(un - u) < tol or abs(gn) < 1e-13
        u, f, g, h = un, fn, gn, hn
        if done:
            return u if math.isfinite(u) else None
    return None


#: A fitted log T within this distance of log(bound) is "at its bound".
_BOUND_TOL = 1e-3


class TemperatureScaler(Calibrator):
    """Temperature scaling: ``softmax(z / T)`` with one scalar T > 0.

    ``fit`` first centres each row of the logits (``z - mean(z)``, which leaves softmax(z / T)
    unchanged; ``lungcal.ctapp.model.heads.fit_temperature`` did this around the scaler before, and
    the fitted T is the same), then minimises the mean NLL over ``log T`` (so T stays positive)
    in float64 numpy with a safeguarded Newton method that uses the analytic first and second
    derivatives of the NLL in log T (see :func:`_ts_objective`), starting at T = 1. If it fails
    (no convergence, non-finite result, NLL worse than at T = 1, or T at/outside ``bounds``) a
    bounded 1-D search (``scipy.optimize.minimize_scalar(method="bounded")`` on log T) is used
    instead; ``method`` records which one produced the result. The NLL is convex in 1/T, so both
    find the same optimum when it lies within ``bounds``. A T within 0.1% of a bound is flagged
    ``fit_info["at_bound"]``: the logits carry no usable signal (or far too much confidence).

    Logits with every value in [0, 1] are accepted (a weak model's genuine logits); rows in
    [0, 1] that sum to 1 are refused as probabilities. ``transform`` returns ``z / T`` (not
    centred); ``predict_proba`` is its softmax.

    Attributes (after fit): ``temperature`` (T), ``nll_before`` (at T = 1), ``nll_after``,
    ``method`` (``"newton"`` or ``"bounded"``), ``n_classes``, ``fit_info``.

    Args:
        bounds: allowed range of T for the fallback search (and the Newton sanity check).

    References:
        Guo, Pleiss, Sun, Weinberger. "On Calibration of Modern Neural Networks." ICML 2017.
        https://arxiv.org/abs/1706.04599
    """

    name = "ts"

    def __init__(self, bounds: tuple[float, float] = (1e-2, 1e2)) -> None:
        super().__init__()
        if not 0 < bounds[0] < 1 < bounds[1]:
            raise ValueError(f"bounds must satisfy 0 < low < 1 < high, got {bounds}")
        self.bounds = (float(bounds[0]), float(bounds[1]))
        self.log_temperature = 0.0
        self.nll_before = float("nan")
        self.nll_after = float("nan")
        self.method = ""

    @property
    def temperature(self) -> float:
        return math.exp(self.log_temperature)

    def fit(self, logits, labels) -> TemperatureScaler:
        """Fit T on held-out logits ``(N, C)`` / ``(N,)`` and labels ``(N,)``; returns self."""
        z, y = self._fit_inputs(logits, labels)
        z = z - z.mean(dim=1, keepdim=True)  # softmax(z / T) is invariant to a per-row shift
        self.nll_before = _nll(z, y)
        zn, yn = z.numpy(), y.numpy()
        lo, hi = math.log(self.bounds[0]), math.log(self.bounds[1])
        cand = _newton_log_t(zn, yn, lo, hi)
        if cand is not None and not (lo < cand < hi and _nll(z / math.exp(cand), y) <= self.nll_before + 1e-12):
            cand = None  # off the open interval, or no better than T = 1: the bounded search decides
        converged = True
        if cand is not None:
            self.log_temperature, self.method = cand, "newton"
        else:
            zy, zmax = zn[np.arange(zn.shape[0]), yn], zn.max(1)
            res = minimize_scalar(lambda u: _ts_objective(zn, zy, zmax, u)[0], bounds=(lo, hi),
                                  method="bounded", options={"xatol": 1e-8})
            self.log_temperature, self.method, converged = float(res.x), "bounded", bool(res.success)
        self.n_classes = int(z.shape[1])
        self.nll_after = _nll(z / self.temperature, y)
        at_bound = min(abs(self.log_temperature - lo), abs(self.log_temperature - hi)) < _BOUND_TOL
        self.fit_info.update(converged=converged, at_bound=at_bound, method=self.method)
        return self

    def _transform(self, z: torch.Tensor) -> torch.Tensor:
        return z / self.temperature

    def _state(self) -> dict:
        return {"temperature": self.temperature, "log_temperature": self.log_temperature,
                "nll_before": self.nll_before, "nll_after": self.nll_after,
                "method": self.method, "bounds": list(self.bounds)}

    def _load(self, state: dict) -> None:
        self.log_temperature = float(state["log_temperature"])
        self.nll_before = _num(state.get("nll_before"))
        self.nll_after = _num(state.get("nll_after"))
        self.method = str(state.get("method", ""))
        if "bounds" in state:
            self.bounds = (float(state["bounds"][0]), float(state["bounds"][1]))

    def __repr__(self) -> str:
        return f"TemperatureScaler(T={self.temperature:.4f}, method={self.method!r})"
