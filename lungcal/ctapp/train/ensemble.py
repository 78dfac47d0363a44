"""The run step of ``bundles/nlst_ensemble.json``: a deep ensemble of stage-1 models (Lakshminarayanan et al. 2017).

:class:`EnsembleRun` (bundle id ``workflow`` of the override file ``bundles/nlst_ensemble.json``) opens a
parent MLflow run, then trains ``ensemble_members`` stage-1 models that differ only in their seed (``seed``,
``seed + 1``, ...). Each member is the stage-1 bundle named by ``member_files`` (``bundles/nlst_focal.json``)
with the ensemble's own ``settings`` (every hyperparameter, after the command line's overrides) and that
seed, parsed by a fresh :class:`monai.bundle.ConfigParser` after its ``initialize`` step: member ``i`` is
exactly ``python -m monai.bundle run --config_file bundles/nlst_focal.json --seed <seed + i>`` with the same
top-level keys (its own checkpoint, test report and TS run), nested under the parent (``mlflow.parentRunId``,
``lungcal.ensemble = member``). A nested override (``--network_def#...``) on the ensemble's command line does
not reach the members: state it in an override file listed in ``member_files``.

The parent run (``lungcal.stage2 = ensemble``, ``lungcal.ensemble = parent``) evaluates the
members' *average probability* (:func:`lungcal.ctapp.model.predict.ensemble_uncertainty`): test report
with bootstrap CIs, predictions with each CT's entropy and mutual information across members
(``test/mean_entropy``, ``test/mean_mi``), the referral metrics and plots. The post-hoc
calibrators (``post_hoc``, default TS) are then fitted on validation on the *log of the averaged
probabilities* (pool, then calibrate: ``softmax(log p̄ / T)``), in linked runs with
``lungcal.stage2 = ensemble+<name>``.

Members must share the network and the bags (they do, being one config with another seed); the
run checks it and raises ``ConfigError`` otherwise.

Resume (``resume``, default on): the parent run id and each finished member's run id are recorded in
``<output_dir>/resume/ensemble-<identity>/run.json`` (identity: the settings and member files without run
name and paths). Rerunning the same bundle and settings after an interruption reopens the same parent run,
does not train the finished members again (their predictions are recomputed from their
checkpoints: deterministic, and MC dropout is seeded), and the interrupted member continues from
its last complete epoch (stage-1 resume). ``resume: false`` starts afresh.

References:
    Lakshminarayanan, Pritzel, Blundell. "Simple and Scalable Predictive Uncertainty Estimation
    using Deep Ensembles." NeurIPS 2017. https://arxiv.org/abs/1612.01474
"""
from __future__ import annotations

import gc
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from mlflow.tracking import MlflowClient
from monai.bundle import ConfigParser

from lungcal.ctapp.evaluate.pictures import check_picture_mode
from lungcal.ctapp.evaluate.reports import evaluate_probs, log_split
from lungcal.ctapp.model.checkpoint import bag_params_of, load_stage1
from lungcal.ctapp.model.predict import ensemble_uncertainty, predict_uncertainty
from lungcal.ctapp.train.posthoc import log_calibrated_test
from lungcal.errors import ConfigError
from lungcal.paths import atomic_write_text
from lungcal.runtime import resolve_device
from lungcal.runtime.bundle_config import spec_of
from lungcal.runtime.resume import IDENTITY_EXCLUDE, run_identity
from lungcal.runtime.settings import typed_settings
from lungcal.tracking import (
    CT_EXPERIMENT,
    PRIVATE_KEYS,
    TAG_DATASET,
    TAG_ENSEMBLE,
    TAG_SITE,
    TAG_STAGE1,
    TAG_STAGE2,
    RunTracker,
)
from lungcal.workflow import CT_COLUMNS, Evaluation, SplitScores, Store, post_hoc_runs, summary_lines

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
        settings: the bundle's hyperparameters (its ``settings`` section); each member's top-level keys.
        member_files: the stage-1 bundle file(s) a member is (default ``["bundles/nlst_focal.json"]``).
        store: where things go (:class:`lungcal.workflow.Store`; run name default ``ensemble-<method>-<time>``,
            members ``<run_name>-m<i>``).
        evaluation: ECE bins, bootstrap, seed (of member 0; member ``i`` uses ``seed + i``) and ``post_hoc``
            calibrators, fitted on the averaged validation log-probabilities, each in a linked run.
        test_pictures: as for :class:`~lungcal.ctapp.train.stage1.Stage1Run`, drawn at the ensemble's
            calibrated probabilities (the members draw none).
        network, loss: the ensemble bundle's own ``network`` and ``loss``: each member must build the same
            (their specs are compared), so ``member_files`` cannot silently train another recipe.
        member_objects: stateless objects of the ensemble's bundle that every member uses as they are, by
            bundle id (default in the bundle: ``{"qc": "@qc"}``, the series checks, so a ``--qc`` override on
            the ensemble's command line reaches the members).
    """

    def __init__(self, members: int = 5, method: str = "focal", settings: Mapping[str, Any] | None = None,
                 member_files: Sequence[str] = ("bundles/nlst_focal.json",), store: Store | None = None,
                 evaluation: Evaluation | None = None, experiment: str = CT_EXPERIMENT,
                 test_pictures: str = "gallery", network: Any = None, loss: Any = None,
                 member_objects: Mapping[str, Any] | None = None) -> None:
        if isinstance(members, bool) or not isinstance(members, (int, np.integer)) or int(members) < 2:
            raise ConfigError(f"ensemble_members must be an integer >= 2, got {members!r}", field="ensemble_members",
                              fix="set ensemble_members to the number of members, e.g. 5 (the default)")
        self.members, self.method = int(members), str(method)
        self.settings = typed_settings(settings or {})
        self.member_files = [str(f) for f in ([member_files] if isinstance(member_files, str) else member_files)]
        missing = [f for f in self.member_files if not Path(f).is_file()]
        if missing:
            raise ConfigError("an ensemble member's bundle file is missing", file=missing[0], field="member_files",
                              fix="run from the project root, or list the stage-1 bundle files of a member")
        self.store = store or Store()
        self.evaluation = evaluation or Evaluation()
        self.seed = self.evaluation.seed
        self.run_name = self.store.name(f"ensemble-{self.method}")
        self.experiment = experiment
        self.test_pictures = check_picture_mode(test_pictures)
        self.member_objects = dict(member_objects or {})
        self.base_tags = {TAG_STAGE1: self.method}
        self.expected = {"network_def": None if network is None else spec_of(network),
                         "loss": None if loss is None else spec_of(loss, strict=False, where="loss")}
        self.result: dict[str, Any] = {}

    def record_path(self) -> Path:
        """``<output_dir>/resume/ensemble-<identity>/run.json``: the parent run and the finished members."""
        ident = run_identity({"settings": {k: v for k, v in self.settings.items() if k not in IDENTITY_EXCLUDE},
                              "member_files": self.member_files, "members": self.members})
        return self.store.path / "resume" / f"ensemble-{ident}" / "run.json"

    def member_parser(self, index: int) -> ConfigParser:
        """Member ``index``'s bundle: ``member_files`` with the ensemble's settings, seed ``seed + index`` and
        run name ``<run_name>-m<index>``, parsed."""
        parser = ConfigParser()
        parser.read_config(self.member_files if len(self.member_files) > 1 else self.member_files[0])
        parser.update({**self.settings, **self.member_objects, "seed": self.seed + int(index),
                       "run_name": f"{self.run_name}-m{index}"})
        parser.parse(reset=True)
        return parser

    def reload_member(self, index: int, run_id: str) -> tuple[dict[str, Any], Any]:
        """A finished member's record, its predictions recomputed from its checkpoint; and its cohort."""
        parser = self.member_parser(index)
        cohort = parser.get_parsed_content("cohort").load(("val", "test"))
        device = resolve_device(parser.get_parsed_content("device"))
        model = load_stage1(run_id, self.store.uri, device=device)
        batch_size, mc = int(parser.get_parsed_content("batch_size")), int(parser.get_parsed_content("mc_samples"))
        preds = {s: predict_uncertainty(model.network, cohort.loader(s, batch_size), device, mc_samples=mc,
                                        seed=self.seed + index) for s in ("val", "test")}
        test = evaluate_probs(preds["test"]["probs"], cohort.splits["test"]["labels"],
                              n_bins=self.evaluation.n_bins, n_bootstrap=0)
        record = {"run_id": run_id, "test": test, "predictions": preds,
                  "network_def": model.checkpoint.get("network_def"), "bag_params": bag_params_of(model.checkpoint)}
        return record, cohort

    def build_member(self, index: int, parent_run_id: str):
        """Member ``index``'s run step, built as ``python -m monai.bundle run`` would (``initialize`` first),
        nested under ``parent_run_id`` (set on the step, not in its settings: the member's resume identity
        does not depend on the parent run)."""
        parser = self.member_parser(index)
        if "initialize" in parser:  # seeds the global RNG before the network is built, as a stage-1 run does
            parser.get_parsed_content("initialize")
        step = parser.get_parsed_content("workflow")
        for key, spec in self.expected.items():
            if spec is not None and step.specs().get(key) != spec:
                raise ConfigError(f"ensemble member {index} builds another {key} than the ensemble's bundle",
                                  field="member_files", fix="list in member_files the stage-1 bundle files the "
                                                            "ensemble is run over (e.g. nlst_focal.json, nlst_ce.json)")
        step.parent_run_id = parent_run_id
        step.extra_tags = {**getattr(step, "extra_tags", {}), TAG_ENSEMBLE: "member"}
        step.test_pictures = "none"  # the parent's reference run draws the ensemble's pictures
        return step

    def params(self) -> dict[str, Any]:
        p = {k: v for k, v in self.settings.items() if k not in PRIVATE_KEYS}
        p.update(method=self.method, post_hoc=list(self.evaluation.post_hoc), ensemble_members=self.members,
                 member_seeds=[self.seed + i for i in range(self.members)], averaging="probabilities",
                 post_hoc_on="log of the averaged probabilities")
        return p

    def tags(self, stage2: str) -> dict[str, str]:
        """The parent's tags (``stage2 == "none"``: ``lungcal.stage2 = ensemble``) or a post-hoc run's."""
        return {**self.base_tags, TAG_STAGE2: "ensemble" if stage2 == "none" else f"ensemble+{stage2}"}

    def log_post_hoc(self, tracker: RunTracker, name: str, calibrator: Any, probs: np.ndarray,
                     report: dict[str, Any], scores: SplitScores, *, reference: bool,
                     threshold: float | None) -> None:
        log_calibrated_test(tracker, name, probs, report, scores, n_bins=self.evaluation.n_bins,
                            title=f"{self.method} ensemble", reference=reference, threshold=threshold,
                            pictures=self.test_pictures)

    def run(self) -> dict[str, Any]:
        """Train the members (nested runs), evaluate their average, fit the post-hoc calibrators; print a summary."""
        ev = self.evaluation
        members: list[dict[str, Any]] = []
        splits: dict[str, Any] = {}
        record = self.record_path()
        state = json.loads(record.read_text()) if self.store.resume and record.is_file() else {}
        done: dict[str, str] = dict(state.get("members", {}))
        with RunTracker(self.experiment, self.run_name, tracking_uri=self.store.uri,
                        tags={**self.tags("none"), TAG_ENSEMBLE: "parent"},
                        run_id=state.get("parent_run_id")) as parent:
            params = self.params()
            if not state:
                parent.log_params(params)
            atomic_write_text(record, json.dumps({"parent_run_id": parent.run_id, "members": done}))
            workdir = self.store.path / "ensembles" / parent.run_id
            client = MlflowClient(self.store.uri)
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
                    self.base_tags.update({TAG_DATASET: cohort.source, TAG_SITE: cohort.site})
                    parent.set_tags(self.base_tags)
                    splits = {s: cohort.splits[s] for s in ("val", "test")}
                members.append(member)
                del cohort
                gc.collect()
            check_compatible(members)
            ens = {s: ensemble_uncertainty([m["predictions"][s] for m in members]) for s in ("val", "test")}
            test, val = splits["test"], splits["val"]
            rep_test = evaluate_probs(ens["test"]["probs"], test["labels"], n_bins=ev.n_bins,
                                      n_bootstrap=ev.n_bootstrap, seed=self.seed)
            rep_val = evaluate_probs(ens["val"]["probs"], val["labels"], n_bins=ev.n_bins, n_bootstrap=0,
                                     seed=self.seed)
            log_split(parent, "test", ens["test"]["probs"], test["labels"], rep_test, n_bins=ev.n_bins,
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

        scores = SplitScores(torch.as_tensor(ens["val"]["logits"]), np.asarray(val["labels"]),
                             torch.as_tensor(ens["test"]["logits"]), np.asarray(test["labels"]), ens["test"]["probs"],
                             rep_test, extra={"test": test, "attention": ens["test"]["attention"], "workdir": workdir})
        post = post_hoc_runs(self, parent_id, scores)
        record.unlink(missing_ok=True)
        self.result = {"parent_run_id": parent_id, "member_run_ids": [m["run_id"] for m in members],
                       "test": rep_test, "predictions": ens, "post_hoc": {r["name"]: r for r in post},
                       "members_test": [m["test"] for m in members]}
        rows = [(f"member {i}", m["test"]) for i, m in enumerate(members)] + [("ensemble", rep_test)]
        rows += [(f"ensemble+{r['name'].upper()}", r["test"]) for r in post]
        runs = [("ensemble", parent_id)] + [(f"+{r['name'].upper()}", r["run_id"]) for r in post]
        text = summary_lines(f"{self.method} deep ensemble of {self.members}", rows, self.store.path, self.store.uri,
                             runs, columns=CT_COLUMNS)
        for r in post:
            if r["temperature"] is not None:
                text += f"\n  temperature   {r['temperature']:.3f} (on the log of the averaged probabilities)"
        print(text, flush=True)
        return self.result
