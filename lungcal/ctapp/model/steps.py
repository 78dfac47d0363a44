"""The MONAI engines' per-iteration pieces for MIL: ``prepare_batch`` and the ``iteration_update`` steps.

The network takes two inputs and returns two outputs, ``(bags, mask) -> (logits, attention)``,
where MONAI's defaults pass one input and expect one output; mixup happens inside the training
step (bag-level in input space, or on pooled features).

References:
    Zhang, Cisse, Dauphin & Lopez-Paz, "mixup: Beyond Empirical Risk Minimization", ICLR 2018.
    https://arxiv.org/abs/1710.09412
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from monai.utils import CommonKeys

from lungcal.calibration.mixup import mixup, mixup_bags
from lungcal.errors import ConfigError

__all__ = ["MILPrepareBatch", "MILTrainStep", "MILEvalStep"]

MIXUP_SPACES = ("input", "feature")


class MILPrepareBatch:
    """``prepare_batch`` for MONAI engines: returns ``((bags, mask), labels)`` on ``device``."""

    def __call__(self, batchdata: Mapping[str, torch.Tensor], device=None, non_blocking: bool = False, **kwargs):
        bags = batchdata["bag"].to(device=device, non_blocking=non_blocking)
        mask = batchdata["mask"].to(device=device, non_blocking=non_blocking)
        label = batchdata["label"].to(device=device, non_blocking=non_blocking).long()
        return (bags, mask), label


class MILTrainStep:
    """``iteration_update`` of the trainer: forward ``(bags, mask) -> (logits, attention)``, loss, step.

    Args:
        mixup_alpha: Beta(alpha, alpha) mixing; 0 disables mixup.
        mixup_space: ``"input"`` mixes bags slot-wise (:func:`mixup_bags`); ``"feature"`` mixes
            the pooled bag features before the head (manifold mixup at the MIL pooling output).
        num_classes: number of classes (2 for CT).
        seed: seed of the step's own mixup generator.
    """

    def __init__(self, mixup_alpha: float = 0.0, mixup_space: str = "input", num_classes: int = 2, seed: int = 0):
        if mixup_space not in MIXUP_SPACES:
            raise ConfigError(f"unknown mixup_space {mixup_space!r}", field="mixup_space",
                              fix="use 'input' or 'feature'")
        if mixup_alpha < 0:
            raise ConfigError(f"mixup_alpha must be >= 0, got {mixup_alpha}", field="mixup_alpha",
                              fix="use 0 to disable")
        self.alpha = float(mixup_alpha)
        self.space = mixup_space
        self.num_classes = num_classes
        self.generator = torch.Generator().manual_seed(int(seed))

    def __call__(self, engine, batchdata) -> dict[str, Any]:
        (bags, mask), label = engine.prepare_batch(batchdata, engine.state.device, engine.non_blocking)
        net = engine.network
        net.train()
        engine.optimizer.zero_grad(set_to_none=True)
        target: torch.Tensor = label
        # mixing draws come from this step's CPU generator whatever the device (calibration.mixup)
        if self.alpha > 0 and self.space == "input":
            bags, mask, target, _ = mixup_bags(bags, mask, label, self.alpha, self.num_classes, self.generator)
        amp: bool = getattr(engine, "amp", False)  # a bool: the bundle hands the trainer $@run_settings['amp']
        with torch.autocast(device_type=bags.device.type, enabled=amp):
            if self.alpha > 0 and self.space == "feature":
                feats, target, _ = mixup(net.features(bags, mask), label, self.alpha, self.num_classes,
                                         self.generator)
                logits = net.head(feats)
            else:
                logits, _ = net(bags, mask)
        logits = logits.float()  # the loss (and every metric downstream) sees float32
        loss = engine.loss_function(logits, target)
        scaler = getattr(engine, "scaler", None)
        if amp and scaler is not None and bags.device.type == "cuda":  # fp16 on CUDA needs loss scaling
            scaler.scale(loss).backward()
            scaler.step(engine.optimizer)
            scaler.update()
        else:
            loss.backward()
            engine.optimizer.step()
        return {CommonKeys.IMAGE: None, CommonKeys.LABEL: label, CommonKeys.PRED: logits.detach(),
                CommonKeys.LOSS: loss.detach()}


class MILEvalStep:
    """``iteration_update`` of evaluators: ``{"pred": logits, "label", "attention"}`` without grad.

    Never under autocast: ECE and temperature scaling see float32 logits.

    Args:
        flips: whether a model with test-time flips (``tta_flips``) runs them here. The CT bundles'
            per-epoch validation passes False: it only ranks the epochs for the checkpoint, and the 8
            flips made it about 40 % of a training epoch at K = 16; the chosen checkpoint is then
            scored (val, test, the calibrators' fit) with its flips.
    """

    def __init__(self, flips: bool = True) -> None:
        self.flips = bool(flips)

    def __call__(self, engine, batchdata) -> dict[str, Any]:
        (bags, mask), label = engine.prepare_batch(batchdata, engine.state.device, engine.non_blocking)
        net = engine.network
        engine.network.eval()
        inner = getattr(net, "module", net)  # DistributedDataParallel wraps the model
        saved = getattr(inner, "tta_flips", None)
        if saved is not None and not self.flips:
            inner.tta_flips = False
        try:
            with torch.no_grad():
                logits, attention = engine.network(bags, mask)
        finally:
            if saved is not None:
                inner.tta_flips = saved
        return {CommonKeys.IMAGE: None, CommonKeys.LABEL: label, CommonKeys.PRED: logits, "attention": attention}
