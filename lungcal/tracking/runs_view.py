"""The MLflow UI opened where the comparison is: the runs table with the study's columns.

What the MLflow 3.17 UI does (read from its bundle, ``mlflow/server/js/build/static/js``):

- The experiment page's mode comes from the URL's ``workflowType`` (``genai`` or ``machine_learning``),
  else the browser's last choice, else ``genai``: the GenAI overview (traces, tokens, an assistant). The
  experiment tag ``mlflow.experimentKind`` (:data:`~lungcal.tracking.names.MLFLOW_EXPERIMENT_KIND`) no
  longer picks it (a feature flag that is always on in 3.17 reads the URL instead); the tag is still set,
  for the experiment-kind selector and earlier 3.x UIs.
- A saved view of the runs table is an experiment tag ``mlflow.sharedViewState.<id>`` holding
  ``{"name", "createdAt", "updatedAt", "state"}``, where ``state`` is the JSON of the search facets
  (``searchFilter``, ``orderByKey``, ``orderByAsc``, ...) and the table's state (``selectedColumns``,
  ``columnWidths``, ``groupBy``, ...). The UI lists it under "Views", and ``?viewStateShareKey=<id>``
  opens it. Facets given in the URL itself (``orderByKey=``...) make the UI ignore the saved view.
- Child runs nest under their parent only while the table is ordered by start time, and then collapsed
  (which children are open is not part of a saved view). The view orders by run name instead: a TS run is
  named after its stage-1 run (``focal-<time>+ts``), so it is the row right under it, numbers in view.
- A column is ``metrics.`<name>```, ``params.`<name>``` or ``tags.`<name>```.

So lungcal writes one saved view per experiment (:func:`saved_view_tag`, at experiment creation and by
``lungcal ui``) and prints :func:`runs_url`, which names the mode and the view.
"""
from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from typing import Any, Protocol
from urllib.parse import urlencode

from lungcal.tracking.names import (
    MLFLOW_SAVED_VIEW_PREFIX,
    RUNS_VIEW_ID,
    TAG_SITE,
    TAG_STAGE1,
    TAG_STAGE2,
    metric_name,
)

__all__ = ["VIEW_VERSION", "RUN_NAME_COLUMN", "ORDER_BY", "view_columns", "view_state", "saved_view_tag",
           "needs_view", "ensure_runs_view", "runs_url", "column_key"]

#: bumped when the view changes, so that ``lungcal ui`` and new runs rewrite views lungcal wrote before
#: (a view a user saved over lungcal's, from the UI, carries no version and is left alone)
VIEW_VERSION = 1
_VERSION_KEY = "lungcalView"


class _TagClient(Protocol):  # the part of mlflow's MlflowClient used here
    def get_experiment(self, experiment_id: str) -> Any: ...

    def set_experiment_tag(self, experiment_id: str, key: str, value: Any) -> None: ...


def column_key(kind: str, name: str) -> str:
    """A runs-table column as MLflow's UI names it: ``column_key("metrics", "test/auc") == "metrics.`test/auc`"``."""
    return f"{kind}.`{name}`"


def _with_ci(metric: str) -> list[str]:
    base = metric_name("test", metric)
    return [base, base + "_ci_low", base + "_ci_high"]


def view_columns(experiment: str) -> list[str]:
    """The study's columns, in reading order: test ECE with its 95% CI and the temperature (what calibration
    changed, in view beside the run name even where the UI's assistant panel takes a third of the window),
    test AUC (CIFAR: ACC) with its CI, the stage-1 method and the stage 2 (``none``, ``ts``, ...); CT
    experiments add the site."""
    cifar = experiment.lower().startswith("cifar")
    metrics = [*_with_ci("ece"), "temperature", *_with_ci("acc" if cifar else "auc")]
    tags = [TAG_STAGE1, TAG_STAGE2] + ([] if cifar else [TAG_SITE])
    return [column_key("metrics", m) for m in metrics] + [column_key("tags", t) for t in tags]


#: the run-name column (the method: ``focal-<time>``, its TS run ``focal-<time>+ts``); the date and duration
#: columns (the UI keeps the date pinned beside the name) come after the study's
RUN_NAME_COLUMN = column_key("attributes", "Run Name")
_TRAILING_WIDTHS = {"runDateAndNestInfo": 140, "duration": 90}
#: the order that puts each post-hoc run right under its stage-1 run (its name is the stage-1 name + ``+ts``)
ORDER_BY = column_key("tags", "mlflow.runName")


def _width(column: str) -> int:
    if column == RUN_NAME_COLUMN:
        return 190
    if column in _TRAILING_WIDTHS:
        return _TRAILING_WIDTHS[column]
    if column.endswith(("_ci_low`", "_ci_high`")):
        return 112
    return 90 if column.startswith("metrics.") else 112


def view_state(experiment: str) -> dict[str, Any]:
    """The runs table's state: the run name, then the study's columns (:func:`view_columns`), then the date and
    duration; ordered by run name, so that each TS run (``<stage-1 name>+ts``) is the row under its stage-1 run,
    with its temperature in view (the UI nests child runs only when ordered by date, and then shows them
    collapsed; a saved view cannot hold them open)."""
    columns = view_columns(experiment)
    order = [RUN_NAME_COLUMN, *columns, *_TRAILING_WIDTHS]
    return {
        "searchFilter": "", "orderByKey": ORDER_BY, "orderByAsc": True, "startTime": "ALL",
        "lifecycleFilter": "Active", "modelVersionFilter": "All Runs", "datasetsFilter": [],
        "selectedColumns": columns, "columnOrder": order,
        "columnWidths": {c: _width(c) for c in order},
        "groupBy": None, "groupsExpanded": {}, "viewMaximized": False, "runListHidden": False,
        _VERSION_KEY: VIEW_VERSION,
    }


def saved_view_tag(experiment: str, now_ms: int | None = None) -> tuple[str, str]:
    """``(tag key, tag value)`` of the experiment's saved view, named "lungcal study"."""
    now = int(time.time() * 1000) if now_ms is None else now_ms
    value = {"name": "lungcal study", "createdAt": now, "updatedAt": now, "state": json.dumps(view_state(experiment))}
    return MLFLOW_SAVED_VIEW_PREFIX + RUNS_VIEW_ID, json.dumps(value)


def needs_view(tags: Mapping[str, str]) -> bool:
    """Whether an experiment with these tags lacks lungcal's current view (absent, or written by an older
    lungcal); a view saved over it from the UI is kept."""
    raw = tags.get(MLFLOW_SAVED_VIEW_PREFIX + RUNS_VIEW_ID)
    if raw is None:
        return True
    try:
        state = json.loads(json.loads(raw)["state"])
    except (ValueError, KeyError, TypeError):
        return False  # not lungcal's format: someone else's view, left alone
    version = state.get(_VERSION_KEY) if isinstance(state, dict) else None
    return isinstance(version, int) and version < VIEW_VERSION


def ensure_runs_view(client: _TagClient, experiment_id: str, experiment: str,
                     tags: Mapping[str, str] | None = None) -> bool:
    """Write the experiment's saved view where :func:`needs_view`; True when it wrote it."""
    current = tags if tags is not None else client.get_experiment(experiment_id).tags
    if not needs_view(current):
        return False
    key, value = saved_view_tag(experiment)
    client.set_experiment_tag(experiment_id, key, value)
    return True


def runs_url(experiment_id: str, base: str = "http://127.0.0.1:5000", extra: Sequence[tuple[str, str]] = ()) -> str:
    """The address of an experiment's runs table, in model-training mode, with lungcal's saved view:
    ``http://127.0.0.1:5000/#/experiments/1/runs?workflowType=machine_learning&viewStateShareKey=lungcal-study``."""
    query = urlencode([("workflowType", "machine_learning"), ("viewStateShareKey", RUNS_VIEW_ID), *extra])
    return f"{base.rstrip('/')}/#/experiments/{experiment_id}/runs?{query}"
