"""Scripts are not a package: their tests load them by path; a small fake CIFAR-10-LT for them."""
from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

from cifar_baselines.bundle import run_bundle
from cifar_baselines.data import load_splits
from tests.cifar_baselines.cifar_fakes import write_fake_cifar

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "scripts"


def load_script(name: str) -> ModuleType:
    """``scripts/<name>.py`` as a module (its ``main`` is not run)."""
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def lt_data(tmp_path_factory):
    """``(folder, splits)`` of a small fake CIFAR-10-LT (imbalance 0.1, 5 validation images per class)."""
    folder = write_fake_cifar(tmp_path_factory.mktemp("fake_cifar"), n_train_per_class=40, n_test_per_class=8)
    return folder, load_splits("cifar10lt", data_dir=folder, imb_factor=0.1, val_per_class=5)


def tiny_stage1_run(bundle: str, folder: Path, tmp_path: Path, monkeypatch) -> tuple[str, str]:
    """``(run id, tracking URI)`` of a one-epoch ``bundles/<bundle>.json`` stage-1 run on the fake LT data."""
    monkeypatch.chdir(ROOT)
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    res = run_bundle(f"bundles/{bundle}.json", {
        "data_dir": str(folder), "output_dir": str(tmp_path), "tracking_uri": uri, "batch_size": 64,
        "n_bootstrap": 20, "val_per_class": 5, "epochs": 1, "warmup_epochs": 1, "lr_milestones": [1],
        "imb_factor": 0.1})
    return res["run_id"], uri
