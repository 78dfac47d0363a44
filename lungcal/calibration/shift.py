"""Is a new site's data the model's kind of data? Label-shift-aware shift tests on a model's outputs.

A site can differ from the data a model was trained on in two ways that need different fixes:

- **prevalence** (label shift): ``p(y)`` changes, ``p(x | y)`` does not. A prior adjustment with the
  site's prevalence (known, or estimated by EM on unlabelled CTs) is then valid;
- **anything else** (a scanner, a reconstruction kernel, a population): ``p(x | y)`` changes, and only
  the site's own labels can recalibrate or adapt the model.

Black-box shift detection (Lipton, Wang & Smola, ICML 2018; Rabanser, Günnemann & Lipton, "Failing
loudly", NeurIPS 2019) tells them apart on the model's outputs alone, without site labels:

1. :func:`bbse_prevalence` estimates the site's prevalence from the fraction of its CTs the model
   calls positive, corrected with the model's true- and false-positive rates on the source's
   held-out (validation) split (black-box shift estimation, BBSE);
2. :func:`label_shift_test` compares the site's output distribution with the source's **re-weighted
   to that prevalence**: class-stratified subsamples of the source with the site's class ratio, so
   that under a pure prevalence change both samples come from the same law; a two-sample
   Kolmogorov-Smirnov statistic with a permutation p-value (:func:`ks_permutation_test`, through
   :func:`scipy.stats.permutation_test`) per subsample, merged over the subsamples as twice their
   median (valid whatever their dependence: Meng 1994, Vovk & Wang 2020);
3. :func:`ks_permutation_test` on the un-weighted source says whether anything changed at all.

On a binary model's one-dimensional output a change of ``p(score | y)`` that moves the scores along
the axis (a scanner that makes every CT look a little more suspicious) is partly explained away as a
prevalence change: BBSE then estimates a different prevalence and the re-weighted source matches
(measured in ``tests/calibration/test_shift.py`` and ``docs/results.md``). The same test on the bag
**embeddings** (:func:`mmd_permutation_test`: kernel MMD on their leading principal components,
Rabanser et al.'s best-performing detector family) does not have that blind spot, because a prevalence
change can only mix the two classes' embedding laws, not move them.

alibi-detect implements these detectors, but its releases pin ``numpy<2`` and ``pandas<3`` (and pull
``transformers``), which this stack cannot take; the statistics here are small, and the permutation
machinery is scipy's.

:func:`range_test` asks the acquisition side's question (are more of the site's values outside the
training data's central range than chance allows?) with an exact binomial test.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike
from scipy import stats
from sklearn.decomposition import PCA
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import roc_auc_score
from sklearn.metrics.pairwise import euclidean_distances
from sklearn.model_selection import StratifiedKFold
from sklearn.neighbors import NearestNeighbors
from threadpoolctl import threadpool_limits

from lungcal.errors import DataError

__all__ = ["ShiftTest", "ks_statistic", "ks_permutation_test", "mmd_permutation_test", "two_sample_test",
           "reduce_features", "bbse_prevalence", "prevalence_interval", "call_rate_test", "matched_reference",
           "label_shift_test",
           "range_test", "merge_pvalues", "EmbeddingRange", "DomainEffect", "domain_effect", "EFFECT_AUC",
           "minimum_detectable_auc"]

#: the domain classifier's AUC at and above which a site differs from the reference by more than a trifle
#: (0.5: indistinguishable; 0.6: a linear read of the embeddings tells a site case from a reference case
#: 60 % of the time, pairwise)
EFFECT_AUC = 0.6


@dataclass(frozen=True)
class ShiftTest:
    """One two-sample test: the statistic (KS distance), its p-value, the two sample sizes, and for a
    label-shift-aware test the prevalence the source was re-weighted to and how many subsamples were merged."""

    statistic: float
    pvalue: float
    n_source: int
    n_target: int
    prevalence: float | None = None
    n_subsamples: int = 1

    def as_dict(self) -> dict[str, float | int | None]:
        return {"statistic": self.statistic, "pvalue": self.pvalue, "n_source": self.n_source,
                "n_target": self.n_target, "prevalence": self.prevalence, "n_subsamples": self.n_subsamples}


def ks_statistic(x: np.ndarray, y: np.ndarray, axis: int = -1) -> np.ndarray:
    """The two-sample Kolmogorov-Smirnov distance ``sup |F_x - F_y|``, vectorised over leading axes
    (the form :func:`scipy.stats.permutation_test` calls with ``vectorized=True``); ties are handled as
    :func:`scipy.stats.ks_2samp` handles them (the ECDFs are compared at the pooled distinct values)."""
    x, y = np.moveaxis(np.asarray(x, float), axis, -1), np.moveaxis(np.asarray(y, float), axis, -1)
    nx, ny = x.shape[-1], y.shape[-1]
    pooled = np.concatenate([x, y], axis=-1)
    order = np.argsort(pooled, axis=-1, kind="stable")
    values = np.take_along_axis(pooled, order, axis=-1)
    steps = np.where(order < nx, 1.0 / nx, -1.0 / ny)
    diff = np.cumsum(steps, axis=-1)
    last = np.ones(values.shape, bool)  # compare only after the last of equal values
    last[..., :-1] = values[..., 1:] != values[..., :-1]
    return np.max(np.where(last, np.abs(diff), 0.0), axis=-1)


def ks_permutation_test(x: ArrayLike, y: ArrayLike, n_resamples: int = 2000,
                        seed: int | np.random.Generator | None = 0) -> ShiftTest:
    """Two-sample KS test of ``x`` (source) against ``y`` (target) with a permutation p-value
    (:func:`scipy.stats.permutation_test`, ``permutation_type="independent"``, one-sided on the distance)."""
    a, b = np.asarray(x, float).ravel(), np.asarray(y, float).ravel()
    if a.size < 2 or b.size < 2:
        raise DataError(f"a two-sample test needs at least 2 values per sample (got {a.size} and {b.size})",
                        field="scores")
    res = stats.permutation_test((a, b), ks_statistic, permutation_type="independent", vectorized=True,
                                 n_resamples=n_resamples, alternative="greater", random_state=seed)
    return ShiftTest(float(res.statistic), float(res.pvalue), int(a.size), int(b.size))


def _mmd2(kernel: np.ndarray, nx: int, order: np.ndarray) -> np.ndarray:
    """Biased MMD^2 of the samples ``order[..., :nx]`` and ``order[..., nx:]`` of a pooled kernel matrix.

    As the quadratic form ``a' K a`` with ``a`` = ``1 / nx`` on the first sample and ``-1 / ny`` on the second
    (the three block means at once), one matrix product per batch of permutations rather than three gathered
    ``n x n`` blocks each: 18-47x as fast for 90-270 pooled cases in batches of 64 (``scripts/bench_shift.py``),
    equal to the block means to rounding."""
    order = np.asarray(order)
    n = kernel.shape[0]
    ny = order.shape[-1] - nx
    a = np.zeros(order.shape[:-1] + (n,))
    np.put_along_axis(a, order[..., :nx], 1.0 / nx, axis=-1)
    np.put_along_axis(a, order[..., nx:], -1.0 / ny, axis=-1)
    return np.einsum("...i,...i->...", a @ kernel, a)


def mmd_permutation_test(x: np.ndarray, y: np.ndarray, n_resamples: int = 1000,
                         seed: int | np.random.Generator | None = 0) -> ShiftTest:
    """Two-sample kernel MMD test (Gretton et al. 2012) of ``x`` ``(n, d)`` against ``y`` ``(m, d)``: a Gaussian
    kernel whose width is the median pairwise distance of the pooled sample, the biased MMD^2 statistic, and
    a permutation p-value (:func:`scipy.stats.permutation_test` permuting the pooled indices)."""
    x, y = np.atleast_2d(np.asarray(x, float)), np.atleast_2d(np.asarray(y, float))
    if x.shape[0] < 2 or y.shape[0] < 2:
        raise DataError(f"a two-sample test needs at least 2 cases per sample (got {x.shape[0]} and {y.shape[0]})",
                        field="features")
    pooled = np.concatenate([x, y])
    d2 = euclidean_distances(pooled, squared=True)
    med = float(np.median(d2[np.triu_indices_from(d2, 1)]))
    kernel = np.exp(-d2 / max(med, 1e-12))
    nx = x.shape[0]

    def statistic(a: np.ndarray, b: np.ndarray, axis: int = -1) -> np.ndarray:
        return _mmd2(kernel, nx, np.concatenate([a, b], axis=-1).astype(int))

    idx = np.arange(pooled.shape[0])
    # one BLAS thread: the products are small (64 x n by n x n), and on a busy machine OpenBLAS's threads cost
    # more to wake than the product (a site assessment's MMD share, 2 cores with one taken: 1.7 s -> 0.1 s)
    with threadpool_limits(limits=1, user_api="blas"):
        res = stats.permutation_test((idx[:nx], idx[nx:]), statistic, permutation_type="independent",
                                     vectorized=True, n_resamples=n_resamples, alternative="greater",
                                     random_state=seed, batch=64)
    return ShiftTest(float(res.statistic), float(res.pvalue), int(nx), int(y.shape[0]))


def two_sample_test(x: np.ndarray, y: np.ndarray, n_resamples: int = 1000,
                    seed: int | np.random.Generator | None = 0) -> ShiftTest:
    """:func:`ks_permutation_test` for one-dimensional samples (scores), :func:`mmd_permutation_test` for
    ``(n, d)`` samples (embeddings)."""
    if np.ndim(x) == 2 and np.shape(x)[1] > 1:
        return mmd_permutation_test(x, y, n_resamples=n_resamples, seed=seed)
    return ks_permutation_test(np.ravel(x), np.ravel(y), n_resamples=n_resamples, seed=seed)


def reduce_features(source: np.ndarray, target: np.ndarray, n_components: int = 8) -> tuple[np.ndarray, np.ndarray]:
    """Both samples projected on the leading principal components of the two pooled (standardised by the
    pooled mean and SD; at most ``n_components``), the reduction Rabanser et al. pair with MMD.

    Fitted on the pooled cases, not on the source alone: components fitted to one sample give that sample
    more variance along them than new cases get (overfitting), which a two-sample test then reports as a
    shift (measured: 15 % false alarms at alpha 0.05 with 200 source cases in 16 dimensions)."""
    s, t = np.asarray(source, float), np.asarray(target, float)
    pooled = np.concatenate([s, t])
    mean, sd = pooled.mean(axis=0), pooled.std(axis=0)
    sd[sd < 1e-12] = 1.0
    k = int(max(1, min(n_components, s.shape[1], pooled.shape[0] - 1)))
    pca = PCA(n_components=k, random_state=0).fit((pooled - mean) / sd)
    return pca.transform((s - mean) / sd), pca.transform((t - mean) / sd)


def _confusion(source_scores: np.ndarray, source_labels: np.ndarray, threshold: float) -> tuple[float, float]:
    called = source_scores > threshold
    return float(called[source_labels == 1].mean()), float(called[source_labels == 0].mean())


def _check_source(scores: ArrayLike, labels: ArrayLike) -> tuple[np.ndarray, np.ndarray]:
    s, y = np.asarray(scores, float).ravel(), np.asarray(labels).ravel().astype(int)
    if s.shape != y.shape:
        raise DataError(f"{s.size} source scores but {y.size} labels", field="labels")
    if set(np.unique(y)) != {0, 1}:
        raise DataError("the source needs cancer and non-cancer cases", field="labels",
                        fix="use a reference split that holds both labels")
    return s, y


def bbse_prevalence(source_scores: ArrayLike, source_labels: ArrayLike, target_scores: ArrayLike,
                    threshold: float | None = None) -> float:
    """The target's prevalence by black-box shift estimation (Lipton et al. 2018), binary case.

    With the hard classifier ``score > t``, its true- and false-positive rates ``tpr``, ``fpr`` on the
    labelled source, and the fraction ``mu`` of target cases it calls positive, the prevalence ``q``
    solves ``mu = q tpr + (1 - q) fpr``: ``q = (mu - fpr) / (tpr - fpr)``, clipped to [0, 1].

    ``threshold`` defaults to the source's median score, where the rates are estimated on the most cases.
    A classifier no better than chance (``tpr <= fpr``) gives NaN: nothing can be estimated.
    """
    s, y = _check_source(source_scores, source_labels)
    t = float(np.median(s)) if threshold is None else float(threshold)
    tpr, fpr = _confusion(s, y, t)
    if tpr - fpr <= 1e-9:
        return float("nan")
    mu = float((np.asarray(target_scores, float) > t).mean())
    return float(np.clip((mu - fpr) / (tpr - fpr), 0.0, 1.0))


def prevalence_interval(source_scores: ArrayLike, source_labels: ArrayLike, target_scores: ArrayLike,
                        n_bootstrap: int = 1000, level: float = 0.95, seed: int = 0) -> tuple[float, float]:
    """A percentile bootstrap interval of :func:`bbse_prevalence`, resampling the source (within each
    label) and the target, so both the rates' and the target fraction's noise are in it."""
    s, y = _check_source(source_scores, source_labels)
    t_scores = np.asarray(target_scores, float).ravel()
    rng = np.random.default_rng(seed)
    pos, neg = np.flatnonzero(y == 1), np.flatnonzero(y == 0)
    est = []
    for _ in range(n_bootstrap):
        idx = np.concatenate([rng.choice(pos, pos.size), rng.choice(neg, neg.size)])
        q = bbse_prevalence(s[idx], y[idx], rng.choice(t_scores, t_scores.size), threshold=float(np.median(s)))
        if np.isfinite(q):
            est.append(q)
    if not est:
        return float("nan"), float("nan")
    lo, hi = np.quantile(est, [(1 - level) / 2, (1 + level) / 2])
    return float(lo), float(hi)


def call_rate_test(source_scores: ArrayLike, target_scores: ArrayLike) -> ShiftTest:
    """Did the prevalence :func:`bbse_prevalence` would estimate move? An exact test with both samples' error.

    At any threshold ``t``, BBSE on the labelled source itself gives back the source's own prevalence ``pi``
    (in-sample, its call fraction is ``mu_s = pi tpr + (1 - pi) fpr`` exactly), so the target's estimate differs
    from ``pi`` by ``(mu_t - mu_s) / (tpr - fpr)``: whether it moved is whether the share of cases called
    positive moved. Here ``t`` is the **pooled** median of the two samples, a symmetric function of them, so that
    under no change (both samples drawn from one law) the target's count above ``t``, given the pooled values, is
    hypergeometric: Fisher's exact test on the 2 x 2 table (above / not, source / target; two-sided) is exact at
    every sample size (conservative by its discreteness), and the source's own sampling error (its prevalence
    ``pi`` and its rates) is in it, which a bootstrap interval of the target's estimate against a fixed ``pi``
    leaves out (:func:`prevalence_interval`; measured in ``docs/results/hospital.md``, 2026-12-07).

    The statistic is ``mu_t - mu_s`` at the pooled median (no label is needed).
    """
    s = np.asarray(source_scores, float).ravel()
    t_scores = np.asarray(target_scores, float).ravel()
    if s.size == 0 or t_scores.size == 0:
        raise DataError("a call-rate test needs scores on both sides", field="scores")
    cut = float(np.median(np.concatenate([s, t_scores])))
    a, b = int((s > cut).sum()), int((t_scores > cut).sum())
    p = float(stats.fisher_exact([[a, s.size - a], [b, t_scores.size - b]]).pvalue)
    return ShiftTest(b / t_scores.size - a / s.size, min(1.0, p), int(s.size), int(t_scores.size))


def matched_reference(source_labels: ArrayLike, prevalence: float, rng: np.random.Generator) -> np.ndarray:
    """Indices of the largest class-stratified subsample of the source (drawn without replacement) whose
    share of label 1 is ``prevalence``: the source re-weighted to the target's class ratio."""
    y = np.asarray(source_labels).ravel().astype(int)
    pos, neg = np.flatnonzero(y == 1), np.flatnonzero(y == 0)
    q = float(np.clip(prevalence, 0.0, 1.0))
    sizes = [pos.size / q if q > 0 else np.inf, neg.size / (1 - q) if q < 1 else np.inf]
    m = min(sizes)
    n_pos = min(pos.size, int(round(m * q)))
    n_neg = min(neg.size, int(round(m * (1 - q))))
    return np.concatenate([rng.choice(pos, n_pos, replace=False), rng.choice(neg, n_neg, replace=False)])


def merge_pvalues(pvalues: ArrayLike) -> float:
    """Twice the median of p-values from the same hypothesis (valid under any dependence; Meng 1994,
    Vovk & Wang 2020), capped at 1: how the subsamples of :func:`label_shift_test` are combined."""
    return float(min(1.0, 2.0 * float(np.median(np.asarray(pvalues, float)))))


def label_shift_test(source_scores: ArrayLike, source_labels: ArrayLike, target_scores: ArrayLike,
                     prevalence: float | None = None, n_subsamples: int = 20, n_resamples: int = 1000,
                     seed: int = 0, source_features: np.ndarray | None = None,
                     target_features: np.ndarray | None = None) -> ShiftTest:
    """Did anything but the prevalence change? The target against the source re-weighted to the target's
    prevalence (``prevalence``, default :func:`bbse_prevalence` on the scores).

    The source is re-weighted by ``n_subsamples`` class-stratified subsamples with the target's class ratio
    (:func:`matched_reference`); each is compared with the target by :func:`two_sample_test` (the scores by
    KS, or, when ``source_features`` and ``target_features`` are given, those ``(n, d)`` embeddings by MMD),
    and the p-values are merged by :func:`merge_pvalues`. The statistic reported is the median over the
    subsamples. Under a pure prevalence change the p-value is (about) uniform; a change of ``p(x | y)``
    lowers it. A prevalence that cannot be estimated (a chance-level model) falls back to the source's own.
    """
    s, y = _check_source(source_scores, source_labels)
    t = np.asarray(target_scores, float).ravel()
    q = bbse_prevalence(s, y, t) if prevalence is None else float(prevalence)
    if not np.isfinite(q):
        q = float(y.mean())
    if (source_features is None) != (target_features is None):
        raise DataError("embeddings are needed for both the source and the target", field="features")
    src = s if source_features is None else np.asarray(source_features, float)
    tgt = t if target_features is None else np.asarray(target_features, float)
    if src.shape[0] != s.size or tgt.shape[0] != t.size:
        raise DataError("one embedding per score is needed", field="features")
    rng = np.random.default_rng(seed)
    stat, pvals, sizes = [], [], []
    for _ in range(n_subsamples):
        idx = matched_reference(y, q, rng)
        r = two_sample_test(src[idx], tgt, n_resamples=n_resamples, seed=rng)
        stat.append(r.statistic)
        pvals.append(r.pvalue)
        sizes.append(idx.size)
    return ShiftTest(float(np.median(stat)), merge_pvalues(pvals), int(np.median(sizes)), int(t.size),
                     prevalence=q, n_subsamples=n_subsamples)


def range_test(values: ArrayLike, low: float, high: float, expected: float = 0.02) -> tuple[int, int, float]:
    """``(outside, n, p)``: how many finite ``values`` lie outside ``[low, high]``, and the exact binomial
    p-value of that many or more when each falls outside with probability ``expected`` (0.02 for the
    training data's 1st-99th percentile range). NaN values are left out; no finite value gives ``p = 1``."""
    v = np.asarray(values, float)
    v = v[np.isfinite(v)]
    outside = int(((v < low) | (v > high)).sum())
    if not v.size:
        return 0, 0, 1.0
    return outside, int(v.size), float(stats.binomtest(outside, v.size, expected, alternative="greater").pvalue)


class EmbeddingRange:
    """Is one case's embedding like the reference's? Its distance to its ``k``-th nearest reference case (on the
    reference's standardised leading principal components; scikit-learn's ``NearestNeighbors``) against the
    ``quantile`` of the same distance for reference cases that were **not** in the fit: ``folds``-fold
    cross-fitting, each fold's cases measured against a reduction and neighbours fitted on the other folds, as
    a new case is. (Measuring the reference cases against a fit that contains them makes their distances
    smaller than a new case's: measured, 12 % of same-scanner CTs flagged instead of about 1 %.) Beyond the
    threshold (the conformal ``ceil((n + 1) quantile)``-th smallest held-out distance), an exchangeable new case
    lands with probability at most 1 - quantile; a reference too small for that level (fewer than
    ``1 / (1 - quantile) - 1`` cases: 99 at 0.99) gives an infinite threshold, and nothing is flagged. (The plain
    99th percentile of 41 validation cases flagged 7-10 % of same-scanner CTs.)"""

    def __init__(self, reference: np.ndarray, k: int = 5, quantile: float = 0.99, n_components: int = 8,
                 folds: int = 5, seed: int = 0):
        ref = np.asarray(reference, float)
        if ref.ndim != 2 or ref.shape[0] < max(2 * (k + 1), folds):
            raise DataError(f"an embedding range needs at least {max(2 * (k + 1), folds)} reference cases "
                            f"(got {len(ref)})", field="features")
        self.k, self.quantile, self.n_components = k, quantile, n_components
        self._fit = self._fitted(ref)
        order = np.random.default_rng(seed).permutation(len(ref))
        held = []
        for part in np.array_split(order, folds):
            rest = np.setdiff1d(order, part)
            held.append(self._distance(self._fitted(ref[rest]), ref[part]))
        # the conformal order statistic: a new exchangeable case exceeds it with probability at most 1 - quantile;
        # too few reference cases for that level give an infinite threshold (nothing can be flagged)
        held_out = np.sort(np.concatenate(held))
        rank = math.ceil((held_out.size + 1) * quantile)
        self.threshold = float(held_out[rank - 1]) if rank <= held_out.size else math.inf

    def _fitted(self, ref: np.ndarray) -> tuple[np.ndarray, np.ndarray, PCA, NearestNeighbors]:
        mean, sd = ref.mean(axis=0), ref.std(axis=0)
        sd[sd < 1e-12] = 1.0
        n = int(max(1, min(self.n_components, ref.shape[1], ref.shape[0] - 1)))
        pca = PCA(n_components=n, random_state=0).fit((ref - mean) / sd)
        nn = NearestNeighbors(n_neighbors=min(self.k, len(ref))).fit(pca.transform((ref - mean) / sd))
        return mean, sd, pca, nn

    def _distance(self, fit: tuple[np.ndarray, np.ndarray, PCA, NearestNeighbors], cases: np.ndarray) -> np.ndarray:
        mean, sd, pca, nn = fit
        z = pca.transform((np.atleast_2d(np.asarray(cases, float)) - mean) / sd)
        return nn.kneighbors(z)[0][:, -1]

    def distance(self, cases: np.ndarray) -> np.ndarray:
        """Each case's distance to its ``k``-th nearest reference case."""
        return self._distance(self._fit, cases)

    def outside(self, cases: np.ndarray) -> np.ndarray:
        """True for each case beyond :attr:`threshold`."""
        return self.distance(cases) > self.threshold


@dataclass(frozen=True)
class DomainEffect:
    """How far a site's embeddings are from the reference's, as the AUC of a cross-validated classifier that
    tells them apart (0.5: not at all), with its 95 % CI, and the smallest AUC these numbers of cases
    could have shown (``mde``: one-sided level ``alpha``, power 0.8, the Hanley-McNeil variance under no
    difference)."""

    auc: float
    ci: tuple[float, float]
    mde: float
    n_site: int
    n_reference: int
    threshold: float = EFFECT_AUC

    @property
    def large(self) -> bool:
        """The point estimate reaches :data:`EFFECT_AUC` (a difference worth acting on, not only a significant one)."""
        return math.isfinite(self.auc) and self.auc >= self.threshold

    def as_dict(self) -> dict[str, float | int | bool | list[float]]:
        return {"auc": self.auc, "ci": list(self.ci), "mde": self.mde, "n_site": self.n_site,
                "n_reference": self.n_reference, "threshold": self.threshold, "large": self.large}


def minimum_detectable_auc(n_site: int, n_reference: int, alpha: float = 0.05, power: float = 0.8) -> float:
    """The smallest AUC above 0.5 a one-sided test at ``alpha`` detects with ``power``, for these sample sizes
    (the AUC's standard error under no difference, ``sqrt((n1 + n2 + 1) / (12 n1 n2))``; Hanley and McNeil 1982)."""
    if n_site < 1 or n_reference < 1:
        return math.nan
    se = math.sqrt((n_site + n_reference + 1) / (12.0 * n_site * n_reference))
    return min(1.0, 0.5 + (stats.norm.ppf(1 - alpha) + stats.norm.ppf(power)) * se)


def _hanley_mcneil_ci(auc: float, n_pos: int, n_neg: int, level: float = 0.95) -> tuple[float, float]:
    """A normal CI of an AUC from the Hanley-McNeil (1982) standard error (clipped to [0, 1])."""
    q1, q2 = auc / (2 - auc), 2 * auc**2 / (1 + auc)
    var = (auc * (1 - auc) + (n_pos - 1) * (q1 - auc**2) + (n_neg - 1) * (q2 - auc**2)) / (n_pos * n_neg)
    z = float(stats.norm.ppf(0.5 + level / 2))
    half = z * math.sqrt(max(var, 0.0))
    return max(0.0, auc - half), min(1.0, auc + half)


def domain_effect(source_features: ArrayLike, target_features: ArrayLike, *, source_weights: ArrayLike | None = None,
                  folds: int = 5, alpha: float = 0.05, seed: int = 0) -> DomainEffect:
    """The effect size of a site's difference (:class:`DomainEffect`): a logistic regression on the two samples'
    leading principal components (:func:`reduce_features`) and their squares, each case scored out of fold
    (``folds``-fold, stratified), and the AUC of those scores, with a 95 % CI from the Hanley-McNeil standard
    error.

    ``source_weights`` (one per reference case, e.g. the prevalence ratio of each case's class) re-weight the
    reference in the fit and in the AUC, so that a change of prevalence alone is not counted as a difference
    (as the re-weighted tests of :func:`label_shift_test` do).

    References:
        Hanley, McNeil. "The meaning and use of the area under a receiver operating characteristic (ROC)
        curve." Radiology 143, 29-36 (1982). https://doi.org/10.1148/radiology.143.1.7063747
        Lipton, Wang, Smola. "Detecting and correcting for label shift with black box predictors." ICML 2018
        (the re-weighting by class).
    """
    a, b = reduce_features(np.asarray(source_features, float), np.asarray(target_features, float))
    n_s, n_t = len(a), len(b)
    k = int(min(folds, n_s, n_t))
    if k < 2:
        raise DataError(f"an effect size needs at least 2 cases on each side (got {n_s} and {n_t})", field="features")
    x = np.concatenate([a, b])
    x = np.concatenate([x, x**2], axis=1)  # the squares see a change of spread (a noisier scanner), not only of mean
    y = np.concatenate([np.zeros(n_s, int), np.ones(n_t, int)])
    w = np.concatenate([np.ones(n_s) if source_weights is None else np.asarray(source_weights, float),
                        np.ones(n_t)])
    scores = np.empty(len(y))
    for train, test in StratifiedKFold(n_splits=k, shuffle=True, random_state=seed).split(x, y):
        clf = LogisticRegression(max_iter=1000).fit(x[train], y[train], sample_weight=w[train])
        scores[test] = clf.decision_function(x[test])
    auc = float(roc_auc_score(y, scores, sample_weight=w))
    return DomainEffect(auc, _hanley_mcneil_ci(auc, n_t, n_s), float(minimum_detectable_auc(n_t, n_s, alpha)),
                        n_t, n_s)
