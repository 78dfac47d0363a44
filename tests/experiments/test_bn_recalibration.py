"""experiments/bn_recalibration.py: a CIFAR model scored with re-estimated BatchNorm statistics."""
from __future__ import annotations

import pytest
import torch
from mlflow.tracking import MlflowClient

from cifar_baselines.resnet import resnet32
from cifar_baselines.steps import prepare_images
from tests.cifar_baselines.cifar_fakes import tiny_stage1_run
from tests.experiments.conftest import load_script


@pytest.fixture(scope="module")
def script():
    return load_script("bn_recalibration")


def test_train_batches_hold_each_image_once_and_balanced_batches_lift_the_tail(script, lt_data):
    _, d = lt_data
    train = torch.cat(list(script.bn_batches(d, "train", batch_size=16, augment=False)))
    assert torch.equal(train, prepare_images(d.train_x))
    aug = torch.cat(list(script.bn_batches(d, "train", batch_size=16)))
    assert aug.shape == train.shape and not torch.equal(aug, train)  # crops and flips of the same images
    assert torch.equal(aug, torch.cat(list(script.bn_batches(d, "train", batch_size=16))))  # seeded
    counts = torch.bincount(d.train_y, minlength=10).double()
    idx = torch.cat([y for _, y in script.BatchIterator(d.train_x, d.train_y, 16, sampler="balanced", seed=0)])
    drawn = torch.bincount(idx, minlength=10).double() / len(idx)
    assert len(idx) == len(d.train_y)
    assert drawn[counts.argmin()] > 2 * counts.min() / counts.sum()  # the rarest class is drawn far above its share
    with pytest.raises(ValueError, match="unknown source"):
        next(script.bn_batches(d, "test"))


def test_recalibrated_statistics_are_the_plain_average_of_the_pass(script, lt_data):
    _, d = lt_data
    torch.manual_seed(0)
    net = resnet32(10).eval()
    before = {k: v.clone() for k, v in net.state_dict().items()}
    batches = list(script.bn_batches(d, "train", batch_size=16, augment=False))
    new = script.recalibrate_bn(net, batches)
    with torch.no_grad():  # the first BatchNorm sees conv1's output; update_bn weighs every batch alike
        want = torch.stack([net.conv1(b).mean(dim=(0, 2, 3)) for b in batches]).mean(0)
    assert torch.allclose(new.bn1.running_mean, want, atol=1e-5)
    assert not new.training and new.bn1.momentum == net.bn1.momentum
    assert all(torch.equal(v, net.state_dict()[k]) for k, v in before.items())  # the original is untouched


def test_main_scores_a_stage1_run_four_ways(script, lt_data, tmp_path, capsys, monkeypatch):
    folder, _ = lt_data
    run_id, uri = tiny_stage1_run("cifar10lt_ce", folder, tmp_path, monkeypatch)
    assert script.main(["--run-id", run_id, "--tracking-uri", uri, "--data-dir", str(folder),
                        "--output-dir", str(tmp_path), "--n-bootstrap", "50"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "---" not in line]
    assert [r.split(" | ")[0] for r in rows[1:]] == ["| as trained", "| BN from train", "| BN from train, clean",
                                                 "| BN from balanced"]
    logged = MlflowClient(uri).get_run(run_id).data.metrics["test/acc"]
    assert rows[1].split(" | ")[1].startswith(f"{100 * logged:.2f} [")  # as trained = the run's own test score
    assert all(r.count("|") == 7 for r in rows)
