"""Stage-1 checkpoints: what they hold, and the one way to load a stage-1 model (run id or file).

A checkpoint (``best.pt`` / ``last.pt``, written by :class:`lungcal.ctapp.model.handlers.AtomicCheckpoint`)
is ``{"state_dict", "epoch", "metric", "network_def", "bag_params", "method"}``:

- ``network_def``: the bundle's ``network_def`` config with its ``@`` references resolved, so any
  network the bundle defined (another encoder, another head) is rebuilt with MONAI's
  ``ConfigParser`` (:func:`lungcal.runtime.bundle_config.build_section`);
- ``bag_params``: JSON of the bag parameters (spacing, HU window, K, P), so LAS, inference and
  ``lungcal recalibrate`` build the same bags.

The weights are the bare network's: a checkpoint written from a ``DistributedDataParallel``
wrapper (``torchrun``) by an older version carries a ``module.`` prefix on every key, which
:func:`load_checkpoint` drops, so stage 2 and inference load either in one process.

A stage-1 run also logs which CTs made its checkpoint (:func:`selection_record`, artifact
``data/selection.json``): the pseudonyms of the train split that trained it and of the val split whose best
epoch (by the checkpoint handler's metric) chose it, so that a site's threshold is never certified on them.

Checkpoints written before the config bundles hold ``model_config`` (keyword arguments of
:func:`lungcal.mil.build_mil_model`) instead of ``network_def``; they still load.
"""
from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lungcal.errors import ConfigError
from lungcal.mil import build_mil_model
from lungcal.runtime import resolve_device
from lungcal.runtime.bundle_config import build_section
from lungcal.runtime.distributed import plain_state_dict
from lungcal.tracking import TAG_STAGE2, artifact_checkpoint, find_stage1_run

__all__ = ["CHECKPOINT_SUFFIXES", "selection_record", "load_checkpoint", "network_config", "build_network",
           "bag_params_of", "kernel_augment_of", "Stage1Model", "load_stage1"]

CHECKPOINT_SUFFIXES = (".pt", ".pth")


def selection_record(train_subjects: Iterable[str], val_subjects: Iterable[str], metric: str) -> dict[str, Any]:
    """Which CTs made a checkpoint: the pseudonyms (sorted, unique) of those that trained it (``train``) and of
    those whose ``metric`` chose its epoch (``val``); no other identifier."""
    return {"version": 1, "selected_by": f"the best {metric} over epochs on the val split",
            "train": sorted({str(s) for s in train_subjects}), "val": sorted({str(s) for s in val_subjects})}


def load_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """Load a stage-1 checkpoint (weights only, no pickled code), its weights' keys without ``module.``.

    Raises:
        ConfigError: missing file, or not a lungcal stage-1 checkpoint.
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError("checkpoint not found", file=path, field="checkpoint",
                          fix="pass a best.pt/last.pt written by a stage-1 bundle, or a stage-1 run id")
    ck = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(ck, dict) or "state_dict" not in ck or not ({"network_def", "model_config"} & set(ck)):
        raise ConfigError("not a lungcal stage-1 checkpoint (no state_dict and network_def/model_config)", file=path,
                          field="checkpoint", fix="use a checkpoint written by bundles/nlst_*.json")
    ck["state_dict"] = plain_state_dict(ck["state_dict"])  # no ``module.`` prefix (a DDP-wrapped network's)
    return ck


def network_config(ck: Mapping[str, Any]) -> dict[str, Any]:
    """What rebuilds the checkpoint's network: ``{"network_def": ...}`` or, for old ones, ``{"model_config": ...}``."""
    if ck.get("network_def"):
        return {"network_def": ck["network_def"]}
    return {"model_config": dict(ck["model_config"])}


def build_network(ck: Mapping[str, Any]) -> nn.Module:
    """A fresh (untrained) network of the checkpoint's architecture."""
    if ck.get("network_def"):
        return build_section(ck["network_def"])
    return build_mil_model(**dict(ck["model_config"]))


def bag_params_of(ck: Mapping[str, Any]) -> dict[str, Any]:
    """The checkpoint's bag parameters (stored as JSON text so that ``weights_only`` loading accepts them)."""
    raw = ck.get("bag_params") or {}
    return json.loads(raw) if isinstance(raw, str) else dict(raw)


def kernel_augment_of(ck: Mapping[str, Any]) -> list[float] | None:
    """The scanner-kernel augmentation the checkpoint's train bags were built with (None: off or
    an older checkpoint), so that LAS retrains the head on the same train bags."""
    raw = ck.get("kernel_augment_mm")
    value = json.loads(raw) if isinstance(raw, str) else raw
    return None if value is None else [float(v) for v in value]


@dataclass
class Stage1Model:
    """A loaded stage-1 model: network (eval mode, on ``device``), checkpoint dict, MLflow run (or None)."""

    network: nn.Module
    checkpoint: dict[str, Any]
    run: Any
    bag_params: dict[str, Any]

    @property
    def run_id(self) -> str | None:
        return self.run.info.run_id if self.run is not None else None

    def stage1_name(self, tag: str) -> str:
        """The stage-1 method: the run's ``tag`` value, else the checkpoint's ``method``."""
        if self.run is not None:
            return self.run.data.tags.get(tag, "unknown")
        return str(self.checkpoint.get("method", "checkpoint"))


def load_stage1(model: str | os.PathLike | None, tracking_uri: str, *, checkpoint: str | os.PathLike | None = None,
                device: str | torch.device | None = "cpu", field: str = "stage1_run_id") -> Stage1Model:
    """Load a stage-1 model from a checkpoint file, an MLflow run id, or the latest finished stage-1 run.

    Args:
        model: a run id, a checkpoint path (``.pt``/``.pth`` or an existing file), or ``None``.
        tracking_uri: the MLflow store that holds the run.
        checkpoint: a checkpoint path; wins over ``model``.
        device: where the network goes (``"auto"`` picks CUDA when available).
        field: the setting named in errors (``stage1_run_id`` in bundles, ``--model`` in the CLI).

    Raises:
        ConfigError: not a checkpoint, unknown run, a stage-2 run, or no ``checkpoint/best.pt`` artifact.
    """
    run = None
    path = Path(str(checkpoint or model)).expanduser() if (checkpoint or model) else None
    if path is not None and (checkpoint or path.suffix in CHECKPOINT_SUFFIXES or path.exists()):
        ck = load_checkpoint(path)
    else:
        run = find_stage1_run(tracking_uri, str(model) if model else None)
        stage2 = run.data.tags.get(TAG_STAGE2, "none")
        if stage2 not in ("none", ""):
            raise ConfigError(f"run {run.info.run_id} is a stage-2 ({stage2}) run", field=field,
                              fix="pass the stage-1 run (its lungcal.parent_run tag names it)")
        ck = load_checkpoint(artifact_checkpoint(tracking_uri, run))
    net = build_network(ck)
    net.load_state_dict(ck["state_dict"])
    net.to(resolve_device(device)).eval()
    return Stage1Model(net, ck, run, bag_params_of(ck))
