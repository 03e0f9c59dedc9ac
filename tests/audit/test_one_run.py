"""One-run audit bounds: Steinke et al.'s p-value against a naive transcription of the paper's Algorithm 3, the
bounds' coverage on mechanisms at exactly the audited privacy (simulated), the f-DP test against the Gaussian
closed forms and dp-accounting, and the Bonferroni-corrected audit."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy.stats import binom, norm

from lightning_dp.audit.one_run import (
    AccountedFamily,
    GaussianFamily,
    count_correct_guesses,
    default_guess_candidates,
    fdp_consistent,
    fdp_epsilon,
    gdp_epsilon,
    one_run_audit,
    steinke_epsilon,
    steinke_p_value,
    tradeoff_from_profile,
)
from lightning_dp.privacy.accounting import PLDAccountant


def _paper_p_value(m, r, v, eps, delta):
    """Steinke, Nasr & Jagielski 2023, Algorithm 3, transcribed loop by loop."""
    q = 1 / (1 + math.exp(-eps))
    beta = binom.sf(v - 1, r, q)
    alpha, total = 0.0, 0.0
    for i in range(1, v + 1):
        total += binom.pmf(v - i, r, q)
        if total > i * alpha:
            alpha = total / i
    return min(beta + alpha * delta * 2 * m, 1)


@pytest.mark.parametrize("m,r,v,eps,delta", [(1000, 100, 50, 0.0, 0.0), (1000, 100, 80, 1.0, 1e-5),
                                             (500, 40, 39, 2.5, 1e-3), (200, 200, 120, 0.3, 1e-6),
                                             (10, 4, 0, 1.0, 1e-2)])
def test_steinke_p_value_equals_the_papers_algorithm(m, r, v, eps, delta):
    assert steinke_p_value(m, r, v, eps, delta) == pytest.approx(_paper_p_value(m, r, v, eps, delta), rel=1e-10)


def test_steinke_epsilon_is_the_edge_of_rejection():
    m, r, v, delta, conf = 1000, 200, 170, 1e-5, 0.95
    eps = steinke_epsilon(m, r, v, delta=delta, confidence=conf)
    assert eps > 0
    assert steinke_p_value(m, r, v, eps, delta) < 0.05 <= steinke_p_value(m, r, v, eps + 1e-4, delta)
    assert steinke_epsilon(m, r, r // 2, delta=delta) == 0.0  # chance-level guesses refute nothing
    # a larger delta can only weaken the bound
    assert steinke_epsilon(m, r, v, delta=1e-3) <= eps


def test_steinke_bound_covers_randomized_response_at_the_audited_epsilon():
    """Randomized response at eps is the extremal eps-DP guesser: every guess is right with probability
    e^eps / (1 + e^eps). The 95 % bound may exceed eps in at most 5 % of the runs: over 400 runs the count is
    Binomial(400, <= 0.05); we allow 36 (the 0.9999 quantile of Binomial(400, 0.05) is 36; false failure < 1e-4)."""
    rng = np.random.default_rng(0)
    eps, m, r = 1.0, 1000, 100
    p = math.exp(eps) / (1 + math.exp(eps))
    exceed = sum(steinke_epsilon(m, r, int(rng.binomial(r, p)), delta=0.0) > eps for _ in range(400))
    assert exceed <= 36
    assert exceed >= 1  # and the bound is tight enough to reach eps sometimes


def test_gdp_epsilon_equals_dp_accountings_gaussian_mechanism():
    from dp_accounting.pld import privacy_loss_distribution

    for sigma in (0.5, 1.0, 2.0):
        pld = privacy_loss_distribution.from_gaussian_mechanism(standard_deviation=sigma,
                                                                value_discretization_interval=1e-4)
        assert gdp_epsilon(1 / sigma, 1e-5) == pytest.approx(pld.get_epsilon_for_delta(1e-5), rel=2e-3)


def test_the_profile_tradeoff_of_a_gaussian_is_below_and_close_to_the_closed_form():
    accountant = PLDAccountant(value_discretization_interval=1e-4)
    accountant.step(noise_multiplier=1.0, sample_rate=1.0)
    grid = np.linspace(0, 10, 501)
    f = tradeoff_from_profile(grid, accountant.privacy_profile(grid))
    for a in (1e-4, 1e-2, 0.1, 0.3, 0.5, 0.9):
        exact = norm.cdf(norm.ppf(1 - a) - 1.0)
        assert f(a) <= exact + 1e-9
        assert f(a) >= exact - 0.01


def test_fdp_test_rejects_a_gaussian_mechanism_at_its_own_mu_at_most_at_the_level():
    """Scores N(mu S_i, 1) make each canary's release exactly mu-GDP. The test at level 5 % may reject the true
    curve in at most 5 % of the runs: over 300 runs, at most 29 (0.9999 quantile of Binomial(300, 0.05))."""
    rng = np.random.default_rng(1)
    mu, m, k = 1.0, 400, 40
    blow = GaussianFamily().inverse_blow_up(1 / mu)
    rejected = 0
    for _ in range(300):
        included = rng.random(m) < 0.5
        r, v = count_correct_guesses(included * mu + rng.standard_normal(m), included, positives=k, negatives=k)
        rejected += not fdp_consistent(blow, m, r, v, confidence=0.95)
    assert rejected <= 29


def test_fdp_bounds_stay_below_the_truth_and_beat_steinke_on_gaussian_scores():
    rng = np.random.default_rng(2)
    mu, m = 2.0, 1000
    included = rng.random(m) < 0.5
    scores = included * mu + rng.standard_normal(m)
    result = one_run_audit(scores, included, delta=1e-5, methods=("steinke", "fdp_gaussian"))
    truth = gdp_epsilon(mu, 1e-5)
    assert 0 < result.epsilon["steinke"] < result.epsilon["fdp_gaussian"] < truth
    assert result.epsilon["fdp_gaussian"] > 0.3 * truth


def test_the_accounted_family_is_the_runs_mechanism_at_scale_one_and_monotone():
    history = [(1.2, 0.05, 200)]
    family = AccountedFamily(history)
    accountant = PLDAccountant()
    accountant.step(noise_multiplier=1.2, sample_rate=0.05, num_steps=200)
    # the reported epsilon of a member is dp-accounting's optimistic estimate at 3e-5: a lower bound, within 5 %
    assert accountant.get_epsilon(1e-5) * 0.95 <= family.epsilon(1.0, 1e-5) <= accountant.get_epsilon(1e-5)
    assert family.epsilon(0.5, 1e-5) > family.epsilon(1.0, 1e-5) > family.epsilon(2.0, 1e-5)
    strong, weak = family.inverse_blow_up(2.0), family.inverse_blow_up(0.5)
    for x in (0.01, 0.1, 0.5):  # a more private curve blows probabilities up less: B^-1 larger
        assert strong(x) >= weak(x)


def test_fdp_epsilon_edges():
    family = GaussianFamily()
    assert fdp_epsilon(1000, 100, 50, family, delta=1e-5) == (0.0, None)  # chance: nothing rejected
    eps, param = fdp_epsilon(1000, 500, 500, family, delta=1e-5)  # 500 of 500 right
    assert eps > 5 and param is not None


def test_guesses_and_candidates():
    assert count_correct_guesses([3, 2, 1, 0], [True, False, True, False], positives=2, negatives=1) == (3, 2)
    assert count_correct_guesses([1, 1, 1, 1], [False, True, True, True], positives=1) == (1, 0)  # ties by index
    with pytest.raises(ValueError, match="positives"):
        count_correct_guesses([1, 2], [True, False], positives=2, negatives=1)
    with pytest.raises(ValueError, match="finite"):
        count_correct_guesses([np.nan, 1], [True, False], positives=1)
    pairs = default_guess_candidates(1000)
    assert (10, 0) in pairs and (500, 500) in pairs and len(pairs) == len(set(pairs))
    assert all(p + n <= 10 for p, n in default_guess_candidates(10))


def test_one_run_audit_validates_and_bonferroni_makes_more_candidates_cost():
    rng = np.random.default_rng(3)
    included = rng.random(500) < 0.5
    scores = included * 3.0 + rng.standard_normal(500)
    one = one_run_audit(scores, included, delta=1e-5, candidates=[(50, 50)])
    many = one_run_audit(scores, included, delta=1e-5, candidates=[(50, 50)] + [(k, 0) for k in range(1, 20)])
    assert many.candidates[0].epsilon["steinke"] < one.epsilon["steinke"]
    assert "| 50 | 50 |" in one.table()
    with pytest.raises(ValueError, match="methods"):
        one_run_audit(scores, included, delta=1e-5, methods=("magic",))
    with pytest.raises(ValueError, match="accounted"):
        one_run_audit(scores, included, delta=1e-5, methods=("fdp_accounted",))
