"""The summary a CT run prints at its end: test AUC / ECE with 95% CIs, where things are, how to look."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["with_ci", "summary_lines"]


def with_ci(report: Mapping[str, Any], key: str) -> str:
    """``"0.744 [0.673, 0.815]"``: a report value with its bootstrap CI."""
    lo, hi = report.get(key + "_ci_low", float("nan")), report.get(key + "_ci_high", float("nan"))
    return f"{report[key]:.3f} [{lo:.3f}, {hi:.3f}]"


def summary_lines(title: str, items: Sequence[tuple[str, Mapping[str, Any]]], output_dir: Path, tracking_uri: str,
                  run_ids: Sequence[str]) -> str:
    """The run summary: one line per ``(name, test report)``, then the output folder, runs and ``mlflow ui``."""
    lines = [f"== lungcal {title} =="]
    for name, r in items:
        lines.append(f"  {name:<14} test AUC {with_ci(r, 'auc')}   ECE {with_ci(r, 'ece')}   ACC {r['acc']:.3f}"
                     f"  (n={r['n']})")
    lines.append(f"  stored under  {output_dir}")
    lines.append(f"  MLflow runs   {', '.join(run_ids)}")
    lines.append(f"  open with     mlflow ui --backend-store-uri {tracking_uri}")
    return "\n".join(lines)
