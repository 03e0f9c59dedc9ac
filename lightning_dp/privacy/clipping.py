"""Flat L2 clipping of per-sample gradients (Abadi et al. 2016, Algorithm 1, "clip gradient")."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["clip_factors", "check_max_grad_norm"]

#: Added to the norm so that ``factor * norm <= max_grad_norm`` holds even for tiny norms.
NORM_EPS = 1e-6


def check_max_grad_norm(max_grad_norm: float) -> float:
    """Validates a clipping threshold C and returns it as a float."""
    try:
        value = float(max_grad_norm)
    except (TypeError, ValueError):
        raise ValueError(f"max_grad_norm={max_grad_norm!r} is not a number; pass a positive float such as 1.0") from None
    if not (value > 0 and torch.isfinite(torch.tensor(value))):
        raise ValueError(
            f"max_grad_norm={max_grad_norm!r} is not allowed: the clipping threshold C must be a finite number "
            "> 0 (it is the L2 sensitivity of each example's contribution). Typical values are 0.1 to 10.")
    return value


def clip_factors(norms: Tensor, max_grad_norm: float) -> Tensor:
    """Per-sample scale factors ``min(1, C / (||g_i|| + 1e-6))``.

    Multiplying example i's gradient by its factor bounds its L2 norm by ``C`` (strictly),
    which is the sensitivity the Gaussian noise is calibrated to.

    Args:
        norms: per-sample gradient norms, shape ``(B,)``.
        max_grad_norm: the clipping threshold ``C``.

    Example:
        >>> clip_factors(torch.tensor([0.5, 2.0]), 1.0)
        tensor([1.0000, 0.5000])
    """
    return (max_grad_norm / (norms + NORM_EPS)).clamp(max=1.0)
