"""Ignite handlers of the stage-1 trainer (bundle ``train#handlers``): MLflow epoch logging and checkpoints.

Both are built by the bundle before the MLflow run exists; the stage-1 run step binds them to its
run (:meth:`EpochMetricsLogger.bind`, :meth:`AtomicCheckpoint.bind`) just before training.

Under ``torchrun`` (``bundles/multi_gpu.json``) both run on every rank, where the validation
metrics are the whole split's (gathered); only rank 0 writes files and logs, ``train/loss`` is the
mean over the ranks, and checkpoints hold the bare network's weights (no ``module.`` prefix).
"""
from __future__ import annotations

import errno
import logging
import math
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from ignite.engine import Events
from torch import nn

from lungcal.paths import atomic_write
from lungcal.runtime.distributed import is_rank_zero, mean_over_ranks, unwrap
from lungcal.runtime.resume import OutputError

__all__ = ["atomic_torch_save", "EpochMetricsLogger", "AtomicCheckpoint"]

logger = logging.getLogger(__name__)


def atomic_torch_save(obj: Any, path: str | os.PathLike) -> Path:
    """``torch.save`` through :func:`lungcal.paths.atomic_write` (never half a file).

    Raises:
        OutputError: the write failed (a full disk); ``path`` keeps its previous content.
    """
    try:
        with atomic_write(path) as f:
            torch.save(obj, f)
    except OSError as exc:
        raise OutputError(f"cannot write checkpoint ({'disk full' if exc.errno == errno.ENOSPC else exc.strerror})"
                          "; the previous checkpoint is kept", file=path,
                          fix="free disk space or pass --output_dir on another disk, then rerun (it resumes)") from exc
    return Path(path)


class EpochMetricsLogger:
    """Per-epoch ``train/loss``, ``train/lr`` and the evaluator's ``val/*`` metrics, sent to a ``log(metrics, step)``.

    Args:
        evaluator: the validation engine (its metrics are read after each validation).
        log: the sink, usually ``RunTracker.log_metrics``; set later with :meth:`bind`.
    """

    def __init__(self, evaluator, log: Callable[[Mapping[str, float], int], None] | None = None) -> None:
        self.evaluator = evaluator
        self.log = log
        self._losses: list[float] = []

    def bind(self, log: Callable[[Mapping[str, float], int], None]) -> None:
        self.log = log

    def _emit(self, metrics: Mapping[str, float], step: int) -> None:
        if self.log is not None:
            self.log(metrics, step)

    def _epoch_loss(self) -> float:
        # the validation runs inside the trainer's EPOCH_COMPLETED, possibly before the train line:
        # read the losses of the epoch directly
        return float(np.mean(self._losses)) if self._losses else float("nan")

    def attach(self, trainer) -> None:
        trainer.add_event_handler(Events.EPOCH_STARTED, self._reset)
        trainer.add_event_handler(Events.ITERATION_COMPLETED, self._loss)
        trainer.add_event_handler(Events.EPOCH_COMPLETED, self._train)
        self.evaluator.add_event_handler(Events.EPOCH_COMPLETED, self._val, trainer)

    def _reset(self, engine) -> None:
        self._losses = []

    def _loss(self, engine) -> None:
        self._losses.append(float(engine.state.output["loss"]))

    def _train(self, engine) -> None:
        lr = engine.optimizer.param_groups[0]["lr"]
        self._emit({"train/loss": mean_over_ranks(self._epoch_loss()), "train/lr": lr}, engine.state.epoch)

    def _val(self, engine, trainer) -> None:
        m = {f"val/{k[4:] if k.startswith('val_') else k}": v for k, v in engine.state.metrics.items()
             if isinstance(v, (int, float))}
        self._emit(m, trainer.state.epoch)
        loss = mean_over_ranks(self._epoch_loss())
        if trainer.state.epoch and is_rank_zero():  # one progress line per epoch (the only output while training)
            logger.info("epoch %d/%d  train loss %.4f  val AUC %.3f  ECE %.3f", trainer.state.epoch,
                        trainer.state.max_epochs, loss,
                        m.get("val/auc", float("nan")), m.get("val/ece", float("nan")))


class AtomicCheckpoint:
    """Keeps ``best.pt`` (highest ``metric_name`` on the evaluator) and ``last.pt`` (each epoch).

    A checkpoint is ``{"state_dict", "epoch", "metric", **extra}``; ``extra`` carries what is
    needed to rebuild the model (see :mod:`lungcal.ctapp.model.checkpoint`). Files are written
    atomically. The first epoch is always saved, then only strict improvements; a NaN metric (a
    one-class validation split) never wins later.

    Args:
        network: the trained network.
        evaluator: the validation engine whose ``metric_name`` picks the best epoch.
        metric_name: key of ``evaluator.state.metrics``.
        directory / extra: set now or by :meth:`bind`.
    """

    def __init__(self, network: nn.Module, evaluator, metric_name: str = "val_auc",
                 directory: str | os.PathLike | None = None, extra: Mapping[str, Any] | None = None) -> None:
        self.network = network
        self.evaluator = evaluator
        self.metric_name = metric_name
        self.dir = Path(directory) if directory is not None else None
        self.extra = dict(extra or {})
        self.best_metric = -math.inf
        self.best_epoch = 0

    def bind(self, directory: str | os.PathLike, extra: Mapping[str, Any] | None = None) -> None:
        """Set the run's checkpoint folder (and more ``extra``), and remove the temporary files of
        ``best.pt`` / ``last.pt`` writes that a killed earlier process of this run left there (never a
        checkpoint: :func:`atomic_torch_save` renames a write only once it is complete; one run identity
        runs in one process at a time, so no live write is touched)."""
        self.dir = Path(directory)
        self.extra.update(extra or {})
        if is_rank_zero() and self.dir.is_dir():
            for name in ("best.pt", "last.pt"):
                for stale in self.dir.glob(f".{name}.*.tmp"):
                    stale.unlink(missing_ok=True)

    @property
    def best_path(self) -> Path:
        return self._dir() / "best.pt"

    @property
    def last_path(self) -> Path:
        return self._dir() / "last.pt"

    def _dir(self) -> Path:
        if self.dir is None:
            raise RuntimeError("AtomicCheckpoint has no directory: call bind() before training")
        return self.dir

    def _payload(self, epoch: int, metric: float) -> dict:
        sd = {k: v.detach().cpu().clone() for k, v in unwrap(self.network).state_dict().items()}
        return {"state_dict": sd, "epoch": int(epoch), "metric": float(metric), **self.extra}

    def state_dict(self) -> dict[str, Any]:
        """The best-so-far metric and epoch (saved in the resume state)."""
        return {"best_metric": float(self.best_metric), "best_epoch": int(self.best_epoch)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.best_metric, self.best_epoch = float(state["best_metric"]), int(state["best_epoch"])

    def attach(self, trainer) -> None:
        self.evaluator.add_event_handler(Events.EPOCH_COMPLETED, self._on_val, trainer)
        trainer.add_event_handler(Events.EPOCH_COMPLETED, self._on_epoch)

    def _on_val(self, engine, trainer) -> None:
        value = float(engine.state.metrics.get(self.metric_name, float("nan")))
        if self.best_epoch == 0 or (not math.isnan(value) and value > self.best_metric):
            self.best_metric = value if not math.isnan(value) else -math.inf
            self.best_epoch = trainer.state.epoch
            if is_rank_zero():  # every rank tracks the best epoch (the metric is the same); rank 0 writes
                atomic_torch_save(self._payload(trainer.state.epoch, value), self.best_path)

    def _on_epoch(self, engine) -> None:
        if is_rank_zero():
            atomic_torch_save(self._payload(engine.state.epoch, self.best_metric), self.last_path)
