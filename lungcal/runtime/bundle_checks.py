"""Checks of a bundle command, run as the first steps of its ``initialize``, before any work starts.

Two mistakes MONAI lets through:

- **A recipe run on its own.** A stage-1 recipe (``bundles/nlst_ce.json``) or an override file
  (``bundles/fullres.json``) holds only what differs from its base, so on its own it has no ``run``
  and MONAI ends in a traceback (``ValueError: run ID 'run' doesn't exist in the config file``).
  MONAI merges ``--config_file`` lists key by key, and a file cannot name its base, so each such
  file *appends* a step to ``initialize`` (``"+initialize"``): :func:`require_base`. Over its base,
  the base's own first step (:func:`base_loaded`) has run before it, and the step does nothing; on
  its own it is the only step, and it stops in one line that names the command to use (MONAI first
  warns that ``+initialize`` had nothing to merge into). The mark lasts for the process: a recipe run on
  its own *in the same Python process* after a complete bundle is not caught (MONAI's own error follows).
- **A mistyped override.** ``--epoch 2`` (for ``--epochs``) adds a top-level key that nothing reads,
  and the run goes on with 120 epochs. :func:`check_command_line` compares the command's override
  names (the top-level id before any ``#``) with the keys of its config files and stops in one line
  naming the unknown key and the nearest known one. It reads the command line of
  ``python -m monai.bundle run`` (``sys.argv``); a bundle run from Python (``monai.bundle.run(...)``,
  the study runner in-process) is not checked. :func:`check_overrides` is the check itself.

Both raise :class:`~lungcal.errors.ConfigError`; this module installs the exit hook
(:mod:`lungcal.runtime.exit_hook`), so under ``python -m monai.bundle run`` it is one line and exit code 2.
"""
from __future__ import annotations

import ast
import difflib
import inspect
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

from monai.bundle import ConfigParser, ConfigWorkflow
from monai.bundle.scripts import run as monai_run

import lungcal.runtime.exit_hook  # noqa: F401  (installs the one-line exit for a LungcalError)
from lungcal.errors import ConfigError

__all__ = ["base_loaded", "require_base", "check_overrides", "check_command_line", "override_names"]

_loaded = False


def base_loaded() -> None:
    """The first ``initialize`` step of a complete bundle: the recipes merged over it may run."""
    global _loaded
    _loaded = True


def require_base(base: str, recipe: str) -> None:
    """The ``initialize`` step a recipe appends: nothing over a complete bundle, else a one-line stop.

    Raises:
        ConfigError: no complete bundle's ``initialize`` ran before this step (``recipe`` alone).
    """
    if _loaded:  # not consumed: several files may be merged over one base (a recipe and fullres.json)
        return
    raise ConfigError(f"a recipe: it holds only what differs from {base}, and does not run on its own",
                      file=recipe, fix=f"run it over its base: python -m monai.bundle run --config_file "
                                       f"\"['{base}','{recipe}']\"")


def _monai_arguments() -> set[str]:
    """The keyword arguments ``monai.bundle run`` takes for itself (not config ids)."""
    names = set(inspect.signature(monai_run).parameters) | set(inspect.signature(ConfigWorkflow.__init__).parameters)
    return {n for n in names if n not in ("self", "override", "kwargs")}


def override_names(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """``(config files, override names)`` of a ``monai.bundle run`` argument list (``--k v``, ``--k=v``)."""
    files: list[str] = []
    names: list[str] = []
    it = iter(range(len(argv)))
    for i in it:
        a = argv[i]
        if not a.startswith("--"):
            continue
        name, eq, value = a[2:].partition("=")
        if not eq and i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            value = argv[i + 1]
            next(it, None)
        if name == "config_file":
            files.extend(_file_list(value))
        else:
            names.append(name)
    return files, names


def _file_list(value: str) -> list[str]:
    """A ``--config_file`` value: one path, a comma-separated list or a Python list literal."""
    v = value.strip()
    if v.startswith("["):
        try:
            return [str(x) for x in ast.literal_eval(v)]
        except (ValueError, SyntaxError):
            pass
    return [p.strip() for p in v.split(",") if p.strip()]


def check_overrides(config_files: Iterable[str | Path], names: Iterable[str]) -> None:
    """Every override name's top-level id is a key of the merged ``config_files`` or a ``monai.bundle run`` argument.

    Raises:
        ConfigError: one names no key (the message names it and the nearest key).
    """
    keys = {k.lstrip("+") for k in ConfigParser.load_config_files([str(f) for f in config_files])}
    allowed = keys | _monai_arguments()
    for name in names:
        top = name.lstrip("+").split("#", 1)[0]
        if top in allowed:
            continue
        near = difflib.get_close_matches(top, sorted(keys), n=1)
        hint = f"did you mean --{near[0]}? " if near else ""
        raise ConfigError(f"--{name} names no key of the bundle, so nothing would read it", field=top,
                          fix=f"{hint}the keys are the top-level ids of {', '.join(map(str, config_files))}")


def check_command_line(argv: Sequence[str] | None = None) -> None:
    """:func:`check_overrides` on the command line of ``python -m monai.bundle run``; nothing otherwise."""
    argv = list(sys.argv if argv is None else argv)
    if not argv or not Path(argv[0]).as_posix().endswith("monai/bundle/__main__.py") or "run" not in argv[1:2]:
        return
    files, names = override_names(argv[2:])
    if files:
        check_overrides(files, names)
