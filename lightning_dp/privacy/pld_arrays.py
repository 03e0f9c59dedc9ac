"""dp-accounting's privacy loss distributions (PLDs), built, composed and read with their loops on arrays.

Written by hand because the library has no array form of these steps and they are a private fit's largest fixed
cost (docs/benchmarks.md, "The accountant's distributions on arrays"): dp-accounting builds the PLD of a
(Poisson-sampled) Gaussian by "connect the dots", the hockey-stick divergence at every grid point between the
truncation bounds (about 77,000 points per direction at the default discretization 1e-4), and

- for the Gaussian inverts the privacy loss one point at a time in a Python loop (``inverse_privacy_loss`` per
  epsilon: 0.2-0.8 s a single step): :func:`gaussian_pld`, :func:`truncated_gaussian_pld`;
- for a user's records (the mixture of Gaussians) bisects recursively (a million calls, 7-9 s at 1e-4):
  :func:`mixture_gaussian_pld`;
- finds epsilon by a Python loop over the distribution: :func:`epsilon_for_delta`;
- composes with Chernoff bounds computed by 40 ``scipy.special.logsumexp`` calls whose dispatch outweighs their
  arithmetic at 1e-3: :func:`self_compose`.

Each function performs the library's operations in the library's order on numpy arrays (the C library's
``math.exp``/``math.log1p`` element by element where the library calls them: numpy's differ in the last bit on a few
percent of inputs), so every field of every distribution, and every epsilon, is bit for bit the library's
(tests/privacy/test_pld_arrays.py compares them). They run only with the dp-accounting release they were read from
(:data:`VERIFIED_DP_ACCOUNTING`); any other release takes the library's own functions. A strided sample of every
inverted array is also computed by the library's own scalar inverse or recursion, whose answer stands on any
difference.
"""

from __future__ import annotations

import functools
import math
import numbers
from importlib import metadata
from typing import Any

import numpy as np
from dp_accounting.pld import pld_pmf, privacy_loss_distribution, privacy_loss_mechanism
from dp_accounting.privacy_accountant import NeighboringRelation
from scipy import fft, stats

__all__ = ["VERIFIED_DP_ACCOUNTING", "VERIFIED_SCIPY", "array_path_available", "epsilon_for_delta", "gaussian_pld",
           "mixture_gaussian_pld", "self_compose", "truncated_gaussian_pld"]

VERIFIED_DP_ACCOUNTING = frozenset({"0.6.0"})
"""dp-accounting releases whose ``get_delta_for_epsilon`` and inverse privacy losses the array form reproduces
(read from their source; a new release takes the library's own path until it is read and added here)."""

VERIFIED_SCIPY = frozenset({"1.17.1"})
"""scipy releases whose ``special.logsumexp`` :func:`_logsumexp` reproduces (:func:`self_compose` uses it only with
these; any other release composes with the library's own ``self_compose``)."""

_SPOT_CHECKS = 64  # library scalar inverses compared per array: about 0.3 ms against 20-100 ms of the build

_Adjacency = privacy_loss_mechanism.AdjacencyType


def _spot_picks(n: int) -> np.ndarray:
    """Indices of a strided sample of ``n`` elements (at most :data:`_SPOT_CHECKS`, the first and last included)."""
    return np.unique(np.linspace(0, n - 1, min(_SPOT_CHECKS, n)).astype(np.int64))


@functools.cache
def _logsumexp_verified() -> bool:
    try:
        return metadata.version("scipy") in VERIFIED_SCIPY
    except metadata.PackageNotFoundError:
        return False


@functools.cache
def array_path_available() -> bool:
    """Whether the installed dp-accounting is a verified release that has the internals the array path calls."""
    try:
        version = metadata.version("dp-accounting")
    except metadata.PackageNotFoundError:
        return False
    return (version in VERIFIED_DP_ACCOUNTING
            and hasattr(privacy_loss_distribution, "_create_pld_pmf_from_monotone_privacy_loss"))


class _ArrayGaussianPrivacyLoss(privacy_loss_mechanism.GaussianPrivacyLoss):
    """The library's ``GaussianPrivacyLoss`` whose ``get_delta_for_epsilon`` inverts the privacy loss on arrays.

    Add, remove and replace adjacency (any sampling probability); scalar queries take the library's code. A strided
    sample of the inverses is compared with the library's scalar ``inverse_privacy_loss`` (bitwise; the same NaN
    positions); on a difference this object answers with the library's loop from then on.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.array_path_used = False  # set when an array query was answered by the array form (tests read it)
        self._array_path_refused = False

    def get_delta_for_epsilon(self, epsilon: Any) -> Any:
        if (isinstance(epsilon, numbers.Number) or self._array_path_refused
                or self.adjacency_type not in (_Adjacency.ADD, _Adjacency.REMOVE, _Adjacency.REPLACE)):
            return super().get_delta_for_epsilon(epsilon)
        # AdditiveNoisePrivacyLoss.get_delta_for_epsilon (0.6.0) line by line, the inverse on the array
        epsilons = np.asarray(epsilon)
        deltas = np.zeros_like(epsilons, dtype=float)
        q = self.sampling_prob
        if q == 1.0 or self.adjacency_type == _Adjacency.REPLACE:
            inverse_indices = np.full_like(epsilons, True, dtype=bool)
        elif self.adjacency_type == _Adjacency.ADD:
            inverse_indices = epsilons < -math.log1p(-q)
        else:
            inverse_indices = epsilons > math.log1p(-q)
            other_indices = np.logical_not(inverse_indices)
            deltas[other_indices] = -np.expm1(epsilons[other_indices])
        inverted = epsilons[inverse_indices]
        x_cutoffs = self._inverse_privacy_losses(np.asarray(inverted, dtype=float))
        if not self._agrees_with_library(inverted, x_cutoffs):
            self._array_path_refused = True
            return super().get_delta_for_epsilon(epsilon)
        deltas[inverse_indices] = (self.mu_upper_cdf(x_cutoffs)
                                   - np.exp(inverted + self.mu_lower_log_cdf(x_cutoffs)))
        self.array_path_used = True
        return np.clip(deltas, 0, 1)

    def _agrees_with_library(self, epsilons: np.ndarray, x_cutoffs: np.ndarray) -> bool:
        if len(epsilons) == 0:
            return True
        picks = _spot_picks(len(epsilons))
        try:
            library = np.array([self.inverse_privacy_loss(eps) for eps in epsilons[picks]], dtype=float)
        except ValueError:
            return False  # the library refuses a point the array form answered: let the library's loop raise
        return bool(np.array_equal(library, x_cutoffs[picks], equal_nan=True))

    def _remove_without_subsampling(self, privacy_loss: np.ndarray) -> np.ndarray:
        # GaussianPrivacyLoss._inverse_privacy_loss_without_subsampling_remove, the same order of operations
        return -0.5 * self.sensitivity - privacy_loss * (self._standard_deviation ** 2) / self.sensitivity

    def _inverse_privacy_losses(self, privacy_loss: np.ndarray) -> np.ndarray:
        """``inverse_privacy_loss`` (``_inverse_privacy_loss_add`` / ``_remove`` / ``_replace``) of every element."""
        if self.adjacency_type == _Adjacency.REPLACE:
            return self._inverse_replace(privacy_loss)
        add = self.adjacency_type == _Adjacency.ADD
        q = self.sampling_prob
        if q == 1.0:
            x = self._remove_without_subsampling(privacy_loss)
            return self.sensitivity + x if add else x
        # privacy losses at the bound map to the without-subsampling inverse of +inf (add) or -inf (remove)
        bound = -math.log(1 - q) if add else math.log(1 - q)
        close = (privacy_loss == bound) | (np.isfinite(privacy_loss) & (
            np.abs(privacy_loss - bound) <= 1e-9 * np.maximum(np.abs(privacy_loss), abs(bound))))  # math.isclose
        beyond = ((privacy_loss > bound) if add else (privacy_loss <= bound)) & ~close
        if beyond.any():
            raise ValueError(f"privacy_loss ({privacy_loss[beyond][0]}) is beyond the bound {bound} of "
                             f"{'-log(1 - q)' if add else 'log(1 - q)'} (sampling_prob={q}).")
        # common.log_a_times_exp_b_plus_c(a, b, c) with a = 1 / q > 0 and c = 1 - 1 / q < 0: log(a + c) where
        # b == 0, else _log_sub(b + log(a), log(-c)), which refuses log(-c) >= b + log(a)
        a, c = 1 / q, 1 - 1 / q
        b = -privacy_loss if add else privacy_loss
        log_a, log_minus_c = np.log(a), np.log(-c)
        with np.errstate(all="ignore"):
            d = b + log_a
            refused = (log_minus_c >= d) & (b != 0) & ~close
            if refused.any():
                raise ValueError(f"a must be greater than b. Got a={d[refused][0]} and b={log_minus_c}.")
            log_term = np.where(b == 0, np.log(a + c), d + np.log1p(-np.exp(log_minus_c - d)))
            x = self._remove_without_subsampling(-log_term if add else log_term)
            if add:
                x = self.sensitivity + x
        return np.where(close, -math.inf if add else math.inf, x)

    def _inverse_replace(self, privacy_loss: np.ndarray) -> np.ndarray:
        # GaussianPrivacyLoss._inverse_privacy_loss_replace with common.log_sinh and common.asinh_exp inlined. They
        # call math.exp, math.log1p and math.log (the C library's), which numpy's own exp and log1p do not match
        # to the last bit on every input: those two run as the C library's functions element by element
        std, s, q = self._standard_deviation, self.sensitivity, self.sampling_prob
        if q == 1.0:
            x = -privacy_loss * std ** 2 / s / 2
        else:
            log_alpha = 0.5 * (s / std) ** 2 + math.log1p(-q) - math.log(q)
            half = np.abs(privacy_loss) / 2
            vanishing = half == 0  # log_sinh(0) is 0: privacy_loss 0 (answered 0.0 below) or +-5e-324 (halved to 0)
            half = np.where(vanishing, 1.0, half)
            with np.errstate(all="ignore"):
                # log_sinh(a) = a + log1p(-exp(-2 a)) - log(2)
                log_sinh = (half + _math_log1p(-_math_exp(-2 * half)).astype(float)) - math.log(2)
                log_sinh = np.where(vanishing, 0.0, log_sinh)
                # asinh_exp(log_sinh_term, b) with b = -sign(privacy_loss): |b| = 1, log(|b| e^a) = 0.0 + a
                log_abs_b_times_exp_a = 0.0 + (log_alpha + log_sinh)
                asinh = np.logaddexp(0.5 * np.logaddexp(0, 2 * log_abs_b_times_exp_a), log_abs_b_times_exp_a)
                asinh_term = np.where(privacy_loss >= 0, -asinh, asinh)  # sign_b * ... with sign_b = -sign
                x = std ** 2 / s * (asinh_term - privacy_loss / 2)
        return np.where(privacy_loss == 0, 0.0, x)


# the C library's exp and log1p, element by element (what dp-accounting's scalar code calls through math)
_math_exp = np.frompyfunc(math.exp, 1, 1)
_math_log1p = np.frompyfunc(math.log1p, 1, 1)


def gaussian_pld(standard_deviation: float, *, sampling_prob: float = 1.0, pessimistic_estimate: bool = True,
                 value_discretization_interval: float = 1e-4, use_connect_dots: bool = True,
                 neighboring_relation: NeighboringRelation = NeighboringRelation.ADD_OR_REMOVE_ONE,
                 ) -> privacy_loss_distribution.PrivacyLossDistribution:
    """``privacy_loss_distribution.from_gaussian_mechanism`` (sensitivity 1, the default mass truncation), the
    connect-the-dots divergences evaluated on arrays where the installed dp-accounting is a verified release;
    otherwise the library's function itself. Either way the same PLD, bit for bit."""
    if not array_path_available():
        return privacy_loss_distribution.from_gaussian_mechanism(
            standard_deviation, pessimistic_estimate=pessimistic_estimate, sampling_prob=sampling_prob,
            value_discretization_interval=value_discretization_interval, use_connect_dots=use_connect_dots,
            neighboring_relation=neighboring_relation)

    def single(adjacency: Any) -> Any:  # from_gaussian_mechanism's single_gaussian_pld
        return privacy_loss_distribution._create_pld_pmf_from_monotone_privacy_loss(
            _ArrayGaussianPrivacyLoss(standard_deviation, pessimistic_estimate=pessimistic_estimate,
                                      sampling_prob=sampling_prob, adjacency_type=adjacency),
            pessimistic_estimate=pessimistic_estimate, value_discretization_interval=value_discretization_interval,
            use_connect_dots=use_connect_dots)

    # from_gaussian_mechanism's choice of directions (_pld_for_subsampled_mechanism for add/remove)
    if neighboring_relation in (NeighboringRelation.ADD_OR_REMOVE_ONE, NeighboringRelation.REPLACE_SPECIAL):
        pmf_remove = single(_Adjacency.REMOVE)
        if sampling_prob == 1.0:
            return privacy_loss_distribution.PrivacyLossDistribution(pmf_remove)
        return privacy_loss_distribution.PrivacyLossDistribution(pmf_remove, single(_Adjacency.ADD))
    if neighboring_relation == NeighboringRelation.REPLACE_ONE:
        return privacy_loss_distribution.PrivacyLossDistribution(single(_Adjacency.REPLACE))
    raise ValueError(f"Unsupported neighboring relation: {neighboring_relation}")


def truncated_gaussian_pld(*, dataset_size: int, sampling_probability: float, truncated_batch_size: int,
                           noise_multiplier: float, value_discretization_interval: float = 1e-4,
                           neighboring_relation: NeighboringRelation = NeighboringRelation.ADD_OR_REMOVE_ONE,
                           ) -> privacy_loss_distribution.PrivacyLossDistribution:
    """``privacy_loss_distribution.from_truncated_subsampled_gaussian_mechanism`` (the default mass truncation,
    connect the dots), its two Gaussian PLDs built by :func:`gaussian_pld`: the same PLD, bit for bit."""
    if not array_path_available():
        return privacy_loss_distribution.from_truncated_subsampled_gaussian_mechanism(
            dataset_size=dataset_size, sampling_probability=sampling_probability,
            truncated_batch_size=truncated_batch_size, noise_multiplier=noise_multiplier,
            value_discretization_interval=value_discretization_interval, neighboring_relation=neighboring_relation)
    # from_truncated_subsampled_gaussian_mechanism (0.6.0), line by line
    sens_1_mechanism = gaussian_pld(noise_multiplier, value_discretization_interval=value_discretization_interval,
                                    sampling_prob=sampling_probability, neighboring_relation=neighboring_relation)
    truncation_probability = stats.binom.sf(truncated_batch_size - 1, dataset_size - 1, sampling_probability)
    if truncation_probability == 0.0:
        return sens_1_mechanism
    conditional_sampling_probability = (stats.binom.sf(truncated_batch_size, dataset_size, sampling_probability)
                                        * truncated_batch_size / truncation_probability / dataset_size)
    sens_2_mechanism = gaussian_pld(noise_multiplier / 2, value_discretization_interval=value_discretization_interval,
                                    sampling_prob=conditional_sampling_probability,
                                    neighboring_relation=NeighboringRelation.REPLACE_ONE)
    return sens_2_mechanism.compute_mixture(sens_1_mechanism, truncation_probability)


class _ArrayMixtureGaussianPrivacyLoss(privacy_loss_mechanism.MixtureGaussianPrivacyLoss):
    """The library's ``MixtureGaussianPrivacyLoss`` (a user's records: the ELS mixture of Gaussians) whose inverse
    privacy losses are found by one bisection per element on arrays.

    The library bisects recursively: a node of the search splits its privacy losses at the loss of its midpoint
    and recurses into both halves (about a million nodes, 2-7 s, at 1e-4 for a user of two records). Each element
    follows one path of that tree; walking every element's path at once, level by level, visits the same
    midpoints and compares with the same losses (the privacy loss of a midpoint is the library's expression, on a
    matrix of midpoints x sensitivities, reduced along each row in the same order): the same inverses, bit for bit.
    The deltas' monotone repair (a Python loop over the grid) is a running maximum from the right. A strided sample
    of every array is also inverted by the library's own recursion; on a difference the library's answers stand.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.array_path_used = False

    def _privacy_losses(self, x: np.ndarray) -> np.ndarray:
        # MixtureGaussianPrivacyLoss.privacy_loss on a column of points
        x_loss = self.sensitivities[np.newaxis, :] * x[:, np.newaxis] / (self._variance)
        if self.adjacency_type == _Adjacency.ADD:
            return -np.logaddexp.reduce(self._precompute_privacy_loss_constants + x_loss, axis=1)
        return np.logaddexp.reduce(self._precompute_privacy_loss_constants - x_loss, axis=1)

    @functools.cached_property
    def _library(self) -> privacy_loss_mechanism.MixtureGaussianPrivacyLoss:
        """The library's object of the same mechanism: its recursion calls itself, never this class's search."""
        return privacy_loss_mechanism.MixtureGaussianPrivacyLoss(
            self._standard_deviation, self.sensitivities, self.sampling_probs,
            pessimistic_estimate=self._pessimistic_estimate, log_mass_truncation_bound=self._log_mass_truncation_bound,
            adjacency_type=self.adjacency_type)

    def _inverse_privacy_losses_with_range(self, privacy_losses: Any, bounds: tuple[float, float],
                                           precision: float = 1e-6) -> Any:
        privacy_losses = np.asarray(privacy_losses)
        if (len(privacy_losses) <= _SPOT_CHECKS or not np.isfinite(bounds).all()
                or self.adjacency_type not in (_Adjacency.ADD, _Adjacency.REMOVE)):
            # a few losses (the privacy-buckets path inverts them a few at a time): the library's recursion is
            # as fast and needs no check
            return self._library._inverse_privacy_losses_with_range(privacy_losses, bounds, precision)
        lower = np.full(len(privacy_losses), bounds[0])
        upper = np.full(len(privacy_losses), bounds[1])
        output = np.zeros_like(privacy_losses)
        open_ = np.ones(len(privacy_losses), dtype=bool)  # the elements whose node is not a leaf yet
        while True:
            leaf = open_ & (upper - lower <= precision)
            output[leaf] = np.floor(upper[leaf] / precision) * precision
            open_ &= ~leaf
            if not open_.any():
                break
            index = np.flatnonzero(open_)
            mid = (lower[index] + upper[index]) / 2
            split = self._privacy_losses(mid)
            losses = privacy_losses[index]
            below, above = losses < split, losses >= split  # the library's lower and higher indices
            lower[index[below]] = mid[below]  # a loss below the split is inverted in (mid, upper)
            upper[index[above]] = mid[above]
            open_[index[~(below | above)]] = False  # NaN goes to neither half: the library leaves its 0
        # An element's path down the tree does not depend on the others: the library's recursion on a strided
        # sample gives those elements' inverses; on a difference the library's recursion answers for all
        picks = _spot_picks(len(privacy_losses))
        expected = np.asarray(self._library._inverse_privacy_losses_with_range(privacy_losses[picks], bounds,
                                                                               precision), dtype=float)
        if not np.array_equal(expected, output[picks], equal_nan=True):
            return self._library._inverse_privacy_losses_with_range(privacy_losses, bounds, precision)
        self.array_path_used = True
        return output

    def get_delta_for_epsilon(self, epsilon: Any) -> Any:
        if isinstance(epsilon, numbers.Number):
            return super().get_delta_for_epsilon(epsilon)
        # MixtureGaussianPrivacyLoss.get_delta_for_epsilon (0.6.0) line by line, then its monotone repair
        epsilons = np.atleast_1d(epsilon)
        if not np.all(epsilons[1:] >= epsilons[:-1]):
            raise ValueError(f"Epsilon values must be non-decreasing: {epsilons}")
        deltas = np.zeros_like(epsilons, dtype=float)
        if self._sampling_prob == 1.0:
            inverse_indices = np.full_like(epsilons, True, dtype=bool)
        elif self.adjacency_type == _Adjacency.ADD:
            inverse_indices = epsilons < -np.log1p(-self._sampling_prob)
        elif self.adjacency_type == _Adjacency.REMOVE:
            inverse_indices = epsilons > np.log1p(-self._sampling_prob)
            other_indices = np.logical_not(inverse_indices)
            deltas[other_indices] = -np.expm1(epsilons[other_indices])
        else:
            return super().get_delta_for_epsilon(epsilon)
        x_cutoffs = self.inverse_privacy_losses(epsilons[inverse_indices])
        deltas[inverse_indices] = self.mu_upper_cdf(x_cutoffs) - np.exp(
            epsilons[inverse_indices] + self.mu_lower_log_cdf(x_cutoffs))
        deltas = np.clip(deltas, 0, 1)
        return _monotone_from_the_right(deltas)


def _monotone_from_the_right(deltas: np.ndarray) -> np.ndarray:
    """``for i in reversed(range(n - 1)): deltas[i] = max(deltas[i], deltas[i + 1])`` without the loop.

    Python's ``max(a, b)`` keeps ``a`` unless ``b > a``: each entry becomes the largest entry to its right where
    that is strictly larger, else keeps its own bits. A NaN breaks that chain (nothing compares larger than it, it
    compares larger than nothing): with one present the loop itself runs."""
    if deltas.shape[0] < 2:
        return deltas
    if np.isnan(deltas).any():
        for i in reversed(range(deltas.shape[0] - 1)):
            deltas[i] = max(deltas[i], deltas[i + 1])
        return deltas
    right = np.maximum.accumulate(deltas[::-1])[::-1]  # right[i]: the largest of deltas[i:]
    larger = np.empty_like(deltas)
    larger[:-1], larger[-1] = right[1:], deltas[-1]
    return np.where(larger > deltas, larger, deltas)


def mixture_gaussian_pld(standard_deviation: float, sensitivities: Any, sampling_probs: Any, *,
                         pessimistic_estimate: bool = True, value_discretization_interval: float = 1e-4,
                         use_connect_dots: bool = True) -> privacy_loss_distribution.PrivacyLossDistribution:
    """``privacy_loss_distribution.from_mixture_gaussian_mechanism`` (the default mass truncation), its inverse
    privacy losses bisected on arrays where the installed dp-accounting is a verified release: the same PLD."""
    if not array_path_available():
        return privacy_loss_distribution.from_mixture_gaussian_mechanism(
            standard_deviation=standard_deviation, sensitivities=sensitivities, sampling_probs=sampling_probs,
            pessimistic_estimate=pessimistic_estimate, use_connect_dots=use_connect_dots,
            value_discretization_interval=value_discretization_interval)

    def single(adjacency: Any) -> Any:  # from_mixture_gaussian_mechanism's single_pld_pmf
        return privacy_loss_distribution._create_pld_pmf_from_monotone_privacy_loss(
            _ArrayMixtureGaussianPrivacyLoss(standard_deviation, sensitivities, sampling_probs,
                                             pessimistic_estimate=pessimistic_estimate, adjacency_type=adjacency),
            pessimistic_estimate=pessimistic_estimate, value_discretization_interval=value_discretization_interval,
            use_connect_dots=use_connect_dots)

    return privacy_loss_distribution.PrivacyLossDistribution(single(_Adjacency.REMOVE), single(_Adjacency.ADD))


def epsilon_for_delta(pld: privacy_loss_distribution.PrivacyLossDistribution, delta: float) -> float:
    """``pld.get_epsilon_for_delta(delta)``, each dense direction's scan from the largest loss down on arrays.

    ``pld_pmf._get_epsilon_for_delta`` walks the PMF from its largest loss in a Python loop until the epsilon:
    0.02-0.2 s a direction (the truncated event's distribution is four times wider than the sampled Gaussian's).
    :func:`_epsilon_from_largest_loss` computes the loop's running sums with ``np.cumsum`` (sequential additions,
    the loop's own order), its ``math.exp`` terms with the C library's exp, and finds where the loop stops from the
    same comparisons (its ``math.log`` evaluated exactly at the candidates): the same number. Sparse PMFs and
    unverified releases take the library's method."""
    if not array_path_available():
        return pld.get_epsilon_for_delta(delta)
    epsilon_remove = _pmf_epsilon_for_delta(pld._pmf_remove, delta)
    if pld._symmetric:
        return epsilon_remove
    return max(epsilon_remove, _pmf_epsilon_for_delta(pld._pmf_add, delta))


def _pmf_epsilon_for_delta(pmf: Any, delta: float) -> Any:
    if type(pmf) is not pld_pmf.DensePLDPmf:
        return pmf.get_epsilon_for_delta(delta)
    # DensePLDPmf.get_epsilon_for_delta: the losses from the largest down by itertools.count (repeated additions)
    upper_loss = (pmf._lower_loss + len(pmf._probs) - 1) * pmf._discretization
    return _epsilon_from_largest_loss(pmf._infinity_mass, upper_loss, -pmf._discretization,
                                      np.flip(pmf._probs), delta)


def _epsilon_from_largest_loss(infinity_mass: float, upper_loss: float, step: float, probs: np.ndarray,
                               delta: float) -> Any:
    """``pld_pmf._get_epsilon_for_delta(infinity_mass, itertools.count(upper_loss, step), probs, delta)``.

    The loop, per entry ``i`` (loss ``l_i``, probability ``p_i``): stop if ``U > delta and L > 0 and
    log((U - delta) / L) >= l_i``; then ``U += p_i``, ``L += exp(-l_i) p_i``; return ``max(0, l_i)`` if ``U >= delta
    and L == 0``. Here in blocks from the largest loss, the block's sums carried in."""
    if infinity_mass > delta:
        return math.inf
    upper, lower = infinity_mass, 0  # the loop's mass_upper and mass_lower (an int 0 until the first addition)
    loss = upper_loss
    start, size = 0, 4096
    while start < len(probs):
        p = np.asarray(probs[start:start + size], dtype=float)
        losses = np.cumsum(np.concatenate(([loss], np.full(len(p) - 1, step))))  # count(): loss, loss + step, ...
        uppers = np.cumsum(np.concatenate(([upper], p)))  # uppers[i]: U before entry i; uppers[i + 1]: after it
        terms = _math_exp(-losses).astype(float) * p
        lowers = np.cumsum(np.concatenate(([lower], terms)))  # int 0 + x is 0.0 + x: the same float
        u_before, l_before = uppers[:-1], lowers[:-1]
        stop = None
        with np.errstate(all="ignore"):
            ratio = (u_before - delta) / l_before
            # np.log and math.log may differ in the last bit: candidates with a margin, then the loop's own test
            # (a ratio that underflows to 0 is a candidate: the loop's math.log(0.0) raises there)
            maybe = (u_before > delta) & (l_before > 0) & (
                (np.log(ratio) >= losses - 1e-9 * (1.0 + np.abs(losses))) | (ratio == 0))
        for i in np.flatnonzero(maybe):
            if math.log(float(ratio[i])) >= losses[i]:
                stop = int(i)
                break
        zero_mass = np.flatnonzero((uppers[1:] >= delta) & (lowers[1:] == 0))
        if len(zero_mass) and (stop is None or zero_mass[0] < stop):
            found = losses[zero_mass[0]]
            return max(0, found)
        if stop is not None:  # never at the very first entry (its L is 0)
            upper, lower = uppers[stop], lowers[stop]
            break
        upper, lower = uppers[-1], lowers[-1]
        loss = losses[-1] + step
        start += len(p)
        size *= 2
    if upper <= lower + delta:
        return 0
    return math.log((upper - delta) / lower)


def self_compose(pld: privacy_loss_distribution.PrivacyLossDistribution, num_times: int,
                 tail_mass_truncation: float = 1e-15) -> privacy_loss_distribution.PrivacyLossDistribution:
    """``pld.self_compose(num_times)``: the same distribution, its truncation bounds found without scipy's
    per-call overhead.

    ``common.self_convolve`` bounds the composed distribution's support by Chernoff bounds at 40 orders, each a
    ``scipy.special.logsumexp`` call whose array-API dispatch costs more than its arithmetic on the few thousand
    entries of a distribution at 1e-3 (about 6 of the 8 ms of an interim epsilon's composition). :func:`_logsumexp`
    performs scipy's operations in its order on numpy arrays; the FFT is the library's (``scipy.fft``, as it calls
    it). Sparse PMFs and unverified releases (of dp-accounting, or of scipy: :data:`VERIFIED_SCIPY`) take the
    library's method."""
    if not (array_path_available() and _logsumexp_verified()):
        return pld.self_compose(num_times, tail_mass_truncation)
    pmf_remove = _pmf_self_compose(pld._pmf_remove, num_times, tail_mass_truncation)
    if pld._symmetric:
        return privacy_loss_distribution.PrivacyLossDistribution(pmf_remove)
    return privacy_loss_distribution.PrivacyLossDistribution(
        pmf_remove, _pmf_self_compose(pld._pmf_add, num_times, tail_mass_truncation))


def _pmf_self_compose(pmf: Any, num_times: int, tail_mass_truncation: float) -> Any:
    if type(pmf) is not pld_pmf.DensePLDPmf:
        return pmf.self_compose(num_times, tail_mass_truncation)
    # DensePLDPmf.self_compose (0.6.0), line by line
    if num_times <= 0:
        raise ValueError(f"num_times should be >= 1, num_times={num_times}")
    lower_loss = pmf._lower_loss * num_times
    truncation_lower_bound, probs = _self_convolve(pmf._probs, num_times, tail_mass_truncation)
    lower_loss += truncation_lower_bound
    probs = np.array(probs)
    inf_prob = (tail_mass_truncation - math.expm1(num_times * math.log1p(-pmf._infinity_mass)))
    return pld_pmf.DensePLDPmf(pmf._discretization, lower_loss, probs, inf_prob, pmf._pessimistic_estimate)


def _self_convolve(input_list: np.ndarray, num_times: int, tail_mass_truncation: float) -> tuple[int, np.ndarray]:
    # common.self_convolve (0.6.0), line by line
    truncation_lower_bound, truncation_upper_bound = _self_convolve_bounds(input_list, num_times,
                                                                           tail_mass_truncation)
    output_len = truncation_upper_bound - truncation_lower_bound + 1
    fast_len = fft.next_fast_len(max(output_len, len(input_list)))
    truncated_convolution_output = np.real(fft.ifft(fft.fft(input_list, fast_len) ** num_times))
    return truncation_lower_bound, np.roll(truncated_convolution_output, -truncation_lower_bound)[:output_len]


def _self_convolve_bounds(input_list: np.ndarray, num_times: int, tail_mass_truncation: float) -> tuple[int, int]:
    # common.compute_self_convolve_bounds (0.6.0) with its default orders, line by line
    upper_bound = (len(input_list) - 1) * num_times
    lower_bound = 0
    if tail_mass_truncation == 0:
        return lower_bound, upper_bound
    orders = np.concatenate((np.arange(-20, 0), np.arange(1, 21))) / len(input_list)
    index = np.arange(len(input_list))
    log_mgfs = [_logsumexp(index * order, input_list) for order in orders]
    for order, log_mgf_value in zip(orders, log_mgfs):
        bound = (num_times * log_mgf_value + math.log(2 / tail_mass_truncation)) / order
        if not math.isfinite(bound):
            continue
        if order > 0:
            upper_bound = min(upper_bound, math.ceil(bound))
        if order < 0:
            lower_bound = max(lower_bound, math.floor(bound))
    return lower_bound, upper_bound


def _logsumexp(a: np.ndarray, b: np.ndarray) -> Any:
    """``scipy.special.logsumexp(a, b=b)`` of real 1-D float64 arrays: scipy's operations (``logsumexp`` and
    ``_logsumexp`` of scipy 1.17) in its order, with its keepdims shapes, on numpy."""
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        masked = np.where(b == 0, -np.inf, a)  # xpx.at(a, b == 0).set(-inf, copy=True)
        a_max = np.max(masked, axis=0, keepdims=True)
        i_max = masked == a_max
        masked[i_max] = -np.inf
        m = np.sum(b * i_max.astype(masked.dtype), axis=0, keepdims=True, dtype=masked.dtype)
        exp = b * np.exp(masked - a_max)
        s = np.sum(exp, axis=0, keepdims=True, dtype=exp.dtype)
        s = np.where(s == 0, s, s / m)
        sgn = np.sign(s + 1) * np.sign(m)
        s = np.where(s < -1, -s - 2, s)
        m = np.abs(m)
        out = np.log1p(s) + np.log(m) + a_max
        out[sgn < 0] = np.nan
        if not np.isfinite(out).all():  # logsumexp's fallback: the plain sum's log where the stable form is not finite
            out = np.where(np.isfinite(out), out, np.log(np.sum(b * np.exp(a), axis=0, keepdims=True)))
    return out[()] if out.ndim == 0 else out[0]
