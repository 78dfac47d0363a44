"""Run a MIL network over a loader: logits, attention and features; MC dropout; per-CT uncertainty.

- :func:`predict`: one deterministic pass in eval mode (``{logits, labels, attention, features}``).
- :func:`predict_uncertainty`: the per-CT predictive distribution and its uncertainty, either
  deterministic (``mc_samples=0``, exactly :func:`predict` + a float64 softmax) or by MC dropout
  (Gal & Ghahramani 2016): the mean softmax over ``mc_samples`` stochastic passes with the dropout
  layers on and every other layer in eval mode (BatchNorm uses its running statistics, test-time
  flips stay on). Entropy and mutual information come from
  :func:`lungcal.calibration.uncertainty.decompose_uncertainty`. This is the function inference,
  ``lungcal predict`` and the stage-1 / ensemble runs call.
- :func:`ensemble_uncertainty`: the same record for the average of several members' predictions.

MC passes are seeded: the same ``seed``, loader (order and batch size) and device give the same
samples, and the global RNG is left as it was (:func:`torch.random.fork_rng`). When every active
dropout layer sits in the network's ``head`` (the log-sum-exp model of the CT bundles), the
encoder runs once per batch and only the head is sampled; otherwise the whole network is run
``mc_samples`` times. Both give the same samples (the encoder draws no random numbers).

References:
    Gal, Ghahramani. "Dropout as a Bayesian Approximation: Representing Model Uncertainty in Deep
    Learning." ICML 2016. https://arxiv.org/abs/1506.02142
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Protocol, TypeGuard, runtime_checkable

import numpy as np
import torch
from torch import nn

from lungcal.calibration.uncertainty import decompose_uncertainty, log_probs
from lungcal.ctapp.model.heads import InstanceScorer
from lungcal.errors import ConfigError

__all__ = ["predict", "predict_uncertainty", "ensemble_uncertainty", "dropout_layers", "mc_dropout",
           "mc_dropout_probs", "check_mc_samples"]


# What the functions here call on a MIL network (every model of lungcal.mil has all of it).
@runtime_checkable
class _Pooled(Protocol):
    def forward_features(self, bags: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...


@runtime_checkable
class _Featured(Protocol):
    def features(self, bags: torch.Tensor, mask: torch.Tensor) -> torch.Tensor: ...


class _HeadSampled(Protocol):
    head: InstanceScorer

    def features(self, bags: torch.Tensor, mask: torch.Tensor) -> torch.Tensor: ...


@torch.no_grad()
def predict(network: nn.Module, loader, device=None) -> dict[str, torch.Tensor]:
    """``{"logits" (N, C), "labels" (N,), "attention" (N, K), "features"}`` of ``network`` (eval mode) on ``loader``."""
    network.eval()
    out: dict[str, list] = {"logits": [], "labels": [], "attention": [], "features": []}
    for batch in loader:
        bags = batch["bag"].to(device) if device is not None else batch["bag"]
        mask = batch["mask"].to(bags.device)
        if isinstance(network, _Pooled):  # one pass: pooled features + attention
            feats, att = network.forward_features(bags, mask)
            logits = network.get_submodule("head")(feats)
        elif isinstance(network, _Featured):
            feats = network.features(bags, mask)
            logits, att = network(bags, mask)
        else:
            raise TypeError(f"{type(network).__name__} has neither forward_features nor features (a MIL network)")
        out["logits"].append(logits.float().cpu())
        out["attention"].append(att.float().cpu())
        out["features"].append(feats.float().cpu())
        out["labels"].append(batch["label"].long().cpu())
    return {k: torch.cat(v) if v else torch.empty(0) for k, v in out.items()}


def dropout_layers(network: nn.Module) -> list[tuple[str, nn.Module]]:
    """The dropout layers of ``network`` that drop something (``p > 0``), with their names."""
    return [(name, m) for name, m in network.named_modules()
            if isinstance(m, nn.modules.dropout._DropoutNd) and float(m.p) > 0.0]


def check_mc_samples(network: nn.Module, mc_samples: Any) -> int:
    """``mc_samples`` as an int >= 0; ``ConfigError`` when negative or when ``network`` has no dropout to sample."""
    if isinstance(mc_samples, bool) or not isinstance(mc_samples, (int, np.integer)) or int(mc_samples) < 0:
        raise ConfigError(f"mc_samples must be an integer >= 0, got {mc_samples!r}", field="mc_samples",
                          fix="set mc_samples 0 (off) or the number of MC-dropout passes, e.g. 20")
    if int(mc_samples) > 0 and not dropout_layers(network):
        raise ConfigError(f"mc_samples={int(mc_samples)} needs a network with dropout, and this one has none (p = 0)",
                          field="mc_samples",
                          fix="set mc_samples 0, or train with dropout > 0 (the bundles' dropout key, e.g. 0.1)")
    return int(mc_samples)


@contextlib.contextmanager
def mc_dropout(network: nn.Module) -> Iterator[nn.Module]:
    """``network`` in eval mode with its dropout layers in train mode; every mode is restored on exit."""
    modes = {m: m.training for m in network.modules()}
    network.eval()
    for _, m in dropout_layers(network):
        m.train()
    try:
        yield network
    finally:
        for m, training in modes.items():
            m.training = training


def _head_only(network: nn.Module) -> TypeGuard[_HeadSampled]:
    """Whether every active dropout layer is inside ``network.head`` (then the features need one pass)."""
    head = getattr(network, "head", None)
    if head is None or not hasattr(network, "features") or not hasattr(head, "forward_with_probs"):
        return False
    inside = {id(m) for m in head.modules()}
    return all(id(m) in inside for _, m in dropout_layers(network))


@torch.no_grad()
def mc_dropout_probs(network: nn.Module, bags: torch.Tensor, mask: torch.Tensor,
                     samples: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(probs (samples, B, C), attention (samples, B, K))`` of ``samples`` passes, dropout on.

    Uses the global RNG as it stands (seed it, or call :func:`predict_uncertainty`); does not check
    that the network has dropout (with none, every pass equals the eval-mode prediction).
    """
    with mc_dropout(network):
        if _head_only(network):
            feats = network.features(bags, mask)  # deterministic: no dropout outside the head
            outs = [network.head.forward_with_probs(feats) for _ in range(int(samples))]
        else:
            outs = [network(bags, mask) for _ in range(int(samples))]
    probs = torch.stack([torch.softmax(o[0].double(), dim=1) for o in outs])
    return probs, torch.stack([o[1].float() for o in outs])


def _fork_rng(device: torch.device):
    cuda = [device.index if device.index is not None else torch.cuda.current_device()] \
        if device.type == "cuda" else []
    return torch.random.fork_rng(devices=cuda)


def predict_uncertainty(network: nn.Module, loader, device=None, mc_samples: int = 0,
                        seed: int = 0) -> dict[str, Any]:
    """Per-CT mean probabilities, entropy and mutual information of ``network`` on ``loader``.

    Args:
        network: a MIL network (``forward(bags, mask) -> (logits, attention)``).
        loader: batches ``{"bag", "mask", "label"}`` (e.g. ``CTCohort.loader(split, batch_size)``).
        device: where to run (``None``: where the batches are).
        mc_samples: 0 = deterministic (eval mode, one pass); T >= 1 = MC dropout over T passes.
        seed: seeds the MC passes (the global RNG is restored afterwards).

    Returns:
        ``{"probs" (N, C) float64 mean probabilities, "logits" (N, C) float32/64: the network's
        logits when deterministic, ``log(probs)`` under MC dropout (softmax gives ``probs`` back;
        fit a temperature on these), "entropy" (N,) H[probs] (nats), "mi" (N,) mutual information
        (all 0 when deterministic), "aleatoric" (N,), "samples" (T, N, C) float64 or ``None``,
        "attention" (N, K) mean over passes, "features" (eval mode, deterministic), "labels" (N,),
        "mc_samples" T}``. With ``mc_samples=0``, ``probs`` is exactly the float64 softmax of
        :func:`predict`'s logits (:func:`lungcal.calibration.scaling.probabilities`).
    """
    t = check_mc_samples(network, mc_samples)
    det = predict(network, loader, device)
    if t == 0:
        probs = torch.softmax(det["logits"].double(), dim=1).numpy()
        unc = decompose_uncertainty(probs[None])
        return {"probs": probs, "logits": det["logits"], "entropy": unc["entropy"], "mi": unc["mi"],
                "aleatoric": unc["aleatoric"], "samples": None, "attention": det["attention"],
                "features": det["features"], "labels": det["labels"], "mc_samples": 0}
    dev = torch.device(device) if device is not None else next(network.parameters()).device
    samples, attention = [], []
    with _fork_rng(dev):
        torch.manual_seed(int(seed))
        for batch in loader:
            bags = batch["bag"].to(dev)
            p, att = mc_dropout_probs(network, bags, batch["mask"].to(dev), t)
            samples.append(p.cpu())
            attention.append(att.mean(0).cpu())
    s = torch.cat(samples, dim=1).numpy() if samples else np.zeros((t, 0, det["logits"].shape[1]))
    unc = decompose_uncertainty(s)
    return {"probs": unc["probs"], "logits": torch.from_numpy(log_probs(unc["probs"])), "entropy": unc["entropy"],
            "mi": unc["mi"], "aleatoric": unc["aleatoric"], "samples": s,
            "attention": torch.cat(attention) if attention else det["attention"], "features": det["features"],
            "labels": det["labels"], "mc_samples": t}


def ensemble_uncertainty(members: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The average of M members' :func:`predict_uncertainty` records on the same loader.

    ``probs`` is the mean of the members' ``probs`` (each member's own MC mean when it was sampled),
    ``entropy`` / ``mi`` / ``aleatoric`` decompose over the members, ``logits = log(probs)`` (fit a
    temperature on these: "pool, then calibrate"), ``attention`` is the members' mean and
    ``samples`` the ``(M, N, C)`` member probabilities.
    """
    if not members:
        raise ConfigError("an ensemble needs at least one member", field="ensemble_members",
                          fix="set ensemble_members to 2 or more")
    labels = members[0]["labels"]
    for m in members[1:]:
        if not torch.equal(torch.as_tensor(m["labels"]), torch.as_tensor(labels)):
            raise ConfigError("the ensemble's members were evaluated on different cases", field="ensemble_members",
                              fix="evaluate every member on the same split, in the same order")
    s = np.stack([np.asarray(m["probs"], dtype=np.float64) for m in members])
    unc = decompose_uncertainty(s)
    att = torch.stack([torch.as_tensor(m["attention"]).float() for m in members]).mean(0)
    return {"probs": unc["probs"], "logits": torch.from_numpy(log_probs(unc["probs"])), "entropy": unc["entropy"],
            "mi": unc["mi"], "aleatoric": unc["aleatoric"], "samples": s, "attention": att, "features": None,
            "labels": labels, "mc_samples": int(members[0].get("mc_samples", 0))}
