from pathlib import Path

import pytest

from tests.cifar_baselines.cifar_fakes import write_fake_cifar


@pytest.fixture(scope="session")
def fake_cifar(tmp_path_factory) -> Path:
    """A tiny CIFAR-10 folder: 40 train / 8 test images per class."""
    return write_fake_cifar(tmp_path_factory.mktemp("fake_cifar"), n_train_per_class=40, n_test_per_class=8)
