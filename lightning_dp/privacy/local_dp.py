"""Local differential privacy of a client's update, and the geometry of clipped updates.

Under local DP any two datasets of a client are neighbours, so a clipped update's sensitivity is the
**diameter** of the clipping set (``2C`` for the L2 ball; :func:`sector_diameter` for the sector of thesis
ch. 5); a client's Gaussian releases compose exactly into one Gaussian mechanism
(:class:`~lightning_dp.privacy.ledger.GaussianLedger`). The composition, the sector and the derivation of
its diameter: docs/federated.md, "Local DP" and "The sector".
"""

from __future__ import annotations

import functools
import math

import torch
from torch import Tensor

from lightning_dp import checks

__all__ = [
    "check_sector",
    "clip_l1",
    "clip_l2",
    "gaussian_epsilon",
    "laplace_noise",
    "project_to_sector",
    "sector_diameter",
]

#: relative margin by which projections land strictly inside their set despite float rounding
MARGIN = 1e-6


def check_sector(upper: float, lower: float = 0.0, angle: float = math.pi) -> tuple[float, float, float]:
    """Validates ``(C, c, a)``: ``C > 0``, ``0 <= c < C``, ``0 <= a <= pi``."""
    upper = checks.positive_real("clip", upper, hint="C, the upper norm")
    lower = checks.non_negative_real("lower_clip", lower, hint="c, the lower norm")
    if not lower < upper:
        raise ValueError(f"lower_clip={lower!r} must be below clip={upper!r}: updates are scaled up to norm c and "
                         "down to norm C")
    angle = checks.non_negative_real("angle", angle, hint="a, in radians")
    if angle > math.pi:
        raise ValueError(f"angle={angle!r} is not allowed: pass an angle in [0, pi] radians (pi: no angular "
                         "clipping)")
    return upper, lower, angle


def sector_diameter(upper: float, lower: float = 0.0, angle: float = math.pi) -> float:
    """The diameter of ``{v : lower <= ||v|| <= upper, angle(v, r) <= angle}`` (module docstring).

    Example:
        >>> sector_diameter(1.0), sector_diameter(1.0, 0.5, 0.0), round(sector_diameter(1.0, 0.0, math.pi / 6), 6)
        (2.0, 0.5, 1.0)
    """
    upper, lower, angle = check_sector(upper, lower, angle)
    t = min(2 * angle, math.pi)
    outer = 2 * upper**2 * (1 - math.cos(t))
    mixed = upper**2 + lower**2 - 2 * upper * lower * math.cos(t)
    return math.sqrt(max(outer, mixed, 0.0))


def clip_l2(delta: Tensor, clip: float, *, norms: Tensor | None = None) -> Tensor:
    """``delta`` (P,), or each row of ``delta`` (m, P), scaled to L2 norm at most ``clip`` (strictly: the factor of
    :func:`~lightning_dp.privacy.clipping.clip_factors`); ``norms``: the rows' float64 norms, if already known."""
    from lightning_dp.privacy.clipping import clip_factors

    if delta.ndim == 1:
        norm = delta.double().norm()[None] if norms is None else norms.reshape(1)
        return delta * clip_factors(norm, clip).to(delta.dtype)
    if norms is None:
        norms = delta.double().norm(dim=1)
    return delta * clip_factors(norms, clip).to(delta.dtype)[:, None]


def clip_l1(delta: Tensor, clip: float) -> Tensor:
    """``delta`` scaled to L1 norm at most ``clip`` (strictly)."""
    norm = float(delta.double().abs().sum())
    return delta * min(1.0, clip * (1 - MARGIN) / norm) if norm > 0 else delta


def project_to_sector(delta: Tensor, reference: Tensor | None, upper: float, lower: float = 0.0,
                      angle: float = math.pi) -> Tensor:
    """Maps ``delta`` into the sector ``S(C, c, a)`` around ``reference`` (strictly inside, by :data:`MARGIN`).

    1. Angle: if ``delta`` is more than ``a`` from ``reference``, it is rotated towards it in
       their common plane to angle ``a``, keeping its norm (exactly opposite: the plane of
       ``reference`` and the first coordinate axis not parallel to it, a public choice).
       Without a reference (the first round: no released aggregate yet) no angular clipping.
    2. Norm: scaled down to ``C`` if longer, up to ``c`` if shorter (a zero update becomes
       ``c * reference / ||reference||``, or ``c`` along the first axis without a reference).

    Args:
        delta: a flat update.
        reference: the public reference direction (any norm > 0), e.g. the previous round's
            released change of the global model, or None.
        upper, lower, angle: C, c, a.
    """
    upper, lower, angle = check_sector(upper, lower, angle)
    v = delta.double()
    r = None
    if reference is not None:
        r_norm = reference.double().norm()
        r = reference.double() / r_norm if r_norm > 0 else None
    norm = v.norm()
    if r is not None and angle < math.pi and norm > 0:
        cos = float((v @ r) / norm)
        target = angle * (1 - MARGIN)
        if cos < math.cos(target):
            ortho = v - (v @ r) * r
            o_norm = ortho.norm()
            if o_norm <= 1e-12 * norm:  # exactly opposite: rotate in a fixed, public plane
                axis = torch.zeros_like(r)
                axis[int(r.abs().argmin())] = 1.0
                ortho = axis - (axis @ r) * r
                o_norm = ortho.norm()
            v = norm * (math.cos(target) * r + math.sin(target) * ortho / o_norm)
    norm = v.norm()
    lo, hi = lower * (1 + MARGIN), upper * (1 - MARGIN)
    if norm == 0:
        if lower > 0:
            if r is not None:
                direction = r
            else:  # the first axis (written in place: an index tensor would have to be on v's device)
                direction = torch.zeros_like(v)
                direction[0] = 1.0
            v = direction * min(lo, hi)
    elif norm > hi:
        v = v * (hi / norm)
    elif norm < lo:
        v = v * (min(lo, hi) / norm)
    return v.to(delta.dtype)


def laplace_noise(numel: int, scale: float, generator: torch.Generator, *, dtype: torch.dtype = torch.float32,
                  device: torch.device | str = "cpu") -> Tensor:
    """``numel`` i.i.d. Laplace(0, scale) draws from ``generator`` (the difference of two Exp(1) draws, times scale)."""
    e = torch.empty(2, numel, dtype=torch.float64, device=device).exponential_(generator=generator)
    return ((e[0] - e[1]) * scale).to(dtype)


#: Below this multiplier (epsilon above about 10 at delta 1e-5) a single Gaussian's epsilon is the analytic one:
#: dp-accounting's PLD of one unsampled Gaussian needs memory and time growing like 1 / multiplier^2 (0.86 GB and
#: 3 s at 0.1, 1.5 GB at 0.05, an allocation of 301 GB at 5e-4, measured), the analytic value is exact.
ANALYTIC_BELOW = 0.5
#: Added to the analytic epsilon (relative and absolute): the root finder's tolerance (1e-12) and float rounding at
#: epsilon ~ 1e7 (1.8e-9 below the exact value at multiplier 1e-4, checked with 80-digit arithmetic), so that it never
#: under-reports.
_ANALYTIC_MARGIN = 1e-9


def gaussian_epsilon(multiplier: float, delta: float, accountant: str = "pld") -> float:
    """Epsilon at ``delta`` of one Gaussian mechanism with ``multiplier`` = noise std / L2 sensitivity.

    Through the project's accountants (dp-accounting): the unsampled Gaussian event at rate 1; with ``"pld"`` and a
    multiplier below :data:`ANALYTIC_BELOW`, dp-accounting's analytic Gaussian (Balle & Wang, ICML 2018, exact) plus
    a margin. Cached: a pure function of public numbers, asked once per client release.
    """
    from lightning_dp.privacy.accounting import check_delta

    return _gaussian_epsilon(float(multiplier), check_delta(delta), str(accountant).lower())


@functools.lru_cache(maxsize=1024)
def _gaussian_epsilon(multiplier: float, delta: float, accountant: str) -> float:
    from lightning_dp.privacy.accounting import get_accountant

    if math.isinf(multiplier):
        return 0.0
    if accountant == "pld" and 0 < multiplier < ANALYTIC_BELOW:
        from dp_accounting.gaussian_mechanism import get_epsilon_gaussian

        eps = float(get_epsilon_gaussian(multiplier, delta))
        return eps * (1 + _ANALYTIC_MARGIN) + _ANALYTIC_MARGIN
    return get_accountant(accountant).epsilon_after(delta, noise_multiplier=multiplier, sample_rate=1.0)
