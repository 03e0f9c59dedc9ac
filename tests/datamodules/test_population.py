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
