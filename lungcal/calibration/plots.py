"""Reliability diagram with the confidence histogram beneath, the risk-coverage curve of selective prediction,
and the decision curve (matplotlib, headless).

Figures are built with :class:`matplotlib.figure.Figure` and the Agg canvas directly, never via
``pyplot``, so they render without a display and leave no global figure state behind.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from .measures.calibration_error import reliability_bins
from .measures.decision_curve import DecisionCurve, decision_curve
from .measures.inputs import _as_probs_labels, _confidence_correct
from .selective import risk_coverage

__all__ = ["reliability_diagram", "risk_coverage_plot", "decision_curve_plot"]


def reliability_diagram(probs, labels, n_bins: int = 15, mode: str = "top_label",
                        title: str | None = None, path: str | Path | None = None, dpi: int = 120):
    """Draw a reliability diagram and the confidence histogram beneath it.

    Top panel: per equal-width ``(lo, hi]`` bin (the binning of :func:`..metrics.ece`), a bar of
    the bin's accuracy, a hatched red "gap" bar from the accuracy to the bin's mean confidence,
    the diagonal of perfect calibration, and ``ECE = ...`` (with ``n_bins`` and the mode) in the
    upper-left corner. Bottom panel: the share of samples per bin, with the overall accuracy
    and mean confidence as vertical lines.

    Args:
        probs: ``(N, C)`` probabilities or ``(N,)`` p(y=1).
        labels: ``(N,)`` class indices.
        n_bins: number of bins.
        mode: ``"top_label"`` or ``"positive_class"`` (then the y axis is the observed
            frequency of y = 1).
        title: figure title.
        path: if given, the PNG is written there (parent folders are created).
        dpi: resolution of the saved PNG.

    Returns:
        the :class:`matplotlib.figure.Figure`.
    """

    p, y = _as_probs_labels(probs, labels)
    conf, hit = _confidence_correct(p, y, mode)
    rb = reliability_bins(p, y, n_bins=n_bins, mode=mode)
    edges, count = rb["edges"], rb["count"]
    width = np.diff(edges)
    left = edges[:-1]
    filled = count > 0
    acc = np.where(filled, rb["accuracy"], 0.0)
    mconf = np.where(filled, rb["confidence"], 0.0)

    fig = Figure(figsize=(5.0, 6.4))
    FigureCanvasAgg(fig)
    ax, axh = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [3, 1], "hspace": 0.08})
    ylab = "Accuracy" if mode == "top_label" else "Observed frequency of y = 1"
    xlab = "Confidence" if mode == "top_label" else "Predicted p(y = 1)"

    ax.bar(left[filled], acc[filled], width=width[filled], align="edge", color="#4C72B0",
           edgecolor="#1f3b63", linewidth=0.8, label="Outputs")
    gap_lo = np.minimum(acc, mconf)
    ax.bar(left[filled], np.abs(mconf - acc)[filled], bottom=gap_lo[filled], width=width[filled],
           align="edge", color="#DD5555", alpha=0.35, edgecolor="#AA2222", hatch="//",
           linewidth=0.8, label="Gap")
    ax.plot([0, 1], [0, 1], ls="--", color="0.35", lw=1.2, label="Perfect calibration")
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.set_ylabel(ylab)
    ax.set_aspect("auto")
    ax.grid(alpha=0.25)
    ax.legend(loc="lower right", fontsize=8, framealpha=0.9)
    ax.text(0.03, 0.97, f"ECE = {rb['ece'] * 100:.2f}%\n{n_bins} bins, {mode.replace('_', '-')}",
            transform=ax.transAxes, va="top", ha="left", fontsize=10,
            bbox={"boxstyle": "round", "facecolor": "white", "edgecolor": "0.6", "alpha": 0.9})
    if title:
        ax.set_title(title)

    frac = count / max(count.sum(), 1)
    axh.bar(left, frac, width=width, align="edge", color="0.55", edgecolor="0.25", linewidth=0.6)
    a_line = float(hit.mean())
    c_line = float(conf.mean())
    a_name = "Accuracy" if mode == "top_label" else "Prevalence"
    axh.axvline(a_line, color="#4C72B0", lw=1.6, label=f"{a_name} {a_line:.3f}")
    axh.axvline(c_line, color="#DD5555", lw=1.6, ls="--", label=f"Mean conf. {c_line:.3f}")
    axh.set_ylabel("Share")
    axh.set_xlabel(xlab)
    axh.set_ylim(0, max(frac.max() * 1.15, 0.05))
    axh.legend(loc="upper left", fontsize=7, framealpha=0.9)
    axh.grid(alpha=0.25)
    fig.subplots_adjust(left=0.13, right=0.97, top=0.94 if title else 0.97, bottom=0.08)
    if path is not None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=dpi, format="png")
    return fig


def risk_coverage_plot(probs, labels, score: str = "confidence", member_probs=None, title: str | None = None,
                       path: str | Path | None = None, dpi: int = 120, mark_coverage: float = 0.9):
    """Risk-coverage curve (:func:`..selective.risk_coverage`) with its AURC, the best curve
    possible for the same errors (every correct case ranked first), the error rate (a random
    ranking) and a marker at ``mark_coverage``.

    Args:
        probs, labels, score, member_probs: as for :func:`..selective.risk_coverage`.
        title: figure title.
        path: if given, the PNG is written there (parent folders are created).
        dpi: resolution of the saved PNG.
        mark_coverage: coverage marked with a dotted line and its risk (None: no marker).

    Returns:
        the :class:`matplotlib.figure.Figure`.
    """
    rc = risk_coverage(probs, labels, score, member_probs)
    cov, risk = rc["coverage"], rc["risk"]
    n = cov.shape[0]
    err_rate = float(risk[-1])
    n_err = int(round(err_rate * n))
    k = np.arange(1, n + 1)
    best = np.maximum(k - (n - n_err), 0) / k

    fig = Figure(figsize=(5.0, 4.2))
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    ax.plot(cov, risk, color="#4C72B0", lw=1.8, label=f"{score} (AURC = {risk.mean():.4f})")
    ax.plot(cov, best, color="#55A868", lw=1.2, ls="--", label=f"best possible (AURC = {best.mean():.4f})")
    ax.axhline(err_rate, color="0.45", lw=1.0, ls=":", label=f"random ranking ({err_rate:.3f})")
    if mark_coverage is not None:
        i = max(1, int(round(float(mark_coverage) * n))) - 1
        ax.axvline(cov[i], color="#DD5555", lw=1.0, ls=":")
        ax.plot([cov[i]], [risk[i]], "o", color="#DD5555",
                label=f"coverage {cov[i]:.0%}: risk {risk[i]:.3f}")
    ax.set_xlim(0, 1)
    ax.set_ylim(0, max(float(risk.max()) * 1.1, 0.05))
    ax.set_xlabel("Coverage (share of cases kept)")
    ax.set_ylabel("Risk (error rate on kept cases)")
    return _finish(fig, ax, "upper left", title, path, dpi, left=0.14)


def decision_curve_plot(probs=None, labels=None, thresholds=None, mark: float | None = None, title: str | None = None,
                        path: str | Path | None = None, dpi: int = 120, curve: DecisionCurve | None = None):
    """Decision curve (:func:`..measures.decision_curve.decision_curve`): the model's net benefit against the
    threshold probability, beside treating all and treating none; ``mark`` draws a dotted line at one
    threshold (a site's work-up threshold) with the model's net benefit there. ``curve``: a curve already
    computed (then ``probs``, ``labels`` and ``thresholds`` are not needed).

    Returns:
        the :class:`matplotlib.figure.Figure` (the PNG is written to ``path`` when given).
    """
    if curve is None:
        curve = decision_curve(probs, labels) if thresholds is None else decision_curve(probs, labels, thresholds)
    t = curve.thresholds
    fig = Figure(figsize=(5.0, 4.2))
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    ax.plot(t, curve.model, color="#4C72B0", lw=1.8, label="model")
    ax.plot(t, curve.treat_all, color="#DD8452", lw=1.2, ls="--",
            label=f"treat all (prevalence {curve.prevalence:.2f})")
    ax.plot(t, curve.treat_none, color="0.45", lw=1.0, ls=":", label="treat none")
    if mark is not None:
        at = curve.at(float(mark))
        ax.axvline(at["threshold"], color="#DD5555", lw=1.0, ls=":")
        ax.plot([at["threshold"]], [at["model"]], "o", color="#DD5555",
                label=f"threshold {at['threshold']:.2f}: net benefit {at['model']:.3f}")
    top = max(float(curve.prevalence), float(np.max(curve.model)), 0.01)
    ax.set_xlim(float(t.min()), float(t.max()))
    ax.set_ylim(-0.25 * top, 1.15 * top)
    ax.set_xlabel("Threshold probability (work-up when p >= it)")
    ax.set_ylabel("Net benefit (true positives per case)")
    return _finish(fig, ax, "upper right", title, path, dpi, left=0.15)


def _finish(fig, ax, legend: str, title: str | None, path: str | Path | None, dpi: int, left: float):
    """The one-panel curves' grid, legend, title and margins; the PNG written to ``path`` when given."""
    ax.grid(alpha=0.25)
    ax.legend(loc=legend, fontsize=8, framealpha=0.9)
    if title:
        ax.set_title(title)
    fig.subplots_adjust(left=left, right=0.97, top=0.92 if title else 0.97, bottom=0.12)
    if path is not None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=dpi, format="png")
    return fig
