"""Mixup (Zhang et al. 2018; for calibration: Thulasidasan et al. 2019) on any tensor shape,
and a bag-level variant for multiple-instance learning.

One λ ~ Beta(α, α) per batch and one random permutation within the batch, as in the reference
implementation. Targets come back as soft targets ``(B, C)`` for
:func:`..losses.soft_cross_entropy` / :class:`..losses.FocalLoss`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from lungcal.errors import ConfigError

__all__ = ["mixup", "mixup_bags", "sample_lambda"]


def sample_lambda(alpha: float, generator: torch.Generator | None = None) -> float:
    """Draw λ ~ Beta(α, α) with the given torch generator (α = 0 gives λ = 1, no mixing)."""
    if alpha < 0:
        raise ConfigError(f"mixup alpha must be >= 0, got {alpha}", field="alpha",
                          fix="use alpha > 0 (e.g. 0.2-1.0), or 0 to disable mixup")
    if alpha == 0:
        return 1.0
    # Beta(a, a) = Ga / (Ga + Gb), Gamma variates drawn with the caller's generator
    a = torch.full((2,), float(alpha), dtype=torch.float64)
    g = torch._standard_gamma(a, generator=generator)
    return float(g[0] / (g[0] + g[1]))


def _targets(y: torch.Tensor, num_classes: int, dtype: torch.dtype) -> torch.Tensor:
    if y.ndim == 2 and y.shape[1] == num_classes and y.is_floating_point():
        return y.to(dtype)
    if y.ndim == 2 and y.shape[1] == 1:
        y = y[:, 0]
    if y.ndim != 1:
        raise ValueError(f"labels must be (B,) indices or (B, {num_classes}) soft targets, got {tuple(y.shape)}")
    return F.one_hot(y.long(), num_classes).to(dtype)


def mixup(x: torch.Tensor, y: torch.Tensor, alpha: float, num_classes: int,
          generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Mix a batch with a permutation of itself.

    ``x_mixed = λ x + (1 - λ) x[perm]``, ``y_soft = λ onehot(y) + (1 - λ) onehot(y[perm])``.

    Args:
        x: any tensor with the batch first, ``(B, ...)`` (images, features, bags).
        y: ``(B,)`` class indices or ``(B, C)`` soft targets.
        alpha: Beta(α, α) parameter; 0 returns the inputs unmixed (λ = 1).
        num_classes: C.
        generator: torch generator for λ and the permutation (reproducibility).

    Returns:
        ``(x_mixed, y_soft (B, C) float, lam)``; rows of ``y_soft`` sum to 1.
    """
    lam = sample_lambda(alpha, generator)
    dtype = x.dtype if x.is_floating_point() else torch.float32
    q = _targets(y, num_classes, dtype).to(x.device)
    if lam == 1.0:
        return x, q, lam
    perm = torch.randperm(x.shape[0], generator=generator).to(x.device)
    x_mixed = lam * x + (1.0 - lam) * x[perm]
    y_soft = lam * q + (1.0 - lam) * q[perm]
    return x_mixed, y_soft, lam


def mixup_bags(bags: torch.Tensor, mask: torch.Tensor, y: torch.Tensor, alpha: float,
               num_classes: int, generator: torch.Generator | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]:
    """Mixup for MIL bags ``(B, K, ...)`` with validity masks ``(B, K)``.

    Semantics (instance-wise blend, mask union): slot k of the mixed bag is
    ``λ a_k + (1 - λ) b_k`` where both partners have a valid instance there; where only one
    partner has one, that instance is kept **unscaled** (blending with a zero pad would just dim
    the patch); where neither has one, the slot stays zero. The mixed mask is the union of the
    two masks. Targets mix with the same λ as in :func:`mixup`. Bags are assumed to be sorted
    by candidate score (slot 0 = most suspicious), so slot-wise pairing pairs like with like.

    Returns:
        ``(bags_mixed, mask_mixed (B, K) bool, y_soft (B, C), lam)``.
    """
    if mask.shape != bags.shape[:2]:
        raise ValueError(f"mask {tuple(mask.shape)} must be bags.shape[:2] = {tuple(bags.shape[:2])}")
    lam = sample_lambda(alpha, generator)
    m = mask.bool()
    dtype = bags.dtype if bags.is_floating_point() else torch.float32
    q = _targets(y, num_classes, dtype).to(bags.device)
    if lam == 1.0:
        return bags, m, q, lam
    perm = torch.randperm(bags.shape[0], generator=generator).to(bags.device)
    mb = m[perm]
    extra = (1,) * (bags.ndim - 2)
    wa = torch.where(mb, lam, 1.0).to(dtype) * m.to(dtype)       # weight of the bag itself
    wb = torch.where(m, 1.0 - lam, 1.0).to(dtype) * mb.to(dtype)  # weight of its partner
    mixed = wa.view(*wa.shape, *extra) * bags + wb.view(*wb.shape, *extra) * bags[perm]
    y_soft = lam * q + (1.0 - lam) * q[perm]
    return mixed, m | mb, y_soft, lam
