"""CIFAR bundle workflows: stage 1 (+ its linked TS run) and the LAS stage 2, tracked in MLflow.

A bundle (``bundles/cifar10*_*.json``) instantiates :class:`Stage1` or :class:`Stage2LAS` from its
top-level keys and calls ``run()``. The MLflow names follow ``DESIGN.md``: experiment = dataset
(``cifar10`` / ``cifar10lt``), params = the settings flattened, per-epoch ``train/*`` and ``val/*``
metrics, final ``{split}/{metric}`` from :func:`lungcal.calibration.metrics.calibration_report`,
tags ``lungcal.dataset``, ``lungcal.stage1``, ``lungcal.stage2``, ``lungcal.site`` (+
``lungcal.parent_run`` on stage-2 runs), and artifacts: reliability diagrams, predictions
(``predictions/{split}.npz`` with logits and labels), the resolved config and the model.
"""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lungcal.errors import ConfigError, DataError
from cifar_baselines.data import SHARED_MAKE_BATCHES, CifarSplits, find_batches_dir, make_splits
from cifar_baselines.resnet import resnet32
from cifar_baselines.train import (METHODS, predict, resolve_device, train_head_las_shift_bn, train_stage1,
                                   training_precision)

__all__ = ["Stage1", "Stage2LAS", "prepare_data_dir", "evaluate_logits"]

DATASETS = ("cifar10", "cifar10lt")
SITE = "cifar"  # value of the lungcal.site tag for CIFAR runs (no hospital site involved)


def prepare_data_dir(data_dir: str | Path, download: bool = False, convert_shared: bool = True) -> Path:
    """Make sure ``data_dir`` holds ``cifar-10-batches-py``; return the folder to read.

    When it is missing and ``../shared/data/cifar10/make_batches.py`` exists (the JPEG copy shipped
    beside the checkout), it is converted automatically into ``data_dir`` (about a minute, said on
    stderr). Otherwise the official archive is downloaded only if ``download``; else a
    :class:`DataError` names the folder and how to fill it.
    """
    data_dir = Path(data_dir)
    try:
        return find_batches_dir(data_dir)
    except DataError:
        if convert_shared and SHARED_MAKE_BATCHES.is_file():
            print(f"[cifar] {data_dir} has no CIFAR-10 yet: converting the shared copy with "
                  f"`python {SHARED_MAKE_BATCHES} {data_dir}` (about a minute)...", file=sys.stderr, flush=True)
            data_dir.mkdir(parents=True, exist_ok=True)
            subprocess.run([sys.executable, str(SHARED_MAKE_BATCHES), str(data_dir)], check=True)
            return find_batches_dir(data_dir)
        if not download:
            raise
    from cifar_baselines.data import download_cifar10
    return download_cifar10(data_dir)


def evaluate_logits(logits: torch.Tensor, labels: torch.Tensor, *, n_bins: int = 15, n_bootstrap: int = 1000,
                    seed: int = 0) -> dict:
    """``calibration_report`` of softmax(logits) (top-label ECE with ``n_bins`` equal-width bins)."""
    from lungcal.calibration.metrics import calibration_report
    probs = torch.softmax(logits.double(), dim=1).numpy()
    return calibration_report(probs, labels.cpu().numpy(), n_bins=n_bins, n_bootstrap=n_bootstrap, seed=seed)


def _log_split(tracker, split: str, logits: torch.Tensor, labels: torch.Tensor, *, n_bins: int,
               n_bootstrap: int, title: str, probs: torch.Tensor | None = None) -> dict:
    """Report + reliability diagram + predictions of one split into ``tracker``."""
    from lungcal.calibration.metrics import calibration_report
    if probs is None:
        probs = torch.softmax(logits.double(), dim=1)
    p = probs.double().numpy()
    y = labels.cpu().numpy()
    report = calibration_report(p, y, n_bins=n_bins, n_bootstrap=n_bootstrap)
    tracker.log_report(split, report)
    try:
        from lungcal.calibration.plots import reliability_diagram
        tracker.log_figure(reliability_diagram(p, y, n_bins=n_bins, title=f"{title} ({split})"),
                           f"plots/reliability_{split}.png")
    except ImportError:  # plots not installed: the metrics still stand
        pass
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"{split}.npz"
        np.savez_compressed(path, logits=logits.numpy(), probs=p.astype(np.float32), labels=y)
        tracker.log_artifact(path, "predictions")
    return report


def _tags(dataset: str, stage1: str, stage2: str) -> dict[str, str]:
    from lungcal.tracking import TAG_DATASET, TAG_SITE, TAG_STAGE1, TAG_STAGE2
    return {TAG_DATASET: dataset, TAG_STAGE1: stage1, TAG_STAGE2: stage2, TAG_SITE: SITE}


@dataclass
class _Common:
    dataset: str = "cifar10"
    data_dir: str | None = None  # None: <output_dir>/data/cifar10, i.e. runs/data/cifar10
    download: bool = False
    imb_factor: float = 0.01
    val_per_class: int = 500
    subset: int | None = None
    seed: int = 0
    batch_size: int = 128
    device: str = "auto"
    amp: bool = True
    channels_last: bool = True
    n_bins: int = 15
    n_bootstrap: int = 1000
    output_dir: str | None = None
    tracking_uri: str | None = None
    progress: bool = True
    num_threads: int | None = None

    def _check(self) -> None:
        if self.dataset not in DATASETS:
            raise ConfigError(f"unknown dataset {self.dataset!r}", field="dataset", fix=f"use one of {DATASETS}")
        if self.subset is not None and int(self.subset) < 10:
            raise ConfigError(f"subset={self.subset} is too small", field="subset", fix="use >= 10 or null")

    def _setup(self) -> tuple[torch.device, CifarSplits, Path, str]:
        from lungcal.paths import default_output_dir
        from lungcal.tracking import default_tracking_uri
        self._check()
        if self.num_threads:
            torch.set_num_threads(int(self.num_threads))
        device = resolve_device(self.device)
        out = Path(self.output_dir) if self.output_dir else default_output_dir()
        uri = self.tracking_uri or default_tracking_uri(out)
        if not self.data_dir:
            self.data_dir = str(out / "data" / "cifar10")
        prepare_data_dir(self.data_dir, download=self.download)
        splits = make_splits(self.data_dir, self.dataset, imb_factor=self.imb_factor, val_per_class=self.val_per_class,
                             seed=self.seed, subset=self.subset).to(device)
        return device, splits, out, uri

    def settings(self) -> dict[str, Any]:
        """The resolved settings (what MLflow records as params and ``config/resolved.json``)."""
        return dataclasses.asdict(self)


@dataclass
class Stage1(_Common):
    """Stage-1 training of ResNet-32 with ``method``, then a linked temperature-scaling run.

    ``run()`` records the stage-1 run (``lungcal.stage2 = none``) and a child run
    (``lungcal.stage2 = ts``, ``lungcal.parent_run`` = the stage-1 run) holding the test metrics
    after temperature scaling fitted on the validation split. Returns a summary dict with
    ``run_id``, ``ts_run_id``, ``checkpoint``, ``temperature``, ``test`` and ``test_ts`` reports.
    """

    method: str = "ce"
    epochs: int = 200
    lr: float = 0.1
    momentum: float = 0.9
    wd: float = 5e-4
    warmup_epochs: float = 5
    lr_milestones: list[int] = field(default_factory=lambda: [160, 180])
    lr_gamma: float = 0.1
    focal_gamma: float = 3.0
    mixup_alpha: float = 1.0
    eval_every: int = 1

    def _check(self) -> None:
        super()._check()
        if self.method not in METHODS:
            raise ConfigError(f"unknown method {self.method!r}", field="method", fix=f"use one of {', '.join(METHODS)}")
        if int(self.epochs) < 1:
            raise ConfigError(f"epochs={self.epochs}", field="epochs", fix="use a positive number of epochs")

    def run(self) -> dict:
        from lungcal.calibration.scaling import TemperatureScaler
        from lungcal.tracking import RunTracker

        device, s, out, uri = self._setup()
        cfg = self.settings()
        name = f"{self.dataset}_{self.method}"
        torch.manual_seed(self.seed)
        model = resnet32(10)
        t0 = time.time()
        with RunTracker(self.dataset, name, tracking_uri=uri, tags=_tags(self.dataset, self.method, "none")) as tr:
            precision = str(training_precision(device, self.amp)).replace("torch.", "")
            tr.log_params({**cfg, "train_precision": precision, "class_counts": s.class_counts,
                           "n_train": len(s.train_y), "n_val": len(s.val_y), "n_test": len(s.test_y),
                           "split_fingerprint": s.fingerprint})
            tr.log_dict(cfg, "config/resolved.json")

            def on_epoch(epoch: int, stats: dict) -> None:
                metrics = dict(stats)
                if self.eval_every and ((epoch + 1) % int(self.eval_every) == 0 or epoch + 1 == self.epochs):
                    vl = predict(model, s.val_x, device=device, amp=self.amp, channels_last=self.channels_last)
                    r = evaluate_logits(vl, s.val_y, n_bins=self.n_bins, n_bootstrap=0)
                    metrics.update({f"val/{k}": r[k] for k in ("acc", "ece", "nll", "mean_confidence")})
                tr.log_metrics(metrics, step=epoch)

            train_stage1(model, s.train_x, s.train_y, method=self.method, epochs=int(self.epochs),
                         batch_size=int(self.batch_size), lr=self.lr, momentum=self.momentum, weight_decay=self.wd,
                         warmup_epochs=self.warmup_epochs, lr_milestones=list(self.lr_milestones),
                         lr_gamma=self.lr_gamma, focal_gamma=self.focal_gamma, mixup_alpha=self.mixup_alpha,
                         seed=self.seed, device=device, amp=self.amp, channels_last=self.channels_last,
                         on_epoch=on_epoch, progress=self.progress)
            wall = time.time() - t0
            val_logits = predict(model, s.val_x, device=device, amp=self.amp, channels_last=self.channels_last)
            test_logits = predict(model, s.test_x, device=device, amp=self.amp, channels_last=self.channels_last)
            title = f"{self.dataset} {self.method}"
            _log_split(tr, "val", val_logits, s.val_y.cpu(), n_bins=self.n_bins, n_bootstrap=0, title=title)
            test = _log_split(tr, "test", test_logits, s.test_y.cpu(), n_bins=self.n_bins,
                              n_bootstrap=self.n_bootstrap, title=title)
            tr.log_metrics({"train_wall_s": wall})
            model_cfg = {"arch": "resnet32", "num_classes": 10}
            tr.log_model(model.to(memory_format=torch.contiguous_format).cpu(), "model", extra=model_cfg)
            ckpt_dir = out / "checkpoints"
            ckpt_dir.mkdir(parents=True, exist_ok=True)
            ckpt = ckpt_dir / f"{name}_{tr.run_id}.pt"
            tmp = ckpt.with_suffix(".tmp")
            torch.save({"state_dict": model.state_dict(), "settings": cfg, "run_id": tr.run_id}, tmp)
            tmp.replace(ckpt)
            run_id = tr.run_id

        scaler = TemperatureScaler().fit(val_logits, s.val_y.cpu())
        with RunTracker(self.dataset, f"{name}_ts", tracking_uri=uri, tags=_tags(self.dataset, self.method, "ts"),
                        parent_run_id=run_id) as tr:
            tr.log_params({**cfg, "stage2": "ts", "ts_fit_split": "val"})
            tr.log_dict({**cfg, "stage2": "ts", "parent_run": run_id}, "config/resolved.json")
            temperature = float(scaler.temperature)
            tr.log_metrics({"temperature": temperature})
            title = f"{self.dataset} {self.method} + TS"
            with torch.no_grad():
                p_val = torch.as_tensor(np.asarray(scaler.predict_proba(val_logits)))
                p_test = torch.as_tensor(np.asarray(scaler.predict_proba(test_logits)))
            _log_split(tr, "val", val_logits, s.val_y.cpu(), n_bins=self.n_bins, n_bootstrap=0, title=title, probs=p_val)
            test_ts = _log_split(tr, "test", test_logits, s.test_y.cpu(), n_bins=self.n_bins,
                                 n_bootstrap=self.n_bootstrap, title=title, probs=p_test)
            tr.log_dict(scaler.state_dict() if hasattr(scaler, "state_dict") else {"temperature": temperature},
                        "model/temperature.json")
            ts_run_id = tr.run_id
        return {"run_id": run_id, "ts_run_id": ts_run_id, "checkpoint": str(ckpt), "temperature": temperature,
                "test": test, "test_ts": test_ts, "train_wall_s": wall}


def _load_parent(parent_run: str | None, checkpoint: str | None, tracking_uri: str) -> tuple[dict, dict]:
    """``(state_dict, stage-1 settings)`` from a checkpoint file or a stage-1 MLflow run."""
    if checkpoint:
        path = Path(checkpoint)
        if not path.is_file():
            raise ConfigError("stage-1 checkpoint not found", file=path, field="checkpoint",
                              fix="point 'checkpoint' at a file written by a cifar stage-1 bundle")
        blob = torch.load(path, map_location="cpu", weights_only=True)
        return blob["state_dict"], {**blob.get("settings", {}), "run_id": blob.get("run_id")}
    if not parent_run:
        raise ConfigError("LAS needs a stage-1 model", field="parent_run",
                          fix="set 'parent_run' (a stage-1 MLflow run id) or 'checkpoint'")
    from mlflow.tracking import MlflowClient
    from lungcal.errors import TrackingError
    client = MlflowClient(tracking_uri=tracking_uri)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            sd = client.download_artifacts(parent_run, "model/state_dict.pt", tmp)
            state = torch.load(sd, map_location="cpu", weights_only=True)
            cfg = json.loads(Path(client.download_artifacts(parent_run, "config/resolved.json", tmp)).read_text())
    except Exception as exc:  # noqa: BLE001
        raise TrackingError(f"cannot read stage-1 run {parent_run!r} ({exc})", field="parent_run",
                            fix="check the run id and tracking_uri") from exc
    return state, cfg


@dataclass
class Stage2LAS(_Common):
    """Stage 2: retrain the head of a stage-1 ResNet-32 with label-aware smoothing (MiSLAS).

    The stage-1 model comes from ``parent_run`` (an MLflow run id in ``tracking_uri``) or
    ``checkpoint``. The data settings (dataset, imb_factor, seed, subset, val_per_class) of the
    parent are reused so the splits are the same. With ``shift_bn`` the head is retrained on
    augmented class-balanced batches while BatchNorm statistics are re-estimated
    (:func:`cifar_baselines.train.train_head_las_shift_bn`); without it,
    :func:`lungcal.calibration.las.retrain_head_las` retrains the head on cached features.
    """

    parent_run: str | None = None
    checkpoint: str | None = None
    epochs: int = 10
    head_lr: float = 0.05
    wd: float = 5e-4
    smooth_head: float = 0.3
    smooth_tail: float = 0.0
    las_shape: str = "concave"
    shift_bn: bool = True

    def run(self) -> dict:
        from lungcal.calibration.las import retrain_head_las
        from lungcal.paths import default_output_dir
        from lungcal.tracking import RunTracker, default_tracking_uri

        out = Path(self.output_dir) if self.output_dir else default_output_dir()
        uri = self.tracking_uri or default_tracking_uri(out)
        state, parent_cfg = _load_parent(self.parent_run, self.checkpoint, uri)
        for key in ("dataset", "imb_factor", "seed", "subset", "val_per_class"):
            if key in parent_cfg:
                setattr(self, key, parent_cfg[key])
        method = parent_cfg.get("method", "unknown")
        parent_id = self.parent_run or parent_cfg.get("run_id")
        device, s, _, _ = self._setup()
        model = resnet32(10)
        model.load_state_dict(state)
        model.to(device)
        if self.channels_last:
            model.to(memory_format=torch.channels_last)
        cfg = self.settings()
        name = f"{self.dataset}_{method}_las"
        with RunTracker(self.dataset, name, tracking_uri=uri, tags=_tags(self.dataset, method, "las"),
                        parent_run_id=parent_id) as tr:
            tr.log_params({**cfg, "stage1_method": method, "class_counts": s.class_counts})
            tr.log_dict({**cfg, "stage1": parent_cfg}, "config/resolved.json")
            if self.shift_bn:
                model = train_head_las_shift_bn(
                    model, s.train_x, s.train_y, s.class_counts, smooth_head=self.smooth_head,
                    smooth_tail=self.smooth_tail, shape=self.las_shape, epochs=int(self.epochs), lr=self.head_lr,
                    batch_size=int(self.batch_size), weight_decay=self.wd, seed=self.seed, device=device,
                    amp=self.amp, channels_last=self.channels_last, progress=self.progress)
            else:
                _, feats = predict(model, s.train_x, device=device, amp=self.amp,
                                   channels_last=self.channels_last, features=True)
                model.head = retrain_head_las(
                    model.head, feats, s.train_y.cpu(), s.class_counts, smooth_head=self.smooth_head,
                    smooth_tail=self.smooth_tail, shape=self.las_shape, epochs=int(self.epochs), lr=self.head_lr,
                    batch_size=int(self.batch_size), balanced_sampling=True, seed=self.seed,
                    weight_decay=self.wd).to(device)
            title = f"{self.dataset} {method} + LAS"
            val_logits = predict(model, s.val_x, device=device, amp=self.amp, channels_last=self.channels_last)
            test_logits = predict(model, s.test_x, device=device, amp=self.amp, channels_last=self.channels_last)
            _log_split(tr, "val", val_logits, s.val_y.cpu(), n_bins=self.n_bins, n_bootstrap=0, title=title)
            test = _log_split(tr, "test", test_logits, s.test_y.cpu(), n_bins=self.n_bins,
                              n_bootstrap=self.n_bootstrap, title=title)
            tr.log_model(model.to(memory_format=torch.contiguous_format).cpu(), "model",
                         extra={"arch": "resnet32", "num_classes": 10})
            return {"run_id": tr.run_id, "parent_run": parent_id, "test": test}
