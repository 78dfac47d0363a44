"""Reliability diagram renders headless and writes a PNG."""
from __future__ import annotations

import numpy as np

from lungcal.calibration.metrics import ece
from lungcal.calibration.plots import reliability_diagram


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
