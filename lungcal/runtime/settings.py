"""Switches are parsed once, here, where the settings enter; everything downstream gets bools.

A bundle's switches (``amp``, ``resume``, ``augment``, ...) arrive as JSON values from the file, or, from
``python -m monai.bundle run --amp false``, as whatever Python Fire made of the text: ``"false"`` stays a
string (and ``bool("false")`` is True), ``False`` is a bool, ``0`` an int. A command-line flag of
``lungcal ...`` arrives as text. Each is converted in one place:

- a bundle's ``settings`` section: :func:`typed_settings`, once, as ``run_settings``
  (``"$lungcal.runtime.settings.typed_settings(@settings)"``); every object that takes a switch gets it from
  there (``"amp": "$@run_settings['amp']"``), and the run's params, ``config/resolved.json`` and resume identity
  hold the parsed value (``--amp false``, ``--amp False`` and ``--amp 0`` are the same run);
- a run built from its own arguments (``LASRun``, ``InferenceRun``: bundles with no ``settings`` section):
  :func:`typed_arguments` on its constructor, each ``bool`` argument by its annotation;
- a ``lungcal`` command-line flag: ``type=switch`` in argparse.

A value no spelling accepts (``--amp maybe``) stops in one line that names the key and the accepted values.
"""
from __future__ import annotations

import argparse
import functools
import inspect
from collections.abc import Callable, Mapping
from typing import Any, ParamSpec, TypeVar

from lungcal.errors import ConfigError
from lungcal.runtime.bundle_config import plain_settings

__all__ = ["SWITCHES", "TRUE_SPELLINGS", "FALSE_SPELLINGS", "Settings", "parse_switch", "typed_settings",
           "typed_arguments", "switch"]

#: the bundles' switch keys: a ``settings`` entry of one of these names is parsed by :func:`parse_switch`
SWITCHES = frozenset({"amp", "resume", "augment", "tta_flips", "freeze_encoder", "stream_bags", "download",
                      "channels_last", "shift_bn", "balanced_sampling", "pictures", "cpu_amp", "isotropic"})
#: text spellings of a switch (any case, surrounding blanks ignored); JSON/Python bools and the numbers 0 and 1
#: are accepted as they are
TRUE_SPELLINGS = ("true", "1", "yes", "on")
FALSE_SPELLINGS = ("false", "0", "no", "off", "none", "null", "")
_ACCEPTED = "true or false (or 1/0, yes/no, on/off)"

P = ParamSpec("P")
R = TypeVar("R")


def parse_switch(value: Any, key: str) -> bool:
    """``value`` as a bool: a bool, ``None`` (false), the number 0 or 1, or one of the text spellings.

    Raises:
        ConfigError: anything else; the message names ``key`` and the accepted values.
    """
    if isinstance(value, bool):
        return value
    if value is None:
        return False
    if isinstance(value, (int, float)) and value in (0, 1):
        return bool(value)
    if isinstance(value, str):
        text = value.strip().lower()
        if text in TRUE_SPELLINGS:
            return True
        if text in FALSE_SPELLINGS:
            return False
    raise ConfigError(f"{key} must be {_ACCEPTED}, got {value!r}", field=key, fix=f"--{key} false")


class Settings(dict):
    """A bundle's ``settings`` after :func:`typed_settings`: plain JSON values, the switches as bools."""


def typed_settings(settings: Mapping[str, Any]) -> Settings:
    """``settings`` as plain JSON values (:func:`~lungcal.runtime.bundle_config.plain_settings`) with every key of
    :data:`SWITCHES` parsed by :func:`parse_switch`. Settings already typed are returned as they are.

    Raises:
        ConfigError: a switch no spelling accepts, or a value that is not JSON.
    """
    if isinstance(settings, Settings):
        return settings
    plain = plain_settings(settings)
    return Settings({k: parse_switch(v, k) if k in SWITCHES else v for k, v in plain.items()})


def _bool_parameters(fn: Callable[..., Any]) -> tuple[inspect.Signature, list[str]]:
    signature = inspect.signature(fn)  # annotations as written (``from __future__ import annotations``: text)
    return signature, [name for name, p in signature.parameters.items() if p.annotation in (bool, "bool")]


def typed_arguments(fn: Callable[P, R]) -> Callable[P, R]:
    """Wrap a run's constructor (or any function a bundle calls): each argument annotated ``bool`` is parsed by
    :func:`parse_switch` under its own name before ``fn`` runs, so its body sees bools only."""
    signature, switches = _bool_parameters(fn)

    @functools.wraps(fn)
    def wrapped(*args: P.args, **kwargs: P.kwargs) -> R:
        bound = signature.bind(*args, **kwargs)
        for name in switches:
            if name in bound.arguments:
                bound.arguments[name] = parse_switch(bound.arguments[name], name)
        return fn(*bound.args, **bound.kwargs)

    return wrapped


def switch(text: str) -> bool:
    """argparse ``type=`` of a switch flag (``--pictures false``).

    Raises:
        argparse.ArgumentTypeError: not a switch spelling (argparse prints it with the flag's name).
    """
    try:
        return parse_switch(text, "value")
    except ConfigError:
        raise argparse.ArgumentTypeError(f"{text!r}: a switch must be {_ACCEPTED}") from None
