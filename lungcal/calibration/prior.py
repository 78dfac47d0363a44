"""Prevalence (label-shift) adaptation of a binary model's posteriors, without new labels.

A model calibrated where the prevalence was ``s1`` (the *source* prior) gives posteriors
``p = P_s(y=1 | x)``. At a site where the class-conditional distributions ``P(x | y)`` are the
same but the prevalence is ``pi1`` (label shift), Bayes' rule gives the site's posteriors:

    p' = p * pi1/s1 / (p * pi1/s1 + (1 - p) * pi0/s0),   i.e.   logit p' = logit p + log(pi1 s0 / (pi0 s1))

(:func:`adjust_to_prior`). When the site's prevalence is unknown but it has unlabelled cases,
:func:`estimate_prior_em` estimates it by the EM algorithm of Saerens et al. (2002): it is the
maximum-likelihood prevalence of the site's cases under the model. Both assume the model is
calibrated at the source; calibrate first, then adapt (Alexandari et al. 2020).

References:
    Saerens, Latinne, Decaestecker. "Adjusting the Outputs of a Classifier to New a Priori
    Probabilities: A Simple Procedure." Neural Computation 14(1), 21-41 (2002).
    https://doi.org/10.1162/089976602753284446
    Alexandari, Kundaje, Shrikumar. "Maximum Likelihood with Bias-Corrected Calibration is
    Hard-To-Beat at Label Shift Adaptation." ICML 2020. https://arxiv.org/abs/1901.06852
"""
from __future__ import annotations

import math
import warnings
from typing import Any

import numpy as np
import torch

from lungcal.calibration.calibrators.base import Calibrator, _normalise_log, calibrated_probs
from lungcal.errors import ConfigError, DataError

__all__ = ["adjust_to_prior", "estimate_prior_em", "check_prior", "PRIOR", "PriorAdjusted"]

_PROB_TOL = 1e-6


def check_prior(value: Any, field: str = "prior") -> float:
    """A prevalence strictly between 0 and 1 as a float, else a ConfigError naming ``field`` and the fix."""
    try:
        v = float(value)
    except (TypeError, ValueError):
        v = float("nan")
    if not 0.0 < v < 1.0:
        raise ConfigError(f"{field} must be a prevalence strictly between 0 and 1, got {value!r}", field=field,
                          fix="give the fraction of positive cases, e.g. 0.11 for 11% (not a percentage, not 0 or 1)")
    return v


def _positive_probs(probs: Any) -> tuple[np.ndarray, bool, bool, Any]:
    """-> (p(y=1) float64 (N,), was_2d, was_tensor, original)."""
    is_t = isinstance(probs, torch.Tensor)
    p = probs.detach().cpu().double().numpy() if is_t else np.asarray(probs, dtype=np.float64)
    two = p.ndim == 2
    if two and p.shape[1] != 2:
        raise DataError(f"probs must be (N,) or (N, 2) for prior adjustment, got shape {p.shape}", field="probs",
                        fix="pass p(y=1) of a binary model, or its (N, 2) probabilities")
    if p.ndim not in (1, 2) or p.shape[0] == 0:
        raise DataError(f"probs must be a non-empty (N,) or (N, 2) array, got shape {p.shape}", field="probs",
                        fix="pass p(y=1) of a binary model, or its (N, 2) probabilities")
    if not np.isfinite(p).all() or p.min() < -_PROB_TOL or p.max() > 1 + _PROB_TOL:
        raise DataError("probs must be probabilities in [0, 1]", field="probs",
                        fix="apply softmax (or sigmoid) to the logits first")
    if two and not np.allclose(p.sum(1), 1.0, rtol=0, atol=1e-4):
        raise DataError("(N, 2) probs must have rows that sum to 1", field="probs",
                        fix="pass softmax probabilities, or p(y=1) as an (N,) array")
    p1 = np.clip(p[:, 1] if two else p, 0.0, 1.0)
    return p1, two, is_t, probs


def _reweight(p1: np.ndarray, r1: float, r0: float) -> np.ndarray:
    num = p1 * r1
    return num / (num + (1.0 - p1) * r0)


def adjust_to_prior(probs, source_prior: float, target_prior: float):
    """Bayes re-weighting of binary posteriors from the source prevalence to a target prevalence.

    ``p' = p pi1/s1 / (p pi1/s1 + (1 - p) pi0/s0)`` with ``s1 = source_prior``, ``pi1 =
    target_prior`` (``s0 = 1 - s1``, ``pi0 = 1 - pi1``): the odds are multiplied by
    ``(pi1/pi0) / (s1/s0)``. Monotone in p (ranks and AUC unchanged); the identity when
    ``target_prior == source_prior``; p = 0 and p = 1 stay put.

    Args:
        probs: ``(N,)`` p(y=1) or ``(N, 2)`` probabilities (numpy or torch).
        source_prior: prevalence where the model was calibrated, in (0, 1).
        target_prior: prevalence at the site, in (0, 1).

    Returns:
        Adjusted probabilities of the input's shape: numpy float64 for array input, a tensor of
        the input's dtype and device for tensor input.

    References:
        Saerens, Latinne, Decaestecker. Neural Computation 14(1), 21-41 (2002), eq. 2.4.
        https://doi.org/10.1162/089976602753284446
    """
    s1 = check_prior(source_prior, "source_prior")
    t1 = check_prior(target_prior, "target_prior")
    p1, two, is_t, orig = _positive_probs(probs)
    q = _reweight(p1, t1 / s1, (1.0 - t1) / (1.0 - s1))
    out = np.stack([1.0 - q, q], axis=1) if two else q
    if is_t:
        return torch.as_tensor(out).to(dtype=orig.dtype if orig.is_floating_point() else torch.float64,
                                       device=orig.device)
    return out


def estimate_prior_em(probs, source_prior: float, tol: float = 1e-10, max_iter: int = 10_000) -> float:
    """Estimate a site's prevalence from unlabelled cases (Saerens et al. 2002 EM).

    Starting at ``pi = source_prior``, repeat

        E-step: ``p'_i = adjust_to_prior(p_i, source_prior, pi)``;  M-step: ``pi = mean_i p'_i``

    until ``|pi_new - pi| < tol``. The fixed point satisfies ``pi = mean(adjust_to_prior(p, s, pi))``
    and is the maximum-likelihood prevalence of the cases under the model (the likelihood is
    concave in pi, so EM cannot stop at a worse fixed point; it may approach 0 or 1 when the
    cases are all of one class). Convergence is linear: slower the weaker the model.

    Args:
        probs: ``(N,)`` p(y=1) or ``(N, 2)`` probabilities of the model, on the site's cases
            (calibrated at the source).
        source_prior: prevalence where the model was calibrated, in (0, 1).
        tol: stop when one iteration moves pi by less than this.
        max_iter: at most this many iterations (a RuntimeWarning says when it is reached).

    Returns:
        the estimated prevalence, a float in [0, 1].

    References:
        Saerens, Latinne, Decaestecker. "Adjusting the Outputs of a Classifier to New a Priori
        Probabilities: A Simple Procedure." Neural Computation 14(1), 21-41 (2002), eq. 2.9-2.10.
        https://doi.org/10.1162/089976602753284446
    """
    s1 = check_prior(source_prior, "source_prior")
    if not tol > 0 or int(max_iter) < 1:
        raise ConfigError(f"tol must be > 0 and max_iter >= 1, got tol={tol!r}, max_iter={max_iter!r}",
                          field="tol", fix="use the defaults tol=1e-10, max_iter=10000")
    p1, _, _, _ = _positive_probs(probs)
    pi = s1
    for _ in range(int(max_iter)):
        new = float(_reweight(p1, pi / s1, (1.0 - pi) / (1.0 - s1)).mean())
        if not math.isfinite(new):
            raise DataError("EM produced a non-finite prevalence", field="probs", fix="check the probabilities")
        done = abs(new - pi) < tol
        pi = new
        if done:
            return pi
    warnings.warn(f"estimate_prior_em did not converge in {max_iter} iterations (last step above tol={tol:g}); "
                  f"returning {pi:.6g}", RuntimeWarning, stacklevel=2)
    return pi


#: the registry-like name of a stored prior adjustment (``lungcal.calibrator = prior``)
PRIOR = "prior"


class PriorAdjusted(Calibrator):
    """The shipped calibrator followed by Bayes re-weighting from ``source_prior`` to ``target_prior``.

    A :class:`~lungcal.calibration.calibrators.base.Calibrator` of binary models (``"prior"``) that is
    built from two prevalences, not fitted on labels: ``predict_proba`` is
    ``adjust_to_prior(calibrated_probs(base, logits), source_prior, target_prior)`` as ``(N, 2)``
    float64, ``transform`` its log. It is stored and loaded as every calibrator is (``to_json``,
    :func:`lungcal.calibration.calibrators.registry.calibrator_from_json`), in the format it had before
    it joined the base: ``{"name": "prior", "base": <the base's state or null>, "source_prior",
    "target_prior", "estimated_by"}`` (no ``n_classes``, always 2; no ``fit_info``, never fitted).

    Args:
        base: the fitted calibrator the model is shipped with (``None``: plain softmax).
        source_prior: prevalence the base probabilities are calibrated to.
        target_prior: the site's prevalence (given, or estimated by EM on its unlabelled CTs).
        estimated_by: ``"given"`` or ``"em"`` (recorded only).

    ``PriorAdjusted()`` without the prevalences is empty (unfitted) until ``load_state_dict`` fills it.
    """

    name = PRIOR

    def __init__(self, base=None, source_prior: float | None = None, target_prior: float | None = None,
                 estimated_by: str = "given") -> None:
        super().__init__()
        self.base = base
        self.source_prior = self.target_prior = float("nan")
        self.estimated_by = str(estimated_by)
        if source_prior is not None or target_prior is not None:
            self._set_priors(source_prior, target_prior)

    def _set_priors(self, source_prior, target_prior) -> None:
        self.source_prior, self.target_prior = float(source_prior), float(target_prior)
        adjust_to_prior(np.array([0.5]), self.source_prior, self.target_prior)  # ConfigError outside (0, 1)
        self.n_classes = 2
        # softmax(z + c) = softmax(z) holds for the adjustment as far as it holds for its base
        self._shift_invariant = self.base is None or bool(self.base._shift_invariant)

    def fit(self, logits, labels) -> PriorAdjusted:
        """Not available: a prior adjustment is built from two prevalences, not fitted on labels."""
        raise ConfigError("a prior adjustment is not fitted on labels", field="method",
                          fix="build it as PriorAdjusted(base, source_prior, target_prior) (estimate_prior_em "
                              "estimates the site's prevalence from unlabelled cases), or fit a calibrator "
                              "of make_calibrator() on labels")

    def predict_proba(self, logits) -> np.ndarray:
        """``(N, 2)`` adjusted probabilities."""
        self._require_fit()
        return adjust_to_prior(calibrated_probs(self.base, logits), self.source_prior, self.target_prior)

    def _transform(self, z: torch.Tensor) -> torch.Tensor:
        return _normalise_log(torch.as_tensor(self.predict_proba(z.numpy()), dtype=torch.float64))

    def _state(self) -> dict[str, Any]:
        return {"base": None if self.base is None else self.base.state_dict(),
                "source_prior": self.source_prior, "target_prior": self.target_prior,
                "estimated_by": self.estimated_by}

    def state_dict(self) -> dict[str, Any]:
        """``{"name": "prior", "base", "source_prior", "target_prior", "estimated_by"}``: the format stored
        before the prior adjustment joined the base, kept so that files written then and now are alike."""
        self._require_fit()
        return {"name": PRIOR, **self._state()}

    def _load(self, state: dict[str, Any]) -> None:
        base = state.get("base")
        try:
            self.base = None if base is None else Calibrator.from_state(base)
            self.estimated_by = str(state.get("estimated_by", "given"))
            self._set_priors(state["source_prior"], state["target_prior"])
        except KeyError as e:
            raise DataError(f"stored prior adjustment lacks {e.args[0]!r}", field="calibrator",
                            fix="refit it: rerun `lungcal recalibrate --prevalence P`") from e

    def __repr__(self) -> str:
        return (f"PriorAdjusted({self.base!r}, source={self.source_prior:.4f}, target={self.target_prior:.4f}, "
                f"{self.estimated_by})")
