"""The run step of the stage-1 CT bundles (``bundles/nlst_*.json``, id ``workflow``).

Everything it runs is built by the bundle (``network``, ``train#trainer`` with its handlers,
``validate#evaluator``, ``cohort``); this step only adds what a config cannot say in order: open
the MLflow run, bind the checkpoint and epoch-logging handlers to it, train, reload the best
checkpoint, evaluate the test split with bootstrap CIs, run the post-hoc calibrators
(:mod:`lungcal.engine.train.posthoc`) and print the summary.

Resume (:mod:`lungcal.runtime.resume`): rerunning the same bundle with the same settings after an
interruption continues from the last complete epoch into the same MLflow run; ``resume: false``
starts afresh. Fine-tuning: ``init_run_id`` / ``init_checkpoint`` start from a trained stage-1
model's weights (encoder + head; the encoder frozen with ``freeze_encoder``), tagged
``lungcal.init_run``; the parent model's metrics on the site's validation split, before any
training, are logged as ``val_init/*``.

Data-parallel (``torchrun`` with ``bundles/multi_gpu.json``, :mod:`lungcal.runtime.distributed`):
every rank trains its shard of each epoch and scores its shard of the validation split (the
metrics are gathered, so they are the whole split's); rank 0 alone opens the MLflow run (one run,
``world_size`` among its params), writes the checkpoints and the resume state, evaluates the test
split, runs the post-hoc calibrators and prints the summary; the other ranks return after training.

Reproducibility: the bundle seeds the global RNG before it builds the network (``initialize``);
this step seeds it again just before training, as the name-based bundles did, and the loaders,
the augmentation and the mixup draws use their own seeded generators.
"""
from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from lungcal.calibration.metrics import paired_bootstrap_diff
from lungcal.calibration.scaling import probabilities
from lungcal.engine.data.cohort import SPLITS, CTCohort, resolve_output_dir
from lungcal.engine.evaluate.pictures import check_picture_mode
from lungcal.engine.evaluate.reports import evaluate_probs, log_split
from lungcal.engine.evaluate.summary import summary_lines
from lungcal.engine.model.checkpoint import load_stage1
from lungcal.engine.model.handlers import AtomicCheckpoint, EpochMetricsLogger
from lungcal.engine.model.predict import check_mc_samples, predict, predict_uncertainty
from lungcal.engine.train.posthoc import run_post_hoc
from lungcal.errors import ConfigError
from lungcal.runtime import resolve_device, seed_everything
from lungcal.runtime.bundle_config import active_config, hyperparameters, resolved_section, unused_keys
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
    CT_EXPERIMENT,
    PRIVATE_KEYS,
    TAG_DATASET,
    TAG_INIT_RUN,
    TAG_RESUMED_FROM,
    TAG_SITE,
    TAG_STAGE1,
    TAG_STAGE2,
    RunTracker,
    default_tracking_uri,
    file_digest,
)

__all__ = ["Stage1Run"]


class Stage1Run:
    """Train, test and post-hoc calibrate one stage-1 model; log it all to MLflow; print the summary.

    Args:
        network: the network the trainer trains (bundle ``network``).
        trainer: ``monai.engines.SupervisedTrainer`` (bundle ``train#trainer``).
        cohort: the :class:`~lungcal.engine.data.cohort.CTCohort` the loaders read.
        checkpoint: the :class:`~lungcal.engine.model.handlers.AtomicCheckpoint` among the trainer's handlers.
        epoch_logger: the :class:`~lungcal.engine.model.handlers.EpochMetricsLogger` among them.
        method: stage-1 name for tags and run names (``ce``, ``focal``, ``mixup``, ``focal_mixup``).
        post_hoc: calibrators fitted on validation, each in a linked run (default ``["ts"]``).
        epochs: must be >= 1 (checked before anything runs).
        batch_size: of the evaluation loaders.
        output_dir, tracking_uri, run_name: where things go (defaults: ``runs/``, its SQLite store,
            ``<method>-<timestamp>``).
        n_bins, n_bootstrap, seed, device: test report and reproducibility.
        network_def: the network's config for the checkpoint (default: the bundle's ``network_def``).
        config: the bundle config for params and the resolved-config artifact (default: the running bundle's).
        lr_scheduler: the trainer's LR scheduler (bundle ``lr_scheduler``), saved in the resume state.
        resume: continue an interrupted run of the same config (default); ``False`` starts afresh.
        init_run_id / init_checkpoint: fine-tune from this stage-1 run's (or file's) weights.
        freeze_encoder: with an init model, train only the head (the encoder's weights stay).
        mc_samples: 0 (default) evaluates the trained network once in eval mode; T >= 1 evaluates
            it by MC dropout, the mean softmax of T seeded passes with dropout on
            (:func:`lungcal.engine.model.predict.predict_uncertainty`): the test metrics, the predictions
            and ``test/mean_mi`` are the MC mean's, and the post-hoc calibrators are fitted on
            ``log`` of the validation MC mean. A network without dropout is a ``ConfigError``.
        parent_run_id: nest this run under that MLflow run (an ensemble's parent run).
        extra_tags: more tags for the stage-1 run (not its post-hoc runs), e.g. ``lungcal.ensemble``.
        test_pictures: per-CT pictures of the test split in the reference calibrator's run
            (:func:`lungcal.engine.evaluate.pictures.log_split_pictures`): ``gallery`` (default; at most nine
            CTs, the gallery logged), ``all`` (every test CT) or ``none``.
    """

    def __init__(self, network: nn.Module, trainer, cohort: CTCohort, checkpoint: AtomicCheckpoint,
                 epoch_logger: EpochMetricsLogger, method: str, post_hoc: Sequence[str] = ("ts",), epochs: int = 1,
                 batch_size: int = 16, output_dir: str | os.PathLike | None = None, tracking_uri: str | None = None,
                 run_name: str | None = None, n_bins: int = 10, n_bootstrap: int = 1000, seed: int = 0,
                 device: str | None = "auto", network_def: Mapping[str, Any] | None = None,
                 config: Mapping[str, Any] | None = None, experiment: str = CT_EXPERIMENT, lr_scheduler=None,
                 resume: bool = True, init_run_id: str | None = None, init_checkpoint: str | None = None,
                 freeze_encoder: bool = False, mc_samples: int = 0, parent_run_id: str | None = None,
                 extra_tags: Mapping[str, str] | None = None, test_pictures: str = "gallery") -> None:
        if int(epochs) < 1:
            raise ConfigError(f"epochs must be >= 1, got {epochs}", field="epochs", fix="set epochs to 1 or more")
        self.network, self.trainer, self.cohort = network, trainer, cohort
        self.checkpoint, self.epoch_logger = checkpoint, epoch_logger
        self.method = str(method)
        self.post_hoc = [str(p) for p in (post_hoc or [])]
        self.batch_size = int(batch_size)
        self.output_dir = resolve_output_dir(output_dir)
        self.tracking_uri = tracking_uri or default_tracking_uri(self.output_dir)
        self.run_name = run_name or f"{self.method}-{time.strftime('%Y%m%d-%H%M%S')}"
        self.n_bins, self.n_bootstrap, self.seed = int(n_bins), int(n_bootstrap), int(seed)
        self.device = resolve_device(device)
        self.network_def = dict(network_def) if network_def is not None else resolved_section("network_def")
        self.config = dict(config) if config is not None else active_config()
        unused = unused_keys(self.config)
        if unused:
            raise ConfigError(f"setting(s) {unused} are used by no object of the bundle", field=unused[0],
                              fix="check the spelling; the network, loss and optimizer are chosen by editing "
                                  "network_def / loss / optimizer (see bundles/ct_common.json)")
        self.loss_def = resolved_section("loss")
        self.experiment = experiment
        self.lr_scheduler, self.resume = lr_scheduler, as_bool(resume, "resume")
        self.init_run_id, self.init_checkpoint = init_run_id or None, init_checkpoint or None
        self.freeze_encoder = as_bool(freeze_encoder, "freeze_encoder")
        self.world_size = world_size()
        if self.freeze_encoder and self.world_size > 1:  # DDP registered the encoder's gradients already
            raise ConfigError("freeze_encoder does not run under torchrun (multi_gpu.json)", field="freeze_encoder",
                              fix="fine-tune a frozen encoder in one process (drop multi_gpu.json)")
        if self.freeze_encoder and not (self.init_run_id or self.init_checkpoint):
            raise ConfigError("freeze_encoder needs a trained model to start from", field="freeze_encoder",
                              fix="set init_run_id or init_checkpoint, or freeze_encoder false")
        self.mc_samples = check_mc_samples(network, mc_samples)
        self.parent_run_id = parent_run_id or None
        self.extra_tags = {str(k): str(v) for k, v in (extra_tags or {}).items()}
        self.test_pictures = check_picture_mode(test_pictures)
        self.result: dict[str, Any] = {}

    def identity(self) -> str:
        """The run's identity (:func:`~lungcal.runtime.resume.run_identity`): config + params, no paths/run name."""
        cfg = self.resolved_config()
        cfg["params"] = {k: v for k, v in cfg["params"].items() if k not in IDENTITY_EXCLUDE}
        return run_identity({**cfg["config"], "_params": cfg["params"]})

    def training_state(self) -> TrainingResume:
        """The resume state of this run: model, optimizer, scheduler, trainer, best metric, every RNG."""
        evaluator = self.checkpoint.evaluator
        rng = RandomState(generators_of(self.trainer.data_loader, self.trainer._process_function,
                                        evaluator.data_loader))
        scaler = getattr(self.trainer, "scaler", None)  # MONAI sets it with amp; disabled off CUDA (no state)
        objects = {"model": unwrap(self.network), "optimizer": self.trainer.optimizer,
                   "lr_scheduler": self.lr_scheduler, "trainer": self.trainer, "best": self.checkpoint, "rng": rng,
                   "scaler": scaler if scaler is not None and scaler.is_enabled() else None}
        return TrainingResume(self.output_dir / "resume" / self.identity(), objects, enabled=self.resume)

    def load_init(self) -> str | None:
        """Load the ``init_run_id`` / ``init_checkpoint`` weights into the network; returns the tag value."""
        if not (self.init_run_id or self.init_checkpoint):
            return None
        field = "init_checkpoint" if self.init_checkpoint else "init_run_id"
        parent = load_stage1(self.init_run_id, self.tracking_uri, checkpoint=self.init_checkpoint, device="cpu",
                             field=field)
        try:
            unwrap(self.network).load_state_dict(parent.network.state_dict())
        except RuntimeError as exc:
            why = str(exc).splitlines()[0]
            raise ConfigError(f"the {field} model does not fit this bundle's network_def ({why})", field=field,
                              fix="fine-tune with the parent's network_def (same encoder and head)") from exc
        if self.freeze_encoder:
            for p in unwrap(self.network).encoder.parameters():
                p.requires_grad_(False)
        return parent.run_id or f"checkpoint:{file_digest(self.init_checkpoint)}"

    def _tags(self, stage2: str) -> dict[str, str]:
        return {TAG_DATASET: self.cohort.source, TAG_STAGE1: self.method, TAG_STAGE2: stage2,
                TAG_SITE: self.cohort.site, **(self.extra_tags if stage2 == "none" else {})}

    def params(self) -> dict[str, Any]:
        """The flattened-config params: named hyperparameters, network and loss, datalist source and hash."""
        p = {k: v for k, v in hyperparameters(self.config).items() if k not in PRIVATE_KEYS}
        p.update(method=self.method, post_hoc=self.post_hoc, network_def=self.network_def, loss=self.loss_def)
        p["datalist"] = {"source": self.cohort.source, "sha256": self.cohort.digest}
        p["n_ct"] = {s: len(self.cohort.splits[s]["subjects"]) for s in SPLITS}
        p["world_size"] = self.world_size
        return p

    def resolved_config(self) -> dict[str, Any]:
        """The bundle config as run (macros expanded, overrides applied), with the paths left out."""
        cfg = {k: v for k, v in self.config.items() if k not in PRIVATE_KEYS}
        cfg["datalist"] = {"source": self.cohort.source, "sha256": self.cohort.digest}
        return {"config": cfg, "params": self.params()}

    def _log_init_validation(self, tracker: RunTracker) -> None:
        """``val_init/*``: the parent model, before fine-tuning, on this site's validation split."""
        val = self.cohort.splits["val"]
        logits = predict(unwrap(self.network), self.cohort.loader("val", self.batch_size), self.device)["logits"]
        rep = evaluate_probs(probabilities(logits), val["labels"], n_bins=self.n_bins, n_bootstrap=0, seed=self.seed)
        tracker.log_report("val_init", {k: v for k, v in rep.items() if "_ci_" not in k})

    def _train_replica(self, state: TrainingResume) -> dict[str, Any]:
        """A rank above 0 under torchrun: restore rank 0's state, train its shards, leave the rest to rank 0."""
        resumed = state.load()
        if resumed < self.trainer.state.max_epochs:
            self.trainer.run()
        self.result = {"resumed_from_epoch": resumed}
        return self.result

    def run(self) -> dict[str, Any]:
        """Train, evaluate on test, fit the post-hoc calibrators on validation, log, print a summary."""
        self.cohort.load()
        seed_everything(self.seed)
        net = unwrap(self.network)  # rank 0's evaluation runs on the bare network (no collective calls)
        n_val = len(self.cohort.splits["val"]["subjects"])
        if n_val < self.world_size:
            raise ConfigError(f"{n_val} validation CTs for {self.world_size} processes", field="nproc_per_node",
                              fix="give each process at least one validation CT (fewer processes or more CTs)")
        init = self.load_init()
        state = self.training_state()
        previous = state.run_id(self.tracking_uri)
        if not is_rank_zero():
            return self._train_replica(state)
        with RunTracker(self.experiment, self.run_name, tracking_uri=self.tracking_uri,
                        tags=self._tags("none"), run_id=previous, parent_run_id=self.parent_run_id) as tracker:
            ckdir = self.output_dir / "checkpoints" / tracker.run_id
            self.checkpoint.bind(ckdir, extra={"network_def": self.network_def, "method": self.method,
                                               "bag_params": json.dumps(self.cohort.bag_params),
                                               "kernel_augment_mm": json.dumps(
                                                   self.cohort.train_bag_params.get("kernel_aug_mm"))})
            self.epoch_logger.bind(StepFilter(tracker.log_metrics, tracker.client, previous))
            params = self.params()
            resumed = state.load()
            if resumed:
                tracker.set_tags({TAG_RESUMED_FROM: str(resumed)})
            else:
                tracker.log_params(params)
                tracker.log_dict(self.resolved_config(), "config/resolved.json")
                self.cohort.log_qc(tracker)  # qc.csv: the series checks of every CT (pseudonyms, no paths)
                if init:
                    tracker.set_tags({TAG_INIT_RUN: init})
                    self._log_init_validation(tracker)
            state.attach(self.trainer, tracker.run_id)
            if resumed < self.trainer.state.max_epochs:
                self.trainer.run()

            best = torch.load(self.checkpoint.best_path, map_location="cpu", weights_only=True)
            net.load_state_dict(plain_state_dict(best["state_dict"]))
            tracker.log_metrics({"best/epoch": best["epoch"], "best/val_auc": best["metric"]})
            out = {s: predict_uncertainty(net, self.cohort.loader(s, self.batch_size), self.device,
                                          mc_samples=self.mc_samples, seed=self.seed) for s in ("val", "test")}
            test, val = self.cohort.splits["test"], self.cohort.splits["val"]
            p_test = out["test"]["probs"]  # mc_samples 0: exactly probabilities(logits)
            rep_test = evaluate_probs(p_test, test["labels"], n_bins=self.n_bins, n_bootstrap=self.n_bootstrap,
                                      seed=self.seed)
            rep_val = evaluate_probs(out["val"]["probs"], val["labels"], n_bins=self.n_bins,
                                     n_bootstrap=0, seed=self.seed)
            log_split(tracker, "test", p_test, test["labels"], rep_test, n_bins=self.n_bins, subjects=test["subjects"],
                      attention=out["test"]["attention"], candidates=test["candidates"], workdir=ckdir / "eval",
                      title=self.method, mi=out["test"]["mi"] if self.mc_samples else None)
            tracker.log_report("val", {k: v for k, v in rep_val.items() if "_ci_" not in k})
            tracker.log_model(net, extra={"network_def": self.network_def})
            tracker.log_artifact(self.checkpoint.best_path, "checkpoint")
            stage1_id = tracker.run_id

        post = run_post_hoc(self.post_hoc, stage1_run_id=stage1_id, run_name=self.run_name, tags=self._tags,
                            params=params, val_logits=out["val"]["logits"], val_labels=val["labels"],
                            test_logits=out["test"]["logits"], test=test, test_attention=out["test"]["attention"],
                            n_bins=self.n_bins, n_bootstrap=self.n_bootstrap, seed=self.seed,
                            tracking_uri=self.tracking_uri, workdir=ckdir / "eval", title=self.method,
                            experiment=self.experiment, train_labels=self.cohort.splits["train"]["labels"],
                            test_pictures=self.test_pictures)
        self.result = {"stage1_run_id": stage1_id, "test": rep_test, "checkpoint": str(self.checkpoint.best_path),
                       "post_hoc": {r["name"]: r for r in post}, "resumed_from_epoch": resumed,
                       "predictions": out, "network_def": self.network_def, "bag_params": self.cohort.bag_params}
        title = f"{self.method} (stage 1)" + "".join(f" + {r['name'].upper()}" for r in post)
        rows = [(self.method, rep_test)] + [(f"{self.method}+{r['name'].upper()}", r["test"]) for r in post]
        text = summary_lines(title, rows, self.output_dir, self.tracking_uri, [stage1_id] + [r["run_id"] for r in post])
        for r in post:
            if r["temperature"] is not None:
                self.result.update(ts_run_id=r["run_id"], temperature=r["temperature"], test_ts=r["test"])
                text += f"\n  temperature   {r['temperature']:.3f}"
        for r in post:  # the same test cases before and after: a paired difference, not two CIs
            d = paired_bootstrap_diff("ece", r["probs"], p_test, test["labels"], n_bootstrap=self.n_bootstrap,
                                      seed=self.seed, n_bins=self.n_bins)
            r["ece_diff"] = d
            verdict = "significant" if d["significant"] else "not significant"
            text += (f"\n  ECE {r['name'].upper()} - none  {d['diff']:+.3f} [{d['ci_low']:+.3f}, {d['ci_high']:+.3f}]"
                     f"  paired bootstrap: {verdict}")
        if resumed:
            text += f"\n  resumed from epoch {resumed}"
        print(text, flush=True)
        state.clear()
        return self.result
