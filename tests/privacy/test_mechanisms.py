"""Tests of the Euclidean Laplace mechanism and the sanitization of client updates.

Statistical tests use fixed seeds, so they are deterministic; each states the
false-failure rate it would have if the seed were drawn at random (KS tests: the
p-value threshold; moment tests: the two-sided normal tail of the tolerance, summed
over the comparisons made).
"""

from __future__ import annotations

import math
import time

import numpy as np
import pytest
import torch
from scipy import integrate, stats

from lightning_dp.privacy.mechanisms import (
    SanitizedUpdate,
    euclidean_laplace,
    euclidean_laplace_log_prob,
    sample_gamma,
    sanitize_update,
)
from tests.helpers import ACCELERATORS, DEVICE

KS_ALPHA = 1e-3  # KS tests fail when p < 1e-3: false-failure rate 1e-3 each for a random seed


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# --------------------------------------------------------------------------- gamma sampler


@pytest.mark.parametrize("concentration", [0.5, 1.0, 2.0, 10.0, 1000.0, 2_000_000.0])
def test_sample_gamma_matches_scipy(concentration: float) -> None:
    draws = sample_gamma(concentration, scale=0.5, num_samples=20_000, generator=_gen(1)).numpy()
    assert draws.shape == (20_000,) and np.all(draws > 0)
    assert stats.kstest(draws, stats.gamma(a=concentration, scale=0.5).cdf).pvalue > KS_ALPHA
    # Mean within 5 standard errors (sd of the mean sqrt(a) * scale / sqrt(N)): false-failure rate 6e-7.
    assert abs(draws.mean() - 0.5 * concentration) <= 5 * math.sqrt(concentration) * 0.5 / math.sqrt(20_000)


def test_sample_gamma_uses_only_its_generator() -> None:
    first = sample_gamma(3.0, num_samples=100, generator=_gen(7))
    torch.manual_seed(0)  # the global RNG must not matter
    again = sample_gamma(3.0, num_samples=100, generator=_gen(7))
    assert torch.equal(first, again) and first.dtype == torch.float64
    assert not torch.equal(first, sample_gamma(3.0, num_samples=100, generator=_gen(8)))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"concentration": 0.0}, "concentration=0.0"),
        ({"concentration": math.inf}, "concentration=inf"),
        ({"concentration": 1.0, "scale": -1.0}, "scale=-1.0"),
        ({"concentration": 1.0, "num_samples": 0}, "num_samples=0"),
    ],
)
def test_sample_gamma_rejects_invalid_arguments(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        sample_gamma(generator=_gen(0), **kwargs)


# --------------------------------------------------------------------------- Euclidean Laplace


@pytest.mark.parametrize("accelerator", ACCELERATORS)
@pytest.mark.parametrize("dim", [1, 2, 10, 1000])
def test_radius_is_gamma_dim_over_epsilon(dim: int, accelerator: str) -> None:
    """On a GPU too, from the GPU's generator (the federated rounds draw their noise on the models' device)."""
    epsilon, device = 2.5, DEVICE[accelerator]
    generator = torch.Generator(device).manual_seed(1000 + dim)
    noise = euclidean_laplace(dim, epsilon, generator=generator, dtype=torch.float64, num_samples=3000, device=device)
    assert noise.shape == (3000, dim) and noise.device.type == device
    radius = torch.linalg.vector_norm(noise, dim=1).cpu().numpy()
    assert stats.kstest(radius, stats.gamma(a=dim, scale=1 / epsilon).cdf).pvalue > KS_ALPHA
    if dim == 1000:  # power: a 2 % error of the scale (0.6 radius sd) would be caught
        assert stats.kstest(radius, stats.gamma(a=dim, scale=1.02 / epsilon).cdf).pvalue < 1e-6


def test_single_draws_have_the_same_radius_distribution() -> None:
    generator = _gen(3)
    radius = [float(euclidean_laplace(10, 4.0, generator=generator, dtype=torch.float64).norm()) for _ in range(1000)]
    assert stats.kstest(radius, stats.gamma(a=10, scale=1 / 4.0).cdf).pvalue > KS_ALPHA


def test_dim_one_is_the_laplace_distribution() -> None:
    noise = euclidean_laplace(1, 2.0, generator=_gen(11), dtype=torch.float64, num_samples=20_000)[:, 0].numpy()
    assert stats.kstest(noise, stats.laplace(scale=0.5).cdf).pvalue > KS_ALPHA


@pytest.mark.parametrize("dim", [2, 3, 10, 100])
def test_direction_has_zero_mean(dim: int) -> None:
    n_samples = 20_000
    noise = euclidean_laplace(dim, 1.0, generator=_gen(100 + dim), dtype=torch.float64, num_samples=n_samples)
    directions = noise / torch.linalg.vector_norm(noise, dim=1, keepdim=True)
    # A uniform direction has covariance I / dim: each mean component has sd 1 / sqrt(dim N). Tolerance 5 sd
    # per component; false-failure rate <= dim * 5.7e-7 (Bonferroni, normal approximation).
    assert directions.mean(0).abs().max() <= 5 / math.sqrt(dim * n_samples)
    # Second moments: E u_i^2 = 1 / dim; the sample mean of u_i^2 has sd <= sqrt(2 / (dim^2 N)) (Var u_i^2 =
    # 2 (dim - 1) / (dim^2 (dim + 2)) < 2 / dim^2); tolerance 5 sd, same false-failure rate.
    assert (directions.pow(2).mean(0) - 1 / dim).abs().max() <= 5 * math.sqrt(2 / n_samples) / dim


def test_direction_uniform_in_dim_2_and_independent_of_radius() -> None:
    noise = euclidean_laplace(2, 1.0, generator=_gen(21), dtype=torch.float64, num_samples=20_000).numpy()
    angle = np.arctan2(noise[:, 1], noise[:, 0])
    assert stats.kstest(angle, stats.uniform(loc=-math.pi, scale=2 * math.pi).cdf).pvalue > KS_ALPHA
    radius = np.linalg.norm(noise, axis=1)
    small = radius < np.median(radius)
    assert stats.ks_2samp(angle[small], angle[~small]).pvalue > KS_ALPHA


def test_direction_uniform_in_dim_3() -> None:
    noise = euclidean_laplace(3, 1.0, generator=_gen(31), dtype=torch.float64, num_samples=20_000)
    u = (noise / torch.linalg.vector_norm(noise, dim=1, keepdim=True)).numpy()
    # Archimedes: on the uniform sphere the height is uniform on [-1, 1], and the azimuth uniform.
    assert stats.kstest(u[:, 2], stats.uniform(loc=-1, scale=2).cdf).pvalue > KS_ALPHA
    azimuth = np.arctan2(u[:, 1], u[:, 0])
    assert stats.kstest(azimuth, stats.uniform(loc=-math.pi, scale=2 * math.pi).cdf).pvalue > KS_ALPHA


@pytest.mark.parametrize("dim", [1, 2, 10])
def test_per_component_variance_is_dim_plus_one_over_epsilon_squared(dim: int) -> None:
    epsilon, n_samples = 2.0, 40_000
    noise = euclidean_laplace(dim, epsilon, generator=_gen(40 + dim), dtype=torch.float64, num_samples=n_samples)
    expected = (dim + 1) / epsilon**2
    # z_i = R u_i: E z_i^4 = E R^4 E u_i^4 = 3 (dim + 1)(dim + 3) / eps^4, so Var z_i^2 = (dim + 1)(2 dim + 8) / eps^4.
    # The known-mean variance estimate mean(z_i^2) has sd sqrt(Var z_i^2 / N); tolerance 5 sd per component,
    # false-failure rate <= dim * 5.7e-7. The mean of z_i has sd sqrt(expected / N); same tolerance.
    sd_var = math.sqrt((dim + 1) * (2 * dim + 8) / epsilon**4 / n_samples)
    assert (noise.pow(2).mean(0) - expected).abs().max() <= 5 * sd_var
    assert noise.mean(0).abs().max() <= 5 * math.sqrt(expected / n_samples)


def test_generator_reproducibility() -> None:
    first = euclidean_laplace(50, 1.0, generator=_gen(5))
    torch.manual_seed(123)  # the global RNG must not matter
    assert torch.equal(first, euclidean_laplace(50, 1.0, generator=_gen(5)))
    assert not torch.equal(first, euclidean_laplace(50, 1.0, generator=_gen(6)))
    generator = _gen(5)
    a, b = euclidean_laplace(50, 1.0, generator=generator), euclidean_laplace(50, 1.0, generator=generator)
    assert torch.equal(a, first) and not torch.equal(a, b)
    # float64 arithmetic, one final rounding: the float32 draw is the rounded float64 draw of the same seed.
    exact = euclidean_laplace(50, 1.0, generator=_gen(5), dtype=torch.float64)
    assert first.dtype == torch.float32 and torch.equal(first, exact.to(torch.float32))
    # None: a private generator with a fresh seed, so two draws differ.
    assert not torch.equal(euclidean_laplace(50, 1.0), euclidean_laplace(50, 1.0))


def test_two_million_dimensions_are_fast_and_have_the_right_norm() -> None:
    dim, epsilon = 2_000_000, 3.0
    start = time.perf_counter()
    noise = euclidean_laplace(dim, epsilon, generator=_gen(9))
    elapsed = time.perf_counter() - start
    assert noise.shape == (dim,) and noise.dtype == torch.float32 and bool(torch.isfinite(noise).all())
    assert elapsed < 5.0  # about 0.05 s on one core
    # ||noise|| ~ Gamma(dim, 1/eps): mean dim/eps, sd sqrt(dim)/eps (0.07 % of the mean). Tolerance 6 sd:
    # false-failure rate 2e-9.
    norm = float(torch.linalg.vector_norm(noise.double()))
    assert abs(norm - dim / epsilon) <= 6 * math.sqrt(dim) / epsilon


def test_huge_radius_does_not_overflow_float64_internals() -> None:
    noise = euclidean_laplace(2_000_000, 1e-30, generator=_gen(1))  # mean norm 2e36, components ~1e33
    assert bool(torch.isfinite(noise).all())
    assert float(torch.linalg.vector_norm(noise.double())) == pytest.approx(2e36, rel=1e-2)
    with pytest.raises(ValueError, match="does not fit into torch.float32"):
        euclidean_laplace(1000, 1e-40, generator=_gen(1))
    assert bool(torch.isfinite(euclidean_laplace(1000, 1e-40, generator=_gen(1), dtype=torch.float64)).all())


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"dim": 0, "epsilon": 1.0}, r"dim=0 .*integer >= 1"),
        ({"dim": 2.5, "epsilon": 1.0}, r"dim=2.5"),
        ({"dim": True, "epsilon": 1.0}, r"dim=True"),
        ({"dim": 3, "epsilon": 0.0}, r"epsilon=0.0 .*finite number > 0"),
        ({"dim": 3, "epsilon": -1.0}, r"epsilon=-1.0"),
        ({"dim": 3, "epsilon": math.inf}, r"epsilon=inf"),
        ({"dim": 3, "epsilon": math.nan}, r"epsilon=nan"),
        ({"dim": 3, "epsilon": 1.0, "dtype": torch.int64}, r"dtype=torch.int64"),
        ({"dim": 3, "epsilon": 1.0, "num_samples": 0}, r"num_samples=0"),
        ({"dim": 3, "epsilon": 1.0, "generator": 0}, r"generator=0 must be a torch.Generator"),
    ],
)
def test_euclidean_laplace_rejects_invalid_arguments(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        euclidean_laplace(**kwargs)


# --------------------------------------------------------------------------- density and the d-privacy bound


@pytest.mark.parametrize("dim", [1, 2, 5, 50])
def test_log_prob_is_a_normalized_density(dim: int) -> None:
    epsilon = 1.5
    unit = torch.zeros(dim, dtype=torch.float64)
    unit[0] = 1.0
    sphere_area = 2 * math.pi ** (dim / 2) / math.gamma(dim / 2)
    mass, _ = integrate.quad(
        lambda r: sphere_area * r ** (dim - 1) * math.exp(float(euclidean_laplace_log_prob(r * unit, epsilon))),
        0, math.inf)
    assert mass == pytest.approx(1.0, rel=1e-8)
    if dim == 1:
        points = torch.linspace(-3, 3, 13, dtype=torch.float64).unsqueeze(1)
        expected = stats.laplace(scale=1 / epsilon).logpdf(points[:, 0].numpy())
        np.testing.assert_allclose(euclidean_laplace_log_prob(points, epsilon).numpy(), expected, rtol=1e-12)


@pytest.mark.parametrize("dim", [1, 2, 10, 1000])
def test_density_ratio_is_bounded_by_exp_epsilon_distance(dim: int) -> None:
    epsilon = 0.7
    g = _gen(dim)
    x1, x2, y = (torch.randn(500, dim, generator=g, dtype=torch.float64) * 3 for _ in range(3))
    log_ratio = euclidean_laplace_log_prob(y - x1, epsilon) - euclidean_laplace_log_prob(y - x2, epsilon)
    bound = epsilon * torch.linalg.vector_norm(x1 - x2, dim=1)
    assert bool((log_ratio <= bound * (1 + 1e-12) + 1e-9).all())
    # The bound is attained behind x1 on the line through x2 and x1: the mechanism is not over-noised.
    behind = x1 + 2.0 * (x1 - x2)
    log_ratio = euclidean_laplace_log_prob(behind - x1, epsilon) - euclidean_laplace_log_prob(behind - x2, epsilon)
    torch.testing.assert_close(log_ratio, bound, rtol=1e-9, atol=1e-9)


def test_empirical_ratio_in_dim_1_respects_and_attains_the_bound() -> None:
    epsilon, shift, n_samples = 1.0, 1.0, 400_000
    y1 = euclidean_laplace(1, epsilon, generator=_gen(61), dtype=torch.float64, num_samples=n_samples)[:, 0]
    y2 = shift + euclidean_laplace(1, epsilon, generator=_gen(62), dtype=torch.float64, num_samples=n_samples)[:, 0]
    edges = np.arange(-4.0, 5.01, 0.25)
    c1, _ = np.histogram(y1.numpy(), edges)
    c2, _ = np.histogram(y2.numpy(), edges)
    keep = (c1 >= 200) & (c2 >= 200)
    assert keep.sum() >= 25
    log_ratio = np.log(c1[keep] / c2[keep])
    # Delta method: log(c1 / c2) has sd ~ sqrt(1/c1 + 1/c2). Tolerance 4.5 sd per bin (one-sided 3.4e-6), at most
    # 36 bins per inequality: false-failure rate < 3e-4 over the test.
    sd = np.sqrt(1 / c1[keep] + 1 / c2[keep])
    bound = epsilon * shift
    assert np.all(log_ratio <= bound + 4.5 * sd)
    assert np.all(log_ratio >= -bound - 4.5 * sd)
    # Per bin, the ratio matches the exact ratio of the bin probabilities (Laplace CDF), same tolerance.
    laplace = stats.laplace(scale=1 / epsilon)
    p1 = np.diff(laplace.cdf(edges))[keep]
    p2 = np.diff(laplace.cdf(edges - shift))[keep]
    assert np.all(np.abs(log_ratio - np.log(p1 / p2)) <= 4.5 * sd)
    # Tightness: left of both centres the density ratio equals exp(eps * shift); pooled over y < 0 the count ratio
    # has sd ~ sqrt(1/n1 + 1/n2); tolerance 4.5 sd, false-failure rate 7e-6.
    n1, n2 = int((y1 < 0).sum()), int((y2 < 0).sum())
    assert abs(math.log(n1 / n2) - bound) <= 4.5 * math.sqrt(1 / n1 + 1 / n2)


def test_empirical_ratio_in_dim_2_respects_the_bound() -> None:
    epsilon, n_samples = 1.0, 400_000
    centre1, centre2 = np.array([0.0, 0.0]), np.array([1.0, 0.0])
    y1 = euclidean_laplace(2, epsilon, generator=_gen(71), dtype=torch.float64, num_samples=n_samples).numpy()
    y2 = euclidean_laplace(2, epsilon, generator=_gen(72), dtype=torch.float64, num_samples=n_samples).numpy()
    y1, y2 = y1 + centre1, y2 + centre2
    edges = np.arange(-3.0, 4.01, 0.5)
    c1, _, _ = np.histogram2d(y1[:, 0], y1[:, 1], bins=[edges, edges - 0.5])
    c2, _, _ = np.histogram2d(y2[:, 0], y2[:, 1], bins=[edges, edges - 0.5])
    keep = (c1 >= 200) & (c2 >= 200)
    assert keep.sum() >= 60
    log_ratio = np.log(c1[keep] / c2[keep])
    # Tolerance 4.5 sd per bin (one-sided 3.4e-6) over at most 196 bins: false-failure rate < 7e-4.
    sd = np.sqrt(1 / c1[keep] + 1 / c2[keep])
    bound = epsilon * float(np.linalg.norm(centre1 - centre2))
    assert np.all(log_ratio <= bound + 4.5 * sd)
    assert np.all(log_ratio >= -bound - 4.5 * sd)
    assert log_ratio.max() > 0.5 * bound  # the bins behind centre 1 come close to the bound


# --------------------------------------------------------------------------- sanitize_update


def _client_and_reference(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = _gen(seed)
    reference = torch.randn(n, generator=g)
    return reference + 0.3 * torch.randn(n, generator=g), reference


def test_sanitize_update_calibration_and_noise_scale() -> None:
    n, nu, repeats = 50, 0.5, 2000
    client, reference = _client_and_reference(n)
    delta_norm = float(torch.linalg.vector_norm(client.double() - reference.double()))
    generator = _gen(1)
    outs = [sanitize_update(client, reference, noise_multiplier=nu, generator=generator) for _ in range(repeats)]
    assert all(isinstance(out, SanitizedUpdate) and out.layer_costs is None for out in outs)
    assert outs[0].cost == n / nu == 100.0
    assert outs[0].epsilon == pytest.approx(n / (nu * delta_norm), rel=1e-12)
    noise = torch.stack([out.released.double() - client.double() for out in outs])
    norms = torch.linalg.vector_norm(noise, dim=1)
    # The noise norm is Gamma(n, 1/eps) with mean n / eps = nu ||delta|| and sd sqrt(n) / eps; its sample mean has
    # sd nu ||delta|| / sqrt(n * repeats). Tolerance 5 sd: false-failure rate 6e-7. (float32 rounding of the
    # release, ~1e-7 relative, is far below.)
    assert abs(float(norms.mean()) - nu * delta_norm) <= 5 * nu * delta_norm / math.sqrt(n * repeats)
    assert stats.kstest(norms.numpy(), stats.gamma(a=n, scale=1 / outs[0].epsilon).cdf).pvalue > KS_ALPHA
    # Centred on the client (not pulled towards the reference): the mean noise per component has sd
    # sqrt((n + 1) / eps^2 / repeats); tolerance 5 sd per component, false-failure rate <= 50 * 5.7e-7.
    assert noise.mean(0).abs().max() <= 5 * math.sqrt((n + 1) / outs[0].epsilon ** 2 / repeats)


def test_sanitize_update_per_layer() -> None:
    sizes, nu, repeats = [30, 15, 5], 2.0, 1000
    g = _gen(2)
    reference = torch.randn(50, generator=g)
    scales = torch.cat([torch.full((s,), f) for s, f in zip(sizes, [0.1, 1.0, 10.0])])
    client = reference + scales * torch.randn(50, generator=g)
    layer_deltas = torch.split(client.double() - reference.double(), sizes)
    delta_norms = [float(torch.linalg.vector_norm(d)) for d in layer_deltas]
    generator = _gen(3)
    outs = [sanitize_update(client, reference, noise_multiplier=nu, generator=generator, per_layer_sizes=sizes)
            for _ in range(repeats)]
    first = outs[0]
    assert first.layer_costs == [15.0, 7.5, 2.5] and first.cost == 25.0 == sum(first.layer_costs)
    assert first.epsilon == pytest.approx([s / (nu * r) for s, r in zip(sizes, delta_norms)], rel=1e-12)
    noise = torch.stack([out.released.double() - client.double() for out in outs])
    for layer, (noise_l, size, radius) in enumerate(zip(torch.split(noise, sizes, dim=1), sizes, delta_norms)):
        norms = torch.linalg.vector_norm(noise_l, dim=1)
        # Per layer, mean noise norm nu ||delta_l||, sd of the sample mean nu ||delta_l|| / sqrt(n_l repeats);
        # tolerance 5 sd per layer: false-failure rate 3 * 6e-7.
        assert abs(float(norms.mean()) - nu * radius) <= 5 * nu * radius / math.sqrt(size * repeats), layer


def test_sanitize_update_without_noise_is_the_baseline() -> None:
    client, reference = _client_and_reference(20)
    generator = _gen(0)
    state = generator.get_state()
    out = sanitize_update(client, reference, noise_multiplier=0.0, generator=generator)
    assert torch.equal(out.released, client) and out.released.data_ptr() != client.data_ptr()
    assert out.epsilon == math.inf and out.cost == math.inf and out.layer_costs is None
    assert torch.equal(generator.get_state(), state)  # nothing was drawn
    layered = sanitize_update(client, reference, noise_multiplier=0, generator=generator, per_layer_sizes=[5, 15])
    assert torch.equal(layered.released, client)
    assert layered.epsilon == [math.inf, math.inf] and layered.layer_costs == [math.inf, math.inf]
    # A zero update is no problem without noise.
    assert torch.equal(sanitize_update(reference, reference, noise_multiplier=0.0, generator=None).released,
                       reference)


def test_sanitize_update_zero_delta_is_refused_unless_floored() -> None:
    reference = torch.randn(40, generator=_gen(0))
    with pytest.raises(ValueError, match=r"has norm 0.0 .*min_delta_norm > 0"):
        sanitize_update(reference.clone(), reference, noise_multiplier=1.0, generator=_gen(1))
    client = reference.clone()
    client[:20] += 1.0  # layer 0 moves, layer 1 does not
    with pytest.raises(ValueError, match=r"in layer 1 \(per_layer_sizes\[1\]=20\)"):
        sanitize_update(client, reference, noise_multiplier=1.0, generator=_gen(1), per_layer_sizes=[20, 20])
    # With a floor, the zero update gets noise of mean norm nu * floor: sd of the sample mean is
    # nu * floor / sqrt(n * repeats); tolerance 5 sd, false-failure rate 6e-7.
    nu, floor, repeats = 2.0, 0.25, 500
    generator = _gen(2)
    outs = [sanitize_update(reference.clone(), reference, noise_multiplier=nu, generator=generator,
                            min_delta_norm=floor) for _ in range(repeats)]
    assert outs[0].epsilon == 40 / (nu * floor) and outs[0].cost == 40 / nu
    norms = torch.stack([torch.linalg.vector_norm(o.released.double() - reference.double()) for o in outs])
    assert abs(float(norms.mean()) - nu * floor) <= 5 * nu * floor / math.sqrt(40 * repeats)
    # The floor only matters below it: a larger update keeps the seed's calibration.
    out = sanitize_update(client, reference, noise_multiplier=nu, generator=_gen(3), min_delta_norm=floor,
                          per_layer_sizes=[20, 20])
    moved = float(torch.linalg.vector_norm(client[:20].double() - reference[:20].double()))  # ~sqrt(20)
    assert out.epsilon == pytest.approx([20 / (nu * moved), 20 / (nu * floor)], rel=1e-12)


def test_sanitize_update_keeps_shape_dtype_and_is_reproducible() -> None:
    client, reference = _client_and_reference(12)
    for dtype in (torch.float32, torch.float64):
        c, r = client.to(dtype).view(3, 4), reference.to(dtype).view(3, 4)
        a = sanitize_update(c, r, noise_multiplier=1.0, generator=_gen(4)).released
        b = sanitize_update(c, r, noise_multiplier=1.0, generator=_gen(4)).released
        assert a.shape == (3, 4) and a.dtype == dtype and torch.equal(a, b)
        assert not torch.equal(a, sanitize_update(c, r, noise_multiplier=1.0, generator=_gen(5)).released)


def test_sanitize_update_handles_a_cnn_sized_update_quickly() -> None:
    n = 1_400_990  # FEMNISTConvNet
    client, reference = _client_and_reference(n)
    sizes = [128, 32, 8192, 64, 1384448, 128, 7936, 62]
    start = time.perf_counter()
    out = sanitize_update(client, reference, noise_multiplier=10.0, generator=_gen(6), per_layer_sizes=sizes)
    assert time.perf_counter() - start < 5.0
    assert out.cost == n / 10.0 and len(out.epsilon) == len(sizes)
    assert bool(torch.isfinite(out.released).all())


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"noise_multiplier": -1.0}, r"noise_multiplier=-1.0 .*>= 0"),
        ({"noise_multiplier": math.inf}, r"noise_multiplier=inf"),
        ({"noise_multiplier": math.nan}, r"noise_multiplier=nan"),
        ({"noise_multiplier": "1"}, r"noise_multiplier='1'"),
        ({"noise_multiplier": 1.0, "per_layer_sizes": [5, 4]}, r"per_layer_sizes=\[5, 4\] .*summing to .* 10"),
        ({"noise_multiplier": 1.0, "per_layer_sizes": [10, 0]}, r"invalid entries \[0\]"),
        ({"noise_multiplier": 1.0, "per_layer_sizes": []}, r"per_layer_sizes=\[\]"),
        ({"noise_multiplier": 1.0, "per_layer_sizes": 10}, r"per_layer_sizes=10"),
        ({"noise_multiplier": 1.0, "min_delta_norm": -0.1}, r"min_delta_norm=-0.1"),
        ({"noise_multiplier": 1.0, "generator": "seed"}, r"generator='seed'"),
    ],
)
def test_sanitize_update_rejects_invalid_arguments(kwargs: dict, message: str) -> None:
    client, reference = _client_and_reference(10)
    kwargs = {"generator": _gen(0), **kwargs}
    with pytest.raises(ValueError, match=message):
        sanitize_update(client, reference, **kwargs)


def test_sanitize_update_rejects_invalid_tensors() -> None:
    client, reference = _client_and_reference(10)
    with pytest.raises(ValueError, match="same shape"):
        sanitize_update(client, reference[:9], noise_multiplier=1.0, generator=_gen(0))
    with pytest.raises(ValueError, match="floating tensor"):
        sanitize_update(client.long(), reference.long(), noise_multiplier=1.0, generator=_gen(0))
    broken = client.clone()
    broken[3] = math.nan
    with pytest.raises(ValueError, match="must be finite"):
        sanitize_update(broken, reference, noise_multiplier=1.0, generator=_gen(0))
    with pytest.raises(ValueError, match="must be tensors"):
        sanitize_update(client.tolist(), reference, noise_multiplier=1.0, generator=_gen(0))


def test_sanitized_cosine_equals_a_naive_loop_over_examples_and_draws():
    """Thesis Fig. 3.1's measurement: per C, clip each example, average, add N(0, (nu C)^2 I) / B, cosine with the
    true mean, averaged over the draws; against a loop over examples and draws with the same generator stream."""
    import torch

    from lightning_dp.privacy.clipping import sanitized_cosine

    g = torch.randn(7, 5, generator=torch.Generator().manual_seed(1), dtype=torch.float64) * 3
    norms = torch.tensor([0.1, 1.0, 100.0])
    got = sanitized_cosine(g, norms, noise_multiplier=0.7, generator=torch.Generator().manual_seed(2),
                           realizations=4)
    gen = torch.Generator().manual_seed(2)
    true = sum(g[i] for i in range(7)) / 7
    for k, c in enumerate(norms.tolist()):
        clipped = sum(g[i] * min(1.0, c / (float(g[i].norm()) + 1e-6)) for i in range(7)) / 7
        draws = torch.randn((4, 5), generator=gen, dtype=torch.float64)
        cosines = [float(torch.dot(clipped + d * 0.7 * c / 7, true) / ((clipped + d * 0.7 * c / 7).norm() * true.norm()))
                   for d in draws]
        assert float(got[k]) == pytest.approx(sum(cosines) / 4, rel=1e-9)
    assert float(sanitized_cosine(g, torch.tensor([1e6]), noise_multiplier=0.0,
                                  generator=torch.Generator())[0]) == pytest.approx(1.0)  # no clip, no noise
    with pytest.raises(ValueError, match="realizations"):
        sanitized_cosine(g, norms, noise_multiplier=1.0, generator=torch.Generator(), realizations=0)

