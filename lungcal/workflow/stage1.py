"""The tracked-run skeleton that the CT and the CIFAR stage-1 runs share.

:class:`TrackedStage1` runs, in this order, what a config cannot say in order:

1. ``prepare``: load the data, check it (a subclass hook);
2. open the MLflow run, or reopen the one an interrupted run left (:mod:`lungcal.runtime.resume`), and log
   the params and ``config/resolved.json`` once;
3. train with the bundle's trainer from the last complete epoch;
4. ``evaluate``: score the splits, log the reports, plots, predictions and the model (a subclass hook);
5. one child run per name of ``post_hoc`` (:data:`lungcal.calibration.scaling.CALIBRATORS`, default TS),
   each fitted on the validation logits, scored on test, linked to the stage-1 run;
6. the paired difference each calibrator makes to the test ECE (same cases, a paired bootstrap);
7. print the summary, clear the resume state, return the result.

A subclass holds the components (the bundle's network, trainer, data) and supplies the hooks; the
settings come from the bundle by reference (:class:`Store`, :class:`Evaluation`, ``settings``).
Under ``torchrun`` every rank trains its shard; rank 0 alone opens the run and does steps 4-7.
"""
from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lungcal.calibration.metrics import calibration_report, paired_bootstrap_diff
from lungcal.calibration.scaling import CALIBRATORS, calibrated_probs, fit_warnings, make_calibrator, no_signal
from lungcal.calibration.selective import REFERRAL_METRIC, referral_threshold
from lungcal.errors import ConfigError
from lungcal.paths import default_output_dir
from lungcal.runtime.distributed import is_rank_zero, world_size
from lungcal.runtime.resume import IDENTITY_EXCLUDE, StepFilter, TrainingResume, run_identity
from lungcal.runtime.settings import typed_settings
from lungcal.tracking import (
    CONFIG_ARTIFACT,
    REFERENCE_CALIBRATOR,
    TAG_CALIBRATOR,
    TAG_FIT_WARNING,
    TAG_RESUMED_FROM,
    RunTracker,
    add_run_metrics,
    calibrator_artifact,
    default_tracking_uri,
)
from lungcal.workflow.stages import stage

__all__ = ["Store", "Evaluation", "SplitScores", "PostHocResult", "TrackedStage1", "post_hoc_runs", "prevalence"]


@dataclass
class Store:
    """Where a run is kept and how it is named: the bundle's ``output_dir``, ``tracking_uri``, ``run_name`` and
    ``resume``. ``output_dir`` ``None`` is ``$LUNGCAL_HOME`` or ``./runs``; the tracking URI defaults to its
    SQLite store; the run name to ``<default>-<timestamp>``."""

    output_dir: str | Path | None = None
    tracking_uri: str | None = None
    run_name: str | None = None
    resume: bool = True

    def __post_init__(self) -> None:
        self.output_dir = Path(self.output_dir).expanduser() if self.output_dir else default_output_dir()
        self.tracking_uri = self.tracking_uri or default_tracking_uri(self.output_dir)

    @property
    def path(self) -> Path:
        return Path(self.output_dir)  # type: ignore[arg-type]

    @property
    def uri(self) -> str:
        return str(self.tracking_uri)

    def name(self, default: str) -> str:
        """The run name: ``run_name`` when set, else ``<default>-<timestamp>``."""
        return self.run_name or f"{default}-{time.strftime('%Y%m%d-%H%M%S')}"


@dataclass
class Evaluation:
    """How the splits are scored: ECE bins (CT 10, CIFAR 15), bootstrap resamples, the seed of the resamples,
    and the post-hoc calibrators fitted on validation (``post_hoc``, default ``["ts"]``)."""

    n_bins: int = 10
    n_bootstrap: int = 1000
    seed: int = 0
    post_hoc: Sequence[str] = ("ts",)

    def __post_init__(self) -> None:
        self.n_bins, self.n_bootstrap, self.seed = int(self.n_bins), int(self.n_bootstrap), int(self.seed)
        self.post_hoc = [str(p) for p in (self.post_hoc or [])]
        unknown = [p for p in self.post_hoc if p not in CALIBRATORS]
        if unknown:
            raise ConfigError(f"unknown post-hoc calibrator(s) {unknown}", field="post_hoc",
                              fix=f"use names from {sorted(CALIBRATORS)}, e.g. [\"ts\"]")


@dataclass
class SplitScores:
    """What :meth:`TrackedStage1.evaluate` hands on: validation and test logits, labels, the stage-1 test
    probabilities and report, and whatever the subclass's post-hoc logging needs (``extra``)."""

    val_logits: torch.Tensor
    val_labels: np.ndarray
    test_logits: torch.Tensor
    test_labels: np.ndarray
    test_probs: np.ndarray
    test_report: dict[str, Any]
    extra: dict[str, Any] = field(default_factory=dict)


class PostHocResult(dict):
    """``{"name", "run_id", "test" (report), "temperature" (ts only), "warnings", "probs" (test, calibrated),
    "ece_diff" (paired difference to stage 1)}``."""


def prevalence(labels: Any) -> float:
    """The fraction of positive (class 1) cases."""
    return float(np.mean(np.asarray(labels) == 1))


class TrackedStage1:
    """The skeleton (see the module doc). A subclass sets, in ``__init__``: ``trainer``, ``experiment``,
    ``store`` (:class:`Store`), ``evaluation`` (:class:`Evaluation`), ``settings`` (the bundle's hyperparameters
    by reference), ``run_name`` and ``method``; and implements :meth:`training_state`, :meth:`tags`,
    :meth:`evaluate` and :meth:`log_post_hoc`; the other hooks have defaults."""

    trainer: Any
    experiment: str
    store: Store
    evaluation: Evaluation
    settings: dict[str, Any]
    run_name: str
    method: str
    parent_run_id: str | None = None
    tracker: RunTracker | None = None
    #: ``log(metrics, step)`` of the per-epoch loggers: the open run, each (metric, step) once (resume)
    epoch_log: StepFilter | None = None
    resumed_from = 0
    train_wall_s = 0.0

    def __init__(self, settings: Mapping[str, Any] | None, store: Store | None, evaluation: Evaluation | None) -> None:
        self.settings = typed_settings(settings or {})
        self.store = store or Store()
        self.evaluation = evaluation or Evaluation()
        self.world_size = world_size()

    # ------------------------------------------------------------------ hooks
    def prepare(self) -> None:
        """Load and check the data before anything is opened (default: nothing)."""

    def training_state(self) -> TrainingResume:
        raise NotImplementedError

    def tags(self, stage2: str) -> dict[str, str]:
        raise NotImplementedError

    def specs(self) -> dict[str, Any]:
        """The self-descriptions of the components that shape the result (network, loss, ...): part of the
        resolved config and of the resume identity."""
        return {}

    def params(self) -> dict[str, Any]:
        """The MLflow params: the settings, the method and the post-hoc list (a subclass adds its own)."""
        return {**self.settings, **self.specs(), "method": self.method, "post_hoc": list(self.evaluation.post_hoc),
                "world_size": self.world_size}

    def resolved_config(self) -> dict[str, Any]:
        """``config/resolved.json``: the settings after overrides and the components' specs."""
        return {"settings": self.settings, **self.specs()}

    def identity(self) -> str:
        """The resume identity: the resolved config without the paths, the run name and ``resume``."""
        cfg = self.resolved_config()
        cfg["settings"] = {k: v for k, v in cfg["settings"].items() if k not in IDENTITY_EXCLUDE}
        return run_identity({**cfg, "_class": type(self).__name__})

    def bind(self, tracker: RunTracker, previous: str | None) -> None:
        """Bind the trainer's handlers to the open run (default: the epoch log)."""
        self.epoch_log = StepFilter(tracker.log_metrics, tracker.client, previous)

    def on_first_open(self, tracker: RunTracker) -> None:
        """Log what a new run logs once, after its params (default: nothing)."""

    def before_training(self) -> None:
        """Last step before ``trainer.run()`` (default: nothing)."""

    def evaluate(self, tracker: RunTracker) -> SplitScores:
        raise NotImplementedError

    def log_post_hoc(self, tracker: RunTracker, name: str, calibrator: Any, probs: np.ndarray, report: dict[str, Any],
                     scores: SplitScores, *, reference: bool, threshold: float | None) -> None:
        raise NotImplementedError

    def finish(self, scores: SplitScores, post: list[PostHocResult], stage1_run_id: str) -> dict[str, Any]:
        """The result dict and the printed summary (a subclass formats its own)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ the skeleton
    def run(self) -> dict[str, Any]:
        """Open or resume -> train -> evaluate -> post-hoc child runs -> paired differences -> summary."""
        self.prepare()
        state = self.training_state()
        previous = state.run_id(self.store.uri)
        if not is_rank_zero():  # torchrun: the other ranks train their shards; rank 0 does everything else
            self.resumed_from = state.load()
            self._train()
            return {"resumed_from_epoch": self.resumed_from}
        with RunTracker(self.experiment, self.run_name, tracking_uri=self.store.uri, tags=self.tags("none"),
                        run_id=previous, parent_run_id=self.parent_run_id) as tracker:
            self.tracker = tracker
            self.bind(tracker, previous)
            self.resumed_from = state.load()
            if self.resumed_from:
                tracker.set_tags({TAG_RESUMED_FROM: str(self.resumed_from)})
            else:
                tracker.log_params(self.params())
                tracker.log_dict(self.resolved_config(), CONFIG_ARTIFACT)
                self.on_first_open(tracker)
            state.attach(self.trainer, tracker.run_id)
            epochs = self.trainer.state.max_epochs
            with stage("training", f"epochs {self.resumed_from + 1}-{epochs}" if self.resumed_from < epochs
                       else "already complete"):
                self._train()
            self.train_wall_s = state.record.elapsed_s()  # every process's training time, when resumed
            with stage("evaluation", "the best checkpoint on val and test, with bootstrap CIs"):
                scores = self.evaluate(tracker)
            stage1_run_id = tracker.run_id
        with stage("post-hoc calibration", "one child run each"):
            post = self.post_hoc_runs(stage1_run_id, scores)
        result = self.finish(scores, post, stage1_run_id)
        state.clear()
        return result

    def _train(self) -> None:
        self.before_training()
        if self.resumed_from < self.trainer.state.max_epochs:
            self.trainer.run()

    def post_hoc_runs(self, stage1_run_id: str, scores: SplitScores) -> list[PostHocResult]:
        """:func:`post_hoc_runs` of this run."""
        return post_hoc_runs(self, stage1_run_id, scores)


def post_hoc_runs(host: Any, stage1_run_id: str, scores: SplitScores) -> list[PostHocResult]:
    """One child run per calibrator of ``host.evaluation.post_hoc``, fitted on validation and scored on test.

    ``host`` is the run that owns them (a :class:`TrackedStage1`, or an ensemble's parent run): it gives
    ``experiment``, ``run_name``, ``store``, ``evaluation``, ``tags(stage2)``, ``params()`` and
    ``log_post_hoc(...)``, which logs the calibrated test split its own way.

    Each run gets ``lungcal.calibrator``, the test report, the calibrator's JSON state
    (``calibrator/<name>.json``), ``temperature`` for TS and, when the fit is "no signal"
    (:func:`~lungcal.calibration.scaling.fit_warnings`), ``lungcal.fit_warning``. Binary tasks also
    store the prevalence the probabilities are calibrated to (``source_prior``; the stage-1 run gets
    ``val/prevalence`` and ``train/prevalence``) and the validation referral rule
    (:data:`~lungcal.calibration.selective.REFERRAL_METRIC`) that inference applies. Every result carries
    the paired bootstrap difference of its test ECE to stage 1's (``ece_diff``).
    """
    ev, names = host.evaluation, list(host.evaluation.post_hoc)
    binary = scores.val_logits.shape[1] == 2
    source_prior = prevalence(scores.val_labels)  # logged for binary tasks only
    if binary:
        priors = {"val/prevalence": source_prior}
        if "train_labels" in scores.extra:
            priors["train/prevalence"] = prevalence(scores.extra["train_labels"])
        add_run_metrics(host.store.uri, stage1_run_id, priors)
    reference = REFERENCE_CALIBRATOR if REFERENCE_CALIBRATOR in names else (names[0] if names else None)
    results = []
    for name in names:
        calibrator = make_calibrator(name).fit(scores.val_logits, scores.val_labels)
        warnings = no_signal(fit_warnings(calibrator, scores.val_logits, scores.val_labels))
        temperature = float(calibrator.temperature) if name == "ts" else None
        probs = calibrated_probs(calibrator, scores.test_logits.numpy())
        report = calibration_report(probs, scores.test_labels, n_bins=ev.n_bins, n_bootstrap=ev.n_bootstrap,
                                    seed=ev.seed)
        with RunTracker(host.experiment, f"{host.run_name}+{name}", tracking_uri=host.store.uri,
                        tags={**host.tags(name), TAG_CALIBRATOR: name}, parent_run_id=stage1_run_id) as tracker:
            tracker.log_params({**host.params(), "stage2": name, "fit_split": "val"})
            threshold = None
            info: dict[str, Any] = {"calibrator": name, "fit_split": "val", "stage1_run": stage1_run_id,
                                    "warnings": warnings}
            if binary:  # the referral rule inference applies, and the prior the probabilities carry
                threshold = referral_threshold(calibrated_probs(calibrator, scores.val_logits.numpy()))
                tracker.log_metrics({"source_prior": source_prior, REFERRAL_METRIC: threshold})
                info["source_prior"] = source_prior
            if warnings:
                tracker.set_tags({TAG_FIT_WARNING: "; ".join(warnings)})
            if temperature is not None:
                tracker.log_metrics({"temperature": temperature})
                info["temperature"] = temperature
            tracker.log_dict(info, CONFIG_ARTIFACT)
            host.log_post_hoc(tracker, name, calibrator, probs, report, scores, reference=name == reference,
                              threshold=threshold)
            tracker.log_text(calibrator.to_json(), calibrator_artifact(name))
            if temperature is not None:
                tracker.log_text(json.dumps({"temperature": temperature, "stage1_run": stage1_run_id}),
                                 calibrator_artifact("temperature"))
            diff = paired_bootstrap_diff("ece", probs, scores.test_probs, scores.test_labels,
                                         n_bootstrap=ev.n_bootstrap, seed=ev.seed, n_bins=ev.n_bins)
            results.append(PostHocResult(name=name, run_id=tracker.run_id, test=report, temperature=temperature,
                                         warnings=warnings, probs=probs, ece_diff=diff))
    return results
