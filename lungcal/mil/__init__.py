"""Multiple-instance learning: a CT is a bag of candidate patches with a validity mask.

- ``encoders.py``: instance encoders, one patch ``(1, P, P, P)`` -> one embedding ``(D,)``;
- ``models.py``: gated attention pooling, attention-MIL, log-sum-exp and noisy-OR MIL models;
  each takes any encoder module (``embed_dim`` for modules without that attribute);
- ``build_mil_model``: the name-based factory that checkpoints before the config bundles stored.
"""
from lungcal.mil.encoders import ENCODERS, InstanceEncoder, ResNetEncoder, SmallCNNEncoder
from lungcal.mil.models import (
    AttentionMIL,
    GatedAttentionPool,
    LogSumExpHead,
    LogSumExpMIL,
    NoisyORHead,
    NoisyORMIL,
    build_mil_model,
    embed_dim_of,
    masked_softmax,
)

__all__ = [
    "ENCODERS", "InstanceEncoder", "SmallCNNEncoder", "ResNetEncoder",
    "GatedAttentionPool", "masked_softmax", "embed_dim_of", "AttentionMIL", "NoisyORHead", "NoisyORMIL",
    "LogSumExpHead", "LogSumExpMIL", "build_mil_model",
]
