"""Run a CIFAR bundle from Python: ``python -m cifar_baselines bundles/cifar10lt_ce.json --epochs 30 --subset 2000``.

The CIFAR bundles are composed as the CT bundles are: ``bundles/cifar10lt_ce.json`` is the complete stage-1
pipeline and ``bundles/cifar10lt_las.json`` the complete LAS one; every other recipe holds only what differs
and is merged over its base, key by key: ``python -m cifar_baselines bundles/cifar10lt_ce.json
bundles/cifar10_focal.json`` (the files in order, as MONAI's ``--config_file "['base','recipe']"``). The files
are parsed with MONAI's ``ConfigParser`` (run from the project root), ids are overridden from the command line,
top-level (``--epochs 30``) or nested (``--optimizer#momentum 0.8``), values parsed as JSON (``--lr_milestones
[24,27]``, ``--subset null``), and ``initialize``, ``run`` and ``finalize`` are evaluated in that order, as
``monai.bundle run`` does; the training log (MONAI ``StatsHandler``, one line per epoch) goes to stderr.
``python -m monai.bundle run --config_file "['bundles/cifar10lt_ce.json','bundles/cifar10_focal.json']"``
works too. A recipe given without its base stops in one line that names the command over its base
(:func:`lungcal.runtime.bundle_checks.require_base`, the recipe's ``+initialize`` step).
"""
from __future__ import annotations

import json
import logging
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from monai.bundle import ConfigParser

from lungcal.errors import ConfigError, LungcalError

__all__ = ["STAGE1_BASE", "LAS_BASE", "recipe_files", "config_file_argument", "load_bundle", "run_bundle", "main"]

#: the complete stage-1 bundle; every other stage-1 recipe (``bundles/cifar10{,lt}_<method>.json``) goes over it
STAGE1_BASE = "bundles/cifar10lt_ce.json"
#: the complete LAS bundle; ``bundles/cifar10_las.json`` goes over it
LAS_BASE = "bundles/cifar10lt_las.json"


def recipe_files(recipe: str) -> list[str]:
    """The config files of a CIFAR recipe (``cifar10_focal``, ``cifar10lt_las``) in merge order: its base, then
    the recipe's own file (none when the recipe is the base)."""
    base = LAS_BASE if recipe.endswith("_las") else STAGE1_BASE
    own = f"bundles/{recipe}.json"
    return [base] if own == base else [base, own]


def config_file_argument(files: Sequence[str]) -> str:
    """``--config_file``'s value in a printed shell command: the one path, or the quoted list MONAI merges."""
    if len(files) == 1:
        return str(files[0])
    return "\"[" + ",".join(f"'{f}'" for f in files) + "]\""


def load_bundle(path: str | Path | Sequence[str | Path], overrides: Mapping[str, Any] | None = None):
    """Parse a bundle, one file or a base and the recipes merged over it in order, into a MONAI ``ConfigParser``
    with ``overrides`` applied.

    Keys are top-level settings (``epochs``) or nested ids (``optimizer#momentum``, ``evaluation#n_bootstrap``).

    Raises:
        ConfigError: a file is missing, or a top-level override names no key of the files.
    """
    paths = [Path(path)] if isinstance(path, (str, Path)) else [Path(p) for p in path]
    for p in paths:
        if not p.is_file():
            raise ConfigError("bundle file not found", file=p,
                              fix="run from the project root, e.g. bundles/cifar10lt_ce.json")
    parser = ConfigParser()
    parser.read_config([str(p) for p in paths])
    parser.resolve_macro_and_relative_ids()  # expand any '%' macro so that nested ids can be overridden
    for key, value in (overrides or {}).items():
        if "#" not in key and key not in parser.get():
            raise ConfigError(f"unknown setting {key!r}", file=paths[-1], field=key,
                              fix=f"use one of {', '.join(k for k in parser.get() if not k.startswith('_'))}")
        parser[key] = value
    return parser


def run_bundle(path: str | Path | Sequence[str | Path], overrides: Mapping[str, Any] | None = None) -> Any:
    """Parse ``path`` (a file, or a base and its recipe) with ``overrides``, evaluate its ``initialize`` (the
    bundle checks, seeding, a writable output folder), ``run`` and ``finalize`` entries; returns the last value of
    ``run``."""
    parser = load_bundle(path, overrides)
    if "initialize" in parser:
        parser.get_parsed_content("initialize")
    result = parser.get_parsed_content("run")
    if "finalize" in parser:
        parser.get_parsed_content("finalize")
    return result[-1] if isinstance(result, list) else result


def _parse_args(argv: list[str]) -> tuple[list[str], dict[str, Any]]:
    """``(config files, overrides)``: the files come first, then ``--key value`` pairs."""
    files: list[str] = []
    rest = list(argv)
    while rest and not rest[0].startswith("-"):
        files.append(rest.pop(0))
    if not files:
        raise ConfigError("no bundle given", fix="python -m cifar_baselines bundles/<base>.json "
                                                 "[bundles/<recipe>.json] [--key value ...]")
    over: dict[str, Any] = {}
    while rest:
        key = rest.pop(0)
        if not key.startswith("--") or not rest:
            raise ConfigError(f"expected '--key value', got {key!r}", field=key.lstrip("-"))
        raw = rest.pop(0)
        try:
            over[key[2:]] = json.loads(raw)
        except json.JSONDecodeError:
            over[key[2:]] = raw
    return files, over


def main(argv: list[str] | None = None) -> int:
    """CLI entry: run a bundle, print the summary as JSON; user errors print one line, exit 2."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", datefmt="%H:%M:%S")
    try:
        files, over = _parse_args(list(sys.argv[1:] if argv is None else argv))
        result = run_bundle(files, over)
    except LungcalError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    summary = {k: v for k, v in (result or {}).items() if not isinstance(v, dict)}
    for key in ("test", "test_ts"):
        if isinstance(result, dict) and key in result:
            summary[key] = {m: result[key][m] for m in ("acc", "ece", "nll", "mean_confidence")}
    print(json.dumps(summary, indent=2, default=str))
    return 0
