"""MMCE (Kumar, Sarawagi & Jain 2018): the torch estimator against a direct O(n^2) numpy loop of the
paper's formulas, ~0 for calibrated predictions, larger for overconfident ones, and the loss wrapper."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from lungcal.calibration.losses import FocalLoss, MMCELoss, mmce_squared
from lungcal.errors import ConfigError


def _reference(p1: np.ndarray, y: np.ndarray, weighted: bool, normalize: str = "weights", width: float = 0.4):
    """The paper's estimators written out pair by pair (binary: r = max(p, 1 - p), c = [argmax == y])."""
    r = np.maximum(p1, 1 - p1)
    c = ((p1 > 0.5).astype(int) == y).astype(float)
    m = len(r)

    def k(a, b):
        return math.exp(-abs(a - b) / width)

    if not weighted:
        return sum((c[i] - r[i]) * (c[j] - r[j]) * k(r[i], r[j]) for i in range(m) for j in range(m)) / m ** 2
    cor = [i for i in range(m) if c[i] == 1]
    wrong = [i for i in range(m) if c[i] == 0]
    if normalize == "counts":
        nc, nw = len(cor), len(wrong)
    else:
        nc, nw = sum(1 - r[i] for i in cor), sum(r[j] for j in wrong)
    cc = sum((1 - r[i]) * (1 - r[j]) * k(r[i], r[j]) for i in cor for j in cor)
    ww = sum(r[i] * r[j] * k(r[i], r[j]) for i in wrong for j in wrong)
    cw = sum((1 - r[i]) * r[j] * k(r[i], r[j]) for i in cor for j in wrong)
    return cc / nc ** 2 + ww / nw ** 2 - 2 * cw / (nc * nw)


def _logits(p1: np.ndarray) -> torch.Tensor:
    """2-logit rows whose softmax gives (1 - p1, p1)."""
    return torch.stack([torch.zeros(len(p1), dtype=torch.float64), torch.logit(torch.as_tensor(p1))], 1)


def _draw(n: int, seed: int, overconfident: bool):
    rng = np.random.default_rng(seed)
    p_true = rng.uniform(0.02, 0.98, n)
    y = (rng.random(n) < p_true).astype(int)
    if not overconfident:
        return p_true, y
    z = np.log(p_true / (1 - p_true)) * 3.0  # logits three times too large
    return 1 / (1 + np.exp(-z)), y


@pytest.mark.parametrize("weighted,normalize", [(False, "weights"), (True, "weights"), (True, "counts")])
def test_matches_the_pairwise_formula(weighted, normalize):
    p1, y = _draw(60, 1, overconfident=True)
    got = mmce_squared(_logits(p1), torch.as_tensor(y), weighted=weighted, normalize=normalize)
    assert float(got) == pytest.approx(_reference(p1, y, weighted, normalize), rel=1e-9, abs=1e-12)


def test_near_zero_when_calibrated_and_larger_when_overconfident():
    p_cal, y_cal = _draw(1500, 2, overconfident=False)
    p_over, y_over = _draw(1500, 2, overconfident=True)
    for weighted in (False, True):
        cal = math.sqrt(float(mmce_squared(_logits(p_cal), torch.as_tensor(y_cal), weighted=weighted)))
        over = math.sqrt(float(mmce_squared(_logits(p_over), torch.as_tensor(y_over), weighted=weighted)))
        assert cal < 0.05, (weighted, cal)  # sampling noise only: 0.009 / 0.037 here, -> 0 as n grows
        assert over > 5 * cal and over > 0.1, (weighted, cal, over)
    # the count-normalised weighted estimate (the authors' code) is not ~0 on calibrated data at accuracy != 1/2
    counts = math.sqrt(float(mmce_squared(_logits(p_cal), torch.as_tensor(y_cal), weighted=True, normalize="counts")))
    assert counts > 0.2


def test_loss_is_base_plus_lambda_mmce_and_has_gradients():
    p1, y = _draw(32, 3, overconfident=True)
    z = _logits(p1).clone().requires_grad_(True)
    t = torch.as_tensor(y)
    loss = MMCELoss(lam=2.0)(z, t)
    expected = F.cross_entropy(z, t) + 2.0 * torch.sqrt(mmce_squared(z, t, weighted=True) + 1e-10)
    torch.testing.assert_close(loss, expected)
    loss.backward()
    assert torch.isfinite(z.grad).all() and z.grad.abs().sum() > 0
    focal = FocalLoss(2.0)
    torch.testing.assert_close(MMCELoss(focal, lam=0.0)(z, t), focal(z, t))
    # soft targets: one-hot rows give the index-target value
    torch.testing.assert_close(MMCELoss(lam=1.0)(z, F.one_hot(t, 2).double()), MMCELoss(lam=1.0)(z, t))


def test_one_sided_batch_and_bad_settings():
    z = _logits(np.array([0.9, 0.8, 0.2]))
    assert float(mmce_squared(z, torch.tensor([1, 1, 0]), weighted=True)) == 0.0  # all correct
    with pytest.raises(ConfigError, match="kernel_width"):
        MMCELoss(kernel_width=0.0)
    with pytest.raises(ConfigError, match="lam"):
        MMCELoss(lam=-1.0)
    with pytest.raises(ConfigError, match="normalize"):
        MMCELoss(normalize="mean")
