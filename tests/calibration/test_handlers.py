"""CalibrationMetrics inside ignite and a real MONAI SupervisedEvaluator."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lungcal.calibration import metrics as M
from lungcal.calibration.handlers import CalibrationMetrics

monai_engines = pytest.importorskip("monai.engines")
monai_data = pytest.importorskip("monai.data")


def _data(n=64, c=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    y = (x[:, 0] + 0.5 * torch.randn(n, generator=g) > 0).long() if c == 2 else torch.randint(0, c, (n,), generator=g)
    return x, y


def _expected(logits, y, n_bins):
    p = torch.softmax(logits.double(), 1)
    return {"ece": M.ece(p, y, n_bins), "acc": M.accuracy(p, y), "auc": M.auroc(p, y),
            "nll": float(F.cross_entropy(logits.double(), y))}


def test_metric_over_batches_equals_whole_epoch():
    x, y = _data(100, c=3)
    logits = torch.randn(100, 3)
    m = CalibrationMetrics(n_bins=10)
    m.reset()
    for i in range(0, 100, 32):
        m.update((logits[i:i + 32], y[i:i + 32]))
    got = m.compute()
    exp = _expected(logits, y, 10)
    for k in exp:
        assert got[k] == pytest.approx(exp[k], abs=1e-9)
    m.reset()
    with pytest.raises(RuntimeError):
        m.compute()


def test_in_monai_supervised_evaluator():
    x, y = _data(48)
    data = [{"image": x[i], "label": y[i]} for i in range(48)]
    loader = monai_data.DataLoader(monai_data.Dataset(data), batch_size=16, shuffle=False)
    torch.manual_seed(0)
    net = torch.nn.Linear(4, 2)
    evaluator = monai_engines.SupervisedEvaluator(
        device=torch.device("cpu"), val_data_loader=loader, network=net,
        key_val_metric={"val_auc": CalibrationMetrics(n_bins=10, key="auc", prefix="val_")},
        additional_metrics={"calib": CalibrationMetrics(n_bins=10, key="ece", mode="positive_class")},
    )
    evaluator.run()
    metrics = evaluator.state.metrics
    with torch.no_grad():
        logits = net(x)
    exp = _expected(logits, y, 10)
    assert metrics["val_auc"] == pytest.approx(exp["auc"], abs=1e-9)
    for k in ("ece", "acc", "auc", "nll"):
        assert metrics[f"val_{k}"] == pytest.approx(exp[k], abs=1e-6)
    p = torch.softmax(logits.double(), 1)
    assert metrics["calib"] == pytest.approx(M.ece(p, y, 10, mode="positive_class"), abs=1e-9)
    assert evaluator.state.best_metric == pytest.approx(exp["auc"], abs=1e-9)


def test_single_logit_and_onehot_labels():
    z = torch.randn(30)
    y = (torch.rand(30) < torch.sigmoid(z)).long()
    m = CalibrationMetrics(n_bins=5)
    m.update((z[:, None], F.one_hot(y, 2)))
    got = m.compute()
    p = torch.sigmoid(z.double())
    assert got["auc"] == pytest.approx(M.auroc(p, y))
    assert got["ece"] == pytest.approx(M.ece(p, y, 5), abs=1e-7)
