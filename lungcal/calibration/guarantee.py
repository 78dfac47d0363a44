"""A decision threshold with a guarantee on the missed-cancer rate: Learn-then-Test or conformal risk control.

On a site's labelled calibration split, :func:`missed_cancer_threshold` chooses the threshold at or above which
a case is called positive (sent on for work-up). The missed-cancer rate of a threshold is the share of the
population's cancers whose probability falls below it (1 - sensitivity). Two guarantees, two strengths:

- ``ltt`` (default), Learn-then-Test (Angelopoulos et al. 2021)::

      P( missed-cancer rate of the threshold  >  alpha )  <=  delta      over the draw of the calibration split

  With ``n`` cancers in the split and ``k`` of them below a threshold, the p-value of H0 "its missed-cancer
  rate exceeds alpha" is the exact binomial tail ``P(Bin(n, alpha) <= k)`` (:func:`ltt_pvalues`, scipy's
  ``binom.cdf`` on the *integer* count). The candidate thresholds (0, then the cancers' own probabilities) are
  tested from the lowest up, by fixed-sequence testing: the count of misses only grows with the threshold,
  so no multiplicity penalty, and testing stops at the first threshold not rejected. Of those rejected the
  highest, which calls the fewest cases positive, is kept. It is the ``(k+1)``-th lowest cancer probability
  where ``k`` (:func:`misses_allowed`) is the largest count with ``P(Bin(n, alpha) <= k) <= delta``: for
  continuous scores its missed-cancer rate is the ``(k+1)``-th order statistic of ``n`` uniforms, which
  exceeds ``alpha`` with probability exactly that tail, so the guarantee is tight, not conservative.

- ``crc``, conformal risk control (Angelopoulos, Bates, Fisch, Lei, Schuster 2022) with the miss indicator of
  each cancer as the loss (bounded by ``B = 1``): the highest threshold whose ``k`` misses satisfy
  ``(n / (n + 1)) * (k / n) + 1 / (n + 1) <= alpha``, i.e. ``k + 1 <= alpha * (n + 1)``. It guarantees

      E[ missed-cancer rate of the threshold ]  <=  alpha      on average over draws of the calibration split

  a weaker promise: no probability is stated for the one split a site has (with 40 cancers at alpha 0.1 the
  chosen threshold misses more than 10 % of the population's cancers for about 42 % of the splits).
  It allows more misses, hence a higher threshold and fewer work-ups, from fewer cancers.

Why not MAPIE's ``BinaryClassificationController`` (which this module used before): it computes the
empirical risk ``1 - recall`` in floating point and then ``ceil(n * risk)`` inside its binomial tail, so one
miss among 40 cancers (``1 - 39/40 = 0.025000000000000022``) counts as two; at alpha = delta = 0.1 that lost
one certifiable miss for 78 of the cancer counts from 22 to 200 (``docs/results.md``, 2026-12-06). Where no
rounding arises (a power-of-two count of cancers) MAPIE is the oracle of the tests.

A split whose cancers are too few for any threshold to pass is refused: :func:`cancers_needed` gives the
count, and the count needed to allow ``k`` misses (:func:`cancers_needed_table` prints the table).

References:
    Angelopoulos, Bates, Candès, Jordan, Lei. "Learn then Test: Calibrating Predictive Algorithms to
    Achieve Risk Control." 2021. https://arxiv.org/abs/2110.01052
    Angelopoulos, Bates, Fisch, Lei, Schuster. "Conformal Risk Control." 2022. https://arxiv.org/abs/2208.02814
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any

import numpy as np
from scipy.stats import binom

from lungcal.errors import ConfigError, DataError

__all__ = ["LTT", "CRC", "GUARANTEES", "PROMISES", "MissedCancerGuarantee", "cancers_needed", "cancers_needed_table",
           "check_guarantee", "ltt_pvalues", "misses_allowed", "missed_cancer_threshold"]

LTT, CRC = "ltt", "crc"
#: the guarantees :func:`missed_cancer_threshold` can give (``--guarantee``)
GUARANTEES = (LTT, CRC)
#: what each promises, in words (the printed summary, ``guarantee.json``)
PROMISES = {LTT: "with probability at least 1 - delta over the draw of the calibration split (Learn-then-Test)",
            CRC: "on average over draws of the calibration split (conformal risk control): a weaker promise that "
                 "states no probability for the one split a site has"}
_METHODS = {LTT: "Learn-then-Test (exact binomial tail P(Bin(n, alpha) <= k) on the integer count k of missed "
                 "cancers, fixed-sequence testing from the lowest threshold)",
            CRC: "conformal risk control (the highest threshold with (k + 1) / (n + 1) <= alpha, k missed cancers "
                 "of n; the miss indicator as the loss, B = 1)"}
#: ``alpha * (n + 1)`` is compared with an integer: a level written as a decimal (0.29) is not one in floats
_TOL = 1e-9


@dataclass(frozen=True)
class MissedCancerGuarantee:
    """A threshold and what it guarantees (``guarantee``: :data:`LTT`, the missed-cancer rate is at most
    ``alpha`` with probability at least ``1 - delta`` over the calibration draw; :data:`CRC`, at most ``alpha``
    on average over calibration draws, ``delta`` None). ``positive_rate``, ``sensitivity`` and ``fit_misses``
    are measured on the calibration split; ``misses_allowed`` is the most misses the guarantee allowed there.
    A test split's numbers are the caller's to report."""

    threshold: float
    alpha: float
    delta: float | None
    n: int
    n_cancers: int
    positive_rate: float
    sensitivity: float
    method: str = _METHODS[LTT]
    guarantee: str = LTT
    misses_allowed: int | None = None
    fit_misses: int | None = None

    @property
    def promise(self) -> str:
        """What the guarantee promises, in words (:data:`PROMISES`)."""
        return PROMISES[self.guarantee]

    def statement(self) -> str:
        """The guarantee as one sentence (what each CT's record states)."""
        head = f"a CT is called positive when p(cancer) >= {self.threshold:.4f}; at most {100 * self.alpha:g}% of "
        tail = f"({self.n_cancers} cancers among {self.n} CTs)"
        if self.guarantee == CRC:
            return (head + "cancers fall below it on average over draws of the site's calibration split "
                    f"{tail} (conformal risk control: no probability is stated for this split)")
        assert self.delta is not None  # LTT always has one
        return (head + f"cancers fall below it, with probability at least {100 * (1 - self.delta):g}% over the "
                f"site's calibration split {tail}")

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "promise": self.promise, "statement": self.statement()}

    @classmethod
    def from_dict(cls, state: Mapping[str, Any]) -> MissedCancerGuarantee:
        """The guarantee :meth:`as_dict` wrote (extra keys, such as a test split's numbers, are ignored; one written
        before ``guarantee`` existed is Learn-then-Test's)."""
        return cls(**{f.name: state[f.name] for f in fields(cls) if f.name in state})

    def decide(self, p1: Any) -> np.ndarray:
        """``True`` where a case is called positive (``p1 >= threshold``)."""
        return np.asarray(p1, dtype=np.float64) >= self.threshold


def check_guarantee(guarantee: str, field: str = "--guarantee") -> str:
    """``guarantee`` if it is one of :data:`GUARANTEES`, else a ConfigError naming them."""
    if guarantee not in GUARANTEES:
        raise ConfigError(f"unknown guarantee {guarantee!r}", field=field,
                          fix=f"use one of: {', '.join(GUARANTEES)} ({LTT}: with a stated probability; {CRC}: on "
                              "average over calibration draws)")
    return guarantee


def ltt_pvalues(misses: Any, n_cancers: int, alpha: float) -> np.ndarray:
    """The p-values of H0 "the missed-cancer rate exceeds ``alpha``" for thresholds that miss ``misses`` (integer
    counts) of ``n_cancers``: the exact binomial tail ``P(Bin(n_cancers, alpha) <= misses)``."""
    k = np.asarray(misses)
    if not np.issubdtype(k.dtype, np.integer):
        raise TypeError(f"misses must be integer counts, got {k.dtype}")
    return np.asarray(binom.cdf(k, int(n_cancers), float(alpha)), dtype=np.float64)


def misses_allowed(n_cancers: int, alpha: float, delta: float | None = None, guarantee: str = LTT) -> int:
    """The most missed cancers among ``n_cancers`` a certified threshold may have (-1: none can be certified).

    ``ltt``: the largest ``k`` with ``P(Bin(n, alpha) <= k) <= delta``; ``crc``: the largest with
    ``k + 1 <= alpha * (n + 1)`` (``delta`` unused).
    """
    n = int(n_cancers)
    if check_guarantee(guarantee, "guarantee") == CRC:
        return min(n, int(math.floor(alpha * (n + 1) + _TOL)) - 1)
    if delta is None:
        raise ValueError("Learn-then-Test needs delta")
    passed = ltt_pvalues(np.arange(n + 1), n, alpha) <= delta
    return int(np.flatnonzero(passed)[-1]) if passed.any() else -1


def cancers_needed(alpha: float, delta: float | None = None, misses: int = 0, guarantee: str = LTT) -> int:
    """The fewest cancers in the calibration split for which a threshold missing ``misses`` of them is certified
    (``misses = 0``: before any threshold can be; ``ltt``: ``P(Bin(n, alpha) <= misses) <= delta``, 22 at alpha =
    delta = 0.1; ``crc``: ``misses + 1 <= alpha * (n + 1)``, 9 at alpha = 0.1)."""
    if check_guarantee(guarantee, "guarantee") == CRC:
        return max(misses + 1, int(math.ceil((misses + 1) / alpha - 1 - _TOL)))
    if delta is None:
        raise ValueError("Learn-then-Test needs delta")
    hi = max(2 * (misses + 1), 16)
    while True:  # the tail falls with n: find the first n at or under delta, doubling the range searched
        n = np.arange(misses + 1, hi + 1)
        passed = binom.cdf(misses, n, alpha) <= delta
        if passed.any():
            return int(n[int(np.argmax(passed))])
        hi *= 2


def cancers_needed_table(alphas: Sequence[float] = (0.05, 0.1), confidences: Sequence[float] = (0.95, 0.9),
                         max_misses: int = 3, crc: bool = True) -> str:
    """The cancers a calibration split needs for a certified threshold to allow 0, 1, ..., ``max_misses`` missed
    cancers, as a Markdown table: a row per ``--miss-rate`` and ``--confidence`` (Learn-then-Test) and, with
    ``crc``, one per ``--miss-rate`` for ``--guarantee crc`` (what ``docs/hospital.md`` publishes;
    ``lungcal cancers-needed`` prints it)."""
    ks = range(max_misses + 1)
    lines = ["| `--miss-rate` | guarantee | " + " | ".join(f"{k} missed" for k in ks) + " |",
             "|---|---|" + "---|" * len(ks)]
    for alpha in alphas:
        for conf in confidences:
            delta = round(1.0 - conf, 12)
            cells = " | ".join(str(cancers_needed(alpha, delta, k)) for k in ks)
            lines.append(f"| {alpha:g} | `ltt`, `--confidence {conf:g}` | {cells} |")
        if crc:
            cells = " | ".join(str(cancers_needed(alpha, misses=k, guarantee=CRC)) for k in ks)
            lines.append(f"| {alpha:g} | `crc` (on average) | {cells} |")
    return "\n".join(lines)


def _check_level(value: float, name: str) -> float:
    v = float(value)
    if not 0.0 < v < 1.0:
        raise ConfigError(f"{name} must be in (0, 1), got {value!r}", field=name,
                          fix=f"pass e.g. --{name.replace('_', '-')} 0.05")
    return v


def missed_cancer_threshold(p1: Any, labels: Any, alpha: float = 0.05, delta: float | None = 0.1,
                            guarantee: str = LTT) -> MissedCancerGuarantee:
    """The threshold on p(cancer) whose missed-cancer rate is at most ``alpha`` with probability ``1 - delta``
    (``ltt``), or at most ``alpha`` on average over calibration draws (``crc``; ``delta`` must be None).

    Args:
        p1: calibrated p(cancer) of the calibration split, ``(N,)`` or ``(N, 2)``.
        labels: 1 cancer, 0 not, ``(N,)``.
        alpha: the missed-cancer rate allowed (1 - the sensitivity guaranteed).
        delta: ``ltt``: the chance, over the calibration draw, that the guarantee fails.
        guarantee: :data:`LTT` or :data:`CRC` (module doc).

    Raises:
        ConfigError: ``alpha`` or ``delta`` outside (0, 1), a ``delta`` with ``crc``; too few cancers for
            ``alpha`` and ``delta`` (the message names the number needed).
        DataError: probabilities and labels disagree in length, or a probability lies outside [0, 1].
    """
    guarantee = check_guarantee(guarantee, "guarantee")
    alpha = _check_level(alpha, "alpha")
    if guarantee == CRC:
        if delta is not None:
            raise ConfigError("conformal risk control states no confidence: its guarantee is on average over "
                              "calibration draws", field="delta", fix="leave delta out with guarantee 'crc'")
    else:
        delta = _check_level(0.1 if delta is None else delta, "delta")
    p = np.asarray(p1, dtype=np.float64)
    p = p[:, 1] if p.ndim == 2 else p
    y = np.asarray(labels).astype(int).reshape(-1)
    if p.shape != y.shape:
        raise DataError(f"{p.size} probabilities but {y.size} labels", field="labels", fix="pass one label per case")
    if p.size and (np.nanmin(p) < 0 or np.nanmax(p) > 1 or np.isnan(p).any()):
        raise DataError("probabilities must lie in [0, 1]", field="probabilities", fix="pass calibrated p(cancer)")
    cancers = np.sort(p[y == 1])
    n_cancers = int(cancers.size)
    allowed = misses_allowed(n_cancers, alpha, delta, guarantee)
    if allowed < 0:
        needed = cancers_needed(alpha, delta, 0, guarantee)
        promise = (f"with probability {100 * (1 - delta):g}%" if delta is not None
                   else "on average (conformal risk control)")
        raise ConfigError(f"the calibration split has {n_cancers} cancers: a missed-cancer rate of at most "
                          f"{100 * alpha:g}% {promise} needs at least {needed}",
                          field="alpha", fix=f"label more of the site's CTs (at least {needed} cancers), or ask for "
                                             + ("a larger alpha" if delta is None else "a larger alpha or delta"))
    # the candidates, lowest first: the count of misses changes only at the cancers' own probabilities
    grid = np.unique(np.concatenate([[0.0], cancers]))
    misses = np.searchsorted(cancers, grid, side="left")  # cancers strictly below each threshold: integers
    # LTT: P(Bin(n, alpha) <= k) <= delta exactly when k <= allowed (the tail grows with k); CRC: (k + 1) / (n + 1)
    # <= alpha exactly then too. Both are tested as p-values / bounds on each candidate's integer count.
    if guarantee == LTT:
        assert delta is not None
        rejected = ltt_pvalues(misses, n_cancers, alpha) <= delta
    else:
        rejected = misses <= allowed
    # fixed-sequence testing: stop at the first threshold not rejected (0 always is: 0 misses, n >= needed)
    last = (int(np.argmin(rejected)) if not rejected.all() else rejected.size) - 1
    t = float(grid[last])
    called = p >= t
    return MissedCancerGuarantee(threshold=t, alpha=alpha, delta=delta, n=int(p.size), n_cancers=n_cancers,
                                 positive_rate=float(called.mean()), sensitivity=float(called[y == 1].mean()),
                                 method=_METHODS[guarantee], guarantee=guarantee, misses_allowed=allowed,
                                 fit_misses=int(misses[last]))
