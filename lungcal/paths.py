"""Where lungcal keeps what it generates, and how it writes it: one rule for the whole package.

``$LUNGCAL_HOME`` if set, else ``./runs`` under the current working directory (the project root
when the bundles run as the README says). Synthetic cohorts go to ``<home>/data``, bag caches,
checkpoints and the default MLflow store (``<home>/mlflow.db``) to ``<home>``, and the
pseudonymisation salt to ``<home>/salt``.

Every file that another process may read while it is written (cache entries, checkpoints,
datalists, predictions) goes through :func:`atomic_write`: a temporary file in the same folder,
flushed and fsynced, then ``os.replace``. A crash or a full disk leaves the old file or nothing,
never half a file.
"""
from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

__all__ = ["lungcal_home", "default_output_dir", "atomic_write", "atomic_write_text"]


def lungcal_home() -> Path:
    """``$LUNGCAL_HOME`` (``~`` expanded), else ``./runs``; always absolute and resolved."""
    home = os.environ.get("LUNGCAL_HOME")
    return Path(home).expanduser().resolve() if home else (Path.cwd() / "runs").resolve()


def default_output_dir() -> Path:
    """Where a run writes everything by default (:func:`lungcal_home`)."""
    return lungcal_home()


@contextmanager
def atomic_write(path: str | os.PathLike, mode: str = "wb", **open_kwargs: Any) -> Iterator[IO]:
    """Open a temporary file beside ``path`` for writing; on success it replaces ``path`` atomically.

    Example::

        with atomic_write(ckpt_path) as f:
            torch.save(state, f)

    On any exception (including ``OSError(ENOSPC)``) the temporary file is removed and the
    exception propagates; ``path`` is untouched.
    """
    if "w" not in mode and "x" not in mode:
        raise ValueError(f"atomic_write needs a write mode, got {mode!r}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; a written file gets the usual mode
        with os.fdopen(fd, mode.replace("x", "w"), **open_kwargs) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write_text(path: str | os.PathLike, text: str, encoding: str = "utf-8") -> Path:
    """Write ``text`` to ``path`` atomically (see :func:`atomic_write`); returns ``path``."""
    with atomic_write(path, "w", encoding=encoding, newline="") as f:
        f.write(text)
    return Path(path)
