"""scripts/class_accuracy.py: where a long-tailed CIFAR model loses accuracy, read back from MLflow."""
from __future__ import annotations

import numpy as np
import pytest
from sklearn.metrics import recall_score

from lungcal.tracking import RunTracker, default_tracking_uri
from tests.scripts.conftest import load_script


@pytest.fixture(scope="module")
def script():
    return load_script("class_accuracy")


def _predictions(seed: int = 0, n_per_class: int = 60):
    """Balanced labels; class c is predicted right with probability 0.9 - 0.08 c (a fading tail)."""
    rng = np.random.default_rng(seed)
    y = np.repeat(np.arange(10), n_per_class)
    right = rng.random(len(y)) < 0.9 - 0.08 * y
    pred = np.where(right, y, (y + rng.integers(1, 10, len(y))) % 10)
    return pred, y


def test_group_accuracy_is_the_mean_of_per_class_recall(script):
    pred, y = _predictions()
    out = script.group_accuracy(pred, y, n_bootstrap=400)
    recall = recall_score(y, pred, average=None)  # sklearn's per-class recall is per-class accuracy
    assert [out["per_class"][str(c)] for c in range(10)] == pytest.approx(recall)
    for name, classes in script.GROUPS.items():
        g = out[name]
        assert g["acc"] == pytest.approx(recall[list(classes)].mean())
        assert g["ci_low"] < g["acc"] < g["ci_high"]
    assert out["many"]["acc"] > out["medium"]["acc"] > out["few"]["acc"]
    assert out["few"]["ci_high"] < out["many"]["ci_low"]  # 0.82 vs 0.18 apart: far outside the noise


def test_group_accuracy_refuses_a_class_without_test_images(script):
    pred, y = _predictions()
    keep = y != 8
    with pytest.raises(ValueError, match=r"classes \[8\] have no test images"):
        script.group_accuracy(pred[keep], y[keep], n_bootstrap=0)


def test_main_reads_each_finished_runs_predictions(script, tmp_path, capsys):
    uri = default_tracking_uri(tmp_path)
    pred, y = _predictions(1)
    probs = np.full((len(y), 10), 0.01)
    probs[np.arange(len(y)), pred] = 0.91
    path = tmp_path / "test.npz"
    np.savez(path, logits=np.log(probs), probs=probs, labels=y)
    with RunTracker("cifar10lt", "cifar10lt_ce", tracking_uri=uri) as tr:
        tr.log_artifact(path, "predictions")
    with RunTracker("cifar10lt", "cifar10lt_no_predictions", tracking_uri=uri):
        pass
    assert script.main(["--experiment", "cifar10lt", "--tracking-uri", uri, "--n-bootstrap", "50"]) == 0
    out = capsys.readouterr()
    recall = recall_score(y, pred, average=None)
    row = next(line for line in out.out.splitlines() if line.startswith("| cifar10lt_ce | 600 |"))
    assert f"| {100 * (pred == y).mean():.2f} | {100 * recall[:3].mean():.2f} [" in row
    assert "skipped cifar10lt_no_predictions" in out.err
    with pytest.raises(SystemExit, match="no experiment 'nope'"):
        script.main(["--experiment", "nope", "--tracking-uri", uri])
