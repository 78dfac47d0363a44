"""Reliability diagram renders headless and writes a PNG."""
from __future__ import annotations

import numpy as np

from lungcal.calibration.metrics import ece
from lungcal.calibration.plots import reliability_diagram, risk_coverage_plot
from lungcal.calibration.selective import aurc


def test_reliability_diagram_png(tmp_path):
    rng = np.random.default_rng(0)
    z = rng.normal(size=(2000, 5)) * 3
    p = np.exp(z) / np.exp(z).sum(1, keepdims=True)
    y = np.where(rng.uniform(size=2000) < 0.7, p.argmax(1), rng.integers(0, 5, 2000))
    out = tmp_path / "sub" / "rel.png"
    fig = reliability_diagram(p, y, n_bins=15, title="test", path=out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    top, hist = fig.axes
    texts = [t.get_text() for t in top.texts]
    assert any(f"{ece(p, y, 15) * 100:.2f}%" in t for t in texts)
    assert len(hist.patches) == 15  # one histogram bar per bin


def test_reliability_diagram_positive_class_no_path():
    rng = np.random.default_rng(1)
    q = rng.uniform(size=300)
    y = (rng.uniform(size=300) < q).astype(int)
    fig = reliability_diagram(q, y, n_bins=10, mode="positive_class")
    assert "positive-class" in fig.axes[0].texts[0].get_text()
    assert fig.axes[1].get_xlabel() == "Predicted p(y = 1)"


def test_risk_coverage_plot_png(tmp_path):
    rng = np.random.default_rng(0)
    y = rng.integers(0, 2, 300)
    p1 = np.clip(0.5 + (y - 0.5) * rng.uniform(-0.5, 1.0, 300), 0, 1)
    out = tmp_path / "plots" / "rc.png"
    fig = risk_coverage_plot(p1, y, title="t", path=out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    labels = fig.axes[0].get_legend_handles_labels()[1]
    assert labels[0] == f"confidence (AURC = {aurc(p1, y):.4f})"
    curve = fig.axes[0].lines[0].get_ydata()
    assert np.isclose(curve[-1], np.mean((p1 > 0.5) != y))
