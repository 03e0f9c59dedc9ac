"""One-run audit bounds: Steinke et al.'s p-value against a naive transcription of the paper's Algorithm 3, the
bounds' coverage on mechanisms at exactly the audited privacy (simulated), the f-DP test against the Gaussian
closed forms and dp-accounting, the Bonferroni-corrected audit, and its ceiling (the bound of a perfect guesser)
against the closed form and the paper's algorithm."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy.stats import binom, norm

from lightning_dp.audit.one_run import (
    AccountedFamily,
    GaussianFamily,
    OneRunCeiling,
    count_correct_guesses,
    default_guess_candidates,
    epsilon_ceiling,
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


# ------------------------------------------------------------------------------------------- the ceiling
def _paper_ceiling(m, r, delta, level):
    """Steinke et al.'s bound for r correct of r guesses, solved independently: the eps where the transcribed
    Algorithm 3 p-value crosses 1 - level (brentq on the transcription, not our bisection)."""
    from scipy.optimize import brentq

    tau = 1 - level
    return brentq(lambda eps: _paper_p_value(m, r, r, eps, delta) - tau, 1e-6, 50.0, xtol=1e-9)


def test_steinke_ceiling_equals_the_closed_form_and_the_papers_algorithm():
    m = 1000
    pairs = default_guess_candidates(m)
    tau = 0.05 / len(pairs)  # 12 candidates, Bonferroni
    # delta = 0: r correct of r guesses is rejected at eps iff q^r < tau, q = e^eps / (1 + e^eps), so the bound is
    # logit(tau^(1/r)), largest for the most guesses (r = m with the (500, 500) candidate)
    closed = max(math.log(tau ** (1 / r) / (1 - tau ** (1 / r))) for r in {p + n for p, n in pairs})
    assert epsilon_ceiling(m, delta=0.0).epsilon["steinke"] == pytest.approx(closed, abs=1e-5)
    # delta = 1e-5 (the MNIST audits of docs/results_mia.md): the paper's algorithm, solved by brentq, and the
    # value ~5.1 the docs state
    ceiling = epsilon_ceiling(m, delta=1e-5).epsilon["steinke"]
    paper = max(_paper_ceiling(m, p + n, 1e-5, 1 - tau) for p, n in pairs)
    assert ceiling == pytest.approx(paper, abs=1e-5)
    assert round(ceiling, 1) == 5.1


def test_ceilings_grow_with_the_number_of_canaries_while_2_m_delta_is_small():
    sizes = (50, 100, 200, 400)
    for delta, methods in ((0.0, ("steinke",)), (1e-5, ("steinke", "fdp_gaussian"))):  # mu-GDP needs delta > 0
        values = [epsilon_ceiling(m, delta=delta, methods=methods).epsilon for m in sizes]
        for name in methods:
            series = [v[name] for v in values]
            assert all(a < b for a, b in zip(series, series[1:])), (name, delta, series)
    # Steinke et al.'s delta term 2 m delta alpha grows with m: at delta 1e-5 their ceiling peaks near 5.7
    # (about 3,000 canaries) and falls after, while at delta 0 it keeps growing
    steinke = {m: epsilon_ceiling(m, delta=1e-5).epsilon["steinke"] for m in (1000, 3000, 10_000)}
    assert steinke[1000] < steinke[3000] and steinke[10_000] < steinke[3000] < 5.8
    assert epsilon_ceiling(10_000, delta=0.0).epsilon["steinke"] > epsilon_ceiling(3000, delta=0.0).epsilon["steinke"]


def test_every_bound_is_at_most_the_ceiling():
    m, delta = 60, 1e-3
    pairs = default_guess_candidates(m)
    level = 1 - 0.05 / len(pairs)
    ceiling = epsilon_ceiling(m, delta=delta, methods=("steinke", "fdp_gaussian"))
    family = GaussianFamily()
    for k_pos, k_neg in pairs:  # every outcome v of every candidate
        r = k_pos + k_neg
        for v in range(r + 1):
            assert steinke_epsilon(m, r, v, delta=delta, confidence=level) <= ceiling.epsilon["steinke"]
        for v in sorted({0, r // 2, (3 * r) // 4, r - 1, r} - {-1}):
            assert fdp_epsilon(m, r, v, family, delta=delta, confidence=level)[0] <= ceiling.epsilon["fdp_gaussian"]
    rng = np.random.default_rng(4)
    for strength in (0.5, 2.0, 8.0):  # simulated audits, weak to nearly perfect
        included = rng.random(m) < 0.5
        result = one_run_audit(included * strength + rng.standard_normal(m), included, delta=delta,
                               methods=("steinke", "fdp_gaussian"))
        assert result.ceiling == ceiling
        for name in ("steinke", "fdp_gaussian"):
            assert result.epsilon[name] <= ceiling.epsilon[name]


def test_a_perfect_attack_reaches_the_ceiling_with_every_method():
    m = 200
    included = np.zeros(m, dtype=bool)
    included[np.random.default_rng(5).permutation(m)[: m // 2]] = True  # 100 in, 100 out: every candidate fits
    family = AccountedFamily([(1.0, 1.0, 1)])  # one Gaussian mechanism: cheap curves
    result = one_run_audit(included.astype(float), included, delta=1e-5, accounted=family,
                           methods=("steinke", "fdp_gaussian", "fdp_accounted"))
    assert all(c.correct == c.guesses for c in result.candidates)
    ceiling = epsilon_ceiling(m, delta=1e-5, accounted=family, methods=("steinke", "fdp_gaussian", "fdp_accounted"))
    assert result.ceiling == ceiling
    assert result.epsilon == ceiling.epsilon  # the same functions on the same outcome: equal, not close
    assert ceiling.params["fdp_accounted"] is not None
    assert ceiling.params["fdp_accounted"] == min(v for k, v in result.params.items()
                                                  if k.startswith("fdp_accounted/") and v is not None)
    assert "| ceiling: every guess correct |" in result.table()


def test_a_claim_above_the_ceiling_cannot_be_refuted():
    ceiling = epsilon_ceiling(1000, delta=1e-5)
    assert ceiling.claim_above(8.0) == {"steinke": True}  # the MNIST audits at epsilon 8 (docs/results_mia.md)
    assert ceiling.claim_above(1.0) == {"steinke": False}
    assert ceiling.claim_above(ceiling.epsilon["steinke"]) == {"steinke": True}  # refuting needs bound > claim
    assert ceiling.claim_above(math.inf) == {"steinke": True}
    # one Gaussian mechanism with sigma 1 (epsilon 4.4 at 1e-5) audited with 100 canaries: Steinke et al.'s ceiling
    # (2.87) is below the claim, but a perfect guesser rejects the claimed curve itself (scale <= 1): the f-DP test
    # could refute it
    family = AccountedFamily([(1.0, 1.0, 1)])
    both = epsilon_ceiling(100, delta=1e-5, methods=("steinke", "fdp_gaussian", "fdp_accounted"), accounted=family)
    claim = family.epsilon(1.0, 1e-5)
    assert both.epsilon["steinke"] < claim < both.epsilon["fdp_accounted"]
    assert both.params["fdp_accounted"] <= 1.0
    assert both.claim_above(claim) == {"steinke": True, "fdp_accounted": False}  # mu-GDP refutes nothing: absent
    # the f-DP test compares curves: a perfect guesser that rejects no curve (None) or none at scale <= 1 cannot refute
    nothing = OneRunCeiling({"fdp_accounted": 0.0}, {"fdp_accounted": None}, 10)
    assert nothing.claim_above(0.1) == {"fdp_accounted": True}
    assert OneRunCeiling({"fdp_accounted": 2.0}, {"fdp_accounted": 1.5}, 10).claim_above(9.0) == {"fdp_accounted": True}
    with pytest.raises(ValueError, match="at most m=10"):
        epsilon_ceiling(10, delta=1e-5, candidates=[(6, 6)])
    with pytest.raises(ValueError, match="m=0"):
        epsilon_ceiling(0, delta=1e-5)
