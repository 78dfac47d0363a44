"""Losses: focal == CE at gamma 0, FLSD-53 gammas, MiSLAS label-aware smoothing."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from lungcal.calibration.losses import (
    FocalLoss,
    FocalLossAdaptiveGamma,
    LabelAwareSmoothingLoss,
    las_epsilons,
    soft_cross_entropy,
)
from lungcal.errors import ConfigError

CIFAR10_LT = [5000, 2997, 1796, 1077, 645, 387, 232, 139, 83, 50]


@pytest.fixture
def batch():
    g = torch.Generator().manual_seed(0)
    z = torch.randn(32, 10, generator=g, dtype=torch.float64) * 2
    y = torch.randint(0, 10, (32,), generator=g)
    return z, y


def test_focal_gamma0_equals_ce(batch):
    z, y = batch
    torch.testing.assert_close(FocalLoss(0.0)(z, y), F.cross_entropy(z, y))
    torch.testing.assert_close(FocalLoss(0.0)(z, F.one_hot(y, 10).double()), F.cross_entropy(z, y))


def test_focal_matches_formula_and_soft_targets(batch):
    z, y = batch
    p = torch.softmax(z, 1)
    pt = p[torch.arange(32), y]
    ref = (-(1 - pt) ** 2 * pt.log())
    torch.testing.assert_close(FocalLoss(2.0, reduction="none")(z, y), ref)
    # soft targets = mixture of the per-class terms
    q = torch.rand(32, 10, dtype=torch.float64)
    q = q / q.sum(1, keepdim=True)
    ref_soft = -(q * (1 - p) ** 2 * p.log()).sum(1).mean()
    torch.testing.assert_close(FocalLoss(2.0)(z, q), ref_soft)
    # focal down-weights confident samples: never larger than CE
    assert (FocalLoss(3.0, reduction="none")(z, y) <= F.cross_entropy(z, y, reduction="none") + 1e-12).all()


def test_focal_alpha():
    z = torch.tensor([[0.3, -0.2], [1.0, 2.0]], dtype=torch.float64)
    y = torch.tensor([0, 1])
    ce = F.cross_entropy(z, y, reduction="none")
    torch.testing.assert_close(FocalLoss(0.0, alpha=0.25, reduction="none")(z, y),
                               ce * torch.tensor([0.75, 0.25], dtype=torch.float64))
    torch.testing.assert_close(FocalLoss(0.0, alpha=[2.0, 3.0], reduction="none")(z, y),
                               ce * torch.tensor([2.0, 3.0], dtype=torch.float64))
    with pytest.raises(ConfigError):
        FocalLoss(-1.0)


def test_flsd53_gamma_switch():
    # p_y below 0.2 -> gamma 5, else gamma 3
    z = torch.tensor([[0.0, 3.0, 0.0], [3.0, 0.0, 0.0]], dtype=torch.float64)
    y = torch.tensor([0, 0])
    pt = torch.softmax(z, 1)[:, 0]
    assert pt[0] < 0.2 < pt[1]
    ref = torch.stack([-(1 - pt[0]) ** 5 * pt[0].log(), -(1 - pt[1]) ** 3 * pt[1].log()])
    torch.testing.assert_close(FocalLossAdaptiveGamma(reduction="none")(z, y), ref)


def test_las_epsilons_cifar10lt_concave_as_mislas():
    eps = las_epsilons(CIFAR10_LT, 0.3, 0.0, "concave")
    expect = [0.300, 0.241, 0.158, 0.096, 0.056, 0.032, 0.017, 0.0085, 0.0031, 0.0]
    np.testing.assert_allclose(eps, expect, atol=6e-4)


def test_las_shapes_endpoints_and_order():
    for shape in ("concave", "linear", "convex"):
        eps = las_epsilons(CIFAR10_LT, 0.4, 0.1, shape)
        assert eps[0] == pytest.approx(0.4) and eps[-1] == pytest.approx(0.1)
        assert np.all(np.diff(eps) <= 1e-12)  # monotone in the counts
    lin, conc, conv = (las_epsilons(CIFAR10_LT, 0.4, 0.1, s) for s in ("linear", "concave", "convex"))
    assert np.all(conc[1:-1] > lin[1:-1]) and np.all(conv[1:-1] < lin[1:-1])
    assert np.allclose(las_epsilons([7, 7], 0.2, 0.0), 0.2)
    with pytest.raises(ConfigError):
        las_epsilons(CIFAR10_LT, 0.3, 0.0, "wavy")


def test_las_loss_equals_ce_with_smoothed_targets(batch):
    z, y = batch
    loss = LabelAwareSmoothingLoss(CIFAR10_LT, 0.3, 0.0, "concave")
    eps = torch.as_tensor(las_epsilons(CIFAR10_LT, 0.3, 0.0), dtype=torch.float64)[y]
    target = (1 - eps)[:, None] * F.one_hot(y, 10) + eps[:, None] / 10  # MiSLAS: mass over all K
    torch.testing.assert_close(loss(z, y), soft_cross_entropy(z, target), rtol=1e-6, atol=1e-6)
    # MiSLAS' forward, written out
    logp = F.log_softmax(z, 1)
    ref = ((1 - eps) * -logp[torch.arange(32), y] + eps * -logp.mean(1)).mean()
    torch.testing.assert_close(loss(z, y), ref, rtol=1e-6, atol=1e-6)
    # uniform smoothing 0 -> CE; one-hot soft targets == indices
    torch.testing.assert_close(LabelAwareSmoothingLoss([5, 5] * 5, 0.0, 0.0)(z, y), F.cross_entropy(z, y))
    torch.testing.assert_close(loss(z, F.one_hot(y, 10).double()), loss(z, y), rtol=1e-6, atol=1e-6)


def test_soft_cross_entropy(batch):
    z, y = batch
    torch.testing.assert_close(soft_cross_entropy(z, y), F.cross_entropy(z, y))
    q = torch.softmax(torch.randn(32, 10, dtype=torch.float64), 1)
    torch.testing.assert_close(soft_cross_entropy(z, q), F.cross_entropy(z, q))
