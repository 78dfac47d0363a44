"""Training losses for calibration: focal (fixed and FLSD-53 adaptive gamma), label-aware
smoothing (MiSLAS), soft-target cross-entropy and the MMCE penalty (Kumar et al. 2018).

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
    "mmce_squared",
    "MMCELoss",
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

    alpha: torch.Tensor | None  # a buffer (moves with .to()), None without class weights

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

    epsilons: torch.Tensor  # a buffer: eps_k per class

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


_MMCE_NORMS = ("weights", "counts")


def mmce_squared(logits: torch.Tensor, target: torch.Tensor, kernel_width: float = 0.4, weighted: bool = False,
                 normalize: str = "weights") -> torch.Tensor:
    """Squared maximum mean calibration error (Kumar, Sarawagi & Jain 2018), differentiable.

    With confidences ``r_i = max_k softmax(z_i)_k``, correctness ``c_i = q_i[argmax z_i]`` (1/0 for
    index targets; the target's mass on the predicted class for soft targets) and the Laplacian
    kernel ``k(r, r') = exp(-|r - r'| / kernel_width)`` (width 0.4 as in the paper):

    * ``weighted=False`` (MMCE_m, the paper's eq. for the estimate on ``m`` samples):
      ``sum_ij (c_i - r_i)(c_j - r_j) k(r_i, r_j) / m^2``;
    * ``weighted=True`` (MMCE_w, the paper's training variant): the squared RKHS distance between
      the correct samples' embedding weighted by ``1 - r`` and the incorrect samples' weighted by
      ``r``: ``sum_{i,j in C} (1-r_i)(1-r_j) k / n_c^2 + sum_{i,j in W} r_i r_j k / n_w^2
      - 2 sum_{i in C, j in W} (1-r_i) r_j k / (n_c n_w)``. ``normalize="counts"`` takes
      ``n_c, n_w`` = the numbers of correct / incorrect samples, as the authors' code does;
      ``normalize="weights"`` (default) takes the sums of the weights, ``sum_C (1-r)`` and
      ``sum_W r``, which makes the expectation zero for a perfectly calibrated model at any
      accuracy (with counts it is zero only at accuracy 1/2: the correct side's embedding tends
      to ``E[r(1-r) phi(r)] / E[r]``, the incorrect side's to ``E[r(1-r) phi(r)] / E[1-r]``).
      A batch with no correct or no incorrect sample gives 0, as in the authors' code.

    O(m^2) in the batch size m (one m x m kernel matrix).

    References:
        Kumar, Sarawagi & Jain, "Trainable Calibration Measures for Neural Networks from Kernel
        Mean Embeddings", ICML 2018. https://proceedings.mlr.press/v80/kumar18a.html
    """
    _check_mmce(kernel_width, normalize)
    q = _soft_targets(target, logits)
    p = F.softmax(logits, dim=1)
    r, pred = p.max(dim=1)
    c = q.gather(1, pred.unsqueeze(1)).squeeze(1)
    kern = torch.exp(-(r.unsqueeze(1) - r.unsqueeze(0)).abs() / float(kernel_width))
    m = r.shape[0]
    if not weighted:
        d = c - r
        return (d @ kern @ d) / max(m * m, 1)
    wc, ww = c * (1.0 - r), (1.0 - c) * r  # correct side weighted by 1 - r, incorrect side by r
    nc, nw = (wc.sum(), ww.sum()) if normalize == "weights" else (c.sum(), (1.0 - c).sum())
    if min(float(c.detach().sum()), float((1.0 - c.detach()).sum()), float(nc.detach()), float(nw.detach())) <= 0.0:
        return logits.sum() * 0.0
    a, b = wc / nc, ww / nw
    return (a @ kern @ a + b @ kern @ b - 2.0 * (a @ kern @ b)).clamp_min(0.0)


def _check_mmce(kernel_width: float, normalize: str) -> None:
    if not kernel_width > 0:
        raise ConfigError(f"MMCE kernel_width must be > 0, got {kernel_width}", field="kernel_width",
                          fix="use the paper's 0.4")
    if normalize not in _MMCE_NORMS:
        raise ConfigError(f"unknown MMCE normalize {normalize!r}", field="normalize",
                          fix=f"use one of {', '.join(_MMCE_NORMS)}")


class MMCELoss(nn.Module):
    """A base loss plus the MMCE calibration penalty: ``base(z, y) + lam * MMCE(z, y)``.

    ``MMCE = sqrt(mmce_squared + 1e-10)`` over the batch (:func:`mmce_squared`; the paper trains
    with ``NLL + lam * MMCE_w``). For the CT bundles the batch is a batch of bags, so this is MMCE
    at bag level; swap it in by replacing the bundle's ``loss`` section (docs/architecture.md).

    Args:
        base: the data-fit loss (default: cross-entropy, i.e. the paper's NLL); any module
            ``(logits, target) -> scalar``, e.g. :class:`FocalLoss`.
        lam: weight of the penalty (>= 0; 0 gives ``base`` alone). Mukhoti et al. 2020 compare
            MMCE with ``lam = 2``.
        kernel_width, weighted, normalize: as for :func:`mmce_squared` (defaults: 0.4, the
            weighted MMCE_w, normalised by the weight sums).

    References:
        Kumar, Sarawagi & Jain, "Trainable Calibration Measures for Neural Networks from Kernel
        Mean Embeddings", ICML 2018. https://proceedings.mlr.press/v80/kumar18a.html
    """

    def __init__(self, base: nn.Module | None = None, lam: float = 2.0, kernel_width: float = 0.4,
                 weighted: bool = True, normalize: str = "weights") -> None:
        super().__init__()
        if lam < 0:
            raise ConfigError(f"MMCE lam must be >= 0, got {lam}", field="lam", fix="use lam >= 0 (e.g. 2.0)")
        self.base = base if base is not None else FocalLoss(gamma=0.0)
        if getattr(self.base, "reduction", "mean") == "none":
            raise ConfigError("the MMCE base loss must reduce to a scalar", field="base.reduction",
                              fix="use reduction 'mean' (the default)")
        self.lam = float(lam)
        self.kernel_width = float(kernel_width)
        self.weighted = bool(weighted)
        _check_mmce(kernel_width, normalize)
        self.normalize = normalize

    def penalty(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """``MMCE = sqrt(mmce_squared + 1e-10)`` of the batch."""
        sq = mmce_squared(logits, target, self.kernel_width, self.weighted, self.normalize)
        return torch.sqrt(sq + 1e-10)

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        loss = self.base(logits, target)
        if self.lam == 0.0:
            return loss
        return loss + self.lam * self.penalty(logits, target)
