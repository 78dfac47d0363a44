"""The lines a run prints when it ends: test numbers with 95% CIs, which run is which, where things are, what next.

One function for the CT and the CIFAR runs. A CT row shows AUC, ECE and ACC as fractions; a CIFAR row shows
ACC, ECE and mean confidence in % (the study's units); ``columns`` says which.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from lungcal.tracking.ui import open_with_lines

__all__ = ["CT_COLUMNS", "CIFAR_COLUMNS", "with_ci", "summary_lines", "post_hoc_lines"]

#: ``(label, report key, in percent)`` of a summary row
Column = tuple[str, str, bool]
CT_COLUMNS: tuple[Column, ...] = (("AUC", "auc", False), ("ECE", "ece", False))
CIFAR_COLUMNS: tuple[Column, ...] = (("ACC", "acc", True), ("ECE", "ece", True))


def with_ci(report: Mapping[str, Any], key: str, percent: bool = False) -> str:
    """``"0.744 [0.673, 0.815]"`` (or ``"64.66% [63.71, 65.58]"``): a report value with its bootstrap CI."""
    lo, hi = report.get(key + "_ci_low", float("nan")), report.get(key + "_ci_high", float("nan"))
    if percent:
        return f"{100 * report[key]:.2f}% [{100 * lo:.2f}, {100 * hi:.2f}]"
    return f"{report[key]:.3f} [{lo:.3f}, {hi:.3f}]"


def _row(name: str, r: Mapping[str, Any], columns: Sequence[Column], width: int) -> str:
    cells = []
    for label, key, percent in columns:
        label = f"ECE{int(r.get('n_bins', 0))}" if key == "ece" and percent else label
        cells.append(f"{label} {with_ci(r, key, percent)}")
    if any(percent for *_, percent in columns):
        tail = f"mean conf. {100 * r['mean_confidence']:.2f}%"
    else:
        tail = f"ACC {r['acc']:.3f}"
    return f"  {name:<{width}} test {'   '.join(cells)}   {tail}  (n={int(r['n'])})"


def summary_lines(title: str, rows: Sequence[tuple[str, Mapping[str, Any]]], output_dir: Path | str,
                  tracking_uri: str, runs: Sequence[tuple[str, str]], *, columns: Sequence[Column] = CT_COLUMNS,
                  next_steps: Sequence[str] = (), prefix: str = "lungcal") -> str:
    """The run summary.

    Args:
        title: what ran (``"focal (stage 1) + TS"``).
        rows: ``(name, test report)`` per line.
        runs: ``(what, run id)`` of every MLflow run written, e.g. ``("stage 1", id)``, ``("+ TS", id)``.
        columns: the report keys shown (:data:`CT_COLUMNS` or :data:`CIFAR_COLUMNS`).
        next_steps: commands that follow this run, printed one per line.

    The "open with" lines start ``mlflow ui`` and give the address of the runs' experiment on its runs table
    with the study's columns (:func:`lungcal.tracking.ui.open_with_lines`).
    """
    width = max([14, *(len(name) for name, _ in rows)])
    lines = [f"== {prefix} {title} =="]
    lines += [_row(name, r, columns, width) for name, r in rows]
    lines.append(f"  {'stored under':<{width}} {output_dir}")
    lines.append(f"  {'MLflow runs':<{width}} " + ", ".join(f"{rid} ({what})" for what, rid in runs))
    lines += open_with_lines(tracking_uri, runs[0][1] if runs else None, width)
    for step in next_steps:
        lines.append(f"  {'next':<{width}} {step}")
    return "\n".join(lines)


def post_hoc_lines(post: Sequence[Mapping[str, Any]], resumed_from: int = 0, percent: bool = False) -> str:
    """The paired test-ECE difference each post-hoc calibrator made (the same cases before and after, a paired
    bootstrap: a verdict, not two CIs), and the epoch a resumed run continued from; one line each."""
    text = ""
    for r in post:
        d, scale, unit, digits = r["ece_diff"], (100 if percent else 1), ("%" if percent else ""), (2 if percent else 3)
        verdict = "significant" if d["significant"] else "not significant"
        lo, hi = scale * d["ci_low"], scale * d["ci_high"]
        text += (f"\n  ECE {r['name'].upper()} - none  {scale * d['diff']:+.{digits}f}{unit} "
                 f"[{lo:+.{digits}f}, {hi:+.{digits}f}]  paired bootstrap: {verdict}")
    if resumed_from:
        text += f"\n  resumed from epoch {resumed_from}"
    return text
