"""Label-aware smoothing, stage 2: retrain only the classifier head (MiSLAS, Zhong et al. 2021).

- :func:`class_counts_from_labels` gives the training-split class counts that set the per-class ε;
- :func:`retrain_head_las` retrains a head alone with
  :class:`~lungcal.calibration.losses.LabelAwareSmoothingLoss` on features of the frozen encoder.

Both work on plain tensors, so the CT attention-MIL model and CIFAR's ResNet-32 share them: a
model only has to expose its features and its ``head``.

References:
    Zhong, Cui, Liu, Jia. "Improving Calibration for Long-Tailed Recognition." CVPR 2021.
    https://arxiv.org/abs/2104.00466
"""
from __future__ import annotations

import copy
from collections.abc import Sequence

import numpy as np
import torch

from lungcal.calibration.losses import LabelAwareSmoothingLoss

__all__ = ["class_counts_from_labels", "retrain_head_las"]


def _as_tensor(x, dtype=None) -> torch.Tensor:
    t = x if isinstance(x, torch.Tensor) else torch.as_tensor(np.asarray(x))
    t = t.detach().cpu()
    return t.to(dtype) if dtype is not None else t


def class_counts_from_labels(labels, num_classes: int) -> list[int]:
    """Per-class counts of integer ``labels`` (length ``num_classes``)."""
    return torch.bincount(_as_tensor(labels, torch.long), minlength=num_classes).tolist()


def retrain_head_las(
    head: torch.nn.Module,
    train_features,
    train_labels,
    class_counts: Sequence[int],
    *,
    smooth_head: float,
    smooth_tail: float,
    shape: str = "concave",
    epochs: int = 10,
    lr: float = 0.05,
    batch_size: int = 128,
    balanced_sampling: bool = True,
    seed: int = 0,
    weight_decay: float = 5e-4,
) -> torch.nn.Module:
    """Retrain a classifier head alone with :class:`LabelAwareSmoothingLoss` (MiSLAS stage 2).

    The encoder is frozen by construction: only pre-computed ``train_features`` (from the frozen
    stage-1 encoder) are seen. The input ``head`` is not modified; a trained copy is returned in
    eval mode.

    Args:
        head: module mapping ``(B, ...)`` features to ``(B, C)`` logits.
        train_features: ``(N, ...)`` features of the training split (``(N, D)`` pooled, or
            ``(N, K, D + 1)`` per instance for the log-sum-exp and noisy-OR heads).
        train_labels: ``(N,)`` integer labels.
        class_counts: training-split class counts (head = most frequent class), length ``C``.
        smooth_head, smooth_tail: ε for the most and the least frequent class.
        shape: ε schedule between them: ``"concave"``, ``"linear"`` or ``"convex"``.
        epochs: passes over ``N`` samples.
        lr: initial SGD learning rate (momentum 0.9, cosine decay to 0).
        batch_size: mini-batch size.
        balanced_sampling: draw each batch class-balanced (with replacement) as MiSLAS does;
            otherwise a seeded shuffle.
        seed: RNG seed for sampling (training is deterministic for a given seed on CPU).
        weight_decay: SGD weight decay.

    Returns:
        The retrained copy of ``head`` (eval mode, on CPU).
    """
    feats = _as_tensor(train_features, torch.float32)
    labels = _as_tensor(train_labels, torch.long)
    if feats.ndim < 2 or feats.shape[0] != labels.shape[0]:
        raise ValueError(f"expected features (N, ...) and labels (N,), "
                         f"got {tuple(feats.shape)} and {tuple(labels.shape)}")
    n = feats.shape[0]
    if n == 0:
        raise ValueError("no training features to retrain the head on")
    counts = [int(c) for c in class_counts]
    if sum(counts) <= 0:
        raise ValueError(f"class_counts must be positive, got {counts}")

    gen = torch.Generator().manual_seed(int(seed))
    new_head = copy.deepcopy(head).cpu().train()
    loss_fn = LabelAwareSmoothingLoss(counts, smooth_head=smooth_head, smooth_tail=smooth_tail, shape=shape)
    params = [p for p in new_head.parameters()]
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.SGD(params, lr=lr, momentum=0.9, weight_decay=weight_decay)
    steps_per_epoch = max(1, -(-n // batch_size))
    total = max(1, epochs * steps_per_epoch)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=total)

    if balanced_sampling:
        present = torch.bincount(labels, minlength=len(counts)).float()
        w = torch.where(present[labels] > 0, 1.0 / present[labels].clamp_min(1), torch.zeros(()))
    for _ in range(int(epochs)):
        if balanced_sampling:
            order = torch.multinomial(w, steps_per_epoch * batch_size, replacement=True, generator=gen)
        else:
            order = torch.randperm(n, generator=gen)
        for i in range(0, order.numel(), batch_size):
            idx = order[i : i + batch_size]
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(new_head(feats[idx]), labels[idx])
            loss.backward()
            opt.step()
            sched.step()
    return new_head.eval()
