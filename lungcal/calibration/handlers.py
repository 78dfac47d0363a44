"""ignite / MONAI glue: calibration metrics computed inside engines.

:class:`CalibrationMetrics` accumulates logits and labels over an epoch and, when the epoch
completes, writes ``ece``, ``acc``, ``auc`` and ``nll`` (optionally prefixed) into
``engine.state.metrics``. The value stored under the metric's own attached *name* is the one
picked by ``key`` (default ``"ece"``), a plain float, so it can serve as a MONAI
``key_val_metric``::

    evaluator = SupervisedEvaluator(
        ...,
        key_val_metric={"val_auc": CalibrationMetrics(n_bins=10, key="auc")},
        # key metric "higher is better" is MONAI's default; for ECE (lower is better) use
        # key="ece" and metric_cmp_fn=lambda current, best: current < best
    )
    # or as an extra: additional_metrics={"calib": CalibrationMetrics(n_bins=10)}

After an epoch ``engine.state.metrics`` then holds ``val_auc`` plus ``ece``, ``acc``, ``auc``,
``nll`` and ``n`` (the number of cases scored), with ``prefix`` prepended, e.g. ``prefix="val_"``
gives ``val_ece``...

Data-parallel (several processes, each scoring its own shard of the cases): ``compute`` gathers
every rank's logits and labels first, shards of any length, so the values are the whole split's
on every rank. Each case must sit in exactly one shard (MONAI's ``DistributedSampler`` with
``even_divisible=False``; torch's pads shards with repeated cases, which would be counted twice).
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import cast

import ignite.distributed as idist
import torch
import torch.nn.functional as F
from ignite.metrics import Metric
from ignite.metrics.metric import reinit__is_reduced

from . import measures as M

__all__ = ["CalibrationMetrics", "calibration_output_transform", "gather_shards"]

_KEYS = ("ece", "acc", "auc", "nll")


def _pick(d: Mapping, names: Sequence[str]):
    for n in names:
        if n in d:
            return d[n]
    raise KeyError(f"engine output has none of {names}; keys: {list(d)}")


def calibration_output_transform(output) -> tuple[torch.Tensor, torch.Tensor]:
    """Default ``output_transform``: ``(y_pred, y)`` from what ignite / MONAI engines emit.

    Accepts a ``(y_pred, y)`` pair, a dict with ``pred``/``label`` (MONAI ``CommonKeys``) or
    ``y_pred``/``y``, or a list of such per-sample dicts (MONAI's decollated batch output).
    """
    if isinstance(output, Mapping):
        return _pick(output, ("pred", "y_pred")), _pick(output, ("label", "y"))
    if isinstance(output, Sequence) and len(output) > 0 and isinstance(output[0], Mapping):
        preds = torch.stack([torch.as_tensor(_pick(o, ("pred", "y_pred"))) for o in output])
        labels = torch.stack([torch.as_tensor(_pick(o, ("label", "y"))) for o in output])
        return preds, labels
    if isinstance(output, Sequence) and len(output) == 2:
        return output[0], output[1]
    raise TypeError(f"cannot read (y_pred, y) from engine output of type {type(output).__name__}")


def _all_gather(tensor: torch.Tensor) -> torch.Tensor:
    # ignite types all_gather's result as a union of everything it accepts; a tensor in gives a tensor out
    return cast(torch.Tensor, idist.all_gather(tensor))


def gather_shards(tensor: torch.Tensor) -> torch.Tensor:
    """Every rank's ``tensor`` concatenated along dim 0 in rank order; shards may differ in length.

    ``ignite.distributed.all_gather`` needs equal shapes: each shard is padded to the longest one
    and the padding cut off again. A single process gets ``tensor`` back.
    """
    if idist.get_world_size() < 2:
        return tensor
    sizes = [int(n) for n in _all_gather(torch.tensor([tensor.shape[0]], device=tensor.device)).tolist()]
    longest = max(sizes)
    pad = tensor.new_zeros((longest - tensor.shape[0], *tensor.shape[1:]))
    every = _all_gather(torch.cat([tensor, pad]))
    return torch.cat([every[i * longest:i * longest + n] for i, n in enumerate(sizes)])


class CalibrationMetrics(Metric):
    """ECE, accuracy, AUC and NLL of an epoch, as an ignite ``Metric``.

    Each ``update`` receives ``(logits, labels)``: logits ``(B, C)`` (or ``(B,)`` / ``(B, 1)``, a
    single binary logit, read as ``[0, z]``), labels ``(B,)``, ``(B, 1)`` or one-hot ``(B, C)``.
    ``compute`` applies softmax and calls :mod:`lungcal.calibration.measures` on the whole epoch
    (equal-width ``(lo, hi]`` ECE, rank AUC). NLL is the cross-entropy of the logits.

    Args:
        n_bins: ECE bins (CIFAR 15, CT 10).
        mode: ``"top_label"`` or ``"positive_class"`` (binary tasks).
        key: which value is stored under the attached name (``"ece"``, ``"acc"``, ``"auc"`` or
            ``"nll"``); the others are stored under their own (prefixed) names.
        prefix: prepended to ``ece``/``acc``/``auc``/``nll`` in ``engine.state.metrics``.
        inputs: ``"logits"`` (default) or ``"probs"`` if the engine output already went
            through softmax (NLL is then ``-mean log p_y``).
        output_transform: maps the engine output to ``(y_pred, y)``; the default
            (:func:`calibration_output_transform`) reads pairs, MONAI dicts and decollated lists.
        device: where the accumulated tensors live (CPU by default).
    """

    def __init__(self, n_bins: int = 15, mode: str = "top_label", key: str = "ece", prefix: str = "",
                 inputs: str = "logits",
                 output_transform: Callable = calibration_output_transform,
                 device: str | torch.device = "cpu") -> None:
        if key not in _KEYS:
            raise ValueError(f"key must be one of {_KEYS}, got {key!r}")
        if inputs not in ("logits", "probs"):
            raise ValueError(f"inputs must be 'logits' or 'probs', got {inputs!r}")
        self.n_bins = int(n_bins)
        self.mode = mode
        self.key = key
        self.prefix = prefix
        self.inputs = inputs
        self._preds: list[torch.Tensor] = []
        self._labels: list[torch.Tensor] = []
        super().__init__(output_transform=output_transform, device=device)

    @reinit__is_reduced
    def reset(self) -> None:
        self._preds = []
        self._labels = []

    @reinit__is_reduced
    def update(self, output) -> None:
        y_pred, y = output
        y_pred = torch.as_tensor(y_pred).detach()
        y = torch.as_tensor(y).detach()
        if y_pred.ndim == 1 or (y_pred.ndim == 2 and y_pred.shape[1] == 1):
            z = y_pred.reshape(-1, 1).float()
            y_pred = torch.cat([torch.zeros_like(z), z], 1) if self.inputs == "logits" else torch.cat([1 - z, z], 1)
        if y.ndim == 2 and y.shape[1] == y_pred.shape[1] and y.shape[1] > 1:
            y = y.argmax(1)  # one-hot labels
        y = y.reshape(-1)
        if y.shape[0] != y_pred.shape[0]:
            raise ValueError(f"{y_pred.shape[0]} predictions but {y.shape[0]} labels")
        self._preds.append(y_pred.to(self._device, torch.float64))
        self._labels.append(y.to(self._device).long())

    def compute(self) -> dict[str, float]:
        if not self._preds:
            raise RuntimeError("CalibrationMetrics needs at least one update before compute()")
        z, y = gather_shards(torch.cat(self._preds)).cpu(), gather_shards(torch.cat(self._labels)).cpu()
        if self.inputs == "logits":
            probs = torch.softmax(z, 1)
            nll = float(F.cross_entropy(z, y))
        else:
            probs = z
            nll = M.nll(probs, y)
        out = {
            "ece": M.ece(probs, y, n_bins=self.n_bins, mode=self.mode),
            "acc": M.accuracy(probs, y),
            "auc": M.auroc(probs, y),
            "nll": nll,
            "n": int(y.shape[0]),
        }
        return {self.prefix + k: v for k, v in out.items()}

    def completed(self, engine, name: str) -> None:
        """Store every value under its (prefixed) name and ``key``'s value under ``name``."""
        result = self.compute()
        for k, v in result.items():
            engine.state.metrics[k] = v
        engine.state.metrics[name] = result[self.prefix + self.key]
