"""Stage 2 on the MIL model: apply a (retrained) head to cached per-candidate features.

LAS head retraining itself is model-agnostic and lives in :mod:`lungcal.calibration.las`;
temperature scaling in :class:`lungcal.calibration.scaling.TemperatureScaler`.
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

__all__ = ["InstanceScorer", "apply_head"]


@runtime_checkable
class InstanceScorer(Protocol):
    """A head that scores every instance (log-sum-exp, noisy-OR): ``(logits, per-instance weights)``."""

    def forward_with_probs(self, feats: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...


def apply_head(head: torch.nn.Module, features: torch.Tensor,
               attention: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logits and per-candidate weights of a (retrained) head on cached features.

    Heads that see every instance (log-sum-exp, noisy-OR: they have ``forward_with_probs``) hold
    their own instance scorer, so after LAS the weights come from the new head. A plain head on
    pooled features (softmax attention) leaves the pool in the frozen part: ``attention``, the
    stage-1 weights, is returned as it is.
    """
    with torch.no_grad():
        if isinstance(head, InstanceScorer):
            return head.forward_with_probs(features)
        return head(features), attention
