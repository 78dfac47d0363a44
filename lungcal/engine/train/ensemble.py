"""The run step of ``bundles/nlst_ensemble.json``: a deep ensemble of stage-1 models (Lakshminarayanan et al. 2017).

:class:`EnsembleRun` (bundle id ``workflow``) opens a parent MLflow run, then trains
``ensemble_members`` stage-1 models that differ only in their seed (``seed``, ``seed + 1``, ...).
Each member is the bundle's ``member`` section (the stage-1 run step,
:class:`lungcal.engine.train.stage1.Stage1Run`, i.e. ``ct_common.json#workflow``) built by a fresh
:class:`monai.bundle.ConfigParser` of the same config with that seed, after the bundle's
``initialize`` step: member ``i`` is exactly the stage-1 bundle run with ``--seed <seed + i>``
(its own checkpoint, test report and TS run), nested under the parent (``mlflow.parentRunId``,
``lungcal.ensemble = member``).

The parent run (``lungcal.stage2 = ensemble``, ``lungcal.ensemble = parent``) evaluates the
members' *average probability* (:func:`lungcal.engine.model.predict.ensemble_uncertainty`): test report
with bootstrap CIs, predictions with each CT's entropy and mutual information across members
(``test/mean_entropy``, ``test/mean_mi``), the referral metrics and plots. The post-hoc
calibrators (``post_hoc``, default TS) are then fitted on validation on the *log of the averaged
probabilities* (pool, then calibrate: ``softmax(log p̄ / T)``), in linked runs with
``lungcal.stage2 = ensemble+<name>``.

Members must share the network and the bags (they do, being one config with another seed); the
run checks it and raises ``ConfigError`` otherwise.

Resume (``resume``, default on): the parent run id and each finished member's run id are recorded in
``<output_dir>/resume/ensemble-<identity>/run.json`` (identity: the config without run name and
paths). Rerunning the same bundle and settings after an interruption reopens the same parent run,
does not train the finished members again (their predictions are recomputed from their
checkpoints: deterministic, and MC dropout is seeded), and the interrupted member continues from
its last complete epoch (stage-1 resume). ``resume: false`` starts afresh.

References:
    Lakshminarayanan, Pritzel, Blundell. "Simple and Scalable Predictive Uncertainty Estimation
    using Deep Ensembles." NeurIPS 2017. https://arxiv.org/abs/1612.01474
"""
from __future__ import annotations

import copy
import gc
import json
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from mlflow.tracking import MlflowClient
from monai.bundle import ConfigParser

from lungcal.engine.data.cohort import resolve_output_dir
from lungcal.engine.evaluate.pictures import check_picture_mode
from lungcal.engine.evaluate.reports import evaluate_probs, log_split
from lungcal.engine.evaluate.summary import summary_lines
from lungcal.engine.model.checkpoint import bag_params_of, load_stage1
from lungcal.engine.model.predict import ensemble_uncertainty, predict_uncertainty
from lungcal.engine.train.posthoc import run_post_hoc
from lungcal.errors import ConfigError
from lungcal.paths import atomic_write_text
from lungcal.runtime import resolve_device
from lungcal.runtime.bundle_config import active_config, hyperparameters
from lungcal.runtime.resume import IDENTITY_EXCLUDE, as_bool, run_identity
from lungcal.tracking import (
    CT_EXPERIMENT,
    PRIVATE_KEYS,
    TAG_DATASET,
    TAG_ENSEMBLE,
    TAG_SITE,
    TAG_STAGE1,
    TAG_STAGE2,
    RunTracker,
    default_tracking_uri,
)

__all__ = ["EnsembleRun", "check_compatible"]


def check_compatible(members: Sequence[Mapping[str, Any]]) -> None:
    """``ConfigError`` unless every member has the same ``network_def`` and ``bag_params`` (architecture,
    preprocessing) and was evaluated on the same cases as the first."""
    if not members:
        raise ConfigError("an ensemble needs at least one member", field="ensemble_members",
                          fix="set ensemble_members to 2 or more")
    first = members[0]
    for i, m in enumerate(members[1:], start=1):
        for key, what in (("network_def", "architecture (network_def)"), ("bag_params", "preprocessing (bag_params)")):
            if json.dumps(m.get(key), sort_keys=True, default=str) != json.dumps(first.get(key), sort_keys=True,
                                                                                 default=str):
                raise ConfigError(f"ensemble member {i} differs from member 0 in its {what}", field=key,
                                  fix="train every member from the same bundle and settings, changing only the seed")


class EnsembleRun:
    """Train ``members`` stage-1 models with seeds ``seed .. seed + members - 1`` and evaluate their average.

    Args:
        members: ensemble size M (bundle ``ensemble_members``, default 5), at least 2.
        method: stage-1 name for tags and run names (``focal``, ...).
        seed: seed of member 0; member ``i`` uses ``seed + i``.
        post_hoc: calibrators fitted on the averaged validation log-probabilities, each in a linked run.
        output_dir, tracking_uri, run_name: where things go (run name default ``ensemble-<method>-<time>``;
            members are ``<run_name>-m<i>``).
        n_bins, n_bootstrap: the test report.
        member: the bundle id of the member run step (default ``member``).
        config: the bundle config (default: the running bundle's).
        resume: continue an interrupted ensemble run of the same config (default); ``False`` starts afresh.
        test_pictures: as for :class:`~lungcal.engine.train.stage1.Stage1Run`, drawn at the ensemble's
            calibrated probabilities (the members draw none).
    """

    def __init__(self, members: int = 5, method: str = "focal", seed: int = 0, post_hoc: Sequence[str] = ("ts",),
                 output_dir: str | os.PathLike | None = None, tracking_uri: str | None = None,
                 run_name: str | None = None, n_bins: int = 10, n_bootstrap: int = 1000, member: str = "member",
                 config: Mapping[str, Any] | None = None, experiment: str = CT_EXPERIMENT,
                 resume: bool = True, test_pictures: str = "gallery") -> None:
        if isinstance(members, bool) or not isinstance(members, (int, np.integer)) or int(members) < 2:
            raise ConfigError(f"ensemble_members must be an integer >= 2, got {members!r}", field="ensemble_members",
                              fix="set ensemble_members to the number of members, e.g. 5 (the default)")
        self.members, self.method, self.seed = int(members), str(method), int(seed)
        self.post_hoc = [str(p) for p in (post_hoc or [])]
        self.output_dir = resolve_output_dir(output_dir)
        self.tracking_uri = tracking_uri or default_tracking_uri(self.output_dir)
        self.run_name = run_name or f"ensemble-{self.method}-{time.strftime('%Y%m%d-%H%M%S')}"
        self.n_bins, self.n_bootstrap = int(n_bins), int(n_bootstrap)
        self.member = str(member)
        self.config = copy.deepcopy(dict(config)) if config is not None else active_config()
        if self.member not in self.config:
            raise ConfigError(f"the bundle has no {self.member!r} section (the member's stage-1 run step)",
                              field=self.member, fix='add "member": "%bundles/ct_common.json#workflow" to the bundle')
        self.experiment = experiment
        self.resume = as_bool(resume, "resume")
        self.test_pictures = check_picture_mode(test_pictures)
        self.result: dict[str, Any] = {}

    def record_path(self):
        """``<output_dir>/resume/ensemble-<identity>/run.json``: the parent run and the finished members."""
        ident = run_identity({k: v for k, v in self.config.items() if k not in IDENTITY_EXCLUDE})
        return self.output_dir / "resume" / f"ensemble-{ident}" / "run.json"

    def reload_member(self, index: int, run_id: str) -> tuple[dict[str, Any], Any]:
        """A finished member's record, its predictions recomputed from its checkpoint; and its cohort."""
        parser = ConfigParser(self.member_config(index))
        parser.parse(reset=True)
        cohort = parser.get_parsed_content("cohort").load(("val", "test"))
        device = resolve_device(parser.get_parsed_content("device"))
        model = load_stage1(run_id, self.tracking_uri, device=device)
        batch_size, mc = int(parser.get_parsed_content("batch_size")), int(parser.get_parsed_content("mc_samples"))
        preds = {s: predict_uncertainty(model.network, cohort.loader(s, batch_size), device, mc_samples=mc,
                                        seed=self.seed + index) for s in ("val", "test")}
        test = evaluate_probs(preds["test"]["probs"], cohort.splits["test"]["labels"], n_bins=self.n_bins,
                              n_bootstrap=0)
        record = {"run_id": run_id, "test": test, "predictions": preds,
                  "network_def": model.checkpoint.get("network_def"), "bag_params": bag_params_of(model.checkpoint)}
        return record, cohort

    def member_config(self, index: int) -> dict[str, Any]:
        """The bundle config of member ``index``: seed ``seed + index`` and its run name (the rest as given)."""
        cfg = copy.deepcopy(self.config)
        cfg["seed"] = self.seed + int(index)
        cfg["run_name"] = f"{self.run_name}-m{index}"
        return cfg

    def build_member(self, index: int, parent_run_id: str):
        """Member ``index``'s run step, built as ``python -m monai.bundle run`` would (``initialize`` first),
        nested under ``parent_run_id`` (set on the step, not in its config: the member's resume identity
        does not depend on the parent run)."""
        parser = ConfigParser(self.member_config(index))
        parser.parse(reset=True)
        if "initialize" in parser:  # seeds the global RNG before the network is built, as a stage-1 run does
            parser.get_parsed_content("initialize")
        step = parser.get_parsed_content(self.member)
        step.parent_run_id = parent_run_id
        step.extra_tags = {**getattr(step, "extra_tags", {}), TAG_ENSEMBLE: "member"}
        step.test_pictures = "none"  # the parent's reference run draws the ensemble's pictures
        return step

    def params(self) -> dict[str, Any]:
        p = {k: v for k, v in hyperparameters(self.config).items() if k not in PRIVATE_KEYS}
        p.update(method=self.method, post_hoc=self.post_hoc, ensemble_members=self.members,
                 member_seeds=[self.seed + i for i in range(self.members)], averaging="probabilities",
                 post_hoc_on="log of the averaged probabilities")
        return p

    def run(self) -> dict[str, Any]:
        """Train the members (nested runs), evaluate their average, fit the post-hoc calibrators; print a summary."""
        base = {TAG_STAGE1: self.method}
        members: list[dict[str, Any]] = []
        splits: dict[str, Any] = {}
        record = self.record_path()
        state = json.loads(record.read_text()) if self.resume and record.is_file() else {}
        done: dict[str, str] = dict(state.get("members", {}))
        with RunTracker(self.experiment, self.run_name, tracking_uri=self.tracking_uri,
                        tags={**base, TAG_STAGE2: "ensemble", TAG_ENSEMBLE: "parent"},
                        run_id=state.get("parent_run_id")) as parent:
            params = self.params()
            if not state:
                parent.log_params(params)
            atomic_write_text(record, json.dumps({"parent_run_id": parent.run_id, "members": done}))
            workdir = self.output_dir / "ensembles" / parent.run_id
            client = MlflowClient(self.tracking_uri)
            for i in range(self.members):
                finished = done.get(str(i))
                if finished and client.get_run(finished).info.status == "FINISHED":
                    print(f"== ensemble member {i + 1}/{self.members} (seed {self.seed + i}): finished before, "
                          f"run {finished} ==", flush=True)
                    member, cohort = self.reload_member(i, finished)
                else:
                    print(f"== ensemble member {i + 1}/{self.members} (seed {self.seed + i}) ==", flush=True)
                    step = self.build_member(i, parent.run_id)
                    result = step.run()
                    member, cohort = {"run_id": result["stage1_run_id"], "test": result["test"],
                                      "predictions": result["predictions"], "network_def": result["network_def"],
                                      "bag_params": result["bag_params"]}, step.cohort
                    done[str(i)] = member["run_id"]
                    atomic_write_text(record, json.dumps({"parent_run_id": parent.run_id, "members": done}))
                    del step, result
                if i == 0:
                    base.update({TAG_DATASET: cohort.source, TAG_SITE: cohort.site})
                    parent.set_tags(base)
                    splits = {s: cohort.splits[s] for s in ("val", "test")}
                members.append(member)
                del cohort
                gc.collect()
            check_compatible(members)
            ens = {s: ensemble_uncertainty([m["predictions"][s] for m in members]) for s in ("val", "test")}
            test, val = splits["test"], splits["val"]
            rep_test = evaluate_probs(ens["test"]["probs"], test["labels"], n_bins=self.n_bins,
                                      n_bootstrap=self.n_bootstrap, seed=self.seed)
            rep_val = evaluate_probs(ens["val"]["probs"], val["labels"], n_bins=self.n_bins, n_bootstrap=0,
                                     seed=self.seed)
            log_split(parent, "test", ens["test"]["probs"], test["labels"], rep_test, n_bins=self.n_bins,
                      subjects=test["subjects"], attention=ens["test"]["attention"], candidates=test["candidates"],
                      workdir=workdir, title=f"{self.method} ensemble of {self.members}", mi=ens["test"]["mi"])
            parent.log_report("val", {k: v for k, v in rep_val.items() if "_ci_" not in k})
            parent.log_metrics({"ensemble_members": self.members,
                                "members/test_auc_mean": float(np.mean([m["test"]["auc"] for m in members])),
                                "members/test_ece_mean": float(np.mean([m["test"]["ece"] for m in members]))})
            parent.log_dict({"members": [m["run_id"] for m in members],
                             "seeds": [self.seed + i for i in range(self.members)],
                             "averaging": "mean of the members' probabilities",
                             "post_hoc_on": "log of the averaged probabilities (pool, then calibrate)"},
                            "config/ensemble.json")
            parent_id = parent.run_id

        post = run_post_hoc(self.post_hoc, stage1_run_id=parent_id, run_name=self.run_name,
                            tags=lambda name: {**base, TAG_STAGE2: f"ensemble+{name}"}, params=params,
                            val_logits=ens["val"]["logits"], val_labels=val["labels"],
                            test_logits=ens["test"]["logits"], test=test, test_attention=ens["test"]["attention"],
                            n_bins=self.n_bins, n_bootstrap=self.n_bootstrap, seed=self.seed,
                            tracking_uri=self.tracking_uri, workdir=workdir, title=f"{self.method} ensemble",
                            experiment=self.experiment, test_pictures=self.test_pictures)
        record.unlink(missing_ok=True)
        self.result = {"parent_run_id": parent_id, "member_run_ids": [m["run_id"] for m in members],
                       "test": rep_test, "predictions": ens, "post_hoc": {r["name"]: r for r in post},
                       "members_test": [m["test"] for m in members]}
        rows = [(f"member {i}", m["test"]) for i, m in enumerate(members)] + [("ensemble", rep_test)]
        rows += [(f"ensemble+{r['name'].upper()}", r["test"]) for r in post]
        text = summary_lines(f"{self.method} deep ensemble of {self.members}", rows, self.output_dir,
                             self.tracking_uri, [parent_id] + [r["run_id"] for r in post])
        for r in post:
            if r["temperature"] is not None:
                text += f"\n  temperature   {r['temperature']:.3f} (on the log of the averaged probabilities)"
        print(text, flush=True)
        return self.result
