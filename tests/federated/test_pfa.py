"""Personalized-DP federated learning: per-client budgets, PFA's projection against numpy, the public/private
splits (direct and budget-agnostic), and the PFA aggregator in a round."""

from __future__ import annotations

import logging

import lightning as L
import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_dp.datamodules import SyntheticLinearMixtureDataModule
from lightning_dp.federated import FederatedRound
from lightning_dp.federated.budgets import FixedBudgets
from lightning_dp.federated.local_dp_sgd import steps_per_participation
from lightning_dp.federated.parts import PFA, FedAvg, LocalDPSGD, UniformSelection
from lightning_dp.federated.pfa import pfa_combine, split_by_budgets, split_by_norms, top_subspace
from lightning_dp.models import LinearRegression
from lightning_dp.privacy.ledger import RecordLedger
from tests.helpers import ACCELERATORS

logging.getLogger("absl").setLevel(logging.ERROR)


def _projector(basis: np.ndarray) -> np.ndarray:
    return basis @ basis.T


def test_top_subspace_is_the_top_eigenvectors_of_the_second_moment_matrix():
    rng = np.random.default_rng(0)
    u = rng.normal(size=(6, 40)) + 3 * rng.normal(size=(1, 40))
    for k in (1, 3):
        got = top_subspace(torch.tensor(u), k).numpy()
        values, vectors = np.linalg.eigh(u.T @ u)
        want = vectors[:, np.argsort(values)[::-1][:k]]
        np.testing.assert_allclose(_projector(got), _projector(want), atol=1e-10)
        np.testing.assert_allclose(got.T @ got, np.eye(k), atol=1e-12)


@pytest.mark.parametrize("weighted", [False, True])
def test_pfa_combine_equals_a_direct_numpy_computation_per_layer(weighted):
    rng = np.random.default_rng(1)
    sizes = [12, 5]
    updates = rng.normal(size=(7, 17))
    public = np.array([True, False, True, False, False, True, False])
    eps = rng.uniform(0.5, 10, size=7)
    w = eps if weighted else np.ones(7)
    got, subspace = pfa_combine(torch.tensor(updates), torch.tensor(public), layer_sizes=sizes, k=2,
                                weights=torch.tensor(eps) if weighted else None)
    pieces = []
    for lo, hi in ((0, 12), (12, 17)):
        pub, priv = updates[public, lo:hi], updates[~public, lo:hi]
        values, vectors = np.linalg.eigh(pub.T @ pub)
        v = vectors[:, np.argsort(values)[::-1][:2]]
        mean_pub = (w[public, None] * pub).sum(0) / w[public].sum()
        mean_priv = (w[~public, None] * priv).sum(0) / w[~public].sum()
        pieces.append((w[public].sum() * mean_pub + w[~public].sum() * (v @ v.T @ mean_priv)) / w.sum())
    np.testing.assert_allclose(got.numpy(), np.concatenate(pieces), atol=1e-10)
    assert [tuple(b.shape) for b in subspace.bases] == [(12, 2), (5, 2)]


def test_the_centered_projection_is_pfas_codes_affine_projection_through_the_public_mean():
    rng = np.random.default_rng(4)
    updates = rng.normal(size=(6, 9)) + 2.0
    public = np.array([True, True, True, False, False, False])
    got, _ = pfa_combine(torch.tensor(updates), torch.tensor(public), layer_sizes=[9], k=1, centered=True)
    pub = updates[public]
    mean = pub.mean(0)
    values, vectors = np.linalg.eigh((pub - mean).T @ (pub - mean))
    v = vectors[:, [np.argmax(values)]]
    projected = mean + v @ v.T @ (updates[~public].mean(0) - mean)
    np.testing.assert_allclose(got.numpy(), (3 * pub.mean(0) + 3 * projected) / 6, atol=1e-10)


def test_a_single_public_client_is_not_centred_as_in_pfas_code():
    # PFA's __standardize returns one public update as it is: the subspace is that update's direction through 0.
    # Centred, the lone update would be a zero row with an arbitrary eigenvector, and the private mean would be
    # projected on a coordinate axis instead (what the project did before, issue 27).
    rng = np.random.default_rng(5)
    updates = rng.normal(size=(4, 9)) + 1.0
    public = np.array([False, True, False, False])
    got, subspace = pfa_combine(torch.tensor(updates), torch.tensor(public), layer_sizes=[5, 4], k=1, centered=True)
    pieces = []
    for lo, hi in ((0, 5), (5, 9)):
        u = updates[1, lo:hi] / np.linalg.norm(updates[1, lo:hi])
        projected = u * (u @ updates[~public, lo:hi].mean(0))
        pieces.append((updates[1, lo:hi] + 3 * projected) / 4)
    np.testing.assert_allclose(got.numpy(), np.concatenate(pieces), atol=1e-10)
    assert float(subspace.origin.abs().max()) == 0.0
    uncentred, _ = pfa_combine(torch.tensor(updates), torch.tensor(public), layer_sizes=[5, 4], k=1)
    np.testing.assert_allclose(got.numpy(), uncentred.numpy(), atol=1e-12)


def test_budgets_drawn_from_pfas_distributions():
    from lightning_dp.federated.budgets import DISTRIBUTIONS, DistributionBudgets

    for name in DISTRIBUTIONS:
        eps, public = DistributionBudgets(name, seed=3).assign_with_groups(list(range(10)))
        assert eps == DistributionBudgets(name, seed=3).assign(list(range(10)))  # the seed fixes the draw
        assert all(e > 0 for e in eps) and any(public)
        assert public == [e > DISTRIBUTIONS[name].threshold for e in eps]
    eps, public = DistributionBudgets("MixGauss1", seed=0).assign_with_groups(list(range(1000)))
    assert abs(np.mean(public) - 0.1) < 5 * np.sqrt(0.09 / 1000)  # the mixture weight 0.1 of N(10, 0.1^2)
    assert all(abs(e - 0.1) < 0.06 or abs(e - 10) < 0.6 for e in eps)  # N(0.1, 0.01^2) and N(10, 0.1^2)
    with pytest.raises(ValueError, match="MixGauss9"):
        DistributionBudgets("MixGauss9")


def test_pfa_plus_projects_on_the_given_bases_and_the_groups_degenerate_to_averages():
    rng = np.random.default_rng(2)
    updates = torch.tensor(rng.normal(size=(4, 6)))
    public = torch.tensor([True, True, False, False])
    from lightning_dp.federated.pfa import Subspace

    previous = Subspace([top_subspace(torch.tensor(rng.normal(size=(3, 6))), 1)], torch.zeros(6, dtype=torch.float64))
    got, _ = pfa_combine(updates, public, layer_sizes=[6], k=1, previous=previous)
    v = previous.bases[0].numpy()
    u = updates.numpy()
    want = (2 * u[:2].mean(0) + 2 * (v @ v.T @ u[2:].mean(0))) / 4
    np.testing.assert_allclose(got.numpy(), want, atol=1e-12)
    only_private, subspace = pfa_combine(updates, torch.zeros(4, dtype=torch.bool), layer_sizes=[6])
    np.testing.assert_allclose(only_private.numpy(), u.mean(0), atol=1e-12)
    assert subspace is None
    only_public, _ = pfa_combine(updates, torch.ones(4, dtype=torch.bool), layer_sizes=[6])
    np.testing.assert_allclose(only_public.numpy(), u.mean(0), atol=1e-12)


def test_the_indirect_split_recovers_a_planted_split_from_noisy_update_norms():
    """10 clients, d = 7 850: a shared signal plus DP noise of std sigma C / B per coordinate, 3 public clients at
    sigma 0.5 and 7 private at sigma 2: the norms separate, the mixture finds the planted split exactly."""
    rng = np.random.default_rng(3)
    d, clip, batch = 7850, 1.0, 64
    signal = rng.normal(size=d) * 0.002
    sigmas = np.array([0.5] * 3 + [2.0] * 7)
    updates = signal + rng.normal(size=(10, d)) * (sigmas[:, None] * clip / batch)
    public = split_by_norms(np.linalg.norm(updates, axis=1))
    assert public.tolist() == [True] * 3 + [False] * 7


def test_direct_splits_from_revealed_budgets():
    eps = [0.5, 8.0, 1.0, 0.7, 9.0, 0.6, 0.9, 1.1, 0.8, 0.55]
    assert split_by_budgets(eps, rule="top_fraction", public_fraction=0.1).tolist() == [
        False, False, False, False, True, False, False, False, False, False]
    assert split_by_budgets(eps, rule="gmm").tolist() == [e > 5 for e in eps]
    with pytest.raises(ValueError, match="rule='median'"):
        split_by_budgets(eps, rule="median")


# ------------------------------------------------------------------------------------------------ in the round
def _trainer(**kwargs):
    defaults = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                    accelerator="cpu", devices=1, max_epochs=3, num_sanity_val_steps=0, limit_val_batches=0,
                    log_every_n_steps=1)
    defaults.update(kwargs)
    return L.Trainer(**defaults)


BUDGETS = [0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 8.0, 8.0, 8.0]


def _pdpfl(aggregator, *, train_at="own", seed=0):
    update = LocalDPSGD(epochs=1, lr=0.05, batch_size=5, budgets=FixedBudgets(BUDGETS, public=[e > 1 for e in BUDGETS]),
                        delta=1e-3, accountant="rdp", train_at=train_at)
    return FederatedRound(LinearRegression(), selection=UniformSelection(10), update=update, aggregator=aggregator,
                          seed=seed, noise_seed=1), update


def _data():
    return SyntheticLinearMixtureDataModule(num_clients=10, num_val_clients=2, seed=0)


@pytest.mark.parametrize("accelerator", ACCELERATORS)
def test_each_client_spends_at_most_its_own_budget_and_equals_the_library_value(accelerator):
    m, update = _pdpfl(FedAvg())
    dm = _data()
    _trainer(max_epochs=4, accelerator=accelerator).fit(m, dm)
    for client, budget in zip(dm.train_clients, BUDGETS):
        spent = update.ledger.spent(client.client_id)
        assert spent <= budget and spent > budget / 1.2
        (sigma, q, steps), = update.ledger.history(client.client_id)
        n = len(client)
        assert q == min(1.0, 5 / n) and steps == 4 * steps_per_participation(n, 5, 1)
        probe = RecordLedger(delta=1e-3, accountant="rdp")
        probe.charge("x", noise_multiplier=sigma, sample_rate=q, num_steps=steps)
        assert spent == probe.spent("x")


def test_minimum_trains_everyone_at_the_smallest_budget():
    m, update = _pdpfl(FedAvg(), train_at="minimum")
    _trainer(max_epochs=2).fit(m, _data())
    assert update.client_budgets() == [0.5] * 10
    assert len(set(update.noise_multipliers())) == 1


@pytest.mark.parametrize("accelerator", ACCELERATORS)
def test_the_server_never_sees_a_budget_in_the_indirect_mode_and_the_split_is_scored(accelerator):
    seen = []

    class Spy(PFA):
        def observe(self, **kwargs):
            seen.append(kwargs["budgets"])
            super().observe(**kwargs)

    aggregator = Spy(partition="indirect")
    m, update = _pdpfl(aggregator)
    t = _trainer(max_epochs=3, accelerator=accelerator)
    t.fit(m, _data())
    assert seen == [None, None, None]
    assert len(aggregator.split()) == 10
    assert 0.0 <= float(t.logged_metrics["pdpfl/public_clients"]) <= 10


def test_the_direct_mode_sees_the_clients_own_budgets():
    seen = []

    class Spy(PFA):
        def observe(self, **kwargs):
            seen.append(kwargs["budgets"])
            super().observe(**kwargs)

    seen_ids = []

    class IdSpy(Spy):
        def observe(self, **kwargs):
            seen_ids.append(kwargs["client_ids"])
            super().observe(**kwargs)

    m, _ = _pdpfl(IdSpy(partition="direct", rule="gmm"))
    dm = _data()
    t = _trainer(max_epochs=2)
    t.fit(m, dm)
    own = {c.client_id: e for c, e in zip(dm.train_clients, BUDGETS)}
    assert len(seen) == 2 and all(b == [own[cid] for cid in ids] for b, ids in zip(seen, seen_ids))
    assert float(t.logged_metrics["pdpfl/public_clients"]) == 3.0
    assert float(t.logged_metrics["pdpfl/split_accuracy"]) == 1.0


def test_weipfa_needs_revealed_budgets():
    with pytest.raises(ValueError, match="WeiPFA"):
        PFA(partition="indirect", weighted=True)


def test_resume_with_pfa_equals_the_uninterrupted_run(tmp_path):
    def fit(epochs, ckpt=None, callbacks=()):
        m, update = _pdpfl(PFA(partition="indirect", plus=True))
        _trainer(max_epochs=epochs, enable_checkpointing=bool(callbacks), callbacks=list(callbacks)).fit(
            m, _data(), ckpt_path=ckpt)
        return m, update

    full, full_update = fit(4, callbacks=[ModelCheckpoint(dirpath=tmp_path, every_n_epochs=1, save_top_k=-1,
                                                           filename="{epoch}")])
    resumed, resumed_update = fit(4, ckpt=str(tmp_path / "epoch=1.ckpt"))
    assert torch.equal(full.hypotheses, resumed.hypotheses)
    assert full_update.ledger.state_dict() == resumed_update.ledger.state_dict()
    assert full.aggregator.split() == resumed.aggregator.split()


def test_a_direct_split_without_budgets_and_several_hypotheses_are_refused_before_training():
    from lightning.pytorch.utilities.exceptions import MisconfigurationException

    from lightning_dp.federated.parts import LocalSGD

    m = FederatedRound(LinearRegression(), selection=UniformSelection(10), update=LocalSGD(),
                       aggregator=PFA(partition="direct"), seed=0, noise_seed=1)
    with pytest.raises(MisconfigurationException, match="revealed privacy budgets"):
        _trainer().fit(m, _data())
    # local DP-SGD with a given noise multiplier and no budget: nothing to reveal either
    m = FederatedRound(LinearRegression(), selection=UniformSelection(10),
                       update=LocalDPSGD(batch_size=5, noise_multiplier=1.0), aggregator=PFA(partition="direct"),
                       seed=0, noise_seed=1)
    t = _trainer()
    with pytest.raises(MisconfigurationException, match="revealed privacy budgets"):
        t.fit(m, _data())
    assert t.global_step == 0
    m = FederatedRound(LinearRegression(), num_hypotheses=2, selection=UniformSelection(10), update=LocalSGD(),
                       aggregator=PFA(partition="indirect"), seed=0, noise_seed=1)
    with pytest.raises(MisconfigurationException, match="num_hypotheses=2"):
        _trainer().fit(m, _data())
