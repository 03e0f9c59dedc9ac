"""Flat L2 clipping of per-sample gradients (Abadi et al. 2016, Algorithm 1, "clip gradient")."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["clip_factors", "check_max_grad_norm", "sanitized_cosine"]

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


def sanitized_cosine(per_sample: Tensor, max_grad_norms: Tensor, *, noise_multiplier: float,
                     generator: torch.Generator, realizations: int = 20) -> Tensor:
    """Cosine between the DP-SGD gradient at each clipping norm C and the true mean gradient (thesis Fig. 3.1).

    For every C: the clipped per-sample gradients are averaged, ``N(0, (nu C)^2 I) / B`` is added
    (:func:`~lightning_dp.privacy.noise.noisy_mean`'s release, here with the realized ``B``), and the cosine
    with the mean of the unclipped gradients is averaged over ``realizations`` draws of the noise. Small C:
    clipping bias (the direction of the clipped mean); large C: noise. A diagnostic on exact gradients:
    what it returns is not private.

    Args:
        per_sample: ``(B, P)`` per-sample gradients, flattened.
        max_grad_norms: ``(K,)`` clipping norms.
        noise_multiplier: ``nu``.
        generator: the noise's generator.
        realizations: draws of the noise averaged per C.

    Returns:
        ``(K,)`` mean cosines.

    Example:
        >>> g = torch.tensor([[1.0, 0.0], [3.0, 0.0]])
        >>> sanitized_cosine(g, torch.tensor([0.5, 10.0]), noise_multiplier=0.0,
        ...                  generator=torch.Generator().manual_seed(0)).tolist()
        [1.0, 1.0]
    """
    if per_sample.dim() != 2:
        raise ValueError(f"per_sample must be (B, P), got shape {tuple(per_sample.shape)}")
    if not noise_multiplier >= 0:
        raise ValueError(f"noise_multiplier={noise_multiplier!r} must be >= 0")
    if isinstance(realizations, bool) or not isinstance(realizations, int) or realizations < 1:
        raise ValueError(f"realizations={realizations!r} must be a positive integer")
    g = per_sample.double()
    true = g.mean(0)
    norms = g.norm(dim=1)
    out = []
    for c in max_grad_norms.double().tolist():
        clipped = (g * clip_factors(norms, c).unsqueeze(1)).mean(0)
        noise = torch.randn((realizations, g.shape[1]), generator=generator, dtype=torch.float64,
                            device=generator.device).to(g.device)
        noisy = clipped + noise * (noise_multiplier * c / g.shape[0])
        out.append(torch.nn.functional.cosine_similarity(noisy, true.expand_as(noisy), dim=1).mean())
    return torch.stack(out)
