"""experiments/jpeg_bound.py: one more JPEG q75 pass over the CIFAR copy, and its data folder."""
from __future__ import annotations

import pickle

import numpy as np
import pytest

from cifar_baselines.data import COPY_JPEG_TWICE, data_copy, load_cifar10
from tests.cifar_baselines.cifar_fakes import write_fake_cifar
from tests.experiments.conftest import load_script


@pytest.fixture(scope="module")
def script():
    return load_script("jpeg_bound")


def clean_images(n: int = 6, seed: int = 0) -> np.ndarray:
    """Smooth colour gradients with an edge and a little noise, ``uint8 (n, 3, 32, 32)``: JPEG-like content."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:32, 0:32] / 31.0
    out = np.empty((n, 3, 32, 32), dtype=np.uint8)
    for i in range(n):
        for c in range(3):
            a, b, f = rng.uniform(40, 200), rng.uniform(-60, 60), rng.uniform(1, 4)
            img = a + b * xx * yy + 30 * np.sin(f * np.pi * (xx + c * yy)) + 50 * (xx > rng.uniform(0.3, 0.7))
            out[i, c] = np.clip(img + rng.normal(0, 4, img.shape), 0, 255).astype(np.uint8)
    return out


def test_a_jpeg_pass_keeps_shape_and_dtype_is_deterministic_and_degrades_plausibly(script):
    x = clean_images()
    y = script.jpeg_pass(x)
    assert y.shape == x.shape and y.dtype == np.uint8
    assert np.array_equal(y, script.jpeg_pass(x))  # deterministic
    assert 20 < script.psnr(x, y) < 45
    assert np.all((script.psnr_per_image(x, y) > 20) & (script.psnr_per_image(x, y) < 45))
    with pytest.raises(ValueError, match="uint8"):
        script.jpeg_pass(x.astype(np.float32))


def test_a_second_pass_on_the_same_grid_changes_less_than_the_first_and_a_shifted_one_more(script):
    x = clean_images()
    once = script.jpeg_pass(x)
    twice = script.jpeg_pass(once)
    first, second = script.psnr(x, once), script.psnr(once, twice)
    assert second > first + 6  # re-quantising with the same tables on the same grid is close to a fixed point
    shifted = script.jpeg_pass(once, shift=4)
    assert shifted.shape == x.shape
    assert script.psnr(once, shifted) < second - 6  # blocks straddling the first pass's: a fresh error


def test_the_second_pass_folder_is_named_as_such_keeps_labels_and_is_written_once(script, tmp_path):
    src = write_fake_cifar(tmp_path / "src", n_train_per_class=2, n_test_per_class=1)
    rec = script.write_second_pass(src, tmp_path / "twice")
    assert data_copy(tmp_path / "twice") == COPY_JPEG_TWICE
    for split in ("train", "test"):
        (xa, ya), (xb, yb) = load_cifar10(src, split), load_cifar10(tmp_path / "twice", split)
        assert np.array_equal(ya, yb) and xa.shape == xb.shape and not np.array_equal(xa, xb)
    assert {"psnr_all_db", "psnr_test_db", "grid_shift_px"} <= set(rec)
    folder = tmp_path / "twice" / "cifar-10-batches-py"
    stamp = (folder / "test_batch").stat().st_mtime_ns
    assert script.write_second_pass(src, tmp_path / "twice") == rec  # idempotent: kept, not rewritten
    assert (folder / "test_batch").stat().st_mtime_ns == stamp
    with open(folder / "test_batch", "rb") as f:
        assert b"batch_label" in pickle.load(f, encoding="bytes")


def test_the_schedule_scales_the_bundles_warmup_and_milestones(script):
    assert script.schedule(200) == {"epochs": 200, "warmup_epochs": 5, "lr_milestones": [160, 180]}
    assert script.schedule(40) == {"epochs": 40, "warmup_epochs": 1, "lr_milestones": [32, 36]}
    assert script.schedule(2)["lr_milestones"] == [2, 3]  # distinct milestones however short
    cmd = script.arm_command(script.Path("runs/x"), "q75x2", 40)
    assert cmd[cmd.index("--data_dir") + 1] == "runs/x/data/q75x2"
    assert not any("EpochSelection" in h["_target_"] for h in script.lean_handlers())


def test_the_paired_table_has_each_arm_and_each_pass_against_the_copy(script):
    rng = np.random.default_rng(0)
    y = rng.integers(0, 10, 300)
    p = {a: rng.dirichlet(np.ones(10), 300) for a in script.ARMS}
    text = script.paired_table(p, y, n_bootstrap=50)
    assert text.count("− copy as is, paired") == len(script.ARMS) - 1
    assert all(script.ARM_LABELS[a] in text for a in script.ARMS)


def test_the_table_of_the_finished_runs_pairs_any_subset_of_arms_against_the_copy(script, tmp_path, monkeypatch):
    rng = np.random.default_rng(1)
    y = rng.integers(0, 10, 200)
    p = {a: rng.dirichlet(np.ones(10), 200) for a in script.ARMS}
    for arm in ("q75x2", "q75x2_shift4"):
        folder = tmp_path / "data" / arm / "cifar-10-batches-py"
        folder.mkdir(parents=True)
        (folder / "test_batch").write_bytes(b"")
        rec = {"psnr_all_db": 32.0, "psnr_train_db": 32.0, "psnr_test_db": 32.0, "psnr_train_per_image_median_db": 32.0,
               "psnr_test_per_image_median_db": 32.0, "unchanged_train_images": 0, "unchanged_test_images": 0}
        (folder / script.JPEG_TWICE_MARKER).write_text(script.json.dumps(rec))
    monkeypatch.setattr(script, "find_batches_dir", lambda root: script.Path(root) / "cifar-10-batches-py")
    monkeypatch.setattr(script, "finished_run", lambda root, arm, epochs: f"run_{arm}")
    monkeypatch.setattr(script, "test_predictions", lambda root, rid: (p[rid[4:]], y, {}))
    out = tmp_path / "preds.npz"
    text = script.table(tmp_path, 40, 20, out, ["copy", "q75x2_shift4"])
    assert "PSNR of q75x2_shift4" in text and "PSNR of q75x2 " not in text
    assert text.count("− copy as is, paired") == 1
    with np.load(out) as z:
        assert list(z["arms"]) == ["copy", "q75x2_shift4"] and z["probs_q75x2_shift4"].shape == (200, 10)
        assert np.array_equal(z["labels"], y)
    with pytest.raises(SystemExit, match="copy"):
        script.table(tmp_path, 40, 20, None, ["q75x2"])
