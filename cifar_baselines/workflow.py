"""The run steps of the CIFAR bundles: open the MLflow run, train, evaluate, post-hoc, summarise.

The bundle (``bundles/cifar10*_*.json`` + ``bundles/cifar_common.json``) builds every object, the
data, network, loss, optimiser, scheduler, trainer, evaluator, calibrator; these classes only run
them in order inside a tracked run:

- :class:`Stage1Run`: stage-1 run (``lungcal.stage2 = none``): ``trainer.run()`` (the trainer's
  handlers log per-epoch metrics and write the checkpoint), float32 val/test logits, reports; then
  the post-hoc calibrator (TS) fitted on validation, logged as a linked child run
  (``lungcal.stage2 = ts``, ``lungcal.parent_run`` = the stage-1 run).
- :class:`LASRun`: MiSLAS stage 2 on a stage-1 model (:func:`load_stage1`): the head retrained with
  label-aware smoothing while BatchNorm statistics shift (the trainer), or on cached features.

Data-parallel (``torchrun`` with ``bundles/multi_gpu.json``): :class:`Stage1Run` trains on every
rank (each its shard of the batches; the validation split is sharded too and its metrics gathered),
and rank 0 alone opens the one MLflow run (``world_size`` among its params), writes the checkpoint
and the resume state, evaluates and fits TS; :class:`LASRun` runs in one process only.

Both resume by default (:mod:`lungcal.runtime.resume`): rerunning the same bundle with the same
settings after an interruption continues from the last complete epoch (model, optimizer, LR
schedule, trainer counters, the global RNGs and the batch-order / augmentation / mixup
generators) and logs into the same MLflow run; ``resume: false`` starts afresh.

MLflow names follow ``DESIGN.md``: experiment = dataset (``cifar10`` / ``cifar10lt``), params = the
bundle's settings flattened, per-epoch ``train/*``, ``val/*`` and ``lr``, final ``{split}/{metric}``
from :func:`lungcal.calibration.metrics.calibration_report`, tags ``lungcal.dataset``,
``lungcal.stage1``, ``lungcal.stage2``, ``lungcal.site`` (``cifar``), ``lungcal.parent_run``, and
artifacts: reliability diagrams, ``predictions/{split}.npz`` (logits, probs, labels), the resolved
config and the model.

References:
    Zhong, Cui, Liu, Jia. "Improving Calibration for Long-Tailed Recognition" (MiSLAS). CVPR 2021.
    https://arxiv.org/abs/2104.00466
    Guo, Pleiss, Sun, Weinberger. "On Calibration of Modern Neural Networks" (temperature scaling).
    ICML 2017. https://arxiv.org/abs/1706.04599
"""
from __future__ import annotations

import copy
import json
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from ignite.engine import Events
from mlflow.tracking import MlflowClient

from cifar_baselines.data import CifarSplits, load_splits
from cifar_baselines.steps import predict, training_precision
from cifar_baselines.summary import run_summary
from lungcal.calibration.las import retrain_head_las
from lungcal.calibration.metrics import calibration_report
from lungcal.calibration.plots import reliability_diagram, risk_coverage_plot
from lungcal.calibration.selective import selective_report
from lungcal.errors import ConfigError, TrackingError
from lungcal.paths import default_output_dir
from lungcal.runtime.bundle_config import active_config
from lungcal.runtime.distributed import is_rank_zero, plain_state_dict, unwrap, world_size
from lungcal.runtime.resume import (
    IDENTITY_EXCLUDE,
    RandomState,
    StepFilter,
    TrainingResume,
    as_bool,
    generators_of,
    run_identity,
)
from lungcal.tracking import (
    TAG_DATASET,
    TAG_RESUMED_FROM,
    TAG_SITE,
    TAG_STAGE1,
    TAG_STAGE2,
    RunTracker,
    default_tracking_uri,
)

__all__ = ["SITE", "SPLIT_KEYS", "follow_epochs", "log_split", "load_stage1", "require_one_process",
           "trainable_head", "Stage1Model", "Stage1Run", "LASRun"]

SITE = "cifar"  # value of the lungcal.site tag for CIFAR runs (no hospital site involved)
#: the stage-1 settings a LAS run reuses so that its splits are the stage-1 splits
SPLIT_KEYS = ("dataset", "imb_factor", "seed", "subset", "val_per_class")
_MODEL_CONFIG = {"arch": "resnet32", "num_classes": 10}


def log_split(tracker: RunTracker, split: str, logits: torch.Tensor, labels: torch.Tensor, *, n_bins: int,
              n_bootstrap: int, title: str, probs: torch.Tensor | None = None) -> dict:
    """Report + reliability diagram + ``predictions/{split}.npz`` of one split into ``tracker``.

    Also logs the referral metrics ``{split}/aurc`` and ``{split}/acc_cov90`` (accuracy on the 90% most
    confident images; :func:`lungcal.calibration.selective.selective_report`) and the risk-coverage curve
    ``plots/risk_coverage_{split}.png``.
    """
    p = (torch.softmax(logits.double(), dim=1) if probs is None else probs.double()).numpy()
    y = labels.cpu().numpy()
    report = calibration_report(p, y, n_bins=n_bins, n_bootstrap=n_bootstrap)
    tracker.log_report(split, report)
    referral = selective_report(p, y, coverage=0.9)
    tracker.log_report(split, {k: referral[k] for k in ("aurc", "acc_cov90")})
    tracker.log_figure(risk_coverage_plot(p, y, title=f"{title} ({split})"), f"plots/risk_coverage_{split}.png")
    tracker.log_figure(reliability_diagram(p, y, n_bins=n_bins, title=f"{title} ({split})"),
                       f"plots/reliability_{split}.png")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"{split}.npz"
        np.savez_compressed(path, logits=logits.numpy(), probs=p.astype(np.float32), labels=y)
        tracker.log_artifact(path, "predictions")
    return report


def require_one_process() -> None:
    """LAS (stage 2) runs in one process: under ``torchrun`` (``multi_gpu.json``) a one-line ``ConfigError``."""
    if world_size() > 1:
        raise ConfigError("LAS (stage 2) runs in one process", field="config_file",
                          fix="run the LAS bundle without multi_gpu.json and torchrun")


def trainable_head(network: torch.nn.Module) -> list[torch.nn.Parameter]:
    """Freeze every parameter of ``network`` but its ``head``'s; return the head's (the LAS optimiser's)."""
    require_one_process()  # the LAS bundle builds its optimiser (this) before its run step
    for p in network.parameters():
        p.requires_grad_(False)
    params = list(network.head.parameters())
    for p in params:
        p.requires_grad_(True)
    return params


@dataclass
class Stage1Model:
    """A stage-1 ResNet-32: its weights, the settings it was trained with and its MLflow run id."""

    state_dict: dict
    settings: dict = field(default_factory=dict)
    run_id: str | None = None

    @property
    def method(self) -> str:
        return str(self.settings.get("method", "unknown"))

    def load_into(self, network: torch.nn.Module) -> torch.nn.Module:
        """Load the weights into ``network`` (same architecture) and return it (a ``module.`` prefix is dropped)."""
        network.load_state_dict(plain_state_dict(self.state_dict))
        return network

    def load_splits(self, **kwargs: Any) -> CifarSplits:
        """The stage-1 run's splits (:data:`SPLIT_KEYS`); ``kwargs`` go to :func:`load_splits`."""
        split = {k: self.settings[k] for k in SPLIT_KEYS if self.settings.get(k) is not None}
        return load_splits(split.pop("dataset", "cifar10"), **split, **kwargs)


def load_stage1(stage1_run_id: str | None = None, checkpoint: str | None = None, *,
                tracking_uri: str | None = None, output_dir: str | None = None) -> Stage1Model:
    """The stage-1 model from a checkpoint file (preferred when given) or a stage-1 MLflow run.

    Raises:
        ConfigError: neither given, or the checkpoint file is missing.
        TrackingError: the run or its artifacts cannot be read.
    """
    if checkpoint:
        path = Path(checkpoint)
        if not path.is_file():
            raise ConfigError("stage-1 checkpoint not found", file=path, field="checkpoint",
                              fix="point 'checkpoint' at a file written by a cifar stage-1 bundle")
        blob = torch.load(path, map_location="cpu", weights_only=True)
        return Stage1Model(blob["state_dict"], dict(blob.get("settings", {})), blob.get("run_id"))
    if not stage1_run_id:
        raise ConfigError("LAS needs a stage-1 model", field="stage1_run_id",
                          fix="set 'stage1_run_id' (a stage-1 MLflow run id) or 'checkpoint'")
    client = MlflowClient(tracking_uri=_store(output_dir, tracking_uri)[1])
    try:
        with tempfile.TemporaryDirectory() as tmp:
            sd = client.download_artifacts(stage1_run_id, "model/state_dict.pt", tmp)
            state = torch.load(sd, map_location="cpu", weights_only=True)
            cfg = json.loads(Path(client.download_artifacts(stage1_run_id, "config/resolved.json", tmp)).read_text())
    except Exception as exc:  # noqa: BLE001 - any store failure is the user's run id or URI
        raise TrackingError(f"cannot read stage-1 run {stage1_run_id!r} ({exc})", field="stage1_run_id",
                            fix="check the run id and tracking_uri") from exc
    return Stage1Model(state, cfg, stage1_run_id)


def _store(output_dir: str | Path | None, tracking_uri: str | None) -> tuple[Path, str]:
    out = Path(output_dir) if output_dir else default_output_dir()
    return out, tracking_uri or default_tracking_uri(out)


def _tags(dataset: str, stage1: str, stage2: str) -> dict[str, str]:
    return {TAG_DATASET: dataset, TAG_STAGE1: stage1, TAG_STAGE2: stage2, TAG_SITE: SITE}


def follow_epochs(trainer) -> None:
    """Give a ``DistributedSampler`` of the trainer's batches the epoch when each starts (a new shuffle).

    MONAI engines do this for a ``DataLoader``'s sampler; :class:`~cifar_baselines.batches.BatchIterator`
    is not one. The epoch comes from the trainer's state, so a resumed run shuffles as an uninterrupted one.
    """
    sampler = getattr(trainer.data_loader, "index_sampler", None)
    if hasattr(sampler, "set_epoch"):
        trainer.add_event_handler(Events.EPOCH_STARTED, lambda engine: sampler.set_epoch(engine.state.epoch))


class _TrackedRun:
    """What both runs share: the store, the open tracker, float32 val/test reports of the network."""

    tracker: RunTracker | None = None
    #: ``log(metrics, step)`` of the per-epoch logger: the open run, each (metric, step) once
    epoch_log = None

    def __init__(self, *, settings: Mapping, data: CifarSplits, network: torch.nn.Module,
                 output_dir: str | None = None, tracking_uri: str | None = None, n_bins: int = 15,
                 n_bootstrap: int = 1000, channels_last: bool = True, lr_scheduler=None, resume: bool = True) -> None:
        self.settings, self.data, self.network = dict(settings), data, network
        self.module = unwrap(network)  # the bare network (a DDP wrapper's module): saved, logged, evaluated
        self.world_size = world_size()
        self.output_dir, self.tracking_uri = _store(output_dir, tracking_uri)
        self.n_bins, self.n_bootstrap, self.channels_last = int(n_bins), int(n_bootstrap), channels_last
        self.lr_scheduler, self.resume = lr_scheduler, as_bool(resume, "resume")
        self.config = active_config() or {"settings": self.settings}
        self.resumed_from = 0

    def identity(self) -> str:
        """The run's identity: the bundle config without run name, output paths and ``resume``."""
        settings = {k: v for k, v in self.settings.items() if k not in IDENTITY_EXCLUDE}
        return run_identity({**self.config, "settings": settings, "_class": type(self).__name__})

    def _command(self, config_file: str, **keys: str) -> str:
        """``python -m monai.bundle run`` of ``config_file`` with ``keys``, on this run's store and output
        folder where the bundle set them (the defaults find themselves)."""
        keys = {**keys, **{k: self.settings[k] for k in ("output_dir", "tracking_uri") if self.settings.get(k)}}
        return " ".join([f"python -m monai.bundle run --config_file {config_file}",
                         *(f"--{k} {v}" for k, v in keys.items())])

    def training_state(self, trainer) -> TrainingResume:
        """The resume state: network, optimizer, LR schedule, trainer, the step (grad scaler), every RNG."""
        step = trainer._process_function
        objects = {"model": self.module, "optimizer": trainer.optimizer, "lr_scheduler": self.lr_scheduler,
                   "trainer": trainer, "step": step if hasattr(step, "state_dict") else None,
                   "rng": RandomState(generators_of(trainer.data_loader, step))}
        return TrainingResume(self.output_dir / "resume" / self.identity(), objects, enabled=self.resume)

    def _train(self, trainer, state: TrainingResume, previous: str | None) -> None:
        """Restore the state when there is one, then train the remaining epochs (inside the open run)."""
        tr = self.tracker
        self.epoch_log = StepFilter(tr.log_metrics, tr.client, previous)
        self.resumed_from = state.load()
        if self.resumed_from:
            tr.set_tags({TAG_RESUMED_FROM: str(self.resumed_from)})
        state.attach(trainer, tr.run_id)
        follow_epochs(trainer)
        if self.resumed_from < trainer.state.max_epochs:
            trainer.run()

    def _train_replica(self, trainer, state: TrainingResume) -> dict:
        """A rank above 0 under torchrun: restore rank 0's state, train its shards, leave the rest to rank 0."""
        self.resumed_from = state.load()
        follow_epochs(trainer)
        if self.resumed_from < trainer.state.max_epochs:
            trainer.run()
        return {"resumed_from_epoch": self.resumed_from}

    def _evaluate(self, title: str) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """Float32 logits of val and test, logged as reports; returns ``(val_logits, test_logits, test_report)``."""
        val = predict(self.module, self.data.val_x, channels_last=self.channels_last)
        test = predict(self.module, self.data.test_x, channels_last=self.channels_last)
        log_split(self.tracker, "val", val, self.data.val_y, n_bins=self.n_bins, n_bootstrap=0, title=title)
        report = log_split(self.tracker, "test", test, self.data.test_y, n_bins=self.n_bins,
                           n_bootstrap=self.n_bootstrap, title=title)
        return val, test, report


class Stage1Run(_TrackedRun):
    """Stage-1 training in a tracked run, then the post-hoc ``calibrator`` in a linked child run.

    Args:
        dataset, method: the MLflow experiment and the ``lungcal.stage1`` tag.
        settings: the bundle's settings, logged as params and ``config/resolved.json``.
        data, network: the bundle's ``data`` and ``network`` (the trainer's).
        calibrator: the post-hoc step (``TemperatureScaler()``), fitted on the validation logits.
        amp: recorded as the ``train_precision`` param (what the trainer's step computes in).
        output_dir, tracking_uri: ``None``: ``$LUNGCAL_HOME`` or ``./runs``; its ``mlflow.db``.
        n_bins, n_bootstrap, channels_last: of the final reports and predictions.

    ``run(trainer)`` returns ``{run_id, ts_run_id, checkpoint, temperature, test, test_ts, train_wall_s}``;
    ``train_wall_s`` (also a metric of the run) sums the training time of every process that worked
    on a resumed run (:class:`lungcal.runtime.resume.RunRecord`).
    """

    def __init__(self, *, dataset: str, method: str, calibrator, amp: bool = True, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.dataset, self.method, self.calibrator, self.amp = dataset, method, calibrator, amp
        self.name = f"{dataset}_{method}"

    def checkpoint_path(self) -> Path:
        """``<output_dir>/checkpoints/<dataset>_<method>_<run id>.pt``."""
        return self.output_dir / "checkpoints" / f"{self.name}_{self.tracker.run_id}.pt"

    def selection_path(self, kind: str) -> Path:
        """The weights of a selected epoch (:class:`cifar_baselines.handlers.EpochSelection`): ``..._<kind>.pt``."""
        return self.checkpoint_path().with_name(f"{self.checkpoint_path().stem}_{kind}.pt")

    def _selected_epochs(self) -> list[tuple[str, dict]]:
        """Test reports (with CIs) of the best-validation and the best-test epoch, when the bundle kept them.

        Logged as ``test_best_val/*`` and ``test_best_test/*`` with the epochs as ``best_val_epoch`` and
        ``best_test_epoch``; the last epoch stays the run's result (``test/*``). Returns summary rows.
        """
        rows = []
        for kind, label in (("best_val", "best-val epoch"), ("best_test", "best-test epoch [MiSLAS conv.]")):
            path = self.selection_path(kind)
            if not path.is_file():
                continue
            blob = torch.load(path, map_location="cpu", weights_only=True)
            net = copy.deepcopy(self.module)
            net.load_state_dict(blob["state_dict"])
            logits = predict(net, self.data.test_x, channels_last=self.channels_last)
            p = torch.softmax(logits.double(), dim=1).numpy()
            report = calibration_report(p, self.data.test_y.cpu().numpy(), n_bins=self.n_bins,
                                        n_bootstrap=self.n_bootstrap)
            self.tracker.log_report(f"test_{kind}", report)
            self.tracker.log_metrics({f"{kind}_epoch": int(blob["epoch"])})
            rows.append((f"{label} {int(blob['epoch'])}", report))
        return rows

    def run(self, trainer) -> dict:
        d = self.data
        if len(d.val_y) < self.world_size:
            raise ConfigError(f"{len(d.val_y)} validation images for {self.world_size} processes",
                              field="nproc_per_node", fix="use fewer processes or a larger val_per_class")
        state = self.training_state(trainer)
        previous = state.run_id(self.tracking_uri)
        if not is_rank_zero():  # torchrun: the other ranks train their shards; rank 0 does everything else
            return self._train_replica(trainer, state)
        with RunTracker(self.dataset, self.name, tracking_uri=self.tracking_uri,
                        tags=_tags(self.dataset, self.method, "none"), run_id=previous) as tr:
            self.tracker = tr
            if not previous:
                tr.log_params({**self.settings, "train_precision": training_precision(d.train_x.device, self.amp),
                               "class_counts": d.class_counts, "n_train": len(d.train_y), "n_val": len(d.val_y),
                               "n_test": len(d.test_y), "split_fingerprint": d.fingerprint,
                               **d.provenance(), "world_size": self.world_size})
                tr.log_dict(self.settings, "config/resolved.json")
            self._train(trainer, state, previous)
            wall = state.record.elapsed_s()  # every process's training time, when the run was resumed
            val_logits, test_logits, test = self._evaluate(f"{self.dataset} {self.method}")
            selected = self._selected_epochs()
            tr.log_metrics({"train_wall_s": wall})
            tr.log_model(self.module, "model", extra=_MODEL_CONFIG)
            run_id, ckpt = tr.run_id, self.checkpoint_path()
        ts_run_id, temperature, test_ts = self._posthoc(run_id, val_logits, test_logits)
        state.clear()
        print(run_summary(f"{self.dataset} {self.method}",
                          [(self.method, test), (f"+ TS (T {temperature:.3f})", test_ts), *selected],
                          [run_id, ts_run_id],
                          self.tracking_uri, self.output_dir,
                          next_step=self._command(f"bundles/{self.dataset}_las.json", stage1_run_id=run_id)),
              flush=True)
        return {"run_id": run_id, "ts_run_id": ts_run_id, "checkpoint": str(ckpt) if ckpt.is_file() else None,
                "temperature": temperature, "test": test, "test_ts": test_ts, "train_wall_s": wall,
                "resumed_from_epoch": self.resumed_from}

    def _posthoc(self, run_id: str, val_logits: torch.Tensor, test_logits: torch.Tensor):
        d, cfg = self.data, {**self.settings, "stage2": "ts"}
        scaler = self.calibrator.fit(val_logits, d.val_y.cpu())
        with RunTracker(self.dataset, f"{self.name}_ts", tracking_uri=self.tracking_uri,
                        tags=_tags(self.dataset, self.method, "ts"), parent_run_id=run_id) as tr:
            tr.log_params({**cfg, "ts_fit_split": "val"})
            tr.log_dict({**cfg, "stage1_run_id": run_id}, "config/resolved.json")
            temperature = float(getattr(scaler, "temperature", float("nan")))
            tr.log_metrics({"temperature": temperature})
            title = f"{self.dataset} {self.method} + TS"
            p_val = torch.as_tensor(np.asarray(scaler.predict_proba(val_logits)))
            p_test = torch.as_tensor(np.asarray(scaler.predict_proba(test_logits)))
            log_split(tr, "val", val_logits, d.val_y, n_bins=self.n_bins, n_bootstrap=0, title=title, probs=p_val)
            test_ts = log_split(tr, "test", test_logits, d.test_y, n_bins=self.n_bins,
                                n_bootstrap=self.n_bootstrap, title=title, probs=p_test)
            tr.log_dict(scaler.state_dict(), "model/temperature.json")
            return tr.run_id, temperature, test_ts


class LASRun(_TrackedRun):
    """MiSLAS stage 2 on ``stage1`` in a run tagged ``lungcal.stage2 = las`` and linked to it.

    With ``shift_bn`` (default) ``trainer`` retrains the head (the bundle's optimiser holds only
    :func:`trainable_head`) on augmented class-balanced batches with the network in train mode,
    so its BatchNorm statistics follow them ("shift learning on BN"). Without it, the head is
    retrained on cached features by :func:`lungcal.calibration.las.retrain_head_las` with the
    same settings (``epochs``, ``lr``, ``batch_size``, ``weight_decay``, ``smooth_head``,
    ``smooth_tail``, ``las_shape``, ``seed``).

    ``run(trainer)`` returns ``{run_id, stage1_run_id, test}``.
    """

    def __init__(self, *, stage1: Stage1Model, shift_bn: bool = True, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        require_one_process()
        self.stage1, self.shift_bn = stage1, shift_bn
        self.dataset = str(stage1.settings.get("dataset", "cifar10"))

    def _retrain_on_features(self) -> None:
        las, net, d = self.settings, self.network, self.data
        _, feats = predict(net, d.train_x, channels_last=self.channels_last, features=True)
        head = retrain_head_las(net.head, feats, d.train_y.cpu(), d.class_counts, smooth_head=las["smooth_head"],
                                smooth_tail=las["smooth_tail"], shape=las["las_shape"], epochs=int(las["epochs"]),
                                lr=las["lr"], batch_size=int(las["batch_size"]), balanced_sampling=True,
                                seed=int(las["seed"]), weight_decay=las["weight_decay"])
        net.head = head.to(next(net.parameters()).device)

    def run(self, trainer) -> dict:
        method, d = self.stage1.method, self.data
        settings = {**self.settings, **{k: self.stage1.settings.get(k) for k in SPLIT_KEYS}}
        state = self.training_state(trainer) if self.shift_bn else None
        previous = state.run_id(self.tracking_uri) if state is not None else None
        with RunTracker(self.dataset, f"{self.dataset}_{method}_las", tracking_uri=self.tracking_uri,
                        tags=_tags(self.dataset, method, "las"), parent_run_id=self.stage1.run_id,
                        run_id=previous) as tr:
            self.tracker = tr
            if not previous:
                tr.log_params({**settings, "stage1_method": method, "class_counts": d.class_counts,
                               **d.provenance()})
                tr.log_dict({**settings, "stage1": self.stage1.settings}, "config/resolved.json")
            if state is not None:
                self._train(trainer, state, previous)
            else:
                self._retrain_on_features()
            _, _, test = self._evaluate(f"{self.dataset} {method} + LAS")
            tr.log_model(self.module, "model", extra=_MODEL_CONFIG)
            run_id = tr.run_id
        if state is not None:
            state.clear()
        print(run_summary(f"{self.dataset} {method} + LAS", [(f"{method} + LAS", test)], [run_id],
                          self.tracking_uri, self.output_dir,
                          next_step=f"lungcal report --experiment {self.dataset} --tracking-uri {self.tracking_uri}"),
              flush=True)
        return {"run_id": run_id, "stage1_run_id": self.stage1.run_id, "test": test,
                "resumed_from_epoch": self.resumed_from}
