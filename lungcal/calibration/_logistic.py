"""One-covariate logistic regression by Newton's method (float64 numpy), single or batched.

Shared by the calibration slope / intercept (:mod:`.measures.clinical`; :mod:`.measures.bootstrap` for
every bootstrap replicate at once) and by Platt scaling (:mod:`.calibrators.platt`). The model is

    logit P(y = 1) = a + b * x        (b fixed at 1 when ``fit_slope=False``: x is then an offset)

fitted by maximum likelihood with weights ``w`` (bootstrap resampling counts). Each Newton step
is halved until the weighted NLL does not increase. Under (quasi-)separation the MLE does not
exist: the iterations are capped and the last iterate is returned with ``converged=False``. With one
covariate, separation is exact to detect: the MLE of (a, b) is finite iff the x-ranges of the
two classes overlap (Albert & Anderson 1984); with b fixed it is finite iff both classes occur.
"""
from __future__ import annotations

import numpy as np

__all__ = ["fit_logistic_batch", "fit_logistic"]


def _log_sigmoid(t: np.ndarray) -> np.ndarray:
    """``log sigmoid(t) = min(t, 0) - log(1 + e^-|t|)``, never overflowing; absolute error below
    1e-15 (4x faster than ``scipy.special.log_expit``, whose ``log1p`` is not vectorised)."""
    out = np.exp(-np.abs(t))
    out += 1.0
    np.log(out, out=out)
    return np.subtract(np.minimum(t, 0.0), out, out=out)


#: Rows per block are chosen so that a block's (rows, N) arrays hold about this many values:
#: small enough to stay in cache (measured 3x faster than one (666, 3000) block).
_BLOCK_VALUES = 1 << 18


def fit_logistic_batch(x: np.ndarray, y: np.ndarray, w: np.ndarray, fit_slope: bool = True,
                       max_iter: int = 100, tol: float = 1e-10, start: tuple[float, float] = (0.0, 1.0)):
    """Fit B weighted logistic regressions that share ``x``, ``y`` (N,) and differ in ``w`` (B, N).

    Newton from ``start = (a, b)`` (default (0, 1), "calibrated"; bootstrap callers pass the
    full-data fit), each step halved until the NLL does not increase; a row stops when its step
    is below ``tol`` (relative) or no decrease is left. Rows are processed in cache-sized blocks.

    Returns:
        ``(a, b, converged)``: (B,) intercepts, (B,) slopes (``start[1]`` everywhere when
        ``fit_slope=False``) and (B,) bool. Rows without a finite MLE (weights on one class
        only, or separated classes) come back with ``converged=False``.
    """
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    w = np.atleast_2d(np.asarray(w, dtype=np.float64))
    rows = max(1, _BLOCK_VALUES // max(x.shape[0], 1))
    parts = [_fit_block(x, y, w[i:i + rows], fit_slope, max_iter, tol, start) for i in range(0, w.shape[0], rows)]
    return tuple(np.concatenate(t) for t in zip(*parts, strict=True))


def _fit_block(x, y, w, fit_slope, max_iter, tol, start):
    """Newton on one block of rows. The state per sample is ``l = log sigmoid(sign * eta)``, the
    log-likelihood of its own label: the NLL is ``-w @ l``, and with ``m = 1 - e^l = -expm1(l)``
    the gradient terms are ``w (p - y) = -w sign m`` and the Hessian terms ``w p (1 - p) = w m (1 - m)``.
    So each trial point costs one log-sigmoid and one ``expm1``, accurate for any |eta|."""
    sign = 2.0 * y - 1.0
    x2 = x * x
    nb = w.shape[0]
    a = np.full(nb, float(start[0]))
    b = np.full(nb, float(start[1]))
    eta = a[:, None] + b[:, None] * x
    ll = _log_sigmoid(sign * eta)
    f = -np.einsum("bn,bn->b", w, ll)
    done = np.zeros(nb, dtype=bool)
    for _ in range(int(max_iter)):
        act = np.flatnonzero(~done)
        if act.size == 0:
            break
        wa, ea = w[act], eta[act]
        m = -np.expm1(ll[act])
        r = -(wa * sign) * m  # gradient terms
        h = wa * m * (1.0 - m)  # Hessian terms
        g0, h00 = r.sum(1), h.sum(1)
        if fit_slope:
            g1, h01, h11 = r @ x, h @ x, h @ x2
            det = h00 * h11 - h01 * h01
            ok = det > 1e-13 * h00 * h11
            safe = np.where(ok, det, 1.0)
            da = np.where(ok, -(h11 * g0 - h01 * g1) / safe, -g0)
            db = np.where(ok, -(h00 * g1 - h01 * g0) / safe, -g1)
        else:
            ok = h00 > 0
            da = np.where(ok, -g0 / np.where(ok, h00, 1.0), -g0)
            db = np.zeros_like(da)
        fa = f[act]
        step = np.ones_like(da)
        new_f, new_eta, new_ll = fa.copy(), ea, ll[act]
        accept = np.zeros(act.size, dtype=bool)
        for _ in range(60):  # step halving, vectorised over the rows still searching
            todo = np.flatnonzero(~accept)
            if todo.size == 0:
                break
            eta_t = ea[todo] + (step * da)[todo, None] + (step * db)[todo, None] * x
            ll_t = _log_sigmoid(sign * eta_t)
            f_t = -np.einsum("bn,bn->b", wa[todo], ll_t)
            good = f_t <= fa[todo] + 1e-12 * np.abs(fa[todo])
            hit = todo[good]
            accept[hit] = True
            new_f[hit], new_eta[hit], new_ll[hit] = f_t[good], eta_t[good], ll_t[good]
            step[todo[~good]] *= 0.5
        step = np.where(accept, step, 0.0)
        na, nbeta = a[act] + step * da, b[act] + step * db
        moved = np.maximum(np.abs(step * da), np.abs(step * db))
        a[act], b[act], f[act], eta[act], ll[act] = na, nbeta, new_f, new_eta, new_ll
        done[act] = (moved < tol * (1.0 + np.maximum(np.abs(na), np.abs(nbeta)))) | ~accept
    # converged = a finite MLE exists and the gradient vanishes at the returned point
    r = (w * sign) * np.expm1(ll)
    gnorm = np.abs(r.sum(1))
    if fit_slope:
        gnorm = np.maximum(gnorm, np.abs(r @ x))
    pos, neg = (w > 0) & (y == 1), (w > 0) & (y == 0)
    exists = pos.any(1) & neg.any(1)
    if fit_slope:  # overlap of the two classes' x-ranges <=> finite MLE
        lo1, hi1 = np.where(pos, x, np.inf).min(1), np.where(pos, x, -np.inf).max(1)
        lo0, hi0 = np.where(neg, x, np.inf).min(1), np.where(neg, x, -np.inf).max(1)
        exists &= (hi0 > lo1) & (hi1 > lo0)
    converged = done & exists & (gnorm <= 1e-6 * np.maximum(w.sum(1), 1.0))
    return a, b, converged


def fit_logistic(x, y, fit_slope: bool = True, max_iter: int = 100,
                 tol: float = 1e-10) -> tuple[float, float, bool]:
    """Single unweighted fit: ``(a, b, converged)`` as Python scalars (see :func:`fit_logistic_batch`)."""
    x = np.asarray(x, dtype=np.float64)
    a, b, ok = fit_logistic_batch(x, y, np.ones((1, x.shape[0])), fit_slope=fit_slope,
                                  max_iter=max_iter, tol=tol)
    return float(a[0]), float(b[0]), bool(ok[0])
