"""The run step of the stage-1 CT bundles (``bundles/nlst_*.json``, id ``workflow``).

Everything it runs is built by the bundle (``network``, ``train#trainer`` with its handlers,
``validate#evaluator``, ``cohort``) and handed over by reference, the hyperparameters as the bundle's
``settings`` section; the order of work is the shared skeleton's (:class:`lungcal.workflow.TrackedStage1`):
open the MLflow run, bind the checkpoint and epoch-logging handlers to it, train, reload the best
checkpoint, evaluate the test split with bootstrap CIs, fit the post-hoc calibrators in linked runs
and print the summary.

Resume (:mod:`lungcal.runtime.resume`): rerunning the same bundle with the same settings after an
interruption continues from the last complete epoch into the same MLflow run; ``resume: false``
starts afresh. The identity is a hash of the settings and of the network's and loss's specs.
Fine-tuning (:class:`FineTune`): ``init_run_id`` / ``init_checkpoint`` start from a trained stage-1
model's weights (encoder + head; the encoder frozen with ``freeze_encoder``), tagged
``lungcal.init_run``; the parent model's metrics on the site's validation split, before any
training, are logged as ``val_init/*``.

Data-parallel (``torchrun`` with ``bundles/multi_gpu.json``, :mod:`lungcal.runtime.distributed`):
every rank trains its shard of each epoch and scores its shard of the validation split (the
metrics are gathered, so they are the whole split's); rank 0 alone opens the MLflow run (one run,
``world_size`` among its params), writes the checkpoints and the resume state, evaluates the test
split, runs the post-hoc calibrators and prints the summary; the other ranks return after training.

Reproducibility: the bundle seeds the global RNG before it builds the network (``initialize``);
this step seeds it again just before training, and the loaders, the augmentation and the mixup
draws use their own seeded generators.
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from lungcal.calibration.scaling import probabilities
from lungcal.ctapp.data.cohort import SPLITS, CTCohort
from lungcal.ctapp.evaluate.pictures import check_picture_mode
from lungcal.ctapp.evaluate.reports import evaluate_probs, log_site_reference, log_split
from lungcal.ctapp.model.checkpoint import load_stage1, selection_record
from lungcal.ctapp.model.handlers import AtomicCheckpoint, EpochMetricsLogger
from lungcal.ctapp.model.predict import check_mc_samples, predict, predict_uncertainty
from lungcal.ctapp.train.posthoc import log_calibrated_test
from lungcal.errors import ConfigError
from lungcal.runtime import resolve_device, seed_everything
from lungcal.runtime.bundle_config import spec_of
from lungcal.runtime.distributed import plain_state_dict, unwrap
from lungcal.runtime.resume import RandomState, TrainingResume, generators_of
from lungcal.tracking import (
    CT_EXPERIMENT,
    PRIVATE_KEYS,
    SELECTION_ARTIFACT,
    TAG_DATASET,
    TAG_INIT_RUN,
    TAG_SITE,
    TAG_STAGE1,
    TAG_STAGE2,
    RunTracker,
    file_digest,
)
from lungcal.workflow.stage1 import Evaluation, PostHocResult, SplitScores, Store, TrackedStage1
from lungcal.workflow.summary import CT_COLUMNS, post_hoc_lines, summary_lines

__all__ = ["Scoring", "FineTune", "Stage1Run", "plan_text"]


def plan_text(method: str, datalist: str | None, epochs: int, post_hoc: Any = (),
              demo_subjects: int | None = None) -> str:
    """The line a stage-1 bundle logs first (its ``initialize`` section, through
    :func:`lungcal.workflow.stages.announce`): what the run will do, and for the built-in demo how long that
    took on an idle 2-core machine."""
    demo = datalist in (None, "", "synthetic")
    what = (f"the built-in synthetic demo cohort ({demo_subjects or 1000} CTs, made on the first run)" if demo
            else f"the datalist {Path(str(datalist)).name}")
    post = ", ".join(str(p).upper() for p in (post_hoc or [])) or "no post-hoc calibration"
    text = (f"{method} stage 1 on {what}: series checks and one bag per CT (cached ones are read back), "
            f"{epochs} epochs, evaluation on val and test, then {post}")
    if demo and not demo_subjects:
        text += ("; on an idle 2-core machine this took about 9 min the first time and 3-4 min once cached "
                 "(docs/results.md)")
    return text


@dataclass
class Scoring:
    """How the trained network scores a split: loader ``batch_size``, ``device``, ``mc_samples`` (0: one
    deterministic pass; T >= 1: the mean softmax of T seeded MC-dropout passes,
    :func:`lungcal.ctapp.model.predict.predict_uncertainty`) and ``test_pictures`` (``gallery``, ``all`` or
    ``none``: per-CT pictures of the test split in the reference calibrator's run)."""

    batch_size: int = 16
    device: str | None = "auto"
    mc_samples: int = 0
    test_pictures: str = "gallery"

    def __post_init__(self) -> None:
        self.batch_size = int(self.batch_size)
        self.test_pictures = check_picture_mode(self.test_pictures)


@dataclass
class FineTune:
    """Start from a trained stage-1 model: ``init_run_id`` (an MLflow run) or ``init_checkpoint`` (a file);
    ``freeze_encoder`` trains the head only."""

    init_run_id: str | None = None
    init_checkpoint: str | None = None
    freeze_encoder: bool = False

    def __post_init__(self) -> None:
        self.init_run_id, self.init_checkpoint = self.init_run_id or None, self.init_checkpoint or None
        if self.freeze_encoder and not (self.init_run_id or self.init_checkpoint):
            raise ConfigError("freeze_encoder needs a trained model to start from", field="freeze_encoder",
                              fix="set init_run_id or init_checkpoint, or freeze_encoder false")

    @property
    def active(self) -> bool:
        return bool(self.init_run_id or self.init_checkpoint)


class Stage1Run(TrackedStage1):
    """Train, test and post-hoc calibrate one stage-1 model; log it all to MLflow; print the summary.

    Args:
        network: the network the trainer trains (bundle ``network``).
        trainer: ``monai.engines.SupervisedTrainer`` (bundle ``train#trainer``).
        cohort: the :class:`~lungcal.ctapp.data.cohort.CTCohort` the loaders read.
        checkpoint: the :class:`~lungcal.ctapp.model.handlers.AtomicCheckpoint` among the trainer's handlers.
        epoch_logger: the :class:`~lungcal.ctapp.model.handlers.EpochMetricsLogger` among them.
        method: stage-1 name for tags and run names (``ce``, ``focal``, ``mixup``, ``focal_mixup``).
        settings: the bundle's hyperparameters (its ``settings`` section of ``"@key"`` references):
            params, ``config/resolved.json`` and, with the specs of ``network`` and ``loss``, the resume identity.
        store: where the run goes (:class:`lungcal.workflow.Store`).
        evaluation: ECE bins, bootstrap, seed and ``post_hoc`` calibrators (:class:`lungcal.workflow.Evaluation`).
        scoring: how splits are scored (:class:`Scoring`). init: fine-tuning (:class:`FineTune`).
        loss, optimizer: recorded as specs (what they are and the arguments they keep, not rebuilt); the
            trainer's data loader too (``train_loader``: its batch size, ``drop_last``, workers).
        lr_scheduler: the trainer's LR scheduler, saved in the resume state.
        parent_run_id: nest this run under that MLflow run (an ensemble's parent run).
        extra_tags: more tags for the stage-1 run (not its post-hoc runs), e.g. ``lungcal.ensemble``.
    """

    def __init__(self, network: nn.Module, trainer, cohort: CTCohort, checkpoint: AtomicCheckpoint,
                 epoch_logger: EpochMetricsLogger, method: str, settings: Mapping[str, Any] | None = None,
                 store: Store | None = None, evaluation: Evaluation | None = None, scoring: Scoring | None = None,
                 init: FineTune | None = None, loss: Any = None, optimizer: Any = None, lr_scheduler: Any = None,
                 experiment: str = CT_EXPERIMENT, parent_run_id: str | None = None,
                 extra_tags: Mapping[str, str] | None = None) -> None:
        super().__init__(settings, store, evaluation)
        if int(trainer.state.max_epochs or 0) < 1:
            raise ConfigError(f"epochs must be >= 1, got {trainer.state.max_epochs}", field="epochs",
                              fix="set epochs to 1 or more")
        self.settings = {k: v for k, v in self.settings.items() if k not in PRIVATE_KEYS}
        self.network, self.trainer, self.cohort = network, trainer, cohort
        self.checkpoint, self.epoch_logger = checkpoint, epoch_logger
        self.method, self.experiment = str(method), experiment
        self.run_name = self.store.name(self.method)
        self.scoring = scoring or Scoring()
        self.init = init or FineTune()
        if self.init.freeze_encoder and self.world_size > 1:  # DDP registered the encoder's gradients already
            raise ConfigError("freeze_encoder does not run under torchrun (multi_gpu.json)", field="freeze_encoder",
                              fix="fine-tune a frozen encoder in one process (drop multi_gpu.json)")
        self.device = resolve_device(self.scoring.device)
        self.network_def = spec_of(unwrap(network))  # what a checkpoint rebuilds (ConfigError if it cannot)
        self.loss_def = None if loss is None else spec_of(loss, strict=False, where="loss")
        self.optimizer_def = None if optimizer is None else spec_of(optimizer, strict=False, where="optimizer")
        self.train_loader_def = spec_of(trainer.data_loader, strict=False, where="train#dataloader")
        self.lr_scheduler = lr_scheduler
        self.mc_samples = check_mc_samples(network, self.scoring.mc_samples)
        self.parent_run_id = parent_run_id or None
        self.extra_tags = {str(k): str(v) for k, v in (extra_tags or {}).items()}
        self.init_tag: str | None = None
        self.result: dict[str, Any] = {}

    @property
    def test_pictures(self) -> str:
        return self.scoring.test_pictures

    @test_pictures.setter
    def test_pictures(self, mode: str) -> None:
        self.scoring.test_pictures = check_picture_mode(mode)

    def specs(self) -> dict[str, Any]:
        return {"network_def": self.network_def, "loss": self.loss_def, "optimizer": self.optimizer_def,
                "train_loader": self.train_loader_def}

    def training_state(self) -> TrainingResume:
        """The resume state of this run: model, optimizer, scheduler, trainer, best metric, every RNG."""
        evaluator = self.checkpoint.evaluator
        rng = RandomState(generators_of(self.trainer.data_loader, self.trainer._process_function,
                                        evaluator.data_loader))
        scaler = getattr(self.trainer, "scaler", None)  # MONAI sets it with amp; disabled off CUDA (no state)
        objects = {"model": unwrap(self.network), "optimizer": self.trainer.optimizer,
                   "lr_scheduler": self.lr_scheduler, "trainer": self.trainer, "best": self.checkpoint, "rng": rng,
                   "scaler": scaler if scaler is not None and scaler.is_enabled() else None}
        return TrainingResume(self.store.path / "resume" / self.identity(), objects, enabled=self.store.resume)

    def load_init(self) -> str | None:
        """Load the ``init_run_id`` / ``init_checkpoint`` weights into the network; returns the tag value."""
        if not self.init.active:
            return None
        field = "init_checkpoint" if self.init.init_checkpoint else "init_run_id"
        parent = load_stage1(self.init.init_run_id, self.store.uri, checkpoint=self.init.init_checkpoint,
                             device="cpu", field=field)
        try:
            unwrap(self.network).load_state_dict(parent.network.state_dict())
        except RuntimeError as exc:
            why = str(exc).splitlines()[0]
            raise ConfigError(f"the {field} model does not fit this bundle's network_def ({why})", field=field,
                              fix="fine-tune with the parent's network_def (same encoder and head)") from exc
        if self.init.freeze_encoder:
            for p in unwrap(self.network).get_submodule("encoder").parameters():
                p.requires_grad_(False)
        if parent.run_id:
            return parent.run_id
        assert self.init.init_checkpoint is not None  # no parent run: the weights came from this file
        return f"checkpoint:{file_digest(self.init.init_checkpoint)}"

    def tags(self, stage2: str) -> dict[str, str]:
        return {TAG_DATASET: self.cohort.source, TAG_STAGE1: self.method, TAG_STAGE2: stage2,
                TAG_SITE: self.cohort.site, **(self.extra_tags if stage2 == "none" else {})}

    def params(self) -> dict[str, Any]:
        """The settings and specs, the datalist's source and hash (never its path), the CTs per split."""
        p = super().params()
        p["datalist"] = {"source": self.cohort.source, "sha256": self.cohort.digest}
        p["n_ct"] = {s: len(self.cohort.splits[s]["subjects"]) for s in SPLITS}
        return p

    def resolved_config(self) -> dict[str, Any]:
        cfg = super().resolved_config()
        cfg["datalist"] = {"source": self.cohort.source, "sha256": self.cohort.digest}
        return cfg

    def prepare(self) -> None:
        self.cohort.load()
        seed_everything(self.evaluation.seed)
        n_val = len(self.cohort.splits["val"]["subjects"])
        if n_val < self.world_size:
            raise ConfigError(f"{n_val} validation CTs for {self.world_size} processes", field="nproc_per_node",
                              fix="give each process at least one validation CT (fewer processes or more CTs)")
        self.init_tag = self.load_init()

    def bind(self, tracker: RunTracker, previous: str | None) -> None:
        super().bind(tracker, previous)
        self.checkpoint.bind(self.store.path / "checkpoints" / tracker.run_id,
                             extra={"network_def": self.network_def, "method": self.method,
                                    "bag_params": json.dumps(self.cohort.bag_params),
                                    "kernel_augment_mm": json.dumps(self.cohort.train_bag_params.get("kernel_aug_mm"))})
        assert self.epoch_log is not None  # super().bind set it
        self.epoch_logger.bind(self.epoch_log)

    def on_first_open(self, tracker: RunTracker) -> None:
        self.cohort.log_qc(tracker)  # qc.csv: the series checks of every CT (pseudonyms, no paths)
        self.cohort.log_acquisition(tracker)  # data/acquisition.json: the train split's scanners, no identifiers
        # data/selection.json: the pseudonyms that trained and chose the checkpoint (never certify a threshold on them)
        splits = self.cohort.splits
        tracker.log_dict(selection_record(splits["train"]["subjects"], splits["val"]["subjects"],
                                          self.checkpoint.metric_name), SELECTION_ARTIFACT)
        if self.init_tag:
            tracker.set_tags({TAG_INIT_RUN: self.init_tag})
            self._log_init_validation(tracker)

    def _log_init_validation(self, tracker: RunTracker) -> None:
        """``val_init/*``: the parent model, before fine-tuning, on this site's validation split."""
        val = self.cohort.splits["val"]
        loader = self.cohort.loader("val", self.scoring.batch_size)
        logits = predict(unwrap(self.network), loader, self.device)["logits"]
        rep = evaluate_probs(probabilities(logits), val["labels"], n_bins=self.evaluation.n_bins, n_bootstrap=0,
                             seed=self.evaluation.seed)
        tracker.log_report("val_init", {k: v for k, v in rep.items() if "_ci_" not in k})

    def workdir(self, run_id: str):
        return self.store.path / "checkpoints" / run_id / "eval"

    def evaluate(self, tracker: RunTracker) -> SplitScores:
        """Reload the best checkpoint; score val and test; log the test report, plots, predictions, model."""
        ev, net = self.evaluation, unwrap(self.network)
        best = torch.load(self.checkpoint.best_path, map_location="cpu", weights_only=True)
        net.load_state_dict(plain_state_dict(best["state_dict"]))
        tracker.log_metrics({"best/epoch": best["epoch"], "best/val_auc": best["metric"]})
        out = {s: predict_uncertainty(net, self.cohort.loader(s, self.scoring.batch_size), self.device,
                                      mc_samples=self.mc_samples, seed=ev.seed) for s in ("val", "test")}
        test, val = self.cohort.splits["test"], self.cohort.splits["val"]
        p_test = out["test"]["probs"]  # mc_samples 0: exactly probabilities(logits)
        rep_test = evaluate_probs(p_test, test["labels"], n_bins=ev.n_bins, n_bootstrap=ev.n_bootstrap, seed=ev.seed)
        rep_val = evaluate_probs(out["val"]["probs"], val["labels"], n_bins=ev.n_bins, n_bootstrap=0, seed=ev.seed)
        log_split(tracker, "test", p_test, test["labels"], rep_test, n_bins=ev.n_bins, subjects=test["subjects"],
                  attention=out["test"]["attention"], candidates=test["candidates"],
                  workdir=self.workdir(tracker.run_id), title=self.method,
                  mi=out["test"]["mi"] if self.mc_samples else None)
        tracker.log_report("val", {k: v for k, v in rep_val.items() if "_ci_" not in k})
        log_site_reference(tracker, out["val"]["logits"], val["labels"], out["val"]["features"],
                           self.workdir(tracker.run_id))
        tracker.log_model(net, extra={"network_def": self.network_def})
        tracker.log_artifact(self.checkpoint.best_path, "checkpoint")
        return SplitScores(out["val"]["logits"], np.asarray(val["labels"]), out["test"]["logits"],
                           np.asarray(test["labels"]), p_test, rep_test,
                           extra={"out": out, "test": test, "attention": out["test"]["attention"],
                                  "train_labels": self.cohort.splits["train"]["labels"],
                                  "workdir": self.workdir(tracker.run_id)})

    def log_post_hoc(self, tracker: RunTracker, name: str, calibrator: Any, probs: np.ndarray,
                     report: dict[str, Any], scores: SplitScores, *, reference: bool,
                     threshold: float | None) -> None:
        log_calibrated_test(tracker, name, probs, report, scores, n_bins=self.evaluation.n_bins, title=self.method,
                            reference=reference, threshold=threshold, pictures=self.scoring.test_pictures)

    def finish(self, scores: SplitScores, post: list[PostHocResult], stage1_run_id: str) -> dict[str, Any]:
        self.result = {"stage1_run_id": stage1_run_id, "test": scores.test_report,
                       "checkpoint": str(self.checkpoint.best_path), "post_hoc": {r["name"]: r for r in post},
                       "resumed_from_epoch": self.resumed_from, "predictions": scores.extra["out"],
                       "network_def": self.network_def, "bag_params": self.cohort.bag_params}
        title = f"{self.method} (stage 1)" + "".join(f" + {r['name'].upper()}" for r in post)
        rows = [(self.method, scores.test_report)] + [(f"{self.method}+{r['name'].upper()}", r["test"]) for r in post]
        runs = [("stage 1", stage1_run_id)] + [(f"+{r['name'].upper()}", r["run_id"]) for r in post]
        next_steps = [f"lungcal predict <CT or folder> --run {stage1_run_id}"
                      + (f" --tracking-uri {self.store.uri}" if self.settings.get("tracking_uri") else ""),
                      f"lungcal ui --tracking-uri {self.store.uri}"]
        text = summary_lines(title, rows, self.store.path, self.store.uri, runs, columns=CT_COLUMNS,
                             next_steps=next_steps)
        for r in post:
            if r["temperature"] is not None:
                self.result.update(ts_run_id=r["run_id"], temperature=r["temperature"], test_ts=r["test"])
                text += f"\n  temperature   {r['temperature']:.3f}"
        text += post_hoc_lines(post, self.resumed_from)
        print(text, flush=True)
        return self.result
