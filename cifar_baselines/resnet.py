"""ResNet-32 for CIFAR (He et al. 2016, section 4.2), the network of the calibration study.

Three stages of five basic blocks with 16/32/64 channels, global average pooling and a linear
head. Shortcuts that change shape use "option A" (stride-2 subsampling plus zero-padded
channels, no parameters), so the 10-class model has exactly 464,154 parameters.

Like the MIL model of :mod:`lungcal.mil`, the network is split into ``features(x) -> (B, 64)`` and
``head`` (an ``nn.Linear``), so stage-2 code (temperature scaling on logits, label-aware smoothing
that retrains ``head`` alone) applies unchanged.

References:
    He, Zhang, Ren, Sun. "Deep Residual Learning for Image Recognition." CVPR 2016.
    https://arxiv.org/abs/1512.03385
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["BasicBlock", "CifarResNet", "resnet32"]


class BasicBlock(nn.Module):
    """Two 3x3 conv-BN layers with an identity / option-A shortcut."""

    expansion = 1

    def __init__(self, in_planes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = stride != 1 or in_planes != planes
        self.pad = (planes - in_planes) // 2

    def shortcut(self, x: torch.Tensor) -> torch.Tensor:
        """Option A: subsample by 2 and zero-pad the new channels on both sides."""
        if not self.downsample:
            return x
        return F.pad(x[:, :, ::2, ::2], (0, 0, 0, 0, self.pad, self.pad))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class CifarResNet(nn.Module):
    """CIFAR ResNet with ``features`` / ``head`` split.

    Args:
        num_blocks: basic blocks per stage (``(5, 5, 5)`` is ResNet-32).
        num_classes: output classes of the linear head.
    """

    def __init__(self, num_blocks: tuple[int, int, int] = (5, 5, 5), num_classes: int = 10) -> None:
        super().__init__()
        self.in_planes = 16
        self.conv1 = nn.Conv2d(3, 16, 3, stride=1, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(16)
        self.layer1 = self._make_layer(16, num_blocks[0], 1)
        self.layer2 = self._make_layer(32, num_blocks[1], 2)
        self.layer3 = self._make_layer(64, num_blocks[2], 2)
        self.feature_dim = 64
        self.head = nn.Linear(64, num_classes)
        for m in self.modules():
            if isinstance(m, (nn.Conv2d, nn.Linear)):
                nn.init.kaiming_normal_(m.weight)

    def _make_layer(self, planes: int, n: int, stride: int) -> nn.Sequential:
        layers = []
        for s in [stride] + [1] * (n - 1):
            layers.append(BasicBlock(self.in_planes, planes, s))
            self.in_planes = planes
        return nn.Sequential(*layers)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """Images ``(B, 3, 32, 32)`` -> pooled penultimate features ``(B, 64)``."""
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.layer3(self.layer2(self.layer1(out)))
        return out.mean(dim=(2, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Images ``(B, 3, 32, 32)`` -> logits ``(B, num_classes)``."""
        return self.head(self.features(x))


def resnet32(num_classes: int = 10) -> CifarResNet:
    """He et al. ResNet-32 for 32x32 inputs (464,154 parameters at 10 classes)."""
    return CifarResNet((5, 5, 5), num_classes)
