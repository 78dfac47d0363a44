"""Stage 1: train an attention-MIL model with MONAI ``SupervisedTrainer`` / ``SupervisedEvaluator``.

The pieces are small functions so that bundles (and ``cifar_baselines``) can reuse them:

- :func:`make_loss` turns a loss name into a module from :mod:`lungcal.calibration.losses`;
- :class:`MILPrepareBatch` feeds ``(bags, mask)`` to the network (MONAI's default only passes
  one input);
- :class:`MILTrainStep` / :class:`MILEvalStep` are the engines' ``iteration_update``: the
  network returns ``(logits, attention)``; mixup (bag-level in input space, or in feature space
  on pooled features) happens here;
- :func:`warmup_cosine` is the per-iteration LR schedule;
- :class:`AtomicCheckpoint` keeps ``best.pt`` (by validation AUC) and ``last.pt`` with atomic
  writes, so a crash never leaves a half-written checkpoint;
- :func:`build_trainer` / :func:`build_evaluator` assemble the engines.
"""
from __future__ import annotations

import logging
import math
import os
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from lungcal.errors import ConfigError

__all__ = [
    "LOSSES",
    "make_loss",
    "MILPrepareBatch",
    "MILTrainStep",
    "MILEvalStep",
    "warmup_cosine",
    "atomic_torch_save",
    "AtomicCheckpoint",
    "EpochMetricsLogger",
    "build_trainer",
    "build_evaluator",
    "predict",
]

logger = logging.getLogger(__name__)

LOSSES = ("ce", "focal", "focal_adaptive")


def make_loss(name: str, *, gamma: float = 2.0, alpha: float | Sequence[float] | None = None) -> nn.Module:
    """A stage-1 loss taking logits and class indices or soft targets.

    Args:
        name: ``"ce"`` (soft-target cross-entropy), ``"focal"`` (``gamma``) or ``"focal_adaptive"``
            (FLSD-53). Mixup is orthogonal: it is switched on by ``mixup_alpha > 0``.
        gamma: focal gamma.
        alpha: optional focal class weights.
    """
    from lungcal.calibration import losses as L

    if name == "ce":
        return _SoftCE()
    if name == "focal":
        return L.FocalLoss(gamma=gamma, alpha=alpha)
    if name == "focal_adaptive":
        return L.FocalLossAdaptiveGamma()
    raise ConfigError(f"unknown loss {name!r}", field="loss", fix=f"use one of {list(LOSSES)}")


class _SoftCE(nn.Module):
    """Cross-entropy accepting class indices or soft targets."""

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if target.ndim == logits.ndim:
            from lungcal.calibration.losses import soft_cross_entropy

            return soft_cross_entropy(logits, target)
        return nn.functional.cross_entropy(logits, target)


class MILPrepareBatch:
    """``prepare_batch`` for MONAI engines: returns ``((bags, mask), labels)`` on ``device``."""

    def __call__(self, batchdata: Mapping[str, torch.Tensor], device=None, non_blocking: bool = False, **kw):
        bags = batchdata["bag"].to(device=device, non_blocking=non_blocking)
        mask = batchdata["mask"].to(device=device, non_blocking=non_blocking)
        label = batchdata["label"].to(device=device, non_blocking=non_blocking).long()
        return (bags, mask), label


class MILTrainStep:
    """``iteration_update`` of the trainer: forward ``(bags, mask) -> (logits, attention)``, loss, step.

    Args:
        mixup_alpha: Beta(α, α) mixing; 0 disables mixup.
        mixup_space: ``"input"`` mixes bags slot-wise (:func:`mixup_bags`); ``"feature"`` mixes
            the pooled bag features before the head (manifold mixup at the MIL pooling output).
        num_classes: number of classes (2 for CT).
        seed: seed of the mixup generator.
    """

    def __init__(self, mixup_alpha: float = 0.0, mixup_space: str = "input", num_classes: int = 2, seed: int = 0):
        if mixup_space not in ("input", "feature"):
            raise ConfigError(f"unknown mixup_space {mixup_space!r}", field="mixup_space", fix="use 'input' or 'feature'")
        if mixup_alpha < 0:
            raise ConfigError(f"mixup_alpha must be >= 0, got {mixup_alpha}", field="mixup_alpha", fix="use 0 to disable")
        self.alpha = float(mixup_alpha)
        self.space = mixup_space
        self.num_classes = num_classes
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, engine, batchdata) -> dict[str, Any]:
        from monai.utils import CommonKeys as K

        (bags, mask), label = engine.prepare_batch(batchdata, engine.state.device, engine.non_blocking)
        net = engine.network
        net.train()
        engine.optimizer.zero_grad(set_to_none=True)
        target: torch.Tensor = label
        if self.alpha > 0 and self.space == "input":
            from lungcal.calibration.mixup import mixup_bags

            bags, mask, target, _ = mixup_bags(bags, mask, label, self.alpha, self.num_classes, self.generator)
            logits, _ = net(bags, mask)
        elif self.alpha > 0:
            from lungcal.calibration.mixup import mixup

            feats = net.features(bags, mask)
            feats, target, _ = mixup(feats, label, self.alpha, self.num_classes, self.generator)
            logits = net.head(feats)
        else:
            logits, _ = net(bags, mask)
        loss = engine.loss_function(logits, target)
        loss.backward()
        engine.optimizer.step()
        return {K.IMAGE: None, K.LABEL: label, K.PRED: logits.detach(), K.LOSS: loss.detach()}


class MILEvalStep:
    """``iteration_update`` of evaluators: ``{"pred": logits, "label", "attention"}`` without grad."""

    def __call__(self, engine, batchdata) -> dict[str, Any]:
        from monai.utils import CommonKeys as K

        (bags, mask), label = engine.prepare_batch(batchdata, engine.state.device, engine.non_blocking)
        engine.network.eval()
        with torch.no_grad():
            logits, attention = engine.network(bags, mask)
        return {K.IMAGE: None, K.LABEL: label, K.PRED: logits, "attention": attention}


def warmup_cosine(optimizer: torch.optim.Optimizer, total_steps: int, warmup_steps: int = 0,
                  min_factor: float = 0.01) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up for ``warmup_steps`` then cosine decay to ``min_factor`` × lr (per iteration)."""
    total_steps = max(1, int(total_steps))
    warmup_steps = max(0, min(int(warmup_steps), total_steps - 1))

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / (warmup_steps + 1)
        t = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return min_factor + (1 - min_factor) * 0.5 * (1 + math.cos(math.pi * min(1.0, t)))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def atomic_torch_save(obj: Any, path: str | os.PathLike) -> Path:
    """``torch.save`` to a temporary file in the same folder, then ``os.replace`` (atomic)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


class AtomicCheckpoint:
    """Keeps ``best.pt`` (highest ``metric_name`` on the evaluator) and ``last.pt`` (each epoch).

    A checkpoint is ``{"state_dict", "epoch", "metric", **extra}``; ``extra`` carries what is
    needed to rebuild the model (architecture kwargs, bag parameters). Files are written
    atomically.
    """

    def __init__(self, directory: str | os.PathLike, network: nn.Module, metric_name: str = "val_auc",
                 extra: Mapping[str, Any] | None = None) -> None:
        self.dir = Path(directory)
        self.network = network
        self.metric_name = metric_name
        self.extra = dict(extra or {})
        self.best_metric = -math.inf
        self.best_epoch = 0

    @property
    def best_path(self) -> Path:
        return self.dir / "best.pt"

    @property
    def last_path(self) -> Path:
        return self.dir / "last.pt"

    def _payload(self, epoch: int, metric: float) -> dict:
        sd = {k: v.detach().cpu().clone() for k, v in self.network.state_dict().items()}
        return {"state_dict": sd, "epoch": int(epoch), "metric": float(metric), **self.extra}

    def attach(self, trainer, evaluator) -> None:
        from ignite.engine import Events

        def on_val(engine) -> None:
            value = float(engine.state.metrics.get(self.metric_name, float("nan")))
            epoch = trainer.state.epoch
            # first epoch always saved, then strictly better; NaN (one-class val split) never wins later
            if self.best_epoch == 0 or (not math.isnan(value) and value > self.best_metric):
                self.best_metric = value if not math.isnan(value) else -math.inf
                self.best_epoch = epoch
                atomic_torch_save(self._payload(epoch, value), self.best_path)

        def on_epoch(engine) -> None:
            atomic_torch_save(self._payload(engine.state.epoch, self.best_metric), self.last_path)

        evaluator.add_event_handler(Events.EPOCH_COMPLETED, on_val)
        trainer.add_event_handler(Events.EPOCH_COMPLETED, on_epoch)


class EpochMetricsLogger:
    """Sends per-epoch train loss / lr and validation metrics to a ``log(metrics, step)`` callable."""

    def __init__(self, log: Callable[[Mapping[str, float], int], None]) -> None:
        self.log = log
        self._losses: list[float] = []

    def _epoch_loss(self) -> float:
        # the validation runs inside the trainer's EPOCH_COMPLETED, possibly before _train: read the
        # losses of the epoch directly rather than a value _train may not have stored yet
        return float(np.mean(self._losses)) if self._losses else float("nan")

    def attach(self, trainer, evaluator) -> None:
        from ignite.engine import Events

        @trainer.on(Events.EPOCH_STARTED)
        def _reset(engine):
            self._losses = []

        @trainer.on(Events.ITERATION_COMPLETED)
        def _loss(engine):
            self._losses.append(float(engine.state.output["loss"]))

        @trainer.on(Events.EPOCH_COMPLETED)
        def _train(engine):
            lr = engine.optimizer.param_groups[0]["lr"]
            self.log({"train/loss": self._epoch_loss(), "train/lr": lr}, engine.state.epoch)

        @evaluator.on(Events.EPOCH_COMPLETED)
        def _val(engine):
            m = {f"val/{k[4:] if k.startswith('val_') else k}": v for k, v in engine.state.metrics.items()
                 if isinstance(v, (int, float))}
            self.log(m, trainer.state.epoch)
            if trainer.state.epoch:  # one progress line per epoch (the run's only console output while training)
                logger.info("epoch %d/%d  train loss %.4f  val AUC %.3f  ECE %.3f", trainer.state.epoch,
                            trainer.state.max_epochs, self._epoch_loss(),
                            m.get("val/auc", float("nan")), m.get("val/ece", float("nan")))


def _calibration_metric(n_bins: int):
    """``CalibrationMetrics`` attached as ``val_auc`` (key metric) that also fills ``val_ece/acc/nll``."""
    from monai.handlers import from_engine

    from lungcal.calibration.handlers import CalibrationMetrics

    return CalibrationMetrics(n_bins=n_bins, key="auc", prefix="val_", output_transform=from_engine(["pred", "label"]))


def build_evaluator(network: nn.Module, loader, *, device, n_bins: int = 10,
                    handlers: Sequence | None = None):
    """A ``SupervisedEvaluator`` with ``CalibrationMetrics``: key metric ``val_auc``, plus ``val_ece/acc/nll``."""
    from monai.engines import SupervisedEvaluator

    return SupervisedEvaluator(
        device=device,
        val_data_loader=loader,
        network=network,
        prepare_batch=MILPrepareBatch(),
        iteration_update=MILEvalStep(),
        key_val_metric={"val_auc": _calibration_metric(n_bins)},
        val_handlers=list(handlers or []),
        amp=False,
    )


def build_trainer(network: nn.Module, loader, evaluator, *, device, loss: nn.Module, epochs: int, lr: float,
                  weight_decay: float = 1e-4, warmup_epochs: float = 1.0, mixup_alpha: float = 0.0,
                  mixup_space: str = "input", seed: int = 0, handlers: Sequence | None = None):
    """A ``SupervisedTrainer`` (AdamW, warm-up + cosine per iteration, validation every epoch)."""
    from monai.engines import SupervisedTrainer
    from monai.handlers import LrScheduleHandler, ValidationHandler

    if epochs < 1:
        raise ConfigError(f"epochs must be >= 1, got {epochs}", field="epochs", fix="set epochs to 1 or more")
    opt = torch.optim.AdamW(network.parameters(), lr=lr, weight_decay=weight_decay)
    steps = len(loader)
    sched = warmup_cosine(opt, total_steps=epochs * steps, warmup_steps=int(round(warmup_epochs * steps)))
    train_handlers = [
        LrScheduleHandler(lr_scheduler=sched, epoch_level=False, print_lr=False),
        ValidationHandler(validator=evaluator, interval=1, epoch_level=True),
        *list(handlers or []),
    ]
    return SupervisedTrainer(
        device=device,
        max_epochs=int(epochs),
        train_data_loader=loader,
        network=network,
        optimizer=opt,
        loss_function=loss,
        prepare_batch=MILPrepareBatch(),
        iteration_update=MILTrainStep(mixup_alpha, mixup_space, seed=seed),
        train_handlers=train_handlers,
        amp=False,
    )


@torch.no_grad()
def predict(network: nn.Module, loader, device=None) -> dict[str, torch.Tensor]:
    """Run ``network`` over ``loader``: ``{"logits" (N, C), "labels" (N,), "attention" (N, K), "features"}``."""
    network.eval()
    out: dict[str, list] = {"logits": [], "labels": [], "attention": [], "features": []}
    for batch in loader:
        bags = batch["bag"].to(device) if device is not None else batch["bag"]
        mask = batch["mask"].to(bags.device)
        if hasattr(network, "forward_features"):  # one pass: pooled features + attention
            feats, att = network.forward_features(bags, mask)
            logits = network.head(feats)
        else:
            feats = network.features(bags, mask)
            logits, att = network(bags, mask)
        out["logits"].append(logits.float().cpu())
        out["attention"].append(att.float().cpu())
        out["features"].append(feats.float().cpu())
        out["labels"].append(batch["label"].long().cpu())
    return {k: torch.cat(v) if v else torch.empty(0) for k, v in out.items()}
