"""User-facing errors.

Every error a user can cause (a bad file, a bad field, a bad setting) is raised as a subclass of
:class:`LungcalError`. The message names *where* (file, row, field) and *how to fix it*, so the
CLI can print it on one line and exit with code 2 (see :mod:`lungcal.cli`).

Programming errors (wrong types passed by our own code) stay ordinary ``TypeError``/``ValueError``.
"""
from __future__ import annotations

import os
from typing import Any

__all__ = ["LungcalError", "DataError", "ConfigError", "CacheError", "TrackingError"]


class LungcalError(Exception):
    """Base class of every user-facing error.

    Args:
        message: what is wrong, in one sentence.
        file: the file or folder involved, if any.
        field: the column, key, tag or config id involved, if any.
        row: the 0-based row index (manifest/CSV), if any.
        fix: what the user should do about it.
    """

    def __init__(
        self,
        message: str,
        *,
        file: str | os.PathLike | None = None,
        field: str | None = None,
        row: int | None = None,
        fix: str | None = None,
    ) -> None:
        self.message = message
        self.file = None if file is None else str(file)
        self.field = field
        self.row = row
        self.fix = fix
        super().__init__(self._format())

    def _format(self) -> str:
        where = []
        if self.file:
            where.append(self.file)
        if self.row is not None:
            where.append(f"row {self.row}")
        if self.field:
            where.append(f"field '{self.field}'")
        text = (": ".join([", ".join(where), self.message]) if where else self.message).rstrip(".")
        if self.fix:
            text += f". Fix: {self.fix.rstrip('.')}"
        return text + "."

    def __reduce__(self) -> tuple[Any, ...]:  # keep kwargs across process pools
        return (_rebuild, (type(self), self.message, self.file, self.field, self.row, self.fix))


def _rebuild(cls, message, file, field, row, fix):  # pragma: no cover - pickling helper
    return cls(message, file=file, field=field, row=row, fix=fix)


class DataError(LungcalError):
    """An input file, manifest row or image is missing, unreadable or inconsistent."""


class ConfigError(LungcalError):
    """A bundle/CLI setting is missing, has the wrong type, or contradicts another."""


class CacheError(LungcalError):
    """A cache entry is unreadable or was written by incompatible parameters."""


class TrackingError(LungcalError):
    """MLflow tracking could not be set up (bad URI, unreachable server, missing parent run)."""
