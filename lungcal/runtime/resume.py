"""Resume an interrupted training run from its last complete epoch, into the same MLflow run.

A training run (stage-1 CT or CIFAR, CIFAR LAS) is identified by :func:`run_identity`: a hash of
its resolved bundle config without ``run_name``, the output paths and ``resume`` itself. Its
resume state lives in ``<output_dir>/resume/<identity>/`` and is written by ignite's
:class:`~ignite.handlers.Checkpoint` after every epoch (the last handler of ``EPOCH_COMPLETED``,
so after validation, the best-model checkpoint and the MLflow epoch log), through
:class:`AtomicDiskSaver` (temporary file, fsync, ``os.replace``: a kill or a full disk leaves the
previous state, never half a file). It holds the model, optimizer, LR scheduler, the trainer's
epoch/iteration, any extra stateful object (best-so-far metric, grad scaler) and
:class:`RandomState`: the global torch/numpy/python RNGs and every ``torch.Generator`` of the data
loaders, samplers, datasets and iteration steps. The MLflow run id and the run's wall time
so far are stored with it (:class:`RunRecord`). :meth:`TrainingResume.load` restores it all with
:meth:`Checkpoint.load_objects`; the state is deleted once the whole run finished, so a rerun of a
finished bundle is a new run.

Metric points already in the run (an epoch logged before the kill, replayed after the resume)
are not logged twice (:class:`StepFilter`): the curve holds each step once.

Under ``torchrun`` (``bundles/multi_gpu.json``) rank 0 alone holds the identity's lock, clears,
writes and prunes the state; every rank loads the file rank 0 chose, so all continue alike.
"""
from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import random
import shutil
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from filelock import FileLock, Timeout
from ignite.engine import Events
from ignite.handlers import Checkpoint, DiskSaver
from mlflow.tracking import MlflowClient

from lungcal.errors import ConfigError, LungcalError
from lungcal.paths import atomic_write, default_output_dir
from lungcal.runtime.distributed import barrier, broadcast_object, is_rank_zero

__all__ = ["IDENTITY_EXCLUDE", "run_identity", "require_writable", "generators_of", "OutputError",
           "RandomState", "RunRecord", "StepFilter", "AtomicDiskSaver", "TrainingResume"]

logger = logging.getLogger(__name__)

#: config keys that do not change what a run computes: they are left out of its identity
IDENTITY_EXCLUDE = ("run_name", "output_dir", "tracking_uri", "resume", "output", "test_pictures", "_meta_", "_comment")
_PREFIX = "resume"
#: the run-identity locks this process holds (``<output_dir>/resume/<identity>.lock``)
_HELD: dict[str, FileLock] = {}


def claim_identity(directory: str | os.PathLike) -> None:
    """Hold the lock of one run identity for this process, or refuse in one line.

    Two processes training the same bundle with the same settings would share one resume state
    and one MLflow run; the second is refused until the first ends (an OS file lock: a killed
    process releases it). The same process may claim an identity again (a rerun after a failure).
    """
    key = f"{Path(directory)}.lock"
    if key in _HELD:
        return
    Path(key).parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(key)
    try:
        lock.acquire(timeout=0)
    except Timeout:
        raise ConfigError("this run (the same bundle with the same settings) is already running in another process",
                          file=key, field="resume",
                          fix="wait for it to finish, or change a setting or output_dir to start another run") from None
    _HELD[key] = lock


def release_identity(directory: str | os.PathLike) -> None:
    """Release the lock taken by :func:`claim_identity` (no-op when not held)."""
    lock = _HELD.pop(f"{Path(directory)}.lock", None)
    if lock is not None:
        lock.release()


class OutputError(LungcalError):
    """An output cannot be written (unwritable folder, full disk)."""


def run_identity(config: Mapping[str, Any], exclude: tuple[str, ...] = IDENTITY_EXCLUDE) -> str:
    """16 hex characters of the SHA-256 of ``config`` (sorted JSON) without the ``exclude`` keys."""
    cfg = {k: v for k, v in config.items() if k not in exclude}
    text = json.dumps(cfg, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def require_writable(output_dir: str | os.PathLike | None) -> Path:
    """Create ``output_dir`` (default: :func:`default_output_dir`) and prove a file can be written there.

    Called before any work starts, so an unwritable output folder fails in one line, not after
    the bags are built. Returns the folder.

    Raises:
        OutputError: the folder cannot be created or written.
    """
    out = Path(output_dir).expanduser().resolve() if output_dir else default_output_dir()
    fix = "pass --output_dir <a writable folder> (or set LUNGCAL_HOME)"
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as exc:
        raise OutputError(f"output folder is not writable ({exc.strerror or exc})", file=out, field="output_dir",
                          fix=fix) from exc
    return out


def generators_of(*objects: Any) -> dict[str, torch.Generator]:
    """Every ``torch.Generator`` held by ``objects`` (and by a loader's ``sampler`` / ``dataset``), by name.

    Names are ``"<position>.<attribute>"``, so the same bundle gives the same names in every run.
    """
    found: dict[str, torch.Generator] = {}
    seen: set[int] = set()
    for i, obj in enumerate(objects):
        stack = [(str(i), obj)]
        while stack:
            name, o = stack.pop(0)
            if o is None or id(o) in seen:
                continue
            seen.add(id(o))
            for attr, value in sorted(getattr(o, "__dict__", {}).items()):
                if isinstance(value, torch.Generator) and id(value) not in seen:
                    seen.add(id(value))
                    found[f"{name}.{attr}"] = value
                elif attr in ("sampler", "batch_sampler", "dataset"):
                    stack.append((f"{name}.{attr}", value))
    return found


class RandomState:
    """``state_dict`` / ``load_state_dict`` of the global RNGs (torch, numpy, python) and named generators.

    Stored as tensors and plain numbers, so the checkpoint loads with ``weights_only=True``.
    """

    def __init__(self, generators: Mapping[str, torch.Generator] | None = None) -> None:
        self.generators = dict(generators or {})

    def state_dict(self) -> dict[str, Any]:
        kind, keys, pos, has_gauss, gauss = np.random.get_state()
        version, py_state, py_gauss = random.getstate()
        return {"torch": torch.get_rng_state(),
                "numpy": {"keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)), "pos": int(pos),
                          "has_gauss": int(has_gauss), "gauss": float(gauss)},
                "python": {"version": int(version), "state": torch.tensor(py_state, dtype=torch.int64),
                           "gauss": py_gauss},
                "generators": {k: g.get_state() for k, g in self.generators.items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        torch.set_rng_state(state["torch"])
        n = state["numpy"]
        np.random.set_state(("MT19937", n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
        p = state["python"]
        random.setstate((p["version"], tuple(int(x) for x in p["state"].tolist()), p["gauss"]))
        missing = set(self.generators) ^ set(state["generators"])
        if missing:
            raise ConfigError(f"the resume state's random generators {sorted(missing)} do not match this bundle's",
                              field="resume", fix="rerun with --resume false")
        for k, g in self.generators.items():
            g.set_state(state["generators"][k])


class RunRecord:
    """The MLflow run id and the run's wall time so far, saved with the training state.

    :meth:`elapsed_s` is the wall time of every process that worked on the run: this one since the
    record was made, plus the earlier ones up to their last saved state (work a crash lost and this
    process redid counts once, the downtime between processes not at all). A state saved before
    the wall time was recorded loads as 0 s of earlier work.
    """

    def __init__(self, run_id: str | None = None) -> None:
        self.run_id = run_id
        self.prior_s = 0.0
        self._start = time.monotonic()

    def elapsed_s(self) -> float:
        """Wall seconds of this run across its processes (see the class)."""
        return self.prior_s + time.monotonic() - self._start

    def state_dict(self) -> dict[str, Any]:
        return {"run_id": self.run_id or "", "elapsed_s": float(self.elapsed_s())}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.run_id = state["run_id"] or None
        self.prior_s = float(state.get("elapsed_s", 0.0))


class StepFilter:
    """Wraps a ``log(metrics, step)``: a ``(metric, step)`` point already in the run is not logged again.

    Args:
        log: the sink (``RunTracker.log_metrics``).
        client, run_id: the MLflow client and run whose existing points are skipped (read once).
    """

    def __init__(self, log: Callable[[Mapping[str, float], int], None], client=None, run_id: str | None = None):
        self.log = log
        self.logged: dict[str, set[int]] = {}
        if client is not None and run_id:
            for key in client.get_run(run_id).data.metrics:
                self.logged[key] = {m.step for m in client.get_metric_history(run_id, key)}

    def __call__(self, metrics: Mapping[str, float], step: int) -> None:
        fresh = {k: v for k, v in metrics.items() if int(step) not in self.logged.get(k, ())}
        if fresh:
            self.log(fresh, step)


class AtomicDiskSaver(DiskSaver):
    """ignite's :class:`DiskSaver` writing through :func:`lungcal.paths.atomic_write` (fsync, then rename).

    An ``OSError`` (a full disk) becomes a one-line :class:`OutputError`; the previous file stays.
    """

    def __init__(self, dirname: str | os.PathLike) -> None:
        super().__init__(str(dirname), atomic=True, create_dir=True, require_empty=False)

    def _save_func(self, checkpoint: Mapping, path: Path, func: Callable) -> None:
        try:
            with atomic_write(path) as f:
                func(checkpoint, f, **self.kwargs)
        except OSError as exc:
            raise _write_error(exc, path) from exc


def _write_error(exc: OSError, path: str | os.PathLike) -> OutputError:
    what = "disk full" if exc.errno == errno.ENOSPC else (exc.strerror or str(exc))
    return OutputError(f"cannot write checkpoint ({what}); the previous checkpoint is kept", file=path,
                       fix="free disk space or pass --output_dir on another disk, then rerun (it resumes)")


class TrainingResume:
    """The resume state of one training run: where it is, what it holds, load / save / clear.

    Args:
        directory: ``<output_dir>/resume/<identity>``.
        objects: ``{name: stateful}`` to save and restore (model, optimizer, lr_scheduler, trainer,
            :class:`RandomState`, best-checkpoint handler, ...); a :class:`RunRecord` is added as ``run``.
        enabled: ``False`` (``--resume false``) deletes any existing state and starts afresh.
    """

    def __init__(self, directory: str | os.PathLike, objects: Mapping[str, Any], enabled: bool = True) -> None:
        self.dir = Path(directory)
        self.record = RunRecord()
        self.objects = {**{k: v for k, v in objects.items() if v is not None}, "run": self.record}
        self.enabled = bool(enabled)
        self.resumed_from = 0
        self.writer = is_rank_zero()  # under torchrun only rank 0 owns the state; the others read it
        if self.writer:
            claim_identity(self.dir)
            if not self.enabled:
                shutil.rmtree(self.dir, ignore_errors=True)
        barrier()
        # n_saved=None: ignite would delete the previous file *before* writing the next one (a kill
        # in between would leave no state); older states are pruned after the new one is complete
        self.handler = Checkpoint(self.objects, AtomicDiskSaver(self.dir), filename_prefix=_PREFIX, n_saved=None,
                                  global_step_transform=lambda engine, _: engine.state.epoch)

    def path(self) -> Path | None:
        """The newest complete state file, or ``None``."""
        if not self.dir.is_dir():
            return None
        files = [p for p in self.dir.glob(f"{_PREFIX}_checkpoint_*.pt") if not p.name.startswith(".")]
        return max(files, key=lambda p: int(p.stem.rsplit("_", 1)[-1]), default=None)

    def run_id(self, tracking_uri: str | None = None) -> str | None:
        """The MLflow run id of the state on disk (``None`` when there is none), without loading the rest.

        With ``tracking_uri``, a run that store does not hold (the store was deleted or another one
        is used) makes the state useless: it is deleted with a warning and the run starts afresh.
        """
        path = self.path() if self.enabled else None
        if path is None:
            return None
        run_id = torch.load(path, map_location="cpu", weights_only=True)["run"]["run_id"] or None
        if run_id and tracking_uri:
            try:
                MlflowClient(tracking_uri=tracking_uri).get_run(run_id)
            except Exception:  # noqa: BLE001 - unknown run (or unreadable store: the tracker reports that)
                logger.warning("resume state %s names MLflow run %s, which %s does not hold: starting afresh",
                               path, run_id, tracking_uri)
                if self.writer:
                    shutil.rmtree(self.dir, ignore_errors=True)  # the state goes; this run keeps its identity
                return None
        return run_id

    def load(self) -> int:
        """Restore every object from the newest state; returns the epoch resumed from (0: none)."""
        if self.writer:
            for stale in self.dir.glob(".*.tmp"):  # a write that a kill interrupted: never a state
                stale.unlink(missing_ok=True)
        path = broadcast_object(self.path() if self.enabled and self.writer else None)  # rank 0's choice
        if path is None:
            return 0
        ck = torch.load(path, map_location="cpu", weights_only=True)
        Checkpoint.load_objects(self.objects, ck)
        trainer = ck.get("trainer", {})  # ignite keeps the iteration count, not the epoch
        self.resumed_from = int(trainer["iteration"]) // max(1, int(trainer["epoch_length"])) if trainer else 0
        logger.info("resumed from epoch %d (%s)", self.resumed_from, path)
        return self.resumed_from

    def attach(self, trainer, run_id: str) -> None:
        """Save the state after every epoch (attach after every other handler); record ``run_id``.

        Under ``torchrun`` only rank 0 saves (the other ranks' models and optimizers are the same).
        """
        self.record.run_id = run_id
        if not self.writer:
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        trainer.add_event_handler(Events.EPOCH_COMPLETED, self.save)

    def save(self, engine) -> None:
        """Write this epoch's state, then delete the older ones."""
        self.handler(engine)
        newest = self.path()
        for old in self.dir.glob(f"{_PREFIX}_checkpoint_*.pt"):
            if old != newest:
                old.unlink(missing_ok=True)

    def clear(self) -> None:
        """Delete the state (the run finished) and release the run identity (rank 0's job)."""
        if self.writer:
            shutil.rmtree(self.dir, ignore_errors=True)
            release_identity(self.dir)
