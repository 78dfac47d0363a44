"""Run-time choices shared by the CT application (``lungcal.ctapp``) and ``cifar_baselines``: the torch device and
seeding.

One helper each, so that ``device: "auto"`` and ``seed`` mean the same thing in every bundle.
"""
from __future__ import annotations

import random

import numpy as np
import torch

__all__ = ["resolve_device", "seed_everything"]


def resolve_device(device: str | torch.device | None = "auto") -> torch.device:
    """``"auto"``/``None``/``""`` -> CUDA when available, else CPU; anything else as given."""
    if isinstance(device, torch.device):
        return device
    if device in (None, "", "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def seed_everything(seed: int) -> None:
    """Seed Python's, numpy's and torch's global generators (CPU and every CUDA device)."""
    random.seed(int(seed))
    np.random.seed(int(seed))
    torch.manual_seed(int(seed))
