import shutil

import numpy as np
import pytest
import torch

from cifar_baselines import data
from cifar_baselines.data import (
    COPY_JPEG,
    COPY_JPEG_TWICE,
    COPY_OFFICIAL,
    COPY_UNVERIFIED,
    JPEG_TWICE_MARKER,
    balanced_indices,
    cifar10_lt_counts,
    data_copy,
    find_batches_dir,
    load_cifar10,
    load_splits,
    lt_indices,
    make_splits,
)
from lungcal.errors import ConfigError, DataError
from lungcal.tracking.tracker import privacy_filter


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


def test_load_splits_defaults_checks_and_device(fake_cifar, tmp_path, monkeypatch):
    monkeypatch.setattr(data, "SHARED_MAKE_BATCHES", tmp_path / "no_converter.py")
    s = load_splits("cifar10", data_dir=fake_cifar, val_per_class=5, device="cpu")
    assert s.train_x.device.type == "cpu"
    assert s.fingerprint == make_splits(fake_cifar, "cifar10", val_per_class=5).fingerprint
    with pytest.raises(ConfigError, match="dataset"):
        load_splits("cifar100", data_dir=fake_cifar)
    with pytest.raises(ConfigError, match="subset"):
        load_splits("cifar10", data_dir=fake_cifar, subset=5)
    with pytest.raises(DataError) as e:  # data_dir None: <output_dir>/data/cifar10, empty here
        load_splits("cifar10", output_dir=tmp_path)
    assert str(tmp_path / "data" / "cifar10") in str(e.value)


def test_the_copy_names_survive_the_privacy_filter_and_the_jpeg_copy_is_recognised(fake_cifar, tmp_path):
    """A run's data_copy param is logged as written (a name with a path in it would be hashed away)."""
    names = {"a": COPY_OFFICIAL, "b": COPY_JPEG, "c": COPY_UNVERIFIED, "d": COPY_JPEG_TWICE}
    assert privacy_filter(names) == names
    assert data_copy(fake_cifar) == COPY_UNVERIFIED
    folder = next(p for p in (fake_cifar / "cifar-10-batches-py", fake_cifar) if (p / "test_batch").is_file())
    (folder / "SOURCE_JPEG_COPY").write_text("converted by make_batches.py\n")
    try:
        assert data_copy(fake_cifar) == COPY_JPEG
        (folder / JPEG_TWICE_MARKER).write_text("re-encoded once more\n")  # a second pass beside the first marker
        assert data_copy(fake_cifar) == COPY_JPEG_TWICE
    finally:
        (folder / "SOURCE_JPEG_COPY").unlink()
        (folder / JPEG_TWICE_MARKER).unlink(missing_ok=True)
