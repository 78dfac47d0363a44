"""The inputs every measure takes: ``(N, C)`` probabilities or ``(N,)`` p(y=1), ``(N,)`` class labels,
checked once (:func:`_as_probs_labels`); the confidence and the hit of each case in either ECE mode."""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from lungcal.errors import DataError

_MODES = ("top_label", "positive_class")
_PROB_TOL = 1e-6


def _to_numpy(x: Any) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu()
        if x.dtype in (torch.bfloat16, torch.float16):
            x = x.float()
        return x.numpy()
    return np.asarray(x)


def _as_probs_labels(probs: Any, labels: Any) -> tuple[np.ndarray, np.ndarray]:
    """Validate and return ``(P (N, C) float, y (N,) int64)``; ``(N,)`` input becomes ``(N, 2)``.

    The float dtype of ``probs`` is kept (float32 stays float32); accumulations upcast later.
    """
    p = _to_numpy(probs)
    y = _to_numpy(labels)
    if not np.issubdtype(p.dtype, np.floating):
        p = p.astype(np.float64)
    if y.ndim == 2 and y.shape[1] == 1:
        y = y[:, 0]
    if p.ndim == 2 and p.shape[1] == 1:
        p = p[:, 0]
    if y.ndim != 1:
        raise DataError(f"labels must be 1-D class indices, got shape {tuple(y.shape)}",
                        field="labels", fix="pass integer class indices of shape (N,), not one-hot")
    if p.ndim == 1:
        p = np.stack([1.0 - p, p], axis=1)
    elif p.ndim != 2:
        raise DataError(f"probs must be (N, C) or (N,), got shape {tuple(p.shape)}", field="probs",
                        fix="flatten extra dimensions so that probs is (N, C)")
    if p.shape[0] != y.shape[0]:
        raise DataError(f"probs has {p.shape[0]} rows but labels has {y.shape[0]}", field="labels",
                        fix="pass one label per row of probs")
    if p.shape[0] == 0:
        raise DataError("no samples", field="probs", fix="pass at least one sample")
    if np.issubdtype(y.dtype, np.floating):
        if not np.all(np.isfinite(y)) or np.any(y != np.round(y)):
            raise DataError("labels are not integral", field="labels", fix="pass class indices")
    y = y.astype(np.int64, copy=False)
    lo, hi = y.min(), y.max()
    if lo < 0 or hi >= p.shape[1]:
        raise DataError(f"labels span [{lo}, {hi}] but probs has {p.shape[1]} classes",
                        field="labels", fix="labels must be in [0, C) for probs of shape (N, C)")
    pmin, pmax = p.min(), p.max()
    if not (np.isfinite(pmin) and np.isfinite(pmax)) or pmin < -_PROB_TOL or pmax > 1 + _PROB_TOL:
        raise DataError(
            f"probs must be probabilities in [0, 1], got values in [{pmin:.4g}, {pmax:.4g}]",
            field="probs", fix="apply softmax (or sigmoid) to logits before computing metrics",
        )
    return p, y


def _check_mode(mode: str, n_classes: int) -> None:
    if mode not in _MODES:
        raise ValueError(f"mode must be one of {_MODES}, got {mode!r}")
    if mode == "positive_class" and n_classes != 2:
        raise DataError(f"mode='positive_class' needs a binary task, got {n_classes} classes",
                        field="mode", fix="use mode='top_label' (or classwise_ece) for C > 2")


def _top_label(p: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Top-label confidence (in ``p``'s dtype) and prediction (ties -> lowest index), one pass.

    ``torch.max(dim=1)`` on a zero-copy view returns values and indices together (and runs
    multithreaded); torch documents that the first maximal index is returned. Arrays torch
    cannot view (negative strides, non-native byte order) take the numpy path.
    """
    try:
        t = torch.from_numpy(p)
    except (TypeError, ValueError, RuntimeError):
        pred = p.argmax(axis=1)
        return np.take_along_axis(p, pred[:, None], axis=1)[:, 0], pred
    conf, pred = t.max(dim=1)
    return conf.numpy(), pred.numpy()


def _confidence_hit(p: np.ndarray, y: np.ndarray, mode: str) -> tuple[np.ndarray, np.ndarray]:
    """Per-sample confidence (``p``'s dtype, no copy of the (N, C) array) and hit (bool)."""
    _check_mode(mode, p.shape[1])
    if mode == "positive_class":
        return p[:, 1], y == 1
    conf, pred = _top_label(p)
    return conf, pred == y


def _confidence_correct(p: np.ndarray, y: np.ndarray, mode: str) -> tuple[np.ndarray, np.ndarray]:
    """Per-sample confidence (float64) and 'hit' (float64 0/1) for the given mode."""
    conf, hit = _confidence_hit(p, y, mode)
    return conf.astype(np.float64), hit.astype(np.float64)
