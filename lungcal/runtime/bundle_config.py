"""The raw config of the MONAI bundle being run, for the objects that must record it.

A MONAI config object never sees the config that built it, yet the stage-1 run logs its config as
MLflow params and artifact, and its checkpoint must say how to rebuild ``network_def`` (MONAI's own
``ckpt_export`` re-parses the bundle for that). Every object of a bundle is built inside
:meth:`monai.bundle.ConfigParser.get_parsed_content`, so :func:`active_config` finds that parser on
the call stack and returns its config: macros expanded and command-line overrides applied, ``@``
references not yet resolved. Outside a bundle (plain Python) it returns ``{}`` and callers pass
what they need explicitly.

:func:`resolved_section` turns one section (``network_def``) into a self-contained config: each
``"@id"`` value becomes the referenced item's parsed value, so ``ConfigParser({"net": spec})``
rebuilds it without the bundle (:func:`build_section`).
"""
from __future__ import annotations

import copy
import inspect
import json
import re
from collections.abc import Mapping
from typing import Any

from monai.bundle import ConfigParser

__all__ = ["active_parser", "active_config", "resolved_section", "build_section", "hyperparameters",
           "unused_keys"]

_REF = "@"


def active_parser() -> ConfigParser | None:
    """The :class:`ConfigParser` that is building the current object, or ``None``."""
    frame = inspect.currentframe()
    try:
        while frame is not None:
            candidate = frame.f_locals.get("self")
            if isinstance(candidate, ConfigParser):
                return candidate
            frame = frame.f_back
    finally:
        del frame
    return None


def active_config() -> dict[str, Any]:
    """A deep copy of the running bundle's config (``{}`` outside a bundle), without ``_meta_``."""
    parser = active_parser()
    if parser is None:
        return {}
    return {k: copy.deepcopy(v) for k, v in parser.get().items() if k != "_meta_"}


def _jsonable(value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


def resolved_section(section: str, parser: ConfigParser | None = None) -> dict[str, Any] | None:
    """The raw config of ``section`` with every whole-string ``"@id"`` replaced by its parsed value.

    Returns ``None`` outside a bundle. A reference to an object (not JSON-able) is kept as it is.
    """
    parser = parser or active_parser()
    if parser is None or section not in parser:
        return None

    def walk(node: Any) -> Any:
        if isinstance(node, dict):
            return {k: walk(v) for k, v in node.items()}
        if isinstance(node, list):
            return [walk(v) for v in node]
        if isinstance(node, str) and node.startswith(_REF) and " " not in node:
            value = parser.get_parsed_content(node[len(_REF):])
            return value if _jsonable(value) else node
        return node

    return walk(copy.deepcopy(parser[section]))


def build_section(spec: Mapping[str, Any]) -> Any:
    """Instantiate a self-contained ``_target_`` config (from :func:`resolved_section`)."""
    return ConfigParser({"section": copy.deepcopy(dict(spec))}).get_parsed_content("section")


def hyperparameters(config: Mapping[str, Any]) -> dict[str, Any]:
    """The named top-level hyperparameters of a bundle config: plain values, not objects or expressions."""

    def plain(v: Any) -> bool:
        if isinstance(v, str):
            return not v.startswith(("$", "@", "%"))
        if isinstance(v, dict):
            return "_target_" not in v and all(plain(x) for x in v.values())
        if isinstance(v, list):
            return all(plain(x) for x in v)
        return True

    return {k: v for k, v in config.items() if not k.startswith("_") and k != "imports" and plain(v)}


def unused_keys(config: Mapping[str, Any]) -> list[str]:
    """Top-level hyperparameters that no object of the bundle refers to (``@key``): a stale or mistyped setting.

    A command-line override of a key the bundle does not have adds it silently (MONAI's parser
    accepts any key), so ``--head attention`` would train the default network; callers turn
    these into a :class:`~lungcal.errors.ConfigError`.
    """
    text = json.dumps({k: v for k, v in config.items() if k not in hyperparameters(config)})
    return sorted(k for k in hyperparameters(config) if not re.search(rf"@{re.escape(k)}(?![A-Za-z0-9_])", text))
