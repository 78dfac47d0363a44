"""MLflow tracking shared by the CT engine, the study and ``cifar_baselines``.

- ``names.py``: every tag and metric name, defined once;
- ``tracker.py``: :class:`RunTracker` (one MLflow run; flattened, privacy-filtered params);
- ``lookup.py``: linked-run look-ups (stage-1 run, its checkpoint, its post-hoc runs);
- ``commands.py``: ``lungcal ui``.
"""
from lungcal.tracking.lookup import (
    add_run_metrics,
    artifact_checkpoint,
    find_stage1_run,
    linked_calibrator,
    linked_calibrator_run,
    linked_runs,
    linked_temperature,
)
from lungcal.tracking.names import *  # noqa: F403
from lungcal.tracking.names import __all__ as _names
from lungcal.tracking.tracker import (
    RunTracker,
    artifact_root_for,
    default_tracking_uri,
    file_digest,
    flatten_config,
    privacy_filter,
)

__all__ = [*_names, "RunTracker", "artifact_root_for", "default_tracking_uri", "file_digest", "flatten_config",
           "privacy_filter", "artifact_checkpoint", "find_stage1_run", "linked_runs", "linked_temperature",
           "linked_calibrator", "linked_calibrator_run", "add_run_metrics"]
