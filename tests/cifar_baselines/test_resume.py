"""Crash-safe CIFAR runs (issue 15): SIGKILL mid-training then rerun = one uninterrupted run, bit for bit.

The bundle is ``bundles/cifar10lt_focal_mixup.json`` over ``bundles/cifar10lt_ce.json`` (random crops/flips,
mixup, shuffled batches) on the tiny fake CIFAR folder, 4 epochs, run through ``python -m cifar_baselines`` in
subprocesses with the same thread settings.
"""
from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from lungcal.tracking import TAG_RESUMED_FROM, TAG_STAGE2, default_tracking_uri

ROOT = Path(__file__).resolve().parents[2]
BUNDLE = ["bundles/cifar10lt_ce.json", "bundles/cifar10lt_focal_mixup.json"]
EPOCHS = 4
ENV = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "2", "MKL_NUM_THREADS": "2"}
FINAL = ("test/acc", "test/ece", "test/nll", "val/ece", "val/acc")


def overrides(data: Path, out: Path, **kw) -> dict:
    return {"data_dir": str(data), "output_dir": str(out), "batch_size": 64, "n_bootstrap": 20, "val_per_class": 5,
            "epochs": EPOCHS, "warmup_epochs": 1, "lr_milestones": [2], "imb_factor": 0.1, **kw}


def command(over: dict) -> list[str]:
    cmd = [sys.executable, "-m", "cifar_baselines", *BUNDLE]
    for k, v in over.items():
        cmd += [f"--{k}", v if isinstance(v, str) else json.dumps(v)]
    return cmd


def cifar(over: dict) -> subprocess.CompletedProcess:
    return subprocess.run(command(over), cwd=ROOT, capture_output=True, text=True, timeout=600, env=ENV)


def stage1_runs(out: Path):
    client = MlflowClient(default_tracking_uri(out))
    exp = client.get_experiment_by_name("cifar10lt")
    return client, client.search_runs([exp.experiment_id], filter_string=f"tags.`{TAG_STAGE2}` = 'none'")


def curve(client, run_id: str, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


def test_sigkill_then_rerun_equals_an_uninterrupted_run(fake_cifar, tmp_path):
    ref_out, same_out, crash_out = tmp_path / "ref", tmp_path / "same", tmp_path / "crash"
    for out in (ref_out, same_out):
        proc = cifar(overrides(fake_cifar, out))
        assert proc.returncode == 0, proc.stderr[-3000:]

    over = overrides(fake_cifar, crash_out)
    proc = subprocess.Popen(command(over), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=ENV)
    deadline = time.time() + 600
    while not glob.glob(str(crash_out / "resume" / "*" / "resume_checkpoint_2.pt")) and time.time() < deadline:
        if proc.poll() is not None:
            pytest.fail("the run ended before it could be killed")
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()

    again = cifar(over)
    assert again.returncode == 0, again.stderr[-3000:]
    summary = json.loads(again.stdout[again.stdout.index("{"):])
    assert summary["resumed_from_epoch"] >= 2

    client, crash = stage1_runs(crash_out)
    assert [r.info.status for r in crash] == ["FINISHED"]  # one run: the killed one, resumed
    crash = crash[0]
    assert int(crash.data.tags[TAG_RESUMED_FROM]) >= 2
    _, (ref,) = stage1_runs(ref_out)
    _, (same,) = stage1_runs(same_out)
    for key in FINAL:
        assert same.data.metrics[key] == ref.data.metrics[key], key  # same seed -> same bits
        assert crash.data.metrics[key] == ref.data.metrics[key], key  # interrupted + resumed -> same bits
    for key in ("train/loss", "train/acc", "lr", "val/ece"):
        got = curve(client, crash.info.run_id, key)
        assert [s for s, _ in got] == list(range(EPOCHS)) or key == "val/ece", key
        assert got == curve(MlflowClient(default_tracking_uri(ref_out)), ref.info.run_id, key), key
    assert not list((crash_out / "resume").glob("*/*.pt"))


def test_unwritable_output_dir_is_one_line(fake_cifar, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    proc = cifar(overrides(fake_cifar, blocker / "runs"))
    assert proc.returncode == 2
    lines = [x for x in proc.stderr.splitlines() if x.startswith(("error:", "lungcal: error:"))]
    assert len(lines) == 1 and "output folder is not writable" in lines[0] and "Traceback" not in proc.stderr
