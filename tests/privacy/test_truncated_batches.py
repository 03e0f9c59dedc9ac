"""Batches of one shape: Poisson sampling truncated to a bound, padded, and accounted as dp-accounting's
TruncatedSubsampledGaussianDpEvent (lightning_dp.privacy.sampling, accounting, planning)."""

from __future__ import annotations

import math

import dp_accounting as dpa
import numpy as np
import pytest
import torch
from scipy import stats
from torch.utils.data import DataLoader, TensorDataset

from lightning_dp.privacy.accounting import PLDAccountant, get_accountant
from lightning_dp.privacy.planning import BatchShape, DataFacts
from lightning_dp.privacy.sampling import (
    PaddingCollate,
    PoissonBatchSampler,
    poisson_dataloader,
    split_indices,
    suggest_max_batch_size,
)


def library_epsilon(size, q, bound, sigma, steps, delta=1e-5, interval=1e-4):
    event = dpa.SelfComposedDpEvent(dpa.TruncatedSubsampledGaussianDpEvent(size, q, bound, sigma), steps)
    return dpa.pld.PLDAccountant(value_discretization_interval=interval).compose(event).get_epsilon(delta)


@pytest.mark.parametrize("size,q,bound,sigma,steps", [(10_000, 0.01, 120, 1.0, 300), (1_000, 0.05, 60, 0.9, 40),
                                                      (201, 0.1, 24, 1.1, 20), (5_000, 0.02, 150, 2.0, 1000)])
def test_epsilon_is_the_librarys_truncated_event(size, q, bound, sigma, steps):
    accountant = PLDAccountant(truncated_batch_size=bound, dataset_size=size)
    accountant.step(noise_multiplier=sigma, sample_rate=q, num_steps=steps // 2)
    accountant.step(noise_multiplier=sigma, sample_rate=q, num_steps=steps - steps // 2)
    assert accountant.get_epsilon(1e-5) == pytest.approx(library_epsilon(size, q, bound, sigma, steps), rel=1e-9)
    # the event the record states is the one the library composes
    lib = dpa.pld.PLDAccountant().compose(accountant.to_dp_event())
    assert lib.get_epsilon(1e-5) == pytest.approx(accountant.get_epsilon(1e-5), rel=1e-9)
    # truncation never helps: at least plain Poisson sampling's epsilon
    plain = PLDAccountant()
    plain.step(noise_multiplier=sigma, sample_rate=q, num_steps=steps)
    assert accountant.get_epsilon(1e-5) >= plain.get_epsilon(1e-5) - 1e-9


def test_a_bound_never_reached_costs_nothing_and_an_often_reached_one_costs_much():
    plain = PLDAccountant()
    plain.step(noise_multiplier=1.0, sample_rate=0.01, num_steps=500)
    loose = PLDAccountant(truncated_batch_size=400, dataset_size=10_000)  # P(overflow) ~ 1e-100
    loose.step(noise_multiplier=1.0, sample_rate=0.01, num_steps=500)
    tight = PLDAccountant(truncated_batch_size=110, dataset_size=10_000)  # P(overflow) ~ 0.15
    tight.step(noise_multiplier=1.0, sample_rate=0.01, num_steps=500)
    assert loose.get_epsilon(1e-5) == pytest.approx(plain.get_epsilon(1e-5), rel=1e-9)
    assert tight.get_epsilon(1e-5) > 2 * plain.get_epsilon(1e-5)


def test_epsilon_grows_with_the_records_the_batch_is_drawn_from():
    """BatchShape accounts N + 1 records (a neighbour holds one more): valid only if epsilon does not decrease with
    the size; checked on a grid around the bound (not a proof)."""
    for q, bound, sigma, steps in [(0.01, 130, 1.0, 300), (0.05, 60, 0.8, 100), (0.1, 16, 1.5, 50)]:
        sizes = range(int(0.6 * bound / q), int(1.1 * bound / q), max(1, int(0.08 * bound / q)))
        eps = []
        for size in sizes:
            a = PLDAccountant(truncated_batch_size=bound, dataset_size=size, value_discretization_interval=1e-3)
            a.step(noise_multiplier=sigma, sample_rate=q, num_steps=steps)
            eps.append(a.get_epsilon(1e-5))
        assert all(b >= a - 1e-9 for a, b in zip(eps, eps[1:])), eps


def test_truncated_accountant_state_round_trips_and_refuses_another_shape():
    a = PLDAccountant(truncated_batch_size=24, dataset_size=201)
    a.step(noise_multiplier=1.1, sample_rate=0.1, num_steps=20)
    b = PLDAccountant(truncated_batch_size=24, dataset_size=201)
    b.load_state_dict(a.state_dict())
    assert b.get_epsilon(1e-5) == a.get_epsilon(1e-5) and b.history == a.history
    with pytest.raises(ValueError, match="mid-run"):
        PLDAccountant().load_state_dict(a.state_dict())
    with pytest.raises(ValueError, match="mid-run"):
        PLDAccountant(truncated_batch_size=24, dataset_size=202).load_state_dict(a.state_dict())
    with pytest.raises(ValueError, match="mid-run"):
        a.truncate(dataset_size=201, truncated_batch_size=30)
    a.truncate(dataset_size=201, truncated_batch_size=24)  # the same: fine
    assert a.unit_key() != PLDAccountant().unit_key()  # a grid refuses to compose them


def test_interim_and_calibration_keep_the_truncated_event():
    from lightning_dp.privacy.calibration import calibrate_noise_multiplier

    kwargs = {"truncated_batch_size": 24, "dataset_size": 201}
    a = PLDAccountant(**kwargs)
    a.step(noise_multiplier=1.1, sample_rate=0.1, num_steps=20)
    assert a.interim_epsilon(1e-5) == pytest.approx(library_epsilon(201, 0.1, 24, 1.1, 20, interval=1e-3), rel=1e-9)
    sigma = calibrate_noise_multiplier(target_epsilon=3.0, target_delta=1e-5, sample_rate=0.1, steps=20,
                                       accountant="pld", accountant_kwargs=kwargs)
    assert library_epsilon(201, 0.1, 24, sigma, 20) <= 3.0
    assert library_epsilon(201, 0.1, 24, sigma / 1.02, 20) > 3.0  # tight: 2 % less noise exceeds the target


@pytest.mark.parametrize("kwargs,match", [
    ({"truncated_batch_size": 10}, "pass both"),
    ({"truncated_batch_size": 0, "dataset_size": 10}, "whole number"),
    ({"truncated_batch_size": 10, "dataset_size": 100, "adjacency": "replace"}, "add/remove"),
    ({"truncated_batch_size": 10, "dataset_size": 100, "examples_per_user": 2}, "user-level"),
    ({"truncated_batch_size": 10, "dataset_size": 100, "pessimistic_estimate": False}, "pessimistic"),
])
def test_truncation_refusals(kwargs, match):
    with pytest.raises(ValueError, match=match):
        get_accountant("pld", **kwargs)


def test_truncation_keeps_a_uniform_subset_from_the_secret_stream():
    # q = 0.5 of 40: about 20 drawn, bound 8: always truncated
    sampler = PoissonBatchSampler(None, 8, False, num_samples=40, sample_rate=0.5, seed=7, max_batch_size=8,
                                  steps_per_epoch=4000)
    counts = np.zeros(40)
    for k in range(4000):
        batch = sampler.batch(k)
        assert len(batch) == 8 and batch == sorted(set(batch))
        counts[batch] += 1
    # every index is kept with the same probability, 8 / 40 (a chi-square test at level 1e-4: false failure 1e-4)
    assert stats.chisquare(counts).pvalue > 1e-4
    # the same seed draws the same batches (a resumed run), another seed others
    again = PoissonBatchSampler(None, 8, False, num_samples=40, sample_rate=0.5, seed=7, max_batch_size=8)
    assert [again.batch(k) for k in range(5)] == [sampler.batch(k) for k in range(5)]
    # below the bound the batch is plain Poisson sampling's
    plain = PoissonBatchSampler(None, 8, False, num_samples=40, sample_rate=0.5, seed=7)
    loose = PoissonBatchSampler(None, 8, False, num_samples=40, sample_rate=0.5, seed=7, max_batch_size=40)
    assert [loose.batch(k) for k in range(20)] == [plain.batch(k) for k in range(20)]


def test_rows_say_how_many_rows_of_each_micro_batch_are_real():
    sampler = PoissonBatchSampler(None, 5, False, num_samples=100, sample_rate=0.1, seed=1, max_batch_size=24,
                                  parts=3, steps_per_epoch=6)
    parts = list(sampler)
    for k in range(6):
        whole = sampler.batch(k)
        assert [sampler.rows(k, j) for j in range(3)] == [len(p) for p in split_indices(whole, 3)]
        assert [len(p) for p in parts[3 * k:3 * k + 3]] == [sampler.rows(k, j) for j in range(3)]
    with pytest.raises(ValueError, match="multiple of world_size x parts"):
        PoissonBatchSampler(None, 5, False, num_samples=100, sample_rate=0.1, seed=1, max_batch_size=25, parts=3)


def test_padding_collate_fills_blank_rows_of_every_kind():
    data = [({"x": torch.ones(3), "n": 4, "ok": True}, 2, "word", np.ones(2))]
    collate = PaddingCollate(torch.utils.data.default_collate, data, rows=3)
    batch = collate([({"x": torch.full((3,), 5.0), "n": 7, "ok": True}, 1, "w", np.full(2, 3.0))])
    assert batch[0]["x"].tolist() == [[5.0] * 3, [0.0] * 3, [0.0] * 3]
    assert batch[0]["n"].tolist() == [7, 0, 0] and batch[0]["ok"].tolist() == [True, False, False]
    assert batch[1].tolist() == [1, 0, 0] and list(batch[2]) == ["w", "", ""]
    assert batch[3].tolist() == [[3.0, 3.0], [0.0, 0.0], [0.0, 0.0]]
    assert collate([])[1].tolist() == [0, 0, 0]  # an empty Poisson batch: all padding
    with pytest.raises(TypeError, match="cannot be blanked"):
        PaddingCollate(torch.utils.data.default_collate, [object()], rows=2)


def test_poisson_loader_yields_one_shape():
    data = TensorDataset(torch.randn(300, 4), torch.randint(0, 3, (300,)))
    loader = poisson_dataloader(DataLoader(data, batch_size=30), sample_rate=0.1, seed=0, max_batch_size=48,
                                parts=2)
    shapes = {tuple(x.shape) for x, _ in loader}
    assert shapes == {(24, 4)}


def test_suggested_bound_meets_the_overflow_probability():
    for n, q, p, world, parts in [(60_000, 256 / 60_000, 1e-6, 1, 1), (1797, 64 / 1797, 1e-3, 2, 2),
                                  (10**6, 1e-4, 1e-9, 4, 1)]:
        m = suggest_max_batch_size(n, q, overflow_probability=p, world_size=world, parts=parts)
        unit = world * parts
        assert m % unit == 0
        assert stats.binom.sf(m, n + 1, q) <= p < stats.binom.sf(m - unit, n + 1, q)  # the smallest multiple


def test_processes_deal_out_one_truncated_sample():
    """Under DDP the truncation is one draw over the whole set (a per-process truncation would depend on which
    records share a process, which a neighbour that shifts the shards changes): the processes' batches together are
    the single process' batch, each at most max_batch_size / world_size."""
    one = PoissonBatchSampler(None, 5, False, num_samples=101, sample_rate=0.3, seed=4, max_batch_size=24)
    ranks = [PoissonBatchSampler(None, 5, False, num_samples=101, sample_rate=0.3, seed=4, max_batch_size=24,
                                 rank=r, world_size=3) for r in range(3)]
    for k in range(50):
        parts = [r.batch(k) for r in ranks]
        assert sorted(i for p in parts for i in p) == one.batch(k) and max(map(len, parts)) <= 8
    with pytest.raises(ValueError, match="multiple of world_size x parts = 6"):
        PoissonBatchSampler(None, 5, False, num_samples=101, sample_rate=0.3, seed=4, max_batch_size=20, rank=0,
                            world_size=3, parts=2)


def test_batch_shape_refuses_what_cannot_be_padded_evenly_or_is_below_the_expected_batch():
    facts = DataFacts.of(dataset_size=1000, batch_size=50, world_size=2, parts=2, poisson_sampling=True)
    with pytest.raises(ValueError, match="multiple of 4"):
        BatchShape.of(250, facts, world_size=2)
    with pytest.raises(ValueError, match="below the expected batch size 200"):
        BatchShape.of(196, facts, world_size=2)
    shape = BatchShape.of("auto", facts, world_size=2, overflow_probability=1e-6)
    assert shape.per_rank * 2 == shape.max_batch_size and shape.accounted_size == 1001
    assert shape.overflow_probability <= 1e-6
