"""Benchmark: many writers on one MLflow store (SQLite vs PostgreSQL), and a study on 1 vs N workers (issue 17, item 5).

Run: python scripts/bench_study_workers.py [--processes [1 2 4]] [--steps 200] [--metrics 10] [--workers 1 2]
         [--pg postgresql://postgres@127.0.0.1:5432/test] [--skip-study]

1. **writers**: P processes each open a :class:`~lungcal.tracking.RunTracker` run on the same
   store and log ``--steps`` batches of ``--metrics`` metrics as fast as they can (far above a
   training run's one batch per epoch), then end the run. Per store and P: wall seconds, batches/s
   over all processes, the number of writes that failed (and how many of those said
   ``database is locked``), runs left not FINISHED; throughput ratio to P = 1.
2. **study**: ``lungcal study`` on two stage-1 fake bundles (each a real ``python -m monai.bundle
   run`` subprocess that opens a stage-1 and a linked TS run, as in ``tests/study``), with
   ``--workers`` 1 and N: wall seconds, ratio to 1 worker, and whether each logged every run once.

PostgreSQL runs in a fresh database made on the ``--pg`` server for the bench and dropped after;
it is skipped (with the reason) where psycopg is missing or the server does not answer. Timings on
a shared machine vary with its load: compare ratios within one invocation.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from mlflow.tracking import MlflowClient
from sqlalchemy.engine import make_url

from lungcal.tracking import RunTracker
from lungcal.tracking.tracker import open_store, redact_uri

ROOT = Path(__file__).resolve().parents[1]


@contextmanager
def fresh_pg_database(admin_uri: str) -> Iterator[str | None]:
    """A new, uniquely named database on the server of ``admin_uri`` (dropped after); ``None`` if unavailable."""
    try:
        import psycopg  # noqa: PLC0415 - optional ([team] extra)
    except ImportError:
        print("  postgresql: skipped (psycopg is not installed: pip install -e '.[team]')")
        yield None
        return
    url = make_url(admin_uri)
    try:
        conn = psycopg.connect(host=url.host, port=url.port or 5432, user=url.username, password=url.password,
                               dbname=url.database or "postgres", autocommit=True, connect_timeout=5)
    except psycopg.OperationalError as exc:
        print(f"  postgresql: skipped ({str(exc).splitlines()[0]})")
        yield None
        return
    name = f"lungcal_bench_{uuid.uuid4().hex[:12]}"
    conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield url.set(database=name).render_as_string(hide_password=False)
    finally:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        conn.close()


def _writer(uri: str, index: int, steps: int, metrics: int, ready: mp.Queue, start: mp.Event, out: mp.Queue) -> None:
    errors: list[str] = []
    t0 = time.perf_counter()
    try:
        with RunTracker("bench", f"writer{index}", tracking_uri=uri) as tr:
            ready.put(index)
            start.wait()
            t0 = time.perf_counter()
            for step in range(steps):
                try:
                    tr.log_metrics({f"m{k}": step * 0.1 + k for k in range(metrics)}, step=step)
                except Exception as exc:  # noqa: BLE001 - counted, not fatal: this is what is measured
                    errors.append(str(exc).splitlines()[0])
    except Exception as exc:  # noqa: BLE001 - opening or ending the run failed: counted too
        errors.append(f"run: {str(exc).splitlines()[0]}")
        ready.put(index)
    finally:
        out.put((index, time.perf_counter() - t0, errors))


def bench_writers(uri: str, processes: int, steps: int, metrics: int) -> dict:
    open_store(uri)  # tables made once, as `lungcal study` does
    ctx = mp.get_context("spawn")
    ready, start, out = ctx.Queue(), ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_writer, args=(uri, i, steps, metrics, ready, start, out)) for i in range(processes)]
    for p in procs:
        p.start()
    for _ in procs:  # every writer has imported and opened its run: time the writes only
        ready.get(timeout=1800)
    t0 = time.perf_counter()
    start.set()
    got = [out.get(timeout=1800) for _ in procs]
    wall = time.perf_counter() - t0
    for p in procs:
        p.join()
    errors = [e for _, _, errs in got for e in errs]
    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("bench")
    runs = client.search_runs([exp.experiment_id], max_results=1000)
    return {"wall": wall, "batches_per_s": processes * steps / wall, "failed": len(errors),
            "locked": sum("locked" in e for e in errors),
            "not_finished": sum(r.info.status != "FINISHED" for r in runs),
            "exit_codes": [p.exitcode for p in procs], "sample": errors[:1]}


STAGE1 = {
    "tracking_uri": "sqlite:///unused.db", "epochs": 100, "stage1": "@method",
    "s1": {"_target_": "lungcal.tracking.RunTracker", "experiment": "nlst", "run_name": "$'bench_' + @method",
           "tracking_uri": "@tracking_uri",
           "tags": {"lungcal.dataset": "synthetic", "lungcal.stage1": "@method", "lungcal.stage2": "none"}},
    "ts": {"_target_": "lungcal.tracking.RunTracker", "experiment": "nlst", "run_name": "$'bench_' + @method + '_ts'",
           "tracking_uri": "@tracking_uri", "parent_run_id": "$@s1.run_id",
           "tags": {"lungcal.dataset": "synthetic", "lungcal.stage1": "@method", "lungcal.stage2": "ts"}},
    "run": ["$@s1.log_params({'epochs': @epochs})", "$@s1.log_report('test', {'ece': 0.2})", "$@s1.end()",
            "$@ts.log_report('test', {'ece': 0.05})", "$@ts.end()"],
}


def bench_study(uri: str, workers: int, bundle_dir: Path, home: Path) -> dict:
    cmd = [sys.executable, "-m", "lungcal", "study", "--stage1", "ce", "focal", "--stage2", "none", "ts",
           "--bundle-dir", str(bundle_dir), "--tracking-uri", uri, "--workers", str(workers)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "LUNGCAL_HOME": str(home)})
    wall = time.perf_counter() - t0
    client = MlflowClient(tracking_uri=uri)
    runs = client.search_runs([client.get_experiment_by_name("nlst").experiment_id], max_results=1000)
    pairs = sorted((r.data.tags["lungcal.stage1"], r.data.tags["lungcal.stage2"]) for r in runs)
    logs = "".join(p.read_text() for p in (home / "study_logs").glob("*.log"))
    return {"wall": wall, "rc": proc.returncode, "runs_once": pairs == [(m, s) for m in ("ce", "focal")
                                                                        for s in ("none", "ts")],
            "all_finished": all(r.info.status == "FINISHED" for r in runs), "locked": "database is locked" in logs}


@contextmanager
def store(kind: str, tmp: Path, tag: str, pg: str) -> Iterator[str | None]:
    """A fresh store of ``kind``: a new SQLite file, or a new PostgreSQL database (``None`` if unavailable)."""
    if kind == "sqlite":
        yield f"sqlite:///{tmp / f'{tag}.db'}"
    else:
        with fresh_pg_database(pg) as uri:
            yield uri


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--processes", type=int, nargs="*", default=[1, 2, 4], help="writer counts (none: skip part 1)")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--metrics", type=int, default=10)
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--pg", default="postgresql://postgres@127.0.0.1:5432/test", help="an existing database to "
                    "connect to; the bench makes and drops its own beside it")
    ap.add_argument("--skip-study", action="store_true")
    args = ap.parse_args()
    print(f"cpus: {os.cpu_count()}, load average: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    with tempfile.TemporaryDirectory() as tmpdir:
        tmp = Path(tmpdir)
        if args.processes:
            print(f"1. writers: {args.steps} batches x {args.metrics} metrics per process, one store")
        for kind in ("sqlite", "postgresql") if args.processes else ():
            base = None
            for p in args.processes:
                with store(kind, tmp, f"w{p}", args.pg) as uri:
                    if uri is None:
                        break
                    r = bench_writers(uri, p, args.steps, args.metrics)
                base = base or r["batches_per_s"]
                print(f"  {kind:<10} P={p}: {r['wall']:6.1f} s, {r['batches_per_s']:6.1f} batches/s "
                      f"(x{r['batches_per_s'] / base:.2f} vs P={args.processes[0]}), failed {r['failed']} "
                      f"(locked {r['locked']}), not FINISHED {r['not_finished']}, exit codes {r['exit_codes']}"
                      + (f", e.g. {r['sample'][0]}" if r["sample"] else ""))
        if args.skip_study:
            return
        bdir = tmp / "bundles"
        bdir.mkdir()
        for m in ("ce", "focal"):
            (bdir / f"nlst_{m}.json").write_text(json.dumps({**STAGE1, "method": m}))
        print("2. study: lungcal study --stage1 ce focal --stage2 none ts (fake bundles, 2 subprocess jobs)")
        for kind in ("sqlite", "postgresql"):
            base = None
            for w in args.workers:
                home = tmp / f"home_{kind}_{w}"
                home.mkdir()
                with store(kind, tmp, f"s{w}", args.pg) as uri:
                    if uri is None:
                        break
                    r = bench_study(uri, w, bdir, home)
                base = base or r["wall"]
                print(f"  {kind:<10} workers={w}: {r['wall']:6.1f} s (x{base / r['wall']:.2f} faster than "
                      f"{args.workers[0]}), exit {r['rc']}, every run once {r['runs_once']}, all FINISHED "
                      f"{r['all_finished']}, 'database is locked' in logs {r['locked']}  [{redact_uri(uri)}]")


if __name__ == "__main__":
    main()
