"""Experiments are not a package (nothing imports ``experiments/``): their tests load them by path."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

from cifar_baselines.data import load_splits
from tests.cifar_baselines.cifar_fakes import write_fake_cifar

EXPERIMENTS = Path(__file__).resolve().parents[2] / "experiments"


def load_script(name: str) -> ModuleType:
    """``experiments/<name>.py`` as a module (its ``main`` is not run)."""
    spec = importlib.util.spec_from_file_location(name, EXPERIMENTS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses (and pickling) look their module up there
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def lt_data(tmp_path_factory):
    """``(folder, splits)`` of a small fake CIFAR-10-LT (imbalance 0.1, 5 validation images per class)."""
    folder = write_fake_cifar(tmp_path_factory.mktemp("fake_cifar"), n_train_per_class=40, n_test_per_class=8)
    return folder, load_splits("cifar10lt", data_dir=folder, imb_factor=0.1, val_per_class=5)
