"""Client populations (lightning_dp/datamodules/federated.py: ClientPopulation; lightning_dp/datamodules/population.py:
SyntheticPopulation and its DataModule)."""

from __future__ import annotations

import statistics

import pytest
import torch

from lightning_dp.datamodules.federated import ClientDataset, client_ids, client_sizes, padded
from lightning_dp.datamodules.population import SyntheticPopulation, SyntheticPopulationDataModule


@pytest.mark.parametrize("task", ["regression", "binary", "image"])
def test_a_client_reads_the_same_data_whichever_clients_it_is_drawn_with(task: str) -> None:
    shape = (3, 4, 4) if task == "image" else (5,)
    pop = SyntheticPopulation(500, task=task, seed=3, samples=(2, 6), input_shape=shape, num_clusters=3)
    x, y, mask = pop.rows([7, 3, 499])
    x2, y2, mask2 = pop.rows([499, 8, 7])
    width = int(mask2[[2, 0]].sum(1).max())
    for a, b in ((0, 2), (2, 0)):
        n = int(mask[a].sum())
        assert torch.equal(x[a, :n], x2[b, :n]) and torch.equal(y[a, :n], y2[b, :n])
    assert width <= 6 and x.shape[2:] == shape and mask.sum(1).tolist() == pop.sizes[[7, 3, 499]].tolist()
    assert not x[~mask].any() and not y[~mask].any()  # padding is zero, as padded() pads
    one = pop[3]
    assert one.client_id == "train-3" and torch.equal(one.x, x[1, : len(one)]) and torch.equal(one.y, y[1, : len(one)])
    assert y.dtype == (torch.int64 if task == "image" else torch.float32)
    if task == "binary":
        assert set(y[mask].tolist()) <= {0.0, 1.0}


def test_padded_rows_of_a_population_is_padded_of_its_clients() -> None:
    pop = SyntheticPopulation(50, task="regression", seed=1, samples=(1, 4))
    index = [4, 0, 31, 4]
    expected = padded([pop[i] for i in index])
    for got, want in zip(pop.rows(index), expected):
        assert torch.equal(got, want)


def test_sizes_ids_and_the_generated_signal() -> None:
    pop = SyntheticPopulation(20_000, task="regression", seed=0, samples=(1, 4), input_shape=(3,), noise=0.1)
    sizes = client_sizes(pop)
    assert sizes.min() == 1 and sizes.max() == 4 and len(pop) == 20_000
    counts = torch.bincount(sizes)[1:].double() / len(pop)
    assert torch.allclose(counts, torch.full((4,), 0.25, dtype=torch.float64), atol=0.02)  # uniform over 1..4
    assert list(client_ids(pop, [0, 19_999])) == ["train-0", "train-19999"]
    assert pop.has_id("train-17") and not pop.has_id("train-20000") and not pop.has_id("train-07")
    assert not pop.has_id("val-1") and not pop.has_id(17)
    # one cluster: least squares on the pooled samples recovers the cluster's weights to the noise's precision
    x, y, mask = pop.rows(list(range(2000)))
    w = torch.linalg.lstsq(x[mask].double(), y[mask].double()[:, None]).solution[:, 0]
    assert torch.allclose(w.float(), pop._weights[0], atol=0.02)


def test_images_are_exact_sums_the_same_in_any_block() -> None:
    """The "image" task's x = prototype + A z is exact in float32 on its grids (population.py, _image_grids): it
    equals the float64 sum to the last bit, so one matrix product over a block of 400 clients gives every client the
    bits it has alone; given A, pixel f's noise has variance sum_d A_fd^2 (the clamps and grids change it by far less than the
    tolerance, 5 relative standard errors of a variance from 2,500 samples: 0.14)."""
    from lightning_dp.datamodules.population import _CLUSTER, _LABEL, _X
    from lightning_dp.privacy.noise import counter_normal, counter_uniform

    pop = SyntheticPopulation(5_000, task="image", seed=4, samples=(1, 4), input_shape=(2, 5, 5), num_clusters=3,
                              num_classes=4, latent_dim=16)
    block = list(range(0, 2000, 5))
    x, y, mask = pop.rows(block)
    assert x.dtype == torch.float32 and not x[~mask].any() and not y[~mask].any()
    at, j = mask.nonzero(as_tuple=True)
    who = torch.tensor(block)[at]
    # a naive reference in float64, with the grids applied as the population's documentation states them
    z = counter_normal(4, 0, _X, who[:, None], j[:, None] * 16 + torch.arange(16)[None])
    z = ((z.clamp(-8, 8) * 64).round() / 64)
    label = (counter_uniform(4, 0, _LABEL, who, j) * 4).long().clamp_max(3)
    cluster = (counter_uniform(4, 0, _CLUSTER, who) * 3).long().clamp_max(2)
    proto = pop._prototypes.double()[cluster, label]
    reference = proto + z @ pop._mixing.double()
    assert torch.equal(x[at, j].reshape(len(who), -1).double(), reference)  # exact: no rounding anywhere
    assert torch.equal(y[at, j], label)
    for position in (0, 57, 399):
        alone, _, alone_mask = pop.rows([block[position]])
        n = int(alone_mask.sum())
        assert torch.equal(alone[0, :n], x[position, :n])
    # the grids: A's entries are multiples of 2^-9 (1/128 of its standard deviation 1/4), z's of 1/64
    assert torch.equal(pop._mixing * 2**9, (pop._mixing * 2**9).round())
    assert abs(float(pop._mixing.double().std()) - 0.25) < 0.02
    many = SyntheticPopulation(2_500, task="image", seed=5, samples=(1, 1), input_shape=(3,), num_classes=1)
    xs, _, _ = many.rows(list(range(2_500)))
    noise = xs[:, 0].double() - many._prototypes[0, 0].double()
    expected = many._mixing.double().square().sum(0)  # given A, pixel f's noise has variance sum_d A_fd^2
    assert torch.allclose(noise.var(dim=0), expected, rtol=0.14)
    with pytest.raises(ValueError, match=r"latent_dim=1024 is not allowed: at most 1023"):
        SyntheticPopulation(10, task="image", latent_dim=1024)


def test_the_image_grids_bound_every_partial_sum_below_float32s_significand() -> None:
    """For every latent_dim allowed, the largest values the clamps let through (on the grids, after the rounding) sum
    to fewer than 2^24 steps of the sum grid, and every term is a multiple of it: the proof of exactness, checked."""
    import math

    from lightning_dp.datamodules.population import _CLAMP, _image_grids, _on_grid

    for d in range(1, 1024):
        z_step, a_step, sum_step = _image_grids(d, "test")
        assert z_step * a_step == sum_step
        z_max = float(_on_grid(torch.tensor([1e9], dtype=torch.float64), 1.0, z_step))
        a_max = float(_on_grid(torch.tensor([1e9], dtype=torch.float64), 1 / math.sqrt(d), a_step))
        p_max = float(_on_grid(torch.tensor([1e9], dtype=torch.float64), 1.0, sum_step))
        assert z_max <= _CLAMP and a_max <= _CLAMP / math.sqrt(d) and p_max <= _CLAMP
        assert (p_max + d * z_max * a_max) / sum_step <= 2**24, d


def test_population_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="id_prefix"):
        from lightning_dp.datamodules.federated import ClientPopulation

        class Digits(ClientPopulation):
            sizes = torch.ones(1, dtype=torch.int64)

            def rows(self, index):
                raise NotImplementedError

        Digits("c1")
    with pytest.raises(ValueError, match="samples"):
        SyntheticPopulation(10, samples=(3, 2))
    with pytest.raises(ValueError, match="task"):
        SyntheticPopulation(10, task="images")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="split"):
        SyntheticPopulation(10, split="training")
    with pytest.raises(ValueError, match="num_clients"):
        SyntheticPopulationDataModule(-1)
    pop = SyntheticPopulation(10)
    with pytest.raises(IndexError):
        pop.rows([10])
    with pytest.raises(IndexError):
        pop[10]
    with pytest.raises(ValueError, match="non-empty"):
        pop.rows([])


def test_the_datamodule_keeps_populations_and_summarizes_them_from_their_sizes() -> None:
    dm = SyntheticPopulationDataModule(100_000, 30, 10, task="binary", input_shape=[4], seed=2)
    dm.setup("fit")
    train = dm.clients("train")
    assert isinstance(train, SyntheticPopulation) and len(train) == 100_000
    assert dm.task == "classification" and dm.num_classes == 2 and dm.input_shape == (4,)
    summary = dm.summary()
    sizes = client_sizes(dm.clients("val")).tolist()
    assert summary["val"] == {"clients": 30, "samples": sum(sizes), "samples_min": min(sizes),
                              "samples_median": float(statistics.median(sizes)), "samples_max": max(sizes)}
    assert summary["train"]["clients"] == 100_000
    x, y, mask = dm.padded_rows("val", [2, 0])
    assert torch.equal(x[1, : int(mask[1].sum())], dm.clients("val")[0].x)
    with pytest.raises(RuntimeError, match="padded_rows"):
        dm.concatenated("train")
    assert dm.clients("val")[0].client_id == "val-0"  # the splits' ids never meet


def test_summary_median_matches_statistics_median_for_lists() -> None:
    from lightning_dp.datamodules.federated import _size_summary

    for sizes in ([3], [1, 4], [5, 1, 2, 2], [7, 1, 3]):
        clients = [ClientDataset(str(i), torch.zeros(n, 1), torch.zeros(n)) for i, n in enumerate(sizes)]
        assert _size_summary(clients)["samples_median"] == float(statistics.median(sizes))
    assert _size_summary([])["samples_median"] is None
