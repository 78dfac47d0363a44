"""The study runner: a grid of dataset x stage-1 method x stage-2 method, run through the bundles.

Each stage-1 bundle (``bundles/{dataset}_{stage1}.json``, merged over its complete base:
``nlst_focal.json``, ``cifar10lt_ce.json``) trains, evaluates and records two runs: stage 2 ``none``
and its linked ``ts`` run. The LAS bundle (``bundles/{dataset}_las.json``; CIFAR-10's over
``cifar10lt_las.json``) retrains the head of a finished stage-1 run (passed as an override). The
runner therefore plans *jobs*: one stage-1 job per (dataset, stage-1 method) that yields ``none``
and ``ts``, and one LAS job per (dataset, stage-1 method) that needs the stage-1 run.

Resume: a job's identity is a short hash of (dataset, stage-1 method, bundle overrides, preset),
its *study key*. When a job finishes, the runner tags the runs it produced with
``lungcal.study_key`` (and ``lungcal.study_preset``). A configuration whose FINISHED run carries
the same study key and the expected ``lungcal.stage1``/``lungcal.stage2`` tags is skipped, so an
interrupted study continues where it stopped and a study with other settings does not reuse it.

Bundles run as subprocesses (``python -m monai.bundle run --config_file ... --key value``) from
the project root, so ``%`` macros resolve as on the command line and a crash in one job cannot
take the study down; each job's output goes to ``<output_dir>/study_logs/``.

Parallel jobs (``workers > 1``): up to ``workers`` bundle subprocesses run at once against the one
tracking store; a LAS job starts only once its stage-1 job has finished. This process alone talks
to MLflow about the plan (it opens the store, creating its tables, before any job starts; it finds
LAS parents and tags runs); each job finds its own runs by the ``lungcal.study_job`` tag that every
run of the job carries (:data:`~lungcal.tracking.names.ENV_STUDY_JOB` in the job's environment),
not by start time, so two jobs that run side by side never claim each other's runs. SQLite takes
one writer at a time (MLflow waits up to 20 s for its lock); a PostgreSQL store
(``postgresql://``, the ``[team]`` extra) takes many.
"""
from __future__ import annotations

import concurrent.futures as cf
import hashlib
import json
import os
import subprocess
import sys
import traceback
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from monai.bundle import run as monai_bundle_run
from tqdm.auto import tqdm

from lungcal.data.synthetic import cohort_datalist_path, ensure_cohort
from lungcal.errors import ConfigError
from lungcal.paths import default_output_dir
from lungcal.study.report import normalise_stage2
from lungcal.tracking.names import ENV_STUDY_JOB, TAG_STAGE2, TAG_STUDY_JOB, TAG_STUDY_KEY, TAG_STUDY_PRESET
from lungcal.tracking.tracker import default_tracking_uri, open_store, redact_uri

__all__ = [
    "DATASETS",
    "STAGE1_METHODS",
    "STAGE2_METHODS",
    "TAG_STUDY_KEY",
    "DatasetSpec",
    "Job",
    "JobResult",
    "StudyPlan",
    "plan_study",
    "print_plan",
    "run_study",
    "bundle_command",
    "subprocess_runner",
    "inprocess_runner",
]


STAGE1_METHODS = ("ce", "focal", "mixup", "focal_mixup")
STAGE2_METHODS = ("none", "ts", "las")


@dataclass(frozen=True)
class DatasetSpec:
    """How the study drives one dataset's bundles.

    Attributes:
        name: ``nlst``, ``cifar10`` or ``cifar10lt``; also the MLflow experiment.
        stage1_bundle: file name pattern of the stage-1 bundles, with ``{stage1}``.
        base_bundle: a complete bundle that the stage-1 files state differences from (``nlst_focal.json``):
            a stage-1 job runs ``[base, variant]`` (the base alone for its own recipe).
        las_bundle: file name of the LAS bundle.
        las_base_bundle: a complete LAS bundle that ``las_bundle`` states differences from
            (``cifar10lt_las.json``): a LAS job runs ``[base, las_bundle]`` (the base alone for its own recipe).
        las_parent_key: the LAS bundle's override key that takes the stage-1 run id.
        presets: ``{"reduced": overrides, "full": overrides}`` of the stage-1 bundles.
        las_presets: the same for the LAS bundle (the LAS job gets only these, the datalist and
            the stage-1 run; ``--override`` values go to the stage-1 bundles).
        accepts_datalist: whether ``--datalist`` is passed to its bundles.
        cohort_presets: ``{study preset: synthetic cohort preset}`` used when no ``--datalist`` is
            given (:data:`lungcal.data.synthetic.COHORT_PRESETS`): the ``full`` CT study runs on the
            NLST-like cohort (prevalence 0.11, 1000/1000/1500 CTs), not on the headline demo.
    """

    name: str
    stage1_bundle: str
    las_bundle: str
    las_parent_key: str
    presets: Mapping[str, Mapping[str, object]]
    las_presets: Mapping[str, Mapping[str, object]] = field(default_factory=lambda: {"reduced": {}, "full": {}})
    accepts_datalist: bool = False
    cohort_presets: Mapping[str, str] = field(default_factory=dict)
    base_bundle: str | None = None
    las_base_bundle: str | None = None

    @property
    def experiment(self) -> str:
        return self.name


_CIFAR_REDUCED = {"epochs": 30, "warmup_epochs": 1, "lr_milestones": [24, 27], "subset": 10000}

#: ``reduced`` runs on two CPU cores in minutes per job; ``full`` is each bundle's own schedule.
DATASETS: dict[str, DatasetSpec] = {
    "nlst": DatasetSpec(
        "nlst", "nlst_{stage1}.json", "nlst_las.json", "stage1_run_id",
        presets={"reduced": {"epochs": 6}, "full": {}},
        las_presets={"reduced": {"epochs": 15}, "full": {}}, accepts_datalist=True,
        cohort_presets={"full": "study"}, base_bundle="nlst_focal.json"),
    "cifar10": DatasetSpec(
        "cifar10", "cifar10_{stage1}.json", "cifar10_las.json", "stage1_run_id",
        presets={"reduced": _CIFAR_REDUCED, "full": {}}, las_presets={"reduced": {"epochs": 5}, "full": {}},
        base_bundle="cifar10lt_ce.json", las_base_bundle="cifar10lt_las.json"),
    "cifar10lt": DatasetSpec(
        "cifar10lt", "cifar10lt_{stage1}.json", "cifar10lt_las.json", "stage1_run_id",
        presets={"reduced": _CIFAR_REDUCED, "full": {}}, las_presets={"reduced": {"epochs": 5}, "full": {}},
        base_bundle="cifar10lt_ce.json", las_base_bundle="cifar10lt_las.json"),
}


@dataclass
class Job:
    """One bundle invocation of the plan.

    ``produces`` lists the stage-2 methods whose runs this job records (``["none", "ts"]`` for a
    stage-1 job, ``["las"]`` for a LAS job); ``missing`` those not yet FINISHED in MLflow.
    """

    dataset: str
    stage1: str
    kind: str  # "stage1" | "las"
    bundle: tuple[Path, ...]
    overrides: dict[str, object]
    study_key: str
    produces: list[str]
    missing: list[str]
    preset: str
    seed: int | None = None
    cohort: str | None = None  # synthetic cohort preset to generate before the job runs

    @property
    def label(self) -> str:
        seed = "" if self.seed is None else f"/seed{self.seed}"
        return f"{self.dataset}/{self.stage1}/{'+'.join(self.produces)}{seed}"

    @property
    def skip(self) -> bool:
        return not self.missing


@dataclass
class StudyPlan:
    jobs: list[Job]
    tracking_uri: str
    output_dir: Path
    project_dir: Path
    #: ``runner(bundle, overrides, cwd, log, env=...) -> exit code``; ``env`` holds extra environment
    #: variables for the job (its :data:`~lungcal.tracking.names.ENV_STUDY_JOB`).
    runner: Callable[..., int] | None = None


@dataclass
class JobResult:
    job: Job
    status: str  # "skipped" | "finished" | "failed"
    run_ids: list[str] = field(default_factory=list)
    log: Path | None = None
    message: str = ""


def study_key(dataset: str, stage1: str, overrides: Mapping[str, object], preset: str) -> str:
    """A short stable hash of what defines a stage-1 configuration's runs (not the stage-2 method)."""
    blob = json.dumps({"dataset": dataset, "stage1": stage1, "preset": preset,
                       "overrides": {k: str(v) for k, v in sorted(overrides.items())}}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _finished_runs(client, experiment: str, key: str) -> list:
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        return []
    return client.search_runs([exp.experiment_id],
                              filter_string=f"attributes.status = 'FINISHED' and tags.`{TAG_STUDY_KEY}` = '{key}'",
                              order_by=["attributes.start_time DESC"], max_results=500)


def _stage2_of(run) -> str:
    return normalise_stage2(run.data.tags.get(TAG_STAGE2))


def plan_study(datasets: Sequence[str], *, stage1: Sequence[str] | None = None, stage2: Sequence[str] | None = None,
               preset: str = "reduced", overrides: Mapping[str, object] | None = None, datalist: str | None = None,
               tracking_uri: str | None = None, bundle_dir: str | Path | None = None,
               output_dir: str | Path | None = None, force: bool = False,
               seeds: Sequence[int] | None = None) -> StudyPlan:
    """Plan the grid and mark what MLflow already holds.

    Args:
        datasets: keys of :data:`DATASETS`.
        stage1: stage-1 methods (default :data:`STAGE1_METHODS`).
        stage2: stage-2 methods among ``none``, ``ts``, ``las`` (default all).
        preset: ``reduced`` (CPU-friendly) or ``full`` (the bundles' own schedule).
        overrides: extra bundle overrides, applied after the preset (``epochs=3``, ...).
        datalist: a datalist JSON for the CT bundles (``nlst``); default: the synthetic cohort.
        tracking_uri: MLflow URI given to every bundle and searched for finished runs.
        bundle_dir: folder of the bundle JSONs (default ``./bundles``).
        output_dir: where job logs go (default: the project's output folder).
        force: plan every job even when its runs exist.
        seeds: run every configuration once per seed (the bundles' ``seed``; default: the bundles'
            own seed). Each seed is its own configuration (study key) and its LAS job starts from
            the stage-1 run of the same seed.

    Raises:
        ConfigError: unknown dataset/method/preset, or a bundle file missing.
    """
    stage1 = list(stage1 or STAGE1_METHODS)
    stage2 = list(stage2 or STAGE2_METHODS)
    unknown = [d for d in datasets if d not in DATASETS]
    if unknown:
        raise ConfigError(f"unknown dataset(s) {unknown}", field="--datasets", fix=f"choose from {sorted(DATASETS)}")
    bad2 = [m for m in stage2 if m not in STAGE2_METHODS]
    if bad2:
        raise ConfigError(f"unknown stage-2 method(s) {bad2}", field="--stage2",
                          fix=f"choose from {list(STAGE2_METHODS)}")
    if preset not in ("reduced", "full"):
        raise ConfigError(f"unknown preset {preset!r}", field="--preset", fix="use reduced or full")
    project_dir = Path.cwd()
    bdir = Path(bundle_dir) if bundle_dir else project_dir / "bundles"
    out = Path(output_dir) if output_dir else default_output_dir()
    uri = tracking_uri or default_tracking_uri(out)
    # a plan (or a dry run) must not create a store: a missing SQLite file simply holds no runs
    fresh = uri.startswith("sqlite:///") and not Path(uri[len("sqlite:///"):]).exists()
    client = None if fresh else open_store(uri)
    jobs: list[Job] = []
    seed_list: list[int | None] = [int(x) for x in seeds] if seeds else [None]
    for ds, s1, seed in ((d, m, x) for d in datasets for m in stage1 for x in seed_list):
        spec = DATASETS[ds]
        ov: dict[str, object] = dict(spec.presets[preset])
        cohort = None
        if datalist and spec.accepts_datalist:
            ov["datalist"] = str(Path(datalist).resolve())
        elif preset in spec.cohort_presets:
            cohort = spec.cohort_presets[preset]
            ov["datalist"] = str(cohort_datalist_path(cohort, out / "data"))
        if seed is not None:
            ov["seed"] = seed
        ov.update(overrides or {})
        key = study_key(ds, s1, ov, preset)
        done = set() if force or client is None else {
            _stage2_of(r) for r in _finished_runs(client, spec.experiment, key)}
        s1_file = bdir / spec.stage1_bundle.format(stage1=s1)
        s1_bundle = tuple(dict.fromkeys([*([bdir / spec.base_bundle] if spec.base_bundle else []), s1_file]))
        for path in s1_bundle:
            if not path.is_file():
                raise ConfigError("bundle not found", file=path, field="--stage1",
                                  fix=f"check the method name ({', '.join(STAGE1_METHODS)}) or --bundle-dir")
        s1_products: list[str] = [m for m in ("none", "ts") if m in stage2]
        # LAS needs the stage-1 run, so a LAS-only request still plans stage 1 if absent
        needs_s1 = bool(s1_products) or ("las" in stage2 and "none" not in done)
        if needs_s1:
            produces = s1_products or ["none"]
            jobs.append(Job(ds, s1, "stage1", s1_bundle, ov, key, produces,
                            [m for m in produces if m not in done], preset, seed, cohort))
        if "las" in stage2:
            las_files = [*([bdir / spec.las_base_bundle] if spec.las_base_bundle else []), bdir / spec.las_bundle]
            las_bundle = tuple(dict.fromkeys(las_files))
            for path in las_bundle:
                if not path.is_file():
                    raise ConfigError("LAS bundle not found", file=path, field="--stage2",
                                      fix="drop 'las' from --stage2 or add the bundle")
            las_ov: dict[str, object] = dict(spec.las_presets[preset])
            for k in ("datalist", "seed"):
                if k in ov:
                    las_ov[k] = ov[k]
            jobs.append(Job(ds, s1, "las", las_bundle, las_ov, key, ["las"],
                            [] if "las" in done else ["las"], preset, seed, cohort))
    return StudyPlan(jobs, uri, out, project_dir)


def print_plan(plan: StudyPlan, file=None) -> None:
    """Print one line per job: run or skip, bundle and overrides."""
    file = file or sys.stdout
    todo = sum(not j.skip for j in plan.jobs)
    print(f"study plan: {len(plan.jobs)} jobs, {todo} to run, {len(plan.jobs) - todo} already finished "
          f"(tracking {redact_uri(plan.tracking_uri)})", file=file)
    for j in plan.jobs:
        state = "skip" if j.skip else "run "
        ov = " ".join(f"--{k} {v}" for k, v in j.overrides.items())
        print(f"  [{state}] {j.label:<28} {'+'.join(b.name for b in j.bundle)} {ov}".rstrip(), file=file)


def _config_file(bundle: Path | Sequence[Path]) -> str | list[str]:
    """``--config_file`` of ``python -m monai.bundle run``: one path, or the list MONAI merges in order."""
    files = [str(bundle)] if isinstance(bundle, (str, Path)) else [str(b) for b in bundle]
    return files[0] if len(files) == 1 else files


def subprocess_runner(bundle: Path | Sequence[Path], overrides: Mapping[str, object], cwd: Path, log: Path,
                      env: Mapping[str, str] | None = None) -> int:
    """Run a bundle as ``python -m monai.bundle run`` in ``cwd``, output to ``log``; the exit code.

    ``env``: extra environment variables for the bundle's process.
    """
    with log.open("w") as fh:
        return subprocess.call(bundle_command(bundle, overrides), cwd=cwd, stdout=fh, stderr=subprocess.STDOUT,
                               env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})


def inprocess_runner(bundle: Path | Sequence[Path], overrides: Mapping[str, object], cwd: Path, log: Path,
                     env: Mapping[str, str] | None = None) -> int:
    """Run a bundle with ``monai.bundle.run`` in this process (faster start; no isolation; one job at a time).

    ``env`` is set in this process's environment for the job and restored after. The traceback of
    a failure goes to ``log``; returns 0 or 1.
    """
    old = Path.cwd()
    saved = {k: os.environ.get(k) for k in (env or {})}
    try:
        os.chdir(cwd)
        os.environ.update(env or {})
        kwargs: dict[str, Any] = dict(overrides)  # bundle keys, as `--key value` on the command line
        monai_bundle_run(config_file=_config_file(bundle), **kwargs)
        log.write_text(f"{bundle}: finished\n")
        return 0
    except Exception:  # noqa: BLE001 - a failing job is recorded, the study goes on
        log.write_text(traceback.format_exc())
        return 1
    finally:
        os.chdir(old)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def bundle_command(bundle: Path | Sequence[Path], overrides: Mapping[str, object]) -> list[str]:
    """The ``python -m monai.bundle run`` command line of a bundle (one file, or a base and its variant) with
    overrides."""
    files = _config_file(bundle)
    cmd = [sys.executable, "-m", "monai.bundle", "run", "--config_file",
           files if isinstance(files, str) else str(files)]
    for k, v in overrides.items():
        cmd += [f"--{k}", v if isinstance(v, str) else json.dumps(v)]
    return cmd


def _tag_new_runs(client, experiment: str, job: Job, token: str) -> list[str]:
    """Tag the FINISHED runs this job attempt produced (tag ``lungcal.study_job = token``) with its study key."""
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        return []
    runs = client.search_runs([exp.experiment_id],
                              filter_string=f"attributes.status = 'FINISHED' and tags.`{TAG_STUDY_JOB}` = '{token}'",
                              order_by=["attributes.start_time DESC"], max_results=100)
    ids = []
    for r in runs:
        if _stage2_of(r) in job.produces and TAG_STUDY_KEY not in r.data.tags:
            client.set_tag(r.info.run_id, TAG_STUDY_KEY, job.study_key)
            client.set_tag(r.info.run_id, TAG_STUDY_PRESET, job.preset)
            ids.append(r.info.run_id)
    return ids


@dataclass
class _Launch:
    """A job ready to run: its overrides (with the tracking URI and LAS parent), log and attempt token."""

    index: int
    overrides: dict[str, object]
    log: Path
    token: str


def _prepare(plan: StudyPlan, client, index: int, logs: Path) -> _Launch | JobResult:
    """What a job needs before it starts (its cohort, its stage-1 run), or its result if it cannot start."""
    job = plan.jobs[index]
    if job.cohort and not Path(str(job.overrides["datalist"])).is_file():
        tqdm.write(f"study: generating the synthetic '{job.cohort}' cohort (once) for {job.label}")
        ensure_cohort(job.cohort, Path(str(job.overrides["datalist"])).parent.parent)
    ov = dict(job.overrides)
    ov["tracking_uri"] = plan.tracking_uri
    if job.kind == "las":
        parents = [r for r in _finished_runs(client, DATASETS[job.dataset].experiment, job.study_key)
                   if _stage2_of(r) == "none"]
        if not parents:
            return JobResult(job, "failed", message="no finished stage-1 run to start LAS from")
        ov[DATASETS[job.dataset].las_parent_key] = parents[0].info.run_id
    log = logs / f"{job.dataset}_{job.stage1}_{job.kind}_{job.study_key}.log"
    return _Launch(index, ov, log, uuid.uuid4().hex)


def _conclude(client, job: Job, launch: _Launch, rc: int) -> JobResult:
    """A finished job attempt's result: its runs tagged with the study key, or why it failed."""
    ids = _tag_new_runs(client, DATASETS[job.dataset].experiment, job, launch.token) if rc == 0 else []
    missing = [m for m in job.missing if m not in {_stage2_of(client.get_run(i)) for i in ids}]
    if rc != 0 or missing:
        msg = f"exit code {rc}" if rc else f"no finished run for {missing}"
        tqdm.write(f"study: {job.label} failed ({msg}); see {launch.log}", file=sys.stderr)
        return JobResult(job, "failed", ids, launch.log, msg)
    return JobResult(job, "finished", ids, launch.log)


def run_study(plan: StudyPlan, progress: bool = True, workers: int = 1) -> list[JobResult]:
    """Run the plan's jobs, up to ``workers`` at a time, each LAS job after its stage-1 job.

    Jobs start in plan order as workers free up; a LAS job waits for its stage-1 job (a skipped,
    already finished stage-1 job does not hold it). A failing job is recorded and the study goes on
    (its LAS job is then failed without running); the log path is printed. Returns one
    :class:`JobResult` per job, in plan order.

    Raises:
        ConfigError: ``workers < 1``, or ``workers > 1`` with the in-process runner (one job at a time).
        TrackingError: the store cannot be opened.
    """
    workers = int(workers)
    runner = plan.runner or subprocess_runner
    if workers < 1:
        raise ConfigError(f"--workers must be at least 1, not {workers}", field="--workers",
                          fix="use --workers 1 or more")
    if workers > 1 and runner is inprocess_runner:
        raise ConfigError("--in-process runs one job at a time", field="--workers",
                          fix="drop --in-process to run jobs in parallel, or use --workers 1")
    client = open_store(plan.tracking_uri)  # tables made here, once, not by racing jobs
    logs = plan.output_dir / "study_logs"
    logs.mkdir(parents=True, exist_ok=True)
    jobs = plan.jobs
    results: list[JobResult | None] = [None] * len(jobs)
    stage1_of = {j.study_key: i for i, j in enumerate(jobs) if j.kind == "stage1" and not j.skip}
    waiting: list[int] = []
    for i, job in enumerate(jobs):
        if job.skip:
            results[i] = JobResult(job, "skipped", message="finished run in MLflow")
        else:
            waiting.append(i)
    bar = tqdm(total=len(jobs), initial=len(jobs) - len(waiting), desc="study", unit="job", disable=not progress)
    running: dict[cf.Future, _Launch] = {}

    def ready(i: int) -> bool:
        dep = stage1_of.get(jobs[i].study_key) if jobs[i].kind == "las" else None
        return dep is None or results[dep] is not None

    def record(i: int, result: JobResult) -> None:
        results[i] = result
        bar.update(1)

    with cf.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="study-job") as pool:
        while waiting or running:
            for i in [i for i in waiting if ready(i)]:
                if len(running) >= workers:
                    break
                waiting.remove(i)
                job = jobs[i]
                dep = stage1_of.get(job.study_key) if job.kind == "las" else None
                dep_result = results[dep] if dep is not None else None
                if dep_result is not None and dep_result.status == "failed":
                    record(i, JobResult(job, "failed", message="its stage-1 job failed"))
                    continue
                launch = _prepare(plan, client, i, logs)
                if isinstance(launch, JobResult):
                    record(i, launch)
                    continue
                running[pool.submit(runner, job.bundle, launch.overrides, plan.project_dir, launch.log,
                                    env={ENV_STUDY_JOB: launch.token})] = launch
            if not running:
                continue  # everything left became ready when the last job was recorded
            bar.set_postfix_str(", ".join(jobs[x.index].label for x in running.values()))
            done, _ = cf.wait(running, return_when=cf.FIRST_COMPLETED)
            for fut in done:
                launch = running.pop(fut)
                try:
                    rc = fut.result()
                except Exception as exc:  # noqa: BLE001 - a runner that raises fails its job only
                    launch.log.write_text(traceback.format_exc())
                    rc = 1
                    tqdm.write(f"study: {jobs[launch.index].label}: the runner raised {type(exc).__name__}",
                               file=sys.stderr)
                record(launch.index, _conclude(client, jobs[launch.index], launch, rc))
    bar.close()
    final = [r for r in results if r is not None]
    n = {s: sum(r.status == s for r in final) for s in ("finished", "skipped", "failed")}
    print(f"study: {n['finished']} finished, {n['skipped']} skipped, {n['failed']} failed; "
          f"report: lungcal report --experiment {' / '.join(sorted({j.dataset for j in plan.jobs}))}"
          + (f" --tracking-uri {redact_uri(plan.tracking_uri)}" if plan.tracking_uri else ""))
    return final
