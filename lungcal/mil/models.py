"""Multiple-instance models: a CT is a bag of candidate patches with a validity mask.

Contract (docs/architecture.md): ``forward(bags (B, K, 1, P, P, P), mask (B, K) bool) ->
(logits (B, 2), attention (B, K))``; ``features(bags, mask)`` gives what ``head`` consumes, and
``head`` is a separate ``nn.Module`` (label-aware smoothing retrains it alone on cached features).

- :class:`AttentionMIL`: instance encoder -> gated attention pooling (Ilse et al. 2018) -> linear
  2-logit head. ``forward_features`` returns the pooled embedding and the attention separately, so
  an engine can mix pooled features (feature-space mixup) before calling ``head``.
- :class:`NoisyORMIL`: leaky noisy-OR (Liao et al. 2019): each instance gets a malignancy
  probability ``p_i``; ``P(cancer) = 1 - (1 - p_leak) * prod_i (1 - p_i)`` over valid instances,
  with a learnable leak ``p_leak`` (the "dummy nodule"). Logits are ``(log(1 - P), log P)``, so a
  softmax gives back ``(1 - P, P)`` exactly; the per-instance ``p_i`` are returned as "attention".
- :class:`LogSumExpMIL` (the CT bundles' default, ``head="lse"``): the same gated attention
  scores ``a_k``, pooled by log-sum-exp with a leak: cancer logit ``b + log(exp(a_0) + sum_k
  exp(a_k))``, so the odds are a sum of per-candidate likelihood ratios (the Bayes form when one
  nodule of a positive CT is the cancer); attention = masked softmax of ``a``.

Test-time flips (``tta_flips=True``, the bundles' default): in eval mode a model averages its
features and attention over the 8 flips of the patch axes (the training augmentation's flips), so
the evaluated model is exactly flip-invariant. For the linear attention head that is the mean of
the 8 logits. On the demo cohort it raised test AUC by 0.03-0.06 over single-orientation logits
(docs/architecture.md). Training is unchanged (one random orientation per bag and step).

Masked (padding) instances are never encoded: the encoder runs on the valid instances only, so
their content cannot change any output and BatchNorm statistics ignore them. An all-empty bag gives
a zero pooled embedding (attention all zero, no NaN), hence the head's bias logits.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.nn import functional

from lungcal.errors import ConfigError
from lungcal.mil.encoders import InstanceEncoder
from lungcal.runtime.bundle_config import Described

__all__ = ["embed_dim_of", "GatedAttentionPool", "masked_softmax", "AttentionMIL", "NoisyORHead", "NoisyORMIL",
           "LogSumExpHead", "LogSumExpMIL", "build_mil_model"]


def masked_softmax(scores: torch.Tensor, mask: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Softmax over ``dim`` restricted to ``mask``; masked entries are 0, all-masked rows are all 0."""
    mask = mask.to(torch.bool)
    s = scores.masked_fill(~mask, float("-inf"))
    m = s.amax(dim=dim, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m)).detach()
    e = torch.exp(s - m) * mask
    return e / e.sum(dim=dim, keepdim=True).clamp_min(_tiny(e.dtype))


def _tiny(dtype: torch.dtype) -> float:
    """The smallest normal number of ``dtype`` (``torch.finfo(dtype).tiny``, spelled out for TorchScript)."""
    if dtype == torch.float64:
        return 2.2250738585072014e-308
    if dtype == torch.float16:
        return 6.103515625e-05
    return 1.1754943508222875e-38  # float32, and bfloat16's exponent range


#: test-time flips: the 8 flips of a patch's three spatial axes (``range(8)``), identity first
N_FLIPS = 8


def _flipped(bags: torch.Tensor, flip: int) -> torch.Tensor:
    """``bags`` flipped along spatial axis ``d`` (of the last three) for each bit ``d`` set in ``flip``."""
    dims: list[int] = []
    for d in range(3):
        if (flip >> d) & 1:
            dims.append(bags.dim() - 3 + d)
    return bags.flip(dims) if len(dims) > 0 else bags


def embed_dim_of(encoder: nn.Module, embed_dim: int | None = None) -> int:
    """The embedding size D of ``encoder``: ``embed_dim`` when given, else ``encoder.embed_dim``.

    Any module mapping ``(N, 1, P, P, P)`` to ``(N, D)`` is an instance encoder, e.g.
    ``monai.networks.nets.resnet10(spatial_dims=3, n_input_channels=1, num_classes=D)``; modules
    without an ``embed_dim`` attribute need ``embed_dim`` passed to the MIL model.
    """
    d = embed_dim if embed_dim is not None else getattr(encoder, "embed_dim", None)
    if d is None:
        raise ConfigError(f"cannot tell the embedding size of the encoder {type(encoder).__name__}",
                          field="network_def.embed_dim",
                          fix="pass embed_dim (the encoder's output size) to the MIL model")
    return int(d)


def _valid_instances(bags: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(valid instances (M, C, ...), flat mask (B * K,))`` of ``bags (B, K, C, ...)`` and ``mask (B, K)``."""
    if bags.dim() < 3:
        raise ValueError("bags must be (B, K, C, ...), got shape " + str(bags.shape))
    b, k = bags.shape[0], bags.shape[1]
    if mask.shape != (b, k):
        raise ValueError("mask must be (B, K) as the bags, got " + str(mask.shape))
    flat_mask = mask.to(torch.bool).reshape(-1)
    return bags.reshape([b * k] + list(bags.shape[2:]))[flat_mask], flat_mask


class _BagEncoder(Described, nn.Module):
    """Shared by the MIL models: ``encode`` runs ``self.encoder`` (output ``self.embed_dim``) on valid instances."""

    if TYPE_CHECKING:  # set by the subclasses; declared for the type checker only (TorchScript reads annotations)
        encoder: nn.Module
        embed_dim: int

    def encode(self, bags: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Instance embeddings ``(B, K, D)`` (zeros for masked slots, which the encoder never sees)."""
        valid, flat_mask = _valid_instances(bags, mask)
        h = bags.new_zeros(flat_mask.shape[0], self.embed_dim)
        if valid.shape[0] > 0:
            h = h.index_put([flat_mask.nonzero().squeeze(1)], self.encoder(valid).to(h.dtype))
        return h.reshape(mask.shape[0], mask.shape[1], self.embed_dim)


class GatedAttentionPool(Described, nn.Module):
    """Gated attention pooling (Ilse, Tomczak & Welling 2018), honouring a validity mask.

    ``a_k = w^T (tanh(V h_k) * sigmoid(U h_k))``; attention = masked softmax of ``a`` over the bag;
    pooled ``z = sum_k attention_k h_k``.

    References:
        Ilse, Tomczak & Welling, "Attention-based Deep Multiple Instance Learning", ICML 2018.
        https://arxiv.org/abs/1802.04712
    """

    def __init__(self, in_dim: int, attn_dim: int = 64, dropout: float = 0.0) -> None:
        super().__init__()
        self.V = nn.Linear(in_dim, attn_dim)
        self.U = nn.Linear(in_dim, attn_dim)
        self.w = nn.Linear(attn_dim, 1)
        self.dropout = nn.Dropout(dropout)

    def scores(self, h: torch.Tensor) -> torch.Tensor:
        """Unnormalised attention scores ``a (B, K)`` of instance embeddings ``h (B, K, D)``."""
        return self.w(self.dropout(torch.tanh(self.V(h)) * torch.sigmoid(self.U(h)))).squeeze(-1)

    def forward(self, h: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``h (B, K, D)``, ``mask (B, K)`` -> ``(pooled (B, D), attention (B, K))``."""
        att = masked_softmax(self.scores(h), mask, dim=1)
        return torch.einsum("bk,bkd->bd", att, h), att


class AttentionMIL(_BagEncoder):
    """Encoder -> gated attention pooling -> linear head with ``num_classes`` (2) logits.

    Args:
        encoder: instance encoder module, ``(N, 1, P, P, P) -> (N, D)``.
        pool: pooling module (default :class:`GatedAttentionPool` ``(D, attn_dim, dropout)``).
        head: head on the pooled embedding (default ``Linear(D, num_classes)``).
        num_classes: logits of the default head.
        dropout: dropout on the attention gate and before the head.
        tta_flips: in eval mode, average over the 8 flips of the patch axes.
        attn_dim: hidden size of the default attention gate.
        embed_dim: D, when the encoder has no ``embed_dim`` attribute.

    References:
        Ilse, Tomczak & Welling, "Attention-based Deep Multiple Instance Learning", ICML 2018.
        https://arxiv.org/abs/1802.04712
    """

    def __init__(self, encoder: nn.Module, pool: nn.Module | None = None, head: nn.Module | None = None,
                 num_classes: int = 2, dropout: float = 0.0, tta_flips: bool = False, attn_dim: int = 64,
                 embed_dim: int | None = None) -> None:
        super().__init__()
        d = embed_dim_of(encoder, embed_dim)
        self.tta_flips = bool(tta_flips)
        self.encoder = encoder
        self.pool = pool if pool is not None else GatedAttentionPool(d, attn_dim, dropout)
        self.dropout = nn.Dropout(dropout)
        self.head = head if head is not None else nn.Linear(d, num_classes)
        self.embed_dim = d

    def forward_features(self, bags: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(pooled (B, D), attention (B, K))``; ``head(pooled)`` gives the logits.

        In eval mode with ``tta_flips`` both are means over the 8 flips of the patches."""
        if self.tta_flips and not self.training:
            outs = [self._pooled(_flipped(bags, flip), mask) for flip in range(8)]
            return (torch.stack([o[0] for o in outs]).mean(0), torch.stack([o[1] for o in outs]).mean(0))
        return self._pooled(bags, mask)

    def _pooled(self, bags: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.pool(self.encode(bags, mask), mask)

    def features(self, bags: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Pooled CT-level embedding ``(B, D)``, the input of ``head``."""
        return self.forward_features(bags, mask)[0]

    def forward(self, bags: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        z, att = self.forward_features(bags, mask)
        return self.head(self.dropout(z)), att


class NoisyORHead(Described, nn.Module):
    """Leaky noisy-OR over instances: features ``(B, K, D + 1)`` (embedding + validity flag) -> logits.

    Returns ``(logits (B, 2), instance_probs (B, K))`` when called via :meth:`forward_with_probs`;
    ``forward`` returns the logits only, so it can stand where a plain head is expected.
    """

    def __init__(self, in_dim: int, leak_init: float = 0.01, instance_prior: float = 0.05) -> None:
        super().__init__()
        self.instance = nn.Linear(in_dim, 1)
        # start from small instance probabilities, so a bag of K candidates is not certain cancer
        nn.init.constant_(self.instance.bias, float(torch.logit(torch.tensor(instance_prior))))
        self.leak_logit = nn.Parameter(torch.logit(torch.tensor(float(leak_init))))

    @torch.jit.export
    def forward_with_probs(self, feats: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h, valid = feats[..., :-1], feats[..., -1] > 0.5
        s = self.instance(h).squeeze(-1)  # instance logits (B, K)
        log_not = (functional.logsigmoid(-s) * valid).sum(dim=1) + functional.logsigmoid(-self.leak_logit)  # log(1 - P)
        log_p = _log1mexp(log_not)  # log P
        probs = torch.sigmoid(s) * valid
        return torch.stack([log_not, log_p], dim=1), probs

    def forward(self, feats: torch.Tensor) -> torch.Tensor:
        return self.forward_with_probs(feats)[0]


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """``log(1 - exp(x))`` for ``x < 0``, numerically stable (Maechler 2012)."""
    x = x.clamp(max=-1e-7)
    return torch.where(x > -0.6931471805599453, torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


class _InstanceHeadMIL(_BagEncoder):
    """Shared body of the MIL models whose head sees every instance (noisy-OR, log-sum-exp).

    ``features(bags, mask)`` returns ``(B, K, D + 1)``: instance embeddings with the validity flag
    appended, so that ``head(features)`` alone reproduces the logits (LAS head retraining works
    unchanged). ``head.forward_with_probs`` gives ``(logits, per-instance weights)``.
    """

    if TYPE_CHECKING:  # for the type checker only (TorchScript reads annotations)
        head: NoisyORHead | LogSumExpHead

    def __init__(self, encoder: nn.Module, head: NoisyORHead | LogSumExpHead, tta_flips: bool = False,
                 embed_dim: int | None = None) -> None:
        super().__init__()
        self.tta_flips = bool(tta_flips)
        self.encoder = encoder
        self.embed_dim = embed_dim_of(encoder, embed_dim)
        self.head = head

    def features(self, bags: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Instance embeddings + validity flag ``(B, K, D + 1)`` (flip-averaged in eval mode with ``tta_flips``)."""
        if self.tta_flips and not self.training:
            h = torch.stack([self.encode(_flipped(bags, flip), mask) for flip in range(8)]).mean(0)
        else:
            h = self.encode(bags, mask)
        return torch.cat([h, mask.to(h.dtype).unsqueeze(-1)], dim=-1)

    def forward_features(self, bags: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        f = self.features(bags, mask)
        return f, self.head.forward_with_probs(f)[1]

    def forward(self, bags: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.head.forward_with_probs(self.features(bags, mask))


class NoisyORMIL(_InstanceHeadMIL):
    """Leaky noisy-OR MIL (Liao et al. 2019) with the :class:`AttentionMIL` forward contract.

    The "attention" output holds the per-instance probabilities ``p_i`` (0 if masked).

    References:
        Liao, Liang, Li, Hu & Song, "Evaluate the Malignancy of Pulmonary Nodules Using the 3D Deep
        Leaky Noisy-OR Network", IEEE TNNLS 2019. https://arxiv.org/abs/1711.08324
    """

    def __init__(self, encoder: nn.Module, head: NoisyORHead | None = None, leak_init: float = 0.01,
                 tta_flips: bool = False, embed_dim: int | None = None) -> None:
        d = embed_dim_of(encoder, embed_dim)
        super().__init__(encoder, head if head is not None else NoisyORHead(d, leak_init), tta_flips, d)


class LogSumExpHead(Described, nn.Module):
    """Gated attention scores pooled by log-sum-exp: features ``(B, K, D + 1)`` -> logits ``(B, 2)``.

    With instance scores ``a_k`` (the gated attention of Ilse et al. 2018) and a learnable leak
    ``a_0`` (the "dummy instance" for a cancer outside the bag, as in the leaky noisy-OR), the
    cancer logit is ``b + log(exp(a_0) + sum_k exp(a_k))`` over valid instances, i.e. the odds are
    a *sum* of per-instance likelihood ratios. That is the form of the Bayes posterior when one
    instance of a positive bag is the cause (``docs/architecture.md``); unlike softmax-attention
    pooling, which averages, it can count: two suspicious nodules are more suspicious than one.
    The logits are ``(0, cancer logit)`` and the attention is the masked softmax of ``a``: the
    posterior that candidate ``k`` is the cancer, given that there is one in the bag.
    """

    def __init__(self, in_dim: int, attn_dim: int = 64, dropout: float = 0.0) -> None:
        super().__init__()
        self.gate = GatedAttentionPool(in_dim, attn_dim, dropout)
        self.leak = nn.Parameter(torch.tensor(-2.0))
        self.bias = nn.Parameter(torch.tensor(0.0))

    @torch.jit.export
    def forward_with_probs(self, feats: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h, valid = feats[..., :-1], feats[..., -1] > 0.5
        a = self.gate.scores(h)
        s = torch.cat([self.leak.expand(a.shape[0], 1), a.masked_fill(~valid, float("-inf"))], dim=1)
        cancer = self.bias + torch.logsumexp(s, dim=1)
        return torch.stack([torch.zeros_like(cancer), cancer], dim=1), masked_softmax(a, valid, dim=1)

    def forward(self, feats: torch.Tensor) -> torch.Tensor:
        return self.forward_with_probs(feats)[0]


class LogSumExpMIL(_InstanceHeadMIL):
    """Encoder -> gated attention scores -> log-sum-exp pooling (:class:`LogSumExpHead`).

    The CT bundles' ``network_def``. Args as :class:`AttentionMIL` (``embed_dim`` only for
    encoders without an ``embed_dim`` attribute).

    References:
        Ilse, Tomczak & Welling, "Attention-based Deep Multiple Instance Learning", ICML 2018.
        https://arxiv.org/abs/1802.04712 (the gated attention scores).
    """

    def __init__(self, encoder: nn.Module, head: LogSumExpHead | None = None, attn_dim: int = 64,
                 dropout: float = 0.0, tta_flips: bool = False, embed_dim: int | None = None) -> None:
        d = embed_dim_of(encoder, embed_dim)
        super().__init__(encoder, head if head is not None else LogSumExpHead(d, attn_dim, dropout), tta_flips, d)


def build_mil_model(encoder: str = "small", head: str = "attention", embed_dim: int = 64, patch_size: int = 16,
                    attn_dim: int = 64, dropout: float = 0.0, num_classes: int = 2, tta_flips: bool = False,
                    **encoder_kwargs) -> nn.Module:
    """Build a MIL model.

    Args:
        encoder: ``"small"`` (CPU default) or ``"resnet10"`` (MONAI).
        head: ``"attention"`` (gated attention + linear head), ``"lse"`` (gated attention scores +
            log-sum-exp pooling, :class:`LogSumExpHead`) or ``"noisy_or"``.
        embed_dim: instance embedding size D.
        patch_size: patch edge P (checked against the encoder; any P >= 8 works).
        attn_dim: hidden size of the attention gate.
        dropout: dropout on the attention gate (attention and log-sum-exp heads) and before the
            linear head (attention head).
        num_classes: logits of the attention head (2; log-sum-exp and noisy-OR are binary by
            construction).
        tta_flips: in eval mode, average features and attention over the 8 flips of the patch axes.
    """
    if patch_size < 8:
        raise ConfigError(f"patch_size={patch_size} is too small", field="patch_size", fix="use patch_size >= 8")
    enc = InstanceEncoder(encoder, embed_dim=embed_dim, **encoder_kwargs)
    if head == "attention":
        return AttentionMIL(enc, GatedAttentionPool(embed_dim, attn_dim, dropout), num_classes=num_classes,
                            dropout=dropout, tta_flips=tta_flips)
    if head in ("lse", "noisy_or", "noisyor") and num_classes != 2:
        raise ConfigError(f"the {head} head is binary", field="num_classes", fix="use num_classes=2")
    if head == "lse":
        return LogSumExpMIL(enc, attn_dim=attn_dim, dropout=dropout, tta_flips=tta_flips)
    if head in ("noisy_or", "noisyor"):
        return NoisyORMIL(enc, tta_flips=tta_flips)
    raise ConfigError(f"unknown MIL head {head!r}", field="head", fix="use 'attention', 'lse' or 'noisy_or'")
