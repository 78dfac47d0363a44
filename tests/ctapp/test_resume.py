"""Crash-safe CT runs (issue 15): resume after SIGKILL, same seed -> same bits, output faults, fine-tuning.

Every run is the real bundle (``nlst_focal.json`` + ``nlst_focal_mixup.json``: dropout, augmentation and mixup, so
every random generator matters) on a 15-CT synthetic cohort at 5 mm, 4 epochs, through
``python -m monai.bundle run`` in a subprocess (the one that is killed, and its references, run
under the same thread settings).
"""
from __future__ import annotations

import errno
import glob
import io
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from mlflow.tracking import MlflowClient
from monai.bundle import run

from lungcal.runtime.exit_hook import find_lungcal_error
from lungcal.runtime.resume import (
    OutputError,
    RandomState,
    RunRecord,
    StepFilter,
    claim_identity,
    generators_of,
    release_identity,
    run_identity,
)
from lungcal.tracking import TAG_INIT_RUN, TAG_RESUMED_FROM, TAG_STAGE2, default_tracking_uri

ROOT = Path(__file__).resolve().parents[2]
BUNDLE = ["bundles/nlst_focal.json", "bundles/nlst_focal_mixup.json"]
EPOCHS = 4
#: the tiny phantoms are 5 mm CTs: the series checks' slice limits are relaxed for them
TINY_QC = {"_target_": "lungcal.ct.qc.QCConfig", "max_slice_thickness_mm": 6.0, "warn_slice_thickness_mm": 6.0,
           "max_pixel_mm": 6.0}
FINAL = ("test/auc", "test/ece", "test/nll", "test/brier", "best/val_auc", "best/epoch")


@pytest.fixture(scope="module")
def cohort(tiny_cohort) -> Path:
    return tiny_cohort  # the session's tiny cohort (tests/conftest.py)


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("runs")


def overrides(cohort: Path, store: Path, **kw) -> dict:
    return {"datalist": str(cohort), "output_dir": str(store), "epochs": EPOCHS, "n_bootstrap": 20,
            "num_workers": 0, "spacing": [5.0, 5.0, 5.0], "patch_size": 8, "batch_size": 4, "warmup_epochs": 0.5,
            "post_hoc": [], "qc": TINY_QC, **kw}


def command(over: dict) -> list[str]:
    cmd = [sys.executable, "-m", "monai.bundle", "run", "--config_file", str(BUNDLE)]
    for k, v in over.items():
        cmd += [f"--{k}", json.dumps(v) if not isinstance(v, str) else v]
    return cmd


ENV = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "2", "MKL_NUM_THREADS": "2"}


def bundle(over: dict, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run(command(over), cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=ENV)


def stage1_runs(store: Path, name: str):
    client = MlflowClient(default_tracking_uri(store))
    exp = client.get_experiment_by_name("nlst")
    if exp is None:
        return client, []
    runs = client.search_runs([exp.experiment_id], filter_string=f"tags.`{TAG_STAGE2}` = 'none'")
    return client, [r for r in runs if r.info.run_name == name]


def curve(client, run_id: str, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


def test_identity_ignores_run_name_and_output_paths():
    a = {"epochs": 3, "lr": 0.1, "run_name": "x", "output_dir": "/a", "tracking_uri": "sqlite:///a", "resume": True}
    b = {**a, "run_name": "y", "output_dir": "/b", "tracking_uri": "sqlite:///b", "resume": False}
    assert run_identity(a) == run_identity(b)
    assert run_identity(a) != run_identity({**a, "lr": 0.2})


def test_random_state_round_trips_every_generator():
    gen = torch.Generator().manual_seed(3)
    holder = type("H", (), {})()
    holder.generator = gen
    state = RandomState(generators_of(holder))
    assert list(state.generators) == ["0.generator"]
    saved = state.state_dict()
    buf = io.BytesIO()
    torch.save(saved, buf)
    first = (torch.rand(3), np.random.rand(3), random.random(), torch.rand(3, generator=gen))
    buf.seek(0)
    state.load_state_dict(torch.load(buf, weights_only=True))  # weights_only: no pickled code in the state
    again = (torch.rand(3), np.random.rand(3), random.random(), torch.rand(3, generator=gen))
    assert torch.equal(first[0], again[0]) and np.array_equal(first[1], again[1])
    assert first[2] == again[2] and torch.equal(first[3], again[3])


def test_run_record_carries_the_wall_time_of_earlier_processes(monkeypatch):
    clock = iter([100.0, 160.0, 500.0, 530.0, 900.0])  # process 1 starts, saves 60 s later; process 2 starts, ends
    monkeypatch.setattr(time, "monotonic", lambda: next(clock))
    first = RunRecord("abc")
    buf = io.BytesIO()
    torch.save(first.state_dict(), buf)  # saved at 160: 60 s of work
    buf.seek(0)
    second = RunRecord()
    second.load_state_dict(torch.load(buf, weights_only=True))
    assert second.run_id == "abc"
    assert second.elapsed_s() == pytest.approx(60.0 + 30.0)  # the 340 s between processes do not count
    older = RunRecord()
    older.load_state_dict({"run_id": "abc"})  # a state saved before the wall time was recorded
    assert older.prior_s == 0.0 and older.run_id == "abc"


def test_step_filter_logs_each_point_once():
    got = []
    f = StepFilter(lambda m, s: got.append((dict(m), s)))
    f.logged = {"val/auc": {1, 2}}
    f({"val/auc": 0.5, "train/loss": 1.0}, 2)
    f({"val/auc": 0.6}, 3)
    assert got == [({"train/loss": 1.0}, 2), ({"val/auc": 0.6}, 3)]


def test_sigkill_then_rerun_equals_an_uninterrupted_run_in_one_mlflow_run(cohort, store):
    ref = bundle(overrides(cohort, store, run_name="ref"))
    assert ref.returncode == 0, ref.stderr[-3000:]
    same = bundle(overrides(cohort, store, run_name="same_seed"))  # (f): same seed -> same bits
    assert same.returncode == 0, same.stderr[-3000:]

    over = overrides(cohort, store, run_name="crash")
    proc = subprocess.Popen(command(over), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=ENV)
    pattern = str(store / "resume" / "*" / "resume_checkpoint_2.pt")
    deadline = time.time() + 600
    while not glob.glob(pattern) and proc.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    assert proc.poll() is None, "the run ended before it could be killed"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    client, runs = stage1_runs(store, "crash")
    assert len(runs) == 1 and runs[0].info.status == "RUNNING"  # a ghost until someone looks

    again = bundle(over)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed from epoch" in again.stdout
    client, runs = stage1_runs(store, "crash")
    assert len(runs) == 1, [r.info.status for r in runs]
    crash = runs[0]
    assert crash.info.status == "FINISHED" and int(crash.data.tags[TAG_RESUMED_FROM]) >= 2
    (r_ref,), (r_same,) = stage1_runs(store, "ref")[1], stage1_runs(store, "same_seed")[1]
    for key in FINAL:
        assert r_same.data.metrics[key] == r_ref.data.metrics[key], key
        assert crash.data.metrics[key] == r_ref.data.metrics[key], key
    for key, first in (("train/loss", 1), ("train/lr", 1), ("val/auc", 0), ("val/ece", 0)):
        got = curve(client, crash.info.run_id, key)  # step 0 of val/*: the final report of the best model
        assert [s for s, _ in got] == list(range(first, EPOCHS + 1)), key  # continuous, each epoch once
        assert got == curve(client, r_ref.info.run_id, key), key
    assert not list((store / "resume").glob("*/*.pt"))  # a finished run leaves no resume state


def test_resume_false_starts_afresh(cohort, store):
    over = overrides(cohort, store, run_name="fresh", epochs=2)
    proc = subprocess.Popen(command(over), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=ENV)
    deadline = time.time() + 600
    while not glob.glob(str(store / "resume" / "*" / "resume_checkpoint_1.pt")) and time.time() < deadline:
        if proc.poll() is not None:
            pytest.fail("the run ended before it could be killed")
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    again = bundle({**over, "resume": False})
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed from epoch" not in again.stdout
    client, runs = stage1_runs(store, "fresh")
    statuses = sorted(r.info.status for r in runs)
    assert statuses == ["FINISHED", "KILLED"], statuses  # the ghost is reaped, the new run is separate


def test_unwritable_output_dir_is_one_line_before_any_work(cohort, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    proc = bundle(overrides(cohort, blocker / "runs"), timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("lungcal: error:")]
    assert len(errors) == 1 and "output folder is not writable" in errors[0] and "Traceback" not in proc.stderr


def test_disk_full_while_writing_a_checkpoint_is_one_line_and_leaves_no_half_file(cohort, store, monkeypatch):
    real_save = torch.save

    def full_disk(obj, f, *args, **kwargs):
        name = os.readlink(f"/proc/self/fd/{f.fileno()}") if hasattr(f, "fileno") else str(f)
        if "resume_checkpoint_2" in name:
            f.write(b"half a checkpoint")
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", full_disk)
    monkeypatch.chdir(ROOT)
    # the store is the module's: a run another test SIGKILLed may have left its own checkpoint write behind,
    # in its own run folder; only a temporary file this run leaves counts
    before = set(store.rglob(".*.tmp"))
    with pytest.raises(Exception) as info:  # noqa: B017 - MONAI wraps it; the LungcalError is in the chain
        run(config_file=BUNDLE, logging_file=False, **overrides(cohort, store, run_name="full", epochs=3))
    error = find_lungcal_error(info.value)
    assert isinstance(error, OutputError) and "disk full" in str(error) and "\n" not in str(error)
    assert not set(store.rglob(".*.tmp")) - before, "a half-written temporary file was left"
    states = list((store / "resume").glob("*/resume_checkpoint_*.pt"))
    assert [p.name for p in states] == ["resume_checkpoint_1.pt"]
    trainer = torch.load(states[0], weights_only=True)["trainer"]  # the previous state is whole
    assert trainer["iteration"] == trainer["epoch_length"]
    _, runs = stage1_runs(store, "full")
    assert [r.info.status for r in runs] == ["FAILED"]


def test_init_run_id_starts_from_the_parent_weights(cohort, store, monkeypatch):
    monkeypatch.chdir(ROOT)
    run(config_file=BUNDLE, logging_file=False, **overrides(cohort, store, run_name="parent", epochs=2))
    _, (parent,) = stage1_runs(store, "parent")
    run(config_file=BUNDLE, logging_file=False,
        **overrides(cohort, store, run_name="finetune", epochs=1, init_run_id=parent.info.run_id))
    client, (child,) = stage1_runs(store, "finetune")
    assert child.data.tags[TAG_INIT_RUN] == parent.info.run_id
    # before any training the child is the parent: its validation logits give the parent's final val report
    parent_val = {k: dict((m.step, m.value) for m in client.get_metric_history(parent.info.run_id, f"val/{k}"))[0]
                  for k in ("auc", "ece", "nll")}
    for k, v in parent_val.items():
        assert child.data.metrics[f"val_init/{k}"] == v, k


def test_las_interrupted_after_its_run_opened_is_rerun_into_the_same_run(cohort, store, monkeypatch):
    monkeypatch.chdir(ROOT)
    _, parents = stage1_runs(store, "parent")
    if not parents:
        run(config_file=BUNDLE, logging_file=False, **overrides(cohort, store, run_name="parent", epochs=2))
        _, parents = stage1_runs(store, "parent")
    las = {k: v for k, v in overrides(cohort, store, run_name="las_crash", epochs=3).items()
           if k not in ("warmup_epochs", "post_hoc", "qc", "spacing", "patch_size")}
    las["stage1_run_id"] = parents[0].info.run_id

    def crash(*args, **kwargs):
        raise OSError(errno.EIO, "simulated crash while logging")

    with monkeypatch.context() as m:
        m.setattr("lungcal.ctapp.train.las.log_split", crash)
        with pytest.raises(Exception):  # noqa: B017 - MONAI wraps the OSError
            run(config_file="bundles/nlst_las.json", logging_file=False, **las)
    run(config_file="bundles/nlst_las.json", logging_file=False, **las)
    client = MlflowClient(default_tracking_uri(store))
    exp = client.get_experiment_by_name("nlst")
    runs = [r for r in client.search_runs([exp.experiment_id], filter_string=f"tags.`{TAG_STAGE2}` = 'las'")
            if r.info.run_name == "las_crash"]
    assert [r.info.status for r in runs] == ["FINISHED"] and "test/ece" in runs[0].data.metrics
    assert not list((store / "resume").glob("*/run.json"))


def test_one_run_identity_runs_in_one_process_at_a_time(tmp_path):
    """A second process training the same bundle with the same settings is refused in one line."""


    ident = tmp_path / "resume" / "abc123"
    claim_identity(ident)
    claim_identity(ident)  # the same process may claim it again (a rerun after a failure)
    code = ("import sys\nfrom lungcal.runtime.resume import claim_identity\n"
            "from lungcal.errors import ConfigError\n"
            "try:\n    claim_identity(sys.argv[1])\nexcept ConfigError as e:\n    print(e); sys.exit(2)\n")
    out = subprocess.run([sys.executable, "-c", code, str(ident)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "already running in another process" in out.stdout
    release_identity(ident)
    out = subprocess.run([sys.executable, "-c", code, str(ident)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
