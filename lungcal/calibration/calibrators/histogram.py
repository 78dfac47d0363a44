"""Histogram binning, one-vs-rest, on equal-width ``(lo, hi]`` bins of the softmax probabilities."""
from __future__ import annotations

import numpy as np
import torch

from lungcal.calibration.calibrators.base import Calibrator, _normalise_log, _softmax_np

__all__ = ["HistogramBinning"]


class HistogramBinning(Calibrator):
    """Histogram binning, one-vs-rest: for each class k, softmax(z)_k is put into ``n_bins``
    equal-width ``(lo, hi]`` bins (0 into the first), and replaced by the observed frequency of
    y = k in that bin on the fit data (the bin midpoint for empty bins). The C calibrated scores
    are renormalised to sum to 1. ``transform`` returns their log.

    References:
        Zadrozny, Elkan. "Obtaining calibrated probability estimates from decision trees and
        naive Bayesian classifiers." ICML 2001. https://dl.acm.org/doi/10.5555/645530.655813
    """

    name = "histogram"

    def __init__(self, n_bins: int = 15) -> None:
        super().__init__()
        self.n_bins = int(n_bins)
        self.bin_values: torch.Tensor | None = None  # (C, n_bins)

    def _bins(self, p: np.ndarray) -> np.ndarray:
        edges = np.linspace(0.0, 1.0, self.n_bins + 1)
        return np.clip(np.searchsorted(edges, p, side="left") - 1, 0, self.n_bins - 1)

    def fit(self, logits, labels) -> HistogramBinning:
        """Fit the per-class bin frequencies; returns self."""
        z, yt = self._fit_inputs(logits, labels)
        y = yt.numpy()
        p = _softmax_np(z.numpy())
        n, c = p.shape
        idx = self._bins(p) + np.arange(c)[None, :] * self.n_bins  # (N, C) flat bin ids
        hit = (y[:, None] == np.arange(c)[None, :]).astype(np.float64)
        m = c * self.n_bins
        count = np.bincount(idx.ravel(), minlength=m).reshape(c, self.n_bins)
        pos = np.bincount(idx.ravel(), weights=hit.ravel(), minlength=m).reshape(c, self.n_bins)
        mid = (np.arange(self.n_bins) + 0.5) / self.n_bins
        vals = np.where(count > 0, pos / np.maximum(count, 1), mid[None, :])
        self.bin_values = torch.as_tensor(vals, dtype=torch.float64)
        self.n_classes = int(c)
        return self

    def _transform(self, z):
        assert self.bin_values is not None  # _prep checked the fit
        p = _softmax_np(z.numpy())
        idx = torch.as_tensor(self._bins(p))
        cal = torch.gather(self.bin_values, 1, idx.T).T  # (N, C)
        return _normalise_log(cal)

    def _state(self) -> dict:
        return {"n_bins": self.n_bins, "bin_values": self.bin_values}

    def _load(self, state: dict) -> None:
        self.n_bins = int(state["n_bins"])
        self.bin_values = torch.as_tensor(state["bin_values"], dtype=torch.float64)
