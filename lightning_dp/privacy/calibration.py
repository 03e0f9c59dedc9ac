"""Noise calibration: the smallest DP-SGD noise multiplier that meets a privacy budget.

:func:`calibrate_noise_multiplier` brackets and bisects with the **same accountant class and configuration
that the training callback uses**, and returns a sigma whose spend was evaluated to be ``<= target_epsilon``;
results are cached for the process. The search and its verification: docs/privacy.md, "Calibration"; its
cost: docs/benchmarks.md, "Calibration".

Example:
    >>> steps = steps_for_epochs(epochs=2, sample_rate=0.01)
    >>> sigma = calibrate_noise_multiplier(
    ...     target_epsilon=3.0, target_delta=1e-5, sample_rate=0.01, steps=steps, accountant="rdp")
    >>> steps, 0.5 < sigma < 1.5
    (200, True)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from lightning_dp import checks
from lightning_dp.privacy.accounting import (
    check_delta,
    _check_num_steps,
    _check_target_epsilon,
    get_accountant,
)
from lightning_dp.privacy.sampling import check_sample_rate

__all__ = [
    "gdp_guess",
    "MAX_NOISE_MULTIPLIER",
    "MIN_NOISE_MULTIPLIER",
    "calibrate_composed_noise_multiplier",
    "calibrate_noise_multiplier",
    "calibrate_spend",
    "steps_for_epochs",
]

MIN_NOISE_MULTIPLIER = 0.1
"""Lower end of the search. Below it DP-SGD gives essentially no protection (epsilon in the
tens to thousands) and privacy loss distributions become very large (gigabytes at sigma = 0.05)."""

MAX_NOISE_MULTIPLIER = 1e4
"""Upper end of the search; a target that needs more noise is reported as unreachable."""

_FIRST_GUESS = 1.0
_FIRST_RATIO = 1.25  # first step of the bracket walk; the ratio is squared after each step


class _OutOfRangeError(ValueError):
    """The target is not bracketed inside the search range; ``boundary`` is the end it ran into."""

    def __init__(self, message: str, boundary: float) -> None:
        super().__init__(message)
        self.boundary = boundary


def _bracket_and_bisect(
    spend: Callable[[float], float],
    target_epsilon: float,
    guess: float,
    tolerance: float,
    describe: str,
    first_ratio: float = _FIRST_RATIO,
) -> float:
    """The upper end of a bracket ``[lo, hi]`` with ``spend(hi) <= target < spend(lo)``, ``hi/lo <= 1+tol``."""
    return _bracket(spend, target_epsilon, guess, tolerance, describe, first_ratio)[2]


def _bracket(
    spend: Callable[[float], float],
    target_epsilon: float,
    guess: float,
    tolerance: float,
    describe: str,
    first_ratio: float = _FIRST_RATIO,
) -> tuple[float, float, float, float]:
    """``(lo, spend(lo), hi, spend(hi))`` with ``spend(hi) <= target < spend(lo)`` and ``hi/lo <= 1+tol``.

    A geometric walk from ``guess`` (step ratio ``first_ratio``, squared after every
    step) finds the bracket; it is then narrowed by false position on ``(log sigma, log spend)``
    (the spend of DP-SGD is close to a power of sigma, so the interpolated root is within a
    fraction of a percent after one or two evaluations), aimed just above the root so that the
    next evaluation, ``hi / (1 + tol)``, closes the bracket from below; a step that fails to
    shrink the bracket enough falls back to bisection on ``log(sigma)``. ``spend`` must be
    non-increasing in sigma.
    """
    guess = min(max(guess, MIN_NOISE_MULTIPLIER), MAX_NOISE_MULTIPLIER)
    ratio = first_ratio
    value = spend(guess)
    if value <= target_epsilon:
        hi, f_hi = guess, value
        while True:  # walk down until the spend exceeds the target
            if hi <= MIN_NOISE_MULTIPLIER:
                raise _OutOfRangeError(
                    f"The target is too loose to calibrate: {describe} spends at most target_epsilon even with "
                    f"noise_multiplier={MIN_NOISE_MULTIPLIER}, the smallest noise multiplier searched (below it "
                    "DP-SGD offers essentially no protection). Lower target_epsilon, or set the noise multiplier "
                    "directly instead of calibrating.",
                    MIN_NOISE_MULTIPLIER,
                )
            lo = max(hi / ratio, MIN_NOISE_MULTIPLIER)
            f_lo = spend(lo)
            if f_lo > target_epsilon:
                break
            hi, f_hi, ratio = lo, f_lo, ratio * ratio
    else:
        lo, f_lo = guess, value
        while True:  # walk up until the spend fits into the target
            if lo >= MAX_NOISE_MULTIPLIER:
                raise _OutOfRangeError(
                    f"The target is unreachable: {describe} spends more than target_epsilon even with "
                    f"noise_multiplier={MAX_NOISE_MULTIPLIER:g} (spend {spend(MAX_NOISE_MULTIPLIER):.4g}), the "
                    "largest noise multiplier searched. Increase target_epsilon or target_delta, train for fewer "
                    "steps or with a smaller sample_rate (for PLD, a smaller value_discretization_interval also "
                    "lowers the smallest reportable epsilon).",
                    MAX_NOISE_MULTIPLIER,
                )
            hi = min(lo * ratio, MAX_NOISE_MULTIPLIER)
            f_hi = spend(hi)
            if f_hi <= target_epsilon:
                break
            lo, f_lo, ratio = hi, f_hi, ratio * ratio
    step = 1.0 + tolerance
    while hi / lo > step:
        if hi / lo <= step * step:
            middle = hi / step  # closes the bracket whichever side it falls on
        else:
            middle = math.sqrt(lo * hi)
            if 0 < f_hi <= target_epsilon < f_lo < math.inf:  # false position in log-log, aimed just above the root
                t = (math.log(f_lo) - math.log(target_epsilon)) / (math.log(f_lo) - math.log(f_hi))
                root = lo * (hi / lo) ** t
                middle = min(max(root * math.sqrt(step), lo * step), hi / step)
        value = spend(middle)
        if value <= target_epsilon:
            hi, f_hi = middle, value
        else:
            lo, f_lo = middle, value
    return lo, f_lo, hi, f_hi


def calibrate_noise_multiplier(
    *,
    target_epsilon: float,
    target_delta: float,
    sample_rate: float,
    steps: int,
    accountant: str = "pld",
    accountant_kwargs: dict[str, Any] | None = None,
    tolerance: float = 0.01,
) -> float:
    """The smallest noise multiplier whose DP-SGD spend stays within ``target_epsilon``.

    Searches sigma in ``[MIN_NOISE_MULTIPLIER, MAX_NOISE_MULTIPLIER]`` for ``steps``
    steps of the Poisson-subsampled Gaussian mechanism with rate ``sample_rate``
    (add/remove adjacency). Epsilon decreases with sigma, so the bracket found by a
    geometric walk is bisected on ``log(sigma)`` until its ends differ by at most the
    factor ``1 + tolerance``. The walk starts from a closed-form Gaussian-DP guess
    (:func:`gdp_guess`), then (PLD finer than ``1e-3``) from a calibration at a
    coarser discretization; these cheap stages only choose the starting point, every
    accepted value is evaluated with the requested accountant and configuration. Results are
    cached for the process (the same arguments give the same sigma at once). The
    returned value is finally re-checked with
    ``get_accountant(accountant, **accountant_kwargs).epsilon_after(...)``.

    Args:
        target_epsilon: The privacy budget epsilon (> 0).
        target_delta: The delta of the budget, in (0, 1).
        sample_rate: Poisson sampling rate q in (0, 1] (``expected_batch_size / dataset_size``).
        steps: Number of DP-SGD steps (>= 1), e.g. :func:`steps_for_epochs`.
        accountant: Registry name of the accountant the training will use (``"pld"`` or ``"rdp"``).
        accountant_kwargs: Constructor arguments of that accountant (e.g.
            ``{"value_discretization_interval": 1e-4}``); use the ones of the training run.
        tolerance: Relative precision in (0, 1): the result is at most ``1 + tolerance``
            times the smallest sigma that fits.

    Returns:
        sigma with ``spend(sigma) <= target_epsilon`` under that accountant, and
        ``spend(sigma / (1 + tolerance)) > target_epsilon``.

    Raises:
        ValueError: For invalid arguments, an unknown accountant, or a target outside
            what the search range can reach.

    Example:
        >>> sigma = calibrate_noise_multiplier(
        ...     target_epsilon=1.0, target_delta=1e-5, sample_rate=0.01, steps=100, accountant="rdp")
        >>> from lightning_dp.privacy.accounting import get_accountant
        >>> spend = get_accountant("rdp").epsilon_after(1e-5, noise_multiplier=sigma, sample_rate=0.01, num_steps=100)
        >>> spend <= 1.0
        True
    """
    target_epsilon, target_delta, tolerance, kwargs = _check_search(target_epsilon, target_delta, tolerance,
                                                                    accountant_kwargs)
    sample_rate = check_sample_rate(sample_rate)
    steps = _check_num_steps(steps, name="steps")
    describe = f"{steps} steps at sample_rate={sample_rate:g}, target_delta={target_delta:g}"
    return _calibrate([(sample_rate, steps, 1.0)], target_epsilon, target_delta, accountant, kwargs, tolerance,
                      describe)


def calibrate_spend(spend: Callable[[float], float], *, target_epsilon: float, describe: str,
                    tolerance: float = 0.01, guess: float = _FIRST_GUESS, first_ratio: float = _FIRST_RATIO) -> float:
    """The smallest noise multiplier z (to ``1 + tolerance``) with ``spend(z) <= target_epsilon``.

    For spends that are not one accountant's history, e.g. the smaller of two valid bounds
    (:class:`~lightning_dp.federated.parts.CentralGaussian` under replacement with sector-bounded
    updates). ``spend`` must be non-increasing in z and evaluate what will be accounted; the
    returned z was evaluated to fit, ``z / (1 + tolerance)`` to exceed. ``guess`` and ``first_ratio``
    start the bracket walk (a good guess and a small ratio save evaluations).

    Example:
        >>> from lightning_dp.privacy.accounting import get_accountant
        >>> def spend(z):
        ...     return get_accountant("rdp").epsilon_after(1e-5, noise_multiplier=z, sample_rate=0.01, num_steps=100)
        >>> z = calibrate_spend(spend, target_epsilon=1.0, describe="100 steps")
        >>> spend(z) <= 1.0 < spend(z / 1.01)
        True
    """
    target_epsilon = _check_target_epsilon(target_epsilon)
    if not checks.is_real(tolerance) or not 0 < tolerance < 1:
        raise ValueError(f"tolerance must be a number in (0, 1), got {tolerance!r}")
    z = _bracket_and_bisect(spend, target_epsilon, guess, float(tolerance), describe, first_ratio=first_ratio)
    if spend(z) > target_epsilon:  # _bracket_and_bisect returns an evaluated fit; a guard, never expected
        raise RuntimeError(f"calibration could not verify a noise multiplier for {describe}; please report this")
    return z


def _check_search(target_epsilon: Any, target_delta: Any, tolerance: Any,
                  accountant_kwargs: Any) -> tuple[float, float, float, dict[str, Any]]:
    """The checks every calibration shares: a finite budget, a delta, the precision and the accountant's options."""
    target_epsilon = _check_target_epsilon(target_epsilon)
    if math.isinf(target_epsilon):
        raise ValueError("target_epsilon must be finite, got inf: an infinite budget needs no noise to calibrate.")
    target_delta = check_delta(target_delta, name="target_delta")
    if not checks.is_real(tolerance) or not 0 < tolerance < 1:
        raise ValueError(
            f"tolerance must be a number in (0, 1), got {tolerance!r}. It is the relative precision of the "
            "calibrated noise multiplier; 0.01 (1%) is the default."
        )
    if accountant_kwargs is not None and not isinstance(accountant_kwargs, dict):
        raise ValueError(f"accountant_kwargs must be a dict or None, got {accountant_kwargs!r}.")
    return target_epsilon, target_delta, float(tolerance), dict(accountant_kwargs or {})


def _spend(name: str, config: dict[str, Any], runs: Sequence[tuple[float, int, float]], delta: float,
           sigma: float) -> float:
    """Epsilon of the composition of ``runs`` (rate, steps, multiplier scale) at noise multiplier ``sigma``."""
    probe = get_accountant(name, **config)
    *first, (q, steps, scale) = runs
    for q_k, steps_k, scale_k in first:
        probe.step(noise_multiplier=sigma * scale_k, sample_rate=q_k, num_steps=steps_k)
    return probe.epsilon_after(delta, noise_multiplier=sigma * scale, sample_rate=q, num_steps=steps)


def gdp_guess(runs: Sequence[tuple[float, int, float]], target_epsilon: float, target_delta: float) -> float:
    """A closed-form first guess of the noise multiplier: the central limit theorem of Gaussian DP.

    Bu, Dong, Long and Su (2020), Theorem 5: ``T`` Poisson-subsampled Gaussian steps at rate ``q``
    and multiplier ``sigma`` are approximately ``mu``-GDP with ``mu = q sqrt(T (exp(sigma^-2) - 1))``;
    runs compose as ``mu^2 = sum mu_k^2``; ``mu``-GDP gives ``delta(eps) = Phi(-eps/mu + mu/2) -
    exp(eps) Phi(-eps/mu - mu/2)`` (Dong, Roth, Su 2022, Corollary 2.13). The ``mu`` that meets
    ``(target_epsilon, target_delta)`` and then ``sigma`` are found by bisection on these closed forms
    (microseconds). An approximation (off by tens of percent for few steps or large q): it only starts
    the search, whose every accepted value is evaluated with the real accountant.

    Example:
        >>> 1.5 < gdp_guess([(0.05, 600, 1.0)], 3.0, 1e-5) < 2.3  # the PLD accountant calibrates 1.93
        True
    """
    from statistics import NormalDist

    if target_epsilon > 50:  # beyond any useful guarantee: the walk starts at the smallest sigma searched
        return MIN_NOISE_MULTIPLIER
    phi = NormalDist().cdf

    def delta_of(mu: float) -> float:
        return phi(-target_epsilon / mu + mu / 2) - math.exp(target_epsilon) * phi(-target_epsilon / mu - mu / 2)

    lo, hi = 1e-6, 1e3  # delta_of increases with mu
    for _ in range(100):
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if delta_of(mid) <= target_delta else (lo, mid)
    mu = lo

    def mu_of(sigma: float) -> float:
        return math.sqrt(sum(q * q * steps * math.expm1(min(1.0 / (scale * sigma) ** 2, 700.0))
                             for q, steps, scale in runs))

    lo, hi = MIN_NOISE_MULTIPLIER, MAX_NOISE_MULTIPLIER  # mu_of decreases with sigma
    for _ in range(100):
        mid = math.sqrt(lo * hi)
        lo, hi = (lo, mid) if mu_of(mid) <= mu else (mid, hi)
    return hi


#: Results of calibrations already run in this process: a calibration is a pure function of its arguments
_CALIBRATION_CACHE: dict[tuple[Any, ...], float] = {}


def _calibrate(runs: Sequence[tuple[float, int, float]], target_epsilon: float, target_delta: float,
               accountant: str, kwargs: dict[str, Any], tolerance: float, describe: str) -> float:
    fresh = get_accountant(accountant, **kwargs)  # validates the name and the configuration
    key = (tuple(runs), target_epsilon, target_delta, fresh.name, fresh._config_key(), tolerance)  # noqa: SLF001
    if key in _CALIBRATION_CACHE:
        return _CALIBRATION_CACHE[key]
    sigma = _search(runs, target_epsilon, target_delta, accountant, kwargs, tolerance, describe, fresh)
    if len(_CALIBRATION_CACHE) > 256:
        _CALIBRATION_CACHE.clear()
    _CALIBRATION_CACHE[key] = sigma
    return sigma


def _search(runs: Sequence[tuple[float, int, float]], target_epsilon: float, target_delta: float,
            accountant: str, kwargs: dict[str, Any], tolerance: float, describe: str, fresh: Any) -> float:
    describe = f"{describe} under {fresh.name!r}"

    def spend_with(name: str, config: dict[str, Any]) -> Callable[[float], float]:
        return lambda sigma: _spend(name, config, runs, target_delta, sigma)

    # The search starts at the closed-form Gaussian-DP guess (within tens of percent), so the first
    # walk steps are small. A PLD finer than 1e-3 is first calibrated at 1e-3 (ten times cheaper per
    # evaluation, a few evaluations with false position); the requested accountant then decides:
    # every returned sigma was evaluated to fit with it, and once more by _verified.
    guess, ratio = gdp_guess(runs, target_epsilon, target_delta), 1.1
    coarse = fresh._coarse_kwargs()  # noqa: SLF001
    if coarse is not None:
        try:
            lo, f_lo, hi, f_hi = _bracket(spend_with(fresh.name, coarse), target_epsilon, guess, tolerance, describe,
                                          first_ratio=ratio)
        except _OutOfRangeError as error:
            guess = error.boundary  # only the requested accountant decides reachability
        else:
            fine = spend_with(fresh.name, kwargs)(hi)
            # hi fits at the requested discretization; hi / (1 + tol) was evaluated to exceed the target at the
            # coarse one. Where the two agree at hi to within half that excess, it exceeds at the fine one too, and
            # hi is the answer after ONE fine evaluation (the two differ by about 1e-3 x the discretization ratio
            # in epsilon; the coarse excess is about tol x the slope, far larger). Otherwise the fine search goes on.
            if fine <= target_epsilon and 2 * abs(f_hi - fine) < f_lo - target_epsilon:
                sigma = hi
                return _verified(sigma, accountant, kwargs, runs, target_delta, target_epsilon, tolerance, describe)
            guess, ratio = hi, 1.0 + tolerance
    sigma = _bracket_and_bisect(
        spend_with(fresh.name, kwargs), target_epsilon, guess, tolerance, describe, first_ratio=ratio
    )
    return _verified(sigma, accountant, kwargs, runs, target_delta, target_epsilon, tolerance, describe)


def _verified(sigma: float, accountant: str, kwargs: dict[str, Any], runs: Sequence[tuple[float, int, float]],
              target_delta: float, target_epsilon: float, tolerance: float, describe: str) -> float:
    # Independent final check with a fresh accountant of the requested kind.
    for _ in range(100):
        if _spend(accountant, kwargs, runs, target_delta, sigma) <= target_epsilon:
            return sigma
        sigma *= 1.0 + tolerance
    raise RuntimeError(f"Calibration could not verify a noise multiplier for {describe}; please report this.")


def calibrate_composed_noise_multiplier(
    *,
    target_epsilon: float,
    target_delta: float,
    runs: Sequence[tuple[float, int] | tuple[float, int, float]],
    accountant: str = "pld",
    accountant_kwargs: dict[str, Any] | None = None,
    tolerance: float = 0.01,
) -> float:
    """The smallest noise multiplier with which ALL ``runs`` together stay within one budget.

    The privacy-accounted grid search (Galli et al. 2024, thesis ch. 3; Mohapatra et al.
    2022): a grid of K configurations trained on the same data releases K models (the
    chosen one depends on all of them), so the budget ``(target_epsilon, target_delta)`` is
    spent by the *composition* of the K runs. Run ``k`` is ``steps_k`` Poisson-subsampled
    Gaussian mechanisms with rate ``q_k`` and multiplier ``scale_k * sigma``; one sigma is
    searched so that the accountant's composition of every run's events meets the budget.

    Composing with the accountant, rather than giving every run ``target_epsilon / K``
    (basic composition), uses the budget fully: for K identical runs the result is the
    sigma of ONE run of ``K * steps`` steps, far smaller than the sigma of ``epsilon / K``.

    Args:
        target_epsilon: The budget of the whole grid (> 0, finite).
        target_delta: Its delta, in (0, 1).
        runs: One ``(sample_rate, steps)`` or ``(sample_rate, steps, multiplier_scale)`` per run
            (:meth:`lightning_dp.callbacks.DPSGD.plan` gives them; scale 0.5 is a shuffled,
            replacement-adjacency epoch).
        accountant: ``"pld"`` or ``"rdp"``, as the runs' callbacks.
        accountant_kwargs: Their accountant configuration.
        tolerance: Relative precision of the result in (0, 1).

    Returns:
        sigma whose composed spend is ``<= target_epsilon``; ``sigma / (1 + tolerance)`` exceeds it.

    Example:
        >>> one = calibrate_noise_multiplier(target_epsilon=1.0, target_delta=1e-5, sample_rate=0.01, steps=400,
        ...                                  accountant="rdp")
        >>> four = calibrate_composed_noise_multiplier(target_epsilon=1.0, target_delta=1e-5,
        ...                                            runs=[(0.01, 100)] * 4, accountant="rdp")
        >>> abs(four / one - 1) < 0.02
        True
    """
    target_epsilon, target_delta, tolerance, kwargs = _check_search(target_epsilon, target_delta, tolerance,
                                                                    accountant_kwargs)
    if isinstance(runs, (str, bytes)) or not runs:
        raise ValueError(f"runs={runs!r} is not allowed: pass one (sample_rate, steps[, multiplier_scale]) tuple per "
                         "run of the grid, e.g. [(0.01, 1000)] * 9 for nine runs of 1000 steps at q = 0.01.")
    checked = []
    for run in runs:
        if not isinstance(run, (tuple, list)) or len(run) not in (2, 3):
            raise ValueError(f"runs: {run!r} is not a (sample_rate, steps[, multiplier_scale]) tuple")
        q, steps, *rest = run
        scale = rest[0] if rest else 1.0
        if not checks.is_real(scale) or not 0 < scale <= 1:
            raise ValueError(f"runs: multiplier_scale={scale!r} in {run!r} must be in (0, 1]")
        checked.append((check_sample_rate(q), _check_num_steps(steps, name="steps"), float(scale)))
    describe = (f"a grid of {len(checked)} runs ({sum(s for _, s, _ in checked)} steps in all), "
                f"target_delta={target_delta:g}")
    return _calibrate(checked, target_epsilon, target_delta, accountant, kwargs, tolerance, describe)


def steps_for_epochs(*, epochs: int, sample_rate: float, rounding: str = "ceil") -> int:
    """Number of Poisson-sampled steps in ``epochs`` epochs: ``epochs * ceil(1 / sample_rate)``.

    With Poisson sampling an "epoch" is ``ceil(1 / q)`` steps (the expected number of
    batches that cover the dataset once; DPSGD's ``ceil(N / B)``). ``1 / q`` within 1e-9 (relative) of an
    integer counts as that integer, so ``q = 256 / 60000`` gives 235 steps per epoch and
    ``q = 0.01`` exactly 100, not 101 through floating-point error. Opacus counts ``int(1 / q)``
    (``rounding="floor"``: 234 for ``q = 256 / 60000``), so its epsilon for the same epochs is slightly lower.

    Args:
        epochs: Number of epochs (>= 1).
        sample_rate: Poisson sampling rate q in (0, 1].
        rounding: ``"ceil"`` (the training's count) or ``"floor"`` (Opacus' ``int(1 / q)``).

    Returns:
        The number of steps.

    Example:
        >>> steps_for_epochs(epochs=3, sample_rate=256 / 60000)
        705
        >>> steps_for_epochs(epochs=3, sample_rate=256 / 60000, rounding="floor")
        702
    """
    epochs = _check_num_steps(epochs, name="epochs")
    sample_rate = check_sample_rate(sample_rate)
    if rounding not in ("ceil", "floor"):
        raise ValueError(f"rounding={rounding!r} must be 'ceil' (the training's steps per epoch) or 'floor' "
                         "(Opacus' int(1 / q))")
    inverse = 1.0 / sample_rate
    nearest = round(inverse)
    per_epoch = (nearest if abs(inverse - nearest) <= 1e-9 * inverse else
                 math.ceil(inverse) if rounding == "ceil" else max(1, math.floor(inverse)))
    return epochs * int(per_epoch)
