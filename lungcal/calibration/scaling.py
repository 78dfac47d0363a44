"""Post-hoc calibrators fitted on held-out **logits** (never on test data).

All share one interface::

    cal = make_calibrator("platt").fit(val_logits, val_labels)   # returns self
    cal.transform(test_logits)        # calibrated logits (log-probabilities for the binning ones)
    cal.predict_proba(test_logits)    # calibrated probabilities
    cal.fit_info                      # {"converged", "at_bound", "n", "n_events", ...}
    text = cal.to_json(); same = calibrator_from_json(text)   # plain JSON, no pickle

Inputs are ``(N, C)`` logits, or ``(N,)`` logits of a binary model (read as ``[0, z]``), as
numpy arrays or torch tensors; outputs keep the input's type (numpy in -> numpy out, tensor in ->
tensor out) and its shape: ``(N, C)`` in -> ``(N, C)`` out, ``(N,)`` in -> ``(N,)`` out (the
calibrated binary logit from ``transform``, p(y=1) from ``predict_proba``). Probabilities given
where logits are expected are refused with :class:`lungcal.errors.DataError` (temperature
scaling of probabilities is a silent, classic bug): rows in [0, 1] that sum to 1 always, and, for
the calibrators that are not invariant to a per-row shift of the logits (vector, matrix) or for
``(N,)`` input, any input with every value in [0, 1]. Labels of one class only are refused.

* :class:`TemperatureScaler` (``"ts"``): ``z / T``; never changes the argmax.
* :class:`PlattScaler` (``"platt"``): ``sigmoid(a (z1 - z0) + b)``, binary only.
* :class:`VectorScaler` (``"vector"``): ``z * w + b``; :class:`MatrixScaler`: ``W z + b``.
* :class:`HistogramBinning` (``"histogram"``), :class:`IsotonicCalibrator` (``"isotonic"``).

Every ``state_dict()`` is plain JSON data (lists, floats, ints, str, bool, None for nan) with a
``"name"`` key, so a stored calibrator survives library upgrades; :data:`CALIBRATORS` maps names
to classes, :func:`select_calibrator` picks one by cross-validated NLL and :func:`fit_warnings`
says when a fit is "no signal" rather than a result.

This module is longer than the house ~400 lines on purpose: the calibrators share one base
class, one input check, one JSON state format, the registry and the selection over them
(docs/architecture.md and the design map put them together in ``scaling.py``).
"""
from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any, Literal, overload

import numpy as np
import torch
import torch.nn.functional as F
from scipy.optimize import isotonic_regression, minimize_scalar
from scipy.stats import mannwhitneyu

from lungcal.calibration._logistic import fit_logistic
from lungcal.errors import ConfigError, DataError

__all__ = [
    "CALIBRATORS",
    "make_calibrator",
    "calibrator_from_json",
    "select_calibrator",
    "fit_warnings",
    "no_signal",
    "probabilities",
    "calibrated_probs",
    "TemperatureScaler",
    "PlattScaler",
    "VectorScaler",
    "MatrixScaler",
    "HistogramBinning",
    "IsotonicCalibrator",
]

#: Fewer cases than this in the rarer class of the fit split: :func:`fit_warnings` says CIs are wide.
FEW_EVENTS = 100
#: Mann-Whitney p-value at or above which the fit split's AUC is "~ chance" in :func:`fit_warnings`.
CHANCE_P = 0.05


# ----------------------------------------------------------------------------- input helpers
def _to_tensor(x: Any) -> tuple[torch.Tensor, bool]:
    """-> (float64 CPU tensor, was_numpy)."""
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().to(torch.float64), False
    return torch.as_tensor(np.asarray(x), dtype=torch.float64), True


def _back(t: torch.Tensor, as_numpy: bool, like: Any = None):
    if as_numpy:
        return t.numpy()
    if isinstance(like, torch.Tensor):
        dtype = like.dtype if like.is_floating_point() else torch.float32
        return t.to(device=like.device, dtype=dtype)
    return t


def _check_logits(logits: Any, name: str = "logits", strict: bool = True) -> tuple[torch.Tensor, bool, bool]:
    """-> ``(z (N, C) float64, was_numpy, was_1d)``; ``(N,)`` input becomes ``[0, z]``.

    ``strict=False`` (calibrators invariant to a per-row shift of z) refuses only rows in [0, 1]
    that sum to 1, so a weak model's genuine logits that all lie in [0, 1] are accepted.
    """
    z, as_np = _to_tensor(logits)
    one_d = z.ndim == 1
    if one_d:
        z = torch.stack([torch.zeros_like(z), z], dim=1)
    if z.ndim != 2 or z.shape[1] < 2:
        raise DataError(f"{name} must be (N, C) with C >= 2 or (N,) binary logits, got shape {tuple(z.shape)}",
                        field=name, fix="pass the model's raw class scores; a binary model emits 2 logits "
                                        "or a single logit z per case")
    if z.shape[0] == 0:
        raise DataError(f"{name} is empty", field=name, fix="pass at least one sample")
    zn = z.numpy()  # checks in numpy: cheaper than small torch ops on a loaded machine
    if not np.isfinite(zn).all():
        raise DataError(f"{name} contain NaN or inf", field=name, fix="check the model outputs")
    if bool(zn.min() >= 0 and zn.max() <= 1):
        sums1 = not one_d and bool(np.allclose(zn.sum(1), 1.0, rtol=0, atol=1e-4))
        if sums1 or strict or one_d:
            what = "rows in [0, 1] that sum to 1" if sums1 else "every value in [0, 1]"
            raise DataError(
                f"{name} look like probabilities ({what}); calibrators need raw logits", field=name,
                fix="pass the pre-softmax outputs of the model (or torch.log(probs) if only "
                    "probabilities are available)",
            )
    return z, as_np, one_d


def _check_labels(labels: Any, n: int, c: int, fitting: bool = False) -> torch.Tensor:
    y = labels.detach().cpu() if isinstance(labels, torch.Tensor) else torch.as_tensor(np.asarray(labels))
    if y.ndim == 2 and y.shape[1] == 1:
        y = y[:, 0]
    if y.ndim != 1 or y.shape[0] != n:
        raise DataError(f"labels must be ({n},) class indices, got shape {tuple(y.shape)}",
                        field="labels", fix="pass one integer label per row of logits")
    if y.is_floating_point() and not torch.equal(y, y.round()):
        raise DataError("labels are not integral", field="labels", fix="pass class indices")
    y = y.long()
    if int(y.min()) < 0 or int(y.max()) >= c:
        raise DataError(f"labels span [{int(y.min())}, {int(y.max())}] for {c} classes",
                        field="labels", fix=f"labels must be in [0, {c})")
    if fitting and int(y.min()) == int(y.max()):
        raise DataError(f"the fit split has labels of one class only (all {int(y[0])}): nothing to calibrate "
                        "against", field="labels",
                        fix="fit on a split that holds both outcomes (e.g. a larger or re-drawn validation split)")
    return y


def _nll(z: torch.Tensor, y: torch.Tensor) -> float:
    """Mean NLL of softmax(z) (float64; equals ``F.cross_entropy(z, y)``)."""
    zn, yn = z.numpy(), y.numpy()
    zmax = zn.max(1)
    lse = zmax + np.log(np.exp(zn - zmax[:, None]).sum(1))
    return float(np.mean(lse - zn[np.arange(zn.shape[0]), yn]))


def _softmax_np(z: np.ndarray) -> np.ndarray:
    """Row softmax in float64 numpy (calibration inputs are small: numpy avoids torch's thread
    start-up, which dominates on a loaded machine)."""
    e = np.exp(z - z.max(1, keepdims=True))
    return e / e.sum(1, keepdims=True)


def _plain(v: Any) -> Any:
    """JSON-able copy: tensors / arrays -> lists, numpy scalars -> Python, nan / inf -> None."""
    if isinstance(v, torch.Tensor):
        v = v.detach().cpu().numpy()
    if isinstance(v, np.ndarray):
        return _plain(v.tolist())
    if isinstance(v, dict):
        return {str(k): _plain(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [_plain(x) for x in v]
    if isinstance(v, np.generic):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


def _num(v: Any) -> float:
    """Inverse of :func:`_plain` for one float (None -> nan)."""
    return float("nan") if v is None else float(v)


def _lbfgs(params: list[torch.Tensor], closure_loss, max_iter: int = 200) -> bool:
    """Full-batch LBFGS with strong Wolfe line search; False if the result is not finite."""
    opt = torch.optim.LBFGS(params, lr=1.0, max_iter=max_iter, tolerance_grad=1e-9,
                            tolerance_change=1e-12, history_size=20, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = closure_loss()
        loss.backward()
        return loss

    try:
        opt.step(closure)
    except RuntimeError:
        return False
    return all(bool(torch.isfinite(p).all()) for p in params)


def _signal_test(z: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """AUC of the logits on the labels and the two-sided Mann-Whitney p-value of "no signal".

    Binary: the score is ``z1 - z0``. C > 2: one-vs-rest on log-softmax, macro AUC, and the
    smallest class p-value times C (Bonferroni).
    """
    zn, yn = z.numpy(), y.numpy()
    scores = [zn[:, 1] - zn[:, 0]] if zn.shape[1] == 2 else list(np.log(_softmax_np(zn)).T)
    classes = [1] if zn.shape[1] == 2 else range(zn.shape[1])
    aucs, pvals = [], []
    for k, s in zip(classes, scores, strict=True):
        pos, neg = s[yn == k], s[yn != k]
        if pos.size == 0 or neg.size == 0:
            continue
        res = mannwhitneyu(pos, neg, alternative="two-sided")
        aucs.append(float(res.statistic) / (pos.size * neg.size))
        pvals.append(float(res.pvalue))
    if not aucs:
        return float("nan"), float("nan")
    return float(np.mean(aucs)), min(1.0, min(pvals) * len(pvals))


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


# ----------------------------------------------------------------------------- public functions
@overload
def make_calibrator(name: Literal["ts"], **kwargs) -> TemperatureScaler: ...
@overload
def make_calibrator(name: str, **kwargs) -> _Calibrator: ...
def make_calibrator(name: str, **kwargs) -> _Calibrator:
    """A new, unfitted calibrator by registry name (see :data:`CALIBRATORS`), e.g.
    ``make_calibrator("histogram", n_bins=10)``; ConfigError naming the valid names otherwise."""
    if name not in CALIBRATORS:
        raise ConfigError(f"unknown calibrator {name!r}", field="method",
                          fix=f"use one of: {', '.join(CALIBRATORS)}")
    return CALIBRATORS[name](**kwargs)


def calibrator_from_json(text: str) -> _Calibrator:
    """Rebuild a fitted calibrator from ``cal.to_json()`` (its class comes from the ``"name"`` key).

    Write the text with ``lungcal.paths.atomic_write_text(path, cal.to_json())`` and read it back
    with ``calibrator_from_json(path.read_text())``.
    """
    try:
        state = json.loads(text)
    except json.JSONDecodeError as e:
        raise DataError(f"calibrator JSON does not parse ({e.msg} at line {e.lineno})", field="calibrator",
                        fix="pass the text written by Calibrator.to_json()") from e
    name = state.get("name") if isinstance(state, dict) else None
    if name not in _LOADABLE:
        raise DataError(f"calibrator JSON has name {name!r}", field="name",
                        fix=f"pass the text written by Calibrator.to_json(); known names: {', '.join(_LOADABLE)}")
    return _LOADABLE[name]().load_state_dict(state)


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


def probabilities(logits, temperature: float = 1.0) -> np.ndarray:
    """Softmax of ``logits / temperature`` as float64 ``(N, C)``."""
    t = torch.as_tensor(np.asarray(logits), dtype=torch.float64)
    return torch.softmax(t / float(temperature), dim=1).numpy()


def calibrated_probs(calibrator, logits) -> np.ndarray:
    """``(N, C)`` float64 probabilities of ``calibrator`` (``None`` = plain softmax) on ``logits``."""
    z = np.asarray(logits, dtype=np.float64)
    if calibrator is None:
        return probabilities(z)
    if getattr(calibrator, "name", "") == "ts":  # softmax(z / T) in float64, as the stage-1 run reports it
        return probabilities(z, calibrator.temperature)
    return np.asarray(calibrator.predict_proba(z), dtype=np.float64)


def fit_warnings(calibrator: _Calibrator, logits, labels) -> list[str]:
    """Why a fitted calibrator is "no signal" rather than a result, as short sentences.

    Checks the calibrator's ``fit_info`` (a parameter on its bound, e.g. ``"temperature at its
    bound 100: no signal"``, or at 0.01: separated classes; a fit that did not converge; a Platt
    slope <= 0) and the fit split
    itself: its AUC is "~ chance" when the two-sided Mann-Whitney p-value of the logits is
    >= :data:`CHANCE_P`, and its CIs are wide when the rarer class has fewer than
    :data:`FEW_EVENTS` cases. An empty list means nothing to flag.

    Args:
        calibrator: a fitted calibrator. logits, labels: the split it was fitted on.
    """
    calibrator._require_fit()
    z, _, _ = _check_logits(logits, strict=False)
    y = _check_labels(labels, z.shape[0], z.shape[1], fitting=True)
    out = []
    info = calibrator.fit_info
    if isinstance(calibrator, TemperatureScaler) and info.get("at_bound"):
        t = calibrator.temperature
        why = "no signal" if t > 1 else "the classes are (nearly) separated on the fit split: not a result"
        out.append(f"temperature at its bound {t:.3g}: {why}")
    elif info.get("at_bound"):
        out.append(f"{calibrator.name}: a parameter is at its bound: no signal")
    if not info.get("converged", True):
        why = " (the classes are separated on the fit split)" if info.get("separated") else ""
        out.append(f"{calibrator.name}: the fit did not converge{why}: not a result")
    if isinstance(calibrator, PlattScaler) and calibrator.slope <= 0:
        out.append(f"Platt slope {calibrator.slope:.3g} <= 0: no signal")
    auc, p = _signal_test(z, y)
    if not p < CHANCE_P:
        out.append(f"validation AUC {auc:.2f} ~ chance (Mann-Whitney p = {p:.2g})")
    counts = np.bincount(y.numpy(), minlength=z.shape[1])
    rare = int(counts[counts > 0].min())
    if rare < FEW_EVENTS:
        out.append(f"only {rare} cases of the rarer class (< {FEW_EVENTS}) in the fit split: CIs are wide")
    return out


def no_signal(warnings: Sequence[str]) -> list[str]:
    """The warnings of :func:`fit_warnings` that make a fit "no signal" (all but the few-events one)."""
    return [w for w in warnings if "CIs are wide" not in w]


# ----------------------------------------------------------------------------- base class
class _Calibrator:
    """Shared plumbing: input checks, type / shape round-trip, predict_proba = softmax(transform),
    JSON state (``state_dict`` = ``{"name", **_state(), "fit_info"}``)."""

    name = ""
    #: softmax(calibrated z) unchanged by z + c per row: logits in [0, 1] need not be probabilities
    _shift_invariant = True
    n_classes: int | None = None

    def __init__(self) -> None:
        self.n_classes = None
        self.fit_info: dict[str, Any] = {}

    def _require_fit(self) -> None:
        if self.n_classes is None:
            raise RuntimeError(f"{type(self).__name__} is not fitted; call .fit(logits, labels) first")

    def _fit_inputs(self, logits, labels) -> tuple[torch.Tensor, torch.Tensor]:
        z, _, _ = _check_logits(logits, strict=not self._shift_invariant)
        y = _check_labels(labels, z.shape[0], z.shape[1], fitting=True)
        counts = torch.bincount(y, minlength=z.shape[1])
        self.fit_info = {"converged": True, "at_bound": False, "n": int(z.shape[0]),
                         "n_events": int(counts[counts > 0].min())}
        return z, y

    def _prep(self, logits):
        self._require_fit()
        z, as_np, one_d = _check_logits(logits, strict=not self._shift_invariant)
        if z.shape[1] != self.n_classes:
            raise DataError(f"logits have {z.shape[1]} classes, the calibrator was fitted on "
                            f"{self.n_classes}", field="logits", fix="use logits of the same model")
        return z, as_np, one_d

    def fit(self, logits, labels) -> _Calibrator:  # pragma: no cover - abstract
        """Fit on ``(N, C)`` (or ``(N,)`` binary) logits and integer labels; returns self."""
        raise NotImplementedError

    def _transform(self, z: torch.Tensor) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def transform(self, logits):
        """Calibrated logits, same type and shape as the input (``(N,)``: the binary logit)."""
        z, as_np, one_d = self._prep(logits)
        out = self._transform(z)
        return _back(out[:, 1] - out[:, 0] if one_d else out, as_np, logits)

    def predict_proba(self, logits):
        """Calibrated probabilities: ``(N, C)`` rows summing to 1, or ``(N,)`` p(y=1) for ``(N,)`` input."""
        z, as_np, one_d = self._prep(logits)
        p = torch.from_numpy(_softmax_np(self._transform(z).numpy()))
        return _back(p[:, 1] if one_d else p, as_np, logits)

    def __call__(self, logits):
        return self.transform(logits)

    def _state(self) -> dict:  # pragma: no cover - abstract
        raise NotImplementedError

    def _load(self, state: dict) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def state_dict(self) -> dict:
        """Plain JSON data: ``{"name", ...parameters..., "n_classes", "fit_info"}`` (nan -> None)."""
        self._require_fit()
        return _plain({"name": self.name, **self._state(), "n_classes": self.n_classes, "fit_info": self.fit_info})

    def load_state_dict(self, state: dict):
        """Restore from :meth:`state_dict` output (or its JSON); returns self."""
        if state.get("name", self.name) != self.name:
            raise DataError(f"state is of a {state['name']!r} calibrator, not {self.name!r}", field="name",
                            fix="rebuild it with calibrator_from_json(), which picks the class by name")
        self._load(state)
        self.n_classes = int(state["n_classes"])
        self.fit_info = dict(state.get("fit_info") or {})
        return self

    def to_json(self) -> str:
        """The state as strict JSON text (see :func:`calibrator_from_json`)."""
        return json.dumps(self.state_dict(), allow_nan=False, sort_keys=True)


# ----------------------------------------------------------------------------- temperature
def _ts_objective(z: np.ndarray, zy: np.ndarray, zmax: np.ndarray, u: float):
    """Mean NLL of ``softmax(z / T)`` at ``u = log T`` and its first two derivatives in u.

    With ``s = z / T`` and ``p = softmax(s)``, ``NLL(u) = mean(logsumexp(s) - s_y)`` and, since
    ``ds/du = -s``::

        dNLL/du   = mean(s_y - E_p[s])
        d2NLL/du2 = mean(Var_p[s]) - dNLL/du

    (float64, vectorised over samples; checked against finite differences in the tests).
    """
    beta = math.exp(-u)
    s = z * beta
    e = np.exp(s - (zmax * beta)[:, None])
    zsum = e.sum(1)
    es = (e * s).sum(1) / zsum
    es2 = (e * s * s).sum(1) / zsum
    sy = zy * beta
    nll = float(np.mean(zmax * beta + np.log(zsum) - sy))
    g = float(np.mean(sy - es))
    h = float(np.mean(es2 - es * es)) - g
    return nll, g, h


def _newton_log_t(z: np.ndarray, y: np.ndarray, lo: float, hi: float,
                  max_iter: int = 100, tol: float = 1e-10) -> float | None:
    """Safeguarded Newton on ``u = log T`` from u = 0: Newton steps where the curvature is
    positive, gradient steps otherwise, each backtracked until the NLL does not increase and
    kept inside ``[lo, hi]``. Returns u, or None when it does not converge."""
    zy = z[np.arange(z.shape[0]), y]
    zmax = z.max(1)
    u = 0.0
    f, g, h = _ts_objective(z, zy, zmax, u)
    for _ in range(max_iter):
        step = -g / h if h > 0 else -g
        step = max(min(step, 2.0), -2.0)  # at most a factor e^2 in T per iteration
        for _ in range(60):
            un = min(max(u + step, lo), hi)
            fn, gn, hn = _ts_objective(z, zy, zmax, un)
            if fn <= f + 1e-15 * abs(f):
                break
            step *= 0.5
        else:  # no decrease left within float64 rounding: stationary if the slope is ~0
            return u if abs(g) < 1e-8 else None
        done = abs(un - u) < tol or abs(gn) < 1e-13
        u, f, g, h = un, fn, gn, hn
        if done:
            return u if math.isfinite(u) else None
    return None


#: A fitted log T within this distance of log(bound) is "at its bound".
_BOUND_TOL = 1e-3


class TemperatureScaler(_Calibrator):
    """Temperature scaling: ``softmax(z / T)`` with one scalar T > 0.

    ``fit`` first centres each row of the logits (``z - mean(z)``, which leaves softmax(z / T)
    unchanged; ``lungcal.engine.model.heads.fit_temperature`` did this around the scaler before, and
    the fitted T is the same), then minimises the mean NLL over ``log T`` (so T stays positive)
    in float64 numpy with a safeguarded Newton method that uses the analytic first and second
    derivatives of the NLL in log T (see :func:`_ts_objective`), starting at T = 1. If it fails
    (no convergence, non-finite result, NLL worse than at T = 1, or T at/outside ``bounds``) a
    bounded 1-D search (``scipy.optimize.minimize_scalar(method="bounded")`` on log T) is used
    instead; ``method`` records which one produced the result. The NLL is convex in 1/T, so both
    find the same optimum when it lies within ``bounds``. A T within 0.1% of a bound is flagged
    ``fit_info["at_bound"]``: the logits carry no usable signal (or far too much confidence).

    Logits with every value in [0, 1] are accepted (a weak model's genuine logits); rows in
    [0, 1] that sum to 1 are refused as probabilities. ``transform`` returns ``z / T`` (not
    centred); ``predict_proba`` is its softmax.

    Attributes (after fit): ``temperature`` (T), ``nll_before`` (at T = 1), ``nll_after``,
    ``method`` (``"newton"`` or ``"bounded"``), ``n_classes``, ``fit_info``.

    Args:
        bounds: allowed range of T for the fallback search (and the Newton sanity check).

    References:
        Guo, Pleiss, Sun, Weinberger. "On Calibration of Modern Neural Networks." ICML 2017.
        https://arxiv.org/abs/1706.04599
    """

    name = "ts"

    def __init__(self, bounds: tuple[float, float] = (1e-2, 1e2)) -> None:
        super().__init__()
        if not 0 < bounds[0] < 1 < bounds[1]:
            raise ValueError(f"bounds must satisfy 0 < low < 1 < high, got {bounds}")
        self.bounds = (float(bounds[0]), float(bounds[1]))
        self.log_temperature = 0.0
        self.nll_before = float("nan")
        self.nll_after = float("nan")
        self.method = ""

    @property
    def temperature(self) -> float:
        return math.exp(self.log_temperature)

    def fit(self, logits, labels) -> TemperatureScaler:
        """Fit T on held-out logits ``(N, C)`` / ``(N,)`` and labels ``(N,)``; returns self."""
        z, y = self._fit_inputs(logits, labels)
        z = z - z.mean(dim=1, keepdim=True)  # softmax(z / T) is invariant to a per-row shift
        self.nll_before = _nll(z, y)
        zn, yn = z.numpy(), y.numpy()
        lo, hi = math.log(self.bounds[0]), math.log(self.bounds[1])
        cand = _newton_log_t(zn, yn, lo, hi)
        if cand is not None and not (lo < cand < hi and _nll(z / math.exp(cand), y) <= self.nll_before + 1e-12):
            cand = None  # off the open interval, or no better than T = 1: the bounded search decides
        converged = True
        if cand is not None:
            self.log_temperature, self.method = cand, "newton"
        else:
            zy, zmax = zn[np.arange(zn.shape[0]), yn], zn.max(1)
            res = minimize_scalar(lambda u: _ts_objective(zn, zy, zmax, u)[0], bounds=(lo, hi),
                                  method="bounded", options={"xatol": 1e-8})
            self.log_temperature, self.method, converged = float(res.x), "bounded", bool(res.success)
        self.n_classes = int(z.shape[1])
        self.nll_after = _nll(z / self.temperature, y)
        at_bound = min(abs(self.log_temperature - lo), abs(self.log_temperature - hi)) < _BOUND_TOL
        self.fit_info.update(converged=converged, at_bound=at_bound, method=self.method)
        return self

    def _transform(self, z: torch.Tensor) -> torch.Tensor:
        return z / self.temperature

    def _state(self) -> dict:
        return {"temperature": self.temperature, "log_temperature": self.log_temperature,
                "nll_before": self.nll_before, "nll_after": self.nll_after,
                "method": self.method, "bounds": list(self.bounds)}

    def _load(self, state: dict) -> None:
        self.log_temperature = float(state["log_temperature"])
        self.nll_before = _num(state.get("nll_before"))
        self.nll_after = _num(state.get("nll_after"))
        self.method = str(state.get("method", ""))
        if "bounds" in state:
            self.bounds = (float(state["bounds"][0]), float(state["bounds"][1]))

    def __repr__(self) -> str:
        return f"TemperatureScaler(T={self.temperature:.4f}, method={self.method!r})"


# ----------------------------------------------------------------------------- Platt
class PlattScaler(_Calibrator):
    """Platt scaling (logistic recalibration) of a binary model: ``p = sigmoid(a z + b)`` with the
    binary logit ``z = z1 - z0`` (``(N, 2)`` logits) or ``z`` itself (``(N,)`` logits).

    Unlike temperature scaling it has an intercept, so it also corrects calibration-in-the-large
    (e.g. a change of prevalence between the training site and this one); like TS it is monotone
    in z for ``a > 0`` and leaves the AUC unchanged. ``(a, b)`` is the maximum-likelihood fit
    (mean NLL, Newton's method in float64 via :mod:`._logistic`), i.e. the logistic regression of
    y on z; Platt's (1999) smoothed targets ``(N+ + 1) / (N+ + 2)`` are not used. When the classes
    are separated on the fit split the MLE does not exist: the iterations are capped and
    ``fit_info`` says ``converged=False, separated=True``.

    ``transform`` returns ``[0, a z + b]`` for ``(N, 2)`` input (``a z + b`` for ``(N,)``).

    Attributes (after fit): ``slope`` (a), ``intercept`` (b), ``nll_before``, ``nll_after``,
    ``n_classes`` (2), ``fit_info``.

    References:
        Platt. "Probabilistic Outputs for Support Vector Machines and Comparisons to Regularized
        Likelihood Methods." Advances in Large Margin Classifiers, MIT Press (1999).
        https://home.cs.colorado.edu/~mozer/Teaching/syllabi/6622/papers/Platt1999.pdf
        Cox. "Two further applications of a model for binary regression." Biometrika 45 (1958).
        https://doi.org/10.1093/biomet/45.3-4.562
    """

    name = "platt"

    def __init__(self, max_iter: int = 100) -> None:
        super().__init__()
        self.max_iter = int(max_iter)
        self.slope = 1.0
        self.intercept = 0.0
        self.nll_before = float("nan")
        self.nll_after = float("nan")

    def fit(self, logits, labels) -> PlattScaler:
        """Fit ``(a, b)`` on held-out binary logits and 0/1 labels; returns self."""
        z, y = self._fit_inputs(logits, labels)
        if z.shape[1] != 2:
            raise DataError(f"PlattScaler is for binary models, got {z.shape[1]} classes", field="logits",
                            fix="use 'ts' or 'vector' for C > 2")
        s = (z[:, 1] - z[:, 0]).numpy()
        self.nll_before = _nll(z, y)
        self.intercept, self.slope, ok = fit_logistic(s, y.numpy().astype(np.float64), max_iter=self.max_iter)
        self.n_classes = 2
        self.nll_after = _nll(self._transform(z), y)
        self.fit_info.update(converged=ok, separated=not ok)
        return self

    def _transform(self, z: torch.Tensor) -> torch.Tensor:
        s = self.slope * (z[:, 1] - z[:, 0]) + self.intercept
        return torch.stack([torch.zeros_like(s), s], dim=1)

    def _state(self) -> dict:
        return {"slope": self.slope, "intercept": self.intercept, "max_iter": self.max_iter,
                "nll_before": self.nll_before, "nll_after": self.nll_after}

    def _load(self, state: dict) -> None:
        self.slope, self.intercept = float(state["slope"]), float(state["intercept"])
        self.max_iter = int(state.get("max_iter", self.max_iter))
        self.nll_before = _num(state.get("nll_before"))
        self.nll_after = _num(state.get("nll_after"))

    def __repr__(self) -> str:
        return f"PlattScaler(slope={self.slope:.4f}, intercept={self.intercept:.4f})"


# ----------------------------------------------------------------------------- vector / matrix
class _AffineScaler(_Calibrator):
    _shift_invariant = False

    def __init__(self, reg: float = 0.0) -> None:
        super().__init__()
        self.reg = float(reg)
        self.weight: torch.Tensor | None = None
        self.bias: torch.Tensor | None = None
        self.nll_before = float("nan")
        self.nll_after = float("nan")

    def _init_weight(self, c: int) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def _apply(self, z, w, b):  # pragma: no cover - abstract
        raise NotImplementedError

    def _penalty(self, w, b):
        return 0.0

    def fit(self, logits, labels):
        """Fit the parameters by (regularised) NLL with LBFGS; returns self."""
        z, y = self._fit_inputs(logits, labels)
        c = z.shape[1]
        self.nll_before = _nll(z, y)
        w = self._init_weight(c).requires_grad_(True)
        b = torch.zeros(c, dtype=torch.float64, requires_grad=True)
        ok = _lbfgs([w, b], lambda: F.cross_entropy(self._apply(z, w, b), y) + self._penalty(w, b))
        if not ok:
            raise RuntimeError(f"{type(self).__name__}: LBFGS diverged; try a larger reg")
        self.weight, self.bias = w.detach(), b.detach()
        self.n_classes = int(c)
        self.nll_after = _nll(self._transform(z), y)
        return self

    def _transform(self, z):
        return self._apply(z, self.weight, self.bias)

    def _state(self) -> dict:
        return {"weight": self.weight, "bias": self.bias, "reg": self.reg,
                "nll_before": self.nll_before, "nll_after": self.nll_after}

    def _load(self, state: dict) -> None:
        self.weight = torch.as_tensor(state["weight"], dtype=torch.float64)
        self.bias = torch.as_tensor(state["bias"], dtype=torch.float64)
        self.reg = float(state.get("reg", self.reg))
        self.nll_before = _num(state.get("nll_before"))
        self.nll_after = _num(state.get("nll_after"))


class VectorScaler(_AffineScaler):
    """Vector scaling: ``z * w + b`` with per-class ``w, b`` (2C parameters), fitted by NLL with
    LBFGS from w = 1, b = 0. Unlike TS it can change the argmax.

    Args:
        reg: optional L2 penalty ``reg * (||w - 1||^2 + ||b||^2)`` (default 0).

    References:
        Guo, Pleiss, Sun, Weinberger. "On Calibration of Modern Neural Networks." ICML 2017.
        https://arxiv.org/abs/1706.04599
    """

    name = "vector"

    def _init_weight(self, c):
        return torch.ones(c, dtype=torch.float64)

    def _apply(self, z, w, b):
        return z * w + b

    def _penalty(self, w, b):
        return self.reg * (((w - 1) ** 2).sum() + (b**2).sum()) if self.reg else 0.0


class MatrixScaler(_AffineScaler):
    """Matrix scaling: ``z W^T + b`` with a full C x C matrix, fitted by NLL plus the L2 penalty
    ``reg * (||W - I||_F^2 + ||b||^2)`` (which keeps C^2 parameters from over-fitting a small
    validation split), LBFGS from W = I, b = 0. Not in :data:`CALIBRATORS` (not offered by
    name), but its JSON state loads with :func:`calibrator_from_json`.

    Args:
        reg: L2 regularisation strength (default 1e-2).

    References:
        Guo, Pleiss, Sun, Weinberger. "On Calibration of Modern Neural Networks." ICML 2017.
        https://arxiv.org/abs/1706.04599
    """

    name = "matrix"

    def __init__(self, reg: float = 1e-2) -> None:
        super().__init__(reg=reg)

    def _init_weight(self, c):
        return torch.eye(c, dtype=torch.float64)

    def _apply(self, z, w, b):
        return z @ w.T + b

    def _penalty(self, w, b):
        eye = torch.eye(w.shape[0], dtype=w.dtype)
        return self.reg * (((w - eye) ** 2).sum() + (b**2).sum())


# ----------------------------------------------------------------------------- non-parametric
_LOG_FLOOR = 1e-12


def _normalise_log(p: torch.Tensor) -> torch.Tensor:
    """Per-class calibrated scores -> renormalised log-probabilities (uniform if a row is all 0);
    probabilities are floored at 1e-12, so the log and any NLL stay finite."""
    s = p.sum(1, keepdim=True)
    p = torch.where(s > 0, p / s.clamp_min(1e-300), torch.full_like(p, 1.0 / p.shape[1]))
    return p.clamp_min(_LOG_FLOOR).log()


class HistogramBinning(_Calibrator):
    """Histogram binning, one-vs-rest: for each class k, softmax(z)_k is put into ``n_bins``
    equal-width ``(lo, hi]`` bins (0 into the first), and replaced by the observed frequency of
    y = k in that bin on the fit data (the bin midpoint for empty bins). The C calibrated scores
    are renormalised to sum to 1. ``transform`` returns their log.

    References:
        Zadrozny, Elkan. "Obtaining calibrated probability estimates from decision trees and
        naive Bayesian classifiers." ICML 2001. https://dl.acm.org/doi/10.5555/645530.655813
    """

    name = "histogram"

    def __init__(self, n_bins: int = 15) -> None:
        super().__init__()
        self.n_bins = int(n_bins)
        self.bin_values: torch.Tensor | None = None  # (C, n_bins)

    def _bins(self, p: np.ndarray) -> np.ndarray:
        edges = np.linspace(0.0, 1.0, self.n_bins + 1)
        return np.clip(np.searchsorted(edges, p, side="left") - 1, 0, self.n_bins - 1)

    def fit(self, logits, labels) -> HistogramBinning:
        """Fit the per-class bin frequencies; returns self."""
        z, yt = self._fit_inputs(logits, labels)
        y = yt.numpy()
        p = _softmax_np(z.numpy())
        n, c = p.shape
        idx = self._bins(p) + np.arange(c)[None, :] * self.n_bins  # (N, C) flat bin ids
        hit = (y[:, None] == np.arange(c)[None, :]).astype(np.float64)
        m = c * self.n_bins
        count = np.bincount(idx.ravel(), minlength=m).reshape(c, self.n_bins)
        pos = np.bincount(idx.ravel(), weights=hit.ravel(), minlength=m).reshape(c, self.n_bins)
        mid = (np.arange(self.n_bins) + 0.5) / self.n_bins
        vals = np.where(count > 0, pos / np.maximum(count, 1), mid[None, :])
        self.bin_values = torch.as_tensor(vals, dtype=torch.float64)
        self.n_classes = int(c)
        return self

    def _transform(self, z):
        assert self.bin_values is not None  # _prep checked the fit
        p = _softmax_np(z.numpy())
        idx = torch.as_tensor(self._bins(p))
        cal = torch.gather(self.bin_values, 1, idx.T).T  # (N, C)
        return _normalise_log(cal)

    def _state(self) -> dict:
        return {"n_bins": self.n_bins, "bin_values": self.bin_values}

    def _load(self, state: dict) -> None:
        self.n_bins = int(state["n_bins"])
        self.bin_values = torch.as_tensor(state["bin_values"], dtype=torch.float64)


class IsotonicCalibrator(_Calibrator):
    """Isotonic regression, one-vs-rest: for each class k a non-decreasing step map of
    softmax(z)_k to the frequency of y = k (pool-adjacent-violators via
    ``scipy.optimize.isotonic_regression`` on tied-score means), evaluated by linear
    interpolation between fitted points and clipped outside them (as scikit-learn's
    ``IsotonicRegression(out_of_bounds="clip")``). Scores are renormalised; ``transform``
    returns their log. Monotone but not strictly: it may tie ranks and so change the AUC.

    References:
        Zadrozny, Elkan. "Transforming classifier scores into accurate multiclass probability
        estimates." KDD 2002. https://doi.org/10.1145/775047.775151
    """

    name = "isotonic"

    def __init__(self) -> None:
        super().__init__()
        self.x: list[torch.Tensor] = []
        self.y: list[torch.Tensor] = []

    def fit(self, logits, labels) -> IsotonicCalibrator:
        """Fit one isotonic map per class; returns self."""
        z, yt = self._fit_inputs(logits, labels)
        y = yt.numpy()
        p = _softmax_np(z.numpy())
        self.x, self.y = [], []
        for k in range(p.shape[1]):  # loop over classes only; each fit is vectorised
            ux, inv = np.unique(p[:, k], return_inverse=True)
            w = np.bincount(inv).astype(np.float64)
            mean_y = np.bincount(inv, weights=(y == k).astype(np.float64)) / w
            fitted = isotonic_regression(mean_y, weights=w, increasing=True).x
            self.x.append(torch.as_tensor(ux, dtype=torch.float64))
            self.y.append(torch.as_tensor(fitted, dtype=torch.float64))
        self.n_classes = int(p.shape[1])
        return self

    def _transform(self, z):
        p = _softmax_np(z.numpy())
        cal = np.stack([np.interp(p[:, k], self.x[k].numpy(), self.y[k].numpy())
                        for k in range(p.shape[1])], axis=1)  # p.shape[1] == n_classes: _prep checked
        return _normalise_log(torch.as_tensor(cal, dtype=torch.float64))

    def _state(self) -> dict:
        return {"x": self.x, "y": self.y}

    def _load(self, state: dict) -> None:
        self.x = [torch.as_tensor(t, dtype=torch.float64) for t in state["x"]]
        self.y = [torch.as_tensor(t, dtype=torch.float64) for t in state["y"]]


#: Calibrators by name (the ``--method`` choices): name -> class.
CALIBRATORS: dict[str, type[_Calibrator]] = {
    "ts": TemperatureScaler,
    "platt": PlattScaler,
    "vector": VectorScaler,
    "isotonic": IsotonicCalibrator,
    "histogram": HistogramBinning,
}
_LOADABLE: dict[str, type[_Calibrator]] = {**CALIBRATORS, "matrix": MatrixScaler}
