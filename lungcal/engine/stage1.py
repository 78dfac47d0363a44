"""The run step of the stage-1 CT bundles (``bundles/nlst_*.json``, id ``workflow``).

Everything it runs is built by the bundle (``network``, ``train#trainer`` with its handlers,
``validate#evaluator``, ``cohort``); this step only adds what a config cannot say in order: open
the MLflow run, bind the checkpoint and epoch-logging handlers to it, train, reload the best
checkpoint, evaluate the test split with bootstrap CIs, run the post-hoc calibrators
(:mod:`lungcal.engine.posthoc`) and print the summary.

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

from lungcal.engine.bundle_config import active_config, hyperparameters, resolved_section, unused_keys
from lungcal.engine.cohort import SPLITS, CTCohort, resolve_output_dir
from lungcal.engine.evaluate import evaluate_probs, log_split, probabilities
from lungcal.engine.handlers import AtomicCheckpoint, EpochMetricsLogger
from lungcal.engine.posthoc import run_post_hoc
from lungcal.engine.predict import predict
from lungcal.engine.summary import summary_lines
from lungcal.errors import ConfigError
from lungcal.runtime import resolve_device, seed_everything
from lungcal.tracking import (
    CT_EXPERIMENT,
    TAG_DATASET,
    TAG_SITE,
    TAG_STAGE1,
    TAG_STAGE2,
    RunTracker,
    default_tracking_uri,
)

__all__ = ["PRIVATE_KEYS", "Stage1Run"]

#: bundle keys never logged as they are (paths may carry identifiers); the datalist is logged as source + hash
PRIVATE_KEYS = ("datalist", "output_dir", "tracking_uri", "inputs", "output", "checkpoint")


class Stage1Run:
    """Train, test and post-hoc calibrate one stage-1 model; log it all to MLflow; print the summary.

    Args:
        network: the network the trainer trains (bundle ``network``).
        trainer: ``monai.engines.SupervisedTrainer`` (bundle ``train#trainer``).
        cohort: the :class:`~lungcal.engine.cohort.CTCohort` the loaders read.
        checkpoint: the :class:`~lungcal.engine.handlers.AtomicCheckpoint` among the trainer's handlers.
        epoch_logger: the :class:`~lungcal.engine.handlers.EpochMetricsLogger` among them.
        method: stage-1 name for tags and run names (``ce``, ``focal``, ``mixup``, ``focal_mixup``).
        post_hoc: calibrators fitted on validation, each in a linked run (default ``["ts"]``).
        epochs: must be >= 1 (checked before anything runs).
        batch_size: of the evaluation loaders.
        output_dir, tracking_uri, run_name: where things go (defaults: ``runs/``, its SQLite store,
            ``<method>-<timestamp>``).
        n_bins, n_bootstrap, seed, device: test report and reproducibility.
        network_def: the network's config for the checkpoint (default: the bundle's ``network_def``).
        config: the bundle config for params and the resolved-config artifact (default: the running bundle's).
    """

    def __init__(self, network: nn.Module, trainer, cohort: CTCohort, checkpoint: AtomicCheckpoint,
                 epoch_logger: EpochMetricsLogger, method: str, post_hoc: Sequence[str] = ("ts",), epochs: int = 1,
                 batch_size: int = 16, output_dir: str | os.PathLike | None = None, tracking_uri: str | None = None,
                 run_name: str | None = None, n_bins: int = 10, n_bootstrap: int = 1000, seed: int = 0,
                 device: str | None = "auto", network_def: Mapping[str, Any] | None = None,
                 config: Mapping[str, Any] | None = None, experiment: str = CT_EXPERIMENT) -> None:
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
        self.result: dict[str, Any] = {}

    def _tags(self, stage2: str) -> dict[str, str]:
        return {TAG_DATASET: self.cohort.source, TAG_STAGE1: self.method, TAG_STAGE2: stage2,
                TAG_SITE: self.cohort.site}

    def params(self) -> dict[str, Any]:
        """The flattened-config params: named hyperparameters, network and loss, datalist source and hash."""
        p = {k: v for k, v in hyperparameters(self.config).items() if k not in PRIVATE_KEYS}
        p.update(method=self.method, post_hoc=self.post_hoc, network_def=self.network_def, loss=self.loss_def)
        p["datalist"] = {"source": self.cohort.source, "sha256": self.cohort.digest}
        p["n_ct"] = {s: len(self.cohort.splits[s]["subjects"]) for s in SPLITS}
        return p

    def resolved_config(self) -> dict[str, Any]:
        """The bundle config as run (macros expanded, overrides applied), with the paths left out."""
        cfg = {k: v for k, v in self.config.items() if k not in PRIVATE_KEYS}
        cfg["datalist"] = {"source": self.cohort.source, "sha256": self.cohort.digest}
        return {"config": cfg, "params": self.params()}

    def run(self) -> dict[str, Any]:
        """Train, evaluate on test, fit the post-hoc calibrators on validation, log, print a summary."""
        self.cohort.load()
        seed_everything(self.seed)
        net = self.network
        with RunTracker(self.experiment, self.run_name, tracking_uri=self.tracking_uri,
                        tags=self._tags("none")) as tracker:
            ckdir = self.output_dir / "checkpoints" / tracker.run_id
            self.checkpoint.bind(ckdir, extra={"network_def": self.network_def, "method": self.method,
                                               "bag_params": json.dumps(self.cohort.bag_params)})
            self.epoch_logger.bind(tracker.log_metrics)
            params = self.params()
            tracker.log_params(params)
            tracker.log_dict(self.resolved_config(), "config/resolved.json")
            self.cohort.log_qc(tracker)  # qc.csv: the series checks of every CT (pseudonyms, no paths)
            self.trainer.run()

            best = torch.load(self.checkpoint.best_path, map_location="cpu", weights_only=True)
            net.load_state_dict(best["state_dict"])
            tracker.log_metrics({"best/epoch": best["epoch"], "best/val_auc": best["metric"]})
            out = {s: predict(net, self.cohort.loader(s, self.batch_size), self.device) for s in ("val", "test")}
            test, val = self.cohort.splits["test"], self.cohort.splits["val"]
            p_test = probabilities(out["test"]["logits"])
            rep_test = evaluate_probs(p_test, test["labels"], n_bins=self.n_bins, n_bootstrap=self.n_bootstrap,
                                      seed=self.seed)
            rep_val = evaluate_probs(probabilities(out["val"]["logits"]), val["labels"], n_bins=self.n_bins,
                                     n_bootstrap=0, seed=self.seed)
            log_split(tracker, "test", p_test, test["labels"], rep_test, n_bins=self.n_bins, subjects=test["subjects"],
                      attention=out["test"]["attention"], candidates=test["candidates"], workdir=ckdir / "eval",
                      title=self.method)
            tracker.log_report("val", {k: v for k, v in rep_val.items() if "_ci_" not in k})
            tracker.log_model(net, extra={"network_def": self.network_def})
            tracker.log_artifact(self.checkpoint.best_path, "checkpoint")
            stage1_id = tracker.run_id

        post = run_post_hoc(self.post_hoc, stage1_run_id=stage1_id, run_name=self.run_name, tags=self._tags,
                            params=params, val_logits=out["val"]["logits"], val_labels=val["labels"],
                            test_logits=out["test"]["logits"], test=test, test_attention=out["test"]["attention"],
                            n_bins=self.n_bins, n_bootstrap=self.n_bootstrap, seed=self.seed,
                            tracking_uri=self.tracking_uri, workdir=ckdir / "eval", title=self.method,
                            experiment=self.experiment)
        self.result = {"stage1_run_id": stage1_id, "test": rep_test, "checkpoint": str(self.checkpoint.best_path),
                       "post_hoc": {r["name"]: r for r in post}}
        title = f"{self.method} (stage 1)" + "".join(f" + {r['name'].upper()}" for r in post)
        rows = [(self.method, rep_test)] + [(f"{self.method}+{r['name'].upper()}", r["test"]) for r in post]
        text = summary_lines(title, rows, self.output_dir, self.tracking_uri, [stage1_id] + [r["run_id"] for r in post])
        for r in post:
            if r["temperature"] is not None:
                self.result.update(ts_run_id=r["run_id"], temperature=r["temperature"], test_ts=r["test"])
                text += f"\n  temperature   {r['temperature']:.3f}"
        print(text, flush=True)
        return self.result
