import pytest
import torch

from cifar_baselines.data import make_splits
from cifar_baselines.resnet import resnet32
from cifar_baselines.train import lr_at, make_criterion, predict, train_head_las_shift_bn, train_stage1
from lungcal.errors import ConfigError


def test_lr_schedule_warmup_and_steps():
    assert lr_at(0, 0.1, 5, (160, 180)) == pytest.approx(0.02)
    assert lr_at(2.5, 0.1, 5, (160, 180)) == pytest.approx(0.07)
    assert lr_at(5, 0.1, 5, (160, 180)) == pytest.approx(0.1)
    assert lr_at(159.9, 0.1, 5, (160, 180)) == pytest.approx(0.1)
    assert lr_at(160, 0.1, 5, (160, 180)) == pytest.approx(0.01)
    assert lr_at(199, 0.1, 5, (160, 180)) == pytest.approx(0.001)
    assert lr_at(0, 0.1, 0, (160, 180)) == pytest.approx(0.1)


def test_criterion_soft_and_hard_targets_agree():
    logits = torch.randn(6, 10)
    y = torch.randint(0, 10, (6,))
    onehot = torch.nn.functional.one_hot(y, 10).float()
    for m in ("ce", "focal"):
        c = make_criterion(m, 10, focal_gamma=2.0)
        torch.testing.assert_close(c(logits, y), c(logits, onehot))
    torch.testing.assert_close(make_criterion("ce", 10)(logits, y), torch.nn.functional.cross_entropy(logits, y))
    with pytest.raises(ConfigError, match="method"):
        make_criterion("bogus", 10)


@pytest.mark.parametrize("method", ["ce", "focal_mixup"])
def test_stage1_learns_fake_data(fake_cifar, method):
    torch.manual_seed(0)
    s = make_splits(fake_cifar, "cifar10", val_per_class=5)
    m = resnet32(10)
    seen = []
    train_stage1(m, s.train_x, s.train_y, method=method, epochs=3, batch_size=64, lr=0.05, warmup_epochs=1,
                 lr_milestones=[2], on_epoch=lambda e, st: seen.append(st), progress=False)
    assert [set(st) for st in seen] == [{"train/loss", "train/acc", "lr"}] * 3
    logits = predict(m, s.val_x, batch_size=16)
    assert logits.shape == (50, 10) and torch.isfinite(logits).all()
    assert seen[-1]["train/loss"] < seen[0]["train/loss"]  # it learns
    assert not m.training


def test_predict_features(fake_cifar):
    s = make_splits(fake_cifar, "cifar10", val_per_class=5)
    m = resnet32(10)
    logits, feats = predict(m, s.val_x, features=True, batch_size=7)
    assert feats.shape == (50, 64)
    torch.testing.assert_close(m.head(feats), logits, atol=1e-5, rtol=1e-5)


def test_las_shift_bn_only_head_and_bn_stats_change(fake_cifar):
    s = make_splits(fake_cifar, "cifar10lt", imb_factor=0.1, val_per_class=5)
    m = resnet32(10)
    new = train_head_las_shift_bn(m, s.train_x, s.train_y, s.class_counts, epochs=1, batch_size=32, progress=False)
    old_sd, new_sd = m.state_dict(), new.state_dict()
    for k, v in old_sd.items():
        changed = not torch.equal(v, new_sd[k])
        if k.startswith("head."):
            assert changed, k
        elif "running_mean" in k or "running_var" in k:
            continue  # shifted BN statistics
        elif "num_batches_tracked" in k:
            continue
        else:
            assert not changed, k
    assert any(not torch.equal(old_sd[k], new_sd[k]) for k in old_sd if "running_mean" in k)


def test_cpu_amp_is_bf16_for_training_only_and_only_with_native_bf16(monkeypatch):
    import cifar_baselines.train as tr

    cpu = torch.device("cpu")
    for native in (True, False):
        monkeypatch.setattr(tr, "cpu_has_native_bf16", lambda native=native: native)
        assert tr._autocast(cpu, True, training=True)[1] == (torch.bfloat16 if native else torch.float32)
        assert tr._autocast(cpu, True, training=False)[1] == torch.float32  # evaluation stays float32
        assert tr._autocast(cpu, False, training=True)[1] == torch.float32
    monkeypatch.setattr(tr, "cpu_has_native_bf16", lambda: True)
    torch.manual_seed(0)
    net = resnet32()
    x = torch.randint(0, 256, (4, 3, 32, 32), dtype=torch.uint8)
    logits = predict(net, x, amp=True, channels_last=False)
    assert logits.dtype == torch.float32 and torch.equal(logits, predict(net, x, amp=False, channels_last=False))
