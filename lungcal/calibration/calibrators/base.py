"""The public base of every post-hoc calibrator, its input checks and its JSON state.

:class:`Calibrator` is what every calibrator of :mod:`lungcal.calibration.calibrators` (and
:class:`lungcal.calibration.prior.PriorAdjusted`) subclasses, in the style of torch-uncertainty's
scalers: a subclass implements ``fit`` (held-out logits and labels -> self), ``_transform`` (calibrated
logits of ``(N, C)`` float64 logits), ``_state`` / ``_load`` (its parameters as plain JSON data) and
sets ``name``; the base gives it the input checks (probabilities refused where logits are expected),
the numpy / torch and ``(N,)`` / ``(N, C)`` round trip, ``predict_proba`` = softmax(``transform``),
``state_dict`` / ``load_state_dict`` / ``to_json`` and :meth:`Calibrator.from_state`, which rebuilds a
stored calibrator of any subclass from its ``"name"`` (every subclass with a ``name`` is known to it as
soon as its module is imported; :mod:`lungcal.calibration` imports them all).

The small public functions come first: :func:`probabilities` (softmax of ``logits / T``) and
:func:`calibrated_probs` (any calibrator, or none, applied to logits).
"""
from __future__ import annotations

import json
import math
from typing import Any, ClassVar

import numpy as np
import torch

from lungcal.errors import DataError

__all__ = ["Calibrator", "probabilities", "calibrated_probs"]


# ----------------------------------------------------------------------------- public functions
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


_LOG_FLOOR = 1e-12


def _normalise_log(p: torch.Tensor) -> torch.Tensor:
    """Per-class calibrated scores -> renormalised log-probabilities (uniform if a row is all 0);
    probabilities are floored at 1e-12, so the log and any NLL stay finite."""
    s = p.sum(1, keepdim=True)
    p = torch.where(s > 0, p / s.clamp_min(1e-300), torch.full_like(p, 1.0 / p.shape[1]))
    return p.clamp_min(_LOG_FLOOR).log()


# ----------------------------------------------------------------------------- the base class
class Calibrator:
    """The base of every post-hoc calibrator: input checks, type / shape round-trip, predict_proba =
    softmax(transform), JSON state (``state_dict`` = ``{"name", **_state(), "n_classes", "fit_info"}``)
    and the loader of a stored calibrator of any subclass (:meth:`from_state`).

    A subclass sets ``name`` (its registry and JSON name) and implements ``fit``, ``_transform``,
    ``_state`` and ``_load``; defining ``name`` makes its stored state loadable by :meth:`from_state`.
    """

    name: ClassVar[str] = ""
    #: softmax(calibrated z) unchanged by z + c per row: logits in [0, 1] need not be probabilities
    _shift_invariant = True
    n_classes: int | None = None
    #: every subclass that names itself, by name, in the order their modules were imported
    _by_name: ClassVar[dict[str, type[Calibrator]]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.__dict__.get("name"):
            Calibrator._by_name[cls.name] = cls

    def __init__(self) -> None:
        self.n_classes = None
        self.fit_info: dict[str, Any] = {}

    @staticmethod
    def from_state(state: Any) -> Calibrator:
        """Rebuild a fitted calibrator of any kind from its :meth:`state_dict` (the class comes from ``"name"``)."""
        name = state.get("name") if isinstance(state, dict) else None
        if name not in Calibrator._by_name:
            raise DataError(f"calibrator JSON has name {name!r}", field="name",
                            fix="pass the text written by Calibrator.to_json(); known names: "
                                f"{', '.join(Calibrator._by_name)}")
        return Calibrator._by_name[name]().load_state_dict(state)

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

    def fit(self, logits, labels) -> Calibrator:  # pragma: no cover - abstract
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
        if "n_classes" in state:
            self.n_classes = int(state["n_classes"])
        elif self.n_classes is None:  # a subclass of one class count (e.g. PriorAdjusted) sets it in _load
            raise DataError(f"stored {self.name!r} calibrator lacks 'n_classes'", field="calibrator",
                            fix="pass the text written by Calibrator.to_json()")
        self.fit_info = dict(state.get("fit_info") or {})
        return self

    def to_json(self) -> str:
        """The state as strict JSON text (see :func:`calibrator_from_json`)."""
        return json.dumps(self.state_dict(), allow_nan=False, sort_keys=True)
