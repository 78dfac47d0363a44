"""One log line when a stage of a run starts and one when it ends, and the line that says what a run will do.

A first run spends most of its time in stages that only show a progress bar (making the demo cohort, the
series checks, the bags); these lines say which stage it is in and how long each took::

    INFO lungcal.stages: [stage] series checks: 1000 CTs (the cached ones are read back) ...
    INFO lungcal.stages: [stage] series checks done in 7 min 40 s

The logger is ``lungcal.stages`` (INFO), so a bundle's logging config shows it beside the epoch lines.
"""
from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator

__all__ = ["stage", "format_seconds", "announce"]

logger = logging.getLogger("lungcal.stages")


def format_seconds(seconds: float) -> str:
    """``"7 min 40 s"``, ``"12 s"``, ``"1 h 02 min"``."""
    s = int(round(seconds))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s // 3600} h {(s % 3600) // 60:02d} min"


def announce(text: str) -> None:
    """The line at the start of a run: what it will do and roughly how long it takes."""
    logger.info("[plan] %s", text)


@contextlib.contextmanager
def stage(name: str, detail: str = "") -> Iterator[None]:
    """Log ``name`` (and ``detail``) as it starts, and its wall time when it ends (or fails)."""
    logger.info("[stage] %s%s ...", name, f": {detail}" if detail else "")
    t0 = time.perf_counter()
    try:
        yield
    except BaseException:
        logger.info("[stage] %s stopped after %s", name, format_seconds(time.perf_counter() - t0))
        raise
    logger.info("[stage] %s done in %s", name, format_seconds(time.perf_counter() - t0))
