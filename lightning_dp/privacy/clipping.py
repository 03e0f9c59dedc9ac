"""Flat L2 clipping of per-sample gradients (Abadi et al. 2016, Algorithm 1, "clip gradient")."""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

from lightning_dp import checks

__all__ = ["clip_factors", "check_clip", "check_max_grad_norm", "sanitized_cosine"]

#: Added to the norm so that ``factor * norm <= max_grad_norm`` holds even for tiny norms.
NORM_EPS = 1e-6


def check_clip(value: Any, *, name: str = "max_grad_norm", hint: Optional[str] = None) -> float:
    """A clipping threshold C as a float: a finite number > 0 (``bool`` is not one), else a ValueError naming
    ``name``, the value, the range and the fix (``hint``: another fix, for a threshold that an update computed). The
    one check of every C: DP-SGD's ``max_grad_norm``, a clipping strategy's current threshold, a sanitizer's ``clip``
    of a client's update.

    Example:
        >>> check_clip(1)
        1.0
        >>> check_clip(0.0, name="clip")
        Traceback (most recent call last):
        ...
        ValueError: clip=0.0 is not allowed: clip must be a finite number > 0; it is the clipping threshold C, the \
bound on the L2 norm of one contribution (an example's gradient, a client's update) that the noise is calibrated to. \
Pass e.g. clip=1.0; typical values are 0.1 to 10.
    """
    return checks.positive_real(
        name, value, hint="it is the clipping threshold C, the bound on the L2 norm of one contribution (an example's "
        "gradient, a client's update) that the noise is calibrated to. "
        + (hint or f"Pass e.g. {name}=1.0; typical values are 0.1 to 10."))


#: DP-SGD's name for :func:`check_clip` (its argument is ``max_grad_norm``).
check_max_grad_norm = check_clip


def clip_factors(norms: Tensor, max_grad_norm: float | Tensor) -> Tensor:
    """Per-sample scale factors ``min(1, C / (||g_i|| + 1e-6))``.

    Multiplying example i's gradient by its factor bounds its L2 norm by ``C`` (strictly),
    which is the sensitivity the Gaussian noise is calibrated to.

    Args:
        norms: per-sample gradient norms, shape ``(B,)``.
        max_grad_norm: the clipping threshold ``C`` (checked: :func:`check_max_grad_norm`); a 0-d tensor in a
            compiled pass, where a float that changes from step to step would recompile.

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
