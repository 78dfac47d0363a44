"""Isotonic regression, one-vs-rest, of the softmax probabilities (pool-adjacent-violators)."""
from __future__ import annotations

import numpy as np
import torch
from scipy.optimize import isotonic_regression

from lungcal.calibration.calibrators.base import Calibrator, _normalise_log, _softmax_np

__all__ = ["IsotonicCalibrator"]


class IsotonicCalibrator(Calibrator):
    """Isotonic regression, one-vs-rest: for each class k a non-decreasing step map of
    softmax(z)_k to the frequency of y = k (pool-adjacent-violators via
    ``scipy.optimize.isotonic_regression`` on tied-score means), evaluated by linear
    interpolation between fitted points and clipped outside them (as scikit-learn's
    ``IsotonicRegression(out_of_bounds="clip")``). Scores are renormalised; ``transform``
    returns their log. Monotone but not strictly: it may tie ranks and so change the AUC.

    References:
        Zadrozny, Elkan. "Transforming classifier scores into accurate multiclass probability
        estimates." KDD 2002. https://doi.org/10.1145/775047.775151
    """

    name = "isotonic"

    def __init__(self) -> None:
        super().__init__()
        self.x: list[torch.Tensor] = []
        self.y: list[torch.Tensor] = []

    def fit(self, logits, labels) -> IsotonicCalibrator:
        """Fit one isotonic map per class; returns self."""
        z, yt = self._fit_inputs(logits, labels)
        y = yt.numpy()
        p = _softmax_np(z.numpy())
        self.x, self.y = [], []
        for k in range(p.shape[1]):  # loop over classes only; each fit is vectorised
            ux, inv = np.unique(p[:, k], return_inverse=True)
            w = np.bincount(inv).astype(np.float64)
            mean_y = np.bincount(inv, weights=(y == k).astype(np.float64)) / w
            fitted = isotonic_regression(mean_y, weights=w, increasing=True).x
            self.x.append(torch.as_tensor(ux, dtype=torch.float64))
            self.y.append(torch.as_tensor(fitted, dtype=torch.float64))
        self.n_classes = int(p.shape[1])
        return self

    def _transform(self, z):
        p = _softmax_np(z.numpy())
        cal = np.stack([np.interp(p[:, k], self.x[k].numpy(), self.y[k].numpy())
                        for k in range(p.shape[1])], axis=1)  # p.shape[1] == n_classes: _prep checked
        return _normalise_log(torch.as_tensor(cal, dtype=torch.float64))

    def _state(self) -> dict:
        return {"x": self.x, "y": self.y}

    def _load(self, state: dict) -> None:
        self.x = [torch.as_tensor(t, dtype=torch.float64) for t in state["x"]]
        self.y = [torch.as_tensor(t, dtype=torch.float64) for t in state["y"]]
