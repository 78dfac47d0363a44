"""The CIFAR training recipe: stage 1 (CE / focal / mixup / focal+mixup) and the LAS stage 2.

Mechanics only; the choices (epochs, lr, wd, method, ...) come from the bundle's top-level keys.

Speed: the data stay one ``uint8`` tensor (on the GPU when there is one), batches are gathered,
augmented and normalised as whole tensors (:class:`cifar_baselines.data.BatchIterator`), the model
runs ``channels_last``, and under AMP: on CUDA bf16/fp16 autocast (a grad scaler for fp16); on a
CPU with native bf16 instructions (AVX512-BF16 or AMX, :func:`cpu_has_native_bf16`) bf16 autocast
for *training* steps, about 1.8x faster for ResNet-32 on 2 cores of this machine. Weights, the
optimiser and the loss stay float32 (autocast). Evaluation on CPU (:func:`predict`) runs in
float32, so the logits that ECE and temperature scaling see are not bf16-rounded.
"""
from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from cifar_baselines.data import BatchIterator, normalize

__all__ = ["METHODS", "lr_at", "make_criterion", "resolve_device", "predict", "train_stage1",
           "train_head_las_shift_bn", "cpu_has_native_bf16", "training_precision"]

METHODS = ("ce", "focal", "mixup", "focal_mixup")


def resolve_device(device: str | None = "auto") -> torch.device:
    """``"auto"`` -> CUDA when available, else CPU; anything else is passed to ``torch.device``."""
    if device in (None, "", "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def lr_at(epoch: float, base_lr: float, warmup_epochs: float = 5, milestones: Sequence[int] = (160, 180),
          gamma: float = 0.1) -> float:
    """Learning rate at a (fractional) epoch: linear warm-up to ``base_lr``, then step decay.

    During warm-up the rate is ``base_lr * (epoch + 1) / warmup_epochs`` (MiSLAS's per-epoch
    warm-up, made continuous over iterations: ``base_lr / warmup_epochs`` at the first step); after it, the rate is multiplied by ``gamma`` at each milestone passed.
    """
    if warmup_epochs > 0 and epoch < warmup_epochs:
        return base_lr * min(1.0, (epoch + 1) / warmup_epochs)
    return base_lr * gamma ** sum(epoch >= m for m in milestones)


def make_criterion(method: str, num_classes: int, focal_gamma: float = 3.0) -> Callable:
    """Loss for ``method``: takes logits and class indices ``(B,)`` or soft targets ``(B, C)``."""
    if method not in METHODS:
        from lungcal.errors import ConfigError
        raise ConfigError(f"unknown method {method!r}", field="method", fix=f"use one of {', '.join(METHODS)}")
    if method.startswith("focal"):
        from lungcal.calibration.losses import FocalLoss
        return FocalLoss(gamma=focal_gamma)

    from lungcal.calibration.losses import soft_cross_entropy
    return soft_cross_entropy


def cpu_has_native_bf16() -> bool:
    """Whether this CPU executes bf16 natively (``avx512_bf16`` or ``amx_bf16`` in /proc/cpuinfo).

    Without those instructions oneDNN emulates bf16 and autocast is slower than float32, so CPU AMP
    is used only where this is true (False off Linux)."""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return bool(flags & {"avx512_bf16", "amx_bf16"})
    except OSError:
        pass
    return False


def _autocast(device: torch.device, amp: bool, training: bool = False):
    """``(context, dtype)`` for a forward pass: CUDA AMP, CPU bf16 AMP for training steps, or none."""
    if amp and device.type == "cuda":
        dtype = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.autocast("cuda", dtype=dtype), dtype
    if amp and training and device.type == "cpu" and cpu_has_native_bf16():
        return torch.autocast("cpu", dtype=torch.bfloat16), torch.bfloat16
    return torch.autocast(device.type, enabled=False), torch.float32


def training_precision(device: torch.device | str, amp: bool) -> torch.dtype:
    """The dtype :func:`train_stage1` computes in on ``device`` (recorded as the ``train_precision`` param)."""
    return _autocast(torch.device(device), amp, training=True)[1]


@torch.no_grad()
def predict(model: nn.Module, x_uint8: torch.Tensor, *, batch_size: int = 1000, device: torch.device | str = "cpu",
            amp: bool = True, channels_last: bool = True, features: bool = False):
    """Logits ``(N, C)`` (float32, CPU) of ``uint8`` images, in eval mode, no augmentation.

    With ``features=True`` returns ``(logits, features (N, D))``.
    """
    device = torch.device(device)
    was_training = model.training
    model.eval()
    ctx, _ = _autocast(device, amp)
    outs, feats = [], []
    for i in range(0, len(x_uint8), batch_size):
        xb = normalize(x_uint8[i:i + batch_size].to(device, non_blocking=True))
        if channels_last:
            xb = xb.contiguous(memory_format=torch.channels_last)
        with ctx:
            f = model.features(xb)
            logits = model.head(f)
        outs.append(logits.float().cpu())
        if features:
            feats.append(f.float().cpu())
    model.train(was_training)
    logits = torch.cat(outs) if outs else torch.empty(0)
    return (logits, torch.cat(feats)) if features else logits


def train_stage1(model: nn.Module, train_x: torch.Tensor, train_y: torch.Tensor, *, method: str = "ce",
                 epochs: int = 200, batch_size: int = 128, lr: float = 0.1, momentum: float = 0.9,
                 weight_decay: float = 5e-4, warmup_epochs: float = 5, lr_milestones: Sequence[int] = (160, 180),
                 lr_gamma: float = 0.1, focal_gamma: float = 3.0, mixup_alpha: float = 1.0,
                 num_classes: int = 10, seed: int = 0, device: torch.device | str = "cpu", amp: bool = True,
                 channels_last: bool = True, on_epoch: Callable[[int, dict], None] | None = None,
                 progress: bool = True) -> nn.Module:
    """Stage-1 training of ``model`` on resident ``uint8`` images (SGD, warm-up + step decay).

    Args:
        model: a network with ``features`` / ``head`` (e.g. :func:`cifar_baselines.resnet.resnet32`).
        train_x, train_y: ``uint8 (N, 3, 32, 32)`` images and ``int64`` labels, already on ``device``.
        method: ``ce``, ``focal``, ``mixup`` (input mixup, Beta(α, α)) or ``focal_mixup``.
        epochs, batch_size, lr, momentum, weight_decay: SGD settings.
        warmup_epochs, lr_milestones, lr_gamma: schedule (see :func:`lr_at`), updated per iteration.
        focal_gamma: γ of the focal loss. mixup_alpha: α of the mixup Beta distribution.
        seed: fixes the initial shuffle/augmentation/mixup draws.
        device: where the model and the data live. amp: autocast (CUDA; CPU training steps where
            the CPU has native bf16). channels_last: memory format.
        on_epoch: called as ``on_epoch(epoch, {"train/loss": .., "train/acc": .., "lr": ..})``
            after each epoch (the caller adds validation metrics and logs them).
        progress: show a tqdm bar over epochs.

    Returns:
        The trained ``model`` (same object), in eval mode.
    """
    device = torch.device(device)
    torch.manual_seed(seed)
    model.to(device)
    if channels_last:
        model.to(memory_format=torch.channels_last)
    criterion = make_criterion(method, num_classes, focal_gamma)
    use_mixup = method in ("mixup", "focal_mixup")
    if use_mixup:
        from lungcal.calibration.mixup import mixup
    # no weight decay on BN / bias (standard practice for these recipes is decay on all; keep all)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum, weight_decay=weight_decay)
    ctx, amp_dtype = _autocast(device, amp, training=True)
    scaler = torch.amp.GradScaler("cuda", enabled=amp_dtype == torch.float16)
    it = BatchIterator(train_x, train_y, batch_size, augment=True, seed=seed, channels_last=channels_last)
    mix_gen = torch.Generator(device=device).manual_seed(seed + 1)
    steps = len(it)
    bar = tqdm(range(epochs), desc=f"stage1 {method}", disable=not progress, dynamic_ncols=True)
    for epoch in bar:
        model.train()
        tot_loss = torch.zeros((), device=device)
        tot_hit = torch.zeros((), device=device)
        seen = 0
        for step, (xb, yb) in enumerate(it):
            for g in opt.param_groups:
                g["lr"] = lr_at(epoch + step / steps, lr, warmup_epochs, lr_milestones, lr_gamma)
            target = yb
            if use_mixup:
                xb, target, _ = mixup(xb, yb, mixup_alpha, num_classes, generator=mix_gen)
            with ctx:
                logits = model(xb)
                loss = criterion(logits.float(), target)
            if not torch.isfinite(loss):
                raise FloatingPointError(f"non-finite loss at epoch {epoch} step {step}: lower lr")
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            tot_loss += loss.detach() * len(yb)
            tot_hit += (logits.detach().argmax(1) == yb).sum()
            seen += len(yb)
        stats = {"train/loss": float(tot_loss) / seen, "train/acc": float(tot_hit) / seen,
                 "lr": opt.param_groups[0]["lr"]}
        bar.set_postfix(loss=f"{stats['train/loss']:.3f}", acc=f"{stats['train/acc']:.3f}")
        if on_epoch is not None:
            on_epoch(epoch, stats)
    model.eval()
    return model


def train_head_las_shift_bn(model: nn.Module, train_x: torch.Tensor, train_y: torch.Tensor,
                            class_counts: Sequence[int], *, smooth_head: float = 0.3, smooth_tail: float = 0.0,
                            shape: str = "concave", epochs: int = 10, lr: float = 0.05, batch_size: int = 128,
                            weight_decay: float = 5e-4, seed: int = 0, device: torch.device | str = "cpu",
                            amp: bool = True, channels_last: bool = True, progress: bool = True) -> nn.Module:
    """MiSLAS stage 2 with shifted BN: retrain ``model.head`` with LAS, re-estimate BN statistics.

    Every parameter of the backbone stays frozen; its BatchNorm layers run in train mode so their
    running mean / variance follow the class-balanced, augmented batches (MiSLAS "shift learning
    on BN"). Only ``head`` receives gradients (SGD momentum 0.9, cosine decay over the epochs).
    Use :func:`lungcal.calibration.las.retrain_head_las` instead when BN shift is not wanted (it
    works on cached features).

    Returns:
        A trained copy of ``model`` (eval mode); the input model is left unchanged.
    """
    from lungcal.calibration.losses import LabelAwareSmoothingLoss

    device = torch.device(device)
    net = copy.deepcopy(model).to(device)
    for p in net.parameters():
        p.requires_grad_(False)
    for p in net.head.parameters():
        p.requires_grad_(True)
    loss_fn = LabelAwareSmoothingLoss(list(class_counts), smooth_head=smooth_head, smooth_tail=smooth_tail, shape=shape)
    opt = torch.optim.SGD(net.head.parameters(), lr=lr, momentum=0.9, weight_decay=weight_decay)
    it = BatchIterator(train_x, train_y, batch_size, augment=True, seed=seed, sampler="balanced",
                       channels_last=channels_last)
    total = max(1, epochs * len(it))
    ctx, _ = _autocast(device, amp)
    k = 0
    for _ in tqdm(range(epochs), desc="stage2 las+shiftBN", disable=not progress, dynamic_ncols=True):
        net.train()
        for xb, yb in it:
            for g in opt.param_groups:
                g["lr"] = 0.5 * lr * (1 + math.cos(math.pi * k / total))
            with ctx:
                logits = net(xb)
            loss = loss_fn(logits.float(), yb)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            k += 1
    return net.eval()
