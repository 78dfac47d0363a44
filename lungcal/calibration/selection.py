"""Choosing a calibrator on one split: stratified K-fold cross-validated NLL with the one-standard-error rule."""
from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from lungcal.calibration.calibrators.base import _check_labels, _check_logits
from lungcal.calibration.calibrators.registry import CALIBRATORS, make_calibrator
from lungcal.errors import ConfigError, DataError

__all__ = ["select_calibrator"]


def select_calibrator(logits, labels, candidates: Sequence[str] = ("ts", "platt", "isotonic"), folds: int = 5,
                      seed: int = 0, rule: str = "1se", eps: float = 1e-6):
    """Pick a calibrator by stratified K-fold cross-validated NLL on one split, refit it on all of it.

    Every candidate is fitted on K-1 folds and scored on the held-out fold; the score of a case
    is ``-log(clip(p_y, eps, 1))`` (so a calibrator that puts probability 0 on an outcome that
    happens, as isotonic regression and histogram binning can, gets a finite, large penalty), and
    ``cv_nll[name]`` is the mean over all N held-out cases. With ``rule="min"`` the lowest
    ``cv_nll`` wins. With ``rule="1se"`` (default; the one-standard-error rule of Hastie,
    Tibshirani & Friedman, ESL 7.10) the first candidate, in the order given (list the simplest
    first), whose ``cv_nll`` exceeds the lowest by at most the standard error of the per-case
    paired difference wins: a calibrator with more parameters must earn its place. The folds are
    the same for every candidate (``folds`` is lowered to the size of the rarer class when needed).

    Args:
        logits: ``(N, C)`` or ``(N,)`` logits of the fit split (validation, never test).
        labels: ``(N,)`` class indices.
        candidates: registry names, simplest first.
        folds: K (at least 2). seed: seed of the fold assignment.
        rule: ``"1se"`` or ``"min"``. eps: probability floor of the held-out NLL.

    Returns:
        ``(name, calibrator, cv_nll)``: the winner's name, the winner refitted on all cases
        (its ``fit_info["selection"]`` records ``cv_nll``, ``cv_se``, ``rule`` and ``folds``),
        and ``{name: mean held-out NLL}`` for every candidate.
    """
    cands = list(candidates)
    if not cands:
        raise ConfigError("no candidate calibrators", field="candidates", fix=f"pass some of: {', '.join(CALIBRATORS)}")
    for name in cands:
        make_calibrator(name)  # ConfigError for unknown names, before any work
    if rule not in ("1se", "min"):
        raise ConfigError(f"unknown selection rule {rule!r}", field="rule", fix="use '1se' or 'min'")
    if int(folds) != folds or folds < 2:
        raise ConfigError(f"folds must be an integer >= 2, got {folds!r}", field="folds", fix="use e.g. 5")
    z, _, _ = _check_logits(logits, strict=False)
    y = _check_labels(labels, z.shape[0], z.shape[1], fitting=True)
    if "platt" in cands and z.shape[1] != 2:
        raise ConfigError(f"'platt' needs a binary model, got {z.shape[1]} classes", field="candidates",
                          fix="drop 'platt' from the candidates (use 'ts' or 'vector' for C > 2)")
    yn = y.numpy()
    counts = np.bincount(yn, minlength=z.shape[1])
    smallest = int(counts[counts > 0].min())
    if smallest < 2:
        raise DataError("a class has a single case in the fit split: cannot cross-validate", field="labels",
                        fix="fit on a split with at least 2 cases of every class present, or choose a method "
                            "instead of selecting one")
    k = min(int(folds), smallest)
    fold = _fold_ids(yn, k, seed)
    per_case = {name: np.empty(z.shape[0]) for name in cands}
    for f in range(k):
        tr, te = np.flatnonzero(fold != f), np.flatnonzero(fold == f)
        for name in cands:
            cal = make_calibrator(name).fit(z[tr], y[tr])
            p = cal.predict_proba(z[te]).numpy()
            per_case[name][te] = -np.log(np.clip(p[np.arange(te.size), yn[te]], eps, 1.0))
    cv_nll = {name: float(v.mean()) for name, v in per_case.items()}
    best = min(cands, key=lambda n: cv_nll[n])
    cv_se = {name: float(np.std(per_case[name] - per_case[best], ddof=1) / math.sqrt(z.shape[0]))
             for name in cands}
    chosen = best if rule == "min" else next(n for n in cands if cv_nll[n] - cv_nll[best] <= cv_se[n])
    cal = make_calibrator(chosen).fit(z, y)
    cal.fit_info["selection"] = {"cv_nll": dict(cv_nll), "cv_se": cv_se, "rule": rule, "folds": k,
                                 "candidates": cands}
    return chosen, cal, cv_nll


def _fold_ids(y: np.ndarray, folds: int, seed: int) -> np.ndarray:
    """Stratified fold of every case: each class is shuffled and dealt round-robin, continuing
    where the previous class stopped, so fold sizes differ by at most one."""
    rng = np.random.default_rng(seed)
    fold = np.empty(y.shape[0], dtype=np.int64)
    start = 0
    for k in np.unique(y):
        idx = rng.permutation(np.flatnonzero(y == k))
        fold[idx] = (start + np.arange(idx.size)) % folds
        start = (start + idx.size) % folds
    return fold
