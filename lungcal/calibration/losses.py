"""Training losses for calibration: focal (fixed and FLSD-53 adaptive gamma), label-aware
smoothing (MiSLAS) and soft-target cross-entropy.

Every loss takes **logits** ``(N, C)`` and a target that is either class indices ``(N,)``
(int) or soft targets ``(N, C)`` (float rows summing to 1, e.g. from :func:`..mixup.mixup`).
The CT classifier's 2-logit output is just the C = 2 case.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from lungcal.errors import ConfigError

__all__ = [
    "soft_cross_entropy",
    "las_epsilons",
    "FocalLoss",
    "FocalLossAdaptiveGamma",
    "LabelAwareSmoothingLoss",
]

_REDUCTIONS = ("mean", "sum", "none")


def _soft_targets(target: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """Class indices (N,) -> one-hot (N, C) in the logits' dtype; soft targets pass through."""
    if logits.ndim != 2:
        raise ValueError(f"logits must be (N, C), got shape {tuple(logits.shape)}")
    if target.ndim == 2 and target.shape[1] == 1 and logits.shape[1] != 1:
        target = target[:, 0]
    if target.ndim == 1:
        return F.one_hot(target.long(), logits.shape[1]).to(logits.dtype)
    if target.shape != logits.shape:
        raise ValueError(f"soft targets {tuple(target.shape)} do not match logits {tuple(logits.shape)}")
    return target.to(logits.dtype)


def _reduce(loss: torch.Tensor, reduction: str) -> torch.Tensor:
    if reduction == "mean":
        return loss.mean()
    if reduction == "sum":
        return loss.sum()
    if reduction == "none":
        return loss
    raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")


def soft_cross_entropy(logits: torch.Tensor, soft_targets: torch.Tensor,
                       reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy ``-sum_k q_k log softmax(z)_k`` with soft (or index) targets ``q``.

    Equals ``F.cross_entropy`` for one-hot / index targets.
    """
    q = _soft_targets(soft_targets, logits)
    return _reduce(-(q * F.log_softmax(logits, dim=1)).sum(1), reduction)


def _check_reduction(reduction: str) -> str:
    if reduction not in _REDUCTIONS:
        raise ConfigError(f"unknown reduction {reduction!r}", field="reduction",
                          fix=f"use one of {', '.join(_REDUCTIONS)}")
    return reduction


class FocalLoss(nn.Module):
    """Focal loss (Lin et al. 2017), as used for calibration by Mukhoti et al. 2020.

    ``loss = -sum_k alpha_k q_k (1 - p_k)^gamma log p_k`` with ``p = softmax(logits)`` and target
    distribution ``q`` (one-hot for index targets, so this is ``-alpha_y (1 - p_y)^gamma log p_y``).
    ``gamma = 0`` and ``alpha = None`` give exactly the cross-entropy.

    Args:
        gamma: focusing parameter (>= 0).
        alpha: ``None`` (no class weights); a float in (0, 1) for a 2-class task (weight alpha on
            class 1 and 1 - alpha on class 0, RetinaNet style); or a sequence of C per-class weights.
        reduction: ``"mean"`` over samples, ``"sum"`` or ``"none"`` (per-sample losses).
    """

    def __init__(self, gamma: float = 2.0, alpha: float | Sequence[float] | None = None,
                 reduction: str = "mean") -> None:
        super().__init__()
        if gamma < 0:
            raise ConfigError(f"focal gamma must be >= 0, got {gamma}", field="gamma",
                              fix="use gamma >= 0 (gamma = 0 is cross-entropy)")
        self.gamma = float(gamma)
        self.reduction = _check_reduction(reduction)
        if alpha is None:
            self.register_buffer("alpha", None)
        else:
            if isinstance(alpha, (int, float)):
                if not 0.0 < float(alpha) < 1.0:
                    raise ConfigError(f"scalar focal alpha must be in (0, 1), got {alpha}",
                                      field="alpha", fix="use a value in (0, 1) or a per-class list")
                alpha = [1.0 - float(alpha), float(alpha)]
            self.register_buffer("alpha", torch.as_tensor(list(alpha), dtype=torch.float32))

    def _gamma(self, p: torch.Tensor) -> torch.Tensor | float:
        return self.gamma

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        q = _soft_targets(target, logits)
        logp = F.log_softmax(logits, dim=1)
        p = logp.exp()
        gamma = self._gamma(p)
        weight = (1.0 - p).clamp_min(0.0) ** gamma
        per_class = -q * weight * logp
        if self.alpha is not None:
            if self.alpha.shape[0] != logits.shape[1]:
                raise ConfigError(f"alpha has {self.alpha.shape[0]} weights for {logits.shape[1]} classes",
                                  field="alpha", fix="give one weight per class")
            per_class = per_class * self.alpha.to(logits.dtype)
        return _reduce(per_class.sum(1), self.reduction)


class FocalLossAdaptiveGamma(FocalLoss):
    """FLSD-53 (Mukhoti et al. 2020): focal loss with a sample-dependent gamma,
    ``gamma = 5`` where ``p < 0.2`` and ``gamma = 3`` otherwise.

    The threshold is applied to the (detached) probability of each target class, so for index
    targets this is exactly FLSD-53 on ``p_y``; for soft targets each class term uses its own p_k.

    Args:
        thresholds_gammas: ``((threshold, gamma), ...)`` checked in order; the first threshold
            that ``p`` is below picks its gamma. Default ``((0.2, 5.0),)``.
        default_gamma: gamma where no threshold applies (3.0).
        alpha, reduction: as for :class:`FocalLoss`.
    """

    def __init__(self, thresholds_gammas: Sequence[tuple[float, float]] = ((0.2, 5.0),),
                 default_gamma: float = 3.0, alpha=None, reduction: str = "mean") -> None:
        super().__init__(gamma=default_gamma, alpha=alpha, reduction=reduction)
        self.thresholds_gammas = tuple((float(t), float(g)) for t, g in thresholds_gammas)

    def _gamma(self, p: torch.Tensor) -> torch.Tensor:
        pd = p.detach()
        gamma = torch.full_like(pd, self.gamma)
        for thr, g in reversed(self.thresholds_gammas):  # first matching threshold wins
            gamma = torch.where(pd < thr, torch.full_like(pd, g), gamma)
        return gamma


_SHAPES = ("concave", "linear", "convex", "exp")


def las_epsilons(class_counts: Sequence[int], smooth_head: float, smooth_tail: float,
                 shape: str = "concave", power: float | None = None) -> np.ndarray:
    """Per-class smoothing factors of label-aware smoothing (MiSLAS, Zhong et al. 2021).

    With ``n_1 = max(counts)``, ``n_K = min(counts)`` and ``r_y = (n_y - n_K) / (n_1 - n_K)``:

    * concave: ``eps_y = tail + (head - tail) * sin(r_y * pi / 2)``
    * linear:  ``eps_y = tail + (head - tail) * r_y``
    * convex:  ``eps_y = head + (head - tail) * sin(3 pi / 2 + r_y * pi / 2)``
    * exp:     ``eps_y = tail + (head - tail) * r_y ** power``

    so the most frequent class gets ``smooth_head`` and the rarest ``smooth_tail``. When all
    counts are equal every class gets ``smooth_head`` (MiSLAS would divide by zero).

    Returns:
        float64 array of shape (K,).
    """
    n = np.asarray(class_counts, dtype=np.float64)
    if n.ndim != 1 or n.size < 2 or np.any(n < 0):
        raise ConfigError(f"class_counts must be >= 2 non-negative counts, got {class_counts!r}",
                          field="class_counts", fix="pass the number of training samples per class")
    for name, v in (("smooth_head", smooth_head), ("smooth_tail", smooth_tail)):
        if not 0.0 <= v < 1.0:
            raise ConfigError(f"{name} must be in [0, 1), got {v}", field=name,
                              fix="use a smoothing factor such as 0.3 (head) / 0.0 (tail)")
    if shape not in _SHAPES:
        raise ConfigError(f"unknown LAS shape {shape!r}", field="shape", fix=f"use one of {_SHAPES}")
    n1, nk = n.max(), n.min()
    if n1 == nk:
        return np.full_like(n, float(smooth_head))
    r = (n - nk) / (n1 - nk)
    h, t = float(smooth_head), float(smooth_tail)
    if shape == "concave":
        return t + (h - t) * np.sin(r * np.pi / 2)
    if shape == "linear":
        return t + (h - t) * r
    if shape == "convex":
        return h + (h - t) * np.sin(1.5 * np.pi + r * np.pi / 2)
    if power is None:
        raise ConfigError("LAS shape 'exp' needs a power", field="power", fix="set power, e.g. 2.0")
    return t + (h - t) * np.power(r, power)


class LabelAwareSmoothingLoss(nn.Module):
    """Label-aware smoothing (MiSLAS): cross-entropy against ``(1 - eps_y) onehot(y) + eps_y / K``.

    ``loss_i = (1 - eps_y) * (-log p_y) + eps_y * mean_k(-log p_k)``: the smoothing mass spreads
    over all K classes, including y (MiSLAS' ``LabelAwareSmoothing``). With soft targets ``q``,
    ``eps_i = sum_k q_k eps_k`` and ``-log p_y`` becomes ``-sum_k q_k log p_k``.

    Args:
        class_counts: training samples per class (length K).
        smooth_head, smooth_tail, shape, power: see :func:`las_epsilons`.
        reduction: ``"mean"``, ``"sum"`` or ``"none"``.
    """

    def __init__(self, class_counts: Sequence[int], smooth_head: float, smooth_tail: float,
                 shape: str = "concave", power: float | None = None, reduction: str = "mean") -> None:
        super().__init__()
        eps = las_epsilons(class_counts, smooth_head, smooth_tail, shape, power)
        self.register_buffer("epsilons", torch.as_tensor(eps, dtype=torch.float32))
        self.reduction = _check_reduction(reduction)

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if logits.shape[1] != self.epsilons.shape[0]:
            raise ConfigError(f"LAS has {self.epsilons.shape[0]} class counts but logits have "
                              f"{logits.shape[1]} classes", field="class_counts",
                              fix="pass one count per class")
        q = _soft_targets(target, logits)
        logp = F.log_softmax(logits, dim=1)
        eps = q @ self.epsilons.to(logits.dtype)
        loss = (1.0 - eps) * (-(q * logp).sum(1)) + eps * (-logp.mean(1))
        return _reduce(loss, self.reduction)
