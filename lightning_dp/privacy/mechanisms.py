"""Metric privacy (d-privacy) for released models: the Euclidean Laplace mechanism.

A client releases ``theta_client + rho``, ``rho`` Euclidean Laplace with ``epsilon = n / (nu * ||delta||)``
(the noise is ``nu`` times the update ``delta``); each participation costs ``n / nu`` with respect to the
client's ``||delta||``-neighbourhood, and costs add up per client
(:class:`~lightning_dp.privacy.ledger.PrivacyLedger`). Every draw takes an explicit ``torch.Generator``. The
density, the sampler, the guarantee and its caveats: docs/privacy.md, "The Euclidean Laplace mechanism".
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from lightning_dp import checks
from lightning_dp.privacy.noise import check_noise_multiplier

__all__ = [
    "SanitizedUpdate",
    "check_metric_noise_multiplier",
    "euclidean_laplace",
    "euclidean_laplace_log_prob",
    "sample_gamma",
    "sanitize_update",
]


# --------------------------------------------------------------------------- validation


def _check_dim(dim: Any, *, name: str = "dim") -> int:
    if not isinstance(dim, numbers.Integral) or isinstance(dim, bool) or dim < 1:
        raise ValueError(
            f"{name}={dim!r} is not allowed: it must be an integer >= 1, the number of released parameters n. "
            "Pass e.g. sum(p.numel() for p in model.parameters())."
        )
    return int(dim)


def _check_laplace_epsilon(epsilon: Any) -> float:
    return checks.positive_real(
        "epsilon", epsilon, hint="it is the Euclidean Laplace parameter (the noise norm has mean dim / epsilon; "
        "epsilon = inf would mean no noise). Pass e.g. epsilon=1.0, or use sanitize_update(..., noise_multiplier=nu) "
        "to calibrate it as n / (nu * ||delta||)")


def check_metric_noise_multiplier(noise_multiplier: Any) -> float:
    """The d-privacy noise multiplier nu as a finite float >= 0, else a ValueError that says what nu is."""
    return check_noise_multiplier(
        noise_multiplier, allow_zero=True,
        meaning="nu, the expected noise norm over the update norm ||client - reference||; each participation costs "
        "n / nu, and nu = 0 releases the client's model without noise (the non-private baseline)",
        fix="Pass a value >= 0, e.g. noise_multiplier=1.0.")


# --------------------------------------------------------------------------- gamma radius


def sample_gamma(
    concentration: float,
    *,
    scale: float = 1.0,
    num_samples: int = 1,
    generator: torch.Generator,
    device: torch.device | str = "cpu",
) -> Tensor:
    """Gamma(shape=``concentration``, scale=``scale``) draws in float64 from an explicit generator.

    ``torch.distributions.Gamma.sample`` takes no generator (it would use the global
    RNG) and ``torch._standard_gamma`` is private API, so this is the squeeze/rejection
    method of Marsaglia & Tsang, "A simple method for generating gamma variables",
    ACM TOMS 26(3), 2000, written with ``torch.randn``/``torch.rand`` and ``generator``:
    with ``d = a - 1/3`` and ``c = 1 / sqrt(9 d)``, draw ``x ~ N(0, 1)``,
    ``v = (1 + c x)^3`` and ``u ~ U(0, 1)``; accept ``d v`` if ``v > 0`` and
    ``u < 1 - 0.0331 x^4`` (squeeze) or ``log u < x^2 / 2 + d (1 - v + log v)``. The
    acceptance probability is above 0.95 for every ``a >= 1`` and tends to 1 as ``a``
    grows, so a handful of vectorized rounds suffice and the cost does not depend on
    ``a`` (a sum of ``a`` exponentials would be O(a), far too slow for the millions of
    parameters of a CNN). Shapes ``a < 1`` use ``Gamma(a) = Gamma(a + 1) U^(1/a)``
    (same paper, section 6). The arithmetic is float64 and ``1 - v + log v`` is
    evaluated with ``log1p``; for ``a`` in the millions its rounding error is below
    1e-9 on a quantity of order one.

    Args:
        concentration: The shape ``a > 0`` (for the radius of :func:`euclidean_laplace`
            the dimension ``n``).
        scale: The scale ``theta > 0``; the mean is ``a * theta``.
        num_samples: Number of independent draws (>= 1).
        generator: The generator of every uniform and normal variate used.
        device: Where the draws are made (must match the generator's device).

    Returns:
        A float64 tensor of shape ``(num_samples,)``.

    Raises:
        ValueError: If an argument is outside its range.

    Example:
        >>> g = torch.Generator().manual_seed(0)
        >>> sample_gamma(3.0, scale=2.0, num_samples=4, generator=g).shape
        torch.Size([4])
    """
    if not checks.is_real(concentration) or not (math.isfinite(concentration) and concentration > 0):
        raise ValueError(f"concentration={concentration!r} must be a finite number > 0, the shape of the Gamma "
                         "distribution (the dimension n for a Euclidean Laplace radius).")
    if not checks.is_real(scale) or not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale={scale!r} must be a finite number > 0 (the Gamma scale, 1 / epsilon for a "
                         "Euclidean Laplace radius).")
    num_samples = _check_dim(num_samples, name="num_samples")
    device = torch.device(device)
    generator = checks.generator("generator", generator, device=device)
    a = float(concentration)
    boost = a < 1.0
    d = (a + 1.0 if boost else a) - 1.0 / 3.0
    c = 1.0 / math.sqrt(9.0 * d)
    out = torch.empty(num_samples, dtype=torch.float64, device=device)
    filled = 0
    while filled < num_samples:
        need = num_samples - filled
        batch = need + need // 10 + 16  # ~5% rejections at worst: usually one round
        x = torch.randn(batch, generator=generator, dtype=torch.float64, device=device)
        u = torch.rand(batch, generator=generator, dtype=torch.float64, device=device)
        w = c * x
        positive = w > -1.0
        w = torch.where(positive, w, torch.zeros_like(w))
        v = (1.0 + w) ** 3
        one_minus_v_plus_log_v = -(3.0 * w + 3.0 * w * w + w * w * w) + 3.0 * torch.log1p(w)
        accept = positive & ((u < 1.0 - 0.0331 * x.pow(4)) | (torch.log(u) < 0.5 * x * x + d * one_minus_v_plus_log_v))
        values = (d * v)[accept][:need]
        out[filled:filled + values.numel()] = values
        filled += values.numel()
    if boost:
        u = torch.rand(num_samples, generator=generator, dtype=torch.float64, device=device)
        out = out * u.pow(1.0 / a)
    return out * float(scale)


# --------------------------------------------------------------------------- Euclidean Laplace


def euclidean_laplace(
    dim: int,
    epsilon: float,
    *,
    generator: torch.Generator | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    num_samples: int | None = None,
) -> Tensor:
    """A draw of the Euclidean Laplace distribution with density proportional to ``exp(-epsilon ||z||_2)``.

    Radius ``R ~ Gamma(shape=dim, scale=1/epsilon)`` (:func:`sample_gamma`), direction
    ``g / ||g||`` with ``g ~ N(0, I_dim)`` (uniform on the sphere, Muller 1959), both
    from ``generator``; the draw is ``R g / ||g||``. Moments: ``E||z|| = dim / epsilon``,
    ``E z_i = 0`` and ``Var z_i = E R^2 / dim = (dim + 1) / epsilon^2``. Adding it to
    ``x`` is ``epsilon``-d-private for the Euclidean distance (module docstring).

    Everything is computed in float64 (the Gaussian, its norm, the radius, the
    product) and rounded once to ``dtype``: the norm of millions of components
    neither overflows nor loses precision, and a seed gives the same noise up to that
    final rounding whatever ``dtype`` is. Memory: ``8 * dim`` bytes per sample
    besides the result.

    Args:
        dim: The dimension ``n >= 1`` (number of released parameters).
        epsilon: The parameter ``epsilon > 0`` (finite).
        generator: Generator of every variate; ``None`` creates a private generator
            seeded from OS entropy (never the global RNG), i.e. a non-reproducible draw.
        dtype: Floating dtype of the result.
        device: Where the noise is drawn (must match the generator's device).
        num_samples: ``None`` for one draw of shape ``(dim,)``; an integer ``k >= 1``
            for ``k`` independent draws of shape ``(k, dim)`` (tests, audits).

    Returns:
        The noise, shape ``(dim,)`` or ``(num_samples, dim)``.

    Raises:
        ValueError: If an argument is outside its range, or if the noise does not fit
            into ``dtype`` (e.g. float16 with a tiny epsilon); use float64 then.

    Example:
        >>> g = torch.Generator().manual_seed(0)
        >>> noise = euclidean_laplace(1000, 10.0, generator=g, dtype=torch.float64)
        >>> noise.shape, 80 < float(noise.norm()) < 120  # E||noise|| = 1000 / 10
        (torch.Size([1000]), True)
    """
    dim = _check_dim(dim)
    epsilon = _check_laplace_epsilon(epsilon)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype={dtype!r} must be a floating torch.dtype such as torch.float32 or torch.float64.")
    count = 1 if num_samples is None else _check_dim(num_samples, name="num_samples")
    device = torch.device(device)
    generator = checks.generator("generator", generator, device=device)

    gaussian = torch.randn(count, dim, generator=generator, dtype=torch.float64, device=device)
    norms = torch.linalg.vector_norm(gaussian, dim=1)
    while bool((norms == 0).any()):  # probability ~0; redrawing keeps the direction uniform
        zero = norms == 0
        gaussian[zero] = torch.randn(int(zero.sum()), dim, generator=generator, dtype=torch.float64, device=device)
        norms = torch.linalg.vector_norm(gaussian, dim=1)
    radius = sample_gamma(float(dim), scale=1.0 / epsilon, num_samples=count, generator=generator, device=device)
    noise = (gaussian * (radius / norms).unsqueeze(1)).to(dtype)
    if not bool(torch.isfinite(noise).all()):
        raise ValueError(
            f"The Euclidean Laplace noise for dim={dim}, epsilon={epsilon!r} (mean norm {dim / epsilon:.3g}) does "
            f"not fit into {dtype}; pass dtype=torch.float64 or a larger epsilon."
        )
    return noise[0] if num_samples is None else noise


def euclidean_laplace_log_prob(noise: Tensor, epsilon: float) -> Tensor:
    """Log density of the Euclidean Laplace distribution at ``noise`` (last dimension = ``n``).

    ``log p(z) = n log(epsilon) + lgamma(n/2) - log 2 - (n/2) log(pi) - lgamma(n) -
    epsilon ||z||``: the normalizing constant follows from ``int_0^inf r^(n-1)
    exp(-epsilon r) dr = Gamma(n) / epsilon^n`` and the area ``2 pi^(n/2) / Gamma(n/2)``
    of the unit sphere. For ``n = 1`` it is the Laplace density with scale ``1/epsilon``.
    The mechanism's density is ``p(y | x) = exp(log_prob(y - x))``.

    Args:
        noise: Points ``z``, shape ``(..., n)``.
        epsilon: The parameter ``epsilon > 0``.

    Returns:
        Float64 log densities of shape ``noise.shape[:-1]``.

    Example:
        >>> round(float(euclidean_laplace_log_prob(torch.zeros(1), 2.0)), 12)  # log(2 / 2), Laplace(scale 1/2)
        0.0
    """
    epsilon = _check_laplace_epsilon(epsilon)
    if noise.dim() < 1 or noise.shape[-1] < 1:
        raise ValueError(f"noise must have a last dimension n >= 1, got shape {tuple(noise.shape)}.")
    n = noise.shape[-1]
    log_norm = (n * math.log(epsilon) + math.lgamma(n / 2) - math.log(2.0) - (n / 2) * math.log(math.pi)
                - math.lgamma(n))
    return log_norm - epsilon * torch.linalg.vector_norm(noise.to(torch.float64), dim=-1)


# --------------------------------------------------------------------------- sanitization


@dataclass(frozen=True)
class SanitizedUpdate:
    """What :func:`sanitize_update` releases and what it costs.

    Attributes:
        released: ``client + rho``, same shape and dtype as ``client`` (a flat parameter
            vector in the usual use).
        epsilon: The Euclidean Laplace parameter used, ``n / (nu * r)`` with ``r`` the
            (floored) update norm; a list with one entry per layer for layer-wise
            sanitization; ``inf`` for ``nu = 0``. Data-dependent: treat it like the
            update norm (log it only where the update norm may be seen).
        cost: The d-privacy cost of this release, ``n / nu`` (``sum_l n_l / nu`` layer-wise,
            the same number); ``inf`` for ``nu = 0``. Data-independent: charge it to the
            client's :class:`~lightning_dp.privacy.ledger.PrivacyLedger` entry.
        layer_costs: ``[n_l / nu, ...]`` for layer-wise sanitization, else ``None``.
        unclipped: for sanitizers that clip at a threshold the server adapts (federated
            adaptive clipping): whether the client's raw update was within it, the bit the
            server's noisy count sums (never released by itself); else ``None``.
    """

    released: Tensor
    epsilon: float | list[float]
    cost: float
    layer_costs: list[float] | None = field(default=None)
    unclipped: bool | None = field(default=None)


def _check_layer_sizes(per_layer_sizes: Any, n: int) -> list[int]:
    try:
        sizes = list(per_layer_sizes)
    except TypeError:
        raise ValueError(f"per_layer_sizes={per_layer_sizes!r} must be a sequence of positive integers summing to "
                         f"the number of parameters {n}, e.g. [p.numel() for p in model.parameters()].") from None
    bad = [s for s in sizes if not isinstance(s, numbers.Integral) or isinstance(s, bool) or s < 1]
    if not sizes or bad or sum(sizes) != n:
        raise ValueError(
            f"per_layer_sizes={per_layer_sizes!r} is not allowed: it must be a non-empty sequence of integers >= 1 "
            f"summing to the number of parameters {n} (got sum {sum(int(s) for s in sizes if checks.is_real(s))}"
            f"{', invalid entries ' + repr(bad) if bad else ''}). Pass [p.numel() for p in model.parameters()] "
            "in the order of torch.nn.utils.parameters_to_vector, or None for one release of the whole vector."
        )
    return [int(s) for s in sizes]


def sanitize_update(
    client: Tensor,
    reference: Tensor,
    *,
    noise_multiplier: float,
    generator: torch.Generator | None,
    per_layer_sizes: Sequence[int] | None = None,
    min_delta_norm: float = 0.0,
) -> SanitizedUpdate:
    """Releases ``client + rho`` with ``rho ~ EuclideanLaplace(n / (nu * ||client - reference||))``.

    The release of Galli et al. (module docstring): with ``delta = client - reference``,
    ``r = max(||delta||, min_delta_norm)`` and ``nu = noise_multiplier``, the noise has
    parameter ``epsilon = n / (nu r)``, expected norm ``nu r``, and the release costs
    ``n / nu`` with respect to the ``r``-ball around ``client`` (for every ``x'`` with
    ``||x' - client|| <= r`` the output densities differ by at most ``exp(n / nu)``).
    Norms are computed in float64.

    **Layer-wise** (``per_layer_sizes = [n_1, ..., n_L]``, consecutive slices of the
    flattened vector): each layer ``l`` is released separately with its own
    ``delta_l``, ``r_l = max(||delta_l||, min_delta_norm)`` and ``epsilon_l = n_l / (nu r_l)``.
    Each layer's release is ``epsilon_l``-d-private with respect to *that layer's*
    parameters and costs ``n_l / nu`` with respect to the ``r_l``-ball of that layer;
    since the layers use independent noise, the whole release satisfies
    ``P[K(x) in S] <= exp(sum_l epsilon_l ||x_l - x'_l||) P[K(x') in S]``, i.e. the total
    cost ``sum_l n_l / nu = n / nu`` holds with respect to the *product* of per-layer
    balls (every layer within its own ``r_l``), a different neighbourhood from the
    ``||delta||``-ball of the whole-vector release: ``cost`` is numerically the same but
    the two guarantees are not comparable. ``layer_costs`` lists the ``n_l / nu``.

    **Zero update.** If ``r == 0`` (the client did not move: ``client == reference``
    and no ``min_delta_norm``), the calibration gives ``epsilon = inf``, i.e. no noise,
    and the guarantee with respect to a zero-radius neighbourhood is vacuous. This
    function refuses that case with a ``ValueError`` instead of releasing the model
    unperturbed (the same holds per layer). Pass ``min_delta_norm > 0`` to always
    protect at least a ball of that radius (the noise then has expected norm
    ``nu * max(||delta||, min_delta_norm)`` and the cost stays ``n / nu`` with respect
    to that larger ball, a guarantee at least as strong as the seed's), or leave the
    client out of the round.

    **No sanitization** (``noise_multiplier == 0``, the non-private baseline):
    ``released`` is a copy of ``client``, ``epsilon = inf`` and ``cost = inf``; the
    generator is not used.

    Args:
        client: The client's updated model ``theta_client`` (a flat vector, e.g. from
            ``torch.nn.utils.parameters_to_vector``; any shape is flattened in order).
        reference: The hypothesis ``theta_j`` the client started from, same shape.
        noise_multiplier: ``nu >= 0``, expected noise norm over update norm.
        generator: Generator of the noise (on ``client``'s device); ``None`` creates a
            private, non-reproducible one.
        per_layer_sizes: ``None`` for one release of the whole vector, or the sizes
            ``n_l`` of consecutive layers (summing to ``n``) for layer-wise releases.
        min_delta_norm: Floor ``>= 0`` on the update norm used for calibration.

    Returns:
        A :class:`SanitizedUpdate`.

    Raises:
        ValueError: On mismatched or non-finite tensors, arguments outside their range,
            or a zero update norm without ``min_delta_norm``.

    Example:
        >>> g = torch.Generator().manual_seed(0)
        >>> out = sanitize_update(torch.ones(100), torch.zeros(100), noise_multiplier=2.0, generator=g)
        >>> out.cost, out.epsilon  # n / nu, n / (nu * ||delta||) = 100 / (2 * 10)
        (50.0, 5.0)
    """
    nu = check_metric_noise_multiplier(noise_multiplier)
    if not isinstance(client, Tensor) or not isinstance(reference, Tensor):
        raise ValueError(f"client and reference must be tensors, got {type(client).__name__} and "
                         f"{type(reference).__name__}; flatten a model with torch.nn.utils.parameters_to_vector.")
    if client.shape != reference.shape or client.device != reference.device:
        raise ValueError(
            f"client (shape {tuple(client.shape)}, {client.device}) and reference (shape {tuple(reference.shape)}, "
            f"{reference.device}) must have the same shape and device: reference is the hypothesis the client "
            "started from, flattened the same way."
        )
    if not client.dtype.is_floating_point or client.numel() == 0:
        raise ValueError(f"client must be a non-empty floating tensor, got dtype {client.dtype} with "
                         f"{client.numel()} elements.")
    if not checks.is_real(min_delta_norm) or not (math.isfinite(min_delta_norm) and min_delta_norm >= 0):
        raise ValueError(f"min_delta_norm={min_delta_norm!r} must be a finite number >= 0, the smallest update "
                         "norm used for calibration; pass 0.0 (the seed's calibration) or e.g. 1e-3.")
    flat_client = client.reshape(-1)
    n = flat_client.numel()
    sizes = None if per_layer_sizes is None else _check_layer_sizes(per_layer_sizes, n)
    delta = flat_client.to(torch.float64) - reference.reshape(-1).to(torch.float64)
    if not bool(torch.isfinite(delta).all()):
        raise ValueError("client and reference must be finite: the update client - reference contains inf or NaN "
                         "(a diverged local training?).")

    if nu == 0.0:
        if sizes is None:
            return SanitizedUpdate(client.clone(), math.inf, math.inf, None)
        return SanitizedUpdate(client.clone(), [math.inf] * len(sizes), math.inf, [math.inf] * len(sizes))

    generator = checks.generator("generator", generator, device=client.device)
    chunks = [delta] if sizes is None else list(torch.split(delta, sizes))
    radii = [max(float(torch.linalg.vector_norm(chunk)), float(min_delta_norm)) for chunk in chunks]
    epsilons = [chunk.numel() / (nu * radius) if radius > 0 else math.inf for chunk, radius in zip(chunks, radii)]
    for index, eps in enumerate(epsilons):
        if not math.isfinite(eps):  # zero update, or one so small (subnormal) that n / (nu * r) overflows
            where = "" if sizes is None else f" in layer {index} (per_layer_sizes[{index}]={sizes[index]})"
            raise ValueError(
                f"The update client - reference{where} has norm {radii[index]!r} (zero, or too small for "
                f"noise_multiplier={nu!r}): the calibration epsilon = n / (nu * ||delta||) is infinite, i.e. the "
                "model would be released without noise, and the d-privacy guarantee with respect to a zero-radius "
                "neighbourhood is vacuous. Pass min_delta_norm > 0 (e.g. 1e-3) to protect at least a ball of that "
                "radius, or leave this client out of the round."
            )
    noise = torch.cat([
        euclidean_laplace(chunk.numel(), eps, generator=generator, dtype=torch.float64, device=client.device)
        for chunk, eps in zip(chunks, epsilons)
    ])
    released = (flat_client.to(torch.float64) + noise).to(client.dtype).reshape(client.shape)
    cost = n / nu
    if sizes is None:
        return SanitizedUpdate(released, epsilons[0], cost, None)
    return SanitizedUpdate(released, epsilons, cost, [size / nu for size in sizes])
