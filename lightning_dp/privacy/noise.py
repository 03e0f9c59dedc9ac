"""The Gaussian mechanism of DP-SGD: noise on the clipped sum, then the normalization.

Every draw comes from an explicit ``torch.Generator``; :func:`derive_generator` derives one per logical query
from (seed, stream, counters), so all DDP ranks draw the *same* noise, added once after the all-reduce. Draws an
accountant relies on come from a :class:`SecretGenerator` (:func:`derive_secret_generator`), which amplified
samplers demand with :func:`require_secret`. Why: docs/privacy.md, "Which randomness is secret, and why".
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Any, Optional

import numpy as np
import torch
from torch import Tensor

from lightning_dp import checks

__all__ = ["check_noise_multiplier", "counter_normal", "counter_uniform", "derive_generator", "derive_secret_generator",
           "gaussian_noise", "noisy_mean",
           "require_secret", "SecretGenerator", "SAMPLING", "NOISE", "CLIP_STATISTIC"]

#: Stream identifiers for :func:`derive_generator`: Poisson sampling, the gradient noise, and the
#: noise of the clipping statistic that adaptive-clipping rules release with the gradient.
SAMPLING, NOISE, CLIP_STATISTIC = 1, 2, 3


_SIGMA = ("sigma, the ratio of the Gaussian noise standard deviation to the clipping norm; sigma = 0 releases the "
          "gradient without privacy")
_SIGMA_FIX = ("Pass a positive value (DP-SGD typically uses 0.5 to 10), or calibrate one: target_epsilon=... in DPSGD, "
              "or lightning_dp.privacy.calibration.calibrate_noise_multiplier.")


def check_noise_multiplier(noise_multiplier: Any, *, name: str = "noise_multiplier", allow_zero: bool = False,
                           meaning: Optional[str] = None, fix: Optional[str] = None) -> float:
    """A noise multiplier as a float: a finite number > 0 (``>= 0`` with ``allow_zero``, where 0 means no noise;
    ``bool`` is not a number), else a ValueError naming ``name``, the value, the range, what the value is and the
    fix. The one check of every noise scale: DP-SGD's and the accountants' sigma (the defaults), a sanitizer's
    multiplier, d-privacy's nu, the noisy-neighbours audit's sigma.

    Args:
        noise_multiplier: the value.
        name: the argument's name in the message.
        allow_zero: accept 0 (no noise: a baseline).
        meaning: what the value is, for the message (default: DP-SGD's sigma).
        fix: what to pass instead, for the message (default: DP-SGD's typical values and calibration).

    Example:
        >>> check_noise_multiplier(0, name="sigma", allow_zero=True, meaning="the noise std", fix="Pass e.g. 0.1.")
        0.0
        >>> check_noise_multiplier(-1, name="sigma", allow_zero=True, meaning="the noise std", fix="Pass e.g. 0.1.")
        Traceback (most recent call last):
        ...
        ValueError: sigma must be a finite number >= 0, got -1 (sigma=-1 is not allowed). It is the noise std. Pass \
e.g. 0.1.
    """
    value = noise_multiplier
    if not checks.is_real(value) or not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        raise ValueError(
            f"{name} must be a finite number {'>= 0' if allow_zero else '> 0'}, got {value!r} ({name}={value!r} is "
            f"not allowed). It is {meaning or _SIGMA}. {fix or _SIGMA_FIX}")
    return float(value)


def _seeded(cls: type[torch.Generator], seed: int, counters: Sequence[int], device: torch.device | str) -> torch.Generator:
    state = np.random.SeedSequence([int(seed) % 2**128, *(int(c) for c in counters)]).generate_state(2, np.uint32)
    g = cls(device=device)
    g.manual_seed(int(state[0]) << 32 | int(state[1]))
    return g


def derive_generator(seed: int, *counters: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator seeded from ``(seed, *counters)`` through NumPy's SeedSequence hashing.

    SeedSequence ignores trailing zero words: ``(seed, s)``, ``(seed, s, 0)`` and ``(seed, s, 0, 0)`` give the same
    generator. So every stream ``s`` is used with one number of counters wherever it is derived from the same seed,
    and each seed has its own streams (DPSGD's secret seed: ``SAMPLING``, ``NOISE``, ``CLIP_STATISTIC``; the
    round's seed and noise seed: ``federated/round.py``; an audit's own seed: ``audit/``), never shared with
    another component's seed (``OneRunAudit`` refuses DPSGD's).

    Counter-based seeding makes every draw a pure function of the run seed and the step,
    so a resumed run draws exactly what the uninterrupted run drew, without saving
    generator states per rank. For draws an accountant relies on, use
    :func:`derive_secret_generator` with the run's secret seed (the module docstring).
    """
    return _seeded(torch.Generator, seed, counters, device)


_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finalizer (Steele, Lea & Flood 2014) on uint64 arrays: a bijection of 64-bit words; NumPy's
    uint64 arithmetic wraps modulo 2^64 as the algorithm needs."""
    x = x + _GOLDEN
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def counter_uniform(seed: int, *counters: int | Tensor, device: torch.device | str | None = None) -> Tensor:
    """Uniform draws in (0, 1) (float64, 52-bit resolution, never 0 or 1), one per element of the broadcast
    ``counters``: a hash of ``(seed, *counters)``, so each draw is a pure function of its own indices.

    For PUBLIC streams only (synthetic data, the local shuffles of non-private updates at populations where one
    generator per client costs more than the round: :func:`derive_generator` takes ~10 us): a draw for client i
    does not depend on which other clients are drawn, in which process or order, without building a generator
    per client or a table over the whole population. Not for anything an accountant relies on
    (:func:`derive_secret_generator`). Written by hand because torch has no counter-based (stateless) random API
    on CPU: the hash chains SplitMix64's bijection over the seed's two 64-bit words and the counters (each an
    integer in [0, 2^64)), computed with NumPy on the CPU and returned on ``device`` (default: the first tensor
    counter's).
    """
    tensors = [c for c in counters if isinstance(c, Tensor)]
    dev = device if device is not None else (tensors[0].device if tensors else "cpu")
    seed = int(seed) % 2**128
    with np.errstate(over="ignore"):
        h = _splitmix64(np.uint64(seed & (2**64 - 1)))
        h = _splitmix64(h ^ np.uint64(seed >> 64))
        for c in counters:
            if isinstance(c, Tensor):
                if c.dtype.is_floating_point or c.dtype == torch.bool:
                    raise TypeError(f"counter_uniform: counters must be integers, got a {c.dtype} tensor")
                if c.numel() and bool((c < 0).any()):
                    raise ValueError("counter_uniform: counters must be >= 0")
                word = c.detach().cpu().numpy().astype(np.uint64)
            else:
                if isinstance(c, bool) or not isinstance(c, numbers.Integral) or not 0 <= int(c) < 2**64:
                    raise ValueError(f"counter_uniform: counter {c!r} is not an integer in [0, 2^64)")
                word = np.uint64(int(c))
            h = _splitmix64(h ^ word)
        # the top 52 bits, centred in their cell: (k + 1/2) / 2^52 is exact in float64 and lies strictly in (0, 1)
        u = ((h >> np.uint64(12)).astype(np.float64) + 0.5) * 2.0**-52
    return torch.as_tensor(np.asarray(u, dtype=np.float64)).to(dev)


def counter_normal(seed: int, *counters: int | Tensor, device: torch.device | str | None = None) -> Tensor:
    """Standard normal draws (float64), one per element of the broadcast ``counters``: the normal quantile of a
    :func:`counter_uniform` draw. Public streams only, as there."""
    return torch.special.ndtri(counter_uniform(seed, *counters, device=device))


class SecretGenerator(torch.Generator):
    """A ``torch.Generator`` derived from a run's secret seed (:func:`derive_secret_generator`).

    The type is the mark: samplers whose rate an accountant amplifies (Poisson batches, client
    selection, local DP-SGD batches) accept only this type (:func:`require_secret`). It draws
    exactly what a plain generator with the same seed state draws.
    """


def derive_secret_generator(secret_seed: int, *counters: int,
                            device: torch.device | str = "cpu") -> SecretGenerator:
    """:func:`derive_generator` from the run's SECRET seed, marked as such (:class:`SecretGenerator`).

    Pass only a seed that never reaches the record (DPSGD's ``seed``, the federated module's
    ``noise_seed``: :mod:`lightning_dp.privacy.seeds`). The draws equal those of
    ``derive_generator(secret_seed, *counters)``.

    Example:
        >>> g = derive_secret_generator(1234, 11, 0)
        >>> isinstance(g, SecretGenerator), torch.equal(torch.rand(3, generator=g),
        ...                                             torch.rand(3, generator=derive_generator(1234, 11, 0)))
        (True, True)
    """
    g = _seeded(SecretGenerator, secret_seed, counters, device)
    assert isinstance(g, SecretGenerator)
    return g


def require_secret(generator: torch.Generator, what: str) -> SecretGenerator:
    """Returns ``generator`` if it is a :class:`SecretGenerator`, else raises.

    Called by every draw that an accountant amplifies (``what`` names it): a generator derived
    from a public seed lets anyone with the record recompute the draw, so no amplification holds.

    Raises:
        TypeError: If ``generator`` is not a :class:`SecretGenerator`.
    """
    if not isinstance(generator, SecretGenerator):
        raise TypeError(
            f"{what} needs a generator derived from the run's SECRET seed, got {type(generator).__name__}: the "
            "accountant claims amplification by this draw, which holds only if nobody who reads the record can "
            "recompute it (a public seed is in the logged params and the uploaded checkpoint). Derive it with "
            "lightning_dp.privacy.noise.derive_secret_generator(secret_seed, stream, ...).")
    return generator


def gaussian_noise(shapes: Sequence[torch.Size], std: float, generator: torch.Generator, *,
                   dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> list[Tensor]:
    """One flat draw of N(0, std^2 I), split into tensors of ``shapes``."""
    sizes = [math.prod(s) for s in shapes]
    flat = torch.randn(sum(sizes), generator=generator, dtype=dtype, device=device).mul_(std)
    return [chunk if chunk.shape == s else chunk.view(s) for chunk, s in zip(torch.split(flat, sizes), shapes)]


def noisy_mean(clipped_sums: Sequence[Tensor], *, noise_multiplier: float, max_grad_norm: float,
               expected_batch_size: float, generator: torch.Generator) -> list[Tensor]:
    """The DP-SGD gradient ``(sum_i clip(g_i) + N(0, (sigma C)^2 I)) / (q N)``.

    Dividing by the *expected* batch size ``q N`` (not the realized one, which depends on
    the data) keeps the normalization data-independent, as the Poisson-subsampled
    Gaussian analysis requires (Abadi et al. 2016; Opacus' ``expected_batch_size``).

    Example:
        >>> g = torch.Generator().manual_seed(0)
        >>> [t.shape for t in noisy_mean([torch.zeros(3)], noise_multiplier=1.0, max_grad_norm=1.0,
        ...                                 expected_batch_size=10, generator=g)]
        [torch.Size([3])]
    """
    if not expected_batch_size > 0:
        raise ValueError(f"expected_batch_size={expected_batch_size!r} must be > 0")
    first = clipped_sums[0]
    noise = gaussian_noise([t.shape for t in clipped_sums], noise_multiplier * max_grad_norm, generator,
                           dtype=first.dtype, device=first.device)
    # two operations over all parameters (per parameter: (s + n) / (q N), the same values)
    out = list(torch._foreach_add(list(clipped_sums), noise))
    torch._foreach_div_(out, float(expected_batch_size))
    return out
