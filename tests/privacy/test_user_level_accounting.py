"""User-level spends (issue 51): the ELS mixture of Gaussians and group privacy, against independent references.

The references are built here, not through the code under test: dp_accounting's own PLD accountant composing
``MixtureOfGaussiansDpEvent``/``GaussianDpEvent`` events written out by hand, and the Gaussian mechanism's closed-form
privacy profile (Balle & Wang 2018) with a brute-force scan for group privacy.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from dp_accounting import dp_event
from dp_accounting.pld import pld_privacy_accountant
from scipy import stats

from lightning_dp.privacy.accounting import PLDAccountant, get_accountant, group_epsilon
from lightning_dp.privacy.calibration import calibrate_noise_multiplier

COARSE = 1e-3  # the mixture's PLD takes ~2 s to build at 1e-3 and ~20 s at the default 1e-4


def _library_epsilon(events, delta: float, interval: float = COARSE) -> float:
    accountant = pld_privacy_accountant.PLDAccountant(value_discretization_interval=interval)
    for event in events:
        accountant.compose(event)
    return float(accountant.get_epsilon(delta))


def _mixture(sigma: float, k: int, q: float) -> dp_event.MixtureOfGaussiansDpEvent:
    """The ELS event of one step, written out: j of the user's k records sampled, j ~ Binomial(k, q)."""
    return dp_event.MixtureOfGaussiansDpEvent(sigma, list(range(k + 1)), list(stats.binom.pmf(range(k + 1), k, q)))


@pytest.mark.parametrize(("k", "q", "sigma", "steps"), [(1, 0.02, 1.0, 50), (3, 0.02, 1.5, 80), (6, 0.01, 2.0, 100)])
def test_els_epsilon_is_dp_accountings_mixture_of_gaussians(k, q, sigma, steps):
    ours = PLDAccountant(value_discretization_interval=COARSE, examples_per_user=k)
    ours.step(noise_multiplier=sigma, sample_rate=q, num_steps=steps)
    reference = _library_epsilon([dp_event.SelfComposedDpEvent(_mixture(sigma, k, q), steps)], 1e-5)
    assert ours.get_epsilon(1e-5) == pytest.approx(reference, rel=1e-9)
    assert ours.privacy_unit == "user" and ours.unit_key() == ("user", k, "mixture", "add_remove")


def test_a_history_of_several_rates_composes_as_the_library_composes_their_events():
    ours = PLDAccountant(value_discretization_interval=COARSE, examples_per_user=2)
    ours.step(noise_multiplier=1.2, sample_rate=0.02, num_steps=30)
    ours.step(noise_multiplier=1.2, sample_rate=0.04, num_steps=20)
    ours.step(noise_multiplier=3.0, sample_rate=1.0, num_steps=2)  # a full batch: sensitivity k, noise sigma
    reference = _library_epsilon([dp_event.SelfComposedDpEvent(_mixture(1.2, 2, 0.02), 30),
                                  dp_event.SelfComposedDpEvent(_mixture(1.2, 2, 0.04), 20),
                                  dp_event.SelfComposedDpEvent(dp_event.GaussianDpEvent(3.0 / 2), 2)], 1e-6)
    assert ours.get_epsilon(1e-6) == pytest.approx(reference, rel=1e-6)


def test_the_user_level_spend_grows_with_k_and_equals_the_example_level_one_at_k_1():
    def epsilon(k=None, how="mixture"):
        accountant = PLDAccountant(value_discretization_interval=COARSE, examples_per_user=k, user_accounting=how)
        accountant.step(noise_multiplier=1.5, sample_rate=0.02, num_steps=100)
        return accountant.get_epsilon(1e-5)

    example = epsilon()
    assert epsilon(1) == pytest.approx(example, rel=1e-6)
    mixtures = [epsilon(k) for k in (1, 2, 4)]
    assert mixtures == sorted(mixtures) and mixtures[-1] > 2 * example
    for k, mixture in zip((2, 4), mixtures[1:]):
        assert mixture < epsilon(k, "group")  # the mixture is the tighter statement of the same mechanism


def _gaussian_delta(epsilons, sigma: float) -> list[float]:
    """The Gaussian mechanism's exact profile, sensitivity 1, std sigma (Balle & Wang 2018, Theorem 8)."""
    e = np.asarray(epsilons, float)
    return list(stats.norm.cdf(0.5 / sigma - e * sigma) - np.exp(e) * stats.norm.cdf(-0.5 / sigma - e * sigma))


@pytest.mark.parametrize(("k", "sigma", "delta"), [(1, 2.0, 1e-5), (2, 2.0, 1e-5), (4, 4.0, 1e-6), (8, 8.0, 1e-5)])
def test_group_epsilon_is_the_smallest_that_meets_delta_on_a_fine_scan(k, sigma, delta):
    found = group_epsilon(lambda eps: _gaussian_delta(eps, sigma), k, delta)
    scan = np.linspace(1e-4, 20, 400_001)  # brute force: 5e-5 steps
    group_delta = k * np.exp((k - 1) * scan) * np.asarray(_gaussian_delta(scan, sigma))
    smallest = k * scan[np.argmax(group_delta <= delta)]
    assert k * np.exp((k - 1) * found / k) * _gaussian_delta([found / k], sigma)[0] <= delta * (1 + 1e-9)
    assert found == pytest.approx(smallest, abs=k * 5e-5)


def test_group_privacy_of_the_accountant_converts_its_example_level_profile():
    accountant = PLDAccountant(value_discretization_interval=COARSE, examples_per_user=3, user_accounting="group")
    example = PLDAccountant(value_discretization_interval=COARSE)
    for a in (accountant, example):
        a.step(noise_multiplier=1.0, sample_rate=0.05, num_steps=40)
    pld = example._composed_pld(tuple(example.history))  # noqa: SLF001
    assert accountant.get_epsilon(1e-5) == group_epsilon(pld.get_delta_for_epsilon, 3, 1e-5)
    eps = accountant.get_epsilon(1e-5) / 3
    assert 3 * math.exp(2 * eps) * pld.get_delta_for_epsilon(eps) <= 1e-5
    with pytest.raises(ValueError, match="group-privacy spend has no dp_accounting event"):
        accountant.to_dp_event()


def test_calibration_meets_a_user_level_target():
    kwargs = {"value_discretization_interval": COARSE, "examples_per_user": 4}
    sigma = calibrate_noise_multiplier(target_epsilon=4.0, target_delta=1e-5, sample_rate=0.02, steps=60,
                                       accountant="pld", accountant_kwargs=kwargs)
    accountant = get_accountant("pld", **kwargs)
    accountant.step(noise_multiplier=sigma, sample_rate=0.02, num_steps=60)
    assert 3.9 < accountant.get_epsilon(1e-5) <= 4.0
    reference = _library_epsilon([dp_event.SelfComposedDpEvent(_mixture(sigma, 4, 0.02), 60)], 1e-5)
    assert accountant.get_epsilon(1e-5) == pytest.approx(reference, rel=1e-9)


def test_what_a_user_level_accountant_refuses():
    with pytest.raises(ValueError, match="accountant='pld' for a user-level spend"):
        get_accountant("rdp", examples_per_user=3)
    with pytest.raises(ValueError, match="adjacency='replace' is not supported"):
        PLDAccountant(adjacency="replace", examples_per_user=3)
    with pytest.raises(ValueError, match="examples_per_user=0 is not allowed"):
        PLDAccountant(examples_per_user=0)
    with pytest.raises(ValueError, match="user_accounting='groups' is not allowed"):
        PLDAccountant(examples_per_user=2, user_accounting="groups")


def test_a_history_resumes_only_into_the_unit_it_was_accounted_at():
    user = PLDAccountant(value_discretization_interval=COARSE, examples_per_user=2)
    user.step(noise_multiplier=2.0, sample_rate=0.1, num_steps=3)
    state = user.state_dict()
    assert state["examples_per_user"] == 2 and state["user_accounting"] == "mixture"
    again = PLDAccountant(value_discretization_interval=COARSE, examples_per_user=2)
    again.load_state_dict(state)
    assert again.get_epsilon(1e-5) == user.get_epsilon(1e-5)
    for other in (PLDAccountant(), PLDAccountant(examples_per_user=3),
                  PLDAccountant(examples_per_user=2, user_accounting="group")):
        with pytest.raises(ValueError, match="change meaning mid-run"):
            other.load_state_dict(state)
    with pytest.raises(ValueError, match="change meaning mid-run"):
        again.load_state_dict(PLDAccountant().state_dict())
    assert "examples_per_user" not in PLDAccountant().state_dict()  # example-level states as before
