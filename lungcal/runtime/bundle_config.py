"""What a run records of the bundle that built it, handed over explicitly (no object looks for its config).

A MONAI bundle builds every object; Python gets what it needs from the bundle *by reference*:

- the named hyperparameters come as one ``settings`` section of ``"@key"`` references (their values
  after the command-line overrides); a run logs them as params and in ``config/resolved.json``, and
  its resume identity is a hash of them and of the specs below;
- a component that must be rebuilt later (the network of a stage-1 checkpoint, for LAS and inference)
  *describes itself*: :class:`Described` records the class and the arguments an object was built with,
  so :func:`spec_of` returns a ``_target_`` config that :func:`build_section` (MONAI's
  ``ConfigParser``) rebuilds. The lung masker and the candidate detector describe themselves the same
  way, by a ``config()`` dict.

Why not read the running bundle's config instead: under ``python -m monai.bundle run`` no object can
reach MONAI's ``ConfigParser`` but by walking the call stack, and a raw section handed over by a ``%``
macro is itself a ``_target_`` config, which MONAI instantiates a second time (``docs/architecture.md``).
"""
from __future__ import annotations

import copy
import functools
import inspect
import json
import pydoc
from collections.abc import Mapping
from typing import Any

import torch
from monai.bundle import ConfigParser

from lungcal.errors import ConfigError

__all__ = ["Described", "build", "spec_of", "build_section", "plain_settings"]


def _target(obj: Any) -> str:
    cls = obj if isinstance(obj, type) else type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


def _spec_value(value: Any, strict: bool, where: str) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_spec_value(v, strict, where) for v in value]
    if isinstance(value, Mapping):
        return {str(k): _spec_value(v, strict, where) for k, v in value.items()}
    return spec_of(value, strict=strict, where=where)


def spec_of(obj: Any, *, strict: bool = True, where: str = "network_def") -> dict[str, Any]:
    """The ``_target_`` config that rebuilds ``obj``: its ``config()`` when it has one (a :class:`Described`
    object, a lung masker, a detector), else, when ``strict`` is False, what can be said of it: its class and
    a torch optimizer's ``defaults``, or the plain constructor arguments it keeps under their own names
    (:func:`_readable_arguments`: a loss's, a data loader's).

    Raises:
        ConfigError: ``strict`` and ``obj`` cannot describe itself (it could not be rebuilt from a checkpoint).
    """
    built = getattr(obj, "__dict__", {}).get("_built_spec")
    if built is not None:
        return copy.deepcopy(built)
    config = getattr(obj, "config", None)
    if callable(config):
        return dict(config())
    if strict:
        raise ConfigError(f"{_target(obj)} cannot say how it was built, so a checkpoint could not rebuild it",
                          field=where, fix="build it through lungcal.runtime.bundle_config.build ({\"_target_\": "
                                           "\"lungcal.runtime.bundle_config.build\", \"target\": \"<its class or "
                                           "factory>\", ...its arguments}), or give the class a config() method")
    spec: dict[str, Any] = {"_target_": _target(obj)}
    defaults = getattr(obj, "defaults", None)  # torch optimizers
    if isinstance(defaults, Mapping):
        spec.update({k: _spec_value(v, False, where) for k, v in defaults.items() if k != "params"})
        return spec
    spec.update(_readable_arguments(obj))
    return spec


def _plain(value: Any) -> tuple[bool, Any]:
    """``(True, value)`` for a value a spec can hold as it is: a scalar, a short list of scalars, or a small
    tensor as that list; ``(False, None)`` otherwise (a dataset, a function, a generator)."""
    if isinstance(value, torch.Tensor):
        if value.numel() > _MAX_LIST:
            return False, None
        value = [float(f"{v:.7g}") if isinstance(v, float) else v for v in value.detach().cpu().reshape(-1).tolist()]
    if value is None or isinstance(value, (bool, int, float, str)):
        return True, value
    if isinstance(value, (list, tuple)) and len(value) <= _MAX_LIST and all(
            v is None or isinstance(v, (bool, int, float, str)) for v in value):
        return True, list(value)
    return False, None


#: the longest list (or tensor) a spec records as a constructor argument
_MAX_LIST = 64
#: arguments that are data, or that change how fast a loader runs but not what it yields
_NOT_RECORDED = frozenset({"dataset", "data", "data_source", "pin_memory", "pin_memory_device", "timeout",
                           "prefetch_factor", "persistent_workers", "multiprocessing_context"})


def _readable_arguments(obj: Any) -> dict[str, Any]:
    """The constructor arguments of ``obj`` that it keeps under the same name, where their values are plain
    (:func:`_plain`): what a loss (``gamma``, ``alpha``, ``reduction``, ``label_smoothing``) or a data loader
    (``batch_size``, ``drop_last``, ``num_workers``) was built with, so that a nested override of any of them
    (``--loss#gamma 3``, ``--train#dataloader#batch_size 8``) reaches the params, ``config/resolved.json`` and
    the resume identity."""
    params: dict[str, inspect.Parameter] = {}
    for cls in reversed(type(obj).__mro__[:-1]):  # a subclass's **kwargs reach its bases' arguments
        init = cls.__dict__.get("__init__")
        if init is None:
            continue
        try:
            params.update(inspect.signature(init).parameters)
        except (TypeError, ValueError):
            continue
    out: dict[str, Any] = {}
    for name, p in params.items():
        if name == "self" or name.startswith("_") or name in _NOT_RECORDED or p.kind in (
                inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
            continue
        if name not in getattr(obj, "__dict__", {}) and not isinstance(getattr(type(obj), name, None), property):
            if not (hasattr(obj, "_buffers") and name in obj._buffers):  # a module's buffer (FocalLoss.alpha)
                continue
        try:
            ok, value = _plain(getattr(obj, name))
        except Exception:  # a property that cannot be read in this state
            continue
        if ok:
            out[name] = value
    return out


class Described:
    """Mixin: an object that remembers how it was built, so ``config()`` can rebuild it.

    Every subclass's ``__init__`` is wrapped: the object records its class and the arguments of the
    outermost constructor call (defaults filled in); ``config()`` returns them as a ``_target_`` config,
    nested :class:`Described` arguments as their own configs. Recording touches no random state.
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        init = cls.__dict__.get("__init__")
        if init is None:
            return
        signature = inspect.signature(init)

        @functools.wraps(init)
        def wrapped(self, *args: Any, **kw: Any) -> None:
            init(self, *args, **kw)
            if type(self) is cls:  # the outermost constructor: the one the user called
                bound = signature.bind(self, *args, **kw)
                bound.apply_defaults()
                self.__dict__["_described_args"] = {k: v for k, v in list(bound.arguments.items())[1:]
                                                    if signature.parameters[k].kind not in
                                                    (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)}

        cls.__init__ = wrapped  # type: ignore[method-assign]

    def config(self) -> dict[str, Any]:
        """``{"_target_": "module.Class", **constructor arguments}`` (JSON-able; rebuild with :func:`build_section`)."""
        args = self.__dict__.get("_described_args", {})
        return {"_target_": _target(self), **{k: _spec_value(v, True, _target(self)) for k, v in args.items()}}


def build(target: str, **kwargs: Any) -> Any:
    """Build ``target(**kwargs)`` (a class or factory path, e.g. ``monai.networks.nets.resnet10``) and make the
    object describe itself, so that :func:`spec_of` can record how to rebuild it (a checkpoint's network with
    an encoder from another library). In a bundle::

        "encoder": {"_target_": "lungcal.runtime.bundle_config.build", "target": "monai.networks.nets.resnet10",
                    "spatial_dims": 3, "n_input_channels": 1, "num_classes": "@embed_dim"}
    """
    factory = pydoc.locate(target)
    if not callable(factory):
        raise ConfigError(f"cannot import {target!r}", field="target", fix="give an importable class or function path")
    obj = factory(**kwargs)
    spec = {"_target_": f"{__name__}.build", "target": target,
            **{k: _spec_value(v, True, target) for k, v in kwargs.items()}}
    try:
        obj.__dict__["_built_spec"] = spec
    except AttributeError:
        raise ConfigError(f"{target} builds a {type(obj).__name__}, which cannot carry its description",
                          field="target", fix="build an object (a module, a class instance)") from None
    return obj


def build_section(spec: Mapping[str, Any]) -> Any:
    """Instantiate a self-contained ``_target_`` config (from :func:`spec_of` or a stored checkpoint)."""
    return ConfigParser({"section": copy.deepcopy(dict(spec))}).get_parsed_content("section")


def plain_settings(settings: Mapping[str, Any]) -> dict[str, Any]:
    """``settings`` as plain JSON values (tuples to lists), checked: a bundle's ``settings`` section must hold
    values (``"@key"`` references to hyperparameters), never objects.

    Raises:
        ConfigError: a value is not JSON-able (an object was put into ``settings``).
    """
    out = {}
    for key, value in settings.items():
        try:
            out[str(key)] = json.loads(json.dumps(value))
        except (TypeError, ValueError):
            raise ConfigError(f"settings#{key} is a {type(value).__name__}, not a value", field=f"settings#{key}",
                              fix="settings lists hyperparameters (\"@key\" of a plain value); pass objects as "
                                  "their own arguments") from None
    return out
