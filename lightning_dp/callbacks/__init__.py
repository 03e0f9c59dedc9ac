"""Lightning callbacks: the privacy mechanisms for centralized training and run tracking."""

from lightning_dp.callbacks.adaptive_clipping import OnlineSensitivity, QuantileClipping
from lightning_dp.callbacks.clipping import (
    ClipStrategy,
    FixedClip,
    OnlineSensitivityClip,
    QuantileClip,
    register_clip_strategy,
)
from lightning_dp.callbacks.dp_sgd import DPSGD
from lightning_dp.callbacks.one_run_audit import OneRunAudit
from lightning_dp.callbacks.restore_best import RestoreBestWeights
from lightning_dp.callbacks.run_artifacts import RunArtifacts

__all__ = ["DPSGD", "ClipStrategy", "FixedClip", "OneRunAudit", "OnlineSensitivity", "OnlineSensitivityClip",
           "QuantileClip", "QuantileClipping", "RestoreBestWeights", "RunArtifacts", "register_clip_strategy"]
