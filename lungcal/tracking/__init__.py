"""MLflow tracking shared by the CT application (``lungcal.ctapp``), the study and ``cifar_baselines``.

- ``names.py``: every tag, metric and artifact name, defined once;
- ``tracker.py``: :class:`RunTracker` (one MLflow run; flattened, privacy-filtered params);
- ``lookup.py``: linked-run look-ups (stage-1 run, its checkpoint, its acquisition summary, its post-hoc runs);
- ``commands.py``: ``lungcal ui``; ``ui.py`` and ``runs_view.py``: the addresses it prints and the saved view
  of the study's columns;
- ``liveness.py``: runs whose process died are marked ``KILLED``;
- ``server.py``: a local MLflow server as a child process (started, waited for, stopped with its workers).

The names are imported at once; the tracker and the look-ups (MLflow, torch) only when first used, so that
``lungcal --help`` and the CLI's argument errors answer without loading them (PEP 562 ``__getattr__``).
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from lungcal.tracking.names import *  # noqa: F403
from lungcal.tracking.names import __all__ as _names

if TYPE_CHECKING:
    from lungcal.tracking.lookup import (
        add_run_metrics,
        artifact_checkpoint,
        find_stage1_run,
        linked_calibrator,
        linked_calibrator_run,
        linked_runs,
        linked_temperature,
        run_acquisition_summary,
        run_selection,
        run_site_reference,
    )
    from lungcal.tracking.tracker import (
        RunTracker,
        artifact_root_for,
        default_tracking_uri,
        file_digest,
        flatten_config,
        privacy_filter,
    )

_LAZY = {
    **{name: "lungcal.tracking.tracker" for name in ("RunTracker", "artifact_root_for", "default_tracking_uri",
                                                     "file_digest", "flatten_config", "privacy_filter")},
    **{name: "lungcal.tracking.lookup" for name in ("add_run_metrics", "artifact_checkpoint", "find_stage1_run",
                                                    "linked_calibrator", "linked_calibrator_run", "linked_runs",
                                                    "linked_temperature", "run_acquisition_summary",
                                                    "run_selection", "run_site_reference")},
}

__all__ = [*_names, "RunTracker", "artifact_root_for", "default_tracking_uri", "file_digest", "flatten_config",
           "privacy_filter", "add_run_metrics", "artifact_checkpoint", "find_stage1_run", "linked_calibrator",
           "linked_calibrator_run", "linked_runs", "linked_temperature", "run_acquisition_summary",
           "run_selection", "run_site_reference"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'lungcal.tracking' has no attribute {name!r}")
