"""ignite handlers of the CIFAR ``train#handlers`` that talk to the run: MLflow epoch metrics, checkpoint.

Each reads the bundle's ``workflow`` (:class:`cifar_baselines.stages.Stage1Run`) it is given: its
``tracker`` (the open :class:`lungcal.tracking.RunTracker`, set when ``run`` opens it), ``epoch_log``,
``settings``, ``data`` and ``checkpoint_path()`` / ``selection_path()``. MONAI attaches handlers in list
order, so put :class:`MLflowEpochLogger` after the ``ValidationHandler``: it then logs that epoch's
validation metrics too.

Under ``torchrun`` (``bundles/multi_gpu.json``) both act on rank 0 only (the metrics they read are
already the whole epoch's, gathered by ignite), and the checkpoint holds the bare network's weights.
"""
from __future__ import annotations

from pathlib import Path

import torch
from ignite.engine import Engine, Events

from cifar_baselines.steps import predict
from lungcal.calibration.metrics import accuracy, ece
from lungcal.paths import atomic_write
from lungcal.runtime.distributed import is_rank_zero, unwrap

__all__ = ["MLflowEpochLogger", "CheckpointWriter", "EpochSelection", "SELECTIONS"]

#: the epochs a stage-1 run keeps besides its last: ``best_val`` (highest validation accuracy, ours) and
#: ``best_test`` (highest test accuracy: MiSLAS's convention of reporting, never our result)
SELECTIONS = ("best_val", "best_test")


class MLflowEpochLogger:
    """Logs, after every epoch, the trainer's metrics (``train/loss``, ``train/acc``), ``lr`` and the
    evaluator's metrics (``val/ece``, ``val/acc``, ...) to the run, at step ``epoch - 1``.

    Args:
        workflow: the run whose ``tracker`` is open (its ``epoch_log`` when bound).
        evaluator: the validation engine, or ``None``.
    """

    def __init__(self, workflow, evaluator: Engine | None = None) -> None:
        self.workflow, self.evaluator = workflow, evaluator

    def attach(self, engine: Engine) -> None:
        engine.add_event_handler(Events.EPOCH_COMPLETED, self)

    def __call__(self, engine: Engine) -> None:
        if not is_rank_zero():  # the run is rank 0's
            return
        metrics = dict(engine.state.metrics)
        metrics["lr"] = engine.optimizer.param_groups[0]["lr"]  # type: ignore[attr-defined]  # a MONAI trainer
        if self.evaluator is not None and self.evaluator.state.epoch == engine.state.epoch:
            metrics.update(self.evaluator.state.metrics)
        log = getattr(self.workflow, "epoch_log", None) or self.workflow.tracker.log_metrics
        log(metrics, engine.state.epoch - 1)


class CheckpointWriter:
    """Writes ``{state_dict, settings, run_id}`` to ``workflow.checkpoint_path()`` when training completes.

    The state dict is saved contiguous and on the CPU; the file is written atomically.
    """

    def __init__(self, workflow, network: torch.nn.Module) -> None:
        self.workflow, self.network = workflow, network

    def attach(self, engine: Engine) -> None:
        engine.add_event_handler(Events.COMPLETED, self)

    def __call__(self, engine: Engine) -> None:
        if not is_rank_zero():
            return
        state = {k: v.detach().cpu().contiguous() for k, v in unwrap(self.network).state_dict().items()}
        blob = {"state_dict": state, "settings": dict(self.workflow.settings),
                "run_id": self.workflow.tracker.run_id}
        with atomic_write(self.workflow.checkpoint_path()) as fh:
            torch.save(blob, fh)


class EpochSelection:
    """Scores the test split after every epoch and keeps the weights of the best-validation and the best-test epoch.

    Logs ``epoch_test/acc`` and ``epoch_test/ece`` (float32, no augmentation) at step ``epoch - 1``, so the
    test curve sits beside the validation curve in MLflow. It keeps two weight files beside the checkpoint
    (``workflow.selection_path(kind)`` for ``kind`` in :data:`SELECTIONS`): the epoch of the highest
    validation accuracy (``best_val``, a model selection that never looks at test), and the epoch of the
    highest test accuracy (``best_test``: MiSLAS reports that epoch; a report labels it as MiSLAS's convention,
    since choosing on test flatters the number). Ties keep the earlier epoch. A resumed run reads the files
    back, so the choice spans every epoch. Scoring never touches an RNG, so training is unchanged by it.

    Put it after the ``ValidationHandler`` (it reads that epoch's ``val/acc``). Rank 0 alone scores.
    """

    def __init__(self, workflow, network: torch.nn.Module, evaluator: Engine, n_bins: int = 15) -> None:
        self.workflow, self.network, self.evaluator, self.n_bins = workflow, network, evaluator, int(n_bins)
        self.best: dict[str, tuple[float, int]] | None = None

    def attach(self, engine: Engine) -> None:
        engine.add_event_handler(Events.EPOCH_COMPLETED, self)

    def _load_best(self) -> dict[str, tuple[float, int]]:
        best = {}
        for kind in SELECTIONS:
            path = Path(self.workflow.selection_path(kind))
            if path.is_file():
                blob = torch.load(path, map_location="cpu", weights_only=True)
                best[kind] = (float(blob["score"]), int(blob["epoch"]))
        return best

    def __call__(self, engine: Engine) -> None:
        if not is_rank_zero():
            return
        if self.best is None:
            self.best = self._load_best()
        epoch, module = engine.state.epoch, unwrap(self.network)
        x, y = self.workflow.data.test_x, self.workflow.data.test_y.cpu()
        p = torch.softmax(predict(module, x, channels_last=self.workflow.channels_last).double(), 1).numpy()
        test_acc = accuracy(p, y.numpy())
        metrics = {"epoch_test/acc": test_acc, "epoch_test/ece": ece(p, y.numpy(), n_bins=self.n_bins)}
        log = getattr(self.workflow, "epoch_log", None) or self.workflow.tracker.log_metrics
        log(metrics, epoch - 1)
        scores = {"best_test": test_acc}
        if self.evaluator.state.epoch == epoch and "val/acc" in self.evaluator.state.metrics:
            scores["best_val"] = float(self.evaluator.state.metrics["val/acc"])
        for kind, score in scores.items():
            if kind not in self.best or score > self.best[kind][0]:
                self.best[kind] = (score, epoch)
                state = {k: v.detach().cpu().contiguous() for k, v in module.state_dict().items()}
                with atomic_write(self.workflow.selection_path(kind)) as fh:
                    torch.save({"state_dict": state, "epoch": epoch, "score": score}, fh)
