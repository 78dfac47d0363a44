"""Mixup: soft targets, Beta(α, α) λ, any shape, bag masks."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from lungcal.calibration.mixup import mixup, mixup_bags, sample_lambda


@pytest.mark.parametrize("alpha", [0.2, 1.0, 2.0])
def test_lambda_has_beta_mean_and_variance(alpha):
    g = torch.Generator().manual_seed(0)
    lam = np.array([sample_lambda(alpha, g) for _ in range(4000)])
    assert lam.min() >= 0 and lam.max() <= 1
    assert lam.mean() == pytest.approx(0.5, abs=0.02)
    assert lam.var() == pytest.approx(1 / (4 * (2 * alpha + 1)), rel=0.1)


@pytest.mark.parametrize("shape", [(16, 3, 8, 8), (16, 5), (16, 4, 1, 6, 6, 6)])
def test_mixup_any_shape_and_soft_targets(shape):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(*shape, generator=g)
    y = torch.randint(0, 3, (16,), generator=g)
    xm, ys, lam = mixup(x, y, 0.4, 3, generator=g)
    assert xm.shape == x.shape and ys.shape == (16, 3)
    torch.testing.assert_close(ys.sum(1), torch.ones(16))
    # x_mixed is λ x + (1-λ) x[perm] for a permutation recovered from the targets' partner
    flat, mflat = x.reshape(16, -1), xm.reshape(16, -1)
    partner = (mflat - lam * flat) / (1 - lam)
    d = torch.cdist(partner, flat)
    perm = d.argmin(1)
    assert torch.allclose(d.min(1).values, torch.zeros(16), atol=1e-3)
    assert sorted(perm.tolist()) == list(range(16))
    expect = lam * torch.eye(3)[y] + (1 - lam) * torch.eye(3)[y[perm]]
    torch.testing.assert_close(ys, expect)


def test_mixup_reproducible_and_alpha0():
    x, y = torch.randn(8, 4), torch.randint(0, 2, (8,))
    a = mixup(x, y, 1.0, 2, generator=torch.Generator().manual_seed(3))
    b = mixup(x, y, 1.0, 2, generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(a[0], b[0])
    assert a[2] == b[2]
    xm, ys, lam = mixup(x, y, 0.0, 2)
    assert lam == 1.0 and torch.equal(xm, x) and torch.equal(ys.argmax(1), y)


def test_mixup_bags_masks_and_padding():
    g = torch.Generator().manual_seed(4)
    bags = torch.rand(6, 5, 1, 4, 4, 4, generator=g) + 0.1
    mask = torch.rand(6, 5, generator=g) > 0.4
    mask[0] = False  # an empty bag (CT without candidates)
    bags = bags * mask.view(6, 5, 1, 1, 1, 1)
    y = torch.tensor([0, 1, 1, 0, 1, 0])
    bm, mm, ys, lam = mixup_bags(bags, mask, y, 1.0, 2, generator=g)
    assert 0 < lam < 1
    assert bm.shape == bags.shape and mm.dtype == torch.bool
    torch.testing.assert_close(ys.sum(1), torch.ones(6))
    assert (bm[~mm] == 0).all()  # padded slots stay zero
    # find the partner of each bag from the mask union and the blended values
    for i in range(6):
        cands = [j for j in range(6) if torch.equal(mm[i], mask[i] | mask[j])]
        ok = False
        for j in cands:
            both = mask[i] & mask[j]
            exp = torch.where(both.view(5, 1, 1, 1, 1), lam * bags[i] + (1 - lam) * bags[j],
                              bags[i] + bags[j])
            ok |= torch.allclose(bm[i], exp, atol=1e-6)
        assert ok, i
