"""The per-iteration learning-rate schedule of the CT bundles: linear warm-up, then cosine decay."""
from __future__ import annotations

import math

import torch

__all__ = ["warmup_cosine"]


def warmup_cosine(optimizer: torch.optim.Optimizer, total_steps: int, warmup_steps: int = 0,
                  min_factor: float = 0.01) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up for ``warmup_steps`` then cosine decay to ``min_factor`` x lr (stepped per iteration).

    References:
        Loshchilov & Hutter, "SGDR: Stochastic Gradient Descent with Warm Restarts", ICLR 2017.
        https://arxiv.org/abs/1608.03983
    """
    total_steps = max(1, int(total_steps))
    warmup_steps = max(0, min(int(warmup_steps), total_steps - 1))

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / (warmup_steps + 1)
        t = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return min_factor + (1 - min_factor) * 0.5 * (1 + math.cos(math.pi * min(1.0, t)))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
