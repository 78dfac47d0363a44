"""The swappable detector: what a nodule-candidate detector must provide, how the bag cache keys it
and how a stage-1 checkpoint rebuilds it.

A detector plugged into a CT bundle's ``detector`` section (or passed to
:class:`~lungcal.ctapp.data.cohort.CTCohort`) satisfies :class:`KeyedDetector`::

    class KeyedDetector(Protocol):
        def detect(self, image, lung_mask, spacing, affine) -> Candidates: ...
        def config(self) -> dict: ...

- ``detect`` is called once per CT by the bag builder (:func:`lungcal.candidates.cache.compute_bag`)
  with the preprocessed volume ``(1, X, Y, Z)`` in ``[0, 1]`` (HU window applied), the lung mask
  of the same shape, the voxel size in mm per axis and the 4x4 voxel-to-world affine, and returns
  :class:`~lungcal.candidates.detector.Candidates` sorted by decreasing score (the bag keeps the
  first K). It must be deterministic: a bag is cached and never recomputed. The builder makes the
  detector from its config once per CT (in worker processes too): keep the constructor cheap
  (e.g. load learned weights on the first ``detect`` and keep them in a module-level cache).
- ``config()`` returns a JSON-able dict: ``"_target_"``, the importable class path
  (``"my_site.detectors.RetinaNetDetector"``; filled in from the class when left out), and the
  keyword arguments that rebuild an equal detector with ``cls(**kwargs)`` (checked when the detector
  is plugged in: the rebuilt one must give the same config and the same plain public attributes). It goes into the bag
  cache key (two detectors never share a bag) and into the bag parameters a stage-1 checkpoint
  stores, so LAS, ``lungcal predict``, ``bundles/inference.json`` and ``lungcal recalibrate``
  rebuild the same detector; the class must therefore be importable wherever those run. Put into
  it everything that changes the candidates, including a version or a digest of learned weights:
  the cache also hashes the code of ``lungcal.ct`` and ``lungcal.candidates``, never that of a
  plugged-in detector.

The built-in :class:`~lungcal.candidates.detector.LoGBlobDetector` needs no ``config()`` method:
its config is its dataclass fields, and it keeps the key it always had (``{"class":
"LoGBlobDetector", **fields}``), so the default pipeline's cache entries, checkpoints and results
do not change; its bag parameters store only its non-default settings, without ``_target_``, as
before. A subclass of it is another detector: it needs its own ``config()``.
"""
from __future__ import annotations

import dataclasses
import importlib
import json
from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import numpy as np

from lungcal.candidates.detector import Candidates, LoGBlobDetector
from lungcal.ct.masking import Spacing
from lungcal.errors import ConfigError

__all__ = ["KeyedDetector", "LOG_TARGET", "detector_config", "detector_from_config", "detector_key",
           "detector_bag_params"]

LOG_TARGET = f"{LoGBlobDetector.__module__}.{LoGBlobDetector.__qualname__}"
_FIX = ("give it detect(image, lung_mask, spacing, affine) -> Candidates and config() -> "
        "{'_target_': '<module>.<Class>', **the arguments that rebuild it} (lungcal/candidates/detector_config.py), "
        "or use lungcal.candidates.detector.LoGBlobDetector")


@runtime_checkable
class KeyedDetector(Protocol):
    """A detector the bag cache can key and a checkpoint can rebuild (see the module docstring)."""

    def detect(self, image, lung_mask, spacing: Spacing, affine) -> Candidates:  # pragma: no cover
        ...

    def config(self) -> dict[str, Any]:  # pragma: no cover
        ...


def detector_config(detector: Any) -> dict[str, Any]:
    """The config of a detector object: ``{"_target_": class path, **its arguments}``, JSON-able.

    Raises:
        ConfigError: naming the field ``detector``, when it has no ``detect()``/``config()``, its config
            is not JSON, or its config does not rebuild it (``cls(**kwargs)`` must give the same config).
    """
    cfg = _config_of(detector)
    if cfg["_target_"] == LOG_TARGET:
        return cfg
    rebuilt = detector_from_config(cfg, field="detector")
    again, back = _config_of(rebuilt), _settings(rebuilt)
    lost = sorted(k for k, v in _settings(detector).items() if back.get(k) != v)
    if again != cfg or lost:
        why = f"has the config {again}" if again != cfg else f"differs in {lost}"
        raise ConfigError(f"the detector {type(detector).__name__} is not rebuilt by its config(): "
                          f"{cfg['_target_']}(**config) {why}", field="detector",
                          fix="make config() return '_target_' (its class path) and every constructor argument")
    return cfg


def _settings(obj: Any) -> dict[str, Any]:
    """The plain public attributes of an object (numbers, strings, lists): what a rebuild must give back."""
    plain = (str, int, float, bool, type(None), list, tuple)
    return {k: _plain(v) for k, v in vars(obj).items() if not k.startswith("_") and isinstance(v, plain)} \
        if hasattr(obj, "__dict__") else {}


def _config_of(detector: Any) -> dict[str, Any]:
    name = type(detector).__name__
    if type(detector) is LoGBlobDetector:
        return {"_target_": LOG_TARGET, **_plain(dataclasses.asdict(detector))}
    missing = [m for m in ("detect", "config") if not callable(getattr(detector, m, None))]
    if missing:
        raise ConfigError(f"the detector {name} has no {' and no '.join(f'{m}()' for m in missing)}, so the bag cache "
                          "cannot key it nor a checkpoint rebuild it", field="detector", fix=_FIX)
    cfg = detector.config()
    if not isinstance(cfg, Mapping):
        raise ConfigError(f"the detector {name}'s config() returned a {type(cfg).__name__}, not a dict",
                          field="detector", fix=_FIX)
    cfg = _plain({"_target_": f"{type(detector).__module__}.{type(detector).__qualname__}", **dict(cfg)})
    try:
        json.dumps(cfg)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"the detector {name}'s config() is not JSON ({e})", field="detector",
                          fix="return plain numbers, strings, lists and dicts (a path, not a model)") from e
    return cfg


def detector_bag_params(detector: Any) -> dict[str, Any] | None:
    """What a detector adds to the bag parameters (``BagParams.detector``): ``None`` for the default
    :class:`LoGBlobDetector` (or no detector), its non-``_target_`` settings for another
    LoGBlobDetector (as before the detector could be swapped), else its whole :func:`detector_config`."""
    if detector is None:
        return None
    cfg = detector_config(detector)
    if cfg["_target_"] != LOG_TARGET:
        return cfg
    kwargs = {k: v for k, v in cfg.items() if k != "_target_"}
    return None if kwargs == _plain(dataclasses.asdict(LoGBlobDetector())) else kwargs


def _resolve(target: Any, field: str) -> type:
    if not isinstance(target, str) or "." not in target:
        raise ConfigError(f"detector _target_ {target!r} is not a class path", field=field,
                          fix="use '<module>.<Class>', e.g. lungcal.candidates.detector.LoGBlobDetector")
    module, _, name = target.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"cannot import the detector {target!r} ({type(e).__name__}: {e})", field=field,
                          fix="install the package that defines it where the bags are built (training, "
                              "inference, recalibration), or use a detector defined at module level") from e
    if not isinstance(cls, type):
        raise ConfigError(f"detector _target_ {target!r} is not a class", field=field, fix=_FIX)
    return cls


def _split(cfg: Mapping[str, Any], field: str) -> tuple[type, dict[str, Any]]:
    """The class and the keyword arguments of a stored config (no ``_target_``: LoGBlobDetector's arguments)."""
    kwargs = {k: v for k, v in dict(cfg).items() if k != "_target_"}
    return _resolve(cfg.get("_target_", LOG_TARGET), field), kwargs


def detector_from_config(cfg: Mapping[str, Any] | None, field: str = "bag_params.detector") -> Any:
    """The detector a config (or a checkpoint's ``bag_params["detector"]``) describes: a mapping with
    ``_target_`` is that class's arguments, one without is :class:`LoGBlobDetector`'s (``None``/empty:
    the default detector)."""
    cls, kwargs = _split(cfg or {}, field)
    try:
        detector = cls(**kwargs)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"bad detector settings for {cls.__name__}: {e}", field=field,
                          fix=f"see {cls.__module__}.{cls.__qualname__} for valid keys") from e
    if not callable(getattr(detector, "detect", None)):
        raise ConfigError(f"{cls.__name__} has no detect()", field=field, fix=_FIX)
    return detector


def detector_key(cfg: Mapping[str, Any] | None) -> dict[str, Any]:
    """The detector's part of the bag cache key. For :class:`LoGBlobDetector` it is what it always was,
    ``{"class": "LoGBlobDetector", **every field}`` (defaults filled in); for another detector its
    config, ``{"_target_": class path, **arguments}`` (the class must import)."""
    cls, kwargs = _split(cfg or {}, "bag_params.detector")
    if cls is LoGBlobDetector:
        det = detector_from_config(kwargs)
        return {"class": "LoGBlobDetector", **_plain(dataclasses.asdict(det))}
    return _plain({"_target_": f"{cls.__module__}.{cls.__qualname__}", **kwargs})


def _plain(v: Any) -> Any:
    """JSON shapes: tuples and arrays as lists, numpy scalars as Python numbers."""
    if isinstance(v, Mapping):
        return {str(k): _plain(x) for k, x in v.items()}
    if isinstance(v, (tuple, list, np.ndarray)):
        return [_plain(x) for x in v]
    if isinstance(v, (np.floating, np.integer, np.bool_)):
        return v.item()
    return v
