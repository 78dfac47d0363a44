"""Tiny CIFAR-format folders for the cifar_baselines tests (official pickle layout), and a one-epoch run on them."""
from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np

from cifar_baselines.bundle import recipe_files, run_bundle

ROOT = Path(__file__).resolve().parents[2]


def write_fake_cifar(root: Path, n_train_per_class: int = 30, n_test_per_class: int = 8, seed: int = 0) -> Path:
    """Write ``root/cifar-10-batches-py`` with class-dependent colours (learnable), return ``root``."""
    rng = np.random.default_rng(seed)
    out = Path(root) / "cifar-10-batches-py"
    out.mkdir(parents=True, exist_ok=True)

    def images(labels):
        base = (np.asarray(labels)[:, None] * 25 + 10).astype(np.int64)  # class -> brightness
        x = rng.integers(0, 40, size=(len(labels), 3072)) + np.repeat(base, 3072, axis=1)
        return np.clip(x, 0, 255).astype(np.uint8)

    ytr = rng.permutation(np.repeat(np.arange(10), n_train_per_class))
    xtr = images(ytr)
    for b, part in enumerate(np.array_split(np.arange(len(ytr)), 5)):
        with open(out / f"data_batch_{b + 1}", "wb") as f:
            pickle.dump({b"data": xtr[part], b"labels": ytr[part].tolist(), b"batch_label": b"x"}, f, protocol=2)
    yte = rng.permutation(np.repeat(np.arange(10), n_test_per_class))
    with open(out / "test_batch", "wb") as f:
        pickle.dump({b"data": images(yte), b"labels": yte.tolist(), b"batch_label": b"t"}, f, protocol=2)
    with open(out / "batches.meta", "wb") as f:
        pickle.dump({b"label_names": [b"c%d" % i for i in range(10)]}, f, protocol=2)
    return Path(root)


def tiny_stage1_run(bundle: str, folder: Path, tmp_path: Path, monkeypatch) -> tuple[str, str]:
    """``(run id, tracking URI)`` of a one-epoch stage-1 run of the recipe ``bundle`` (``cifar10lt_focal``, over
    its base) on fake LT data in ``folder``."""
    monkeypatch.chdir(ROOT)
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    res = run_bundle(recipe_files(bundle), {
        "data_dir": str(folder), "output_dir": str(tmp_path), "tracking_uri": uri, "batch_size": 64,
        "n_bootstrap": 20, "val_per_class": 5, "epochs": 1, "warmup_epochs": 1, "lr_milestones": [1],
        "imb_factor": 0.1})
    return res["run_id"], uri
