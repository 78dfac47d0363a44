"""MC dropout and per-CT uncertainty (lungcal.ctapp.model.predict): seeded, eval-mode BatchNorm, exact at T = 0."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from lungcal.calibration import decompose_uncertainty
from lungcal.calibration.scaling import probabilities
from lungcal.ctapp.data.bagset import BagSet
from lungcal.ctapp.model.predict import (
    check_mc_samples,
    dropout_layers,
    ensemble_uncertainty,
    mc_dropout,
    mc_dropout_probs,
    predict,
    predict_uncertainty,
)
from lungcal.errors import ConfigError
from lungcal.mil import AttentionMIL, LogSumExpMIL, SmallCNNEncoder


def _model(dropout=0.5, head="lse", seed=0, tta=False):
    torch.manual_seed(seed)
    enc = SmallCNNEncoder(embed_dim=8, width=4)
    if head == "lse":
        net = LogSumExpMIL(enc, attn_dim=8, dropout=dropout, tta_flips=tta)
    else:
        net = AttentionMIL(enc, attn_dim=8, dropout=dropout, tta_flips=tta)
    net.train()
    with torch.no_grad():  # BatchNorm running statistics away from their defaults
        net(torch.rand(4, 3, 1, 8, 8, 8), torch.ones(4, 3, dtype=torch.bool))
    return net.eval()


def _loader(n=10, k=3, batch_size=4):
    g = torch.Generator().manual_seed(1)
    bags = torch.rand(n, k, 1, 8, 8, 8, generator=g)
    mask = torch.ones(n, k, dtype=torch.bool)
    mask[::3, -1] = False
    labels = torch.arange(n) % 2
    return torch.utils.data.DataLoader(BagSet(bags, mask, labels), batch_size=batch_size, shuffle=False)


def test_zero_samples_is_exactly_the_deterministic_prediction():
    net, loader = _model(), _loader()
    out = predict_uncertainty(net, loader, mc_samples=0)
    det = predict(net, loader)
    assert torch.equal(out["logits"], det["logits"])
    assert np.array_equal(out["probs"], probabilities(det["logits"]))  # bit for bit what stage 1 evaluates
    assert np.array_equal(out["mi"], np.zeros(10)) and out["samples"] is None
    assert np.allclose(out["entropy"], -(out["probs"] * np.log(out["probs"])).sum(1))


@pytest.mark.parametrize("head", ["lse", "attention"])
def test_mc_passes_differ_but_the_seeded_mean_is_reproducible(head):
    net, loader = _model(head=head, tta=head == "lse"), _loader()
    state = torch.random.get_rng_state()
    predict_uncertainty(net, loader, mc_samples=0)
    after_plain = torch.random.get_rng_state()  # (iterating a DataLoader draws its base seed)
    torch.random.set_rng_state(state)
    a = predict_uncertainty(net, loader, mc_samples=6, seed=3)
    assert torch.equal(torch.random.get_rng_state(), after_plain)  # the MC passes leave the global RNG alone
    b = predict_uncertainty(net, loader, mc_samples=6, seed=3)
    c = predict_uncertainty(net, loader, mc_samples=6, seed=4)
    assert a["samples"].shape == (6, 10, 2)
    assert not np.allclose(a["samples"][0], a["samples"][1])  # the passes differ
    assert np.array_equal(a["probs"], b["probs"]) and np.array_equal(a["mi"], b["mi"])  # seeded
    assert not np.array_equal(a["probs"], c["probs"])
    assert np.allclose(a["probs"], a["samples"].mean(0))
    assert np.all(a["mi"] > 0)
    dec = decompose_uncertainty(a["samples"])
    assert np.allclose(a["entropy"], dec["entropy"]) and np.allclose(a["mi"], dec["mi"])
    # logits = log of the mean: a temperature fitted on them acts on the MC mean
    assert np.allclose(torch.softmax(a["logits"], 1).numpy(), a["probs"])
    assert not net.training and all(not m.training for m in net.modules())  # modes restored


def test_batchnorm_stays_in_eval_mode_during_mc_passes():
    net, loader = _model(), _loader()
    bn = [m for m in net.modules() if isinstance(m, nn.BatchNorm3d)]
    stats = [(m.running_mean.clone(), m.running_var.clone(), int(m.num_batches_tracked)) for m in bn]
    seen = []
    hooks = [m.register_forward_hook(lambda mod, i, o: seen.append(mod.training)) for m in bn]
    with mc_dropout(net):
        assert all(m.training for _, m in dropout_layers(net))
        assert not any(m.training for m in bn)
    predict_uncertainty(net, loader, mc_samples=3, seed=0)
    for h in hooks:
        h.remove()
    assert seen and not any(seen)
    for m, (mean, var, n) in zip(bn, stats):
        assert torch.equal(m.running_mean, mean) and torch.equal(m.running_var, var)
        assert int(m.num_batches_tracked) == n


def test_one_pass_with_dropout_off_equals_plain_inference():
    net, loader = _model(dropout=0.0), _loader()
    batch = next(iter(loader))
    probs, att = mc_dropout_probs(net, batch["bag"], batch["mask"], 1)
    logits, att0 = net(batch["bag"], batch["mask"])
    assert torch.allclose(probs[0], torch.softmax(logits.double(), 1), atol=1e-12)
    assert torch.allclose(att[0], att0)


def test_head_only_sampling_equals_sampling_the_whole_network():
    net = _model()
    batch = next(iter(_loader()))
    torch.manual_seed(5)
    fast, _ = mc_dropout_probs(net, batch["bag"], batch["mask"], 4)  # the LSE model: encoder once, head 4 times
    torch.manual_seed(5)
    with mc_dropout(net), torch.no_grad():
        slow = torch.stack([torch.softmax(net(batch["bag"], batch["mask"])[0].double(), 1) for _ in range(4)])
    assert torch.allclose(fast, slow, atol=1e-12)


def test_mc_samples_without_dropout_or_negative_is_a_config_error():
    with pytest.raises(ConfigError, match="needs a network with dropout"):
        predict_uncertainty(_model(dropout=0.0), _loader(), mc_samples=5)
    with pytest.raises(ConfigError, match="integer >= 0"):
        check_mc_samples(_model(), -1)
    assert check_mc_samples(_model(dropout=0.0), 0) == 0


def test_ensemble_average_is_the_mean_of_the_members():
    loader = _loader()
    members = [predict_uncertainty(_model(seed=s), loader) for s in range(3)]
    ens = ensemble_uncertainty(members)
    assert np.allclose(ens["probs"], np.mean([m["probs"] for m in members], axis=0), atol=1e-15)
    assert ens["samples"].shape == (3, 10, 2) and np.all(ens["mi"] >= 0) and ens["mi"].max() > 0
    assert np.allclose(torch.softmax(ens["logits"], 1).numpy(), ens["probs"])
    other = dict(members[1], labels=torch.zeros(10, dtype=torch.long))
    with pytest.raises(ConfigError, match="different cases"):
        ensemble_uncertainty([members[0], other])
