"""The sampled Gaussian's PLD with its divergences on arrays: bit for bit dp-accounting's, or dp-accounting's own."""

import itertools
import math

import numpy as np
import pytest
from dp_accounting.pld import privacy_loss_distribution, privacy_loss_mechanism
from dp_accounting.privacy_accountant import NeighboringRelation

from lightning_dp.privacy import pld_arrays as module
from lightning_dp.privacy.accounting import PLDAccountant, binomial_sensitivities, clear_caches
from lightning_dp.privacy.pld_arrays import (
    _ArrayGaussianPrivacyLoss,
    _ArrayMixtureGaussianPrivacyLoss,
    _monotone_from_the_right,
    array_path_available,
    gaussian_pld,
    mixture_gaussian_pld,
    truncated_gaussian_pld,
)

ADD, REMOVE = privacy_loss_mechanism.AdjacencyType.ADD, privacy_loss_mechanism.AdjacencyType.REMOVE
REPLACE = privacy_loss_mechanism.AdjacencyType.REPLACE
needs_array_path = pytest.mark.skipif(not array_path_available(), reason="the installed dp-accounting is not a "
                                      "verified release: gaussian_pld calls from_gaussian_mechanism itself")

# (sigma, q, interval): DP-SGD's regimes (small q, sigma near 1), a large and a tiny q, q = 1, a sigma so large that
# the loss vanishes, one so small that the grid is wide
CASES = [(1.1, 256 / 60000, 1e-3), (0.8, 64 / 1797, 1e-3), (5.0, 0.5, 1e-3), (0.5, 0.01, 1e-3), (2.0, 1.0, 1e-3),
         (0.3, 0.999, 1e-3), (20.0, 1e-5, 1e-4), (1.1, 256 / 60000, 1e-4), (0.6, 0.3, 1e-2)]


def _fields(pld):
    """Every attribute of the PLD and of its two PMFs, arrays as (dtype, shape, bytes)."""
    out = {}
    for name, value in vars(pld).items():
        if hasattr(value, "__dict__") and not isinstance(value, (int, float, bool)):
            for inner, item in vars(value).items():
                out[f"{name}.{inner}"] = ((item.dtype.str, item.shape, item.tobytes()) if isinstance(item, np.ndarray)
                                          else item)
            out[f"{name}.type"] = type(value).__name__
        else:
            out[name] = value
    return out


@pytest.mark.parametrize("relation", [NeighboringRelation.ADD_OR_REMOVE_ONE, NeighboringRelation.REPLACE_ONE])
@pytest.mark.parametrize("sigma,q,interval", CASES)
def test_the_pld_is_the_librarys_bit_for_bit(sigma, q, interval, relation):
    mine = gaussian_pld(sigma, sampling_prob=q, value_discretization_interval=interval, neighboring_relation=relation)
    library = privacy_loss_distribution.from_gaussian_mechanism(
        sigma, sampling_prob=q, value_discretization_interval=interval, neighboring_relation=relation)
    assert _fields(mine) == _fields(library)
    for delta in (1e-5, 1e-9):
        assert mine.get_epsilon_for_delta(delta) == library.get_epsilon_for_delta(delta)


@needs_array_path
@pytest.mark.parametrize("adjacency", [ADD, REMOVE, REPLACE])
@pytest.mark.parametrize("sigma,q,interval", CASES)
def test_the_deltas_come_from_the_array_form_and_equal_the_librarys(sigma, q, interval, adjacency):
    mine = _ArrayGaussianPrivacyLoss(sigma, sampling_prob=q, adjacency_type=adjacency)
    library = privacy_loss_mechanism.GaussianPrivacyLoss(sigma, sampling_prob=q, adjacency_type=adjacency)
    bounds = library.connect_dots_bounds()
    grid = np.arange(math.floor(bounds.epsilon_lower / interval), math.ceil(bounds.epsilon_upper / interval) + 1)
    epsilons = grid * interval
    expected = library.get_delta_for_epsilon(epsilons)
    got = mine.get_delta_for_epsilon(epsilons)
    assert mine.array_path_used and not mine._array_path_refused
    assert got.dtype == expected.dtype and got.tobytes() == expected.tobytes()


@needs_array_path
@pytest.mark.parametrize("adjacency", [ADD, REMOVE, REPLACE])
def test_the_edges_of_the_inverse_match_the_library(adjacency):
    """Zero (log(a + c)), the bound itself and the float next to it (math.isclose), both signs near the bound,
    and losses so small that exp(-2 a) rounds near 1 (replace's log_sinh)."""
    q = 0.02
    bound = -math.log(1 - q) if adjacency == ADD else math.log(1 - q)
    inside = np.nextafter(bound, 0.0)
    mine = _ArrayGaussianPrivacyLoss(0.9, sampling_prob=q, adjacency_type=adjacency)
    library = privacy_loss_mechanism.GaussianPrivacyLoss(0.9, sampling_prob=q, adjacency_type=adjacency)
    points = np.array([0.0, -0.0, bound, inside, bound * (1 - 1e-10), bound * (1 - 1e-8), 1e-300, -1e-300, 1e-15,
                       -1e-12, 0.5 * bound, 3.0 * abs(bound) * (-1 if adjacency == ADD else 1)])
    if adjacency == REPLACE:  # no bound: every real loss is inverted, but exp(-|loss|) == 1 fails log1p(-1)
        for tiny in (1e-300, -1e-300):
            with pytest.raises(ValueError):
                library.inverse_privacy_loss(tiny)
            with pytest.raises(ValueError):
                _ArrayGaussianPrivacyLoss(0.9, sampling_prob=q, adjacency_type=adjacency)._inverse_privacy_losses(
                    np.array([tiny]))
        # the smallest subnormal halves to 0: the library's log_sinh(0) is 0 there, not an error
        points = np.concatenate([points[np.abs(points) != 1e-300], [-40.0, -3.0, 3.0, 40.0, 5e-324, -5e-324]])
    inverses = mine._inverse_privacy_losses(points)
    assert inverses.tobytes() == np.array([library.inverse_privacy_loss(p) for p in points]).tobytes()
    assert mine.get_delta_for_epsilon(points).tobytes() == library.get_delta_for_epsilon(points).tobytes()
    if adjacency == REPLACE:
        return
    beyond = np.array([bound + (0.1 if adjacency == ADD else -0.1)])
    with pytest.raises(ValueError):
        library.inverse_privacy_loss(float(beyond[0]))
    with pytest.raises(ValueError, match="beyond the bound"):
        mine._inverse_privacy_losses(beyond)


@needs_array_path
def test_a_disagreement_with_the_library_takes_the_librarys_loop(monkeypatch):
    """Were the array form one ulp off anywhere the spot checks look, the library's own loop answers."""
    loss = _ArrayGaussianPrivacyLoss(1.1, sampling_prob=0.01, adjacency_type=REMOVE)
    exact = loss._inverse_privacy_losses
    monkeypatch.setattr(loss, "_inverse_privacy_losses", lambda e: np.nextafter(exact(e), np.inf))
    epsilons = np.arange(-50, 3000) * 1e-3
    library = privacy_loss_mechanism.GaussianPrivacyLoss(1.1, sampling_prob=0.01, adjacency_type=REMOVE)
    assert loss.get_delta_for_epsilon(epsilons).tobytes() == library.get_delta_for_epsilon(epsilons).tobytes()
    assert loss._array_path_refused and not loss.array_path_used


def test_an_unverified_release_builds_with_the_library(monkeypatch):
    array_path_available.cache_clear()
    monkeypatch.setattr(module.metadata, "version", lambda name: "99.0.0")
    calls = []
    original = privacy_loss_distribution.from_gaussian_mechanism
    monkeypatch.setattr(privacy_loss_distribution, "from_gaussian_mechanism",
                        lambda *a, **k: calls.append(k) or original(*a, **k))
    try:
        assert not array_path_available()
        pld = gaussian_pld(1.0, sampling_prob=0.02, value_discretization_interval=1e-3)
    finally:
        array_path_available.cache_clear()
    assert len(calls) == 1 and calls[0]["sampling_prob"] == 0.02
    assert _fields(pld) == _fields(original(1.0, sampling_prob=0.02, value_discretization_interval=1e-3))


def test_the_optimistic_estimate_is_the_librarys():
    """pessimistic_estimate=False builds by privacy buckets (no connect the dots): the library's path throughout."""
    kwargs = dict(sampling_prob=0.05, value_discretization_interval=1e-3, pessimistic_estimate=False,
                  use_connect_dots=False)
    assert _fields(gaussian_pld(1.3, **kwargs)) == _fields(
        privacy_loss_distribution.from_gaussian_mechanism(1.3, **kwargs))


@pytest.mark.parametrize("cap,interval", [(300, 1e-3), (270, 1e-4), (10_000, 1e-3)])
def test_the_truncated_pld_is_the_librarys_bit_for_bit(cap, interval):
    """Batches of one shape: the sampled Gaussian mixed with a sensitivity-2 replace-one Gaussian (a cap that never
    binds returns the first alone)."""
    kwargs = dict(dataset_size=60_000, sampling_probability=256 / 60_000, truncated_batch_size=cap,
                  noise_multiplier=1.1, value_discretization_interval=interval)
    mine = truncated_gaussian_pld(**kwargs)
    library = privacy_loss_distribution.from_truncated_subsampled_gaussian_mechanism(**kwargs)
    assert _fields(mine) == _fields(library)
    assert mine.get_epsilon_for_delta(1e-5) == library.get_epsilon_for_delta(1e-5)


MIXTURES = [(2, 256 / 60000, 1.1, 1e-3), (4, 0.01, 2.0, 1e-3), (8, 0.05, 3.0, 1e-3), (3, 0.6, 4.0, 1e-3),
            (2, 0.02, 0.9, 1e-3)]


@pytest.mark.parametrize("k,q,sigma,interval", MIXTURES)
def test_the_mixture_pld_is_the_librarys_bit_for_bit(k, q, sigma, interval):
    """A user's k records (the ELS mixture over Binomial(k, q) sensitivities)."""
    sensitivities, probabilities = binomial_sensitivities(k, q)
    mine = mixture_gaussian_pld(sigma, sensitivities, probabilities, value_discretization_interval=interval)
    library = privacy_loss_distribution.from_mixture_gaussian_mechanism(
        sigma, sensitivities, probabilities, value_discretization_interval=interval)
    assert _fields(mine) == _fields(library)
    assert mine.get_epsilon_for_delta(1e-5) == library.get_epsilon_for_delta(1e-5)


@needs_array_path
@pytest.mark.parametrize("adjacency", [ADD, REMOVE])
def test_the_mixtures_bisection_is_the_librarys_tree_walked_by_rows(adjacency):
    """The inverses themselves, over the whole grid, a grid with NaN, ties at split points and a range already
    within the precision."""
    sensitivities, probabilities = binomial_sensitivities(3, 0.05)
    mine = _ArrayMixtureGaussianPrivacyLoss(1.3, sensitivities, probabilities, adjacency_type=adjacency)
    library = privacy_loss_mechanism.MixtureGaussianPrivacyLoss(1.3, sensitivities, probabilities,
                                                                adjacency_type=adjacency)
    bounds = library.connect_dots_bounds()
    epsilons = np.arange(math.floor(bounds.epsilon_lower / 1e-3), math.ceil(bounds.epsilon_upper / 1e-3) + 1) * 1e-3
    assert (mine.get_delta_for_epsilon(epsilons).tobytes() == library.get_delta_for_epsilon(epsilons).tobytes())
    assert mine.array_path_used
    search = (-3.0, 2.5)
    # more losses than the spot checks (fewer go to the library's recursion directly), with NaN among them and
    # losses exactly at split points of the search
    at_splits = np.sort(np.repeat([library.privacy_loss(x) for x in (-0.25, 0.0, 1.125, -1.6875)], 30))
    with_nan = np.linspace(-0.4, 0.4, 100)
    with_nan[[3, 50, 99]] = np.nan
    for losses in (np.sort(np.linspace(-0.5, 0.5, 101)), with_nan, at_splits):
        expected = library._inverse_privacy_losses_with_range(losses, search, 1e-6)
        mine.array_path_used = False
        assert mine._inverse_privacy_losses_with_range(losses, search, 1e-6).tobytes() == expected.tobytes()
        assert mine.array_path_used
    narrow = (0.1, 0.1 + 5e-7)
    assert (mine._inverse_privacy_losses_with_range(with_nan, narrow, 1e-6).tobytes()
            == np.asarray(library._inverse_privacy_losses_with_range(with_nan, narrow, 1e-6)).tobytes())


def _python_repair(deltas):
    deltas = deltas.copy()
    for i in reversed(range(deltas.shape[0] - 1)):
        deltas[i] = max(deltas[i], deltas[i + 1])
    return deltas


@pytest.mark.parametrize("deltas", [
    [0.3, 0.1, 0.2, 0.2, 0.0, 0.05], [0.0, -0.0, 0.0, -0.0], [-0.0, 0.0], [0.5], [],
    [0.2, np.nan, 0.1, 0.3, np.nan, 0.0], [1.0, 1.0, 0.999, 1.0],
])
def test_the_monotone_repair_is_the_librarys_loop(deltas):
    deltas = np.array(deltas, dtype=float)
    assert _monotone_from_the_right(deltas.copy()).tobytes() == _python_repair(deltas).tobytes()


def test_random_repairs_match_the_loop():
    rng = np.random.default_rng(7)
    for _ in range(50):
        deltas = np.clip(np.sort(rng.uniform(0, 1, 200))[::-1] + rng.normal(0, 1e-3, 200), 0, 1)
        assert _monotone_from_the_right(deltas.copy()).tobytes() == _python_repair(deltas).tobytes()


@pytest.mark.parametrize("config", [{}, {"adjacency": "replace"}, {"examples_per_user": 2},
                                    {"examples_per_user": 3, "user_accounting": "group"},
                                    {"truncated_batch_size": 300, "dataset_size": 60_000}])
def test_the_accountants_epsilon_is_the_librarys_events(config):
    """The accountant, through these builders, states what dp-accounting's own PLDAccountant states for its event."""
    from dp_accounting.pld import PLDAccountant as LibraryPLDAccountant

    clear_caches()
    accountant = PLDAccountant(value_discretization_interval=1e-3, **config)
    accountant.step(noise_multiplier=1.1, sample_rate=256 / 60_000, num_steps=200)
    relation = NeighboringRelation.REPLACE_ONE if config.get("adjacency") == "replace" else None
    if config.get("user_accounting") == "group":
        example_level = PLDAccountant(value_discretization_interval=1e-3)
        example_level.step(noise_multiplier=1.1, sample_rate=256 / 60_000, num_steps=200)
        event = example_level.to_dp_event()
    else:
        event = accountant.to_dp_event()
    library = LibraryPLDAccountant(**({"neighboring_relation": relation} if relation else {}),
                                   value_discretization_interval=1e-3).compose(event)
    if config.get("user_accounting") == "group":
        from lightning_dp.privacy.accounting import group_epsilon
        expected = group_epsilon(library._pld.get_delta_for_epsilon, 3, 1e-5)
    else:
        expected = library.get_epsilon(1e-5)
    assert accountant.get_epsilon(1e-5) == expected


@needs_array_path
def test_a_mixture_disagreement_takes_the_librarys_recursion(monkeypatch):
    sensitivities, probabilities = binomial_sensitivities(2, 0.05)
    mine = _ArrayMixtureGaussianPrivacyLoss(1.3, sensitivities, probabilities, adjacency_type=REMOVE)
    library = privacy_loss_mechanism.MixtureGaussianPrivacyLoss(1.3, sensitivities, probabilities,
                                                                adjacency_type=REMOVE)
    exact = mine._privacy_losses
    monkeypatch.setattr(mine, "_privacy_losses", lambda x: exact(x) + 1e-4)  # the splits off: other paths
    losses = np.sort(np.linspace(-0.5, 0.5, 301))
    expected = library._inverse_privacy_losses_with_range(losses, (-3.0, 2.5), 1e-6)
    assert mine._inverse_privacy_losses_with_range(losses, (-3.0, 2.5), 1e-6).tobytes() == expected.tobytes()
    assert not mine.array_path_used


def _library_epsilon(pmf, delta):
    from dp_accounting.pld import pld_pmf

    upper_loss = (pmf._lower_loss + len(pmf._probs) - 1) * pmf._discretization
    return pld_pmf._get_epsilon_for_delta(pmf._infinity_mass, itertools.count(upper_loss, -pmf._discretization),
                                          np.flip(pmf._probs), delta)


def _real_plds():
    yield gaussian_pld(1.1, sampling_prob=256 / 60000, value_discretization_interval=1e-3).self_compose(235)
    yield gaussian_pld(0.6, sampling_prob=0.05, value_discretization_interval=1e-3).self_compose(40)
    yield gaussian_pld(3.0, sampling_prob=1.0, value_discretization_interval=1e-3)
    yield truncated_gaussian_pld(dataset_size=1797, sampling_probability=64 / 1797, truncated_batch_size=100,
                                 noise_multiplier=1.0, value_discretization_interval=1e-3).self_compose(87)
    yield mixture_gaussian_pld(1.5, *binomial_sensitivities(2, 0.02), value_discretization_interval=1e-3)


@pytest.mark.parametrize("delta", [1e-5, 1e-9, 0.3, 0.0])
def test_epsilon_for_delta_is_the_librarys_on_real_distributions(delta):
    for pld in _real_plds():
        assert module.epsilon_for_delta(pld, delta) == pld.get_epsilon_for_delta(delta)
        for pmf in (pld._pmf_remove, pld._pmf_add):
            assert module._pmf_epsilon_for_delta(pmf, delta) == _library_epsilon(pmf, delta)


def _dense(probs, lower_loss, infinity_mass=0.0, discretization=1e-2):
    from dp_accounting.pld import pld_pmf

    return pld_pmf.DensePLDPmf(discretization, lower_loss, np.asarray(probs, dtype=float), infinity_mass, True)


def test_epsilon_for_delta_edges_match_the_loop():
    """Mass at infinity above delta, huge losses whose exp(-l) underflows (the loop's early return), a stop before
    the first addition, an epsilon of 0, blocks past the first (4096 entries), random PMFs."""
    rng = np.random.default_rng(3)
    cases = [
        (_dense([0.5, 0.5], 0, infinity_mass=0.2), 0.1),
        (_dense([0.3, 0.3, 0.4], 100_000), 0.1),  # losses ~1000: exp(-l) = 0
        (_dense([0.3, 0.3, 0.4], 100_000), 0.5),
        (_dense([0.3, 0.3, 0.4], -500), 1e-5),  # all losses negative
        (_dense([1.0], 0), 1e-5), (_dense([1e-7, 1 - 1e-7], 5), 1e-3),
        (_dense([0.5, 0.5], -1, infinity_mass=1e-6), 1e-6),
    ]
    for size in (10, 5000, 20_000):
        probs = rng.exponential(size=size)
        cases.append((_dense(probs / probs.sum(), -size // 2, infinity_mass=1e-7, discretization=1e-3), 1e-5))
        cases.append((_dense(probs / probs.sum(), -size // 3, discretization=1e-4), 1e-3))
    for pmf, delta in cases:
        with np.errstate(all="ignore"):
            expected = _library_epsilon(pmf, delta)
            got = module._pmf_epsilon_for_delta(pmf, delta)
        assert got == expected or (math.isnan(got) and math.isnan(expected)), (pmf._probs[:5], delta)


@pytest.mark.parametrize("num_times", [1, 2, 87, 1000])
def test_self_compose_is_the_librarys_bit_for_bit(num_times):
    for pld in (gaussian_pld(1.0, sampling_prob=64 / 1797, value_discretization_interval=1e-3),
                gaussian_pld(2.0, sampling_prob=1.0, value_discretization_interval=1e-3),
                truncated_gaussian_pld(dataset_size=1797, sampling_probability=64 / 1797, truncated_batch_size=100,
                                       noise_multiplier=1.0, value_discretization_interval=1e-3),
                mixture_gaussian_pld(1.5, *binomial_sensitivities(2, 0.02), value_discretization_interval=1e-3),
                privacy_loss_distribution.identity(value_discretization_interval=1e-3)):
        assert _fields(module.self_compose(pld, num_times)) == _fields(pld.self_compose(num_times))


def test_logsumexp_is_scipys_bit_for_bit():
    from scipy import special

    rng = np.random.default_rng(11)
    cases = []
    for n in (1, 2, 10, 4097):
        b = rng.exponential(size=n)
        cases += [(rng.normal(size=n) * 30, b), (np.arange(n) * 0.37, b), (np.arange(n) * -1e-3, b / b.sum())]
    zeros = np.zeros(5)
    cases += [(np.arange(5.0), zeros),  # every weight 0: -inf
              (np.array([0.0, 800.0, 800.0]), np.array([1.0, 2.0, 3.0])),  # a tie at the maximum
              (np.array([1e308, -1e308, 0.0]), np.array([1.0, 1.0, 0.0])),
              (np.array([-np.inf, 0.0]), np.array([1.0, 1.0])), (np.array([np.inf, 0.0]), np.array([1.0, 1.0])),
              (np.array([1.0, 2.0]), np.array([1e-320, 1e-320])), (np.array([3.0, 1.0]), np.array([0.0, -0.0]))]
    for a, b in cases:
        with np.errstate(all="ignore"):
            expected = special.logsumexp(a, b=b)
            got = module._logsumexp(a, b)
        assert np.float64(got).tobytes() == np.float64(expected).tobytes(), (a[:3], b[:3], got, expected)


def test_an_unverified_scipy_composes_with_the_library(monkeypatch):
    """self_compose's logsumexp reproduces one scipy release: with another, the library's own self_compose."""
    pld = gaussian_pld(1.0, sampling_prob=0.02, value_discretization_interval=1e-3)
    module._logsumexp_verified.cache_clear()
    monkeypatch.setattr(module.metadata, "version", lambda name: "99.0.0" if name == "scipy" else "0.6.0")
    calls = []
    monkeypatch.setattr(module, "_pmf_self_compose", lambda *a: calls.append(a))
    try:
        composed = module.self_compose(pld, 10)
    finally:
        module._logsumexp_verified.cache_clear()
    assert calls == [] and _fields(composed) == _fields(pld.self_compose(10))
