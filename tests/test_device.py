"""lungcal.runtime: one meaning of ``device: auto`` and of ``seed`` everywhere."""
from __future__ import annotations

import random

import numpy as np
import torch

from lungcal.runtime import resolve_device, seed_everything


def test_resolve_device():
    want = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto").type == want
    assert resolve_device(None).type == want
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device(torch.device("cpu")) == torch.device("cpu")


def test_seed_everything_repeats_every_generator():
    seed_everything(7)
    a = (random.random(), np.random.rand(), torch.rand(1).item())
    seed_everything(7)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == a
