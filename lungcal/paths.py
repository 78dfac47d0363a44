"""Where lungcal keeps what it generates: one rule for the whole package.

``$LUNGCAL_HOME`` if set, else ``./runs`` under the current working directory (the project root
when the bundles run as the README says). Synthetic cohorts go to ``<home>/data``, bag caches,
checkpoints and the default MLflow store (``<home>/mlflow.db``) to ``<home>``, and the
pseudonymisation salt to ``<home>/salt``.
"""
from __future__ import annotations

import os
from pathlib import Path

__all__ = ["lungcal_home"]


def lungcal_home() -> Path:
    """``$LUNGCAL_HOME`` (``~`` expanded), else ``./runs``; always absolute and resolved."""
    home = os.environ.get("LUNGCAL_HOME")
    return Path(home).expanduser().resolve() if home else (Path.cwd() / "runs").resolve()
