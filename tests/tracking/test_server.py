"""``lungcal.tracking.server``: a child server is waited for, and stopped with its workers, whatever happens.

A few lines of ``http.server`` stand in for ``mlflow ui`` (which takes 30-60 s to start here; the real one is
in ``test_mlflow_server.py``). The stand-in forks a worker into its own process group, as gunicorn does, so
the test sees that stopping the server takes the worker with it.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request

import pytest

from lungcal.tracking.server import free_port, running_server, stop_process_group, wait_until_up

SERVER = r"""
import http.server, os, sys, time
port, pidfile = int(sys.argv[1]), sys.argv[2]
worker = os.fork()
if worker == 0:          # a worker, as gunicorn keeps: it must die with its parent's group
    while True:
        time.sleep(1)
open(pidfile, "w").write(str(worker))
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
        self.wfile.write(b"OK")
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (exited, not yet reaped by init) counts as gone
    with open(f"/proc/{pid}/stat") as fh:
        return fh.read().rsplit(")", 1)[1].split()[0] != "Z"


def test_running_server_answers_then_stops_with_its_workers(tmp_path):
    port, pidfile = free_port(), tmp_path / "worker.pid"
    with running_server([sys.executable, "-c", SERVER, str(port), str(pidfile)], port, timeout=60) as base:
        assert base == f"http://127.0.0.1:{port}"
        with urllib.request.urlopen(base + "/health", timeout=5) as r:
            assert r.status == 200
        worker = int(pidfile.read_text())
        assert _alive(worker)
    deadline = time.monotonic() + 10
    while _alive(worker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(worker), "the server's worker outlived it"
    with pytest.raises(OSError):
        urllib.request.urlopen(base + "/health", timeout=2)


def test_running_server_stops_it_when_the_block_raises(tmp_path):
    port, pidfile = free_port(), tmp_path / "worker.pid"
    with pytest.raises(KeyError), running_server([sys.executable, "-c", SERVER, str(port), str(pidfile)], port,
                                                 timeout=60):
        raise KeyError("the caller failed")
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)


def test_a_server_that_exits_early_is_an_error_naming_its_code():
    port = free_port()
    with pytest.raises(RuntimeError, match="exited early with code 3"), \
            running_server([sys.executable, "-c", "import sys; sys.exit(3)"], port, timeout=60):
        pass


def test_a_server_that_never_answers_times_out_and_is_stopped():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    try:
        with pytest.raises(TimeoutError, match="did not answer"):
            wait_until_up(f"http://127.0.0.1:{free_port()}", proc, timeout=1.5)
        assert proc.poll() is None
    finally:
        stop_process_group(proc, grace=5)
    assert proc.poll() is not None
