"""Where the MLflow UI opens: each experiment's runs table with the study's columns, and the lines that say so.

``lungcal ui`` prints :func:`experiment_urls`; the end of every run prints :func:`open_with_lines` (the
``mlflow ui`` command and the address of the run's experiment). What the addresses hold is in
:mod:`lungcal.tracking.runs_view`.
"""
from __future__ import annotations

from collections.abc import Sequence

from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from lungcal.errors import ConfigError
from lungcal.tracking.names import CT_EXPERIMENT
from lungcal.tracking.runs_view import ensure_runs_view, runs_url
from lungcal.tracking.tracker import redact_uri

__all__ = ["PROJECT_EXPERIMENTS", "UI_HOST", "UI_PORT", "ui_base", "experiment_urls", "open_with_lines"]

#: the experiments ``lungcal ui`` lists when they exist: the CT runs and the two CIFAR halves of the study
PROJECT_EXPERIMENTS = (CT_EXPERIMENT, "cifar10", "cifar10lt")
UI_HOST = "127.0.0.1"
UI_PORT = 5000


def _is_server(tracking_uri: str) -> bool:
    return tracking_uri.startswith(("http://", "https://"))


def ui_base(tracking_uri: str, port: int = UI_PORT) -> str:
    """The UI's address: a tracking server's own (without credentials), else ``mlflow ui`` on loopback."""
    if _is_server(tracking_uri):
        return redact_uri(tracking_uri).rstrip("/")
    return f"http://{UI_HOST}:{port}"


def experiment_urls(tracking_uri: str, names: Sequence[str] = (), port: int = UI_PORT) -> list[tuple[str, str]]:
    """``(experiment, runs-table address)`` for ``names`` (default: those of :data:`PROJECT_EXPERIMENTS` that
    exist), writing lungcal's saved view on any that lacks it. A name asked for that does not exist is a
    :class:`ConfigError` naming the experiments there are."""
    client = MlflowClient(tracking_uri=tracking_uri)
    base = ui_base(tracking_uri, port)
    out = []
    for name in names or PROJECT_EXPERIMENTS:
        exp = client.get_experiment_by_name(name)
        if exp is None:
            if not names:
                continue
            there = sorted(e.name for e in client.search_experiments())
            raise ConfigError(f"no MLflow experiment named {name!r} in this store", field="--experiment",
                              fix=f"use one of {there}" if there else "run a bundle first")
        ensure_runs_view(client, exp.experiment_id, name, exp.tags)
        out.append((name, runs_url(exp.experiment_id, base)))
    return out


def open_with_lines(tracking_uri: str, run_id: str | None, width: int = 14, port: int = UI_PORT) -> list[str]:
    """The summary's lines that open a run's experiment on its runs table::

          open with      mlflow ui --backend-store-uri sqlite:///<abs>/mlflow.db --host 127.0.0.1 --port 5000
          then open      http://127.0.0.1:5000/#/experiments/1/runs?workflowType=machine_learning&viewStateShareKey=...

    (a tracking server: only its address). When the run cannot be looked up, the UI's front page."""
    base = ui_base(tracking_uri, port)
    url = base
    if run_id:
        try:
            client = MlflowClient(tracking_uri=tracking_uri)
            exp = client.get_experiment(client.get_run(run_id).info.experiment_id)
            ensure_runs_view(client, exp.experiment_id, exp.name, exp.tags)
            url = runs_url(exp.experiment_id, base)
        except MlflowException:
            pass
    if _is_server(tracking_uri):
        return [f"  {'open':<{width}} {url}"]
    cmd = f"mlflow ui --backend-store-uri {redact_uri(tracking_uri)} --host {UI_HOST} --port {port}"
    return [f"  {'open with':<{width}} {cmd}", f"  {'then open':<{width}} {url}"]
