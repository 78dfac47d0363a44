import numpy as np
import pytest
import torch

from cifar_baselines.data import (BatchIterator, augment_batch, balanced_indices, cifar10_lt_counts,
                                  find_batches_dir, load_cifar10, lt_indices, make_splits, normalize)
from lungcal.errors import DataError


def test_lt_counts_match_ldam_mislas():
    c = cifar10_lt_counts(0.01)
    assert c[0] == 5000 and c[1] == 2997 and c[-1] == 50
    assert sum(c) == 12406
    assert c == sorted(c, reverse=True)
    assert cifar10_lt_counts(1.0) == [5000] * 10
    assert sum(cifar10_lt_counts(0.1)) == sum(int(5000 * 0.1 ** (i / 9)) for i in range(10))


def test_missing_folder_names_folder_and_fix(tmp_path):
    with pytest.raises(DataError) as e:
        load_cifar10(tmp_path / "nowhere")
    msg = str(e.value)
    assert "nowhere" in msg and "make_batches.py" in msg and "download" in msg


def test_incomplete_folder(tmp_path, fake_cifar):
    import shutil
    dst = tmp_path / "c" / "cifar-10-batches-py"
    shutil.copytree(find_batches_dir(fake_cifar), dst)
    (dst / "data_batch_3").unlink()
    with pytest.raises(DataError, match="data_batch_3"):
        find_batches_dir(tmp_path / "c")


def test_load_official_layout(fake_cifar):
    x, y = load_cifar10(fake_cifar, "train")
    assert x.shape == (400, 3, 32, 32) and x.dtype == np.uint8 and y.dtype == np.int64
    assert np.bincount(y).tolist() == [40] * 10
    xt, yt = load_cifar10(find_batches_dir(fake_cifar), "test")  # the batches folder itself works too
    assert xt.shape == (80, 3, 32, 32)


def test_lt_selection_is_seeded_and_follows_counts():
    labels = np.repeat(np.arange(10), 100)
    counts = cifar10_lt_counts(0.1, n_max=100)
    a, b, c = lt_indices(labels, counts, 0), lt_indices(labels, counts, 0), lt_indices(labels, counts, 1)
    assert np.array_equal(a, b) and not np.array_equal(a, c)
    assert np.bincount(labels[a], minlength=10).tolist() == counts


def test_balanced_indices_excludes():
    labels = np.repeat(np.arange(10), 20)
    excl = np.arange(0, 200, 2)
    v = balanced_indices(labels, 5, exclude=excl, seed=0)
    assert np.bincount(labels[v]).tolist() == [5] * 10
    assert not set(v) & set(excl)
    with pytest.raises(DataError, match="val_per_class"):
        balanced_indices(labels, 11, exclude=excl)


@pytest.mark.parametrize("dataset", ["cifar10", "cifar10lt"])
def test_splits_disjoint_and_val_balanced(fake_cifar, dataset):
    s = make_splits(fake_cifar, dataset, imb_factor=0.1, val_per_class=5, seed=0)
    assert torch.bincount(s.val_y, minlength=10).tolist() == [5] * 10
    assert len(s.test_y) == 80  # the test set is never touched
    assert s.class_counts == torch.bincount(s.train_y, minlength=10).tolist()
    # train and val images are disjoint (fake images are random, so equal rows mean equal images)
    tr = {bytes(r) for r in s.train_x.reshape(len(s.train_x), -1).numpy()}
    assert not any(bytes(r) in tr for r in s.val_x.reshape(len(s.val_x), -1).numpy())
    if dataset == "cifar10":
        assert s.class_counts == [35] * 10
    else:
        prof = cifar10_lt_counts(0.1, n_max=40)
        assert s.class_counts == [min(p, 35) for p in prof]
    again = make_splits(fake_cifar, dataset, imb_factor=0.1, val_per_class=5, seed=0)
    assert again.fingerprint == s.fingerprint and torch.equal(again.train_x, s.train_x)


def test_subset_is_stratified(fake_cifar):
    s = make_splits(fake_cifar, "cifar10", val_per_class=5, subset=100)
    assert 90 <= len(s.train_y) <= 110 and len(s.test_y) <= 80
    assert torch.bincount(s.train_y, minlength=10).min() >= 1


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
    same = augment_batch(x, padding=0, flip=False)
    assert torch.equal(same, x)


def test_normalize_matches_manual():
    x = torch.randint(0, 255, (4, 3, 32, 32), dtype=torch.uint8)
    mean = torch.tensor([0.4914, 0.4822, 0.4465]).view(1, 3, 1, 1)
    std = torch.tensor([0.2470, 0.2435, 0.2616]).view(1, 3, 1, 1)
    torch.testing.assert_close(normalize(x), (x.float() / 255 - mean) / std)


def test_batch_iterator_covers_epoch_and_balances():
    y = torch.tensor([0] * 90 + [1] * 10)
    x = torch.arange(100, dtype=torch.uint8).view(100, 1, 1, 1).expand(100, 3, 32, 32).contiguous()
    it = BatchIterator(x, y, 32, augment=False)
    seen = torch.cat([yb for _, yb in it])
    assert len(it) == 4 and len(seen) == 100 and torch.equal(seen.sort().values, y.sort().values)
    xb, _ = next(iter(it))
    assert xb.dtype == torch.float32 and xb.shape == (32, 3, 32, 32)
    bal = BatchIterator(x, y, 100, augment=False, sampler="balanced", seed=0)
    ys = torch.cat([torch.cat([yb for _, yb in bal]) for _ in range(20)])
    assert 0.4 < ys.float().mean() < 0.6
