"""CIFAR runs logged before the shared artifact names (predictions/{split}.npz) stay readable by the report."""
from __future__ import annotations

import numpy as np
from mlflow.tracking import MlflowClient

from lungcal.study.differences import load_predictions
from lungcal.study.posthoc import load_logits
from lungcal.tracking import RunTracker
from lungcal.tracking.names import predictions_artifact, predictions_artifacts


def test_an_old_cifar_run_is_read_under_its_old_name(tmp_path):
    assert predictions_artifacts("test", "npz") == (predictions_artifact("test", "npz"), "predictions/test.npz")
    assert predictions_artifacts("test", "csv") == ("predictions/test_predictions.csv",)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    rng = np.random.default_rng(0)
    logits, labels = rng.normal(size=(20, 10)), rng.integers(0, 10, 20)
    probs = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
    np.savez(tmp_path / "test.npz", logits=logits.astype(np.float32), probs=probs.astype(np.float32), labels=labels)
    with RunTracker("cifar10lt", "old", tracking_uri=uri) as tr:
        tr.log_artifact(tmp_path / "test.npz", "predictions")  # the name CIFAR runs used before
        run_id = tr.run_id
    client = MlflowClient(uri)
    ids, p, y = load_predictions(client, run_id, "test")
    assert len(ids) == 20 and np.array_equal(y, labels) and np.allclose(p, probs, atol=1e-6)
    z, y2 = load_logits(client, run_id, "test")
    assert np.allclose(z, logits, atol=1e-6) and np.array_equal(y2, labels)
