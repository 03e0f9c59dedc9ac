"""Tests of noise calibration: never above the target, never wastefully far below it."""

import itertools
import math

import pytest

from lightning_dp.privacy.accounting import get_accountant
from lightning_dp.privacy.calibration import (
    MAX_NOISE_MULTIPLIER,
    _bracket_and_bisect,
    calibrate_noise_multiplier,
    steps_for_epochs,
)

DELTA = 1e-5
TOLERANCE = 0.01
# The coarser PLD grid keeps the 16-point grid fast; the default grid is tested separately.
ACCOUNTANT_CONFIGS = [("pld", {"value_discretization_interval": 1e-3}), ("rdp", {})]
GRID = list(itertools.product([0.5, 1.0, 3.0, 8.0], [0.004, 0.05], [100, 1000]))


def _spend(name, config, sigma, sample_rate, steps):
    return get_accountant(name, **config).epsilon_after(
        DELTA, noise_multiplier=sigma, sample_rate=sample_rate, num_steps=steps
    )


def _check_calibrated(name, config, target_epsilon, sample_rate, steps, tolerance=TOLERANCE):
    sigma = calibrate_noise_multiplier(
        target_epsilon=target_epsilon,
        target_delta=DELTA,
        sample_rate=sample_rate,
        steps=steps,
        accountant=name,
        accountant_kwargs=config,
        tolerance=tolerance,
    )
    assert _spend(name, config, sigma, sample_rate, steps) <= target_epsilon
    assert _spend(name, config, sigma * (1 - 2 * tolerance), sample_rate, steps) > target_epsilon
    return sigma


@pytest.mark.parametrize(("name", "config"), ACCOUNTANT_CONFIGS, ids=["pld", "rdp"])
def test_calibration_grid_is_tight_and_never_above_target(name, config):
    sigmas = {}
    for target_epsilon, sample_rate, steps in GRID:
        sigmas[target_epsilon, sample_rate, steps] = _check_calibrated(name, config, target_epsilon, sample_rate, steps)
    # More budget needs less noise; more steps or a larger sampling rate need more.
    for (eps, q, steps), sigma in sigmas.items():
        if eps < 8.0:
            larger_budget = {0.5: 1.0, 1.0: 3.0, 3.0: 8.0}[eps]
            assert sigmas[larger_budget, q, steps] < sigma
        assert sigma < sigmas[eps, q, 1000] or steps == 1000
        assert sigma < sigmas[eps, 0.05, steps] or q == 0.05


@pytest.mark.parametrize("guess", [0.2, 1.0, 30.0, 5000.0])
@pytest.mark.parametrize("tolerance", [0.01, 0.2])
def test_bracket_and_bisect_on_a_known_curve(guess, tolerance):
    # spend(sigma) = 10 / sigma: the smallest sigma within target 0.5 is exactly 20.
    calls = []

    def spend(sigma):
        calls.append(sigma)
        return 10.0 / sigma

    sigma = _bracket_and_bisect(spend, 0.5, guess, tolerance, "test")
    assert spend(sigma) <= 0.5
    assert 20.0 <= sigma <= 20.0 * (1 + tolerance)
    assert len(calls) < 40


def test_calibration_with_default_pld_configuration():
    sigma = _check_calibrated("pld", {}, 1.0, 0.05, 1000)
    # PLD is tighter than RDP, so it needs no more noise than RDP for the same budget.
    rdp_sigma = calibrate_noise_multiplier(
        target_epsilon=1.0, target_delta=DELTA, sample_rate=0.05, steps=1000, accountant="rdp"
    )
    assert sigma <= rdp_sigma


def test_calibration_of_unsampled_gaussian_matches_closed_form():
    # One Gaussian release with q == 1: the tight (Balle & Wang 2018) sigma for eps = 1,
    # delta = 1e-5 is about 3.73; PLD reproduces it within the tolerance.
    sigma = _check_calibrated("pld", {"value_discretization_interval": 1e-3}, 1.0, 1.0, 1)
    assert sigma == pytest.approx(3.73, rel=0.03)


def test_coarser_tolerance_is_respected():
    _check_calibrated("rdp", {}, 2.0, 0.01, 500, tolerance=0.1)


def test_unreachable_target_raises():
    with pytest.raises(ValueError, match=rf"unreachable.*noise_multiplier={MAX_NOISE_MULTIPLIER:g}"):
        calibrate_noise_multiplier(
            target_epsilon=1e-4, target_delta=DELTA, sample_rate=1.0, steps=1000, accountant="rdp"
        )
    with pytest.raises(ValueError, match="unreachable"):
        calibrate_noise_multiplier(
            target_epsilon=1e-4,
            target_delta=DELTA,
            sample_rate=1.0,
            steps=1000,
            accountant="pld",
            accountant_kwargs={"value_discretization_interval": 1e-3},
        )


def test_too_loose_target_raises():
    with pytest.raises(ValueError, match="too loose"):
        calibrate_noise_multiplier(target_epsilon=1e6, target_delta=DELTA, sample_rate=0.01, steps=10, accountant="rdp")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"target_epsilon": 0.0}, r"target_epsilon must be a number > 0, got 0\.0"),
        ({"target_epsilon": -1.0}, "target_epsilon"),
        ({"target_epsilon": math.inf}, "target_epsilon must be finite"),
        ({"target_delta": 0.0}, r"target_delta must be a number in \(0, 1\)"),
        ({"target_delta": 1.0}, "target_delta"),
        ({"sample_rate": 0.0}, r"sample_rate must be a number in \(0, 1\]"),
        ({"sample_rate": 1.01}, "sample_rate"),
        ({"steps": 0}, r"steps must be an integer >= 1, got 0"),
        ({"steps": 10.0}, "steps"),
        ({"tolerance": 0.0}, r"tolerance must be a number in \(0, 1\)"),
        ({"tolerance": 1.0}, "tolerance"),
        ({"accountant": "moments"}, r"accountant='moments' is not a registered accountant; choose one of "
                                    r"\['pld', 'rdp'\]"),
        ({"accountant_kwargs": {"value_discretization_interval": -1.0}}, "value_discretization_interval"),
        ({"accountant_kwargs": [1e-3]}, "accountant_kwargs must be a dict"),
    ],
)
def test_bad_inputs_raise(kwargs, message):
    arguments = {"target_epsilon": 1.0, "target_delta": DELTA, "sample_rate": 0.01, "steps": 100, **kwargs}
    with pytest.raises(ValueError, match=message):
        calibrate_noise_multiplier(**arguments)


@pytest.mark.parametrize(
    ("epochs", "sample_rate", "expected"),
    [(1, 0.01, 100), (3, 256 / 60000, 3 * 235), (2, 1.0, 2), (1, 0.3, 4), (5, 1 / 3, 15), (1, 0.004, 250)],
)
def test_steps_for_epochs(epochs, sample_rate, expected):
    assert steps_for_epochs(epochs=epochs, sample_rate=sample_rate) == expected


@pytest.mark.parametrize(("kwargs", "message"), [({"epochs": 0}, "epochs"), ({"sample_rate": 0.0}, "sample_rate")])
def test_steps_for_epochs_rejects_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        steps_for_epochs(**{"epochs": 1, "sample_rate": 0.01, **kwargs})


# ------------------------------------------------------------------ grid budgets (composition of K runs)


def _composed_spend(runs, sigma, accountant="pld", delta=1e-5):
    """Reference: dp-accounting's PLD accountant composing every run's events directly."""
    import dp_accounting as dpa

    if accountant == "pld":
        acc = dpa.pld.PLDAccountant(value_discretization_interval=1e-4)
    else:
        acc = dpa.rdp.RdpAccountant()
    for q, steps, *scale in runs:
        s = sigma * (scale[0] if scale else 1.0)
        acc.compose(dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(s)), steps))
    return acc.get_epsilon(delta)


@pytest.mark.parametrize("accountant", ["rdp", "pld"])
def test_grid_of_identical_runs_composes_to_the_budget_and_not_wastefully_below(accountant):
    from lightning_dp.privacy.calibration import calibrate_composed_noise_multiplier

    runs = [(0.02, 150)] * 6
    sigma = calibrate_composed_noise_multiplier(target_epsilon=2.0, target_delta=1e-5, runs=runs,
                                                accountant=accountant)
    assert _composed_spend(runs, sigma, accountant) <= 2.0 * (1 + 1e-3)  # independent reference, its own grid
    assert get_accountant(accountant).epsilon_after(1e-5, noise_multiplier=sigma, sample_rate=0.02,
                                                    num_steps=900) <= 2.0
    assert get_accountant(accountant).epsilon_after(1e-5, noise_multiplier=sigma / 1.01, sample_rate=0.02,
                                                    num_steps=900) > 2.0  # not wastefully below
    one_run = calibrate_noise_multiplier(target_epsilon=2.0, target_delta=1e-5, sample_rate=0.02, steps=900,
                                         accountant=accountant)
    assert sigma == pytest.approx(one_run, rel=0.011)
    # dividing the budget (basic composition) would need much more noise for the same guarantee
    divided = calibrate_noise_multiplier(target_epsilon=2.0 / 6, target_delta=1e-5 / 6, sample_rate=0.02, steps=150,
                                         accountant=accountant)
    assert divided > 1.3 * sigma


def test_grid_of_different_runs_composes_every_event():
    from lightning_dp.privacy.calibration import calibrate_composed_noise_multiplier

    runs = [(0.01, 300), (0.05, 40), (1.0, 3, 0.5)]  # the last: 3 shuffled epochs, replacement adjacency
    sigma = calibrate_composed_noise_multiplier(target_epsilon=4.0, target_delta=1e-5, runs=runs, accountant="rdp")
    assert _composed_spend(runs, sigma, "rdp") <= 4.0 < _composed_spend(runs, sigma / 1.01, "rdp")


@pytest.mark.parametrize("runs, match", [
    ([], "one \\(sample_rate, steps"),
    ([(0.1,)], "is not a \\(sample_rate"),
    ([(0.1, 10, 2.0)], "multiplier_scale=2.0"),
    ([(1.5, 10)], "sample_rate"),
    ([(0.1, 0)], "steps"),
])
def test_grid_calibration_errors(runs, match):
    from lightning_dp.privacy.calibration import calibrate_composed_noise_multiplier

    with pytest.raises(ValueError, match=match):
        calibrate_composed_noise_multiplier(target_epsilon=1.0, target_delta=1e-5, runs=runs)


def test_the_readme_calibration_takes_few_evaluations_and_is_cached(monkeypatch):
    """Item 4 of issue 26: the README job's calibration (epsilon 3, q = 64/1,257, 600 steps, PLD) brackets from
    the Gaussian-DP guess in a handful of accountant evaluations, and a second one in the process costs none
    (its time, 0.28 s on an idle machine, is in docs/benchmarks.md; tests do not assert times)."""
    from lightning_dp.privacy import calibration

    calls = []
    real = calibration._spend
    monkeypatch.setattr(calibration, "_spend", lambda *a, **k: calls.append(a) or real(*a, **k))
    monkeypatch.setattr(calibration, "_CALIBRATION_CACHE", {})
    args = dict(target_epsilon=3.0, target_delta=1e-5, sample_rate=64 / 1257, steps=600)
    sigma = calibrate_noise_multiplier(**args)
    assert 1 <= len(calls) <= 8, len(calls)
    reference = get_accountant("pld")
    reference.step(noise_multiplier=sigma, sample_rate=64 / 1257, num_steps=600)
    assert reference.get_epsilon(1e-5) <= 3.0
    calls.clear()
    assert calibrate_noise_multiplier(**args) == sigma and calls == []
