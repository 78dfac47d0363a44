"""Run a CIFAR bundle: ``python -m cifar_baselines bundles/cifar10lt_ce.json --epochs 30 --subset 2000``.

The bundle JSON is parsed with MONAI's ``ConfigParser`` (``%`` macros resolve from the current
directory, i.e. run from the project root), top-level keys are overridden from the command line
(values parsed as JSON, e.g. ``--lr_milestones [24,27]``, ``--subset null``), and ``initialize``,
``run`` and ``finalize`` are evaluated in that order, as ``monai.bundle run`` does; the training log
(MONAI ``StatsHandler``, one line per epoch) goes to stderr.
``python -m monai.bundle run --config_file bundles/cifar10lt_ce.json`` works too.
"""
from __future__ import annotations

import json
import logging
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from monai.bundle import ConfigParser

from lungcal.errors import ConfigError, LungcalError

__all__ = ["load_bundle", "run_bundle", "main"]


def load_bundle(path: str | Path, overrides: Mapping[str, Any] | None = None):
    """Parse a bundle file into a MONAI ``ConfigParser`` with ``overrides`` applied.

    Keys are top-level settings (``epochs``) or nested ids (``evaluation#n_bootstrap``).
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError("bundle file not found", file=path,
                          fix="run from the project root, e.g. bundles/cifar10lt_ce.json")
    parser = ConfigParser()
    parser.read_config(str(path))
    parser.resolve_macro_and_relative_ids()  # expand '%' macros so nested ids can be overridden
    for key, value in (overrides or {}).items():
        if "#" not in key and key not in parser.get():
            raise ConfigError(f"unknown setting {key!r}", file=path, field=key,
                              fix=f"use one of {', '.join(k for k in parser.get() if not k.startswith('_'))}")
        parser[key] = value
    return parser


def run_bundle(path: str | Path, overrides: Mapping[str, Any] | None = None) -> Any:
    """Parse ``path`` with ``overrides``, evaluate its ``initialize`` (seeding, a writable output folder), ``run``
    and ``finalize`` entries; returns the last value of ``run``."""
    parser = load_bundle(path, overrides)
    if "initialize" in parser:
        parser.get_parsed_content("initialize")
    result = parser.get_parsed_content("run")
    if "finalize" in parser:
        parser.get_parsed_content("finalize")
    return result[-1] if isinstance(result, list) else result


def _parse_args(argv: list[str]) -> tuple[str, dict[str, Any]]:
    if not argv or argv[0].startswith("-"):
        raise ConfigError("no bundle given", fix="python -m cifar_baselines bundles/<name>.json [--key value ...]")
    path, rest, over = argv[0], argv[1:], {}
    while rest:
        key = rest.pop(0)
        if not key.startswith("--") or not rest:
            raise ConfigError(f"expected '--key value', got {key!r}", field=key.lstrip("-"))
        raw = rest.pop(0)
        try:
            over[key[2:]] = json.loads(raw)
        except json.JSONDecodeError:
            over[key[2:]] = raw
    return path, over


def main(argv: list[str] | None = None) -> int:
    """CLI entry: run a bundle, print the summary as JSON; user errors print one line, exit 2."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", datefmt="%H:%M:%S")
    try:
        path, over = _parse_args(list(sys.argv[1:] if argv is None else argv))
        result = run_bundle(path, over)
    except LungcalError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    summary = {k: v for k, v in (result or {}).items() if not isinstance(v, dict)}
    for key in ("test", "test_ts"):
        if isinstance(result, dict) and key in result:
            summary[key] = {m: result[key][m] for m in ("acc", "ece", "nll", "mean_confidence")}
    print(json.dumps(summary, indent=2, default=str))
    return 0
