"""Membership-inference statistics against closed forms: the AUC of two Gaussians, exact binomial bounds, and the
empirical epsilon of a Gaussian mechanism below (and near) its true epsilon."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy.stats import norm

from lightning_dp.audit.statistics import (
    clopper_pearson,
    empirical_epsilon,
    epsilon_lower_bound,
    roc,
    tpr_at_fpr,
)


def test_the_auc_of_two_gaussians_is_phi_of_mu_over_root_two():
    """200 000 samples a side: the AUC's standard error is below 0.001, the tolerance 0.004 is four of them."""
    rng = np.random.default_rng(0)
    for mu in (0.5, 1.0, 2.0):
        curve = roc(rng.normal(mu, 1, 200_000), rng.normal(0, 1, 200_000))
        assert curve.auc == pytest.approx(norm.cdf(mu / math.sqrt(2)), abs=0.004)
        # TPR at FPR f of the shifted Gaussian: 1 - Phi(Phi^-1(1 - f) - mu)
        assert tpr_at_fpr(curve, 0.01) == pytest.approx(1 - norm.cdf(norm.ppf(0.99) - mu), abs=0.01)


def test_clopper_pearson_matches_its_closed_forms_and_covers():
    n, alpha = 50, 0.05
    assert clopper_pearson(n, n, alpha)[0] == pytest.approx(alpha ** (1 / n))
    assert clopper_pearson(0, n, alpha)[1] == pytest.approx(1 - alpha ** (1 / n))
    low, high = clopper_pearson(20, n, alpha)
    assert low < 0.4 < high
    # coverage by simulation: the one-sided lower bound misses p = 0.3 at most alpha of the time (+3 SE)
    rng = np.random.default_rng(1)
    misses = sum(clopper_pearson(int(k), n, alpha)[0] > 0.3 for k in rng.binomial(n, 0.3, 2000))
    assert misses / 2000 <= alpha + 3 * math.sqrt(alpha * (1 - alpha) / 2000)


def test_the_empirical_epsilon_of_a_gaussian_mechanism_is_below_and_near_its_true_epsilon():
    """Scores of the Gaussian mechanism with sensitivity 1 and sigma 1 (the optimal test's statistic): members
    N(1, 1), non-members N(0, 1), 10^6 a side. The two-stage bound (threshold chosen on half, bounded on the other
    half) holds at 95 % and comes within 30 % of the true epsilon at delta 1e-3 (dp-accounting); the maximum over
    all thresholds of the same samples is optimistic and may exceed it (the reason for the two stages)."""
    from lightning_dp.audit.statistics import two_stage_epsilon
    from lightning_dp.privacy.local_dp import gaussian_epsilon

    true = gaussian_epsilon(1.0, 1e-3)
    rng = np.random.default_rng(2)
    members, nonmembers = rng.normal(1, 1, 1_000_000), rng.normal(0, 1, 1_000_000)
    result = two_stage_epsilon(members, nonmembers, delta=1e-3)
    assert 0.7 * true < result.epsilon <= true
    assert empirical_epsilon(members, nonmembers, delta=1e-3).epsilon >= result.epsilon


def test_no_leak_gives_no_epsilon_and_a_separating_attack_a_large_one():
    rng = np.random.default_rng(3)
    same = empirical_epsilon(rng.normal(0, 1, 20_000), rng.normal(0, 1, 20_000))
    assert same.epsilon < 0.1
    apart = empirical_epsilon(rng.normal(10, 1, 1000), rng.normal(0, 1, 1000), confidence=0.95)
    # perfectly separated: TPR_low = 0.025^(1/1000), FPR_high = 1 - 0.025^(1/1000)
    q = 0.025 ** (1 / 1000)
    assert apart.epsilon == pytest.approx(math.log(q / (1 - q)), rel=1e-9)


def test_a_given_threshold_is_used_as_is_and_bad_input_is_refused():
    result = empirical_epsilon([3.0, 2.0, 1.0], [0.0, 1.0], threshold=2.0)
    assert (result.threshold, result.tpr, result.fpr) == (2.0, 2 / 3, 0.0)
    assert result.epsilon == epsilon_lower_bound(2, 3, 0, 2)
    with pytest.raises(ValueError, match="members must be a non-empty array"):
        roc([], [1.0])
    with pytest.raises(ValueError, match="NaN or inf"):
        empirical_epsilon([float("nan")], [1.0])
    with pytest.raises(ValueError, match="confidence"):
        epsilon_lower_bound(1, 2, 0, 2, confidence=1.5)
