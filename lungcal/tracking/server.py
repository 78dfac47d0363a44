"""A local MLflow server as a child process: start it on a free loopback port, wait until it answers, stop it.

``mlflow ui`` and ``mlflow server`` run gunicorn or uvicorn workers, so the server is started in a session
of its own and stopped by process group: its workers go with it, whatever happened in between.

    with running_server(ui_command(uri, port), port) as base:   # 'http://127.0.0.1:<port>'
        ...
"""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import IO

__all__ = ["LOOPBACK", "free_port", "running_server", "stop_process_group", "wait_until_up"]

LOOPBACK = "127.0.0.1"


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port nothing listens on now (the OS picks it; another process may take it before you do)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def wait_until_up(base_url: str, proc: subprocess.Popen, timeout: float = 120.0) -> None:
    """Poll ``base_url + '/health'`` until it answers 200; raise if ``proc`` exits first or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited early with code {proc.returncode}: {proc.args!r}")
        try:
            with urllib.request.urlopen(base_url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(f"the server did not answer on {base_url} within {timeout:.0f} s")


def stop_process_group(proc: subprocess.Popen, grace: float = 20.0) -> None:
    """SIGTERM the process group of ``proc`` (started with ``start_new_session=True``), SIGKILL after ``grace`` s."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


@contextlib.contextmanager
def running_server(cmd: Sequence[str], port: int, *, timeout: float = 120.0, log: IO[bytes] | None = None,
                   cwd: str | Path | None = None) -> Iterator[str]:
    """Run ``cmd`` (a server listening on ``LOOPBACK:port``) until the block ends; yields its base URL.

    Its output goes to ``log`` (default: discarded). The server is stopped with its workers on the way out,
    also when it never came up or the block raised."""
    sink = log if log is not None else subprocess.DEVNULL
    proc = subprocess.Popen(list(cmd), stdout=sink, stderr=subprocess.STDOUT, start_new_session=True, cwd=cwd)
    base = f"http://{LOOPBACK}:{port}"
    try:
        wait_until_up(base, proc, timeout)
        yield base
    finally:
        stop_process_group(proc)
