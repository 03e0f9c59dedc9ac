"""Local DP core: the sector's diameter against brute force, projections into the sector, Laplace noise,
Gaussian epsilon and the Gaussian ledger against dp-accounting."""

from __future__ import annotations

import math

import dp_accounting as dpa
import pytest
import torch
from scipy import stats

from lightning_dp.privacy.ledger import GaussianLedger, PrivacyLedger
from lightning_dp.privacy.local_dp import (
    check_sector,
    clip_l1,
    clip_l2,
    gaussian_epsilon,
    laplace_noise,
    project_to_sector,
    sector_diameter,
)
from tests.helpers import ACCELERATORS, DEVICE

SECTORS = [(1.0, 0.0, math.pi), (1.0, 0.5, math.pi), (1.0, 0.5, 0.0), (2.0, 0.3, 0.2), (1.0, 0.9, 0.5),
           (1.0, 0.2, 1.0), (1.0, 0.0, 0.7), (1.0, 0.6, math.pi / 2), (3.0, 2.9, 1.4)]


def _sector_points(n, dim, upper, lower, angle, g):
    """Points of the sector around e_0, half of them on its boundary (radius c or C, angle exactly a)."""
    r = torch.zeros(dim, dtype=torch.float64)
    r[0] = 1.0
    theta = torch.rand(n, generator=g, dtype=torch.float64) * angle
    theta[: n // 2] = angle
    ortho = torch.randn(n, dim, generator=g, dtype=torch.float64)
    ortho[:, 0] = 0
    ortho = ortho / ortho.norm(dim=1, keepdim=True)
    direction = torch.cos(theta)[:, None] * r + torch.sin(theta)[:, None] * ortho
    radius = lower + (upper - lower) * torch.rand(n, generator=g, dtype=torch.float64)
    radius[: n // 4] = upper
    radius[n // 4: n // 2] = lower
    return direction * radius[:, None]


@pytest.mark.parametrize("dim", [2, 3, 10])
@pytest.mark.parametrize("sector", SECTORS, ids=[f"C{c}_c{lo}_a{a:.2f}" for c, lo, a in SECTORS])
def test_sector_diameter_is_the_brute_force_maximum_over_sampled_pairs(sector, dim):
    """No sampled pair is farther apart than the formula (1e-12), and the farthest sampled pair comes close
    to it (within 2% in 2-3 dimensions, 10% in 10, where extremal pairs are rarer)."""
    upper, lower, angle = sector
    g = torch.Generator().manual_seed(dim)
    points = _sector_points(3000, dim, upper, lower, angle, g)
    found = float(torch.cdist(points, points).max())
    diameter = sector_diameter(upper, lower, angle)
    assert found <= diameter * (1 + 1e-12)
    assert found >= diameter * (0.98 if dim <= 3 else 0.9)


def test_sector_diameter_closed_cases():
    assert sector_diameter(1.0) == 2.0  # the ball
    assert sector_diameter(1.0, 0.7) == 2.0  # lower clipping alone buys nothing
    assert sector_diameter(1.0, 0.7, math.pi / 2) == 2.0  # nor an angle of pi / 2 or more
    assert sector_diameter(1.0, 0.25, 0.0) == 0.75  # a ray segment: C - c
    assert sector_diameter(2.0, 0.0, math.pi / 6) == pytest.approx(2.0)  # chord of 2a = 60 degrees: C
    with pytest.raises(ValueError, match=r"lower_clip=1.0 must be below clip=1.0"):
        check_sector(1.0, 1.0)
    with pytest.raises(ValueError, match=r"angle=4.0 is not allowed: pass an angle in \[0, pi\]"):
        check_sector(1.0, 0.0, 4.0)


@pytest.mark.parametrize("upper,lower,angle", [(1.0, 0.3, 0.4), (0.5, 0.0, 1.2), (2.0, 1.5, 0.05), (1.0, 0.2, math.pi)])
def test_projection_lands_strictly_inside_the_sector(upper, lower, angle):
    g = torch.Generator().manual_seed(0)
    ref = torch.randn(20, generator=g)
    deltas = [torch.randn(20, generator=g) * s for s in (0.01, 0.5, 1.0, 10.0) for _ in range(25)]
    deltas += [torch.zeros(20), -ref, -3 * ref, ref * 1e-9, ref * 100]
    for delta in deltas:
        for reference in (ref, None):
            v = project_to_sector(delta, reference, upper, lower, angle).double()
            norm = float(v.norm())
            assert lower <= norm <= upper, (norm, lower, upper)
            if reference is not None and angle < math.pi:
                cos = float(v @ ref.double() / (norm * ref.double().norm()))
                assert math.acos(min(1.0, cos)) <= angle + 1e-6


@pytest.mark.parametrize("accelerator", ACCELERATORS)
def test_a_zero_update_without_reference_goes_to_the_first_axis_at_the_lower_norm(accelerator):
    """The first round's zero update under a lower clip: along the first axis, on the update's device."""
    v = project_to_sector(torch.zeros(5, device=DEVICE[accelerator]), None, 1.0, 0.1)
    assert v.device.type == DEVICE[accelerator]
    assert v[1:].abs().max() == 0 and 0.1 < float(v[0]) < 1.0


def test_projection_keeps_what_is_already_inside_and_keeps_the_norm_when_rotating():
    ref = torch.tensor([1.0, 0.0, 0.0])
    inside = torch.tensor([0.5, 0.1, 0.0])
    assert torch.allclose(project_to_sector(inside, ref, 1.0, 0.2, 0.5), inside)
    outside = torch.tensor([0.0, 0.6, 0.0])  # 90 degrees off, norm 0.6
    rotated = project_to_sector(outside, ref, 1.0, 0.2, 0.5)
    assert float(rotated.norm()) == pytest.approx(0.6, rel=1e-5)
    assert float(torch.atan2(rotated[1], rotated[0])) == pytest.approx(0.5, rel=1e-5)


def test_l2_and_l1_clipping():
    v = torch.tensor([3.0, 4.0])
    assert float(clip_l2(v, 1.0).norm()) < 1.0 and float(clip_l2(v, 1.0).norm()) == pytest.approx(1.0, rel=1e-5)
    assert torch.equal(clip_l2(v, 10.0), v)
    assert float(clip_l1(v, 1.0).abs().sum()) < 1.0 and float(clip_l1(v, 1.0).abs().sum()) == pytest.approx(1.0, rel=1e-5)
    assert torch.equal(clip_l1(torch.zeros(3), 1.0), torch.zeros(3))


def test_laplace_noise_is_laplace_with_the_given_scale():
    """Kolmogorov-Smirnov against Laplace(0, 0.7) on 200 000 draws: p > 0.001 (a false alarm 1 run in 1000)."""
    draws = laplace_noise(200_000, 0.7, torch.Generator().manual_seed(3)).double().numpy()
    assert stats.kstest(draws, stats.laplace(scale=0.7).cdf).pvalue > 1e-3
    again = laplace_noise(10, 0.7, torch.Generator().manual_seed(3))
    assert torch.equal(again, laplace_noise(10, 0.7, torch.Generator().manual_seed(3)))


@pytest.mark.parametrize("multiplier", [0.5, 1.0, 3.0])
def test_gaussian_epsilon_is_the_library_value(multiplier):
    acc = dpa.pld.PLDAccountant()
    acc.compose(dpa.GaussianDpEvent(multiplier))
    assert gaussian_epsilon(multiplier, 1e-5) == pytest.approx(acc.get_epsilon(1e-5), rel=1e-9)
    assert gaussian_epsilon(math.inf, 1e-5) == 0.0
    for delta in (0.0, 1.0):
        with pytest.raises(ValueError, match="delta"):
            gaussian_epsilon(0.1, delta)  # both branches check delta (the analytic one returned 1e-9 at delta 1)


@pytest.mark.parametrize("multiplier", [5e-4, 0.01, 0.3, 0.4999])
def test_a_small_multipliers_epsilon_is_the_exact_analytic_one_never_below_it(multiplier):
    """PLD of one unsampled Gaussian needs memory like 1/multiplier^2 (301 GB at 5e-4): below 0.5 the analytic
    epsilon (Balle & Wang 2018; dp-accounting) plus 1e-9. Checked against the analytic delta(epsilon) of the
    Gaussian (Balle & Wang, Theorem 8) computed here with scipy: at our epsilon, delta is at most the target."""
    from scipy.stats import norm

    eps = gaussian_epsilon(multiplier, 1e-5)
    sensitivity_over_std = 1 / multiplier
    a = sensitivity_over_std
    delta_at = norm.cdf(a / 2 - eps / a) - math.exp(eps + norm.logcdf(-a / 2 - eps / a))
    assert delta_at <= 1e-5 * (1 + 1e-6)
    assert delta_at >= 1e-5 * (1 - 1e-3)  # tight: not a loose upper bound
    if multiplier > 0.25:  # where PLD is still affordable, the two agree
        acc = dpa.pld.PLDAccountant()
        acc.compose(dpa.GaussianDpEvent(multiplier))
        assert eps == pytest.approx(acc.get_epsilon(1e-5), rel=1e-7)


def test_gaussian_ledger_reports_the_exact_composition_of_its_releases():
    """Releases at multipliers 2, 3 and 6 compose into one Gaussian mechanism with multiplier
    (1/4 + 1/9 + 1/36)^(-1/2) = sqrt(36/14); the library composing the three events agrees (PLD, up to
    its discretization)."""
    ledger = GaussianLedger(delta=1e-5)
    for m in (2.0, 3.0, 6.0):
        ledger.charge("a", m**-2)
    ledger.charge("b", 0.25)
    acc = dpa.pld.PLDAccountant()
    acc.compose(dpa.ComposedDpEvent([dpa.GaussianDpEvent(2.0), dpa.GaussianDpEvent(3.0), dpa.GaussianDpEvent(6.0)]))
    assert ledger.spent("a") == pytest.approx(acc.get_epsilon(1e-5), rel=2e-3)
    assert ledger.spent("a") == pytest.approx(gaussian_epsilon((36 / 14) ** 0.5, 1e-5), rel=1e-9)
    assert ledger.max() == ledger.spent("a") and ledger.spent("b") < ledger.spent("a")
    assert ledger.median() == pytest.approx((ledger.spent("a") + ledger.spent("b")) / 2)
    assert ledger.would_exceed("b", 0.25, cap=ledger.spent("b") * 1.01)
    assert not ledger.would_exceed("b", 0.0, cap=ledger.spent("b") * 1.01)
    state = ledger.state_dict()
    again = GaussianLedger(delta=1e-5)
    again.load_state_dict(state)
    assert again.as_dict() == ledger.as_dict()
    with pytest.raises(ValueError, match="kind 'gaussian' but this one is 'additive'"):
        PrivacyLedger().load_state_dict(state)
    with pytest.raises(ValueError, match="delta=0.001"):
        GaussianLedger(delta=1e-3).load_state_dict(state)
