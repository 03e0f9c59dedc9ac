"""The round at population scale: a ClientPopulation read through its sizes and the drawn clients' rows, the
vectorized sanitizers, the hashed local shuffles (lightning_dp/federated/round.py, parts/sanitizers.py)."""

from __future__ import annotations

import math

import lightning as L
import pytest
import torch
from torch import nn

from lightning_dp.datamodules.population import SyntheticPopulation, SyntheticPopulationDataModule
from lightning_dp.federated import FederatedRound
from lightning_dp.federated.parts import (
    CentralGaussian,
    ClipSanitizer,
    EuclideanLaplace,
    LocalSGD,
    NoSanitizer,
    PoissonSelection,
    UniformSelection,
)
from lightning_dp.privacy.noise import derive_secret_generator
from tests.federated.test_dp_fedavg import library_epsilon, trainer


def rows(m=6, p=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    start = torch.randn(m, p, generator=g)
    return start + torch.randn(m, p, generator=g) * torch.tensor([0.1, 3.0, 0.5, 10.0, 1.0, 0.01])[:m, None], start


@pytest.mark.parametrize("sanitizer", [ClipSanitizer(1.0), NoSanitizer(), EuclideanLaplace(2.0)])
def test_sanitize_rows_is_sanitize_of_each_row(sanitizer):
    """The vectorized path (no noise: one pass over the rows) releases what the per-client path releases, with the
    same costs and unclipped bits; a noisy sanitizer loops with each client's own generator."""
    trained, start = rows()
    refs = [None]
    choice = torch.zeros(len(trained), dtype=torch.long)
    gen = lambda c: derive_secret_generator(5, 13, 0, c)  # noqa: E731
    released, costs, bits = sanitizer.sanitize_rows(trained, start, generator_of=gen, layer_sizes=[5],
                                                    references=refs, choice=choice)
    for c in range(len(trained)):
        one = sanitizer.sanitize(trained[c], start[c], generator=gen(c), layer_sizes=[5])
        torch.testing.assert_close(released[c], one.released, rtol=1e-6, atol=1e-7)
        assert costs[c].item() == one.cost
        assert (math.isnan(bits[c]) and one.unclipped is None) or bits[c].item() == float(one.unclipped)
    if isinstance(sanitizer, ClipSanitizer):
        raw = (trained - start).double().norm(dim=1)
        assert bits.tolist() == (raw <= 1.0).double().tolist() and 0 < bits.sum() < len(bits)
        assert (released - start).double().norm(dim=1).max() <= 1.0


def test_uniform_selection_without_caps_is_the_permutations_head():
    g1, g2 = derive_secret_generator(3, 11, 0), derive_secret_generator(3, 11, 0)
    chosen, declined = UniformSelection(5).draw(1000, g1)
    assert chosen == torch.randperm(1000, generator=g2).tolist()[:5] and declined == 0


def test_local_shuffles_of_a_population_depend_on_the_client_not_on_the_others():
    module = FederatedRound(nn.Linear(3, 1), seed=4, noise_seed=5)
    module.clients.splits = {"train": SyntheticPopulation(10**6, samples=(1, 4))}
    module.clients.key_width = 4
    mask = torch.ones(3, 4, dtype=torch.bool)
    a = module.clients.shuffle_keys(2, [7, 999_999, 3], mask)(1)
    b = module.clients.shuffle_keys(2, [3, 7, 12], mask)(1)
    assert torch.equal(a[0], b[1]) and torch.equal(a[2], b[0]) and a.dtype == torch.float32
    assert not torch.equal(module.clients.shuffle_keys(2, [7], mask[:1])(0), a[:1])  # another epoch, other keys


def test_dp_fedavg_on_a_population_builds_only_the_drawn_clients_and_accounts_as_the_library():
    dm = SyntheticPopulationDataModule(200_000, 20, task="regression", seed=1)
    built: list[int] = []
    dm.setup("fit")
    population = dm.clients("train")
    rows_of = population.rows

    def recording(index):
        built.append(len(index))
        return rows_of(index)

    population.rows = recording  # type: ignore[method-assign]
    privacy = CentralGaussian(noise_multiplier=1.1, clip=1.0, target_delta=1e-7)
    module = FederatedRound(nn.Sequential(nn.Linear(3, 2), nn.ReLU(), nn.Linear(2, 1)),
                            selection=PoissonSelection(0.001), update=LocalSGD(lr=0.05, epochs=1, batch_size=10),
                            server_privacy=privacy, seed=0, noise_seed=1)
    start = module.hypotheses.clone()
    trainer(max_epochs=3, log_every_n_steps=1).fit(module, dm)
    assert len(built) == 3 and all(100 < n < 300 for n in built)  # ~200 drawn per round, never the population
    assert privacy.accountant.history == [(1.1, 0.001, 3)]
    assert privacy.epsilon == pytest.approx(library_epsilon(1.1, 0.001, 3, delta=1e-7), rel=1e-9)
    assert not torch.equal(module.hypotheses, start) and torch.isfinite(module.hypotheses).all()


def test_the_personalized_round_on_a_population_charges_the_drawn_clients():
    """d-privacy releases (one secret generator per client) and the per-client ledger keyed by the population's ids."""
    dm = SyntheticPopulationDataModule(50_000, 10, task="regression", num_clusters=2, seed=2)
    module = FederatedRound(nn.Linear(3, 1), num_hypotheses=2, selection=UniformSelection(30),
                            sanitizer=EuclideanLaplace(5.0), aggregator="kmeans", seed=0, noise_seed=1)
    trainer(max_epochs=2).fit(module, dm)
    spend = module.ledger.as_dict()
    assert 30 < len(spend) <= 60 and all(dm.clients("train").has_id(i) for i in spend)
    assert max(spend.values()) == pytest.approx(module.participation_cost() * max(
        module.ledger.participations(i) for i in spend))


def test_a_population_round_is_reproducible_from_its_seeds():
    def run():
        module = FederatedRound(nn.Linear(3, 1), selection=PoissonSelection(0.01), update=LocalSGD(lr=0.1),
                                server_privacy=CentralGaussian(noise_multiplier=1.0, target_delta=1e-6),
                                seed=3, noise_seed=4)
        trainer(max_epochs=2).fit(module, SyntheticPopulationDataModule(20_000, 10, seed=0))
        return module.hypotheses

    assert torch.equal(run(), run())


@pytest.fixture(autouse=True)
def _quiet():
    L.seed_everything(0, verbose=False)
