import pytest
import torch

from cifar_baselines.batches import BatchIterator, augment_batch, normalize
from cifar_baselines.steps import TrainStep
from lungcal.calibration.mixup import mixup


def test_augment_batch_crops_and_flips_exactly():
    x = torch.arange(2 * 3 * 8 * 8, dtype=torch.int64).reshape(2, 3, 8, 8).to(torch.uint8)
    out = augment_batch(x, padding=2, flip=True, generator=torch.Generator().manual_seed(0))
    assert out.shape == x.shape and out.dtype == x.dtype
    padded = torch.nn.functional.pad(x, (2, 2, 2, 2))
    for i in range(2):  # each output is one of the 5x5x2 crops/flips of its own padded input
        cands = [padded[i, :, a:a + 8, b:b + 8] for a in range(5) for b in range(5)]
        cands += [c.flip(-1) for c in cands]
        assert any(torch.equal(out[i], c) for c in cands)


def test_augment_batch_is_random_and_seeded():
    x = torch.randint(0, 255, (64, 3, 32, 32), dtype=torch.uint8)
    a = augment_batch(x, generator=torch.Generator().manual_seed(1))
    b = augment_batch(x, generator=torch.Generator().manual_seed(1))
    c = augment_batch(x, generator=torch.Generator().manual_seed(2))
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert not torch.equal(a, x)
    assert torch.equal(augment_batch(x, padding=0, flip=False), x)


def test_normalize_matches_manual():
    x = torch.randint(0, 255, (4, 3, 32, 32), dtype=torch.uint8)
    mean = torch.tensor([0.4914, 0.4822, 0.4465]).view(1, 3, 1, 1)
    std = torch.tensor([0.2470, 0.2435, 0.2616]).view(1, 3, 1, 1)
    torch.testing.assert_close(normalize(x), (x.float() / 255 - mean) / std)


def test_batch_iterator_covers_epoch_and_balances():
    y = torch.tensor([0] * 90 + [1] * 10)
    x = torch.arange(100, dtype=torch.uint8).view(100, 1, 1, 1).expand(100, 3, 32, 32).contiguous()
    it = BatchIterator(x, y, 32)
    batches = list(it)
    seen = torch.cat([yb for _, yb in batches])
    assert len(it) == 4 and len(seen) == 100 and torch.equal(seen.sort().values, y.sort().values)
    xb, yb = batches[0]
    assert xb.dtype == torch.uint8 and xb.shape == (32, 3, 32, 32)
    assert torch.equal(y[xb[:, 0, 0, 0].long()], yb)  # images and labels gathered with one index
    assert torch.equal(torch.cat([b[0][:, 0, 0, 0] for b in BatchIterator(x, y, 30, sampler="sequential")]),
                       torch.arange(100, dtype=torch.uint8))
    bal = BatchIterator(x, y, 100, sampler="balanced", seed=0)
    ys = torch.cat([torch.cat([yb for _, yb in bal]) for _ in range(20)])
    assert 0.4 < ys.float().mean() < 0.6
    with pytest.raises(ValueError, match="sampler"):
        BatchIterator(x, y, 10, sampler="random")


# --- the device-independent sampling contract (issue 16, section 5) ---------------------------------
# Every random draw is made by a CPU generator, whatever device the data and the model are on; only
# index tensors move. PyTorch's "meta" device stands in for CUDA here: a tensor that is not on the CPU
# and whose values cannot be read, so a draw made on the data's device (or a CUDA generator handed to
# a CPU sampler) would fail or differ.

def test_every_sampling_generator_lives_on_the_cpu():
    x = torch.zeros(10, 3, 32, 32, dtype=torch.uint8, device="meta")
    y = torch.zeros(10, dtype=torch.long, device="meta")
    assert BatchIterator(x, y, 4).generator.device.type == "cpu"
    assert TrainStep(mixup_alpha=1.0).generator.device.type == "cpu"


@pytest.mark.parametrize("sampler", ["shuffle", "balanced"])
def test_batch_order_does_not_depend_on_the_data_device(sampler):
    y = torch.arange(40) % 4
    x = torch.zeros(40, 3, 32, 32, dtype=torch.uint8)
    cpu = BatchIterator(x, y, 8, sampler=sampler, seed=3)
    meta = BatchIterator(x.to("meta"), y, 8, sampler=sampler, seed=3)
    for _ in range(2):  # two epochs: the generators advance alike
        assert torch.equal(cpu.order(), meta.order())
    if sampler == "shuffle":  # (the balanced sampler reads the labels' values: meta tensors have none)
        yb = [b for _, b in BatchIterator(x.to("meta"), y.to("meta"), 8, sampler=sampler, seed=3)]
        assert len(yb) == 5 and all(b.device.type == "meta" for b in yb)


def test_augmentation_and_mixup_draws_do_not_depend_on_the_data_device():
    x = torch.randint(0, 255, (16, 3, 32, 32), dtype=torch.uint8)
    y = torch.arange(16) % 10
    g_cpu, g_meta = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    out = augment_batch(x.to("meta"), generator=g_meta)
    assert out.device.type == "meta" and out.shape == x.shape
    augment_batch(x, generator=g_cpu)
    assert torch.equal(g_cpu.get_state(), g_meta.get_state())  # the same draws were made
    xm, ym, lam_meta = mixup(normalize(x).to("meta"), y.to("meta"), 1.0, 10, generator=g_meta)
    _, y_soft, lam_cpu = mixup(normalize(x), y, 1.0, 10, generator=g_cpu)
    assert xm.device.type == "meta" and ym.device.type == "meta" and lam_meta == lam_cpu
    assert torch.equal(g_cpu.get_state(), g_meta.get_state()) and y_soft.shape == (16, 10)
