"""Data-parallel runs: ``bundles/multi_gpu.json`` under ``torchrun`` with gloo on the CPU.

The end-to-end runs (a CT and a CIFAR bundle under ``torchrun --nproc_per_node 2``) take one to
two minutes on two shared cores and are marked slow; the fast check below spawns two gloo
processes that exercise the same pieces (shards, gathered validation metrics, rank 0 first, the
resume state), and the checkpoints' ``module.`` prefix and the missing-launcher error are checked
in one process.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from mlflow.tracking import MlflowClient

from cifar_baselines.bundle import recipe_files
from cifar_baselines.resnet import resnet32
from cifar_baselines.stages import Stage1Model
from lungcal.calibration.handlers import CalibrationMetrics
from lungcal.ctapp.model.checkpoint import load_stage1
from lungcal.data.manifest import load_manifest, rows_for_split
from lungcal.runtime.bundle_config import build_section
from lungcal.runtime.distributed import ENV, plain_state_dict, unwrap
from lungcal.tracking import TAG_STAGE2, default_tracking_uri
from lungcal.tracking.server import free_port
from tests.bundles import ddp_workers

ROOT = Path(__file__).resolve().parents[2]
#: series checks that accept the tiny cohort's 5 mm slices and pixels (as in test_ct_bundles.py)
TINY_QC = {"_target_": "lungcal.ct.qc.QCConfig", "max_slice_thickness_mm": 6.0, "warn_slice_thickness_mm": 6.0,
           "max_pixel_mm": 6.0}
CIFAR_TINY = {"epochs": 1, "warmup_epochs": 1, "lr_milestones": [1], "batch_size": 32, "subset": 100,
              "n_bootstrap": 10, "val_per_class": 5}


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ENV}
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    return env


def _cli(config_files: list[str], overrides: dict) -> list[str]:
    args = ["--config_file", json.dumps(config_files)]
    for k, v in overrides.items():
        args += [f"--{k}", v if isinstance(v, str) else json.dumps(v)]
    return args


def torchrun(bundle: str, overrides: dict, nproc: int = 2) -> subprocess.CompletedProcess:
    """``torchrun --nproc_per_node <nproc> -m monai.bundle run`` of ``bundle`` (a CIFAR recipe over its base) +
    ``multi_gpu.json``, from the root."""
    files = recipe_files(bundle) if bundle.startswith("cifar") else [f"bundles/{bundle}.json"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", str(nproc),
           "--master_addr", "127.0.0.1", "--master_port", str(free_port()), "-m", "monai.bundle", "run",
           *_cli([*files, "bundles/multi_gpu.json"], overrides)]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900, env=_env())


def test_two_gloo_ranks_shard_gather_and_share_the_resume_state(tmp_path):
    mp.spawn(ddp_workers.worker, args=(free_port(), str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert (r0["backend"], r0["world_size"], r1["rank"]) == ("gloo", 2, 1)
    # torch's rank-prefixing excepthook would swallow the one-line error: lungcal's is put back on top
    assert r0["lungcal_hook_on_top"] and r1["lungcal_hook_on_top"]
    # validation: each case in exactly one shard, no padding; training: equal shards (DDP steps in lockstep)
    assert sorted(r0["val"] + r1["val"]) == list(range(ddp_workers.N_CASES))
    assert len(r0["train"]) == len(r1["train"]) == 4 and set(r0["train"] + r1["train"]) == set(range(7))
    # the gathered metrics are the whole split's, the same on both ranks, each case counted once
    logits, labels = ddp_workers.split_logits()
    whole = CalibrationMetrics(n_bins=5, key="auc")
    whole.update((logits, labels))
    want = whole.compute()
    assert want["n"] == ddp_workers.N_CASES
    for got in (r0["metrics"], r1["metrics"]):
        assert got == pytest.approx(want, abs=1e-12)
    assert r0["loss"] == r1["loss"] == pytest.approx(1.5)
    assert not r0["saw_rank0_file"] and r1["saw_rank0_file"]  # rank 1 ran the block after rank 0
    # rank 0 owns the resume state; both ranks restored rank 0's file
    assert (r0["writer"], r1["writer"]) == (True, False)
    assert r0["weight_after_load"] == r1["weight_after_load"] == [2.0, 2.0]


def test_checkpoints_of_a_wrapped_network_load_without_the_module_prefix(tmp_path):
    net = torch.nn.Sequential(torch.nn.Linear(3, 2))
    wrapped = torch.nn.DataParallel(net)
    assert unwrap(wrapped) is net
    old = wrapped.state_dict()  # what an older DDP checkpoint held: "module.0.weight", ...
    assert all(k.startswith("module.") for k in old)
    assert list(plain_state_dict(old)) == list(net.state_dict())
    # a CT stage-1 checkpoint written from a wrapper by an older version
    network_def = {"_target_": "lungcal.mil.LogSumExpMIL", "encoder": {"_target_": "lungcal.mil.SmallCNNEncoder",
                                                                       "embed_dim": 8}, "embed_dim": 8, "attn_dim": 8}
    ct = load_stage1(None, "sqlite:///unused.db", checkpoint=_write_ct(tmp_path, network_def, prefix=True))
    ref = load_stage1(None, "sqlite:///unused.db", checkpoint=_write_ct(tmp_path, network_def, prefix=False))
    for (k, a), (k2, b) in zip(ct.network.state_dict().items(), ref.network.state_dict().items()):
        assert k == k2 and torch.equal(a, b)
    # a CIFAR one
    src = resnet32()
    into = Stage1Model({f"module.{k}": v for k, v in src.state_dict().items()}).load_into(resnet32())
    assert all(torch.equal(a, b) for a, b in zip(into.state_dict().values(), src.state_dict().values()))


def _write_ct(tmp_path: Path, network_def: dict, prefix: bool) -> Path:
    torch.manual_seed(0)
    sd = build_section(network_def).state_dict()
    path = tmp_path / f"ct_{prefix}.pt"
    torch.save({"state_dict": {("module." if prefix else "") + k: v for k, v in sd.items()}, "epoch": 1,
                "metric": 0.5, "network_def": network_def, "bag_params": "{}", "method": "ce"}, path)
    return path


def test_multi_gpu_json_without_torchrun_is_one_line_naming_the_launch(tmp_path):
    cmd = [sys.executable, "-m", "monai.bundle", "run",
           *_cli(["bundles/nlst_focal.json", "bundles/multi_gpu.json"], {"output_dir": str(tmp_path)})]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env=_env())
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("lungcal: error:")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr
    assert "torchrun --nproc_per_node" in errors[0] and "RANK" in errors[0]


def _one_stage1_run(uri: str, experiment: str):
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name(experiment)
    runs = client.search_runs([exp.experiment_id], f"tags.`{TAG_STAGE2}` = 'none'")
    assert len(runs) == 1, [r.info.run_name for r in runs]  # one run, not one per rank
    return client, runs[0]


def _epoch_values(client, run, key: str) -> list[float]:
    """The values of ``key`` in the order they were logged (the epoch's, then the final evaluation's)."""
    history = client.get_metric_history(run.info.run_id, key)
    return [m.value for m in sorted(history, key=lambda m: (m.timestamp, -m.step))]


@pytest.mark.slow  # two processes importing torch, MONAI and MLflow, then 15 CTs of bags: 1-2 min on 2 cores
def test_ct_bundle_under_torchrun(tiny_cohort, tmp_path):
    store = tmp_path / "runs"
    proc = torchrun("nlst_focal", {"datalist": str(tiny_cohort), "output_dir": str(store), "epochs": 1,
                                   "n_bootstrap": 20, "num_workers": 0, "spacing": [5.0, 5.0, 5.0], "patch_size": 8,
                                   "batch_size": 4, "qc": TINY_QC, "run_name": "ddp"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("== lungcal focal (stage 1)") == 1  # rank 0 alone prints the summary
    client, run = _one_stage1_run(default_tracking_uri(store), "nlst")
    assert run.info.status == "FINISHED" and run.data.params["world_size"] == "2"
    # the validation metrics of the epoch cover every validation CT (gathered over both ranks) and equal
    # the single-process evaluation of the saved checkpoint after training
    n_val = len(rows_for_split(load_manifest(tiny_cohort), "val"))
    assert n_val >= 2 and _epoch_values(client, run, "val/n") == [n_val, n_val]
    for key in ("val/ece", "val/auc", "val/nll"):
        during, after = _epoch_values(client, run, key)
        assert during == pytest.approx(after, abs=1e-6), key
    # the checkpoint holds the bare network: it loads into a plain single-process network
    best = store / "checkpoints" / run.info.run_id / "best.pt"
    assert not any(k.startswith("module.") for k in torch.load(best, weights_only=True)["state_dict"])
    model = load_stage1(str(best), default_tracking_uri(store))
    bags, mask = torch.rand(2, 8, 1, 8, 8, 8), torch.ones(2, 8, dtype=torch.bool)
    with torch.no_grad():
        logits, _ = model.network(bags, mask)
    assert logits.shape == (2, 2) and torch.isfinite(logits).all()
    assert not (store / "resume").exists() or not any((store / "resume").glob("*/*.pt"))


@pytest.mark.slow  # two processes importing torch, MONAI and MLflow: about a minute on 2 cores
def test_cifar_bundle_under_torchrun(fake_cifar, tmp_path):
    store = {"data_dir": str(fake_cifar), "output_dir": str(tmp_path), "tracking_uri": f"sqlite:///{tmp_path}/m.db"}
    proc = torchrun("cifar10_focal", {**store, **CIFAR_TINY})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    client, run = _one_stage1_run(store["tracking_uri"], "cifar10")
    assert run.info.status == "FINISHED" and run.data.params["world_size"] == "2"
    n_val = int(run.data.params["n_val"])
    assert _epoch_values(client, run, "val/n") == [n_val, n_val]
    during, after = _epoch_values(client, run, "val/ece")
    assert during == pytest.approx(after, abs=1e-6)
    (ckpt,) = (tmp_path / "checkpoints").glob(f"cifar10_focal_{run.info.run_id}.pt")
    net = resnet32()
    net.load_state_dict(torch.load(ckpt, weights_only=True)["state_dict"])  # strict: no "module." keys
