"""``lungcal ui``: open the project's MLflow store in the MLflow UI, on each experiment's runs table.

The addresses name the model-training mode and lungcal's saved view (see :mod:`lungcal.tracking.runs_view`).

Imports inside the command keep ``lungcal --help`` fast (the lint contract allows it here).
"""
from __future__ import annotations

import argparse
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from lungcal.errors import ConfigError

__all__ = ["register", "ui_command"]


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``ui`` to the ``lungcal`` parser."""
    p = subparsers.add_parser(
        "ui", help="open the project's MLflow store in the MLflow UI, on the runs table",
        description="Prints and runs `mlflow ui` on the project's SQLite store, or a team PostgreSQL store "
        "(bound to 127.0.0.1), and prints the address of each experiment's runs table (nlst, cifar10, cifar10lt, "
        "whichever exist) in model-training mode with the study's columns: test AUC (CIFAR: ACC) and ECE with "
        "95% CIs, the temperature, the method, each TS run under its stage-1 run. The columns are a saved view "
        "(\"Views\" > \"lungcal study\"), written on each experiment that lacks it.")
    p.add_argument("--tracking-uri", default=None,
                   help="store to open: sqlite:///... or postgresql://... (default: the project's SQLite store)")
    p.add_argument("--experiment", default=None, metavar="NAME",
                   help="print only this experiment's address (default: nlst, cifar10, cifar10lt, whichever exist)")
    p.add_argument("--port", type=int, default=5000)
    p.add_argument("--print-only", action="store_true", help="only print the command and the addresses")
    p.set_defaults(func=_ui)


def ui_command(tracking_uri: str | None = None, port: int = 5000) -> list[str]:
    """The ``mlflow ui`` command line for a store, loopback only.

    The store is the project's SQLite file (default) or a team database (``postgresql://...``,
    checked: driver installed, server answering). A tracking server (``http(s)://``) has its own UI.
    """
    from lungcal.tracking.tracker import check_tracking_uri, default_tracking_uri

    uri = tracking_uri or default_tracking_uri()
    if re.match(r"^postgresql(\+\w+)?://", uri):
        check_tracking_uri(uri)
    elif not uri.startswith("sqlite:///"):
        raise ConfigError(f"`lungcal ui` opens a SQLite or PostgreSQL store, not {uri!r}", field="--tracking-uri",
                          fix="open a team server's address in the browser instead")
    else:
        db = Path(uri[len("sqlite:///"):])
        if not db.exists():
            raise ConfigError("no MLflow store here yet", file=db,
                              fix="run a bundle first, or pass --tracking-uri sqlite:///<abs path>/mlflow.db")
    exe = shutil.which("mlflow") or str(Path(sys.executable).with_name("mlflow"))
    return [exe, "ui", "--backend-store-uri", uri, "--host", "127.0.0.1", "--port", str(port)]


def _ui(args: argparse.Namespace) -> int:
    from lungcal.tracking.tracker import redact_uri
    from lungcal.tracking.ui import experiment_urls

    cmd = ui_command(args.tracking_uri, args.port)
    urls = experiment_urls(cmd[3], [args.experiment] if args.experiment else [], port=args.port)
    print("mlflow " + " ".join(shlex.quote(redact_uri(c)) for c in cmd[1:]))
    if not urls:
        print(f"then open http://127.0.0.1:{args.port} (no nlst, cifar10 or cifar10lt experiment in this store yet)")
    width = max(len(name) for name, _ in urls) if urls else 0
    for name, url in urls:
        print(f"then open {name:<{width}}  {url}")
    if args.print_only:
        return 0
    return subprocess.call(cmd)
