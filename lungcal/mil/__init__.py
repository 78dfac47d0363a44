"""Multiple-instance learning: instance encoders, gated attention pooling and noisy-OR heads.

See docs/architecture.md (``lungcal.mil``).
"""
from lungcal.mil.encoders import ENCODERS, InstanceEncoder, ResNetEncoder, SmallCNNEncoder
from lungcal.mil.models import (
    AttentionMIL, GatedAttentionPool, NoisyORHead, NoisyORMIL, build_mil_model, masked_softmax,
)

__all__ = [
    "ENCODERS", "InstanceEncoder", "SmallCNNEncoder", "ResNetEncoder",
    "GatedAttentionPool", "masked_softmax", "AttentionMIL", "NoisyORHead", "NoisyORMIL", "build_mil_model",
]
