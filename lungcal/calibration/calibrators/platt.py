"""Platt scaling (logistic recalibration) of a binary model: ``sigmoid(a (z1 - z0) + b)``."""
from __future__ import annotations

import numpy as np
import torch

from lungcal.calibration._logistic import fit_logistic
from lungcal.calibration.calibrators.base import Calibrator, _nll, _num
from lungcal.errors import DataError

__all__ = ["PlattScaler"]


class PlattScaler(Calibrator):
    """Platt scaling (logistic recalibration) of a binary model: ``p = sigmoid(a z + b)`` with the
    binary logit ``z = z1 - z0`` (``(N, 2)`` logits) or ``z`` itself (``(N,)`` logits).

    Unlike temperature scaling it has an intercept, so it also corrects calibration-in-the-large
    (e.g. a change of prevalence between the training site and this one); like TS it is monotone
    in z for ``a > 0`` and leaves the AUC unchanged. ``(a, b)`` is the maximum-likelihood fit
    (mean NLL, Newton's method in float64 via :mod:`._logistic`), i.e. the logistic regression of
    y on z; Platt's (1999) smoothed targets ``(N+ + 1) / (N+ + 2)`` are not used. When the classes
    are separated on the fit split the MLE does not exist: the iterations are capped and
    ``fit_info`` says ``converged=False, separated=True``.

    ``transform`` returns ``[0, a z + b]`` for ``(N, 2)`` input (``a z + b`` for ``(N,)``).

    Attributes (after fit): ``slope`` (a), ``intercept`` (b), ``nll_before``, ``nll_after``,
    ``n_classes`` (2), ``fit_info``.

    References:
        Platt. "Probabilistic Outputs for Support Vector Machines and Comparisons to Regularized
        Likelihood Methods." Advances in Large Margin Classifiers, MIT Press (1999).
        https://home.cs.colorado.edu/~mozer/Teaching/syllabi/6622/papers/Platt1999.pdf
        Cox. "Two further applications of a model for binary regression." Biometrika 45 (1958).
        https://doi.org/10.1093/biomet/45.3-4.562
    """

    name = "platt"

    def __init__(self, max_iter: int = 100) -> None:
        super().__init__()
        self.max_iter = int(max_iter)
        self.slope = 1.0
        self.intercept = 0.0
        self.nll_before = float("nan")
        self.nll_after = float("nan")

    def fit(self, logits, labels) -> PlattScaler:
        """Fit ``(a, b)`` on held-out binary logits and 0/1 labels; returns self."""
        z, y = self._fit_inputs(logits, labels)
        if z.shape[1] != 2:
            raise DataError(f"PlattScaler is for binary models, got {z.shape[1]} classes", field="logits",
                            fix="use 'ts' or 'vector' for C > 2")
        s = (z[:, 1] - z[:, 0]).numpy()
        self.nll_before = _nll(z, y)
        self.intercept, self.slope, ok = fit_logistic(s, y.numpy().astype(np.float64), max_iter=self.max_iter)
        self.n_classes = 2
        self.nll_after = _nll(self._transform(z), y)
        self.fit_info.update(converged=ok, separated=not ok)
        return self

    def _transform(self, z: torch.Tensor) -> torch.Tensor:
        s = self.slope * (z[:, 1] - z[:, 0]) + self.intercept
        return torch.stack([torch.zeros_like(s), s], dim=1)

    def _state(self) -> dict:
        return {"slope": self.slope, "intercept": self.intercept, "max_iter": self.max_iter,
                "nll_before": self.nll_before, "nll_after": self.nll_after}

    def _load(self, state: dict) -> None:
        self.slope, self.intercept = float(state["slope"]), float(state["intercept"])
        self.max_iter = int(state.get("max_iter", self.max_iter))
        self.nll_before = _num(state.get("nll_before"))
        self.nll_after = _num(state.get("nll_after"))

    def __repr__(self) -> str:
        return f"PlattScaler(slope={self.slope:.4f}, intercept={self.intercept:.4f})"
