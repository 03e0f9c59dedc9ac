"""Tests of the adaptive clipping rules: every formula against an independent reference.

References: hand-computed numbers, naive per-example loops, Google's ``dp_accounting``
(RDP and PLD) and a direct numerical integration of the privacy curve of the
two-dimensional subsampled Gaussian mechanism.
"""

import math

import numpy as np
import pytest
import torch
from dp_accounting import dp_event
from dp_accounting.pld import PLDAccountant as LibraryPLDAccountant
from dp_accounting.rdp import RdpAccountant as LibraryRdpAccountant

from lightning_dp.privacy.adaptive import (
    OSO_CLIP_LR,
    OSO_INITIAL_CLIP,
    OSO_LR_LR,
    OSO_Q_NOISE_RATIO,
    composed_noise_multiplier,
    count_unclipped,
    default_count_noise_std,
    oso_noise_split,
    oso_noisy_q_sum,
    oso_statistics,
    oso_update,
    quantile_clip_update,
    quantile_noise_split,
)
from lightning_dp.privacy.noise import gaussian_noise

DELTA = 1e-5


def _gaussian(sigma):
    return dp_event.GaussianDpEvent(sigma)


# --------------------------------------------------------------------------- noise splits


@pytest.mark.parametrize("nu", [0.3, 1.0, 2.5, 10.0])
def test_oso_default_split_gives_one_percent_more_gradient_noise(nu):
    nu_g, nu_q = oso_noise_split(nu)
    assert nu_q == pytest.approx(7.124 * nu, rel=1e-15)
    assert nu_g / nu == pytest.approx(1.01, rel=1e-3)
    assert composed_noise_multiplier(nu_g, nu_q) == pytest.approx(nu, rel=1e-12)


@pytest.mark.parametrize(("nu", "nu_q"), [(1.0, 1.5), (1.0, 100.0), (3.0, 3.000001), (0.5, 2.0)])
def test_oso_explicit_split_composes_back(nu, nu_q):
    nu_g, returned_q = oso_noise_split(nu, q_noise_multiplier=nu_q)
    assert returned_q == nu_q
    assert nu_g > nu
    assert composed_noise_multiplier(nu_g, nu_q) == pytest.approx(nu, rel=1e-12)
    # the defining formula, written out
    assert nu_g == pytest.approx(1.0 / math.sqrt(1.0 / nu**2 - 1.0 / nu_q**2), rel=1e-12)


def test_oso_split_hand_computed():
    nu_g, nu_q = oso_noise_split(2.0, q_noise_multiplier=4.0)
    assert nu_g == pytest.approx(1.0 / math.sqrt(0.25 - 0.0625), rel=1e-15)  # 2.3094...
    assert nu_q == 4.0


@pytest.mark.parametrize("nu_q", [1.0, 0.5])
def test_oso_split_rejects_q_multiplier_not_above_total(nu_q):
    with pytest.raises(ValueError, match=r"q_noise_multiplier=.* must be larger than noise_multiplier") as info:
        oso_noise_split(1.0, q_noise_multiplier=nu_q)
    assert "none for the gradient" in str(info.value)


@pytest.mark.parametrize("bad", [0.0, -1.0, math.nan, math.inf, True, "1.0"])
def test_oso_split_rejects_bad_noise_multiplier(bad):
    with pytest.raises(ValueError, match="noise_multiplier"):
        oso_noise_split(bad)


@pytest.mark.parametrize("bad", [0.0, -2.0, math.nan, math.inf])
def test_oso_split_rejects_bad_q_noise_multiplier(bad):
    with pytest.raises(ValueError, match="q_noise_multiplier"):
        oso_noise_split(1.0, q_noise_multiplier=bad)


def test_composed_noise_multiplier_reference_values():
    assert composed_noise_multiplier(1.7) == 1.7
    assert composed_noise_multiplier(2.0, 2.0) == pytest.approx(math.sqrt(2.0), rel=1e-15)
    assert composed_noise_multiplier(3.0, 4.0) == pytest.approx(12.0 / 5.0, rel=1e-15)  # 1/9 + 1/16 = 25/144
    # associative: composing in stages gives the same multiplier
    assert composed_noise_multiplier(1.0, 2.0, 3.0) == pytest.approx(
        composed_noise_multiplier(composed_noise_multiplier(1.0, 2.0), 3.0), rel=1e-14)


def test_composed_noise_multiplier_is_the_inverse_norm_of_the_stacked_sensitivity():
    # Releases (sum of clipped / (nu_g C), sum of q / nu_q) with unit noise: the worst-case
    # example moves the stacked mean by (C / (nu_g C), 1 / nu_q); its norm is 1 / nu.
    clip, nu_g, nu_q = 0.37, 1.3, 4.0
    shift = torch.tensor([clip / (nu_g * clip), 1.0 / nu_q], dtype=torch.float64)
    assert 1.0 / shift.norm().item() == pytest.approx(composed_noise_multiplier(nu_g, nu_q), rel=1e-14)


def test_composed_noise_multiplier_rejects_bad_input():
    with pytest.raises(ValueError, match="at least one"):
        composed_noise_multiplier()
    with pytest.raises(ValueError, match="noise_multiplier"):
        composed_noise_multiplier(1.0, 0.0)


@pytest.mark.parametrize(("z", "sigma_b"), [(1.0, 12.8), (1.0, 0.51), (4.0, 3.0), (0.7, 100.0)])
def test_quantile_split_composes_back(z, sigma_b):
    z_delta = quantile_noise_split(z, count_noise_std=sigma_b)
    assert z_delta > z
    assert composed_noise_multiplier(z_delta, 2 * sigma_b) == pytest.approx(z, rel=1e-12)
    assert z_delta == pytest.approx((z**-2 - (2 * sigma_b) ** -2) ** -0.5, rel=1e-15)


def test_quantile_split_with_the_paper_default():
    sigma_b = default_count_noise_std(256)
    assert sigma_b == 12.8
    # 1 - 1/25.6^2 = 0.998474121..., z_Delta = 1.000763...
    assert quantile_noise_split(1.0, count_noise_std=sigma_b) == pytest.approx(1 / math.sqrt(1 - 1 / 655.36), rel=1e-15)


@pytest.mark.parametrize(("z", "sigma_b"), [(1.0, 0.5), (2.0, 0.9), (10.0, 1.0)])
def test_quantile_split_rejects_count_noise_too_small(z, sigma_b):
    with pytest.raises(ValueError, match=r"must be smaller than 2 \* count_noise_std") as info:
        quantile_noise_split(z, count_noise_std=sigma_b)
    assert "Increase count_noise_std" in str(info.value)


@pytest.mark.parametrize("bad", [0.0, -1.0, math.nan, math.inf])
def test_quantile_split_rejects_bad_count_noise_std(bad):
    with pytest.raises(ValueError, match="count_noise_std"):
        quantile_noise_split(1.0, count_noise_std=bad)


def test_default_count_noise_std():
    assert default_count_noise_std(64) == 3.2
    assert default_count_noise_std(20.0) == 1.0
    with pytest.raises(ValueError, match="expected_batch_size"):
        default_count_noise_std(0)


# --------------------------------------------------------------------------- accounting equivalence


SPLITS = {
    "oso_default": lambda: (1.0, oso_noise_split(1.0)),
    "oso_even": lambda: (2.0, oso_noise_split(2.0, q_noise_multiplier=2.0 * math.sqrt(2.0))),
    "quantile": lambda: (1.0, (quantile_noise_split(1.0, count_noise_std=3.2), 6.4)),
}


@pytest.mark.parametrize("split", list(SPLITS))
@pytest.mark.parametrize("steps", [1, 50])
def test_unsampled_rdp_of_two_releases_equals_one_gaussian(split, steps):
    # q = 1: RDP adds a / (2 nu_k^2) per release, so the composition IS the Gaussian with nu.
    nu, (nu_a, nu_b) = SPLITS[split]()
    pair = dp_event.ComposedDpEvent([_gaussian(nu_a), _gaussian(nu_b)])
    composed = LibraryRdpAccountant().compose(dp_event.SelfComposedDpEvent(pair, steps)).get_epsilon(DELTA)
    single = LibraryRdpAccountant().compose(dp_event.SelfComposedDpEvent(_gaussian(nu), steps)).get_epsilon(DELTA)
    assert composed == pytest.approx(single, rel=1e-9)


@pytest.mark.parametrize("split", ["oso_default", "quantile"])
def test_unsampled_pld_of_two_releases_equals_one_gaussian(split):
    # The PLD library discretizes each release before composing, so agreement is up to the grid.
    nu, (nu_a, nu_b) = SPLITS[split]()
    pair = dp_event.ComposedDpEvent([_gaussian(nu_a), _gaussian(nu_b)])
    composed = LibraryPLDAccountant(value_discretization_interval=1e-4).compose(pair).get_epsilon(DELTA)
    single = LibraryPLDAccountant(value_discretization_interval=1e-4).compose(_gaussian(nu)).get_epsilon(DELTA)
    assert composed == pytest.approx(single, rel=1e-6)


def _hockey_stick_2d(shift, sample_rate, epsilons, step=0.02, lo=-8.0, hi=10.0):
    """delta(eps) of the Poisson-subsampled 2-D Gaussian mechanism, by integration on a grid.

    Neighbours: Q = N(0, I) without the example, P = (1 - q) N(0, I) + q N(shift, I) with it;
    add/remove adjacency bounds both directions, so delta is the larger hockey-stick divergence.
    The grid is in the original coordinates: nothing assumes that only ||shift|| matters.
    """
    x = np.arange(lo, hi, step)
    density = lambda mean: np.exp(-((x - mean) ** 2) / 2) / math.sqrt(2 * math.pi)  # noqa: E731
    q_density = np.outer(density(0.0), density(0.0))
    p_density = (1 - sample_rate) * q_density + sample_rate * np.outer(density(shift[0]), density(shift[1]))
    deltas = []
    for eps in epsilons:
        remove = np.maximum(p_density - math.exp(eps) * q_density, 0).sum() * step**2
        add = np.maximum(q_density - math.exp(eps) * p_density, 0).sum() * step**2
        deltas.append(max(remove, add))
    return deltas


@pytest.mark.parametrize(("nu", "sample_rate"), [(1.0, 0.01), (0.8, 0.05)])
def test_sampled_step_is_one_subsampled_gaussian_with_the_composed_multiplier(nu, sample_rate):
    # Both OSO releases see the SAME Poisson batch. Rescaled by their noise, (clipped sum /
    # (nu_g C), q sum / nu_q) is one 2-D (after projection) Gaussian with unit noise; the
    # worst-case example (||g|| > C: clipped norm C, ||q|| = 1, along one direction each)
    # shifts it by (1/nu_g, 1/nu_q), of norm 1/nu. Its privacy curve must be that of
    # PoissonSampledDpEvent(q, GaussianDpEvent(nu)).
    nu_g, nu_q = oso_noise_split(nu)
    epsilons = [0.005, 0.01, 0.02, 0.05]
    integrated = _hockey_stick_2d((1.0 / nu_g, 1.0 / nu_q), sample_rate, epsilons)
    event = dp_event.PoissonSampledDpEvent(sample_rate, _gaussian(nu))
    accountant = LibraryPLDAccountant(value_discretization_interval=1e-3).compose(event)
    library = [accountant.get_delta(eps) for eps in epsilons]
    assert integrated == pytest.approx(library, rel=1e-5)
    if nu == 1.0:
        # Accounting the releases as two separately sampled events models independent
        # batches and UNDER-reports the spend of the joint mechanism.
        separate = dp_event.ComposedDpEvent([dp_event.PoissonSampledDpEvent(sample_rate, _gaussian(nu_g)),
                                             dp_event.PoissonSampledDpEvent(sample_rate, _gaussian(nu_q))])
        wrong = LibraryPLDAccountant(value_discretization_interval=1e-3).compose(separate)
        assert wrong.get_delta(epsilons[0]) < 0.995 * integrated[0]


# --------------------------------------------------------------------------- OSO statistics


def _per_sample_gradients(generator):
    """Six examples, two parameters; example 2 has a zero gradient."""
    grads = [torch.randn(6, 3, 4, generator=generator, dtype=torch.float64),
             torch.randn(6, 5, generator=generator, dtype=torch.float64)]
    grads[0][2].zero_()
    grads[1][2].zero_()
    norms = torch.stack([g.reshape(6, -1).norm(dim=1) for g in grads], dim=1).norm(dim=1)
    return grads, norms


def test_oso_statistics_match_a_naive_per_example_loop():
    generator = torch.Generator().manual_seed(11)
    grads, norms = _per_sample_gradients(generator)
    at_threshold = norms.argsort()[3].item()  # the zero example sorts first; two examples lie above this one
    clip = norms[at_threshold].item()  # exactly at the threshold: ||g|| == C is NOT clipped
    stats = oso_statistics(norms, clip)
    assert not torch.isnan(stats.q_weights).any() and not torch.isnan(stats.clip_factors).any()

    q_sum = [torch.zeros_like(g[0]) for g in grads]
    clipped_sum = [torch.zeros_like(g[0]) for g in grads]
    for i in range(6):
        g_i = torch.cat([g[i].reshape(-1) for g in grads])
        norm = g_i.norm().item()
        # q_i = g_i / (||g_i|| + 1e-6), the margin of clip_factors: ||q_i|| <= 1 despite rounding
        q_i = g_i / (norm + 1e-6) if norm > clip else torch.zeros_like(g_i)
        assert q_i.norm().item() <= 1.0
        assert q_i.norm().item() == pytest.approx(1.0 if norm > clip else 0.0, abs=1e-5)
        factor = min(1.0, clip / (norm + 1e-6))
        assert stats.clip_factors[i].item() == pytest.approx(factor, rel=1e-12)
        expected_weight = 1.0 / (norm + 1e-6) if norm > clip else 0.0
        assert stats.q_weights[i].item() == pytest.approx(expected_weight, rel=1e-12)
        for k, g in enumerate(grads):
            sizes = [t[0].numel() for t in grads]
            start = sum(sizes[:k])
            q_sum[k] += q_i[start:start + sizes[k]].view_as(g[i])
            clipped_sum[k] += factor * g[i]
    assert stats.q_weights[2] == 0 and stats.q_weights[at_threshold] == 0  # zero gradient, at the threshold
    assert (stats.q_weights > 0).sum() == 2 and stats.clip_factors[at_threshold] < 1
    for k, g in enumerate(grads):  # the weighted sums a GradSampleEngine would form
        torch.testing.assert_close(torch.einsum("i,i...->...", stats.q_weights, g), q_sum[k], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(torch.einsum("i,i...->...", stats.clip_factors, g), clipped_sum[k],
                                   rtol=1e-12, atol=1e-12)


def test_oso_statistics_hand_computed():
    stats = oso_statistics(torch.tensor([0.0, 0.5, 1.0, 2.0, 4.0]), 1.0)
    torch.testing.assert_close(stats.q_weights, torch.tensor([0.0, 0.0, 0.0, 0.5, 0.25]))
    torch.testing.assert_close(stats.clip_factors, torch.tensor([1.0, 1.0, 1.0 / (1.0 + 1e-6), 0.5, 0.25]),
                               rtol=1e-6, atol=0)
    with pytest.raises(ValueError, match="clip"):
        oso_statistics(torch.ones(3), 0.0)


def test_count_unclipped_counts_the_threshold_as_unclipped():
    assert count_unclipped(torch.tensor([0.0, 0.5, 1.0, 1.0 + 1e-6, 3.0]), 1.0).item() == 3


def test_oso_noisy_q_sum_uses_nu_q_as_std_whatever_the_threshold():
    q_sum = [torch.arange(6.0).view(2, 3), torch.ones(4)]
    noisy = oso_noisy_q_sum(q_sum, q_noise_multiplier=7.124, generator=torch.Generator().manual_seed(5))
    reference = gaussian_noise([t.shape for t in q_sum], 7.124, torch.Generator().manual_seed(5))
    for n, s, r in zip(noisy, q_sum, reference):
        torch.testing.assert_close(n, s + r)
    # Statistical check of the std: 200 000 draws; the sample std of N(0, s^2) has relative
    # std 1/sqrt(2n) = 0.16 %, the 1 % tolerance is > 6 of those (false failures < 1e-9).
    big = oso_noisy_q_sum([torch.zeros(200_000)], q_noise_multiplier=3.0, generator=torch.Generator().manual_seed(6))
    assert big[0].std().item() == pytest.approx(3.0, rel=0.01)


# --------------------------------------------------------------------------- OSO update


def test_oso_defaults():
    assert (OSO_INITIAL_CLIP, OSO_CLIP_LR, OSO_LR_LR, OSO_Q_NOISE_RATIO) == (0.1, 2.5e-3, 2.5e-3, 7.124)


def _as_list(flat):
    return [flat[:4].view(2, 2), flat[4:]]


UP = torch.tensor([1.0, 2.0, -1.0, 0.5, 3.0, -2.0])


@pytest.mark.parametrize("layout", ["flat", "list", "mixed"])
def test_oso_update_hand_computed(layout):
    g = UP
    agree, oppose, orthogonal = UP * 0.3, -UP, torch.tensor([1.0, 0.0, 0.0, 0.0, 0.0, 0.5])  # 1 - 1 = 0
    convert = {"flat": lambda t: t, "list": _as_list, "mixed": _as_list}[layout]
    g_in = g if layout == "mixed" else convert(g)

    clip, lr = oso_update(0.1, 0.5, g_in, convert(oppose), convert(agree))
    assert clip == pytest.approx(0.1 * math.exp(0.0025), rel=1e-15)
    assert lr == pytest.approx(0.5 * math.exp(-0.0025), rel=1e-15)

    clip, lr = oso_update(0.1, 0.5, g_in, convert(agree), convert(oppose))
    assert clip == pytest.approx(0.1 * math.exp(-0.0025), rel=1e-15)
    assert lr == pytest.approx(0.5 * math.exp(0.0025), rel=1e-15)

    assert oso_update(0.1, 0.5, g_in, convert(orthogonal), convert(orthogonal)) == (0.1, 0.5)  # sign(0) = 0
    assert oso_update(0.1, 0.5, g_in, None, None) == (0.1, 0.5)  # first step
    clip, lr = oso_update(0.1, 0.5, g_in, None, convert(agree))
    assert (clip, lr) == (pytest.approx(0.1 * math.exp(0.0025), rel=1e-15), 0.5)
    clip, lr = oso_update(0.1, 0.5, g_in, convert(agree), None)
    assert (clip, lr) == (0.1, pytest.approx(0.5 * math.exp(0.0025), rel=1e-15))


def test_oso_update_dot_product_runs_over_all_parameters():
    g = [torch.tensor([1.0]), torch.tensor([1.0])]
    q = [torch.tensor([-1.0]), torch.tensor([3.0])]  # first parameter disagrees, the total (2) agrees
    clip, _ = oso_update(1.0, 1.0, g, None, q, clip_lr=0.1)
    assert clip == pytest.approx(math.exp(0.1), rel=1e-15)


def test_oso_update_custom_rates_and_iteration():
    clip, lr = 0.1, 0.2
    for _ in range(4):
        clip, lr = oso_update(clip, lr, UP, UP, UP, clip_lr=0.01, lr_lr=0.0)
    assert clip == pytest.approx(0.1 * math.exp(0.04), rel=1e-14)
    assert lr == 0.2  # lr_lr = 0 keeps the learning rate fixed


def test_oso_update_rejects_bad_input():
    with pytest.raises(ValueError, match="different sizes"):
        oso_update(0.1, 0.5, torch.ones(3), None, torch.ones(4))
    with pytest.raises(ValueError, match="clip"):
        oso_update(0.0, 0.5, torch.ones(3), None, None)
    with pytest.raises(ValueError, match="lr"):
        oso_update(0.1, -0.5, torch.ones(3), None, None)
    with pytest.raises(ValueError, match="clip_lr"):
        oso_update(0.1, 0.5, torch.ones(3), None, None, clip_lr=-1e-3)
    with pytest.raises(ValueError, match="lr_lr"):
        oso_update(0.1, 0.5, torch.ones(3), None, None, lr_lr=math.nan)


# --------------------------------------------------------------------------- quantile clipping


def _no_noise(**kwargs):
    return quantile_clip_update(count_noise_std=0.0, generator=torch.Generator().manual_seed(0), **kwargs)


def test_quantile_update_hand_computed_without_noise():
    clip, b = _no_noise(clip=1.0, unclipped_count=48, batch_size=64, expected_batch_size=64)
    assert b == 0.75  # (48 - 32) / 64 + 1/2
    assert clip == pytest.approx(math.exp(-0.2 * 0.25), rel=1e-15)
    # realized batch 50, expected 64: (30 - 25) / 64 + 1/2 = 0.578125; gamma = 0.9 -> C grows
    clip, b = _no_noise(clip=2.0, unclipped_count=30, batch_size=50, expected_batch_size=64, target_quantile=0.9,
                        clip_lr=0.5)
    assert b == 0.578125
    assert clip == pytest.approx(2.0 * math.exp(-0.5 * (0.578125 - 0.9)), rel=1e-15)
    clip, b = _no_noise(clip=1.0, unclipped_count=torch.tensor(48), batch_size=64, expected_batch_size=64)
    assert b == 0.75  # a 0-dim tensor from count_unclipped is accepted


def test_quantile_update_clamps_the_fraction():
    clip, b = _no_noise(clip=1.0, unclipped_count=64, batch_size=64, expected_batch_size=16)  # (32/16) + 1/2 = 2.5
    assert b == 1.0 and clip == pytest.approx(math.exp(-0.2 * 0.5), rel=1e-15)
    clip, b = _no_noise(clip=1.0, unclipped_count=0, batch_size=64, expected_batch_size=16)  # -2 + 1/2
    assert b == 0.0 and clip == pytest.approx(math.exp(0.2 * 0.5), rel=1e-15)
    clip, b = _no_noise(clip=1.0, unclipped_count=0, batch_size=0, expected_batch_size=16)  # empty Poisson batch
    assert b == 0.5 and clip == 1.0


def test_quantile_update_noise_is_one_float64_draw_from_the_generator():
    sigma_b, m = 3.2, 64
    generator = torch.Generator().manual_seed(123)
    clip, b = quantile_clip_update(1.0, 30, 60, m, count_noise_std=sigma_b, generator=generator)
    reference = torch.Generator().manual_seed(123)
    z = torch.randn((), generator=reference, dtype=torch.float64).item()
    assert b == pytest.approx((30 - 30 + sigma_b * z) / m + 0.5, rel=1e-15)
    assert clip == pytest.approx(math.exp(-0.2 * (b - 0.5)), rel=1e-15)
    # exactly one draw was consumed: both generators continue identically
    assert torch.equal(generator.get_state(), reference.get_state())


def test_quantile_update_noisy_fraction_statistics():
    # b~ = 1/2 + N(0, (sigma_b / m)^2) = 1/2 + N(0, 0.05^2) when half the batch is unclipped;
    # the clamp to [0, 1] is 10 std away (never active). With n = 20 000 draws the mean has
    # std 0.05 / sqrt(n) = 3.5e-4 and the sample std has std 0.05 / sqrt(2n) = 2.5e-4; the
    # tolerances are 5 of those (false-failure rate about 6e-7 each; the seed is fixed anyway).
    generator = torch.Generator().manual_seed(2024)
    n, m = 20_000, 64
    sigma_b = default_count_noise_std(m)
    draws = np.array([quantile_clip_update(1.0, 30, 60, m, count_noise_std=sigma_b, generator=generator)[1]
                      for _ in range(n)])
    assert abs(draws.mean() - 0.5) < 5 * 0.05 / math.sqrt(n)
    assert abs(draws.std(ddof=1) - 0.05) < 5 * 0.05 / math.sqrt(2 * n)


def test_quantile_update_tracks_the_target_quantile():
    # Norms uniform on (0, 1): from C = 0.05 the noisy geometric rule settles near the median.
    generator = torch.Generator().manual_seed(7)
    norms_generator = torch.Generator().manual_seed(8)
    clip = 0.05
    for _ in range(300):
        norms = torch.rand(256, generator=norms_generator)
        clip, _ = quantile_clip_update(clip, count_unclipped(norms, clip), 256, 256,
                                       count_noise_std=default_count_noise_std(256), generator=generator)
    assert clip == pytest.approx(0.5, abs=0.1)


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"target_quantile": 1.5}, "target_quantile"),
    ({"target_quantile": -0.1}, "target_quantile"),
    ({"clip_lr": -0.2}, "clip_lr"),
    ({"count_noise_std": -1.0}, "count_noise_std"),
    ({"count_noise_std": math.inf}, "count_noise_std"),
    ({"clip": 0.0}, "clip"),
    ({"clip": math.nan}, "clip"),
    ({"unclipped_count": 65}, "cannot exceed batch_size"),
    ({"unclipped_count": -1}, "unclipped_count"),
    ({"expected_batch_size": 0}, "expected_batch_size"),
    ({"generator": None}, "torch.Generator"),
])
def test_quantile_update_rejects_bad_input(kwargs, match):
    arguments = {"clip": 1.0, "unclipped_count": 30, "batch_size": 64, "expected_batch_size": 64,
                 "count_noise_std": 3.2, "generator": torch.Generator().manual_seed(0), **kwargs}
    with pytest.raises(ValueError, match=match):
        quantile_clip_update(**arguments)


def test_quantile_update_accepts_the_closed_quantile_interval():
    for gamma in (0.0, 1.0):
        clip, b = _no_noise(clip=1.0, unclipped_count=32, batch_size=64, expected_batch_size=64, target_quantile=gamma)
        assert b == 0.5 and clip == pytest.approx(math.exp(-0.2 * (0.5 - gamma)), rel=1e-15)
