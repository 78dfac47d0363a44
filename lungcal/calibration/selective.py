"""Selective prediction (referral): risk-coverage curves, AURC and metrics on the cases kept.

A model that may refer the cases it is least sure about to a human is judged by the error it
makes on the cases it keeps. Cases are ranked by an uncertainty *score*, most certain first, and
at coverage ``k / N`` the ``k`` most certain are kept and the rest referred:

* ``"confidence"``: top-label probability ``max_c p_c`` (higher = more certain);
* ``"entropy"``: predictive entropy ``-sum_c p_c log p_c`` of ``probs`` (lower = more certain);
* ``"mi"``: mutual information between the prediction and the model parameters (the epistemic
  part of the entropy, BALD; Houlsby et al. 2011), ``H(mean_m p_m) - mean_m H(p_m)`` over the
  ``(M, N, C)`` probabilities ``member_probs`` of M MC-dropout samples or ensemble members (lower
  = more certain).

The *risk* at a coverage is the error rate (1 - accuracy of the argmax prediction) among the
kept cases; AURC is the mean risk over the coverages ``1/N, 2/N, ..., N/N``.

Ties in the score. :func:`risk_coverage` and :func:`aurc` average over tied groups: when the cut
at ``k`` falls inside a group of equally certain cases, the errors of that group are counted
pro rata (``(k - n_before) / group_size`` of them), which is the expected risk over every order
of the tied cases. The curve therefore does not depend on the order of the input rows, and a
constant score gives the overall error rate at every coverage. :func:`metrics_at_coverage`
needs a concrete set of kept cases: it ranks with a *stable* sort, so a tie group straddling the
cut is split in input order (deterministic, documented, but order-dependent for such ties).

Inputs follow :mod:`lungcal.calibration.measures`: ``probs`` is ``(N, C)`` or ``(N,)`` p(y=1) of a
binary task, ``labels`` ``(N,)`` class indices.

References:
    Geifman, El-Yaniv. "Selective Classification for Deep Neural Networks." NeurIPS 2017.
    https://arxiv.org/abs/1705.08500
    Geifman, Uziel, El-Yaniv. "Bias-Reduced Uncertainty Estimation for Deep Neural Classifiers"
    (AURC, E-AURC). ICLR 2019. https://arxiv.org/abs/1805.08206
    Houlsby, Huszar, Ghahramani, Lengyel. "Bayesian Active Learning for Classification and
    Preference Learning" (BALD, mutual information). 2011. https://arxiv.org/abs/1112.5745
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from lungcal.errors import ConfigError, DataError

from .measures.inputs import _as_probs_labels, _to_numpy

__all__ = [
    "REFERRAL_COVERAGE", "REFERRAL_METRIC", "confidence", "referral_threshold",
    "SCORES",
    "predictive_entropy",
    "mutual_information",
    "uncertainty_score",
    "risk_coverage",
    "aurc",
    "metrics_at_coverage",
    "selective_report",
]

#: the uncertainty scores :func:`risk_coverage` ranks by
SCORES = ("confidence", "entropy", "mi")
_MI_ZERO = 1e-12  # nats: mutual information below this is rounding noise
#: share of validation cases kept by the validation referral rule (the 10 % least confident are referred)
REFERRAL_COVERAGE = 0.9
#: the metric a calibrator run stores: the confidence below which its validation cases were referred
REFERRAL_METRIC = "val/referral_threshold_cov90"


def confidence(p1) -> np.ndarray:
    """``max(p, 1 - p)`` of binary p(y=1), float64."""
    p = np.asarray(p1, dtype=np.float64)
    return np.maximum(p, 1.0 - p)


def referral_threshold(probs, coverage: float = REFERRAL_COVERAGE) -> float:
    """The confidence of the least confident case kept when the ``1 - coverage`` least confident are referred.

    ``probs`` is ``(N, 2)`` or ``(N,)`` calibrated p(y=1); ``round(coverage * N)`` cases (at least
    one) are kept, as :func:`lungcal.calibration.selective.metrics_at_coverage` keeps them; a new
    case is referred when its confidence is below the returned value.
    """
    p = np.asarray(probs, dtype=np.float64)
    p1 = p[:, 1] if p.ndim == 2 else p
    if p1.size == 0:
        raise ConfigError("no cases to set a referral threshold on", field="coverage", fix="pass a non-empty split")
    if not 0.0 < float(coverage) <= 1.0:
        raise ConfigError(f"coverage must be in (0, 1], got {coverage!r}", field="coverage",
                          fix="pass the share of cases to keep, e.g. 0.9")
    conf = np.sort(confidence(p1))[::-1]
    k = max(1, int(round(float(coverage) * conf.size)))
    return float(conf[k - 1])


def predictive_entropy(probs) -> np.ndarray:
    """Per-case entropy ``-sum_c p_c log p_c`` (nats, float64; ``0 log 0 = 0``) of ``(N, C)`` or
    ``(N,)`` binary probabilities."""
    p = _to_numpy(probs).astype(np.float64)
    if p.ndim == 1:
        p = np.stack([1.0 - p, p], axis=1)
    return _entropy(p)


def mutual_information(member_probs) -> np.ndarray:
    """Per-case mutual information ``H(mean_m p_m) - mean_m H(p_m)`` (nats, float64, >= 0).

    Args:
        member_probs: ``(M, N, C)`` probabilities of M MC-dropout samples or ensemble members,
            or ``(M, N)`` p(y=1) of a binary task.

    Returns:
        ``(N,)``; 0 where every member gives the same probabilities (values below 1e-12 nats,
        rounding noise, are set to 0 so that such cases tie exactly).
    """
    m = _member_array(member_probs)
    mi = _entropy(m.mean(axis=0)) - _entropy(m).mean(axis=0)
    # where the members agree rounding leaves +-1e-16, which would split tied cases: snap to 0
    return np.where(mi < _MI_ZERO, 0.0, mi)


def uncertainty_score(probs, score: str = "confidence", member_probs=None) -> np.ndarray:
    """Per-case *certainty* (higher = more certain): the confidence, or minus the entropy / MI.

    ``score="mi"`` needs ``member_probs`` (``(M, N, C)``); see :func:`mutual_information`.
    """
    p, _ = _as_probs_labels(probs, np.zeros(_to_numpy(probs).shape[0], dtype=np.int64))
    return _certainty(p.astype(np.float64), score, member_probs)


def risk_coverage(probs, labels, score: str = "confidence", member_probs=None) -> dict[str, np.ndarray]:
    """Risk-coverage curve: the error rate among the ``k`` most certain cases, ``k = 1..N``.

    Args:
        probs: ``(N, C)`` probabilities or ``(N,)`` p(y=1).
        labels: ``(N,)`` class indices.
        score: ``"confidence"``, ``"entropy"`` or ``"mi"`` (:data:`SCORES`).
        member_probs: ``(M, N, C)`` member / MC-dropout probabilities; required for ``"mi"``.

    Returns:
        ``{"coverage": k/N, "risk": error rate of the k kept cases (tied groups averaged, see the
        module doc), "thresholds": the score of the k-th most certain case}``, each ``(N,)``
        float64. ``thresholds`` are in the score's own units: keep cases whose confidence is
        ``>=`` it, or whose entropy / MI is ``<=`` it.
    """
    p, y = _as_probs_labels(probs, labels)
    p = p.astype(np.float64)
    cert = _certainty(p, score, member_probs)
    err = (p.argmax(axis=1) != y).astype(np.float64)
    order = np.argsort(-cert, kind="stable")
    cert_s, err_s = cert[order], err[order]
    n = cert_s.shape[0]
    # tie groups of the sorted certainties: errors of the strictly more certain cases plus a pro-rata
    # share of the group the cut falls into
    starts = np.flatnonzero(np.r_[True, cert_s[1:] != cert_s[:-1]])
    sizes = np.diff(np.r_[starts, n])
    group = np.repeat(np.arange(starts.shape[0]), sizes)
    cum = np.r_[0.0, np.cumsum(err_s)]
    before = cum[starts][group]  # errors before the case's group
    in_group = (cum[starts + sizes] - cum[starts])[group]
    k = np.arange(1, n + 1, dtype=np.float64)
    errors = before + (k - starts[group]) / sizes[group] * in_group
    thresholds = cert_s if score == "confidence" else -cert_s
    return {"coverage": k / n, "risk": errors / k, "thresholds": thresholds.copy()}


def aurc(probs, labels, score: str = "confidence", member_probs=None) -> float:
    """Area under the risk-coverage curve: the mean risk over coverages ``1/N .. N/N``
    (Geifman & El-Yaniv 2017; lower is better; ties averaged, see the module doc).

    For reference, a score that ranks every correct case before every error reaches the minimum
    ``(1/N) sum_{k > N_correct} (k - N_correct) / k``, and a random score the error rate.
    """
    return float(risk_coverage(probs, labels, score, member_probs)["risk"].mean())


def metrics_at_coverage(probs, labels, coverage: float, score: str = "confidence", threshold: float = 0.5,
                        member_probs=None) -> dict[str, Any]:
    """Metrics on the ``coverage`` share of most certain cases; the rest are referred.

    ``max(1, round(coverage * N))`` cases are kept (ranked by a stable sort of the certainty,
    see the module doc).

    Args:
        probs: ``(N, C)`` probabilities or ``(N,)`` p(y=1).
        labels: ``(N,)`` class indices.
        coverage: share of cases kept, in (0, 1].
        score: uncertainty score the cases are ranked by (:data:`SCORES`).
        threshold: binary tasks: a case is called positive (class 1) when ``p1 > threshold``
            (0.5 equals the argmax, ties to class 0).
        member_probs: ``(M, N, C)`` member probabilities, for ``score="mi"``.

    Returns:
        ``coverage`` (actual kept share), ``n_kept``, ``n_referred``, ``acc`` on the kept cases; for
        binary tasks also ``sensitivity`` and ``specificity`` on the kept cases and
        ``referred_cancer_share`` (share of class 1 among the referred cases). Undefined values
        (no positives kept, nothing referred) are nan.
    """
    if isinstance(coverage, bool) or not isinstance(coverage, (int, float, np.floating, np.integer)) \
            or not (0.0 < float(coverage) <= 1.0):
        raise ConfigError(f"coverage must be in (0, 1], got {coverage!r}", field="coverage",
                          fix="pass the share of cases to keep, e.g. 0.9 to refer the 10% least certain")
    if not (0.0 <= float(threshold) <= 1.0):
        raise ConfigError(f"threshold must be in [0, 1], got {threshold!r}", field="threshold",
                          fix="pass the decision threshold on p(y=1), e.g. 0.5")
    p, y = _as_probs_labels(probs, labels)
    p = p.astype(np.float64)
    cert = _certainty(p, score, member_probs)
    n = y.shape[0]
    k = max(1, int(round(float(coverage) * n)))
    order = np.argsort(-cert, kind="stable")
    kept = np.zeros(n, dtype=bool)
    kept[order[:k]] = True
    binary = p.shape[1] == 2
    pred = (p[:, 1] > float(threshold)).astype(np.int64) if binary else p.argmax(axis=1)
    out: dict[str, Any] = {"coverage": k / n, "n_kept": k, "n_referred": n - k,
                           "acc": float((pred[kept] == y[kept]).mean())}
    if binary:
        yk, pk = y[kept], pred[kept]
        out["sensitivity"] = _ratio(((pk == 1) & (yk == 1)).sum(), (yk == 1).sum())
        out["specificity"] = _ratio(((pk == 0) & (yk == 0)).sum(), (yk == 0).sum())
        out["referred_cancer_share"] = _ratio((y[~kept] == 1).sum(), n - k)
    return out


def selective_report(probs, labels, coverage: float = 0.9, score: str = "confidence",
                     threshold: float = 0.5, member_probs=None) -> dict[str, float]:
    """Flat, MLflow-ready referral metrics: ``aurc`` and ``{metric}_cov{pct}`` at ``coverage``.

    Keys (``pct = round(100 * coverage)``, e.g. ``acc_cov90``): ``aurc``, ``acc_cov{pct}``,
    ``n_referred_cov{pct}``; for binary tasks also ``sensitivity`` and ``specificity`` on all
    cases (coverage 1, the reference) and ``sensitivity_cov{pct}``, ``specificity_cov{pct}``,
    ``referred_cancer_share_cov{pct}``. (MLflow metric names cannot hold ``@``, hence ``_cov90``
    for the ``@cov90`` of the issue.)
    """
    tag = f"cov{round(100 * float(coverage))}"
    at = metrics_at_coverage(probs, labels, coverage, score, threshold, member_probs)
    out = {"aurc": aurc(probs, labels, score, member_probs), f"acc_{tag}": at["acc"],
           f"n_referred_{tag}": float(at["n_referred"])}
    if "sensitivity" in at:
        full = metrics_at_coverage(probs, labels, 1.0, score, threshold, member_probs)
        out.update({"sensitivity": full["sensitivity"], "specificity": full["specificity"],
                    f"sensitivity_{tag}": at["sensitivity"], f"specificity_{tag}": at["specificity"],
                    f"referred_cancer_share_{tag}": at["referred_cancer_share"]})
    return out


# ----------------------------------------------------------------------------- helpers
def _entropy(p: np.ndarray) -> np.ndarray:
    """Entropy over the last axis, float64, ``0 log 0 = 0``."""
    safe = np.where(p > 0, p, 1.0)
    return -(p * np.log(safe)).sum(axis=-1)


def _member_array(member_probs) -> np.ndarray:
    m = _to_numpy(member_probs).astype(np.float64)
    if m.ndim == 2:
        m = np.stack([1.0 - m, m], axis=-1)
    if m.ndim != 3:
        raise DataError(f"member_probs must be (M, N, C) or (M, N), got shape {tuple(m.shape)}",
                        field="member_probs", fix="stack the probabilities of the M members on a new first axis")
    if m.size and (not np.all(np.isfinite(m)) or m.min() < -1e-6 or m.max() > 1 + 1e-6):
        raise DataError("member_probs must be probabilities in [0, 1]", field="member_probs",
                        fix="apply softmax to each member's logits first")
    return m


def _certainty(p: np.ndarray, score: str, member_probs) -> np.ndarray:
    """Higher = more certain, (N,) float64."""
    if score not in SCORES:
        raise ConfigError(f"unknown score {score!r}", field="score", fix=f"use one of: {', '.join(SCORES)}")
    if score == "confidence":
        return p.max(axis=1)
    if score == "entropy":
        return -_entropy(p)
    if member_probs is None:
        raise ConfigError("score='mi' needs member_probs", field="member_probs",
                          fix="pass the (M, N, C) probabilities of the MC-dropout samples or ensemble members, "
                              "or use score='confidence' or 'entropy'")
    m = _member_array(member_probs)
    if m.shape[1:] != p.shape:
        raise DataError(f"member_probs has shape {tuple(m.shape)} but probs is {tuple(p.shape)}",
                        field="member_probs", fix="pass (M, N, C) member probabilities of the same cases and classes")
    return -mutual_information(m)


def _ratio(num, den) -> float:
    return float(num) / float(den) if den else math.nan
