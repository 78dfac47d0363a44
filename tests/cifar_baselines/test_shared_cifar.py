"""Real CIFAR-10 from ../shared: convert with make_batches.py (once per session), run a real bundle.

The conversion decodes 60,000 JPEGs (about a minute on a free core). It is part of the default
run, so CI (which has ../shared beside the checkout) exercises the real data path; without
../shared the tests skip and say why.
"""
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cifar_baselines.bundle import recipe_files, run_bundle
from cifar_baselines.data import cifar10_lt_counts, make_splits


@pytest.fixture(scope="session")
def real_cifar(shared_dir, tmp_path_factory):
    script = shared_dir / "data" / "cifar10" / "make_batches.py"
    if not script.is_file():
        pytest.skip(f"no shared CIFAR-10 converter at {script}")
    out = tmp_path_factory.mktemp("cifar10_real")
    subprocess.run([sys.executable, str(script), str(out)], check=True, capture_output=True)
    return out


def test_real_cifar_splits(real_cifar):
    s = make_splits(real_cifar, "cifar10lt", imb_factor=0.01)
    assert s.class_counts == [4500] + cifar10_lt_counts(0.01)[1:]
    assert len(s.test_y) == 10000 and torch.bincount(s.val_y).tolist() == [500] * 10
    b = make_splits(real_cifar, "cifar10")
    assert len(b.train_y) == 45000 and len(b.val_y) == 5000


def test_real_bundle_short_epoch(real_cifar, tmp_path, monkeypatch):
    monkeypatch.chdir(Path(__file__).resolve().parents[2])
    res = run_bundle(recipe_files("cifar10_ce"), {
        "data_dir": str(real_cifar), "output_dir": str(tmp_path), "tracking_uri": f"sqlite:///{tmp_path}/m.db",
        "epochs": 1, "subset": 512, "warmup_epochs": 1, "n_bootstrap": 20})
    assert 0.0 <= res["test"]["acc"] <= 1.0 and res["test"]["n"] > 400
    assert res["test_ts"]["acc"] == pytest.approx(res["test"]["acc"])
