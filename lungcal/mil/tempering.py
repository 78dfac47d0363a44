"""A temperature inside the MIL pooling, fitted on validation with the network frozen (issue 18 item 3b).

Bag-level temperature scaling (:class:`lungcal.calibration.scaling.TemperatureScaler`) divides the
CT's logit. Here one scalar ``T`` divides the *instance* scores before they are pooled, so it also
changes how the bag's evidence is shared among the candidates:

- log-sum-exp (:class:`~lungcal.mil.models.LogSumExpMIL`, the CT bundles' model): cancer logit
  ``b + log(exp(a_0 / T) + sum_k exp(a_k / T))``; the leak ``a_0`` is the dummy instance's score
  and is divided too. ``T > 1`` flattens the sum of likelihood ratios, ``T < 1`` sharpens it
  towards the largest one;
- noisy-OR (:class:`~lungcal.mil.models.NoisyORMIL`): instance logits ``s_k / T`` and the leak
  logit ``/ T`` before the noisy-OR;
- attention (:class:`~lungcal.mil.models.AttentionMIL` with the gated pool and a linear head):
  attention ``softmax(a / T)`` (the attention scale); with test-time flips the pooled embedding is
  averaged over the 8 flips as the model does.

``T = 1`` reproduces the network's logits exactly. :func:`pooling_view` runs the frozen network once
over a loader and keeps only what the pooling needs (instance scores, validity, the head's
parameters), so fitting ``T`` (:func:`fit_pooling_temperature`: L-BFGS on the mean NLL over
``log T``, float64, with a bounded 1-D search as fallback, as for bag-level TS) costs no further
network passes.

Per-candidate malignancy probabilities (:func:`instance_probabilities`), for instance-level
calibration against a phantom's nodule truth:

- log-sum-exp: the model's posterior that candidate ``k`` is the cancer,
  ``P(cancer) * exp(a_k / T) / (exp(a_0 / T) + sum_j exp(a_j / T))`` (attention-weighted, the
  leak included in the denominator): the odds of the bag are a sum of per-candidate likelihood
  ratios, and one nodule of a positive CT is the cancer. A bag-level temperature ``T_bag`` acts on
  ``P(cancer)`` only;
- noisy-OR: the instance head's ``sigmoid(s_k / T)`` (bag-level TS leaves it as it is);
- attention: the instance head, i.e. the linear bag head applied to the candidate's own
  (flip-averaged) embedding, ``softmax((W h_k + c) / T_bag)[1]`` (the pooling temperature leaves
  it as it is: it only moves attention).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from scipy.optimize import minimize_scalar
from torch import nn
from torch.nn import functional

from lungcal.errors import ConfigError
from lungcal.mil.models import (
    AttentionMIL,
    GatedAttentionPool,
    LogSumExpHead,
    NoisyORHead,
    _flipped,
    _InstanceHeadMIL,
    _log1mexp,
    masked_softmax,
)

__all__ = ["PoolingView", "PoolingTemperatureFit", "pooling_view", "pooled_logits", "instance_probabilities",
           "fit_pooling_temperature"]


@dataclass
class PoolingView:
    """What the pooling of a frozen MIL network needs, for every bag of a loader.

    ``kind``: ``"lse"``, ``"noisy_or"`` or ``"attention"``; ``scores``: instance scores ``(B, K)``
    (attention: ``(F, B, K)`` per test-time flip); ``valid`` ``(B, K)``; ``labels`` ``(B,)``;
    ``leak``, ``bias``: the head's scalars (log-sum-exp: leak ``a_0`` and bias ``b``; noisy-OR:
    the leak logit); ``instance_logits``: attention only, ``(F, B, K, C)`` = ``W h_k`` per flip,
    with the head's bias in ``bias``. All float64 on the CPU.
    """

    kind: str
    scores: torch.Tensor
    valid: torch.Tensor
    labels: torch.Tensor
    leak: torch.Tensor
    bias: torch.Tensor
    instance_logits: torch.Tensor | None = None


@dataclass
class PoolingTemperatureFit:
    """Result of :func:`fit_pooling_temperature`: ``temperature``, the validation NLL at T = 1 and at T, the method."""

    temperature: float
    nll_before: float
    nll_after: float
    method: str
    at_bound: bool


def _kind(network: nn.Module) -> str:
    head = getattr(network, "head", None)
    if isinstance(network, _InstanceHeadMIL) and isinstance(head, LogSumExpHead):
        return "lse"
    if isinstance(network, _InstanceHeadMIL) and isinstance(head, NoisyORHead):
        return "noisy_or"
    if isinstance(network, AttentionMIL) and isinstance(network.pool, GatedAttentionPool) \
            and isinstance(head, nn.Linear):
        return "attention"
    raise ConfigError(f"no pooling temperature for {type(network).__name__} with a {type(head).__name__} head",
                      field="network_def",
                      fix="use LogSumExpMIL, NoisyORMIL or AttentionMIL (gated pool, linear head), "
                          "or bag-level temperature scaling")


@torch.no_grad()
def pooling_view(network: nn.Module, loader, device=None) -> PoolingView:
    """Run the frozen ``network`` (eval mode) over ``loader`` once; keep what its pooling needs."""
    kind = _kind(network)
    network.eval()
    if isinstance(network, AttentionMIL):
        return _attention_view(network, loader, device)
    assert isinstance(network, _InstanceHeadMIL)  # as _kind checked
    return _instance_view(network, kind, loader, device)


def _batches(loader, device):
    for batch in loader:
        bags = batch["bag"].to(device) if device is not None else batch["bag"]
        yield bags, batch["mask"].to(bags.device).to(torch.bool), batch["label"].long().cpu()


def _attention_view(network: AttentionMIL, loader, device) -> PoolingView:
    pool, head = network.pool, network.head
    assert isinstance(pool, GatedAttentionPool) and isinstance(head, nn.Linear)  # as _kind checked
    scores, valid, labels, inst = [], [], [], []
    for bags, mask, label in _batches(loader, device):
        flips = 8 if network.tta_flips else 1
        hs = torch.stack([network.encode(_flipped(bags, f), mask) for f in range(flips)])  # (F, B, K, D)
        scores.append(pool.scores(hs).double().cpu())
        inst.append(functional.linear(hs, head.weight).double().cpu())
        valid.append(mask.cpu())
        labels.append(label)
    leak = torch.zeros((), dtype=torch.float64)
    bias = (head.bias.detach() if head.bias is not None else torch.zeros(head.out_features)).double().cpu()
    return PoolingView("attention", torch.cat(scores, 1), torch.cat(valid), torch.cat(labels), leak, bias,
                       torch.cat(inst, 1) if inst else None)


def _instance_view(network: _InstanceHeadMIL, kind: str, loader, device) -> PoolingView:
    head = network.head
    scores, valid, labels = [], [], []
    for bags, mask, label in _batches(loader, device):
        feats = network.features(bags, mask)
        h = feats[..., :-1]
        valid.append((feats[..., -1] > 0.5).cpu())
        s = head.gate.scores(h) if isinstance(head, LogSumExpHead) else head.instance(h).squeeze(-1)
        scores.append(s.double().cpu())
        labels.append(label)
    if isinstance(head, LogSumExpHead):
        leak, bias = head.leak.detach().double().cpu(), head.bias.detach().double().cpu()
    else:
        leak, bias = head.leak_logit.detach().double().cpu(), torch.zeros((), dtype=torch.float64)
    return PoolingView(kind, torch.cat(scores), torch.cat(valid), torch.cat(labels), leak, bias)


def _as_t(temperature, like: torch.Tensor) -> torch.Tensor:
    t = torch.as_tensor(temperature, dtype=like.dtype)
    if not bool((t.detach() > 0).all()):
        raise ConfigError(f"a temperature must be > 0, got {float(t.detach())}", field="temperature", fix="use T > 0")
    return t


def _lse_parts(view: PoolingView, temperature) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cancer logit (B,), scaled scores incl. the leak (B, K + 1))`` of the log-sum-exp pooling at ``T``."""
    t = _as_t(temperature, view.scores)
    a = (view.scores / t).masked_fill(~view.valid, float("-inf"))  # divide first: no inf * 0 in the gradient
    s = torch.cat([(view.leak / t).expand(a.shape[0], 1), a], dim=1)
    return view.bias + torch.logsumexp(s, dim=1), s


def pooled_logits(view: PoolingView, temperature=1.0) -> torch.Tensor:
    """Bag logits ``(B, 2)`` with the instance scores divided by ``temperature`` (differentiable in it)."""
    if view.kind == "lse":
        cancer, _ = _lse_parts(view, temperature)
        return torch.stack([torch.zeros_like(cancer), cancer], dim=1)
    t = _as_t(temperature, view.scores)
    if view.kind == "noisy_or":
        s = view.scores / t
        log_not = (functional.logsigmoid(-s) * view.valid).sum(dim=1) + functional.logsigmoid(-view.leak / t)
        return torch.stack([log_not, _log1mexp(log_not)], dim=1)
    att = masked_softmax(view.scores / t, view.valid.unsqueeze(0).expand_as(view.scores), dim=2)  # (F, B, K)
    assert view.instance_logits is not None  # an attention view has them
    return (att.unsqueeze(-1) * view.instance_logits).sum(2).mean(0) + view.bias


def instance_probabilities(view: PoolingView, temperature=1.0, bag_temperature: float = 1.0) -> np.ndarray:
    """Per-candidate malignancy probabilities ``(B, K)`` (0 at padding slots); see the module docstring."""
    bt = float(_as_t(bag_temperature, view.scores))
    with torch.no_grad():
        if view.kind == "lse":
            cancer, s = _lse_parts(view, temperature)
            p_bag = torch.sigmoid(cancer / bt)
            share = torch.exp(s - torch.logsumexp(s, dim=1, keepdim=True))[:, 1:]
            p = p_bag.unsqueeze(1) * share
        elif view.kind == "noisy_or":
            p = torch.sigmoid(view.scores / _as_t(temperature, view.scores))
        else:
            assert view.instance_logits is not None  # an attention view has them
            z = view.instance_logits.mean(0) + view.bias  # (B, K, C)
            p = torch.softmax(z / bt, dim=-1)[..., 1]
    return (p * view.valid).numpy()


def _nll(view: PoolingView, log_t: torch.Tensor) -> torch.Tensor:
    return functional.cross_entropy(pooled_logits(view, torch.exp(log_t)), view.labels)


def fit_pooling_temperature(network: nn.Module | None = None, loader=None, device=None, *,
                            view: PoolingView | None = None,
                            bounds: tuple[float, float] = (1e-2, 1e2)) -> PoolingTemperatureFit:
    """Fit the pooling temperature on a held-out loader (validation) with the network frozen.

    Minimises the mean NLL of the bag labels over ``log T`` with L-BFGS (strong Wolfe line search,
    float64), from ``T = 1``. If that is non-finite, worse than ``T = 1`` or outside ``bounds``, a
    bounded 1-D search on ``log T`` (``scipy.optimize.minimize_scalar``) decides instead. Pass
    ``view`` (:func:`pooling_view`) to reuse one network pass.
    """
    if view is None:
        if network is None or loader is None:
            raise ValueError("pass a network and a loader, or a pooling view")
        view = pooling_view(network, loader, device)
    if view.labels.numel() == 0:
        raise ConfigError("no bags to fit the pooling temperature on", field="split",
                          fix="give the datalist validation rows")
    lo, hi = math.log(bounds[0]), math.log(bounds[1])
    with torch.no_grad():
        before = float(_nll(view, torch.zeros((), dtype=torch.float64)))
    log_t = torch.zeros((), dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([log_t], lr=1.0, max_iter=100, tolerance_grad=1e-10, tolerance_change=1e-12,
                            line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = _nll(view, log_t)
        loss.backward()
        return loss

    method = "lbfgs"
    try:
        opt.step(closure)
        cand = float(log_t.detach())
        with torch.no_grad():
            after = float(_nll(view, torch.tensor(cand, dtype=torch.float64)))
        ok = math.isfinite(cand) and lo < cand < hi and math.isfinite(after) and after <= before + 1e-12
    except (RuntimeError, ValueError, ConfigError):  # a step to a non-finite T: the bounded search decides
        ok = False
    if not ok:
        def f(u: float) -> float:
            with torch.no_grad():
                return float(_nll(view, torch.tensor(u, dtype=torch.float64)))

        res = minimize_scalar(f, bounds=(lo, hi), method="bounded", options={"xatol": 1e-8})
        cand, after, method = float(res.x), float(res.fun), "bounded"
    at_bound = min(abs(cand - lo), abs(cand - hi)) < 1e-3
    return PoolingTemperatureFit(math.exp(cand), before, after, method, at_bound)
