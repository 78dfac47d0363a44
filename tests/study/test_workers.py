"""``lungcal study --workers N``: jobs in parallel processes against one store, SQLite or PostgreSQL.

The scheduler is checked with a thread runner that meets a barrier (two stage-1 jobs must run at
the same time, or the barrier times out) and records when each job starts and ends. The store
tests run the study's fake bundles (``tests/study/test_runner.py``: real MONAI bundle configs that
open real :class:`~lungcal.tracking.RunTracker` runs) as ``python -m monai.bundle run``
subprocesses, two at a time, against SQLite and against a fresh PostgreSQL database made for the
test and dropped after it (skipped where psycopg is missing or no server answers at
``$LUNGCAL_TEST_PG``, default ``postgresql://postgres@127.0.0.1:5432/test``).
"""
from __future__ import annotations

import importlib.util
import json
import os
import shlex
import socket
import threading
import uuid
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient
from sqlalchemy.engine import make_url

from lungcal.cli import main
from lungcal.errors import ConfigError, TrackingError
from lungcal.study.runner import TAG_STUDY_KEY, inprocess_runner, plan_study, run_study
from lungcal.tracking.commands import ui_command
from lungcal.tracking.names import ENV_STUDY_JOB, TAG_STAGE1, TAG_STAGE2, TAG_STUDY_JOB
from lungcal.tracking.tracker import artifact_root_for, check_tracking_uri, privacy_filter, redact_uri
from tests.study.test_runner import LAS_BUNDLE, _stage1_bundle

PG_ADMIN = os.environ.get("LUNGCAL_TEST_PG", "postgresql://postgres@127.0.0.1:5432/test")


@pytest.fixture
def bundles(tmp_path):
    d = tmp_path / "bundles"
    d.mkdir()
    for method in ("ce", "focal"):
        (d / f"nlst_{method}.json").write_text(json.dumps(_stage1_bundle(method)))
    (d / "nlst_las.json").write_text(json.dumps(LAS_BUNDLE))
    return d


def _pg_database():
    """Create a uniquely named database on the test server; yield its URI; drop it."""
    psycopg = pytest.importorskip("psycopg", reason="psycopg is not installed (pip install -e '.[team]')")
    admin = make_url(PG_ADMIN)
    try:
        socket.create_connection((admin.host or "127.0.0.1", admin.port or 5432), timeout=2).close()
    except OSError as exc:
        pytest.skip(f"no PostgreSQL answers at {admin.host}:{admin.port or 5432} ({exc}); set LUNGCAL_TEST_PG")
    users = [admin.username] if admin.username else []
    users += [u for u in ("postgres", "root") if u not in users]
    conn, user = None, None
    for user in users:
        try:
            conn = psycopg.connect(host=admin.host, port=admin.port or 5432, user=user, password=admin.password,
                                   dbname=admin.database or "postgres", autocommit=True, connect_timeout=5)
            break
        except psycopg.OperationalError as exc:
            error = exc
    if conn is None:
        pytest.skip(f"cannot log in to PostgreSQL at {admin.host} as {users}: {str(error).splitlines()[0]}")
    name = f"lungcal_test_{uuid.uuid4().hex[:12]}"
    try:
        conn.execute(f'CREATE DATABASE "{name}"')
    except psycopg.Error as exc:
        conn.close()
        pytest.skip(f"user {user!r} may not create a database: {str(exc).splitlines()[0]}")
    uri = admin.set(username=user, database=name).render_as_string(hide_password=False)
    try:
        yield uri
    finally:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        conn.close()


@pytest.fixture(params=["sqlite", "postgresql"])
def store(request, tmp_path):
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'mlflow.db'}"
    else:
        yield from _pg_database()


def _study_runs(uri: str) -> list:
    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("nlst")
    return client.search_runs([exp.experiment_id], max_results=1000)


def _two_worker_study(store: str, bundles: Path, stage2: list[str], capsys) -> None:
    """``lungcal study --workers 2`` on the fake bundles: every run once, FINISHED; a rerun skips all."""
    args = ["study", "--stage1", "ce", "focal", "--stage2", *stage2, "--bundle-dir", str(bundles),
            "--tracking-uri", store, "--workers", "2", "-o", "epochs=1"]
    n_jobs = 4 if "las" in stage2 else 2
    assert main(args) == 0
    assert f"study: {n_jobs} finished, 0 skipped, 0 failed" in capsys.readouterr().out

    runs = _study_runs(store)
    got = sorted((r.data.tags[TAG_STAGE1], r.data.tags[TAG_STAGE2]) for r in runs)
    assert got == [(m, s) for m in ("ce", "focal") for s in sorted(stage2)]  # each run once
    assert all(r.info.status == "FINISHED" for r in runs)
    assert all(r.data.tags.get(TAG_STUDY_KEY) and r.data.tags.get(TAG_STUDY_JOB) for r in runs)
    assert all(r.data.params.get("epochs") == "1" for r in runs if r.data.tags[TAG_STAGE2] == "none")
    by = {(r.data.tags[TAG_STAGE1], r.data.tags[TAG_STAGE2]): r for r in runs}
    for m in ("ce", "focal"):  # each stage-2 run hangs off its own method's stage-1 run
        for s2 in set(stage2) - {"none"}:
            assert by[(m, s2)].data.tags["lungcal.parent_run"] == by[(m, "none")].info.run_id
    logs = list((Path(os.environ["LUNGCAL_HOME"]) / "study_logs").glob("*.log"))
    assert logs and not any("database is locked" in p.read_text() for p in logs)

    # resume: nothing left to run, nothing logged twice
    assert main(args) == 0
    assert f"study: 0 finished, {n_jobs} skipped, 0 failed" in capsys.readouterr().out
    assert len(_study_runs(store)) == len(got)


def test_two_workers_log_every_run_once_and_finished(store, bundles, tmp_path, monkeypatch, capsys):
    """The team store's acceptance test: two stage-1 jobs at once, as two processes, on one store."""
    monkeypatch.chdir(tmp_path)
    _two_worker_study(store, bundles, ["none", "ts"], capsys)


@pytest.mark.slow  # four bundle processes, two rounds: ~30 s of CPU per store, minutes on shared cores
def test_two_workers_run_the_grid_with_las_jobs_after_their_stage1(store, bundles, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    _two_worker_study(store, bundles, ["none", "ts", "las"], capsys)


def _thread_runner(uri: str, events: list, barrier: threading.Barrier, fail: set[str]):
    """A runner that logs the runs a job would log, straight through MLflow, from a worker thread."""
    lock = threading.Lock()

    def runner(bundle, overrides, cwd, log, env=None):
        last = bundle[-1]  # a stage-1 job runs [base, variant]; the variant names the method
        method = json.loads(last.read_text())["stage1"] if last.name != "nlst_las.json" else None
        kind = "las" if method is None else "stage1"
        if method is None:
            client = MlflowClient(tracking_uri=uri)
            method = client.get_run(str(overrides["stage1_run_id"])).data.tags[TAG_STAGE1]
        with lock:
            events.append(("start", method, kind))
        if kind == "stage1":
            barrier.wait()  # both stage-1 jobs run at once, or this times out
        log.write_text("ran\n")
        rc = 1 if method in fail and kind == "stage1" else 0
        if rc == 0:
            client = MlflowClient(tracking_uri=uri)
            exp = client.get_experiment_by_name("nlst") or client.get_experiment(client.create_experiment("nlst"))
            for s2 in (["none", "ts"] if kind == "stage1" else ["las"]):
                run = client.create_run(exp.experiment_id, tags={TAG_STAGE1: method, TAG_STAGE2: s2,
                                                                 TAG_STUDY_JOB: env[ENV_STUDY_JOB]})
                client.set_terminated(run.info.run_id, "FINISHED")
        with lock:
            events.append(("end", method, kind))
        return rc

    return runner


def test_scheduler_runs_stage1_jobs_together_and_las_after_its_stage1(store, bundles, tmp_path):
    uri = store
    plan = plan_study(["nlst"], stage1=["ce", "focal"], tracking_uri=uri, bundle_dir=bundles,
                      output_dir=tmp_path / "out")
    events: list = []
    plan.runner = _thread_runner(uri, events, threading.Barrier(2, timeout=60), fail={"focal"})
    results = run_study(plan, progress=False, workers=2)
    assert [(r.job.stage1, r.job.kind, r.status) for r in results] == [
        ("ce", "stage1", "finished"), ("ce", "las", "finished"),
        ("focal", "stage1", "failed"), ("focal", "las", "failed")]
    assert results[2].message == "exit code 1" and results[3].message == "its stage-1 job failed"
    assert events.index(("start", "ce", "las")) > events.index(("end", "ce", "stage1"))
    assert ("start", "focal", "las") not in events
    assert len(results[0].run_ids) == 2 and len(results[1].run_ids) == 1


def test_workers_errors(bundles, tmp_path, monkeypatch, capsys):
    uri = f"sqlite:///{tmp_path / 'e.db'}"
    plan = plan_study(["nlst"], stage1=["ce"], tracking_uri=uri, bundle_dir=bundles, output_dir=tmp_path / "out")
    with pytest.raises(ConfigError, match="--workers"):
        run_study(plan, progress=False, workers=0)
    plan.runner = inprocess_runner
    with pytest.raises(ConfigError, match="in-process"):
        run_study(plan, progress=False, workers=2)
    monkeypatch.chdir(tmp_path)
    assert main(["study", "--stage1", "ce", "--bundle-dir", str(bundles), "--tracking-uri", uri,
                 "--in-process", "--workers", "2"]) == 2
    assert "--in-process runs one job at a time" in capsys.readouterr().err


def test_postgresql_uris_are_checked_in_one_line_and_passwords_never_shown():
    assert redact_uri("postgresql://me:s3cret@db.example:5432/mlflow") == "postgresql://me:***@db.example:5432/mlflow"
    assert redact_uri("postgresql://me@db/mlflow") == "postgresql://me@db/mlflow"
    pytest.importorskip("psycopg", reason="psycopg is not installed (pip install -e '.[team]')")
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(TrackingError, match="cannot connect to the PostgreSQL store.*refused") as info:
        check_tracking_uri(f"postgresql://me:s3cret@127.0.0.1:{port}/mlflow", timeout=2)
    assert "s3cret" not in str(info.value) and "***" in str(info.value)
    if importlib.util.find_spec("pg8000") is None:  # a driver SQLAlchemy knows that is not installed
        with pytest.raises(TrackingError, match="driver 'pg8000' is not installed"):
            check_tracking_uri("postgresql+pg8000://me@127.0.0.1/mlflow")


def test_a_database_store_is_private_and_keeps_artifacts_under_the_project(tmp_path, monkeypatch):
    monkeypatch.setenv("LUNGCAL_HOME", str(tmp_path))
    assert artifact_root_for("postgresql://me@db:5432/mlflow") == (tmp_path / "mlartifacts").as_uri()
    assert artifact_root_for("postgresql+psycopg://me@db/mlflow") == (tmp_path / "mlartifacts").as_uri()
    assert artifact_root_for("http://127.0.0.1:5000") is None
    params = privacy_filter({"tracking_uri": "postgresql://me:s3cret@db:5432/mlflow", "lr": "0.1"})
    assert params == {"tracking_uri": "postgresql://me:***@db:5432/mlflow", "lr": "0.1"}


def test_ui_opens_a_postgresql_store_without_showing_its_password(store, capsys):
    if not store.startswith("postgresql"):
        pytest.skip("the SQLite store is covered by tests/study/test_report.py")
    url = make_url(store).set(password="s3cret")
    uri = url.render_as_string(hide_password=False)
    cmd = ui_command(uri, port=5123)
    assert cmd[1:4] == ["ui", "--backend-store-uri", uri] and cmd[-3:] == ["127.0.0.1", "--port", "5123"]
    assert main(["ui", "--tracking-uri", uri, "--print-only"]) == 0
    out = capsys.readouterr().out
    assert "s3cret" not in out and f"--backend-store-uri {shlex.quote(redact_uri(uri))}" in out
    with pytest.raises(TrackingError, match="does not exist"):  # at once, not after MLflow's minutes of retries
        check_tracking_uri(make_url(store).set(database="lungcal_no_such_db").render_as_string(hide_password=False))
