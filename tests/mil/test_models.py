"""MIL models: shapes, mask semantics, permutation invariance, empty bags, noisy-OR."""
from __future__ import annotations

import pytest
import torch

from lungcal.calibration.las import retrain_head_las
from lungcal.ctapp.model.heads import apply_head
from lungcal.errors import ConfigError
from lungcal.mil import (
    AttentionMIL,
    GatedAttentionPool,
    LogSumExpHead,
    NoisyORMIL,
    SmallCNNEncoder,
    build_mil_model,
    masked_softmax,
)

P = 12


def _bags(b=3, k=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    bags = torch.rand(b, k, 1, P, P, P, generator=g)
    mask = torch.ones(b, k, dtype=torch.bool)
    mask[1, 3:] = False
    mask[2] = False  # all-empty bag
    return bags, mask


@pytest.fixture(params=[("small", "attention"), ("small", "noisy_or"), ("small", "lse"), ("resnet10", "attention")])
def model(request):
    torch.manual_seed(0)
    enc, head = request.param
    return build_mil_model(enc, head, embed_dim=16, patch_size=P).eval()


def test_shapes_and_no_nan(model):
    bags, mask = _bags()
    logits, att = model(bags, mask)
    assert logits.shape == (3, 2) and att.shape == (3, 5)
    assert torch.isfinite(logits).all() and torch.isfinite(att).all()
    assert (att[~mask] == 0).all()
    f = model.features(bags, mask)
    assert f.shape[0] == 3
    torch.testing.assert_close(model.head(f), logits)
    logits.sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_masked_instances_change_nothing(model):
    bags, mask = _bags()
    logits, att = model(bags, mask)
    noisy = bags.clone()
    noisy[~mask] = torch.randn_like(noisy[~mask]) * 100
    l2, a2 = model(noisy, mask)
    torch.testing.assert_close(l2, logits)
    torch.testing.assert_close(a2, att)
    # a bag with its padding removed gives the same output as alone
    l3, _ = model(bags[1:2, :3], mask[1:2, :3])
    torch.testing.assert_close(l3, logits[1:2], rtol=1e-5, atol=1e-5)


def test_masked_instances_do_not_leak_into_batchnorm_in_training():
    torch.manual_seed(0)
    m = build_mil_model("small", embed_dim=8, patch_size=P).train()
    bags, mask = _bags()
    l1, _ = m(bags, mask)
    noisy = bags.clone()
    noisy[~mask] = 50.0
    torch.manual_seed(0)
    m2 = build_mil_model("small", embed_dim=8, patch_size=P).train()
    l2, _ = m2(noisy, mask)
    torch.testing.assert_close(l1, l2)


def test_permutation_invariance(model):
    bags, mask = _bags()
    perm = torch.tensor([4, 2, 0, 3, 1])
    l1, a1 = model(bags, mask)
    l2, a2 = model(bags[:, perm], mask[:, perm])
    torch.testing.assert_close(l2, l1, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(a2, a1[:, perm], rtol=1e-5, atol=1e-5)


def test_attention_sums_to_one_on_non_empty_bags_and_empty_bag_gives_bias():
    torch.manual_seed(0)
    m = build_mil_model("small", embed_dim=8, patch_size=P).eval()
    bags, mask = _bags()
    logits, att = m(bags, mask)
    torch.testing.assert_close(att[:2].sum(1), torch.ones(2))
    assert (att[2] == 0).all()
    torch.testing.assert_close(logits[2], m.head.bias)
    assert (m.features(bags, mask)[2] == 0).all()


def test_masked_softmax_gradients_are_finite_for_empty_rows():
    s = torch.randn(2, 4, requires_grad=True)
    mask = torch.tensor([[True, False, True, False], [False] * 4])
    out = masked_softmax(s, mask)
    torch.testing.assert_close(out[0, [0, 2]].sum(), torch.tensor(1.0))
    assert (out[1] == 0).all() and (out[0, [1, 3]] == 0).all()
    (out * torch.arange(4.0)).sum().backward()
    assert torch.isfinite(s.grad).all()


def test_feature_mixup_path_matches_forward():
    torch.manual_seed(0)
    m = build_mil_model("small", embed_dim=8, patch_size=P).eval()
    bags, mask = _bags()
    z, att = m.forward_features(bags, mask)
    logits, att2 = m(bags, mask)
    torch.testing.assert_close(m.head(z), logits)
    lam = 0.3
    mixed = m.head(lam * z + (1 - lam) * z.flip(0))
    assert mixed.shape == (3, 2)


def test_noisy_or_probability_formula():
    torch.manual_seed(0)
    m = build_mil_model("small", "noisy_or", embed_dim=8, patch_size=P).eval()
    bags, mask = _bags()
    logits, p_inst = m(bags, mask)
    leak = torch.sigmoid(m.head.leak_logit)
    prod = torch.where(mask, 1 - p_inst, torch.ones_like(p_inst)).prod(1)
    p = 1 - (1 - leak) * prod
    torch.testing.assert_close(torch.softmax(logits, 1)[:, 1], p, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(logits.exp().sum(1), torch.ones(3), rtol=1e-5, atol=1e-6)
    # the empty bag's probability is the leak
    torch.testing.assert_close(torch.softmax(logits, 1)[2, 1], leak, rtol=1e-5, atol=1e-7)
    # probability grows when an instance is added
    m2 = torch.ones(1, 5, dtype=torch.bool)
    m1 = m2.clone()
    m1[0, 4] = False
    assert m(bags[:1], m2)[0][0, 1] >= m(bags[:1], m1)[0][0, 1]


def test_components_and_factory_errors():
    enc = SmallCNNEncoder(embed_dim=8)
    m = AttentionMIL(enc, GatedAttentionPool(8, 4))
    assert isinstance(m.head, torch.nn.Linear)
    assert isinstance(build_mil_model(head="noisy_or", embed_dim=8), NoisyORMIL)
    for kw in ({"encoder": "vit"}, {"head": "max"}, {"patch_size": 4}):
        with pytest.raises(ConfigError):
            build_mil_model(**kw)
    with pytest.raises(ValueError):
        m(torch.rand(2, 3, 1, P, P, P), torch.ones(2, 4, dtype=torch.bool))


@pytest.mark.parametrize("head", ["attention", "noisy_or", "lse"])
def test_tta_flips_is_eval_only_flip_invariant_and_the_mean_of_the_8_flips(head):
    torch.manual_seed(0)
    bags, mask = _bags(b=4, k=5)
    plain = build_mil_model(head=head, patch_size=bags.shape[-1], tta_flips=False)
    tta = build_mil_model(head=head, patch_size=bags.shape[-1], tta_flips=True)
    tta.load_state_dict(plain.state_dict())
    plain.eval(), tta.eval()
    with torch.no_grad():
        logits, att = tta(bags, mask)
        # exactly invariant to any flip of the patch axes (the group maps onto itself)
        flipped_logits, flipped_att = tta(bags.flip([-1, -3]), mask)
        assert torch.allclose(logits, flipped_logits, atol=1e-5)
        assert torch.allclose(att, flipped_att, atol=1e-5)
        # and, for the linear attention head, it is the mean of the 8 single-orientation logits
        flips = [[d for d in (-3, -2, -1) if (f >> (d + 3)) & 1] for f in range(8)]
        singles = torch.stack([plain(bags.flip(f) if f else bags, mask)[0] for f in flips])
        if head == "attention":
            assert torch.allclose(logits, singles.mean(0), atol=1e-5)
        assert not torch.allclose(plain(bags.flip([-1]), mask)[0], plain(bags, mask)[0], atol=1e-5)
        assert (att[~mask] == 0).all()
    # training sees one orientation: identical to the plain model
    plain.train(), tta.train()
    torch.manual_seed(1)
    a = plain(bags, mask)[0]
    torch.manual_seed(1)
    b = tta(bags, mask)[0]
    assert torch.allclose(a, b)


def test_log_sum_exp_head_is_a_sum_of_odds_that_counts():
    torch.manual_seed(0)
    head = LogSumExpHead(6, attn_dim=4).eval()
    with torch.no_grad():
        head.bias.fill_(0.3)
        head.leak.fill_(-1.5)
    h = torch.randn(2, 4, 6)
    valid = torch.tensor([[True, True, False, False], [False, False, False, False]])
    feats = torch.cat([h, valid.float().unsqueeze(-1)], -1)
    with torch.no_grad():
        logits, att = head.forward_with_probs(feats)
        a = head.gate.scores(h)
    expected = 0.3 + torch.log(torch.exp(torch.tensor(-1.5)) + torch.exp(a[0, :2]).sum())
    assert torch.allclose(logits[0], torch.stack([torch.zeros(()), expected]), atol=1e-5)
    assert torch.allclose(logits[1], torch.tensor([0.0, 0.3 - 1.5]), atol=1e-6)  # empty bag: bias + leak
    assert torch.allclose(att[0, :2], torch.softmax(a[0, :2], 0)) and (att[0, 2:] == 0).all() and (att[1] == 0).all()
    # a second copy of the same candidate raises the cancer logit (softmax pooling could not tell)
    two = feats.clone()
    two[0, 2] = two[0, 0]
    with torch.no_grad():
        assert head(two)[0, 1] > logits[0, 1]


def test_las_retrains_a_per_instance_head_on_3d_features():
    torch.manual_seed(0)
    model = build_mil_model(head="lse", embed_dim=8, patch_size=P).eval()
    bags, mask = _bags(b=6, k=5)
    with torch.no_grad():
        feats = model.features(bags, mask)
    assert feats.shape == (6, 5, 9)
    labels = torch.tensor([0, 1, 0, 1, 0, 1])
    new = retrain_head_las(model.head, feats, labels, [3, 3], smooth_head=0.1, smooth_tail=0.0, epochs=2, batch_size=4)
    assert new is not model.head and new(feats).shape == (6, 2)
    # the candidate weights of a LAS run come from the retrained scorer, not from stage 1
    with torch.no_grad():
        _, stage1_att = model(bags, mask)
    logits, att = apply_head(new, feats, stage1_att)
    assert torch.equal(logits, new(feats)) and torch.equal(att, new.forward_with_probs(feats)[1])
    assert not torch.allclose(att, stage1_att)
    assert torch.allclose(att.sum(1), mask.any(1).float()) and (att[~mask] == 0).all()


def test_apply_head_keeps_the_pool_weights_of_an_attention_model():
    model = build_mil_model(head="attention", embed_dim=8, patch_size=P).eval()
    bags, mask = _bags(b=3, k=4)
    with torch.no_grad():
        pooled, att = model.forward_features(bags, mask)
    logits, same = apply_head(model.head, pooled, att)
    assert same is att and torch.equal(logits, model(bags, mask)[0])


@pytest.mark.parametrize("head", ["attention", "lse", "noisy_or"])
def test_models_are_scriptable_and_the_script_computes_the_same(head):
    """``python -m monai.bundle ckpt_export`` scripts ``network_def``: every MIL model must stay scriptable."""
    torch.manual_seed(0)
    model = build_mil_model(head=head, embed_dim=8, patch_size=P, tta_flips=True).eval()
    scripted = torch.jit.script(model)
    bags, mask = torch.rand(3, 4, 1, P, P, P), torch.rand(3, 4) > 0.3
    mask[1] = False
    with torch.no_grad():
        for got, want in zip(scripted(bags, mask), model(bags, mask)):
            assert torch.equal(got, want)
