"""Honest run states: a run whose process died is marked KILLED by the next command, and left out."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

from mlflow.tracking import MlflowClient

from lungcal import tracking
from lungcal.cli import main
from lungcal.tracking.liveness import owner_tags, process_alive, reap_orphaned_runs

GHOST = textwrap.dedent("""
    import os, signal, sys
    from lungcal.tracking import RunTracker
    tr = RunTracker("nlst", "ghost", tracking_uri=sys.argv[1],
                    tags={"lungcal.stage1": "ce", "lungcal.stage2": "none", "lungcal.dataset": "synthetic"})
    tr.log_metrics({"test/ece": 0.5, "test/acc": 0.5, "test/auc": 0.5})
    print(tr.run_id, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
""")


def _ghost(uri: str) -> str:
    out = subprocess.run([sys.executable, "-c", GHOST, uri], capture_output=True, text=True, timeout=120)
    assert out.returncode == -signal.SIGKILL, out.stderr[-2000:]
    return out.stdout.split()[0]


def test_owner_liveness():
    assert process_alive(owner_tags()) is True
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    tags = owner_tags(dead.pid)
    dead.wait()
    assert process_alive(tags) is False
    assert process_alive({**owner_tags(), tracking.TAG_OWNER_HOST: "another-host"}) is None
    # a recycled pid (a live process with that number, started at another time) is not the owner
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert process_alive(owner_tags(other.pid)) is True
        assert process_alive({**owner_tags(other.pid), tracking.TAG_OWNER_START: "boot:1"}) is False
    finally:
        other.kill()
        other.wait()


def test_sigkilled_run_is_marked_killed_by_the_next_report_and_left_out(tmp_path, capsys):
    uri = tracking.default_tracking_uri(tmp_path)
    ghost = _ghost(uri)
    client = MlflowClient(uri)
    assert client.get_run(ghost).info.status == "RUNNING"
    with tracking.RunTracker("nlst", "alive", tracking_uri=uri,
                             tags={tracking.TAG_STAGE1: "focal", tracking.TAG_STAGE2: "none"}) as live:
        # opening a run is "the next command that touches the store": the ghost is gone already,
        assert client.get_run(ghost).info.status == "KILLED"
        # and a live run is never reaped, whoever looks
        assert reap_orphaned_runs(client, [client.get_experiment_by_name("nlst").experiment_id]) == []
        assert client.get_run(live.run_id).info.status == "RUNNING"
        live.log_metrics({"test/ece": 0.1, "test/acc": 0.8, "test/auc": 0.9})
    assert client.get_run(ghost).info.status == "KILLED"
    assert client.get_run(ghost).data.tags[tracking.TAG_ENDED_BY] == "reaper"

    ghost2 = _ghost(uri)
    out = str(tmp_path / "r")
    assert main(["report", "--experiment", "nlst", "--tracking-uri", uri, "--out", out, "--no-log"]) == 0
    assert client.get_run(ghost2).info.status == "KILLED"
    table = (tmp_path / "r" / "report.csv").read_text()
    assert "focal" in table and ",ce," not in table  # the ghost's configuration is not in the report


def test_a_resumed_run_goes_back_to_running_and_ends_finished(tmp_path):
    uri = tracking.default_tracking_uri(tmp_path)
    ghost = _ghost(uri)
    client = MlflowClient(uri)
    with tracking.RunTracker("nlst", "ghost", tracking_uri=uri, run_id=ghost) as tr:
        assert tr.resumed and tr.run_id == ghost
        assert client.get_run(ghost).info.status == "RUNNING"
        assert client.get_run(ghost).data.tags[tracking.TAG_OWNER_PID] == str(os.getpid())
    assert client.get_run(ghost).info.status == "FINISHED"


def test_unreachable_server_is_one_line(tmp_path):
    rc = main(["report", "--experiment", "nlst", "--tracking-uri", "http://127.0.0.1:9", "--no-log"])
    assert rc == 2
