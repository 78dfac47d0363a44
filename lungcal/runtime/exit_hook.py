"""One line and exit code 2 for a user error under ``python -m monai.bundle run``, as the ``lungcal`` CLI does.

MONAI wraps an exception raised while a config item is built into ``RuntimeError: Failed to
evaluate ConfigExpression`` (``from`` the original), so the user's real message ends up in the
middle of a long traceback. Importing this module (the CT bundles do, through their ``imports``)
installs a :data:`sys.excepthook` that looks for a :class:`~lungcal.errors.LungcalError` in the
``__cause__`` / ``__context__`` chain of an uncaught exception; when it finds one it prints
``lungcal: error: <message>`` on stderr, runs the ``atexit`` handlers, flushes and ends the
process with exit code 2. Any other exception goes to the previous hook (a normal traceback).

``sys.excepthook`` runs after the interpreter gave up on the exception, where ``sys.exit`` no
longer sets the exit code; hence ``os._exit`` once everything is flushed.
"""
from __future__ import annotations

import atexit
import os
import sys
from collections.abc import Callable
from types import TracebackType
from typing import Any

from lungcal.errors import LungcalError

__all__ = ["find_lungcal_error", "install"]

EXIT_CODE = 2


def find_lungcal_error(exc: BaseException | None) -> LungcalError | None:
    """The first :class:`LungcalError` in ``exc``'s ``__cause__`` / ``__context__`` chain, or ``None``."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, LungcalError):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


class _Hook:
    """The installed :data:`sys.excepthook`; ``lungcal_exit_hook`` marks it so :func:`install` stays idempotent."""

    lungcal_exit_hook = True

    def __init__(self, previous: Callable[[type[BaseException], BaseException, TracebackType | None], Any]) -> None:
        self.previous = previous

    def __call__(self, exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
        error = find_lungcal_error(exc)
        if error is None:
            self.previous(exc_type, exc, tb)
            return
        print(f"lungcal: error: {error}", file=sys.stderr)
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(EXIT_CODE)


def install() -> None:
    """Install the hook (idempotent)."""
    if not getattr(sys.excepthook, "lungcal_exit_hook", False):
        sys.excepthook = _Hook(sys.excepthook)


install()
