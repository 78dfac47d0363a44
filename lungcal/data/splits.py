"""Patient-level stratified seeded splits and salted pseudonyms.

Pseudonyms
    ``pseudonym(subject_id, salt)`` is ``"S"`` + the first 16 hex digits of
    HMAC-SHA256(salt, subject_id). The salt comes from :func:`get_salt`, in this order:

    1. the ``LUNGCAL_SALT`` environment variable (the salt itself);
    2. the file named by ``LUNGCAL_SALT_FILE``;
    3. ``$LUNGCAL_HOME/salt`` (default ``./runs/salt``), created once with 32 random bytes
       (mode 0600) on first use.

    Keep the salt secret and stable for a site: the same salt maps the same patient to the same
    pseudonym across imports, a different salt makes pseudonyms unlinkable.

Splits
    ``assign_splits`` gives every *subject* one split; a subject's label for stratification is the
    max over its CTs (a patient with any positive CT is a positive patient). Within each label
    stratum the subjects are shuffled with ``numpy.random.default_rng(seed)`` and cut by the
    fractions, so the same inputs and seed always give the same splits.
"""
from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import numpy as np

from lungcal.errors import ConfigError
from lungcal.paths import lungcal_home

__all__ = ["SPLITS", "get_salt", "pseudonym", "assign_splits", "apply_splits"]

SPLITS = ("train", "val", "test")


def _home() -> Path:
    return lungcal_home()


def get_salt() -> str:
    """Return the pseudonymisation salt (env ``LUNGCAL_SALT``, file ``LUNGCAL_SALT_FILE``, or
    ``$LUNGCAL_HOME/salt`` created on first use)."""
    env = os.environ.get("LUNGCAL_SALT")
    if env:
        return env
    file = os.environ.get("LUNGCAL_SALT_FILE")
    if file:
        p = Path(file)
        if not p.is_file():
            raise ConfigError("salt file not found", file=p, field="LUNGCAL_SALT_FILE",
                              fix="create the file with a secret string, or unset LUNGCAL_SALT_FILE")
        return p.read_text().strip()
    p = _home() / "salt"
    if not p.is_file():
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_name(f".salt.{os.getpid()}")
        tmp.write_text(secrets.token_hex(32))
        os.chmod(tmp, 0o600)
        try:
            os.link(tmp, p)  # atomic; loses gracefully to a concurrent creator
        except FileExistsError:
            pass
        finally:
            tmp.unlink(missing_ok=True)
    return p.read_text().strip()


def pseudonym(subject_id: str, salt: str | None = None) -> str:
    """Salted pseudonym of a subject ID: ``"S" + hex16(HMAC-SHA256(salt, id))``."""
    key = (get_salt() if salt is None else salt).encode()
    return "S" + hmac.new(key, str(subject_id).encode(), hashlib.sha256).hexdigest()[:16]


def assign_splits(
    subject_labels: Mapping[str, int],
    fractions: Sequence[float] = (0.6, 0.2, 0.2),
    seed: int = 0,
    names: Sequence[str] = SPLITS,
) -> dict[str, str]:
    """Assign each subject to a split, stratified by its label, seeded.

    Args:
        subject_labels: subject -> label (0/1) used for stratification.
        fractions: split fractions, summing to 1, in the order of ``names``.
        seed: RNG seed.
        names: split names.

    Returns:
        subject -> split name. Every split with a positive fraction gets at least one subject per
        stratum when the stratum is large enough (largest-remainder rounding).
    """
    fr = np.asarray(fractions, dtype=float)
    if len(fr) != len(names) or (fr < 0).any() or abs(fr.sum() - 1) > 1e-6:
        raise ConfigError(f"split fractions {list(fractions)} must be {len(names)} non-negative numbers summing to 1",
                          field="fractions", fix="e.g. 0.6,0.2,0.2")
    rng = np.random.default_rng(seed)
    out: dict[str, str] = {}
    for label in sorted(set(subject_labels.values())):
        subjects = sorted(s for s, y in subject_labels.items() if y == label)
        subjects = [subjects[i] for i in rng.permutation(len(subjects))]
        n = len(subjects)
        raw = fr * n
        counts = np.floor(raw).astype(int)
        for i in np.argsort(-(raw - counts), kind="stable")[: n - counts.sum()]:
            counts[i] += 1
        bounds = np.concatenate([[0], np.cumsum(counts)])
        for name, a, b in zip(names, bounds[:-1], bounds[1:]):
            out.update({s: name for s in subjects[a:b]})
    return out


def apply_splits(rows: Iterable[dict], fractions: Sequence[float] = (0.6, 0.2, 0.2), seed: int = 0,
                 keep_existing: bool = True) -> list[dict]:
    """Fill the ``split`` of each row by subject (stratified by the subject's max label).

    Rows whose ``split`` is already set keep it when ``keep_existing``; the other rows of the same
    subject then follow that split.
    """
    rows = [dict(r) for r in rows]
    fixed: dict[str, str] = {}
    for r in rows:
        if keep_existing and r.get("split"):
            fixed.setdefault(r["subject"], r["split"])
    labels: dict[str, int] = {}
    for r in rows:
        if r["subject"] not in fixed:
            labels[r["subject"]] = max(labels.get(r["subject"], 0), int(r["label"]))
    assigned = assign_splits(labels, fractions, seed) if labels else {}
    assigned.update(fixed)
    for r in rows:
        if not (keep_existing and r.get("split")):  # a given split is never overwritten (conflicts stay visible)
            r["split"] = assigned[r["subject"]]
    return rows
