"""Derived generators and their streams (lightning_dp/privacy/noise.py): the trailing-zero property of NumPy's
SeedSequence, one number per stream within each seed, one number of counters per stream at every call site."""

import ast
import math
from pathlib import Path

import pytest
import torch
from scipy import stats

from lightning_dp.privacy.noise import NOISE, derive_secret_generator, gaussian_noise
from tests.helpers import ACCELERATORS, DEVICE

PACKAGE = Path(__file__).resolve().parents[2] / "lightning_dp"


def test_derived_streams_alias_on_trailing_zeros_and_each_seed_has_distinct_streams() -> None:
    """The property derive_generator's docstring warns of (SeedSequence ignores trailing zero words), and the
    stream tables that keep the draws of one seed apart: distinct numbers within each seed's table."""
    from lightning_dp.audit import _common, attacks, canaries, lira, neighbours
    from lightning_dp.commands import audit_dlg
    from lightning_dp.federated import round as rnd
    from lightning_dp.privacy import noise
    from lightning_dp.privacy.noise import derive_generator

    def draw(*counters):
        return torch.rand(4, generator=derive_generator(7, *counters))

    assert torch.equal(draw(31), draw(31, 0)) and torch.equal(draw(31), draw(31, 0, 0))
    assert not torch.equal(draw(31, 0), draw(31, 1)) and not torch.equal(draw(31), draw(32))
    tables = {
        "DPSGD's secret seed": [noise.SAMPLING, noise.NOISE, noise.CLIP_STATISTIC],
        "the round's seed and noise seed": [rnd._CLIENTS, rnd._LOCAL, rnd._NOISE, rnd._INIT, rnd._VAL,
                                            rnd._SERVER_NOISE, rnd._SERVER_COUNT, rnd._DIAGNOSTICS, rnd._LOCAL_NOISE],
        "OneRunAudit's seed": [canaries.CANARY_INCLUSION, canaries.CANARY_DATA, canaries.CANARY_SAMPLING],
        "the DLG audit's seed": [_common.NOISE_STREAM, _common.DUMMY_STREAM, audit_dlg.INIT_STREAM],
        "the MIA command's seed": [attacks.INIT_STREAM, attacks.DATA_STREAM, attacks.NOISE_STREAM,
                                   attacks.SUBSET_STREAM, attacks.SHUFFLE_STREAM],
        "a LiRA seed": [lira._INIT_STREAM, lira._DATA_STREAM],
        "a noisy-neighbour seed": [neighbours._MEMBER_STREAM, neighbours._NONMEMBER_STREAM],
    }
    for seed, streams in tables.items():
        assert len(streams) == len(set(streams)), (seed, streams)


def _stream_uses() -> dict[tuple[str, str], set[int]]:
    """``{(defining module, stream name): {counters after the stream}}`` over every call site in the package that
    derives a generator (or a seed, ``seeded``) from a named stream constant."""
    uses: dict[tuple[str, str], set[int]] = {}
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text())
        module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        imported = {alias.asname or alias.name: node.module for node in ast.walk(tree)
                    if isinstance(node, ast.ImportFrom) and node.module for alias in node.names}
        for call in ast.walk(tree):
            if not isinstance(call, ast.Call):
                continue
            name = getattr(call.func, "id", getattr(call.func, "attr", None))
            if name in ("derive_generator", "derive_secret_generator", "StatisticStream") and len(call.args) >= 2:
                stream, counters = call.args[1], call.args[2:]
            elif name == "seeded" and call.args:  # seeded(stream, k=0) = derive_generator(seed, stream, k)
                stream, counters = call.args[0], [None]
            else:
                continue
            if not isinstance(stream, ast.Name) or any(isinstance(c, ast.Starred) for c in counters):
                continue
            uses.setdefault((imported.get(stream.id, module), stream.id), set()).add(len(counters))
    return uses


def test_every_named_stream_is_derived_with_one_number_of_counters() -> None:
    """(seed, s, 0) is (seed, s): a stream used with two arities could draw the same numbers twice."""
    uses = _stream_uses()
    assert len(uses) >= 20  # the scan sees the package's streams (round, DPSGD, audits)
    assert uses[("lightning_dp.privacy.noise", "NOISE")] == {1}
    mixed = {key: arities for key, arities in uses.items() if len(arities) > 1}
    assert not mixed, mixed


# ------------------------------------------------------------------ counter-based (stateless) public draws
def _splitmix64(x: int) -> int:
    """SplitMix64's finalizer written out on Python integers (the reference: Steele, Lea & Flood 2014)."""
    m = 2**64 - 1
    x = (x + 0x9E3779B97F4A7C15) & m
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & m
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & m
    return x ^ (x >> 31)


def test_counter_uniform_is_the_splitmix64_chain_written_out() -> None:
    from lightning_dp.privacy.noise import counter_uniform

    def reference(seed: int, *counters: int) -> float:
        h = _splitmix64(seed & (2**64 - 1))
        h = _splitmix64(h ^ (seed >> 64))
        for c in counters:
            h = _splitmix64(h ^ c)
        return ((h >> 12) + 0.5) * 2.0**-52

    for seed, counters in [(0, (1,)), (7, (12, 3, 0, 2**40)), (2**100 + 3, (5, 2**64 - 1)), (5, ())]:
        assert counter_uniform(seed, *counters).item() == reference(seed, *counters)
    # the largest hash maps strictly below 1 (the normal quantile stays finite), the smallest above 0
    assert ((2**52 - 1) + 0.5) * 2.0**-52 < 1.0 and (0 + 0.5) * 2.0**-52 > 0.0
    rows = counter_uniform(9, 4, torch.arange(3)[:, None], torch.tensor([[0, 2**33]]))
    assert rows.shape == (3, 2) and rows.dtype == torch.float64
    assert [[reference(9, 4, i, j) for j in (0, 2**33)] for i in range(3)] == rows.tolist()


def test_counter_draws_are_pure_functions_of_their_own_counters_and_well_distributed() -> None:
    """A client's draws do not depend on which other clients are drawn (the reason they exist); the marginals pass
    Kolmogorov-Smirnov at the 0.1 % level (fixed seeds: the test is deterministic) and neighbouring counters are
    uncorrelated (|r| < 5 / sqrt(n))."""
    from scipy import stats

    from lightning_dp.privacy.noise import counter_normal, counter_uniform

    everyone = counter_uniform(3, 12, torch.arange(1000)[:, None], torch.arange(4)[None])
    some = torch.tensor([998, 5, 17])
    assert torch.equal(counter_uniform(3, 12, some[:, None], torch.arange(4)[None]), everyone[some])
    assert not torch.equal(counter_uniform(4, 12, some), counter_uniform(3, 12, some))
    n = 200_000
    u, z = counter_uniform(1, torch.arange(n)), counter_normal(1, torch.arange(n))
    assert stats.kstest(u.numpy(), "uniform").pvalue > 1e-3 and stats.kstest(z.numpy(), "norm").pvalue > 1e-3
    assert 0 < float(u.min()) and float(u.max()) < 1
    r = float(torch.corrcoef(torch.stack([u[:-1], u[1:]]))[0, 1])
    assert abs(r) < 5 / n**0.5


def test_counter_uniform_refuses_what_it_cannot_hash() -> None:
    import pytest

    from lightning_dp.privacy.noise import counter_uniform

    with pytest.raises(ValueError, match=r"\[0, 2\^64\)"):
        counter_uniform(1, -1)
    with pytest.raises(ValueError, match=">= 0"):
        counter_uniform(1, torch.tensor([3, -2]))
    with pytest.raises(TypeError, match="integers"):
        counter_uniform(1, torch.tensor([0.5]))
    with pytest.raises(ValueError, match="integer"):
        counter_uniform(1, 1.5)  # type: ignore[arg-type]


@pytest.mark.parametrize("accelerator", ACCELERATORS)
def test_gaussian_noise_from_a_secret_generator_has_its_law_on_every_device(accelerator) -> None:
    """DP-SGD's noise on the gradients' device (a GPU's own generator there): N(0, std^2) by a KS test on 2^20
    draws (fails when p < 1e-3), mean within 5 standard errors, variance within 5 of its standard errors."""
    device, std, n = DEVICE[accelerator], 0.7, 2**20
    g = derive_secret_generator(1234, NOISE, 3, device=device)
    (a, b) = gaussian_noise([torch.Size([n // 2]), torch.Size([n // 4, 2])], std, g, device=device)
    assert a.device.type == b.device.type == device and a.dtype == torch.float32
    draws = torch.cat([a.reshape(-1), b.reshape(-1)]).double().cpu().numpy()
    assert stats.kstest(draws, stats.norm(scale=std).cdf).pvalue > 1e-3
    assert abs(draws.mean()) <= 5 * std / math.sqrt(n)
    assert abs(draws.var() - std**2) <= 5 * std**2 * math.sqrt(2 / n)
    again = gaussian_noise([torch.Size([n // 2]), torch.Size([n // 4, 2])], std,
                           derive_secret_generator(1234, NOISE, 3, device=device), device=device)
    assert torch.equal(again[0], a) and torch.equal(again[1], b)  # a pure function of the secret stream
