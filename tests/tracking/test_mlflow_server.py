"""Team setup: an ``mlflow server`` on a SQL backend, bound to loopback, receives a bundle's run.

The server gets a SQLite backend and serves artifacts itself (``--artifacts-destination``), as in
``docs/hospital.md``. A tiny MONAI bundle (config JSON run by ``monai.bundle``) logs through
:class:`lungcal.tracking.RunTracker` with ``tracking_uri=http://127.0.0.1:PORT``; the run
is read back with ``MlflowClient``; :func:`lungcal.tracking.server.running_server` stops the server
with its workers.
"""
from __future__ import annotations

import json
import subprocess
import sys
import urllib.request

import pytest
from mlflow.tracking import MlflowClient

from lungcal.tracking.server import LOOPBACK, free_port, running_server

TINY_BUNDLE = {
    "imports": ["$import lungcal.tracking"],
    "tracking_uri": "sqlite:///unused.db",
    "experiment": "team",
    "tracker": {
        "_target_": "lungcal.tracking.RunTracker",
        "experiment": "@experiment",
        "run_name": "tiny-bundle",
        "tracking_uri": "@tracking_uri",
        "tags": {"lungcal.dataset": "synthetic", "lungcal.stage1": "ce", "lungcal.stage2": "none",
                 "lungcal.site": "site-a"},
    },
    "run": [
        "$@tracker.log_params({'epochs': 1, 'lr': 0.01})",
        "$@tracker.log_metrics({'train/loss': 0.7}, step=1)",
        "$@tracker.log_report('test', {'ece': 0.125, 'ece_ci_low': 0.1, 'ece_ci_high': 0.15, 'auc': 0.8})",
        "$@tracker.log_dict({'resolved': True}, 'config/resolved.json')",
        "$@tracker.end()",
    ],
}


@pytest.mark.slow  # starting `mlflow server` takes ~30-60 s on two shared cores
def test_team_server_on_loopback_receives_a_bundle_run(tmp_path):
    pytest.importorskip("mlflow")
    port = free_port()
    db = tmp_path / "team.db"
    art = tmp_path / "team-artifacts"
    cmd = [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", f"sqlite:///{db}",
           "--artifacts-destination", str(art), "--host", LOOPBACK, "--port", str(port), "--workers", "1"]
    with (tmp_path / "server.log").open("wb") as log, running_server(cmd, port, log=log, cwd=tmp_path) as url:
        bundle = tmp_path / "tiny.json"
        bundle.write_text(json.dumps(TINY_BUNDLE))
        out = subprocess.run(
            [sys.executable, "-m", "monai.bundle", "run", "--config_file", str(bundle), "--tracking_uri", url],
            cwd=tmp_path, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]

        client = MlflowClient(tracking_uri=url)
        exp = client.get_experiment_by_name("team")
        runs = client.search_runs([exp.experiment_id])
        assert len(runs) == 1
        run = runs[0]
        assert run.info.status == "FINISHED" and run.info.run_name == "tiny-bundle"
        assert run.data.metrics["test/ece"] == pytest.approx(0.125)
        assert run.data.tags["lungcal.site"] == "site-a" and run.data.params["lr"] == "0.01"
        # artifacts went through the server into its artifacts destination
        assert run.info.artifact_uri.startswith("mlflow-artifacts:")
        local = client.download_artifacts(run.info.run_id, "config/resolved.json", str(tmp_path))
        assert json.loads(open(local).read()) == {"resolved": True}
        assert list(art.rglob("resolved.json")), "artifact not stored under --artifacts-destination"
        assert db.exists() and not (tmp_path / "mlruns").exists()  # SQL backend, not a file store
    with pytest.raises(OSError):  # stopped with its workers: nothing answers on the port any more
        urllib.request.urlopen(url + "/health", timeout=2)
