"""Adaptive clipping rules: the functional core of the adaptive-clipping callbacks.

OSO-DPSGD (Galli et al., AAAI 2024) and quantile clipping (Andrew et al., NeurIPS 2021) move the clipping
threshold ``C``; the statistic each releases shares one noise multiplier with the gradient
(:func:`composed_noise_multiplier`: one Gaussian mechanism per step). Adjacency add/remove; every draw takes an
explicit ``torch.Generator``. The rules and why they are hand-written (Opacus' AdaClip differs):
docs/privacy.md, "Adaptive clipping".

Example:
    >>> nu_g, nu_q = oso_noise_split(1.0)
    >>> round(nu_g, 3), round(nu_q, 3), round(composed_noise_multiplier(nu_g, nu_q), 12)
    (1.01, 7.124, 1.0)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

from lightning_dp import checks
from lightning_dp.privacy.clipping import NORM_EPS, check_clip, clip_factors
from lightning_dp.privacy.noise import check_noise_multiplier, gaussian_noise

__all__ = [
    "OSO_CLIP_LR",
    "OSO_INITIAL_CLIP",
    "OSO_LR_LR",
    "OSO_Q_NOISE_RATIO",
    "OSOStatistics",
    "composed_noise_multiplier",
    "count_unclipped",
    "default_count_noise_std",
    "oso_noise_split",
    "oso_noisy_q_sum",
    "oso_q_weights",
    "oso_statistics",
    "oso_update",
    "quantile_clip_update",
    "quantile_noise_split",
]

#: Thesis heuristic ``nu_q = 7.124 nu``: it leaves the gradient ``nu_g = 1.01 nu`` (1 % more noise).
OSO_Q_NOISE_RATIO = 7.124
#: Default initial clipping threshold ``C_0`` of OSO-DPSGD.
OSO_INITIAL_CLIP = 0.1
#: Default step ``rho_c`` of the multiplicative update of ``C`` (eq. 3.20).
OSO_CLIP_LR = 2.5e-3
#: Default step ``rho_r`` of the multiplicative update of the learning rate (eq. 3.21).
OSO_LR_LR = 2.5e-3

Tensors = Tensor | Sequence[Tensor]
"""One flat tensor, or one tensor per parameter."""


# --------------------------------------------------------------------------- validation


def _check_clip(clip: Any) -> float:
    return check_clip(clip, name="clip", hint="An adaptive rule's multiplicative update keeps it positive: pass the "
                      "value the previous update returned (OSO starts at 0.1).")


def _as_count(value: Any, name: str) -> float:
    if isinstance(value, Tensor):
        if value.numel() != 1:
            raise ValueError(f"{name} must be a scalar, got a tensor of shape {tuple(value.shape)}.")
        value = value.item()
    if not checks.is_real(value) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}. Pass a number of examples.")
    return float(value)


# --------------------------------------------------------------------------- accounting


def composed_noise_multiplier(*multipliers: float) -> float:
    """The multiplier of the single Gaussian mechanism that several Gaussian releases form.

    ``nu = (sum_k nu_k^-2)^(-1/2)``, where release ``k`` adds ``N(0, (nu_k Delta_k)^2 I)``
    to a query of L2 sensitivity ``Delta_k`` (Galli et al. 2024, Proposition 1; Andrew
    et al. 2021, Theorem 1).

    Derivation: let the releases be computed on the same batch and rescale each by its
    noise scale, ``A_k / (nu_k Delta_k) = f_k(batch) / (nu_k Delta_k) + N(0, I)``
    (data-independent post-processing, invertible). Stacked, this is ONE Gaussian
    mechanism with unit noise whose mean moves, when one example is added or removed,
    by a vector of norm at most ``sqrt(sum_k nu_k^-2) = 1 / nu``; the privacy of a
    Gaussian mechanism depends only on that norm over the noise std, so the stack is
    the Gaussian mechanism with multiplier ``nu``. For OSO the releases are the clipped
    sum (``Delta = C``, multiplier ``nu_g``) and the sum of the ``q_i`` (``Delta = 1``,
    ``nu_q``); for quantile clipping the clipped sum (``z_Delta``) and the centered
    count (``Delta = 1/2``, std ``sigma_b``, multiplier ``2 sigma_b``). The bound is
    attained (an example with ``||g|| > C`` moves both parts by their maximum), so it
    is tight.

    Accounting consequence: with Poisson sampling both releases see the *same* batch,
    so one step is ``PoissonSampledDpEvent(q, GaussianDpEvent(nu))``, not a composition
    of two separately sampled events. Without sampling (``q = 1``) the two views agree
    exactly: RDP adds ``a / (2 nu_k^2)`` per release and the privacy loss distribution
    of composed Gaussians is the Gaussian one.

    Args:
        *multipliers: The noise multipliers ``nu_k > 0`` of the releases (at least one).

    Returns:
        The composed multiplier ``nu``, smaller than every ``nu_k``.

    Example:
        >>> round(composed_noise_multiplier(2.0, 2.0), 12) == round(2.0 / math.sqrt(2), 12)
        True
    """
    if not multipliers:
        raise ValueError("composed_noise_multiplier needs at least one noise multiplier, got none.")
    return math.fsum(check_noise_multiplier(m) ** -2 for m in multipliers) ** -0.5


# --------------------------------------------------------------------------- OSO-DPSGD


def oso_noise_split(noise_multiplier: float, *, q_noise_multiplier: float | None = None) -> tuple[float, float]:
    """Splits one OSO-DPSGD noise multiplier between the gradient and the ``q`` release.

    ``nu_g = (nu^-2 - nu_q^-2)^(-1/2)`` so that :func:`composed_noise_multiplier`
    ``(nu_g, nu_q) == nu`` (Galli et al. 2024, Proposition 1): the accountant records
    ``nu``, the clipped sum receives ``N(0, (nu_g C_t)^2 I)`` and the sum of the ``q_i``
    receives ``N(0, nu_q^2 I)`` (:func:`oso_noisy_q_sum`).

    Args:
        noise_multiplier: The overall multiplier ``nu`` the accountant records.
        q_noise_multiplier: ``nu_q``, the multiplier of the ``q`` release; ``None`` uses
            the thesis heuristic ``7.124 nu``, which gives ``nu_g = 1.01 nu``.

    Returns:
        ``(nu_g, nu_q)``.

    Raises:
        ValueError: If ``nu`` is not a positive number, or ``nu_q <= nu`` (the ``q``
            release alone would use the whole budget, leaving none for the gradient).

    Example:
        >>> nu_g, nu_q = oso_noise_split(2.0, q_noise_multiplier=4.0)
        >>> round(nu_g, 6), nu_q
        (2.309401, 4.0)
    """
    nu = check_noise_multiplier(noise_multiplier)
    if q_noise_multiplier is None:
        nu_q = OSO_Q_NOISE_RATIO * nu
    else:
        nu_q = checks.positive_real(
            "q_noise_multiplier", q_noise_multiplier, hint="it is nu_q, the noise multiplier of the released sum of "
            "q_i; pass None for the default 7.124 * noise_multiplier")
    if nu_q <= nu:
        raise ValueError(
            f"q_noise_multiplier={q_noise_multiplier!r} must be larger than noise_multiplier={noise_multiplier!r}: "
            f"the q release with multiplier {nu_q!r} would spend the whole budget of multiplier {nu!r} and leave "
            "none for the gradient (nu_g = (nu^-2 - nu_q^-2)^(-1/2) would be infinite or undefined). Pass a larger "
            f"q_noise_multiplier (e.g. None for the default {OSO_Q_NOISE_RATIO} * noise_multiplier) or a smaller "
            "noise_multiplier.")
    return (nu ** -2 - nu_q ** -2) ** -0.5, nu_q


class OSOStatistics(NamedTuple):
    """Per-example scalar weights of one OSO-DPSGD step (see :func:`oso_statistics`)."""

    clip_factors: Tensor
    """``min(1, C / (||g_i|| + 1e-6))``: the clipped sum is ``sum_i clip_factors[i] g_i``."""
    q_weights: Tensor
    """``1[||g_i|| > C] / (||g_i|| + 1e-6)``: the ``q`` sum is ``sum_i q_weights[i] g_i``."""


def oso_statistics(per_sample_norms: Tensor, clip: float) -> OSOStatistics:
    """The clip factors and the ``q`` weights of OSO-DPSGD, from the per-example norms.

    ``q_i = g_i / ||g_i||`` if ``||g_i|| > C`` else ``0`` is the derivative of the clipped
    gradient ``g_i min(1, C / ||g_i||)`` with respect to ``C`` (Galli et al. 2024, thesis
    Algorithm 3); ``||q_i|| <= 1``, so the sum of the ``q_i`` has sensitivity 1. Both sums
    are weighted sums of the per-example gradients, so a caller that only has the norms
    and a weighted-sum routine (``GradSampleEngine.clipped_sum(weights)``) forms them
    without materializing any ``g_i``. The clip factors are
    :func:`~lightning_dp.privacy.clipping.clip_factors` (one formula, one place).
    An example at the threshold (``||g_i|| == C``) is not clipped (``q_i = 0``); a zero
    gradient has weight 0, never NaN.

    Args:
        per_sample_norms: ``||g_i||``, shape ``(B,)``.
        clip: The current threshold ``C_t > 0``.

    Returns:
        :class:`OSOStatistics` ``(clip_factors, q_weights)``, both of shape ``(B,)``.

    Example:
        >>> stats = oso_statistics(torch.tensor([0.0, 0.5, 2.0]), 1.0)
        >>> stats.q_weights
        tensor([0.0000, 0.0000, 0.5000])
    """
    clip = _check_clip(clip)
    return OSOStatistics(clip_factors(per_sample_norms, clip), oso_q_weights(per_sample_norms, clip))


def oso_q_weights(per_sample_norms: Tensor, clip: float | Tensor) -> Tensor:
    """:func:`oso_statistics`' ``q`` weights with ``clip`` already checked (a tensor too: what a compiled pass
    computes, :func:`lightning_dp.callbacks.private_step.fused_pass`)."""
    clipped = per_sample_norms > clip
    safe = torch.where(clipped, per_sample_norms, torch.ones_like(per_sample_norms))
    # 1 / (||g|| + NORM_EPS) as in clip_factors: a rounding error in the computed norm cannot push
    # ||q_i|| above 1, the sensitivity the q noise is calibrated to
    return torch.where(clipped, (safe + NORM_EPS).reciprocal(), torch.zeros_like(per_sample_norms))


def oso_noisy_q_sum(q_sum: Sequence[Tensor], *, q_noise_multiplier: float,
                    generator: torch.Generator) -> list[Tensor]:
    """The released ``q~_t = sum_i q_i + N(0, nu_q^2 I)`` of OSO-DPSGD.

    The noise std is ``nu_q`` itself, *not* ``nu_q C_t``: each ``q_i`` is a unit vector or
    zero, so this query has sensitivity 1 whatever the threshold. Like the gradient
    noise, it must be drawn once per step in aggregate (after the all-reduce under DDP,
    with the same derived generator on every rank).

    Args:
        q_sum: ``sum_i q_i``, one tensor per parameter (``clipped_sum(q_weights)``).
        q_noise_multiplier: ``nu_q`` from :func:`oso_noise_split`.
        generator: The generator of this query.

    Returns:
        One noisy tensor per parameter.

    Example:
        >>> g = torch.Generator().manual_seed(0)
        >>> [t.shape for t in oso_noisy_q_sum([torch.zeros(2, 3)], q_noise_multiplier=7.124, generator=g)]
        [torch.Size([2, 3])]
    """
    nu_q = checks.positive_real(
        "q_noise_multiplier", q_noise_multiplier, hint="pass the nu_q returned by oso_noise_split")
    first = q_sum[0]
    noise = gaussian_noise([t.shape for t in q_sum], nu_q, generator, dtype=first.dtype, device=first.device)
    return [s + n for s, n in zip(q_sum, noise)]


def _as_tensor_list(value: Tensors) -> list[Tensor]:
    return [value] if isinstance(value, Tensor) else list(value)


def _dot(a: Tensors, b: Tensors, names: str) -> float:
    """The dot product over all parameters, accumulated in float64, as a Python float (one sync)."""
    xs, ys = _as_tensor_list(a), _as_tensor_list(b)
    if not (len(xs) == len(ys) and all(x.numel() == y.numel() for x, y in zip(xs, ys))):
        # a flat tensor against a list, or lists split differently: compare the concatenations
        total_x, total_y = sum(x.numel() for x in xs), sum(y.numel() for y in ys)
        if total_x != total_y:
            raise ValueError(
                f"{names} have different sizes ({total_x} and {total_y} elements): pass one tensor per "
                "parameter in the same order for both, or flat tensors of the concatenated parameters.")
        device = xs[0].device
        xs = [torch.cat([x.reshape(-1).to(device) for x in xs])]
        ys = [torch.cat([y.reshape(-1).to(device) for y in ys])]
    device = xs[0].device
    total = torch.zeros((), dtype=torch.float64, device=device)
    for x, y in zip(xs, ys):
        total += (x.reshape(-1).double() @ y.reshape(-1).double().to(x.device)).to(device)
    return total.item()


def _sign(x: float) -> float:
    return float((x > 0) - (x < 0))


def oso_update(clip: float, lr: float, g_noisy: Tensors, g_prev: Tensors | None, q_prev: Tensors | None, *,
               clip_lr: float = OSO_CLIP_LR, lr_lr: float = OSO_LR_LR) -> tuple[float, float]:
    """One OSO-DPSGD update of the clipping threshold and the learning rate.

    Galli et al. 2024, thesis eqs. 3.20 and 3.21::

        C_{t+1}   = C_t   * exp(rho_c * sign(g~_t . q~_{t-1}))
        rho_{t+1} = rho_t * exp(rho_r * sign(g~_t . g~_{t-1}))

    Sign convention (hypergradient descent): ``theta_t = theta_{t-1} - rho g~_{t-1}/m``
    and ``d g~_{t-1} / d C = sum_i q_i``, so ``dL(theta_t)/dC_{t-1} ~ -g_t . q_{t-1}``;
    descending it *raises* ``C`` when the new gradient agrees with ``q``. Likewise
    ``dL/drho ~ -g_t . g_{t-1}``. Only the signs of the dot products of released
    (noisy) vectors are used, so the update is post-processing (no privacy cost) and
    any positive scaling of the inputs (noisy sum or noisy mean) gives the same result.

    Args:
        clip: ``C_t > 0``.
        lr: ``rho_t > 0``, the learning rate.
        g_noisy: ``g~_t``, the noisy gradient of this step: a flat tensor or one tensor
            per parameter (the dot product runs over all parameters).
        g_prev: ``g~_{t-1}``; ``None`` on the first step leaves the learning rate unchanged.
        q_prev: ``q~_{t-1}`` (:func:`oso_noisy_q_sum`); ``None`` on the first step leaves
            ``C`` unchanged.
        clip_lr: ``rho_c >= 0`` (default ``2.5e-3``).
        lr_lr: ``rho_r >= 0`` (default ``2.5e-3``); 0 keeps the learning rate fixed.

    Returns:
        ``(C_{t+1}, rho_{t+1})``. A zero dot product (``sign(0) = 0``) leaves the value
        unchanged.

    Example:
        >>> new_clip, new_lr = oso_update(0.1, 0.5, torch.ones(3), -torch.ones(3), torch.ones(3))
        >>> round(new_clip / 0.1, 6), round(new_lr / 0.5, 6)
        (1.002503, 0.997503)
    """
    clip = _check_clip(clip)
    lr = checks.positive_real(
        "lr", lr, hint="it is the current learning rate rho_t; a multiplicative update keeps it positive")
    clip_lr = checks.non_negative_real(
        "clip_lr", clip_lr, hint=f"it is rho_c, the step of log C per update (default {OSO_CLIP_LR})")
    lr_lr = checks.non_negative_real(
        "lr_lr", lr_lr, hint=f"it is rho_r, the step of log(lr) per update (default {OSO_LR_LR})")
    if q_prev is not None:  # exp(0) == 1.0 exactly: a zero dot product leaves C bit-identical
        clip *= math.exp(clip_lr * _sign(_dot(g_noisy, q_prev, "g_noisy and q_prev")))
    if g_prev is not None:
        lr *= math.exp(lr_lr * _sign(_dot(g_noisy, g_prev, "g_noisy and g_prev")))
    return clip, lr


# --------------------------------------------------------------------------- quantile clipping


def default_count_noise_std(expected_batch_size: float) -> float:
    """``sigma_b = m / 20``, the std of the noise on the unclipped count (Andrew et al. 2021).

    The paper's recommendation (also TF Federated's default ``0.05 * clients_per_round``):
    the noisy fraction then has std 0.05 whatever the batch size.

    Example:
        >>> default_count_noise_std(256)
        12.8
    """
    m = checks.positive_real(
        "expected_batch_size", expected_batch_size, hint="it is m = q * N, the expected number of examples per batch")
    return m / 20


def quantile_noise_split(noise_multiplier: float, *, count_noise_std: float) -> float:
    """The multiplier ``z_Delta`` of the clipped sum under quantile clipping.

    ``z_Delta = (z^-2 - (2 sigma_b)^-2)^(-1/2)`` (Andrew et al. 2021, Theorem 1). The count
    query releases ``sum_i (1[||g_i|| <= C] - 1/2) + N(0, sigma_b^2)``; after the ``-1/2``
    centering, adding or removing one example moves it by exactly ``1/2``, so its
    multiplier is ``2 sigma_b``, and :func:`composed_noise_multiplier` ``(z_Delta,
    2 sigma_b) == z``: the accountant records ``z``.

    Args:
        noise_multiplier: ``z``, the overall multiplier the accountant records.
        count_noise_std: ``sigma_b > 0``, the std of the noise on the count
            (:func:`default_count_noise_std`: ``m / 20``).

    Returns:
        ``z_Delta``, the multiplier of the clipped-sum noise (``N(0, (z_Delta C)^2 I)``).

    Raises:
        ValueError: If ``z >= 2 sigma_b`` (the count query would need the whole budget or more).

    Example:
        >>> round(quantile_noise_split(1.0, count_noise_std=12.8), 6)
        1.000764
    """
    z = check_noise_multiplier(noise_multiplier)
    sigma_b = checks.positive_real(
        "count_noise_std", count_noise_std, hint="it is sigma_b, the std of the noise on the unclipped count; "
        "Andrew et al. use expected_batch_size / 20 (default_count_noise_std)")
    if z >= 2 * sigma_b:
        raise ValueError(
            f"noise_multiplier={noise_multiplier!r} must be smaller than 2 * count_noise_std = {2 * sigma_b!r}: "
            "the centered count has sensitivity 1/2, so its noise alone is a Gaussian mechanism with multiplier "
            f"2 * count_noise_std, and at or below the overall multiplier it would use the whole budget (or more), "
            "leaving none for the gradient. Increase count_noise_std (e.g. expected_batch_size / 20) or lower "
            "noise_multiplier.")
    return (z ** -2 - (2 * sigma_b) ** -2) ** -0.5


def count_unclipped(per_sample_norms: Tensor, clip: float) -> Tensor:
    """``sum_i 1[||g_i|| <= C]``, the examples the threshold leaves unclipped (a 0-dim tensor).

    A tensor, so that DDP ranks can all-reduce it before :func:`quantile_clip_update`.

    Example:
        >>> count_unclipped(torch.tensor([0.5, 1.0, 2.0]), 1.0)
        tensor(2)
    """
    return (per_sample_norms <= _check_clip(clip)).sum()


def quantile_clip_update(clip: float, unclipped_count: float | Tensor, batch_size: int, expected_batch_size: float,
                         *, target_quantile: float = 0.5, clip_lr: float = 0.2, count_noise_std: float,
                         generator: torch.Generator) -> tuple[float, float]:
    """One geometric step of quantile-adaptive clipping (Andrew et al. 2021, Algorithm 1).

    ::

        b~      = clamp((sum_i (1[||g_i|| <= C] - 1/2) + N(0, sigma_b^2)) / m + 1/2, 0, 1)
        C_{t+1} = C_t * exp(-eta_C * (b~ - gamma))

    The sum runs over the realized batch, ``sum_i (1[...] - 1/2) = unclipped_count -
    batch_size / 2``: centering with the *realized* size is what gives the query
    sensitivity ``1/2`` (with ``m / 2`` instead it would be 1, and the split of
    :func:`quantile_noise_split` would be wrong). The division by the *expected* batch
    size ``m`` is data-independent. ``C`` shrinks when more than a ``gamma`` fraction
    is unclipped, grows otherwise. The draw is one float64 standard normal from
    ``generator`` (consumed even when ``count_noise_std == 0``), so all ranks of a DDP
    job that use the same derived generator compute the same threshold.

    Args:
        clip: ``C_t > 0``.
        unclipped_count: ``sum_i 1[||g_i|| <= C_t]`` over the batch (all ranks), e.g.
            :func:`count_unclipped`.
        batch_size: The realized number of examples in the batch (all ranks).
        expected_batch_size: ``m = q N > 0``.
        target_quantile: ``gamma`` in ``[0, 1]``, the target fraction of unclipped examples.
        clip_lr: ``eta_C >= 0``, the step of ``log C`` (the paper recommends 0.2).
        count_noise_std: ``sigma_b >= 0``. Use the value given to
            :func:`quantile_noise_split`; 0 means no noise (NOT private, for tests only).
        generator: The generator of this query.

    Returns:
        ``(C_{t+1}, b~)``.

    Example:
        >>> g = torch.Generator().manual_seed(0)
        >>> new_clip, b = quantile_clip_update(1.0, 48, 64, 64, count_noise_std=0.0, generator=g)
        >>> b, round(new_clip, 6)
        (0.75, 0.951229)
    """
    clip = _check_clip(clip)
    count = _as_count(unclipped_count, "unclipped_count")
    size = _as_count(batch_size, "batch_size")
    if count > size:
        raise ValueError(
            f"unclipped_count={unclipped_count!r} cannot exceed batch_size={batch_size!r}: the count is taken over "
            "the examples of the batch. Pass the realized batch size (summed over ranks).")
    m = checks.positive_real(
        "expected_batch_size", expected_batch_size, hint="it is m = q * N, the expected number of examples per batch")
    if not checks.is_real(target_quantile) or not 0 <= target_quantile <= 1:
        raise ValueError(
            f"target_quantile must be a number in [0, 1], got {target_quantile!r}. It is gamma, the fraction of "
            "examples the threshold should leave unclipped (Andrew et al. recommend 0.5).")
    clip_lr = checks.non_negative_real(
        "clip_lr", clip_lr, hint="it is eta_C, the step of log C per update (Andrew et al. use 0.2)")
    sigma_b = checks.non_negative_real(
        "count_noise_std", count_noise_std,
        hint="it is sigma_b, the std of the count noise (default_count_noise_std: m / 20)")
    if not isinstance(generator, torch.Generator):
        raise ValueError(
            f"generator must be a torch.Generator, got {type(generator).__name__}: every privacy-relevant draw "
            "uses an explicit generator; derive one with lightning_dp.privacy.noise.derive_generator(seed, ...).")
    noise = torch.randn((), generator=generator, dtype=torch.float64, device=generator.device).item() * sigma_b
    b_noisy = min(1.0, max(0.0, (count - size / 2 + noise) / m + 0.5))
    return clip * math.exp(-clip_lr * (b_noisy - float(target_quantile))), b_noisy
