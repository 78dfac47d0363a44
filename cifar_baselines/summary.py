"""The lines a CIFAR bundle prints when it ends: test ACC / ECE with 95% CIs, the run IDs, what next.

A 200-epoch run ends hours after it started, and the next step (``bundles/<dataset>_las.json
--stage1_run_id ID``) needs the stage-1 run's ID, so the run says it rather than leaving the reader
to search the store. ``python -m monai.bundle run`` prints these lines; ``python -m cifar_baselines``
prints them and then its JSON summary.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["percent_with_ci", "run_summary"]


def percent_with_ci(report: Mapping[str, Any], key: str) -> str:
    """``"64.66% [63.71, 65.58]"``: a fraction in a test report, in %, with its bootstrap CI."""
    lo, hi = report.get(key + "_ci_low", float("nan")), report.get(key + "_ci_high", float("nan"))
    return f"{100 * report[key]:.2f}% [{100 * lo:.2f}, {100 * hi:.2f}]"


def run_summary(title: str, rows: Sequence[tuple[str, Mapping[str, Any]]], run_ids: Sequence[str],
                tracking_uri: str, output_dir: Path, next_step: str | None = None) -> str:
    """One line per ``(name, test report)`` (ACC, ECE and mean confidence, ECE's bin count), then where
    the runs are, the ``mlflow ui`` line and, for a stage-1 run, the LAS command that follows it."""
    lines = [f"== cifar_baselines {title} =="]
    for name, r in rows:
        lines.append(f"  {name:<18} test ACC {percent_with_ci(r, 'acc')}   ECE{int(r.get('n_bins', 15))} "
                     f"{percent_with_ci(r, 'ece')}   mean conf. {100 * r['mean_confidence']:.2f}%  (n={int(r['n'])})")
    lines.append(f"  MLflow runs        {', '.join(run_ids)}")
    lines.append(f"  stored under       {output_dir}")
    lines.append(f"  open with          mlflow ui --backend-store-uri {tracking_uri}")
    if next_step:
        lines.append(f"  next               {next_step}")
    return "\n".join(lines)
