"""Multiple-instance learning: instance encoders, gated attention pooling, log-sum-exp and noisy-OR heads.

See docs/architecture.md (``lungcal.mil``).
"""
from lungcal.mil.encoders import ENCODERS, InstanceEncoder, ResNetEncoder, SmallCNNEncoder
from lungcal.mil.models import (
    AttentionMIL, GatedAttentionPool, LogSumExpHead, LogSumExpMIL, NoisyORHead, NoisyORMIL, build_mil_model,
    masked_softmax,
)

__all__ = [
    "ENCODERS", "InstanceEncoder", "SmallCNNEncoder", "ResNetEncoder",
    "GatedAttentionPool", "masked_softmax", "AttentionMIL", "NoisyORHead", "NoisyORMIL",
    "LogSumExpHead", "LogSumExpMIL", "build_mil_model",
]
