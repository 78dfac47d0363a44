"""Honest run states: a run whose process died is marked ``KILLED``, not left ``RUNNING`` forever.

Every :class:`~lungcal.tracking.tracker.RunTracker` run records its owner: pid, host name and the
process's start time (``/proc/<pid>/stat`` field 22 plus the boot id, so a recycled pid or a
reboot is not mistaken for the owner). The next command that opens the same store (any bundle,
``lungcal report``) calls :func:`reap_orphaned_runs`: a ``RUNNING`` run owned by a process of this
host that no longer exists is terminated ``KILLED`` and tagged ``lungcal.ended_by = reaper``.
Runs owned by another host are left alone (their liveness cannot be checked from here).
"""
from __future__ import annotations

import logging
import os
import socket
from pathlib import Path

from lungcal.tracking.names import TAG_ENDED_BY, TAG_OWNER_HOST, TAG_OWNER_PID, TAG_OWNER_START

__all__ = ["owner_tags", "process_alive", "reap_orphaned_runs"]

logger = logging.getLogger(__name__)


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def _start_ticks(pid: int) -> str | None:
    """The start time of ``pid`` in clock ticks since boot, or ``None`` if there is no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # the command name (field 2) may hold spaces and parentheses: split after its closing ")"
    return stat.rsplit(")", 1)[1].split()[19]


def _start_token(pid: int) -> str:
    ticks = _start_ticks(pid)
    return f"{_boot_id()}:{ticks}" if ticks is not None else ""


def owner_tags(pid: int | None = None) -> dict[str, str]:
    """The tags that identify the process owning a run (default: this process)."""
    pid = os.getpid() if pid is None else int(pid)
    return {TAG_OWNER_PID: str(pid), TAG_OWNER_HOST: socket.gethostname(), TAG_OWNER_START: _start_token(pid)}


def process_alive(tags: dict[str, str]) -> bool | None:
    """Is the run's owner alive? ``True``/``False`` on this host, ``None`` when it cannot be told."""
    if tags.get(TAG_OWNER_HOST) != socket.gethostname() or not tags.get(TAG_OWNER_PID, "").isdigit():
        return None
    pid = int(tags[TAG_OWNER_PID])
    if pid == os.getpid():
        return True
    if not Path("/proc").is_dir():  # no procfs: fall back on signal 0
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    recorded = tags.get(TAG_OWNER_START, "")
    now = _start_token(pid) if _start_ticks(pid) is not None else ""
    return bool(now) and (not recorded or now == recorded)


def reap_orphaned_runs(client, experiment_ids: list[str]) -> list[str]:
    """Mark ``KILLED`` every RUNNING run of ``experiment_ids`` whose owner process is gone.

    Returns the ids of the runs it marked. Safe to call from any command: a run whose owner is
    alive, or lives on another host, is not touched.
    """
    if not experiment_ids:
        return []
    reaped = []
    runs = client.search_runs(experiment_ids, filter_string="attributes.status = 'RUNNING'", max_results=1000)
    for run in runs:
        if process_alive(run.data.tags) is False:
            client.set_tag(run.info.run_id, TAG_ENDED_BY, "reaper")
            client.set_terminated(run.info.run_id, "KILLED")
            reaped.append(run.info.run_id)
            logger.warning("MLflow run %s (%s) was left RUNNING by a process that is gone: marked KILLED",
                           run.info.run_id, run.info.run_name)
    return reaped
