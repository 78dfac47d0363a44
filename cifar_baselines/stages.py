"""The run steps of the CIFAR bundles on the shared tracked-run skeleton (:class:`lungcal.workflow.TrackedStage1`).

The bundle (``bundles/cifar10lt_ce.json``, complete, with a recipe's differences merged over it; LAS:
``bundles/cifar10lt_las.json`` the same way; :func:`cifar_baselines.bundle.recipe_files`) builds every
object, the data, network, loss, optimiser, scheduler, trainer and evaluator, and hands the hyperparameters over by
reference (its ``settings`` section), with where the runs go (``store``, :class:`lungcal.workflow.Store`)
and how the splits are scored (``evaluation``, :class:`lungcal.workflow.Evaluation`: 15 ECE bins, the
bootstrap, its seed and the ``post_hoc`` calibrators). ``initialize`` seeds the global RNG before the
network is built; ``run`` is ``$@workflow.run(@train#trainer)`` (the trainer's handlers refer to the
workflow, so the workflow takes the trainer when it runs, not when it is built). The order of work is
the skeleton's: open or resume the run -> train -> evaluate the splits -> one post-hoc child run per
name of ``post_hoc`` -> paired differences -> summary.

- :class:`Stage1Run`: stage-1 run (``lungcal.stage2 = none``): ``trainer.run()`` (the trainer's
  handlers log per-epoch metrics, keep the best-validation and best-test epochs and write the
  checkpoint), float32 val/test logits and reports, the test reports of the selected epochs; then
  each post-hoc calibrator (default TS) fitted on validation, logged as a linked child run
  (``lungcal.stage2 = ts``, ``lungcal.parent_run`` = the stage-1 run), and its paired ECE difference.
- :class:`LASRun`: MiSLAS stage 2 on a stage-1 model (:func:`load_stage1`): the head retrained with
  label-aware smoothing while BatchNorm statistics shift (the trainer), or on cached features.

Data-parallel (``torchrun`` with ``bundles/multi_gpu.json``): :class:`Stage1Run` trains on every
rank (each its shard of the batches; the validation split is sharded too and its metrics gathered),
and rank 0 alone opens the one MLflow run (``world_size`` among its params), writes the checkpoint
and the resume state, evaluates and fits the calibrators; :class:`LASRun` runs in one process only.

Both resume by default (:mod:`lungcal.runtime.resume`): rerunning the same bundle with the same
settings after an interruption continues from the last complete epoch (model, optimizer, LR
schedule, trainer counters, the global RNGs and the batch-order / augmentation / mixup
generators) and logs into the same MLflow run; ``resume: false`` starts afresh. The identity is
:meth:`lungcal.workflow.TrackedStage1.identity`: the settings (paths, run name and ``resume`` left
out) and what the network and the loss are.

MLflow names follow ``DESIGN.md`` and :mod:`lungcal.tracking.names`: experiment = dataset (``cifar10`` /
``cifar10lt``), params = the settings flattened, per-epoch ``train/*``, ``val/*`` and ``lr``, final
``{split}/{metric}`` from :func:`lungcal.calibration.metrics.calibration_report`, tags ``lungcal.dataset``,
``lungcal.stage1``, ``lungcal.stage2``, ``lungcal.site`` (``cifar``), ``lungcal.parent_run``, and
artifacts: ``plots/{split}_reliability.png`` and ``plots/{split}_risk_coverage.png``
(:func:`~lungcal.tracking.names.plot_artifact`), ``predictions/{split}_predictions.npz`` (logits, probs,
labels; :func:`~lungcal.tracking.names.predictions_artifact`), ``config/resolved.json`` and the model.

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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from ignite.engine import Events
from mlflow.tracking import MlflowClient

from cifar_baselines.bundle import config_file_argument, recipe_files
from cifar_baselines.data import CifarSplits, load_splits
from cifar_baselines.steps import predict, training_precision
from lungcal.calibration.las import retrain_head_las
from lungcal.calibration.metrics import calibration_report
from lungcal.calibration.plots import reliability_diagram, risk_coverage_plot
from lungcal.calibration.scaling import calibrated_probs
from lungcal.calibration.selective import selective_report
from lungcal.errors import ConfigError, TrackingError
from lungcal.runtime.bundle_config import spec_of
from lungcal.runtime.distributed import plain_state_dict, unwrap, world_size
from lungcal.runtime.resume import RandomState, TrainingResume, generators_of
from lungcal.tracking import (
    CONFIG_ARTIFACT,
    MODEL_ARTIFACT,
    TAG_DATASET,
    TAG_SITE,
    TAG_STAGE1,
    TAG_STAGE2,
    RunTracker,
    plot_artifact,
    predictions_artifact,
)
from lungcal.workflow import (
    CIFAR_COLUMNS,
    Evaluation,
    PostHocResult,
    SplitScores,
    Store,
    TrackedStage1,
    post_hoc_lines,
    summary_lines,
)

__all__ = ["SITE", "SPLIT_KEYS", "follow_epochs", "log_split", "load_stage1", "require_one_process",
           "trainable_head", "Stage1Model", "Stage1Run", "LASRun"]

SITE = "cifar"  # value of the lungcal.site tag for CIFAR runs (no hospital site involved)
#: the stage-1 settings a LAS run reuses so that its splits are the stage-1 splits
SPLIT_KEYS = ("dataset", "imb_factor", "seed", "subset", "val_per_class")
_MODEL_CONFIG = {"arch": "resnet32", "num_classes": 10}


def log_split(tracker: RunTracker, split: str, logits: torch.Tensor, labels: Any, *, n_bins: int, n_bootstrap: int,
              title: str, seed: int = 0, probs: Any = None, report: Mapping[str, Any] | None = None) -> dict:
    """Report + plots + predictions of one split into ``tracker``; returns the report.

    ``probs`` (default: the float64 softmax of ``logits``) are what is scored, e.g. a calibrator's; ``report``
    is logged as given when the caller computed it already. Logs ``{split}/*`` (with ``n_bootstrap`` CIs), the
    referral metrics ``{split}/aurc`` and ``{split}/acc_cov90`` (accuracy on the 90% most confident images;
    :func:`lungcal.calibration.selective.selective_report`), the reliability diagram and the risk-coverage
    curve (``plot_artifact(split, "reliability" | "risk_coverage")``) and ``predictions_artifact(split, "npz")``
    (``logits``, ``probs`` as float32, ``labels``).
    """
    p = torch.softmax(logits.double(), dim=1).numpy() if probs is None else np.asarray(probs, dtype=np.float64)
    y = labels.cpu().numpy() if isinstance(labels, torch.Tensor) else np.asarray(labels)
    report = dict(report) if report is not None else calibration_report(p, y, n_bins=n_bins, n_bootstrap=n_bootstrap,
                                                                         seed=seed)
    tracker.log_report(split, report)
    referral = selective_report(p, y, coverage=0.9)
    tracker.log_report(split, {k: referral[k] for k in ("aurc", "acc_cov90")})
    tracker.log_figure(risk_coverage_plot(p, y, title=f"{title} ({split})"), plot_artifact(split, "risk_coverage"))
    tracker.log_figure(reliability_diagram(p, y, n_bins=n_bins, title=f"{title} ({split})"),
                       plot_artifact(split, "reliability"))
    folder, name = predictions_artifact(split, "npz").rsplit("/", 1)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / name
        np.savez_compressed(path, logits=logits.numpy(), probs=p.astype(np.float32), labels=y)
        tracker.log_artifact(path, folder)
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
    params = list(network.get_submodule("head").parameters())
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

    The run's settings are the ``settings`` of its ``config/resolved.json`` (a run recorded before the
    shared skeleton holds them at the top level).

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
    client = MlflowClient(tracking_uri=Store(output_dir, tracking_uri).uri)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            sd = client.download_artifacts(stage1_run_id, f"{MODEL_ARTIFACT}/state_dict.pt", tmp)
            state = torch.load(sd, map_location="cpu", weights_only=True)
            cfg = json.loads(Path(client.download_artifacts(stage1_run_id, CONFIG_ARTIFACT, tmp)).read_text())
    except Exception as exc:  # noqa: BLE001 - any store failure is the user's run id or URI
        raise TrackingError(f"cannot read stage-1 run {stage1_run_id!r} ({exc})", field="stage1_run_id",
                            fix="check the run id and tracking_uri") from exc
    return Stage1Model(state, dict(cfg.get("settings", cfg)), stage1_run_id)


def follow_epochs(trainer) -> None:
    """Give a ``DistributedSampler`` of the trainer's batches the epoch when each starts (a new shuffle).

    MONAI engines do this for a ``DataLoader``'s sampler; :class:`~cifar_baselines.batches.BatchIterator`
    is not one. The epoch comes from the trainer's state, so a resumed run shuffles as an uninterrupted one.
    """
    set_epoch = getattr(getattr(trainer.data_loader, "index_sampler", None), "set_epoch", None)
    if callable(set_epoch):
        trainer.add_event_handler(Events.EPOCH_STARTED, lambda engine: set_epoch(engine.state.epoch))


class _CifarRun(TrackedStage1):
    """What both CIFAR runs share on the skeleton: the data and network, the resume state, the tags, float32
    val/test scores of the network, calibrated splits in the post-hoc runs, the summary's next command."""

    dataset: str
    #: whether training keeps a resume state (LAS on cached features does not)
    resumable = True

    def __init__(self, network: torch.nn.Module, data: CifarSplits, settings: Mapping[str, Any] | None,
                 store: Store | None, evaluation: Evaluation | None, lr_scheduler: Any = None,
                 channels_last: bool = True) -> None:
        super().__init__(settings, store, evaluation)
        self.network, self.data = network, data
        self.module = unwrap(network)  # the bare network (a DDP wrapper's module): saved, logged, evaluated
        self.lr_scheduler, self.channels_last = lr_scheduler, channels_last

    def run(self, trainer) -> dict[str, Any]:  # type: ignore[override]
        """:meth:`TrackedStage1.run` with the bundle's trainer (``$@workflow.run(@train#trainer)``)."""
        self.trainer = trainer
        return super().run()

    def tags(self, stage2: str) -> dict[str, str]:
        return {TAG_DATASET: self.dataset, TAG_STAGE1: self.method, TAG_STAGE2: stage2, TAG_SITE: SITE}

    def training_state(self) -> TrainingResume:
        """The resume state: network, optimizer, LR schedule, trainer, the step (grad scaler), every RNG."""
        step = self.trainer._process_function
        objects = {"model": self.module, "optimizer": self.trainer.optimizer, "lr_scheduler": self.lr_scheduler,
                   "trainer": self.trainer, "step": step if hasattr(step, "state_dict") else None,
                   "rng": RandomState(generators_of(self.trainer.data_loader, step))}
        return TrainingResume(self.store.path / "resume" / self.identity(), objects,
                              enabled=self.store.resume and self.resumable)

    def _command(self, config_file: str, **keys: str) -> str:
        """``python -m monai.bundle run`` of ``config_file`` with ``keys``, on this run's store and output
        folder where the bundle set them (the defaults find themselves)."""
        keys = {**keys, **{k: self.settings[k] for k in ("output_dir", "tracking_uri") if self.settings.get(k)}}
        return " ".join([f"python -m monai.bundle run --config_file {config_file}",
                         *(f"--{k} {v}" for k, v in keys.items())])

    def score_splits(self, tracker: RunTracker, title: str) -> SplitScores:
        """Float32 logits of val and test, logged (val without CIs, test with them), as :class:`SplitScores`."""
        ev, d = self.evaluation, self.data
        val = predict(self.module, d.val_x, channels_last=self.channels_last)
        test = predict(self.module, d.test_x, channels_last=self.channels_last)
        log_split(tracker, "val", val, d.val_y, n_bins=ev.n_bins, n_bootstrap=0, seed=ev.seed, title=title)
        test_probs = torch.softmax(test.double(), dim=1).numpy()
        report = log_split(tracker, "test", test, d.test_y, n_bins=ev.n_bins, n_bootstrap=ev.n_bootstrap,
                           seed=ev.seed, title=title, probs=test_probs)
        return SplitScores(val, d.val_y.cpu().numpy(), test, d.test_y.cpu().numpy(), test_probs, report)

    def log_post_hoc(self, tracker: RunTracker, name: str, calibrator: Any, probs: np.ndarray,
                     report: dict[str, Any], scores: SplitScores, *, reference: bool,
                     threshold: float | None) -> None:
        """The calibrated val split (no CIs) and test split (the skeleton's report, with CIs)."""
        ev, title = self.evaluation, f"{self.dataset} {self.method} + {name.upper()}"
        log_split(tracker, "val", scores.val_logits, scores.val_labels, n_bins=ev.n_bins, n_bootstrap=0,
                  seed=ev.seed, title=title, probs=calibrated_probs(calibrator, scores.val_logits.numpy()))
        log_split(tracker, "test", scores.test_logits, scores.test_labels, n_bins=ev.n_bins,
                  n_bootstrap=ev.n_bootstrap, title=title, probs=probs, report=report)

    def summary(self, title: str, rows: list, runs: list, next_step: str, post: Sequence[PostHocResult] = ()) -> str:
        """:func:`lungcal.workflow.summary_lines` in the study's units (ACC / ECE in %), then the paired test
        ECE difference each calibrator makes (same images before and after, a paired bootstrap)."""
        text = summary_lines(title, rows, self.store.path, self.store.uri, runs, columns=CIFAR_COLUMNS,
                             next_steps=[next_step], prefix="cifar_baselines")
        return text + post_hoc_lines(post, self.resumed_from, percent=True)


class Stage1Run(_CifarRun):
    """Stage-1 training in a tracked run, then the post-hoc calibrators in linked child runs.

    Args:
        network, data: the bundle's ``network`` (the trainer's) and ``data``.
        dataset, method: the MLflow experiment and the ``lungcal.stage1`` tag.
        settings: the bundle's hyperparameters (its ``settings`` section of ``"@key"`` references): params,
            ``config/resolved.json`` and, with what the network and the loss are, the resume identity.
        store: where the runs go (:class:`lungcal.workflow.Store`; the run name defaults to
            ``<dataset>_<method>-<timestamp>``).
        evaluation: ECE bins (15), bootstrap, seed and ``post_hoc`` calibrators (:class:`lungcal.workflow.Evaluation`).
        loss: recorded as a spec (what it is). lr_scheduler: saved in the resume state.
        amp: recorded as the ``train_precision`` param (what the trainer's step computes in).
        channels_last: of the final reports and predictions.

    ``run(trainer)`` returns ``{run_id, stage1_run_id, checkpoint, test, post_hoc, train_wall_s,
    resumed_from_epoch}`` and, with TS among the calibrators, ``ts_run_id``, ``temperature`` and ``test_ts``;
    ``train_wall_s`` (also a metric of the run) sums the training time of every process that worked on a
    resumed run (:class:`lungcal.runtime.resume.RunRecord`).
    """

    def __init__(self, network: torch.nn.Module, data: CifarSplits, dataset: str, method: str,
                 settings: Mapping[str, Any] | None = None, store: Store | None = None,
                 evaluation: Evaluation | None = None, loss: Any = None, lr_scheduler: Any = None, amp: bool = True,
                 channels_last: bool = True) -> None:
        super().__init__(network, data, settings, store, evaluation, lr_scheduler, channels_last)
        self.dataset, self.method, self.amp = str(dataset), str(method), amp
        self.experiment = self.dataset
        self.name = f"{self.dataset}_{self.method}"
        self.run_name = self.store.name(self.name)
        self.network_def = spec_of(self.module, strict=False)
        self.loss_def = None if loss is None else spec_of(loss, strict=False, where="loss")

    def specs(self) -> dict[str, Any]:
        return {"network_def": self.network_def, "loss": self.loss_def}

    def params(self) -> dict[str, Any]:
        """The settings, the specs, what the training computes in, and which images it saw."""
        d = self.data
        return {**super().params(), "train_precision": training_precision(d.train_x.device, self.amp),
                "class_counts": d.class_counts, "n_train": len(d.train_y), "n_val": len(d.val_y),
                "n_test": len(d.test_y), "split_fingerprint": d.fingerprint, **d.provenance()}

    def checkpoint_path(self, run_id: str | None = None) -> Path:
        """``<output_dir>/checkpoints/<dataset>_<method>_<run id>.pt``."""
        run_id = run_id or getattr(self.tracker, "run_id", None)  # the open run's
        return self.store.path / "checkpoints" / f"{self.name}_{run_id}.pt"

    def selection_path(self, kind: str) -> Path:
        """The weights of a selected epoch (:class:`cifar_baselines.handlers.EpochSelection`): ``..._<kind>.pt``."""
        return self.checkpoint_path().with_name(f"{self.checkpoint_path().stem}_{kind}.pt")

    def prepare(self) -> None:
        if len(self.data.val_y) < self.world_size:
            raise ConfigError(f"{len(self.data.val_y)} validation images for {self.world_size} processes",
                              field="nproc_per_node", fix="use fewer processes or a larger val_per_class")

    def before_training(self) -> None:
        follow_epochs(self.trainer)

    def _selected_epochs(self, tracker: RunTracker) -> list[tuple[str, dict]]:
        """Test reports (with CIs) of the best-validation and the best-test epoch, when the bundle kept them.

        Logged as ``test_best_val/*`` and ``test_best_test/*`` with the epochs as ``best_val_epoch`` and
        ``best_test_epoch``; the last epoch stays the run's result (``test/*``). Returns summary rows.
        """
        ev, rows = self.evaluation, []
        for kind, label in (("best_val", "best-val epoch"), ("best_test", "best-test epoch [MiSLAS conv.]")):
            path = self.selection_path(kind)
            if not path.is_file():
                continue
            blob = torch.load(path, map_location="cpu", weights_only=True)
            net = copy.deepcopy(self.module)
            net.load_state_dict(blob["state_dict"])
            logits = predict(net, self.data.test_x, channels_last=self.channels_last)
            p = torch.softmax(logits.double(), dim=1).numpy()
            report = calibration_report(p, self.data.test_y.cpu().numpy(), n_bins=ev.n_bins,
                                        n_bootstrap=ev.n_bootstrap, seed=ev.seed)
            tracker.log_report(f"test_{kind}", report)
            tracker.log_metrics({f"{kind}_epoch": int(blob["epoch"])})
            rows.append((f"{label} {int(blob['epoch'])}", report))
        return rows

    def evaluate(self, tracker: RunTracker) -> SplitScores:
        """Score val and test (the last epoch: the result), the selected epochs; log the training time, model."""
        scores = self.score_splits(tracker, f"{self.dataset} {self.method}")
        scores.extra["selected"] = self._selected_epochs(tracker)
        tracker.log_metrics({"train_wall_s": self.train_wall_s})
        tracker.log_model(self.module, MODEL_ARTIFACT, extra=_MODEL_CONFIG)
        return scores

    def finish(self, scores: SplitScores, post: list[PostHocResult], stage1_run_id: str) -> dict[str, Any]:
        rows = [(self.method, scores.test_report)]
        for r in post:
            t = f" (T {r['temperature']:.3f})" if r["temperature"] is not None else ""
            rows.append((f"+ {r['name'].upper()}{t}", r["test"]))
        runs = [("stage 1", stage1_run_id)] + [(f"+{r['name'].upper()}", r["run_id"]) for r in post]
        las = self._command(config_file_argument(recipe_files(f"{self.dataset}_las")), stage1_run_id=stage1_run_id)
        print(self.summary(f"{self.dataset} {self.method}", rows + scores.extra["selected"], runs, las, post),
              flush=True)
        ckpt = self.checkpoint_path(stage1_run_id)
        result = {"run_id": stage1_run_id, "stage1_run_id": stage1_run_id,
                  "checkpoint": str(ckpt) if ckpt.is_file() else None, "test": scores.test_report,
                  "post_hoc": {r["name"]: r for r in post}, "train_wall_s": self.train_wall_s,
                  "resumed_from_epoch": self.resumed_from}
        for r in post:
            if r["temperature"] is not None:
                result.update(ts_run_id=r["run_id"], temperature=r["temperature"], test_ts=r["test"])
        return result


class LASRun(_CifarRun):
    """MiSLAS stage 2 on ``stage1`` in a run tagged ``lungcal.stage2 = las`` and linked to it.

    With ``shift_bn`` (default) the trainer retrains the head (the bundle's optimiser holds only
    :func:`trainable_head`) on augmented class-balanced batches with the network in train mode,
    so its BatchNorm statistics follow them ("shift learning on BN"). Without it, the head is
    retrained on cached features by :func:`lungcal.calibration.las.retrain_head_las` with the
    same settings (``epochs``, ``lr``, ``batch_size``, ``weight_decay``, ``smooth_head``,
    ``smooth_tail``, ``las_shape``, ``seed``), and nothing is resumed.

    The run's params and ``config/resolved.json`` hold its settings with the stage-1 run's split
    settings (:data:`SPLIT_KEYS`). It fits no post-hoc calibrator (``evaluation.post_hoc`` is empty).

    ``run(trainer)`` returns ``{run_id, stage1_run_id, test, resumed_from_epoch}``.
    """

    def __init__(self, network: torch.nn.Module, data: CifarSplits, stage1: Stage1Model,
                 settings: Mapping[str, Any] | None = None, store: Store | None = None,
                 evaluation: Evaluation | None = None, shift_bn: bool = True, lr_scheduler: Any = None,
                 channels_last: bool = True) -> None:
        super().__init__(network, data, settings, store, evaluation or Evaluation(n_bins=15, post_hoc=[]),
                         lr_scheduler, channels_last)
        require_one_process()
        if self.evaluation.post_hoc:
            raise ConfigError(f"a LAS run fits no post-hoc calibrator, got {self.evaluation.post_hoc}",
                              field="evaluation#post_hoc", fix="leave post_hoc empty in the LAS bundle")
        self.stage1, self.shift_bn = stage1, shift_bn
        self.resumable = self.shift_bn  # on cached features: nothing to resume
        self.dataset = self.experiment = str(stage1.settings.get("dataset", "cifar10"))
        self.method, self.parent_run_id = stage1.method, stage1.run_id
        self.splits = {k: stage1.settings.get(k) for k in SPLIT_KEYS}  # the stage-1 splits, recorded
        self.run_name = self.store.name(f"{self.dataset}_{self.method}_las")

    def tags(self, stage2: str) -> dict[str, str]:
        """The run is stage 2 itself: ``lungcal.stage2 = las`` (it has no post-hoc runs)."""
        return super().tags("las")

    def params(self) -> dict[str, Any]:
        return {**super().params(), **self.splits, "stage1_method": self.method,
                "class_counts": self.data.class_counts, **self.data.provenance()}

    def resolved_config(self) -> dict[str, Any]:
        cfg = super().resolved_config()
        return {**cfg, "settings": {**cfg["settings"], **self.splits}, "stage1": self.stage1.settings}

    def _train(self) -> None:
        if self.shift_bn:
            super()._train()
        else:
            self._retrain_on_features()

    def _retrain_on_features(self) -> None:
        las, net, d = self.settings, self.network, self.data
        _, feats = predict(net, d.train_x, channels_last=self.channels_last, features=True)
        head = retrain_head_las(net.get_submodule("head"), feats, d.train_y.cpu(), d.class_counts,
                                smooth_head=las["smooth_head"], smooth_tail=las["smooth_tail"], shape=las["las_shape"],
                                epochs=int(las["epochs"]), lr=las["lr"], batch_size=int(las["batch_size"]),
                                balanced_sampling=True, seed=int(las["seed"]), weight_decay=las["weight_decay"])
        net.head = head.to(next(net.parameters()).device)

    def evaluate(self, tracker: RunTracker) -> SplitScores:
        scores = self.score_splits(tracker, f"{self.dataset} {self.method} + LAS")
        tracker.log_model(self.module, MODEL_ARTIFACT, extra=_MODEL_CONFIG)
        return scores

    def finish(self, scores: SplitScores, post: list[PostHocResult], stage1_run_id: str) -> dict[str, Any]:
        report = f"lungcal report --experiment {self.dataset} --tracking-uri {self.store.uri}"
        print(self.summary(f"{self.dataset} {self.method} + LAS", [(f"{self.method} + LAS", scores.test_report)],
                           [("LAS", stage1_run_id)], report), flush=True)
        return {"run_id": stage1_run_id, "stage1_run_id": self.stage1.run_id, "test": scores.test_report,
                "resumed_from_epoch": self.resumed_from}
