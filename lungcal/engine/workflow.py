"""The experiment objects that the CT bundles instantiate (Python holds the mechanics).

``bundles/ct_common.json`` wires them; each ``bundles/nlst_*.json`` holds only its choices as
named top-level keys. Three workflows:

- :class:`CTExperiment` (stage 1 + linked TS run): datalist (or the built-in synthetic cohort)
  -> cached bags -> attention-MIL trained with MONAI engines -> test report -> temperature
  scaling on validation -> calibrated test report in a child run tagged ``lungcal.parent_run``;
- :class:`LASExperiment` (stage 2): a finished stage-1 run (or checkpoint) -> frozen encoder
  -> head retrained with label-aware smoothing on cached features -> test report;
- :class:`InferenceWorkflow`: new CTs (datalist or folder) -> calibrated probability and a
  candidates table with attention per CT.
"""
from __future__ import annotations

import json
import logging
import os
import random
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lungcal import tracking
from lungcal.errors import ConfigError, DataError
from lungcal.paths import default_output_dir

__all__ = ["CTExperiment", "LASExperiment", "InferenceWorkflow", "find_stage1_run", "load_checkpoint"]

logger = logging.getLogger(__name__)

EXPERIMENT = "nlst"
SPLITS = ("train", "val", "test")


# ---------------------------------------------------------------------------------------- helpers
def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _device(device: str | None) -> torch.device:
    if device in (None, "", "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def _resolve_output_dir(output_dir: str | os.PathLike | None) -> Path:
    out = Path(output_dir).expanduser().resolve() if output_dir else default_output_dir()
    out.mkdir(parents=True, exist_ok=True)
    return out


def random_orientation(bag: torch.Tensor, generator: torch.Generator, permute: bool = True) -> torch.Tensor:
    """One random element of the cube's symmetry group applied to every patch of a bag.

    ``bag (K, 1, P, P, P)``: each spatial axis is flipped with probability 1/2 and, with
    ``permute``, the axes are shuffled (valid only for isotropic voxels). A nodule has no preferred
    orientation, so this is label-preserving; with a few hundred training CTs it is what stops the
    instance encoder from memorising them (5-fold CV AUC 0.49 -> 0.65 on the demo cohort).
    """
    flips = [d + 2 for d in range(3) if torch.rand((), generator=generator) < 0.5]
    if permute:
        order = (torch.randperm(3, generator=generator) + 2).tolist()
        bag = bag.permute(0, 1, *order)
    return bag.flip(flips) if flips else bag


class BagSet(torch.utils.data.Dataset):
    """In-memory bags of one split: ``{"bag" (K,1,P,P,P), "mask" (K,), "label", "index"}``.

    With ``augment``, each bag is randomly flipped (and its axes permuted when ``isotropic``), see
    :func:`random_orientation`; ``seed`` makes the sequence reproducible.
    """

    def __init__(self, bags: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor, augment: bool = False,
                 isotropic: bool = True, seed: int = 0) -> None:
        self.bags, self.mask, self.labels = bags, mask, labels
        self.augment, self.isotropic = bool(augment), bool(isotropic)
        self._gen = torch.Generator().manual_seed(int(seed))

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        bag = self.bags[i]
        if self.augment:
            bag = random_orientation(bag, self._gen, permute=self.isotropic).contiguous()
        return {"bag": bag, "mask": self.mask[i], "label": self.labels[i], "index": torch.tensor(i)}


def load_split(entries: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Stack the cached bags of ``entries`` (rows returned by ``build_bags``)."""
    from lungcal.candidates.cache import load_bag

    loaded = [load_bag(e["bag"]) for e in entries]
    if not loaded:
        return {"bags": torch.empty(0), "mask": torch.empty(0, dtype=torch.bool), "labels": torch.empty(0, dtype=torch.long),
                "subjects": [], "candidates": []}
    return {
        "bags": torch.from_numpy(np.stack([d["bag"] for d in loaded]).astype(np.float32)),
        "mask": torch.from_numpy(np.stack([d["mask"] for d in loaded]).astype(bool)),
        "labels": torch.tensor([int(e.get("label", -1)) for e in entries], dtype=torch.long),
        "subjects": [str(e.get("subject", f"ct{i:04d}")) for i, e in enumerate(entries)],
        "candidates": [{"world": d["world"], "score": d["score"], "radius_mm": d["radius_mm"]} for d in loaded],
    }


def load_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """Load a stage-1 checkpoint written by :class:`~lungcal.engine.stage1.AtomicCheckpoint`."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError("checkpoint not found", file=path, field="checkpoint",
                          fix="pass a best.pt/last.pt written by a stage-1 bundle, or a stage-1 run id")
    ck = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(ck, dict) or "state_dict" not in ck or "model_config" not in ck:
        raise ConfigError("not a lungcal stage-1 checkpoint (no state_dict/model_config)", file=path,
                          field="checkpoint", fix="use a checkpoint written by bundles/nlst_*.json")
    return ck


def _build_network(model_config: Mapping[str, Any]) -> torch.nn.Module:
    from lungcal.mil.models import build_mil_model

    return build_mil_model(**dict(model_config))


def find_stage1_run(tracking_uri: str, run_id: str | None = None, experiment: str = EXPERIMENT):
    """The stage-1 run ``run_id``, or the latest FINISHED stage-1 run of ``experiment``.

    Raises:
        ConfigError: when there is no such run.
    """
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    if run_id:
        try:
            run = client.get_run(run_id)
        except Exception as exc:  # noqa: BLE001
            raise ConfigError(f"no MLflow run {run_id!r} in {tracking_uri}", field="stage1_run_id",
                              fix="copy a stage-1 run id from `mlflow ui` or leave it null for the latest") from exc
        return run
    exp = client.get_experiment_by_name(experiment)
    runs = [] if exp is None else client.search_runs(
        [exp.experiment_id], filter_string=f"attributes.status = 'FINISHED' and tags.`{tracking.TAG_STAGE2}` = 'none'",
        order_by=["attributes.start_time DESC"], max_results=1)
    if not runs:
        raise ConfigError(f"no finished stage-1 run in experiment {experiment!r} of {tracking_uri}",
                          field="stage1_run_id",
                          fix="run a stage-1 bundle first (python -m monai.bundle run --config_file bundles/nlst_focal.json), "
                              "or pass --stage1_run_id / --checkpoint")
    return runs[0]


def _summary_lines(title: str, items: Sequence[tuple[str, Mapping[str, Any]]], output_dir: Path, tracking_uri: str,
                   run_ids: Sequence[str]) -> str:
    def ci(r, k):
        return f"{r[k]:.3f} [{r.get(k + '_ci_low', float('nan')):.3f}, {r.get(k + '_ci_high', float('nan')):.3f}]"

    lines = [f"== lungcal {title} =="]
    for name, r in items:
        lines.append(f"  {name:<14} test AUC {ci(r, 'auc')}   ECE {ci(r, 'ece')}   ACC {r['acc']:.3f}  (n={r['n']})")
    lines.append(f"  stored under  {output_dir}")
    lines.append(f"  MLflow runs   {', '.join(run_ids)}")
    ui = f"mlflow ui --backend-store-uri {tracking_uri}"
    lines.append(f"  open with     {ui}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------- data
class _CTData:
    """Datalist -> cached bags -> per-split tensors (shared by all CT workflows)."""

    def __init__(self, datalist, output_dir: Path, bag_params: Mapping[str, Any], num_workers: int,
                 demo_subjects: int | None = None) -> None:
        self.datalist = datalist
        self.output_dir = output_dir
        self.bag_params = dict(bag_params)
        self.num_workers = int(num_workers)
        self.demo_subjects = demo_subjects
        self.splits: dict[str, dict[str, Any]] = {}
        self.source = "synthetic"
        self.digest = ""
        self.site = "synthetic"

    def datalist_path(self) -> Path:
        if self.datalist in (None, "", "synthetic"):
            from lungcal.data.synthetic import ensure_demo_cohort

            kw = {} if self.demo_subjects is None else {"n_subjects": int(self.demo_subjects)}
            return Path(ensure_demo_cohort(self.output_dir / "data", **kw))
        p = Path(str(self.datalist)).expanduser()
        if not p.is_file():
            raise DataError("datalist not found", file=p, field="datalist",
                            fix="pass a datalist JSON made by `lungcal import-nlst`/`import-site`/`synth`, "
                                "or omit --datalist for the built-in synthetic cohort")
        return p

    def load(self, splits: Sequence[str] = SPLITS) -> "_CTData":
        from lungcal.candidates.cache import build_bags
        from lungcal.data.manifest import load_manifest, manifest_source, rows_for_split

        path = self.datalist_path()
        rows = load_manifest(path)
        self.source = manifest_source(path) if self.datalist not in (None, "", "synthetic") else "synthetic"
        self.digest = tracking.file_digest(path)
        sites = sorted({str(r.get("site", "")) for r in rows if r.get("site")})
        self.site = ",".join(sites) if sites else "unknown"
        wanted = [r for s in splits for r in rows_for_split(rows, s)]
        built = build_bags(wanted, self.bag_params, self.output_dir / "cache" / "bags", num_workers=self.num_workers)
        for s in splits:
            self.splits[s] = load_split([e for e in built if e.get("split") == s])
        return self

    def loader(self, split: str, batch_size: int, shuffle: bool, seed: int = 0, augment: bool = False):
        d = self.splits[split]
        if len(d["subjects"]) == 0:
            raise DataError(f"the datalist has no '{split}' rows", field="split",
                            fix="give the datalist train, val and test rows (lungcal check-data shows the counts)")
        spacing = np.asarray(self.bag_params.get("spacing", (2.5, 2.5, 2.5)), float).reshape(-1)
        ds = BagSet(d["bags"], d["mask"], d["labels"], augment=augment,
                    isotropic=bool(np.allclose(spacing, spacing[0])), seed=seed)
        g = torch.Generator().manual_seed(seed)
        return torch.utils.data.DataLoader(ds, batch_size=batch_size, shuffle=shuffle, generator=g, num_workers=0)


# ---------------------------------------------------------------------------------------- stage 1
class CTExperiment:
    """Stage-1 training of an attention-MIL CT classifier, then a linked temperature-scaling run.

    Every argument is a bundle choice (a named top-level key of ``bundles/nlst_*.json``).

    Args:
        method: stage-1 name used in tags/run names (``ce``, ``focal``, ``mixup``, ``focal_mixup``).
        loss: ``ce``, ``focal`` or ``focal_adaptive``.
        focal_gamma: focal γ.
        mixup_alpha: Beta(α, α) mixup; 0 disables.
        mixup_space: ``input`` (bag-level) or ``feature`` (pooled features).
        epochs, batch_size, lr, weight_decay, warmup_epochs: optimisation (AdamW, warm-up + cosine).
        encoder, embed_dim, attn_dim, dropout, head: MIL model (:func:`lungcal.mil.models.build_mil_model`;
            head ``attention``, ``lse`` or ``noisy_or``).
        bag_params: :class:`lungcal.candidates.cache.BagParams` fields (spacing, hu_window, k, patch_size...).
        datalist: datalist JSON; ``None`` uses the built-in synthetic cohort (generated once).
        demo_subjects: size of the synthetic cohort when it is generated (``None``: its default).
        output_dir: where data, caches, checkpoints and the MLflow store go (default ``runs/``).
        tracking_uri: MLflow URI (default ``sqlite:///<output_dir>/mlflow.db``).
        run_name: MLflow run name (default ``<method>-<timestamp>``).
        n_bins, n_bootstrap: test-report ECE bins (10 for CT) and bootstrap resamples.
        seed, device, num_workers: reproducibility, torch device, bag-building processes.
        augment: random flips/axis permutations of the training bags (:func:`random_orientation`).
        tta_flips: evaluate (validation, test, TS, LAS features, inference) with features averaged
            over the 8 flips of the patch axes (:mod:`lungcal.mil.models`); stored in the checkpoint.
    """

    def __init__(self, method: str, loss: str = "ce", focal_gamma: float = 2.0, mixup_alpha: float = 0.0,
                 mixup_space: str = "input", epochs: int = 10, batch_size: int = 16, lr: float = 1e-3,
                 weight_decay: float = 1e-4, warmup_epochs: float = 1.0, encoder: str = "small", embed_dim: int = 64,
                 attn_dim: int = 64, dropout: float = 0.0, head: str = "attention",
                 bag_params: Mapping[str, Any] | None = None,
                 datalist: str | None = None, demo_subjects: int | None = None, output_dir: str | None = None,
                 tracking_uri: str | None = None, run_name: str | None = None, n_bins: int = 10,
                 n_bootstrap: int = 1000, seed: int = 0, device: str | None = None, num_workers: int = 2,
                 augment: bool = True, tta_flips: bool = True, bundle: str | None = None) -> None:
        self.choices = {k: v for k, v in locals().items() if k not in ("self", "__class__")}
        self.method = method
        self.loss_name = loss
        self.focal_gamma = float(focal_gamma)
        self.mixup_alpha = float(mixup_alpha)
        self.mixup_space = mixup_space
        self.epochs = int(epochs)
        self.batch_size = int(batch_size)
        self.lr = float(lr)
        self.weight_decay = float(weight_decay)
        self.warmup_epochs = float(warmup_epochs)
        self.bag_params = dict(bag_params or {})
        self.model_config = {"encoder": encoder, "head": head, "embed_dim": int(embed_dim),
                             "attn_dim": int(attn_dim), "dropout": float(dropout),
                             "patch_size": int(self.bag_params.get("patch_size", 16)), "num_classes": 2,
                             "tta_flips": bool(tta_flips)}
        self.output_dir = _resolve_output_dir(output_dir)
        self.tracking_uri = tracking_uri or tracking.default_tracking_uri(self.output_dir)
        self.run_name = run_name or f"{method}-{time.strftime('%Y%m%d-%H%M%S')}"
        self.n_bins = int(n_bins)
        self.n_bootstrap = int(n_bootstrap)
        self.seed = int(seed)
        self.device = _device(device)
        self.bundle = bundle
        self.augment = bool(augment)
        self.data = _CTData(datalist, self.output_dir, self.bag_params, num_workers, demo_subjects)
        self._network: torch.nn.Module | None = None
        self._evaluator = None
        self._loaded = False
        self.result: dict[str, Any] = {}

    # -- lazily built pieces (the bundle's train#trainer / validate#evaluator call these) --------
    def _ensure_data(self) -> None:
        if not self._loaded:
            self.data.load()
            self._loaded = True

    @property
    def network(self) -> torch.nn.Module:
        if self._network is None:
            _seed_everything(self.seed)
            self._network = _build_network(self.model_config).to(self.device)
        return self._network

    def build_evaluator(self, handlers: Sequence | None = None):
        """The validation ``SupervisedEvaluator`` (bundle id ``validate#evaluator``)."""
        from lungcal.engine.stage1 import build_evaluator

        self._ensure_data()
        self._evaluator = build_evaluator(self.network, self.data.loader("val", self.batch_size, False),
                                          device=self.device, n_bins=self.n_bins, handlers=handlers)
        return self._evaluator

    def build_trainer(self, evaluator, handlers: Sequence | None = None):
        """The ``SupervisedTrainer`` (bundle id ``train#trainer``); validates every epoch."""
        from lungcal.engine.stage1 import build_trainer, make_loss

        self._ensure_data()
        self._evaluator = evaluator
        return build_trainer(
            self.network, self.data.loader("train", self.batch_size, True, self.seed, augment=self.augment), evaluator,
            device=self.device, loss=make_loss(self.loss_name, gamma=self.focal_gamma), epochs=self.epochs,
            lr=self.lr, weight_decay=self.weight_decay, warmup_epochs=self.warmup_epochs,
            mixup_alpha=self.mixup_alpha, mixup_space=self.mixup_space, seed=self.seed, handlers=handlers)

    # -- the run ---------------------------------------------------------------------------------
    def _params(self) -> dict[str, Any]:
        p = {k: v for k, v in self.choices.items() if k not in ("datalist", "output_dir", "tracking_uri", "bundle")}
        p["datalist"] = {"source": self.data.source, "sha256": self.data.digest}
        p["bundle"] = Path(self.bundle).name if self.bundle else "python"
        p["n_ct"] = {s: len(self.data.splits[s]["subjects"]) for s in SPLITS}
        return p

    def _tags(self, stage2: str) -> dict[str, str]:
        return {tracking.TAG_DATASET: self.data.source, tracking.TAG_STAGE1: self.method, tracking.TAG_STAGE2: stage2, tracking.TAG_SITE: self.data.site}

    def run(self, trainer) -> dict[str, Any]:
        """Train, evaluate on test, fit TS on validation, log the calibrated test run; print a summary."""
        from lungcal.engine.evaluate import evaluate_probs, log_split, probabilities
        from lungcal.engine.stage1 import AtomicCheckpoint, EpochMetricsLogger, predict
        from lungcal.calibration.scaling import TemperatureScaler

        self._ensure_data()
        _seed_everything(self.seed)
        evaluator = self._evaluator
        with tracking.RunTracker(EXPERIMENT, self.run_name, tracking_uri=self.tracking_uri, tags=self._tags("none")) as tr:
            ckdir = self.output_dir / "checkpoints" / tr.run_id
            ckpt = AtomicCheckpoint(ckdir, self.network, "val_auc",
                                    extra={"model_config": self.model_config, "bag_params": json.dumps(self.bag_params),
                                           "method": self.method})
            ckpt.attach(trainer, evaluator)
            EpochMetricsLogger(tr.log_metrics).attach(trainer, evaluator)
            tr.log_params(self._params())
            tr.log_dict({"choices": self._params(), "model_config": self.model_config}, "config/resolved.json")
            trainer.run()

            best = torch.load(ckpt.best_path, map_location="cpu", weights_only=True)
            self.network.load_state_dict(best["state_dict"])
            tr.log_metrics({"best/epoch": best["epoch"], "best/val_auc": best["metric"]})
            out = {s: predict(self.network, self.data.loader(s, self.batch_size, False), self.device) for s in ("val", "test")}
            test, val = self.data.splits["test"], self.data.splits["val"]
            work = ckdir / "eval"
            p_test = probabilities(out["test"]["logits"])
            rep_test = evaluate_probs(p_test, test["labels"], n_bins=self.n_bins, n_bootstrap=self.n_bootstrap, seed=self.seed)
            rep_val = evaluate_probs(probabilities(out["val"]["logits"]), val["labels"], n_bins=self.n_bins, n_bootstrap=0,
                                     seed=self.seed)
            log_split(tr, "test", p_test, test["labels"], rep_test, n_bins=self.n_bins, subjects=test["subjects"],
                      attention=out["test"]["attention"], candidates=test["candidates"], workdir=work, title=self.method)
            tr.log_report("val", {k: v for k, v in rep_val.items() if "_ci_" not in k})
            tr.log_model(self.network, extra=self.model_config)
            tr.log_artifact(ckpt.best_path, "checkpoint")
            stage1_id = tr.run_id

        # stage 2: temperature scaling fitted on validation logits, its own linked run
        with tracking.RunTracker(EXPERIMENT, f"{self.run_name}+ts", tracking_uri=self.tracking_uri, tags=self._tags("ts"),
                          parent_run_id=stage1_id) as tr2:
            scaler = TemperatureScaler().fit(out["val"]["logits"], val["labels"])
            temp = float(scaler.temperature)
            p_cal = probabilities(out["test"]["logits"], temp)
            rep_cal = evaluate_probs(p_cal, test["labels"], n_bins=self.n_bins, n_bootstrap=self.n_bootstrap, seed=self.seed)
            tr2.log_params({**self._params(), "stage2": "ts", "fit_split": "val"})
            tr2.log_metrics({"temperature": temp})
            tr2.log_dict({"temperature": temp, "fit_split": "val", "stage1_run": stage1_id}, "config/resolved.json")
            log_split(tr2, "test", p_cal, test["labels"], rep_cal, n_bins=self.n_bins, subjects=test["subjects"],
                      attention=out["test"]["attention"], candidates=test["candidates"], workdir=work / "ts",
                      title=f"{self.method}+TS")
            ts_path = ckdir / "temperature.json"
            ts_path.write_text(json.dumps({"temperature": temp, "stage1_run": stage1_id}))
            tr2.log_artifact(ts_path, "calibrator")
            ts_id = tr2.run_id

        self.result = {"stage1_run_id": stage1_id, "ts_run_id": ts_id, "temperature": temp,
                       "test": rep_test, "test_ts": rep_cal, "checkpoint": str(ckpt.best_path)}
        print(_summary_lines(f"{self.method} (stage 1) + TS", [(self.method, rep_test), (f"{self.method}+TS", rep_cal)],
                             self.output_dir, self.tracking_uri, [stage1_id, ts_id]) + f"\n  temperature   {temp:.3f}",
              flush=True)
        return self.result


# ---------------------------------------------------------------------------------------- stage 2
def _artifact_checkpoint(tracking_uri: str, run) -> Path:
    """Download (or locate) the ``checkpoint/best.pt`` artifact of a stage-1 run."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    try:
        return Path(client.download_artifacts(run.info.run_id, "checkpoint/best.pt"))
    except Exception as exc:  # noqa: BLE001
        raise ConfigError(f"stage-1 run {run.info.run_id} has no checkpoint/best.pt artifact", field="stage1_run_id",
                          fix="pick a FINISHED run of a bundles/nlst_*.json stage-1 bundle") from exc


class _FromStage1:
    """Shared loading for workflows that start from a stage-1 run or checkpoint."""

    def _init_source(self, stage1_run_id, checkpoint, output_dir, tracking_uri, datalist, num_workers, device,
                     demo_subjects=None):
        self.output_dir = _resolve_output_dir(output_dir)
        self.tracking_uri = tracking_uri or tracking.default_tracking_uri(self.output_dir)
        self.stage1_run_id = stage1_run_id
        self.checkpoint = checkpoint
        self.datalist = datalist
        self.num_workers = int(num_workers)
        self.device = _device(device)
        self.demo_subjects = demo_subjects

    def _load_stage1(self):
        run = None
        if self.checkpoint:
            ck = load_checkpoint(self.checkpoint)
        else:
            run = find_stage1_run(self.tracking_uri, self.stage1_run_id)
            ck = load_checkpoint(_artifact_checkpoint(self.tracking_uri, run))
        net = _build_network(ck["model_config"])
        net.load_state_dict(ck["state_dict"])
        net.to(self.device).eval()
        bag_params = json.loads(ck["bag_params"]) if isinstance(ck.get("bag_params"), str) else dict(ck.get("bag_params", {}))
        return run, ck, net, bag_params


class LASExperiment(_FromStage1):
    """Stage 2 by label-aware smoothing: retrain only the head of a stage-1 model.

    Args:
        stage1_run_id: MLflow id of the stage-1 run; ``None`` = the latest finished stage-1 run.
        checkpoint: a stage-1 ``best.pt`` instead of a run (then the run tag is ``checkpoint``).
        smooth_head, smooth_tail, shape: LAS ε schedule (MiSLAS).
        epochs, lr, batch_size, balanced_sampling: head retraining.
        datalist: the datalist of the stage-1 run (``None``: the synthetic cohort).
        output_dir, tracking_uri, n_bins, n_bootstrap, seed, device, num_workers, run_name: as for
            :class:`CTExperiment`.
    """

    def __init__(self, stage1_run_id: str | None = None, checkpoint: str | None = None, smooth_head: float = 0.3,
                 smooth_tail: float = 0.0, shape: str = "concave", epochs: int = 30, lr: float = 0.05,
                 batch_size: int = 32, balanced_sampling: bool = True, datalist: str | None = None,
                 demo_subjects: int | None = None, output_dir: str | None = None, tracking_uri: str | None = None,
                 run_name: str | None = None, n_bins: int = 10, n_bootstrap: int = 1000, seed: int = 0,
                 device: str | None = None, num_workers: int = 2, bundle: str | None = None) -> None:
        self.choices = {k: v for k, v in locals().items() if k not in ("self", "__class__")}
        self._init_source(stage1_run_id, checkpoint, output_dir, tracking_uri, datalist, num_workers, device,
                          demo_subjects)
        self.las = {"smooth_head": float(smooth_head), "smooth_tail": float(smooth_tail), "shape": shape,
                    "epochs": int(epochs), "lr": float(lr), "batch_size": int(batch_size),
                    "balanced_sampling": bool(balanced_sampling), "seed": int(seed)}
        self.run_name = run_name
        self.n_bins, self.n_bootstrap, self.seed = int(n_bins), int(n_bootstrap), int(seed)
        self.result: dict[str, Any] = {}

    def run(self) -> dict[str, Any]:
        """Load stage 1, retrain the head with LAS on train features, evaluate on test, log a linked run."""
        from lungcal.engine.evaluate import evaluate_probs, log_split, probabilities
        from lungcal.engine.stage1 import predict
        from lungcal.calibration.las import class_counts_from_labels, retrain_head_las
        from lungcal.engine.stage2 import apply_head

        run, ck, net, bag_params = self._load_stage1()
        data = _CTData(self.datalist, self.output_dir, bag_params, self.num_workers, self.demo_subjects).load()
        bs = self.las["batch_size"]
        out = {s: predict(net, data.loader(s, bs, False), self.device) for s in ("train", "test")}
        train, test = data.splits["train"], data.splits["test"]
        counts = class_counts_from_labels(train["labels"], 2)
        head = retrain_head_las(net.head, out["train"]["features"], train["labels"], counts,
                                **{k: v for k, v in self.las.items()})
        # log-sum-exp / noisy-OR heads score the candidates themselves: the table shows the new weights
        logits, attention = apply_head(head, out["test"]["features"], out["test"]["attention"])
        p = probabilities(logits)
        rep = evaluate_probs(p, test["labels"], n_bins=self.n_bins, n_bootstrap=self.n_bootstrap, seed=self.seed)
        parent = run.info.run_id if run is not None else None
        stage1 = run.data.tags.get(tracking.TAG_STAGE1, "unknown") if run is not None else str(ck.get("method", "checkpoint"))
        name = self.run_name or f"{stage1}+las-{time.strftime('%Y%m%d-%H%M%S')}"
        tags = {tracking.TAG_DATASET: data.source, tracking.TAG_STAGE1: stage1, tracking.TAG_STAGE2: "las", tracking.TAG_SITE: data.site}
        with tracking.RunTracker(EXPERIMENT, name, tracking_uri=self.tracking_uri, tags=tags, parent_run_id=parent) as tr:
            params = {k: v for k, v in self.choices.items() if k not in ("datalist", "output_dir", "tracking_uri",
                                                                           "checkpoint", "bundle")}
            params.update({"datalist": {"source": data.source, "sha256": data.digest}, "class_counts": counts,
                           "stage1_run": parent or "checkpoint"})
            tr.log_params(params)
            tr.log_dict(params, "config/resolved.json")
            log_split(tr, "test", p, test["labels"], rep, n_bins=self.n_bins, subjects=test["subjects"],
                      attention=attention, candidates=test["candidates"],
                      workdir=self.output_dir / "checkpoints" / tr.run_id, title=f"{stage1}+LAS")
            net.head = head
            tr.log_model(net, extra=ck["model_config"])
            run_id = tr.run_id
        self.result = {"run_id": run_id, "parent": parent, "test": rep, "class_counts": counts}
        print(_summary_lines(f"{stage1} + LAS (stage 2)", [(f"{stage1}+LAS", rep)], self.output_dir, self.tracking_uri,
                             [run_id]), flush=True)
        return self.result


# ---------------------------------------------------------------------------------------- inference
class InferenceWorkflow(_FromStage1):
    """Calibrated probabilities for new CTs, with a candidates table per CT.

    Args:
        inputs: a datalist JSON, or a folder of CTs (each NIfTI/MHD/NRRD file or DICOM series
            folder directly inside it is one CT).
        stage1_run_id / checkpoint: the model (default: latest finished stage-1 run); with a run,
            the temperature of its linked TS run is applied: the reference one fitted by the
            stage-1 bundle, or with ``site`` the one ``lungcal recalibrate`` fitted at that site.
        site: use the temperature recalibrated at this site (the ``lungcal.site`` of a
            ``lungcal recalibrate`` run of the same stage-1 run).
        temperature: overrides the temperature (1.0 = uncalibrated) when set.
        output: folder for ``predictions.csv`` and ``candidates/<subject>.csv``
            (default ``<output_dir>/inference/<timestamp>``).
    """

    def __init__(self, inputs: str | None = None, stage1_run_id: str | None = None, checkpoint: str | None = None,
                 temperature: float | None = None, output: str | None = None, output_dir: str | None = None,
                 tracking_uri: str | None = None, device: str | None = None, num_workers: int = 2,
                 batch_size: int = 16, site: str | None = None) -> None:
        if not inputs:
            raise ConfigError("no inputs given", field="inputs", fix="pass --inputs <datalist.json or folder of CTs>")
        self._init_source(stage1_run_id, checkpoint, output_dir, tracking_uri, None, num_workers, device)
        self.inputs = Path(str(inputs)).expanduser()
        self.temperature = temperature
        self.site = str(site) if site else None
        self.output = Path(output) if output else self.output_dir / "inference" / time.strftime("%Y%m%d-%H%M%S")
        self.batch_size = int(batch_size)

    def _rows(self) -> list[dict]:
        if self.inputs.is_file():
            from lungcal.data.manifest import load_manifest

            return load_manifest(self.inputs)
        if not self.inputs.is_dir():
            raise DataError("inputs not found", file=self.inputs, field="inputs",
                            fix="pass a datalist JSON or a folder of CTs")
        items = sorted(p for p in self.inputs.iterdir() if not p.name.startswith("."))
        cts = [p for p in items if p.is_dir() or p.name.lower().endswith((".nii", ".nii.gz", ".mha", ".mhd", ".nrrd"))]
        if not cts:
            raise DataError("no CT found in the folder", file=self.inputs, field="inputs",
                            fix="put one NIfTI/MHD/NRRD file or DICOM series folder per CT in it")
        # pseudonyms by position: file names may carry identifiers
        return [{"image": str(p), "label": -1, "subject": f"ct{i:04d}", "site": "inference", "split": "test"}
                for i, p in enumerate(cts)]

    def _temperature(self, run) -> float:
        if self.temperature is not None:
            return float(self.temperature)
        if run is None:
            if self.site:
                raise ConfigError("--site needs the model as an MLflow run", field="site",
                                  fix="pass --stage1_run_id, or --temperature <T> with a checkpoint")
            return 1.0
        temp = tracking.linked_temperature(self.tracking_uri, run, site=self.site)
        if temp is not None:
            return temp
        if self.site:
            raise ConfigError(f"run {run.info.run_id} has no finished TS run recalibrated at site {self.site!r}",
                              field="site", fix=f"run `lungcal recalibrate --model {run.info.run_id} --datalist "
                                                "<site.json>` first, or drop --site to use the reference temperature")
        logger.warning("no finished TS run linked to %s: probabilities are uncalibrated", run.info.run_id)
        return 1.0

    def run(self) -> dict[str, Any]:
        """Write ``predictions.csv`` (subject, probability, temperature) and per-CT candidate tables."""
        import csv

        from lungcal.candidates.cache import build_bags
        from lungcal.engine.evaluate import probabilities
        from lungcal.engine.stage1 import predict

        run, ck, net, bag_params = self._load_stage1()
        temp = self._temperature(run)
        rows = self._rows()
        for r in rows:
            r.setdefault("label", -1)
        built = build_bags(rows, bag_params, self.output_dir / "cache" / "bags", num_workers=self.num_workers)
        split = load_split(built)
        split["labels"] = torch.zeros(len(built), dtype=torch.long)
        loader = torch.utils.data.DataLoader(BagSet(split["bags"], split["mask"], split["labels"]),
                                             batch_size=self.batch_size, shuffle=False)
        out = predict(net, loader, self.device)
        p = probabilities(out["logits"], temp)[:, 1]
        self.output.mkdir(parents=True, exist_ok=True)
        (self.output / "candidates").mkdir(exist_ok=True)
        with open(self.output / "predictions.csv", "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["subject", "probability", "temperature", "top_candidate", "top_attention"])
            for i, subj in enumerate(split["subjects"]):
                att = out["attention"][i].numpy()
                j = int(att.argmax())
                w.writerow([subj, f"{p[i]:.6f}", f"{temp:.4f}", j, f"{att[j]:.6f}"])
        for i, subj in enumerate(split["subjects"]):
            c = split["candidates"][i]
            att = out["attention"][i].numpy()
            with open(self.output / "candidates" / f"{subj}.csv", "w", newline="") as f:
                w = csv.writer(f)
                w.writerow(["slot", "x_mm", "y_mm", "z_mm", "radius_mm", "score", "attention"])
                for j in range(len(c["score"])):
                    w.writerow([j, *(f"{v:.2f}" for v in c["world"][j]), f"{c['radius_mm'][j]:.2f}",
                                f"{c['score'][j]:.4f}", f"{att[j]:.6f}"])
        print(f"== lungcal inference ==\n  {len(rows)} CT(s), temperature {temp:.3f}\n  written to {self.output}", flush=True)
        return {"output": str(self.output), "temperature": temp, "probabilities": p.tolist()}
