"""The federated DataModule base: ClientDataset, split_clients, padded, summary and the centralized loaders."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from torch.utils.data import RandomSampler, SequentialSampler

from lightning_dp.datamodules.federated import (
    ClientDataset,
    FederatedDataModule,
    derived_seed,
    padded,
    split_clients,
)


def _client(client_id: str, n: int, value: float = 1.0, features: int = 3) -> ClientDataset:
    return ClientDataset(client_id, torch.full((n, features), value), torch.arange(n, dtype=torch.float32) + value)


class _Fixed(FederatedDataModule):
    """A concrete FederatedDataModule over fixed clients."""

    input_shape = (3,)

    def __init__(self, train, val, test, **kwargs):
        super().__init__(**kwargs)
        self._lists = (train, val, test)
        self.builds = 0

    def _build_clients(self):
        self.builds += 1
        return self._lists


# ---------------------------------------------------------------- ClientDataset
def test_client_dataset_length_dataset_and_device_copy():
    client = _client("a", 4)
    assert len(client) == 4
    x, y = client.as_dataset()[2]
    assert torch.equal(x, client.x[2]) and float(y) == 3.0
    moved = client.to("cpu")
    assert moved.client_id == "a" and torch.equal(moved.x, client.x) and torch.equal(moved.y, client.y)


def test_client_dataset_rejects_mismatched_lengths():
    with pytest.raises(ValueError, match=r"'bad'.*same number of samples.*\(3, 2\).*\(2,\)"):
        ClientDataset("bad", torch.zeros(3, 2), torch.zeros(2))


# ---------------------------------------------------------------- split_clients
def test_split_clients_partitions_by_client_with_exact_sizes():
    items = [f"c{i}" for i in range(10)]
    train, val = split_clients(items, [0.7, 0.3], seed=0)
    assert (len(train), len(val)) == (7, 3)
    assert sorted(train + val) == sorted(items) and not set(train) & set(val)
    # Each group keeps the input order.
    assert train == sorted(train, key=items.index) and val == sorted(val, key=items.index)


def test_split_clients_is_seeded():
    items = list(range(50))
    assert split_clients(items, [0.5, 0.5], seed=3) == split_clients(items, [0.5, 0.5], seed=3)
    assert split_clients(items, [0.5, 0.5], seed=3) != split_clients(items, [0.5, 0.5], seed=4)


def test_split_clients_largest_remainder_sizes_and_client_objects():
    clients = [_client(str(i), i + 1) for i in range(7)]
    groups = split_clients(clients, [0.5, 0.25, 0.25], seed=0)
    # 3.5, 1.75, 1.75: floors 3, 1, 1; the two leftover clients go to the largest remainders (0.75, 0.75).
    assert [len(group) for group in groups] == [3, 2, 2]
    assert {c.client_id for g in groups for c in g} == {str(i) for i in range(7)}
    assert split_clients([], [0.7, 0.3], seed=0) == [[], []]


@pytest.mark.parametrize("fractions", [[0.7, 0.2], [1.2, -0.2], [0.0, 1.0], []])
def test_split_clients_rejects_bad_fractions(fractions):
    with pytest.raises(ValueError, match="fractions must be positive and sum to 1"):
        split_clients(list(range(5)), fractions, seed=0)


def test_derived_seed_is_stable_and_separates_keys():
    assert derived_seed(0, "train") == derived_seed(0, "train")
    assert len({derived_seed(0, "train"), derived_seed(0, "val"), derived_seed(1, "train")}) == 3
    assert 0 <= derived_seed(123, "x", 4) < 2**63


# ---------------------------------------------------------------- padded
def test_padded_shapes_values_and_mask():
    a, b, c = _client("a", 3, 1.0), _client("b", 1, 2.0), _client("c", 0, 3.0)
    x, y, mask = padded([a, b, c], pad_value=-1.0)
    assert x.shape == (3, 3, 3) and y.shape == (3, 3) and mask.shape == (3, 3) and mask.dtype == torch.bool
    assert mask.tolist() == [[True, True, True], [True, False, False], [False, False, False]]
    assert torch.equal(x[0], a.x) and torch.equal(y[1, :1], b.y)
    assert bool((x[1, 1:] == -1).all()) and bool((y[2] == -1).all())
    assert x.dtype == a.x.dtype and y.dtype == a.y.dtype


def test_padded_keeps_image_shapes_and_integer_labels():
    clients = [
        ClientDataset("a", torch.rand(2, 1, 4, 4), torch.tensor([1, 2])),
        ClientDataset("b", torch.rand(5, 1, 4, 4), torch.arange(5)),
    ]
    x, y, mask = padded(clients)
    assert x.shape == (2, 5, 1, 4, 4) and y.dtype == torch.int64 and mask.sum(1).tolist() == [2, 5]


def test_padded_rejects_empty_and_mixed_shapes():
    with pytest.raises(ValueError, match="at least one client"):
        padded([])
    with pytest.raises(ValueError, match="client 'b' has samples x \\(2,\\)"):
        padded([_client("a", 2), _client("b", 2, features=2)])


# ---------------------------------------------------------------- DataModule behaviour
def _module(**kwargs) -> _Fixed:
    train = [_client("t0", 2, 1.0), _client("t1", 5, 2.0), _client("t2", 3, 3.0)]
    val = [_client("v0", 4, 4.0)]
    return _Fixed(train, val, [], **kwargs)


def test_setup_builds_once_and_summary_counts():
    datamodule = _module()
    with pytest.raises(RuntimeError, match=r"call setup\(\) first"):
        datamodule.clients("train")
    datamodule.setup("fit")
    datamodule.setup("test")
    assert datamodule.builds == 1
    summary = datamodule.summary()
    assert summary["task"] == "regression" and summary["num_classes"] is None and summary["input_shape"] == (3,)
    assert summary["train"] == {"clients": 3, "samples": 10, "samples_min": 2, "samples_median": 3.0,
                                "samples_max": 5}
    assert summary["val"]["clients"] == 1 and summary["test"] == {
        "clients": 0, "samples": 0, "samples_min": None, "samples_median": None, "samples_max": None}
    with pytest.raises(ValueError, match="split must be one of"):
        datamodule.clients("training")


def test_setup_rejects_empty_or_overlapping_splits():
    with pytest.raises(ValueError, match="0 validation clients"):
        _Fixed([_client("a", 1)], [], []).setup()
    with pytest.raises(ValueError, match=r"\['a'\] are both training and validation clients"):
        _Fixed([_client("a", 1)], [_client("a", 2)], []).setup()


def test_centralized_loaders_concatenate_the_clients():
    datamodule = _module(batch_size=4, seed=7)
    datamodule.setup()
    view = datamodule.centralized()
    loader = view.train_dataloader()
    assert isinstance(loader.sampler, RandomSampler) and loader.batch_size == 4
    seen = torch.cat([y for _, y in loader])
    expected = torch.cat([client.y for client in datamodule.train_clients])
    assert torch.equal(seen.sort().values, expected.sort().values)
    # Same seed, same shuffled order.
    assert torch.equal(torch.cat([y for _, y in view.train_dataloader()]), seen)
    val_loader = view.val_dataloader()
    assert isinstance(val_loader.sampler, SequentialSampler)
    assert torch.equal(torch.cat([y for _, y in val_loader]), datamodule.val_clients[0].y)
    with pytest.raises(RuntimeError, match="the test split has no clients"):
        view.test_dataloader()
    assert len(datamodule.train_dataloader()) == 1  # the federated module's loader: one round per epoch
    x, y, mask = datamodule.padded("train")
    assert x.shape == (3, 5, 3) and mask.sum().item() == 10


@pytest.mark.parametrize(
    "kwargs, message",
    [({"batch_size": 0}, "batch_size must be a positive integer"),
     ({"num_workers": -1}, "num_workers must be a non-negative integer"),
     ({"seed": 1.5}, "seed must be an integer")],
)
def test_constructor_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        _module(**kwargs)


class _Linear(LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(3, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x).squeeze(-1), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val/loss", torch.nn.functional.mse_loss(self.layer(x).squeeze(-1), y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_usable_as_a_plain_lightning_datamodule_for_a_centralized_baseline():
    trainer = Trainer(max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, accelerator="cpu")
    trainer.fit(_Linear(), datamodule=_module(batch_size=4).centralized())
    assert trainer.state.finished and "val/loss" in trainer.callback_metrics


def test_former_datamodule_names_still_resolve_with_a_warning():
    """Configs written before the rename (class_path: lightning_dp.datamodules.FEMNIST) keep working, warned."""
    import lightning_dp.datamodules as datamodules
    from lightning_dp.datamodules import FEMNISTDataModule, HospitalChargesDataModule

    with pytest.warns(FutureWarning, match="class_path: lightning_dp.datamodules.FEMNISTDataModule"):
        assert datamodules.FEMNIST is FEMNISTDataModule
    with pytest.warns(FutureWarning):
        from lightning_dp.datamodules import HospitalCharges
    assert HospitalCharges is HospitalChargesDataModule
    with pytest.raises(AttributeError):
        datamodules.NoSuchData  # noqa: B018
    from lightning_dp.datamodules import femnist, synthetic  # the modules' paths too (their __all__ had them)

    with pytest.warns(FutureWarning, match="class_path: lightning_dp.datamodules.femnist.FEMNISTDataModule"):
        assert femnist.FEMNIST is FEMNISTDataModule
    with pytest.warns(FutureWarning):
        assert synthetic.GeneratedClients is synthetic.GeneratedClientsDataModule
