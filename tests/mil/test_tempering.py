"""Pooling temperature: T = 1 reproduces the network, the fit recovers a planted temperature, and the
per-candidate probabilities are the log-sum-exp posterior."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from lungcal.errors import ConfigError
from lungcal.mil import build_mil_model
from lungcal.mil.tempering import (
    PoolingView,
    fit_pooling_temperature,
    instance_probabilities,
    pooled_logits,
    pooling_view,
)

P = 8


def _loader(b=6, k=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    bags = torch.rand(b, k, 1, P, P, P, generator=g)
    mask = torch.ones(b, k, dtype=torch.bool)
    mask[1, 2:] = False
    mask[2] = False  # an all-empty bag
    labels = torch.tensor([0, 1] * (b // 2))
    return [{"bag": bags[:3], "mask": mask[:3], "label": labels[:3]},
            {"bag": bags[3:], "mask": mask[3:], "label": labels[3:]}], bags, mask


@pytest.mark.parametrize("head", ["lse", "noisy_or", "attention"])
@pytest.mark.parametrize("tta", [False, True])
def test_temperature_one_reproduces_the_network(head, tta):
    torch.manual_seed(0)
    net = build_mil_model("small", head, embed_dim=8, attn_dim=8, patch_size=P, tta_flips=tta).eval()
    loader, bags, mask = _loader()
    view = pooling_view(net, loader)
    with torch.no_grad():
        ref, _ = net(bags, mask)
    torch.testing.assert_close(pooled_logits(view, 1.0).float(), ref, atol=1e-5, rtol=1e-5)
    p = instance_probabilities(view)
    assert p.shape == tuple(mask.shape) and np.all(p[~mask.numpy()] == 0) and np.all((p >= 0) & (p <= 1))
    # a different temperature changes the bag logits of non-empty bags
    assert not torch.allclose(pooled_logits(view, 0.02)[0], pooled_logits(view, 1.0)[0], atol=1e-9, rtol=1e-9)


def _lse_view(n=3000, k=4, seed=0, true_t=2.0):
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(n, k, generator=g, dtype=torch.float64) * 2.5
    valid = torch.rand(n, k, generator=g) < 0.8
    view = PoolingView("lse", scores, valid, torch.zeros(n, dtype=torch.long),
                       torch.tensor(-1.0, dtype=torch.float64), torch.tensor(-1.5, dtype=torch.float64))
    p = torch.softmax(pooled_logits(view, true_t), 1)[:, 1]
    view.labels = (torch.rand(n, generator=g, dtype=torch.float64) < p).long()
    return view


def test_fit_recovers_a_planted_temperature():
    fit = fit_pooling_temperature(view=_lse_view(true_t=2.0))
    assert fit.temperature == pytest.approx(2.0, rel=0.15)
    assert fit.nll_after < fit.nll_before and not fit.at_bound
    assert fit_pooling_temperature(view=_lse_view(true_t=0.5, seed=1)).temperature == pytest.approx(0.5, rel=0.15)


def test_fit_on_a_network_and_loader_keeps_it_frozen():
    torch.manual_seed(0)
    net = build_mil_model("small", "lse", embed_dim=8, attn_dim=8, patch_size=P)
    before = {k: v.clone() for k, v in net.state_dict().items()}
    loader, _, _ = _loader()
    fit = fit_pooling_temperature(net, loader)
    assert fit.temperature > 0 and fit.nll_after <= fit.nll_before + 1e-12
    assert all(torch.equal(before[k], v) for k, v in net.state_dict().items())


def test_lse_instance_probabilities_are_the_posterior_shares():
    view = _lse_view(n=50)
    for t, bt in ((1.0, 1.0), (1.7, 1.0), (1.0, 2.5)):
        p = instance_probabilities(view, t, bag_temperature=bt)
        cancer = pooled_logits(view, t)[:, 1]
        p_bag = torch.sigmoid(cancer / bt).numpy()
        leak_share = torch.exp(view.leak / t - (cancer - view.bias)).numpy()
        np.testing.assert_allclose(p.sum(1) + p_bag * leak_share, p_bag, rtol=1e-10)
    # at T = 1: exp(b + a_k) * (1 - P(cancer)), the Bayes form of one cancer among the candidates
    cancer = pooled_logits(view, 1.0)[:, 1]
    ref = torch.exp(view.bias + view.scores) * torch.sigmoid(-cancer).unsqueeze(1) * view.valid
    np.testing.assert_allclose(instance_probabilities(view), ref.numpy(), rtol=1e-10, atol=1e-300)


def test_bad_inputs():
    with pytest.raises(ConfigError, match="temperature"):
        pooled_logits(_lse_view(n=10), 0.0)
    net = build_mil_model("small", "attention", embed_dim=8, attn_dim=8, patch_size=P)
    net.head = torch.nn.Sequential(torch.nn.Linear(8, 2))
    with pytest.raises(ConfigError, match="pooling temperature"):
        pooling_view(net, _loader()[0])
    assert math.isfinite(fit_pooling_temperature(view=_lse_view(n=40)).temperature)
