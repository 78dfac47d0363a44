"""The ``lungcal`` command line.

Each package that owns commands exposes ``register(subparsers)`` in a ``commands.py`` module; the
function adds its sub-commands and sets ``func`` on each. This file only wires them together and
turns :class:`lungcal.errors.LungcalError` into one line on stderr and exit code 2.
"""
from __future__ import annotations

import argparse
import importlib
import logging
import sys

from lungcal.errors import LungcalError

# modules exposing ``register(subparsers)``; order is the order in ``lungcal --help``
COMMAND_MODULES = [
    "lungcal.data.commands",
    "lungcal.ct.commands",
    "lungcal.ctapp.commands",
    "lungcal.study.commands",
    "lungcal.tracking.commands",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lungcal", description="Calibrated lung-cancer prediction from chest CT (see README.md)."
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:  # a real import error inside the module: surface it
                raise
            continue
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(levelname)s %(name)s: %(message)s")
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        result = args.func(args)
    except LungcalError as exc:
        print(f"lungcal {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"lungcal {args.command}: interrupted", file=sys.stderr)
        return 130
    return int(result or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
