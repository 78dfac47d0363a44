"""The CIFAR learning-rate schedule: linear warm-up, then step decay at milestones, per iteration.

``lr_scheduler`` in the bundles is :func:`warmup_step_lr`, stepped after every iteration by
MONAI's ``LrScheduleHandler(epoch_level=False)``.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["lr_at", "warmup_step_lr"]


def lr_at(epoch: float, base_lr: float, warmup_epochs: float = 5, milestones: Sequence[float] = (160, 180),
          gamma: float = 0.1) -> float:
    """Learning rate at a (fractional) epoch: linear warm-up to ``base_lr``, then step decay.

    During warm-up the rate is ``base_lr * (epoch + 1) / warmup_epochs`` (MiSLAS's per-epoch
    warm-up, made continuous over iterations: ``base_lr / warmup_epochs`` at the first step);
    after it, the rate is multiplied by ``gamma`` at each milestone passed.
    """
    if warmup_epochs > 0 and epoch < warmup_epochs:
        return base_lr * min(1.0, (epoch + 1) / warmup_epochs)
    return base_lr * gamma ** sum(epoch >= m for m in milestones)


def warmup_step_lr(optimizer: torch.optim.Optimizer, steps_per_epoch: int, warmup_epochs: float = 5,
                   milestones: Sequence[int] = (160, 180), gamma: float = 0.1) -> torch.optim.lr_scheduler.LambdaLR:
    """:func:`lr_at` as a per-iteration ``LambdaLR``: iteration ``k`` runs at ``lr_at(k / steps_per_epoch)``."""
    steps = max(1, int(steps_per_epoch))
    at = [float(m) for m in milestones]
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda k: lr_at(k / steps, 1.0, float(warmup_epochs), at, float(gamma)))
