"""The run step of ``bundles/nlst_las.json``: stage 2 by label-aware smoothing on a stage-1 model.

The stage-1 network is loaded from its run or checkpoint (:func:`lungcal.ctapp.model.checkpoint.load_stage1`,
whatever ``network_def`` it was trained with), frozen, and only its head is retrained with LAS on
cached train features (:func:`lungcal.calibration.las.retrain_head_las`); the test split is
reported in a run linked to the stage-1 run.

Resume: the head retraining takes seconds and is deterministic, so an interrupted LAS run is
resumed at the run level: its MLflow run id is recorded in ``<output_dir>/resume/<identity>/run.json``
when the run opens, and a rerun of the same settings recomputes into that same run (which goes
back to ``RUNNING`` and ends ``FINISHED``); ``resume: false`` starts a new run.
"""
from __future__ import annotations

import json
import os
import shutil
import time
from typing import Any

from lungcal.calibration.las import class_counts_from_labels, retrain_head_las
from lungcal.calibration.scaling import probabilities
from lungcal.ctapp.data.cohort import CTCohort, resolve_output_dir
from lungcal.ctapp.evaluate.reports import evaluate_probs, log_split
from lungcal.ctapp.model.checkpoint import kernel_augment_of, load_stage1, network_config
from lungcal.ctapp.model.heads import apply_head
from lungcal.ctapp.model.predict import predict
from lungcal.errors import ConfigError
from lungcal.paths import atomic_write_text
from lungcal.runtime import resolve_device
from lungcal.runtime.distributed import world_size
from lungcal.runtime.resume import IDENTITY_EXCLUDE, run_identity
from lungcal.runtime.settings import typed_arguments
from lungcal.tracking import CT_EXPERIMENT, RunTracker, default_tracking_uri
from lungcal.tracking.names import TAG_DATASET, TAG_SITE, TAG_STAGE1, TAG_STAGE2
from lungcal.workflow import CT_COLUMNS, summary_lines

__all__ = ["LASRun"]


class LASRun:
    """Stage 2 by label-aware smoothing: retrain only the head of a stage-1 model.

    Args:
        stage1_run_id: MLflow id of the stage-1 run; ``None`` = the latest finished stage-1 run.
        checkpoint: a stage-1 ``best.pt`` instead of a run (then the run tag is its ``method``).
        smooth_head, smooth_tail, las_shape: LAS epsilon schedule (MiSLAS).
        epochs, lr, batch_size, balanced_sampling: head retraining.
        datalist: the datalist of the stage-1 run (``None``: the synthetic cohort).
        output_dir, tracking_uri, run_name, n_bins, n_bootstrap, seed, device, num_workers,
            demo_subjects: as for the stage-1 bundles.

    References:
        Zhong, Cui, Liu & Jia, "Improving Calibration for Long-Tailed Recognition" (MiSLAS), CVPR 2021.
        https://arxiv.org/abs/2104.00466
    """

    @typed_arguments  # the bundle's switches (balanced_sampling, resume) arrive here: parsed once, by annotation
    def __init__(self, stage1_run_id: str | None = None, checkpoint: str | None = None, smooth_head: float = 0.3,
                 smooth_tail: float = 0.0, las_shape: str = "concave", epochs: int = 30, lr: float = 0.05,
                 batch_size: int = 32, balanced_sampling: bool = True, datalist: str | None = None,
                 demo_subjects: int | None = None, output_dir: str | os.PathLike | None = None,
                 tracking_uri: str | None = None, run_name: str | None = None, n_bins: int = 10,
                 n_bootstrap: int = 1000, seed: int = 0, device: str | None = "auto", num_workers: int = 2,
                 resume: bool = True) -> None:
        self.choices = {k: v for k, v in locals().items() if k not in ("self", "resume")}
        if world_size() > 1:
            raise ConfigError("LAS (stage 2) runs in one process", field="config_file",
                              fix="run bundles/nlst_las.json without multi_gpu.json and torchrun")
        self.resume = resume
        self.output_dir = resolve_output_dir(output_dir)
        self.tracking_uri = tracking_uri or default_tracking_uri(self.output_dir)
        self.stage1_run_id, self.checkpoint = stage1_run_id, checkpoint
        self.datalist, self.demo_subjects, self.num_workers = datalist, demo_subjects, int(num_workers)
        self.device = resolve_device(device)
        self.las: dict[str, Any] = {
            "smooth_head": float(smooth_head), "smooth_tail": float(smooth_tail), "shape": las_shape,
            "epochs": int(epochs), "lr": float(lr), "batch_size": int(batch_size),
            "balanced_sampling": balanced_sampling, "seed": int(seed)}
        self.run_name = run_name
        self.n_bins, self.n_bootstrap, self.seed = int(n_bins), int(n_bootstrap), int(seed)
        self.result: dict[str, Any] = {}

    def run(self) -> dict[str, Any]:
        """Load stage 1, retrain the head with LAS on train features, evaluate on test, log a linked run."""
        stage1 = load_stage1(self.stage1_run_id, self.tracking_uri, checkpoint=self.checkpoint, device=self.device)
        cohort = CTCohort.with_bag_params(self.datalist, stage1.bag_params, output_dir=self.output_dir,
                                          num_workers=self.num_workers, demo_subjects=self.demo_subjects,
                                          kernel_augment_mm=kernel_augment_of(stage1.checkpoint))
        cohort.load(("train", "test"))
        bs = self.las["batch_size"]
        out = {s: predict(stage1.network, cohort.loader(s, bs), self.device) for s in ("train", "test")}
        train, test = cohort.splits["train"], cohort.splits["test"]
        counts = class_counts_from_labels(train["labels"], 2)
        head = retrain_head_las(stage1.network.get_submodule("head"), out["train"]["features"], train["labels"], counts,
                                **self.las)
        # log-sum-exp / noisy-OR heads score the candidates themselves: the table shows the new weights
        logits, attention = apply_head(head, out["test"]["features"], out["test"]["attention"])
        probs = probabilities(logits)
        rep = evaluate_probs(probs, test["labels"], n_bins=self.n_bins, n_bootstrap=self.n_bootstrap, seed=self.seed)
        method = stage1.stage1_name(TAG_STAGE1)
        name = self.run_name or f"{method}+las-{time.strftime('%Y%m%d-%H%M%S')}"
        tags = {TAG_DATASET: cohort.source, TAG_STAGE1: method, TAG_STAGE2: "las", TAG_SITE: cohort.site}
        ident = {k: v for k, v in self.choices.items() if k not in IDENTITY_EXCLUDE}
        record = self.output_dir / "resume" / run_identity({**ident, "datalist": cohort.digest,
                                                            "stage1": stage1.run_id or "checkpoint"}) / "run.json"
        previous = json.loads(record.read_text())["run_id"] if self.resume and record.is_file() else None
        with RunTracker(CT_EXPERIMENT, name, tracking_uri=self.tracking_uri, tags=tags,
                        parent_run_id=stage1.run_id, run_id=previous) as tracker:
            atomic_write_text(record, json.dumps({"run_id": tracker.run_id}))
            params = {k: v for k, v in self.choices.items()
                      if k not in ("datalist", "output_dir", "tracking_uri", "checkpoint")}
            params.update({"datalist": {"source": cohort.source, "sha256": cohort.digest}, "class_counts": counts,
                           "stage1_run": stage1.run_id or "checkpoint"})
            tracker.log_params(params)
            tracker.log_dict(params, "config/resolved.json")
            log_split(tracker, "test", probs, test["labels"], rep, n_bins=self.n_bins, subjects=test["subjects"],
                      attention=attention, candidates=test["candidates"],
                      workdir=self.output_dir / "checkpoints" / tracker.run_id, title=f"{method}+LAS")
            stage1.network.head = head
            tracker.log_model(stage1.network, extra=network_config(stage1.checkpoint))
            run_id = tracker.run_id
        shutil.rmtree(record.parent, ignore_errors=True)
        self.result = {"run_id": run_id, "parent": stage1.run_id, "test": rep, "class_counts": counts}
        print(summary_lines(f"{method} + LAS (stage 2)", [(f"{method}+LAS", rep)], self.output_dir,
                            self.tracking_uri, [("LAS", run_id)], columns=CT_COLUMNS,
                            next_steps=[f"lungcal report --experiment nlst --tracking-uri {self.tracking_uri}"]),
              flush=True)
        return self.result
