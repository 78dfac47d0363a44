"""Instance encoders: one patch ``(1, P, P, P)`` -> one embedding ``(D,)``.

- ``kind="small"`` (default): a 3-stage strided 3D CNN (~1.5 M multiply-adds per 16^3 patch,
  ~60 k parameters), fast enough to train on a laptop CPU;
- ``kind="resnet10"``: MONAI's 3D ResNet-10 (``monai.networks.nets.resnet10``, randomly
  initialised, nothing is downloaded) followed by a linear projection to ``embed_dim``; meant for
  GPUs and larger patches.

Encoders only see the *valid* instances of a bag (see :class:`lungcal.mil.AttentionMIL`), so
BatchNorm statistics never include padding slots.
"""
from __future__ import annotations

import torch
from monai.networks.nets import resnet10
from torch import nn

from lungcal.errors import ConfigError
from lungcal.runtime.bundle_config import Described

__all__ = ["SmallCNNEncoder", "ResNetEncoder", "InstanceEncoder", "ENCODERS"]


def _block(cin: int, cout: int, stride: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv3d(cin, cout, kernel_size=3, stride=stride, padding=1, bias=False),
        nn.BatchNorm3d(cout),
        nn.ReLU(inplace=True),
    )


class SmallCNNEncoder(Described, nn.Module):
    """Small strided 3D CNN: ``(N, 1, P, P, P) -> (N, embed_dim)``.

    Three stride-2 conv-BN-ReLU blocks (``width``, ``2*width``, ``4*width`` channels), global
    average + max pooling, a linear projection and ReLU.
    """

    def __init__(self, embed_dim: int = 64, width: int = 16, in_channels: int = 1) -> None:
        super().__init__()
        self.embed_dim = embed_dim
        self.features = nn.Sequential(
            _block(in_channels, width, 2),
            _block(width, 2 * width, 2),
            _block(2 * width, 4 * width, 2),
        )
        self.proj = nn.Sequential(nn.Linear(8 * width, embed_dim), nn.ReLU(inplace=True))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.features(x)
        h = torch.cat([h.mean(dim=(2, 3, 4)), h.amax(dim=(2, 3, 4))], dim=1)
        return self.proj(h)


class ResNetEncoder(Described, nn.Module):
    """MONAI 3D ResNet-10 trunk (no classifier) + linear projection: ``(N, 1, P, P, P) -> (N, D)``."""

    def __init__(self, embed_dim: int = 64, in_channels: int = 1) -> None:
        super().__init__()
        self.embed_dim = embed_dim
        self.trunk = resnet10(pretrained=False, spatial_dims=3, n_input_channels=in_channels, feed_forward=False)
        self.proj = nn.Sequential(nn.Linear(512, embed_dim), nn.ReLU(inplace=True))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.trunk(x).flatten(1))


ENCODERS = {"small": SmallCNNEncoder, "resnet10": ResNetEncoder}


def InstanceEncoder(kind: str = "small", embed_dim: int = 64, **kwargs) -> nn.Module:  # noqa: N802 (factory)
    """Build an instance encoder by name (``"small"`` or ``"resnet10"``)."""
    if kind not in ENCODERS:
        raise ConfigError(f"unknown encoder {kind!r}", field="encoder", fix=f"use one of {sorted(ENCODERS)}")
    return ENCODERS[kind](embed_dim=embed_dim, **kwargs)
