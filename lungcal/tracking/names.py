"""Every MLflow name lungcal writes or reads, defined once (see ``../shared/DESIGN.md``).

Tags on every run: :data:`TAG_DATASET`, :data:`TAG_STAGE1`, :data:`TAG_STAGE2`, :data:`TAG_SITE`;
:data:`TAG_PARENT` on stage-2 runs. Final metrics are ``{split}/{metric}`` (:func:`metric_name`),
for example ``test/ece`` and ``test/ece_ci_low``.

Artifacts, the same in the CT and the CIFAR runs, so that ``lungcal report`` finds them by name:
``plots/{split}_{kind}.png`` (:func:`plot_artifact`: ``reliability``, ``risk_coverage``, ...),
``predictions/{split}_predictions.{csv|npz}`` (:func:`predictions_artifact`), the resolved config
:data:`CONFIG_ARTIFACT` and the model under :data:`MODEL_ARTIFACT`. CT stage-1 runs also log their
training split's acquisition summary as :data:`ACQUISITION_ARTIFACT`.
"""
from __future__ import annotations

__all__ = [
    "CALIBRATOR_DIR",
    "calibrator_artifact",
    "REFERENCE_CALIBRATOR",
    "TAG_DATASET",
    "TAG_STAGE1",
    "TAG_STAGE2",
    "TAG_SITE",
    "TAG_PARENT",
    "TAG_RECALIBRATION",
    "TAG_CALIBRATOR",
    "TAG_FIT_WARNING",
    "TAG_REPORT",
    "TAG_STUDY_KEY",
    "TAG_STUDY_PRESET",
    "TAG_STUDY_JOB",
    "ENV_STUDY_JOB",
    "TAG_OWNER_PID",
    "MLFLOW_GIT_COMMIT",
    "TAG_CODE_DIRTY",
    "TAG_OWNER_HOST",
    "TAG_OWNER_START",
    "TAG_ENDED_BY",
    "TAG_RESUMED_FROM",
    "TAG_INIT_RUN",
    "TAG_INFERENCE",
    "TAG_MODEL",
    "TAG_OUTCOME",
    "TAG_ENSEMBLE",
    "MLFLOW_PARENT",
    "MLFLOW_EXPERIMENT_KIND",
    "EXPERIMENT_KIND_TRAINING",
    "MLFLOW_SAVED_VIEW_PREFIX",
    "RUNS_VIEW_ID",
    "CT_EXPERIMENT",
    "THRESHOLD_METRIC",
    "SENSITIVITY_AT_THRESHOLD",
    "POSITIVE_RATE_AT_THRESHOLD",
    "GUARANTEE_ARTIFACT",
    "PRIVATE_KEYS",
    "CONFIG_ARTIFACT",
    "MODEL_ARTIFACT",
    "ACQUISITION_ARTIFACT",
    "SITE_REFERENCE_ARTIFACT",
    "SELECTION_ARTIFACT",
    "TAG_SITE_CHECK",
    "TAG_FORCED",
    "SITE_CHECK_ARTIFACT",
    "TAG_MONITOR",
    "TAG_MONITOR_ALERTS",
    "MONITOR_ARTIFACT",
    "PLOTS_DIR",
    "PREDICTIONS_DIR",
    "metric_name",
    "plot_artifact",
    "predictions_artifact",
    "predictions_artifacts",
]

TAG_DATASET = "lungcal.dataset"
TAG_STAGE1 = "lungcal.stage1"
TAG_STAGE2 = "lungcal.stage2"
TAG_SITE = "lungcal.site"
TAG_PARENT = "lungcal.parent_run"
#: on TS runs fitted by ``lungcal recalibrate`` at a site (value ``local``), as opposed to the
#: reference TS run of a stage-1 bundle.
TAG_RECALIBRATION = "lungcal.recalibration"
#: the name of the calibrator a post-hoc run fitted (``ts``, ``platt``, ...).
TAG_CALIBRATOR = "lungcal.calibrator"
#: of a stage-1 run's post-hoc calibrators, the reference one (what inference applies and what
#: draws the test pictures) when it is among them; else the first listed.
REFERENCE_CALIBRATOR = "ts"
#: on a post-hoc / recalibration run whose fit is "no signal" (a parameter on its bound, a fit
#: that did not converge, a validation AUC at chance): the reasons, "; "-joined.
TAG_FIT_WARNING = "lungcal.fit_warning"
#: on the run that holds a study report's files.
TAG_REPORT = "lungcal.report"
#: a study job's identity and preset (see :mod:`lungcal.study.runner`).
TAG_STUDY_KEY = "lungcal.study_key"
TAG_STUDY_PRESET = "lungcal.study_preset"
#: one attempt of one study job: ``lungcal study`` sets :data:`ENV_STUDY_JOB` in the job's
#: environment and every run the job opens carries it, so jobs running side by side (``--workers``)
#: each find exactly their own runs.
TAG_STUDY_JOB = "lungcal.study_job"
ENV_STUDY_JOB = "LUNGCAL_STUDY_JOB"

#: the process that owns a run (see :mod:`lungcal.tracking.liveness`), and who ended it when the
#: owner died (``reaper``).
TAG_OWNER_PID = "lungcal.owner.pid"
TAG_OWNER_HOST = "lungcal.owner.host"
TAG_OWNER_START = "lungcal.owner.start"
TAG_ENDED_BY = "lungcal.ended_by"
#: the epoch a resumed run continued from.
TAG_RESUMED_FROM = "lungcal.resumed_from_epoch"
#: on a fine-tuned stage-1 run: the run it started from (or ``checkpoint:<sha256[:16]>`` of the file).
TAG_INIT_RUN = "lungcal.init_run"
#: deep ensembles (``bundles/nlst_ensemble.json``): ``parent`` on the run that evaluates the
#: members' average (``lungcal.stage2 = ensemble``, its TS run ``ensemble+ts``), ``member`` on each
#: member's stage-1 run (nested under the parent by ``mlflow.parentRunId`` / ``lungcal.parent_run``).
TAG_ENSEMBLE = "lungcal.ensemble"

#: on a scoring run (``lungcal predict`` = ``predict``, ``bundles/inference.json`` = ``bundle``); it is
#: linked to the model's stage-1 run by ``lungcal.parent_run`` and carries no ``lungcal.stage2``.
TAG_INFERENCE = "lungcal.inference"
#: the model a scoring run used: the stage-1 run id, or ``checkpoint:<sha256[:16]>`` of the file.
TAG_MODEL = "lungcal.model"
#: on a scoring run: ``complete`` (every CT found was scored), ``partial`` (some were refused; the
#: run holds the others) or ``failed`` (it broke off: its outputs are incomplete, not a result).
TAG_OUTCOME = "lungcal.outcome"

#: MLflow's own tag that nests a child run under its parent in the UI.
MLFLOW_PARENT = "mlflow.parentRunId"
#: the code that ran: MLflow's own tag for the git commit (the UI shows it on the run's page), set on every run
#: started from a git checkout of lungcal (:func:`lungcal.tracking.tracker.code_version`), and whether the
#: checkout's tracked files differed from that commit (``true`` / ``false``).
MLFLOW_GIT_COMMIT = "mlflow.source.git.commit"
TAG_CODE_DIRTY = "lungcal.code_dirty"
#: MLflow 3's experiment tag for the kind of work (``custom_model_development`` = "Machine learning" in the
#: UI's selector). MLflow 3.0-3.x used it to pick the landing page; 3.17 picks it from the URL's
#: ``workflowType`` instead (see :mod:`lungcal.tracking.runs_view`), so lungcal prints that URL.
MLFLOW_EXPERIMENT_KIND = "mlflow.experimentKind"
EXPERIMENT_KIND_TRAINING = "custom_model_development"
#: MLflow 3.17's saved views of the runs table: experiment tags ``mlflow.sharedViewState.<id>``, opened
#: by ``?viewStateShareKey=<id>``; lungcal's view (the study's columns) has the id :data:`RUNS_VIEW_ID`.
MLFLOW_SAVED_VIEW_PREFIX = "mlflow.sharedViewState."
RUNS_VIEW_ID = "lungcal-study"

#: the MLflow experiment of the CT runs (CIFAR runs use ``cifar10`` / ``cifar10lt``).
CT_EXPERIMENT = "nlst"

#: ``lungcal recalibrate --miss-rate``: the decision threshold on p(cancer) whose missed-cancer rate is
#: guaranteed (:mod:`lungcal.calibration.guarantee`), fitted on the site's val split; logged on the
#: recalibration run with the guarantee as :data:`GUARANTEE_ARTIFACT`, which ``predict --site`` states.
THRESHOLD_METRIC = "val/threshold_missrate"
#: the share of cancers at or above that threshold (``{split}/sensitivity_at_threshold``, with
#: ``_ci_low`` / ``_ci_high`` on test), and the share of CTs called positive (``{split}/positive_rate_at_threshold``)
SENSITIVITY_AT_THRESHOLD = "sensitivity_at_threshold"
POSITIVE_RATE_AT_THRESHOLD = "positive_rate_at_threshold"
GUARANTEE_ARTIFACT = "guarantee.json"


#: bundle keys never logged as they are (paths may carry identifiers); a datalist is logged as source + hash
PRIVATE_KEYS = ("datalist", "output_dir", "tracking_uri", "inputs", "output", "checkpoint", "init_checkpoint")

#: the config a run ran with (macros expanded, overrides applied, paths left out)
CONFIG_ARTIFACT = "config/resolved.json"
#: the logged model (weights + what rebuilds the network)
MODEL_ARTIFACT = "model"
#: a CT stage-1 run's training split, summarised without identifiers: per acquisition field (slice thickness,
#: pixel size, HU of air, noise, edge width) n, mean, sd and quantiles, and the scanner-profile and kernel
#: counts (lungcal.ct.acquisition.summarize_acquisitions); what a site check compares a new site with
ACQUISITION_ARTIFACT = "data/acquisition.json"
#: what a stage-1 run's network makes of its validation split, for site checks: ``scores`` (logit of
#: cancer minus logit of no cancer), ``labels`` and ``features`` (the pooled bag embeddings); no identifiers
SITE_REFERENCE_ARTIFACT = "data/site_reference.npz"
#: which CTs made a CT stage-1 run's checkpoint: the pseudonyms of its train split (trained it) and of its val
#: split (chose its epoch), and the metric that chose it; ``recalibrate --miss-rate`` refuses to certify a
#: threshold on those CTs (lungcal.ctapp.site.certify_split)
SELECTION_ARTIFACT = "data/selection.json"
#: the tag of a ``lungcal site-check`` run: its verdict (``comparable``, ``prevalence_shift``, ``scanner_shift``)
TAG_SITE_CHECK = "lungcal.site_check"
#: set on a run that a site check refused and ``--force`` ran anyway: the verdict it overrode
TAG_FORCED = "lungcal.forced_past_site_check"
#: the JSON of a site check, in its run
SITE_CHECK_ARTIFACT = "site_check.json"
#: the tag of a ``lungcal monitor`` run: ``alert`` when a chunk raised one, else ``quiet``
TAG_MONITOR = "lungcal.monitor"
#: the alerts of a monitoring pass, by chunk ordinal and kind (``chunk 4: scanner_shift; ...``; never a date)
TAG_MONITOR_ALERTS = "lungcal.monitor_alerts"
#: the JSON of a monitoring pass (chunks by ordinal), in its run
MONITOR_ARTIFACT = "monitor.json"
PLOTS_DIR = "plots"
PREDICTIONS_DIR = "predictions"


def plot_artifact(split: str, kind: str) -> str:
    """``plots/{split}_{kind}.png``, e.g. ``plot_artifact("test", "reliability") == "plots/test_reliability.png"``."""
    return f"{PLOTS_DIR}/{split}_{kind}.png"


CALIBRATOR_DIR = "calibrator"


def calibrator_artifact(name: str) -> str:
    """``calibrator/{name}.json``: a fitted calibrator's state (``to_json``), what ``inference.json --site`` and
    :func:`lungcal.tracking.lookup.linked_calibrator` read back."""
    return f"{CALIBRATOR_DIR}/{name}.json"


def predictions_artifact(split: str, suffix: str = "csv") -> str:
    """``predictions/{split}_predictions.{suffix}``: one row per case (CT: CSV; CIFAR: ``npz`` of logits)."""
    return f"{PREDICTIONS_DIR}/{split}_predictions.{suffix}"


def predictions_artifacts(split: str, suffix: str) -> tuple[str, ...]:
    """Where a run may hold its ``split`` predictions, newest name first: :func:`predictions_artifact`, then the
    name CIFAR runs used before 2026-12-04 (``predictions/{split}.npz``), so their stores stay readable."""
    names = (predictions_artifact(split, suffix),)
    return names + ((f"{PREDICTIONS_DIR}/{split}.npz",) if suffix == "npz" else ())


def metric_name(split: str, metric: str) -> str:
    """The final-metric name ``{split}/{metric}``, e.g. ``metric_name("test", "ece") == "test/ece"``."""
    return f"{split}/{metric}"
