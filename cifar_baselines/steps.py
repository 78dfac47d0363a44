"""What one MONAI engine iteration does on CIFAR: the ``iteration_update`` of the trainer and evaluator.

- :class:`TrainStep` (``train#trainer``): crop/flip augmentation of the ``uint8`` batch,
  normalisation, channels_last, mixup (when ``mixup_alpha > 0``), the forward pass under AMP, the
  loss on float32 logits, backward and the optimiser step.
- :class:`EvalStep` (``validate#evaluator``) and :func:`predict`: normalisation and a float32
  forward pass, never autocast, so the logits that ECE and temperature scaling see are float32.

AMP (:func:`autocast_for`): on CUDA bf16 (fp16 with a grad scaler where bf16 is missing); on a CPU
with native bf16 instructions (:func:`cpu_has_native_bf16`) bf16 autocast for *training* steps,
about 1.8x faster for ResNet-32 on 2 cores. Weights, optimiser and loss stay float32.

Every random draw uses a CPU generator (see :mod:`cifar_baselines.batches`).

References:
    Zhang, Cisse, Dauphin, Lopez-Paz. "mixup: Beyond Empirical Risk Minimization." ICLR 2018.
    https://arxiv.org/abs/1710.09412
    Thulasidasan, Chennupati, Bilmes, Bhattacharya, Michalak. "On Mixup Training: Improved Calibration
    and Predictive Uncertainty for Deep Neural Networks." NeurIPS 2019. https://arxiv.org/abs/1905.11001
"""
from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

import torch
from ignite.metrics import Loss
from monai.handlers import from_engine
from monai.utils import CommonKeys

from cifar_baselines.batches import augment_batch, normalize
from lungcal.calibration.mixup import mixup

__all__ = ["cpu_has_native_bf16", "autocast_for", "training_precision", "prepare_images", "predict",
           "top_confidence", "epoch_loss_metric", "mean_confidence_metric", "TrainStep", "EvalStep"]


def cpu_has_native_bf16() -> bool:
    """Whether this CPU executes bf16 natively (``avx512_bf16`` or ``amx_bf16`` in /proc/cpuinfo).

    Without those instructions oneDNN emulates bf16 and autocast is slower than float32, so CPU AMP
    is used only where this is true (False off Linux)."""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("flags"):
                    return bool(set(line.split(":", 1)[1].split()) & {"avx512_bf16", "amx_bf16"})
    except OSError:
        pass
    return False


def autocast_for(device: torch.device | str, amp: bool, training: bool = False):
    """``(context, dtype)`` of a forward pass: CUDA AMP, CPU bf16 AMP for training steps, or none."""
    device = torch.device(device)
    if amp and device.type == "cuda":
        dtype = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.autocast("cuda", dtype=dtype), dtype
    if amp and training and device.type == "cpu" and cpu_has_native_bf16():
        return torch.autocast("cpu", dtype=torch.bfloat16), torch.bfloat16
    return contextlib.nullcontext(), torch.float32


def training_precision(device: torch.device | str, amp: bool) -> str:
    """The dtype a :class:`TrainStep` computes in on ``device`` (the ``train_precision`` param)."""
    return str(autocast_for(device, amp, training=True)[1]).replace("torch.", "")


def prepare_images(x_uint8: torch.Tensor, channels_last: bool = True) -> torch.Tensor:
    """``uint8`` batch -> normalised float32, in channels_last memory format if asked."""
    x = normalize(x_uint8)
    return x.contiguous(memory_format=torch.channels_last) if channels_last else x


@torch.no_grad()
def predict(network: torch.nn.Module, x_uint8: torch.Tensor, *, batch_size: int = 1000,
            channels_last: bool = True, features: bool = False):
    """Float32 logits ``(N, C)`` on the CPU of ``uint8`` images, in eval mode, no augmentation.

    Runs on the network's device, never under autocast. With ``features=True`` returns
    ``(logits, features (N, D))`` (the network must expose ``features`` and ``head``).
    """
    device = next(network.parameters()).device
    was_training = network.training
    network.eval()
    outs, feats = [], []
    for i in range(0, len(x_uint8), batch_size):
        xb = prepare_images(x_uint8[i:i + batch_size].to(device, non_blocking=True), channels_last)
        if features:
            split: Any = network  # a network with features() / head (cifar_baselines.resnet), not any Module
            f = split.features(xb)
            feats.append(f.float().cpu())
            outs.append(split.head(f).float().cpu())
        else:
            outs.append(network(xb).float().cpu())
    network.train(was_training)
    logits = torch.cat(outs) if outs else torch.empty(0)
    return (logits, torch.cat(feats)) if features else logits


def top_confidence(output: Mapping) -> torch.Tensor:
    """Max softmax probability per sample of an engine output's logits."""
    return torch.softmax(output[CommonKeys.PRED].float(), dim=1).amax(dim=1)


def epoch_loss_metric() -> Loss:
    """The epoch's sample-weighted mean of the step losses (read from the output, not recomputed)."""
    return Loss(lambda loss, _label: loss, output_transform=from_engine([CommonKeys.LOSS, CommonKeys.LABEL]))


def mean_confidence_metric() -> Loss:
    """The epoch's mean top-label confidence (ignite's sample-weighted ``Loss`` accumulator)."""
    return Loss(lambda conf, _label: conf.mean(),
                output_transform=lambda out: (top_confidence(out), out[CommonKeys.LABEL]))


class TrainStep:
    """``iteration_update`` of the CIFAR ``SupervisedTrainer``: augment, mix, forward under AMP, step.

    Args:
        num_classes: C, for mixup's soft targets.
        mixup_alpha: Beta(α, α) of input mixup; 0 trains on the plain (augmented) batch with
            class-index targets.
        augment: random crop (4-px zero padding) and horizontal flip.
        amp: autocast (:func:`autocast_for` with ``training=True``).
        cpu_amp: allow bf16 autocast on a CPU with native bf16 (the LAS stage turns it off, so
            the BatchNorm statistics it re-estimates are float32, as before).
        channels_last: memory format of the batch (the network must match).
        seed: seeds the CPU generator of augmentation and mixup.

    Returns (per iteration): ``{image, label, pred, loss}``; ``label`` is the un-mixed class index
    (training accuracy is measured against it), ``pred`` the logits.
    """

    def __init__(self, num_classes: int = 10, mixup_alpha: float = 0.0, augment: bool = True, amp: bool = True,
                 cpu_amp: bool = True, channels_last: bool = True, seed: int = 0) -> None:
        self.num_classes, self.mixup_alpha, self.augment = int(num_classes), float(mixup_alpha), augment
        self.amp, self.cpu_amp, self.channels_last = amp, cpu_amp, channels_last
        self.generator = torch.Generator().manual_seed(int(seed) + 1)  # CPU, whatever the model's device
        self._scaler: torch.amp.GradScaler | None = None

    def state_dict(self) -> dict:
        """The grad scaler's state (empty before the first step or without fp16); resume saves it."""
        return {"scaler": self._scaler.state_dict() if self._scaler is not None else {}}

    def load_state_dict(self, state: Mapping) -> None:
        if state.get("scaler"):
            self._scaler = torch.amp.GradScaler("cuda")
            self._scaler.load_state_dict(state["scaler"])

    def _autocast(self, device: torch.device):
        if device.type == "cpu" and not self.cpu_amp:
            return contextlib.nullcontext(), torch.float32
        return autocast_for(device, self.amp, training=True)

    def batch(self, x_uint8: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The network's input and the loss's target of one ``uint8`` batch, as a training step makes them.

        Crop and flip (when ``augment``), normalise, channels_last, then mixup (when ``mixup_alpha >
        0``: the target becomes soft, ``(B, C)``), drawing from :attr:`generator`. The step itself
        and ``experiments/precision_check.py`` both call this, so the check measures what training does.
        """
        x = augment_batch(x_uint8, generator=self.generator) if self.augment else x_uint8
        x = prepare_images(x, self.channels_last)
        if self.mixup_alpha > 0:
            x, target, _ = mixup(x, y, self.mixup_alpha, self.num_classes, generator=self.generator)
            return x, target
        return x, y

    def __call__(self, engine, batchdata) -> dict:
        x, y = engine.prepare_batch(batchdata, engine.state.device, engine.non_blocking)[:2]
        x, target = self.batch(x, y)
        ctx, dtype = self._autocast(x.device)
        if self._scaler is None:
            self._scaler = torch.amp.GradScaler("cuda", enabled=dtype == torch.float16)
        engine.network.train()
        with ctx:
            logits = engine.network(x)
        loss = engine.loss_function(logits.float(), target)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"non-finite loss at epoch {engine.state.epoch} iteration "
                                     f"{engine.state.iteration}: lower the learning rate")
        engine.optimizer.zero_grad(set_to_none=True)
        self._scaler.scale(loss).backward()
        self._scaler.step(engine.optimizer)
        self._scaler.update()
        return {CommonKeys.IMAGE: x, CommonKeys.LABEL: y, CommonKeys.PRED: logits.detach(),
                CommonKeys.LOSS: loss.detach()}


class EvalStep:
    """``iteration_update`` of the CIFAR ``SupervisedEvaluator``: normalise, float32 forward, no autocast."""

    def __init__(self, channels_last: bool = True) -> None:
        self.channels_last = channels_last

    def __call__(self, engine, batchdata) -> dict:
        x, y = engine.prepare_batch(batchdata, engine.state.device, engine.non_blocking)[:2]
        engine.network.eval()
        with torch.no_grad():
            logits = engine.network(prepare_images(x, self.channels_last)).float()
        return {CommonKeys.LABEL: y, CommonKeys.PRED: logits}
