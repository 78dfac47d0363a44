"""lungcal.paths: where outputs go, and atomic writes that leave the old file or nothing."""
from __future__ import annotations

import errno
import os

import pytest

from lungcal.paths import atomic_write, atomic_write_text, default_output_dir, lungcal_home


def test_home_follows_env_then_cwd(tmp_path, monkeypatch):
    monkeypatch.setenv("LUNGCAL_HOME", str(tmp_path / "h"))
    assert lungcal_home() == default_output_dir() == (tmp_path / "h").resolve()
    monkeypatch.delenv("LUNGCAL_HOME")
    monkeypatch.chdir(tmp_path)
    assert lungcal_home() == (tmp_path / "runs").resolve()


def test_atomic_write_replaces_and_uses_the_umask_mode(tmp_path):
    p = tmp_path / "sub" / "a.txt"
    atomic_write_text(p, "one")
    atomic_write_text(p, "two")
    assert p.read_text() == "two"
    mask = os.umask(0)
    os.umask(mask)
    assert (p.stat().st_mode & 0o777) == (0o666 & ~mask)
    assert [q.name for q in p.parent.iterdir()] == ["a.txt"]


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    p = tmp_path / "ckpt.pt"
    p.write_bytes(b"old")
    with pytest.raises(OSError) as info:
        with atomic_write(p) as f:
            f.write(b"half")
            raise OSError(errno.ENOSPC, "No space left on device")
    assert info.value.errno == errno.ENOSPC
    assert p.read_bytes() == b"old"
    assert [q.name for q in tmp_path.iterdir()] == ["ckpt.pt"]


def test_atomic_write_refuses_a_read_mode(tmp_path):
    with pytest.raises(ValueError):
        with atomic_write(tmp_path / "x", "rb"):
            pass
