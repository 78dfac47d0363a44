"""experiments/precision_check.py: bf16 gradients against float32 ones and against SGD's own noise."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from cifar_baselines.resnet import resnet32
from cifar_baselines.steps import prepare_images
from lungcal.calibration.losses import FocalLoss
from tests.cifar_baselines.cifar_fakes import tiny_stage1_run
from tests.experiments.conftest import load_script


@pytest.fixture(scope="module")
def script():
    return load_script("precision_check")


def test_the_run_loss_follows_the_method(script):
    assert isinstance(script.run_loss({"method": "ce"}), torch.nn.CrossEntropyLoss)
    assert isinstance(script.run_loss({"method": "mixup"}), torch.nn.CrossEntropyLoss)
    focal = script.run_loss({"method": "focal_mixup", "focal_gamma": 2.0, "focal_alpha": None})
    assert isinstance(focal, FocalLoss) and focal.gamma == 2.0


def test_float32_gradient_is_autograds_and_bf16_is_close_but_not_equal(script, lt_data):
    _, d = lt_data
    torch.manual_seed(0)
    net = resnet32(10).to(memory_format=torch.channels_last)
    x, y = prepare_images(d.train_x[:32]), d.train_y[:32]
    loss_fn = torch.nn.CrossEntropyLoss()
    g = script.flat_gradient(net, loss_fn, x, y)
    want = torch.autograd.grad(loss_fn(net(x), y), list(net.parameters()))  # the oracle: plain autograd
    assert torch.allclose(g, torch.cat([w.reshape(-1) for w in want]), rtol=1e-4, atol=1e-6)
    g16 = script.flat_gradient(net, loss_fn, x, y, bf16=True)
    rel = float((g16 - g).norm() / g.norm())
    assert g16.dtype == torch.float32 and g16.shape == g.shape
    assert 1e-4 < rel < 0.5  # bf16 keeps 8 bits of mantissa: a non-zero difference, far from another gradient
    assert torch.nn.functional.cosine_similarity(g16, g, dim=0) > 0.9


def test_gradient_noise_per_batch(script, lt_data):
    _, d = lt_data
    torch.manual_seed(0)
    net = resnet32(10)
    before = {k: v.clone() for k, v in net.state_dict().items()}
    r = script.gradient_noise(net, torch.nn.CrossEntropyLoss(), d, n_batches=3, batch_size=16)
    assert set(r) == {*script.MEASURES, script.ACCUMULATION} and all(len(r[k]) == 3 for k in script.MEASURES)
    assert 0.5 < r[script.ACCUMULATION][0] <= 3 ** 0.5 + 1e-6  # |sum e_i| <= sqrt(K) sqrt(sum |e_i|^2)
    assert (r["augmentation noise"] > 0).all() and (r["batch noise"] > 0).all() and (r["bf16 error"] > 0).all()
    assert ((r["bf16 cosine"] > 0) & (r["bf16 cosine"] <= 1 + 1e-6)).all()
    assert all(torch.equal(v, net.state_dict()[k]) for k, v in before.items())  # the network is untouched
    mixed = script.gradient_noise(net, torch.nn.CrossEntropyLoss(), d, n_batches=2, batch_size=16, mixup_alpha=1.0)
    assert all(len(mixed[k]) == 2 for k in script.MEASURES)
    with pytest.raises(ValueError, match="fewer than two batches"):
        script.gradient_noise(net, torch.nn.CrossEntropyLoss(), d, n_batches=3, batch_size=len(d.train_y))


def test_summarise_is_a_mean_with_a_normal_interval(script):
    v = np.array([1.0, 2.0, 3.0, 4.0])
    half = 1.96 * v.std(ddof=1) / 2
    assert script.summarise(v) == f"2.5000 [{2.5 - half:.4f}, {2.5 + half:.4f}]"


def test_main_checks_a_stage1_run_at_trained_and_initial_weights(script, lt_data, tmp_path, capsys, monkeypatch):
    folder, _ = lt_data
    run_id, uri = tiny_stage1_run("cifar10lt_focal", folder, tmp_path, monkeypatch)
    assert script.main(["--run-id", run_id, "--tracking-uri", uri, "--data-dir", str(folder),
                        "--output-dir", str(tmp_path), "--batches", "2", "--batch-size", "32"]) == 0
    out = capsys.readouterr().out
    assert "loss FocalLoss" in out
    rows = [line for line in out.splitlines() if line.startswith("| ") and "---" not in line]
    assert [r.split(" | ")[0] for r in rows[1:]] == ["| trained", "| initial"]
    assert all(r.count("|") == len(script.MEASURES) + 4 for r in rows)
