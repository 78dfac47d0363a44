"""The run tracker: one MLflow run, shared by the CT bundles and ``cifar_baselines``.

One :class:`RunTracker` is one MLflow run, opened through :class:`mlflow.tracking.MlflowClient`
(no global fluent state, so two trackers can be open at once: a stage-1 run and its linked
stage-2 child). The tracking URI defaults to a SQLite store beside the run outputs,
``sqlite:///<output_dir>/mlflow.db``, with artifacts under ``<output_dir>/mlartifacts``; a team
store (``postgresql://...``) or server is one ``tracking_uri`` away.

Names (see ``../shared/DESIGN.md``): final metrics ``{split}/{metric}``; tags
``lungcal.dataset``, ``lungcal.stage1``, ``lungcal.stage2``, ``lungcal.site`` and
``lungcal.parent_run`` on stage-2 runs.

Privacy: :meth:`RunTracker.log_params` never logs a filesystem path verbatim (a path can carry a
patient name or ID); it logs a short hash of it instead. Callers log datalists by their ``source``
name and content hash, never by row contents.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import re
import socket
import subprocess
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

import matplotlib.pyplot as plt
import torch
from filelock import FileLock
from mlflow.entities import Metric, Param, RunTag
from mlflow.tracking import MlflowClient
from sqlalchemy import create_engine
from sqlalchemy.engine import make_url
from sqlalchemy.pool import NullPool

from lungcal.errors import TrackingError
from lungcal.paths import default_output_dir
from lungcal.tracking.liveness import owner_tags, reap_orphaned_runs
from lungcal.tracking.names import (
    ENV_STUDY_JOB,
    EXPERIMENT_KIND_TRAINING,
    MLFLOW_EXPERIMENT_KIND,
    MLFLOW_GIT_COMMIT,
    MLFLOW_PARENT,
    TAG_CODE_DIRTY,
    TAG_PARENT,
    TAG_STUDY_JOB,
)
from lungcal.tracking.runs_view import ensure_runs_view, saved_view_tag

__all__ = [
    "code_version",
    "default_tracking_uri",
    "artifact_root_for",
    "flatten_config",
    "privacy_filter",
    "file_digest",
    "RunTracker",
    "check_tracking_uri",
    "open_store",
    "redact_uri",
]

logger = logging.getLogger(__name__)

_MAX_PARAM_LEN = 6000
_PARAM_BATCH = 100
_METRIC_BATCH = 1000
_KEY_BAD = re.compile(r"[^A-Za-z0-9_\-./ ]")
_URI_PASSWORD = re.compile(r"(://[^/@:]*:)[^/@]*@")
#: where a PostgreSQL store's driver comes from (psycopg 3; SQLAlchemy >= 2.1 uses it for ``postgresql://``)
_TEAM_FIX = 'pip install -e ".[team]"'
_PATH_SUFFIX = re.compile(
    r"\.(json|csv|tsv|nii|nii\.gz|mha|mhd|nrrd|dcm|pt|pth|npz|npy|db|zip|txt|yaml|yml)$", re.I
)


@functools.lru_cache(maxsize=1)
def code_version() -> dict[str, str]:
    """The tags that say which code ran: the commit of the git checkout lungcal runs from
    (:data:`~lungcal.tracking.names.MLFLOW_GIT_COMMIT`, MLflow's own tag) and whether its tracked files differ
    from it (:data:`~lungcal.tracking.names.TAG_CODE_DIRTY`). Empty when lungcal is not run from a checkout of
    its own (an installed wheel, a checkout without git): the run then says nothing rather than another
    repository's commit. Read once per process."""
    root = Path(__file__).resolve().parents[2]

    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=20,
                                 check=False)
        except (OSError, subprocess.SubprocessError):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    top = git("rev-parse", "--show-toplevel")
    if top is None or Path(top).resolve() != root:
        return {}
    commit = git("rev-parse", "HEAD")
    if not commit:
        return {}
    status = git("status", "--porcelain", "--untracked-files=no")
    tags = {MLFLOW_GIT_COMMIT: commit}
    if status is not None:
        tags[TAG_CODE_DIRTY] = "true" if status else "false"
    return tags


def default_tracking_uri(output_dir: str | Path | None = None) -> str:
    """The default MLflow store: ``sqlite:///<output_dir>/mlflow.db`` (absolute path)."""
    out = Path(output_dir).expanduser().resolve() if output_dir is not None else default_output_dir()
    return f"sqlite:///{(out / 'mlflow.db').as_posix()}"


def artifact_root_for(tracking_uri: str) -> str | None:
    """Artifact location for new experiments of a store that is a database, not a server.

    A local SQLite store keeps them beside its file (``<db dir>/mlartifacts``); a database server
    (``postgresql://``, ``mysql://``, ``mssql://``) under the project's output folder
    (``<LUNGCAL_HOME or ./runs>/mlartifacts``), not in MLflow's default ``./mlruns`` of whatever
    folder the first run started in. Returns ``None`` for a tracking server (``http(s)://``): it
    decides its own artifact store.
    """
    if tracking_uri.startswith("sqlite:///"):
        db = Path(tracking_uri[len("sqlite:///"):])
        if not db.is_absolute():  # "sqlite:///rel.db" is relative in SQLAlchemy
            db = db.resolve()
        return (db.parent / "mlartifacts").as_uri()
    if re.match(r"^(postgresql|mysql|mssql)(\+\w+)?://", tracking_uri):
        return (default_output_dir() / "mlartifacts").as_uri()
    return None


def flatten_config(cfg: Mapping, sep: str = ".") -> dict[str, str]:
    """Flatten a nested config into ``{"a.b.c": "value"}`` strings (lists index as ``a.0``).

    Values are rendered as JSON for containers left empty and ``str`` otherwise; keys are kept in
    insertion order.
    """
    out: dict[str, str] = {}

    def walk(prefix: str, node: Any) -> None:
        if isinstance(node, Mapping) and node:
            for k, v in node.items():
                walk(f"{prefix}{sep}{k}" if prefix else str(k), v)
        elif isinstance(node, (list, tuple)) and node and not all(_is_scalar(x) for x in node):
            for i, v in enumerate(node):
                walk(f"{prefix}{sep}{i}" if prefix else str(i), v)
        else:
            if isinstance(node, (list, tuple)):
                out[prefix] = json.dumps(list(node), default=str)
            elif isinstance(node, Mapping):
                out[prefix] = "{}"
            else:
                out[prefix] = "None" if node is None else str(node)

    walk("", cfg)
    return out


def _is_scalar(x: Any) -> bool:
    return x is None or isinstance(x, (bool, int, float, str))


def _looks_like_path(value: str) -> bool:
    if not value or value.startswith("$") or value.startswith("@"):
        return False
    if "://" in value and not value.startswith(("sqlite:", "file:")):
        return False  # a server URL is not patient data
    return ("/" in value or "\\" in value or value.startswith("~") or bool(_PATH_SUFFIX.search(value)))


def _short_hash(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "replace")).hexdigest()[:12]


def privacy_filter(params: Mapping[str, str]) -> dict[str, str]:
    """Replace every path-like value with ``path:<sha256[:12]>`` (paths can carry identifiers).

    Expressions (``$...``) that mention a path are hashed too; a URL's password becomes ``***``.
    Everything else is kept.
    """
    out = {}
    for k, v in params.items():
        s = str(v)
        if _looks_like_path(s) or (s.startswith("$") and ("/" in s or "\\" in s)):
            out[k] = f"path:{_short_hash(s)}"
        else:
            out[k] = redact_uri(s)  # a database URL's password never reaches a param
    return out


def file_digest(path: str | Path, n: int = 16) -> str:
    """Hex SHA-256 of a file's bytes, truncated to ``n`` characters (datalist fingerprints)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()[:n]


def redact_uri(uri: str) -> str:
    """``uri`` with any password replaced by ``***`` (``postgresql://me:***@host/db``), for printing."""
    return _URI_PASSWORD.sub(r"\1***@", uri)


def _check_postgresql(uri: str, timeout: float) -> None:
    """A ``postgresql[+driver]://`` store: its driver is installed and its database takes a login."""
    shown = redact_uri(uri)
    try:
        url = make_url(uri)
        dialect = url.get_dialect()
    except Exception as exc:  # noqa: BLE001 - any parse failure is the URI's fault
        raise TrackingError(f"cannot read the PostgreSQL tracking URI {shown!r} ({exc})", field="tracking_uri",
                            fix="write postgresql://USER@HOST:5432/DATABASE") from exc
    try:
        dialect.import_dbapi()
    except ImportError as exc:
        raise TrackingError(f"the PostgreSQL driver {dialect.driver!r} is not installed (tracking URI {shown!r})",
                            field="tracking_uri", fix=_TEAM_FIX) from exc
    # one real connection, not MLflow's: it retries a refused login or a missing database for minutes
    engine = create_engine(url, poolclass=NullPool, connect_args={"connect_timeout": max(1, int(timeout))})
    try:
        with engine.connect():
            pass
    except Exception as exc:  # noqa: BLE001 - refused, unknown host, no such database, login failed
        raise TrackingError(f"cannot connect to the PostgreSQL store {shown!r}: {_first_line(exc)}",
                            field="tracking_uri",
                            fix="start PostgreSQL, check host and port, create the database (createdb NAME) "
                                "and the user's login (~/.pgpass or PGPASSWORD)") from exc
    finally:
        engine.dispose()


def check_tracking_uri(uri: str, timeout: float = 5.0) -> None:
    """Refuse, in one line, a store that cannot work: an unknown scheme, or a server that does not answer.

    ``sqlite:///`` gets its folder created; an ``http(s)://`` server must accept a TCP connection
    within ``timeout`` seconds, and a ``postgresql://`` store a login to its database (MLflow's own
    client would retry either for minutes); a ``postgresql://`` store also needs its driver (the
    ``[team]`` extra).

    Raises:
        TrackingError: naming the URI and the fix.
    """
    if uri.startswith("sqlite:///"):
        folder = Path(uri[len("sqlite:///"):]).expanduser().parent
        fix = "pass --tracking_uri sqlite:///<a writable folder>/mlflow.db"
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise TrackingError(f"cannot create the MLflow store's folder for {uri!r}: {exc.strerror}", file=folder,
                                field="tracking_uri", fix=fix) from exc
        if not os.access(folder, os.W_OK):
            raise TrackingError(f"the MLflow store's folder is not writable ({uri!r})", file=folder,
                                field="tracking_uri", fix=fix)
        return
    if re.match(r"^postgresql(\+\w+)?://", uri):
        _check_postgresql(uri, timeout)
        return
    if not re.match(r"^(https?|databricks|postgresql|mysql|mssql)", uri):
        raise TrackingError(f"unsupported MLflow tracking URI {uri!r}", field="tracking_uri",
                            fix="use sqlite:///<abs path>/mlflow.db, postgresql://..., or an http(s):// server")
    if uri.startswith(("http://", "https://")):
        url = urlsplit(uri)
        port = url.port or (443 if url.scheme == "https" else 80)
        try:
            socket.create_connection((url.hostname or "localhost", port), timeout=timeout).close()
        except OSError as exc:
            raise TrackingError(f"MLflow server {uri!r} does not answer ({exc.strerror or exc})", field="tracking_uri",
                                fix="start the server (mlflow server ...) or check the address and port") from exc


def _first_line(exc: BaseException) -> str:
    """The message of ``exc`` (or of the driver error under it), first line, without a password."""
    inner = getattr(exc, "orig", None) or exc
    return redact_uri(str(inner).strip().splitlines()[0] if str(inner).strip() else type(inner).__name__)


def store_creation_lock(uri: str) -> contextlib.AbstractContextManager:
    """A lock held while a process opens a SQLite store for the first time: MLflow creates and migrates a
    new database's tables on first use, and two processes doing it at once on the same new file fail
    ("Online migration expected to match one row ..."). A file lock beside the database
    (``<db>.lock``); other stores need none (nothing for a server, and a team database is made once)."""
    if not uri.startswith("sqlite:///"):
        return contextlib.nullcontext()
    return FileLock(uri[len("sqlite:///"):] + ".lock", timeout=600)


def open_store(uri: str) -> MlflowClient:
    """A client on ``uri`` whose store exists: checked (:func:`check_tracking_uri`), tables created.

    Opening a new database store creates MLflow's tables; doing it once here, before parallel study
    jobs open the same store, keeps them from racing to create the tables.

    Raises:
        TrackingError: the store cannot be opened (naming the URI without its password).
    """
    check_tracking_uri(uri)
    try:
        with store_creation_lock(uri):
            client = MlflowClient(tracking_uri=uri)  # a database store connects here
            client.search_experiments(max_results=1)
    except Exception as exc:  # noqa: BLE001 - any backend failure is a tracking error
        raise TrackingError(f"cannot open MLflow store {redact_uri(uri)!r}: {_first_line(exc)}",
                            field="tracking_uri",
                            fix="check the path is writable, the database exists and the user may write it") from exc
    return client


def _clean_key(key: str) -> str:
    return _KEY_BAD.sub("_", str(key))[:250]


class RunTracker:
    """One MLflow run, used as a context manager.

    ``__exit__`` ends the run ``FINISHED``, ``KILLED`` on ``KeyboardInterrupt``, or ``FAILED`` when
    any other exception escapes (the exception is re-raised).

    Args:
        experiment: MLflow experiment name (``nlst``, ``cifar10``, ``cifar10lt``); created on first
            use with artifacts under ``<store dir>/mlartifacts`` for a SQLite store.
        run_name: explicit run name (never reuse an unfinished run).
        tracking_uri: MLflow URI; defaults to :func:`default_tracking_uri`. ``sqlite:///``,
            ``postgresql://`` (a team store; the ``[team]`` extra) or a server URL (file stores are
            rejected by MLflow 3).
        tags: tags to set at creation (``lungcal.*``; values are strings).
        parent_run_id: the stage-1 run this run derives from; sets ``lungcal.parent_run`` and
            MLflow's ``mlflow.parentRunId`` so the UI nests the child run.
    """

    def __init__(
        self,
        experiment: str,
        run_name: str,
        *,
        tracking_uri: str | None = None,
        tags: Mapping[str, str] | None = None,
        parent_run_id: str | None = None,
        run_id: str | None = None,
    ) -> None:
        self.tracking_uri = tracking_uri or default_tracking_uri()
        check_tracking_uri(self.tracking_uri)
        self.experiment_name = experiment
        self.run_name = run_name
        try:
            with store_creation_lock(self.tracking_uri):  # two runs starting at once on a new store
                self.client = MlflowClient(tracking_uri=self.tracking_uri)
                self.experiment_id = self._get_or_create_experiment(experiment)
            try:
                reap_orphaned_runs(self.client, [self.experiment_id])
            except Exception:  # noqa: BLE001 - housekeeping must never stop a run
                logger.debug("could not check for orphaned runs", exc_info=True)
            all_tags = {str(k): str(v) for k, v in (tags or {}).items()}
            all_tags.update(owner_tags())
            all_tags.update(code_version())
            if os.environ.get(ENV_STUDY_JOB):  # a `lungcal study` job: lets the study find this job's runs
                all_tags[TAG_STUDY_JOB] = os.environ[ENV_STUDY_JOB]
            if parent_run_id:
                all_tags[TAG_PARENT] = parent_run_id
                all_tags[MLFLOW_PARENT] = parent_run_id
            if run_id:  # resume: the same run goes back to RUNNING under this process
                run = self.client.get_run(run_id)
                self.client.update_run(run_id, status="RUNNING")
                self.client.log_batch(run_id, tags=[RunTag(_clean_key(k), v) for k, v in all_tags.items()])
            else:
                run = self.client.create_run(self.experiment_id, run_name=run_name, tags=all_tags)
        except TrackingError:
            raise
        except Exception as exc:  # noqa: BLE001 - any backend failure is a tracking error
            raise TrackingError(
                f"cannot open MLflow store {redact_uri(self.tracking_uri)!r}: {exc}",
                field="tracking_uri",
                fix="check the path is writable or the server reachable",
            ) from exc
        self.run_id: str = run.info.run_id
        self.parent_run_id = parent_run_id
        self.resumed = bool(run_id)
        self._closed = False

    # ------------------------------------------------------------------ setup
    def _get_or_create_experiment(self, name: str) -> str:
        """The experiment's id; a new one is tagged as model training with lungcal's saved runs-table view
        (:mod:`lungcal.tracking.runs_view`), and an existing one gets whichever of the two it lacks."""
        exp = self.client.get_experiment_by_name(name)
        if exp is not None:
            if exp.tags.get(MLFLOW_EXPERIMENT_KIND) is None:
                self.client.set_experiment_tag(exp.experiment_id, MLFLOW_EXPERIMENT_KIND, EXPERIMENT_KIND_TRAINING)
            ensure_runs_view(self.client, exp.experiment_id, name, exp.tags)
            return exp.experiment_id
        view_key, view = saved_view_tag(name)
        try:
            return self.client.create_experiment(name, artifact_location=artifact_root_for(self.tracking_uri),
                                                 tags={MLFLOW_EXPERIMENT_KIND: EXPERIMENT_KIND_TRAINING,
                                                       view_key: view})
        except Exception:  # another process created it meanwhile
            exp = self.client.get_experiment_by_name(name)
            if exp is None:
                raise
            return exp.experiment_id

    # ------------------------------------------------------------------ logging
    def set_tags(self, tags: Mapping[str, str]) -> None:
        """Set (or overwrite) string tags on the run."""
        items = [RunTag(_clean_key(k), str(v)) for k, v in tags.items()]
        if items:
            self.client.log_batch(self.run_id, tags=items)

    def log_params(self, config: Mapping) -> None:
        """Log a (nested) config as flattened, privacy-filtered params.

        Path-like values become ``path:<hash>``; values longer than MLflow's limit are truncated.
        Params are immutable in MLflow: logging the same key twice with a new value fails, so each
        key should be logged once per run.
        """
        flat = privacy_filter(flatten_config(config))
        items = [Param(_clean_key(k), v[:_MAX_PARAM_LEN]) for k, v in flat.items()]
        for i in range(0, len(items), _PARAM_BATCH):
            self.client.log_batch(self.run_id, params=items[i : i + _PARAM_BATCH])

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        """Log numeric metrics (non-numeric values are skipped; NaN is logged as NaN)."""
        ts = int(time.time() * 1000)
        items = []
        for k, v in metrics.items():
            try:
                val = float(v)
            except (TypeError, ValueError):
                continue
            items.append(Metric(_clean_key(k), val, ts, int(step or 0)))
        for i in range(0, len(items), _METRIC_BATCH):
            self.client.log_batch(self.run_id, metrics=items[i : i + _METRIC_BATCH])

    def log_report(self, split: str, report: Mapping) -> None:
        """Log a calibration report as ``{split}/{key}`` metrics; string entries become params."""
        numeric, text = {}, {}
        for k, v in report.items():
            if isinstance(v, bool) or not isinstance(v, (int, float)) and not hasattr(v, "__float__"):
                text[f"{split}/{k}"] = str(v)
            else:
                numeric[f"{split}/{k}"] = v
        self.log_metrics(numeric)
        if text:
            self.log_params(text)

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        """Upload one file (or a folder) into the run's artifacts."""
        p = Path(path)
        if p.is_dir():
            self.client.log_artifacts(self.run_id, str(p), artifact_path)
        else:
            self.client.log_artifact(self.run_id, str(p), artifact_path)

    def log_figure(self, fig, name: str) -> None:
        """Save a matplotlib figure as artifact ``name`` (e.g. ``plots/test_reliability.png``) and close it."""
        try:
            self.client.log_figure(self.run_id, fig, name)
        finally:
            plt.close(fig)

    def log_dict(self, data: Mapping, name: str) -> None:
        """Save a mapping as a JSON/YAML artifact named ``name``."""
        self.client.log_dict(self.run_id, json.loads(json.dumps(data, default=str)), name)

    def log_text(self, text: str, name: str) -> None:
        """Save a text artifact named ``name``."""
        self.client.log_text(self.run_id, text, name)

    def log_model(self, model: torch.nn.Module, name: str = "model", extra: Mapping | None = None) -> None:
        """Log ``{name}/state_dict.pt`` plus ``{name}/architecture.json`` (class, size, ``extra``).

        ``extra`` should hold what is needed to rebuild the module (constructor kwargs).
        """
        arch = {
            "class": f"{type(model).__module__}.{type(model).__qualname__}",
            "n_parameters": int(sum(p.numel() for p in model.parameters())),
            "repr": repr(model),
            **({"config": dict(extra)} if extra else {}),
        }
        with tempfile.TemporaryDirectory() as tmp:
            torch.save({k: v.detach().cpu() for k, v in model.state_dict().items()}, Path(tmp) / "state_dict.pt")
            (Path(tmp) / "architecture.json").write_text(json.dumps(arch, indent=2, default=str))
            self.client.log_artifacts(self.run_id, tmp, name)

    # ------------------------------------------------------------------ lifecycle
    @property
    def artifact_uri(self) -> str:
        """Where this run's artifacts live."""
        return self.client.get_run(self.run_id).info.artifact_uri

    def end(self, status: str = "FINISHED") -> None:
        """Terminate the run with ``status`` (FINISHED, FAILED or KILLED); idempotent."""
        if self._closed:
            return
        self.client.set_terminated(self.run_id, status)
        self._closed = True

    def __enter__(self) -> RunTracker:
        return self

    def __exit__(self, exc_type, exc, tb) -> Literal[False]:  # never swallows the exception
        if exc_type is None:
            status = "FINISHED"
        elif issubclass(exc_type, KeyboardInterrupt):
            status = "KILLED"
        else:
            status = "FAILED"
        try:
            self.end(status)
        except Exception:  # noqa: BLE001 - never mask the original error
            if exc_type is None:
                raise
            logger.exception("could not mark MLflow run %s as %s", self.run_id, status)
        return False

