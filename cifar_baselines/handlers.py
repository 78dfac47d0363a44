"""ignite handlers of the CIFAR ``train#handlers`` that talk to the run: MLflow epoch metrics, checkpoint.

Both read the experiment object (:class:`cifar_baselines.workflow.Stage1Run`) they are given: its
``tracker`` (the open :class:`lungcal.tracking.RunTracker`, set when ``run`` starts), ``settings``
and ``checkpoint_path()``. MONAI attaches handlers in list order, so put :class:`MLflowEpochLogger`
after the ``ValidationHandler``: it then logs that epoch's validation metrics too.

Under ``torchrun`` (``bundles/multi_gpu.json``) both act on rank 0 only (the metrics they read are
already the whole epoch's, gathered by ignite), and the checkpoint holds the bare network's weights.
"""
from __future__ import annotations

import torch
from ignite.engine import Engine, Events

from lungcal.paths import atomic_write
from lungcal.runtime.distributed import is_rank_zero, unwrap

__all__ = ["MLflowEpochLogger", "CheckpointWriter"]


class MLflowEpochLogger:
    """Logs, after every epoch, the trainer's metrics (``train/loss``, ``train/acc``), ``lr`` and the
    evaluator's metrics (``val/ece``, ``val/acc``, ...) to the run, at step ``epoch - 1``.

    Args:
        experiment: the object whose ``tracker`` is the open run.
        evaluator: the validation engine, or ``None``.
    """

    def __init__(self, experiment, evaluator: Engine | None = None) -> None:
        self.experiment, self.evaluator = experiment, evaluator

    def attach(self, engine: Engine) -> None:
        engine.add_event_handler(Events.EPOCH_COMPLETED, self)

    def __call__(self, engine: Engine) -> None:
        if not is_rank_zero():  # the run is rank 0's
            return
        metrics = dict(engine.state.metrics)
        metrics["lr"] = engine.optimizer.param_groups[0]["lr"]
        if self.evaluator is not None and self.evaluator.state.epoch == engine.state.epoch:
            metrics.update(self.evaluator.state.metrics)
        log = getattr(self.experiment, "epoch_log", None) or self.experiment.tracker.log_metrics
        log(metrics, engine.state.epoch - 1)


class CheckpointWriter:
    """Writes ``{state_dict, settings, run_id}`` to ``experiment.checkpoint_path()`` when training completes.

    The state dict is saved contiguous and on the CPU; the file is written atomically.
    """

    def __init__(self, experiment, network: torch.nn.Module) -> None:
        self.experiment, self.network = experiment, network

    def attach(self, engine: Engine) -> None:
        engine.add_event_handler(Events.COMPLETED, self)

    def __call__(self, engine: Engine) -> None:
        if not is_rank_zero():
            return
        state = {k: v.detach().cpu().contiguous() for k, v in unwrap(self.network).state_dict().items()}
        blob = {"state_dict": state, "settings": dict(self.experiment.settings),
                "run_id": self.experiment.tracker.run_id}
        with atomic_write(self.experiment.checkpoint_path()) as fh:
            torch.save(blob, fh)
