"""Affine scaling of the logits fitted by NLL with LBFGS: vector (``z * w + b``) and matrix (``W z + b``)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from lungcal.calibration.calibrators.base import Calibrator, _nll, _num

__all__ = ["VectorScaler", "MatrixScaler"]


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


class _AffineScaler(Calibrator):
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
