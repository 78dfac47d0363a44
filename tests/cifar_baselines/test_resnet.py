import torch

from cifar_baselines.resnet import resnet32


def test_resnet32_parameter_count_is_he_et_al():
    assert sum(p.numel() for p in resnet32(10).parameters()) == 464154
    assert sum(p.numel() for p in resnet32(100).parameters()) == 464154 + 90 * 65


def test_features_head_split():
    m = resnet32(10).eval()
    x = torch.randn(3, 3, 32, 32)
    f = m.features(x)
    assert f.shape == (3, 64)
    assert isinstance(m.head, torch.nn.Linear)
    torch.testing.assert_close(m(x), m.head(f))
    cl = m(x.contiguous(memory_format=torch.channels_last))
    torch.testing.assert_close(cl, m(x), atol=1e-4, rtol=1e-4)


def test_option_a_shortcut_has_no_parameters():
    m = resnet32(10)
    blk = m.layer2[0]
    assert blk.downsample and blk.pad == 8
    x = torch.randn(2, 16, 32, 32)
    s = blk.shortcut(x)
    assert s.shape == (2, 32, 16, 16)
    torch.testing.assert_close(s[:, 8:24], x[:, :, ::2, ::2])
    assert s[:, :8].abs().sum() == 0 and s[:, 24:].abs().sum() == 0
