"""Issue 51, item 5: a federated DataModule's pooled samples state their users (``user_ids``: the client of every
sample), so that DPSGD(privacy_unit="user") trains on them through CentralizedView, from Python or a config."""

from __future__ import annotations

import sys

import pytest
import torch
from torch.utils.data import TensorDataset

from lightning_dp.datamodules import (
    CentralizedView,
    FEMNISTDataModule,
    FEMNISTFairnessDataModule,
    HospitalChargesDataModule,
    PooledClients,
    SyntheticFairnessDataModule,
    SyntheticLinearMixtureDataModule,
    SyntheticPopulationDataModule,
)
from lightning_dp.datamodules.federated import ClientDataset, SampleClients
from lightning_dp.datamodules.hospital import OFFICIAL_FILENAME
from lightning_dp.privacy.users import count_bounded, user_ids_of
from tests.datamodules.test_federated_femnist import write_leaf
from tests.datamodules.test_federated_hospital import fixture_rows, write_cms_csv


def _expected(clients) -> list[str]:
    return [client.client_id for client in clients for _ in range(len(client))]


def _check_pooled(datamodule, splits=("train", "val", "test")) -> dict[str, PooledClients]:
    """Every split's pooled dataset: the same tensors, in the same order, as before (the clients concatenated), and
    ``user_ids`` the client id of every sample, read as DPSGD reads it."""
    datamodule.setup()
    out = {}
    for split in splits:
        clients = datamodule.clients(split)
        pooled = datamodule.concatenated(split)
        assert isinstance(pooled, TensorDataset) and len(pooled.tensors) == 2
        assert torch.equal(pooled.tensors[0], torch.cat([c.x for c in clients]))
        assert torch.equal(pooled.tensors[1], torch.cat([c.y for c in clients]))
        assert pooled.tensors[0].dtype == clients[0].x.dtype and pooled.tensors[1].dtype == clients[0].y.dtype
        assert list(pooled.user_ids) == _expected(clients) == user_ids_of(pooled)
        assert len(pooled.user_ids) == len(pooled)
        out[split] = pooled
    return out


@pytest.mark.parametrize("module", [
    lambda: SyntheticLinearMixtureDataModule(num_clients=7, samples_per_client=3, num_val_clients=2,
                                             num_test_clients=2, seed=1),
    lambda: SyntheticFairnessDataModule(num_clients=9, samples_per_client=4, num_val_clients=3, num_test_clients=2,
                                        seed=2),
], ids=["linear-mixture", "fairness"])
def test_the_synthetic_clients_are_the_users(module):
    datamodule = module()
    pooled = _check_pooled(datamodule)
    users = pooled["train"].user_ids
    assert users[0] == datamodule.train_clients[0].client_id and users[-1] == datamodule.train_clients[-1].client_id
    facts = count_bounded(user_ids_of(pooled["train"]), 2)
    assert facts.users == len(datamodule.train_clients) and facts.kept == 2 * facts.users


def test_the_providers_are_the_users_of_the_hospital_data(tmp_path):
    """The CMS file identifies providers, not patients: a row (one provider's average of one DRG) belongs to its
    provider."""
    path = write_cms_csv(tmp_path / "cms" / OFFICIAL_FILENAME, fixture_rows())
    datamodule = HospitalChargesDataModule(path=path, seed=0)
    pooled = _check_pooled(datamodule, splits=("train", "val"))  # no test clients
    providers = {str(10001 + i) for i in range(20)}
    assert set(pooled["train"].user_ids) | set(pooled["val"].user_ids) == providers  # unknown-ZIP rows dropped
    assert not set(pooled["train"].user_ids) & set(pooled["val"].user_ids)
    assert count_bounded(user_ids_of(pooled["train"]), 4).largest == 4  # one row per DRG of the 4 chosen


@pytest.mark.parametrize("module", [FEMNISTDataModule, FEMNISTFairnessDataModule])
def test_the_writers_are_the_users_of_femnist(tmp_path, module):
    train_sizes = {f"f{i:04d}_{i:02d}": 2 + i % 3 for i in range(8)}
    write_leaf(tmp_path / "femnist", train_sizes=train_sizes, test_sizes={w: 1 for w in train_sizes})
    datamodule = module(data_dir=tmp_path / "femnist", val_fraction=0.25, seed=0)
    pooled = _check_pooled(datamodule)
    assert set(pooled["train"].user_ids) | set(pooled["val"].user_ids) == set(train_sizes)
    assert set(pooled["test"].user_ids) == set(train_sizes)  # each writer's test samples, under its writer id


def test_a_population_is_not_pooled():
    datamodule = SyntheticPopulationDataModule(num_clients=10, num_val_clients=2)
    datamodule.setup()
    with pytest.raises(RuntimeError, match="population"):
        datamodule.concatenated("train")


def test_sample_clients_are_run_lengths_read_like_a_list():
    users = SampleClients(["a", "b", "c", "d"], [2, 0, 3, 1])
    listed = ["a", "a", "c", "c", "c", "d"]
    assert len(users) == 6 and list(users) == users.tolist() == listed
    assert [users[i] for i in range(-6, 6)] == listed + listed and users[1:4] == listed[1:4]
    for bad in (6, -7, 1.0, True):
        with pytest.raises(IndexError):
            users[bad]
    with pytest.raises(ValueError, match="one non-negative size per id"):
        SampleClients(["a"], [1, 2])
    assert list(SampleClients([], [])) == [] and "6 samples of 4 clients" in repr(users)
    with pytest.raises(ValueError, match="at least one client"):
        PooledClients([])
    pooled = PooledClients([ClientDataset("x", torch.zeros(0, 2), torch.zeros(0)),
                            ClientDataset("y", torch.ones(2, 2), torch.ones(2))])
    assert list(pooled.user_ids) == ["y", "y"]


def test_the_view_delegates_to_its_federated_module():
    federated = SyntheticFairnessDataModule(num_clients=10, num_val_clients=4, num_test_clients=4, batch_size=8,
                                            seed=3)
    view = CentralizedView(federated)
    assert (view.task, view.num_classes, view.input_shape) == ("classification", 2, (2,))
    logged = view.hparams_initial
    assert logged["data/view"] == "centralized" and logged["data/num_clients"] == 10 and logged["data/seed"] == 3
    view.setup("fit")
    assert list(view.train_dataloader().dataset.user_ids) == _expected(federated.train_clients)
    with pytest.raises(TypeError, match="must be a FederatedDataModule"):
        CentralizedView(object())


def test_a_config_nests_the_federated_module_and_dpsgd_trains_per_user(tmp_path, monkeypatch):
    """`lightning-dp fit` config: CentralizedView's init_args hold the federated DataModule's class_path; DPSGD with
    privacy_unit='user' reads the generated clients as users and bounds each to k records; the federated module's
    hyperparameters reach the logger as data/<name>."""
    from lightning_dp.callbacks import DPSGD
    from lightning_dp.cli import LightningDPCLI

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["lightning-dp"])
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    config = tmp_path / "view.yaml"
    config.write_text("""
model:
  class_path: lightning_dp.models.ImageClassifier
  init_args:
    network: {class_path: lightning_dp.models.LogisticRegression, init_args: {in_features: 2, num_classes: 2}}
    num_classes: 2
    log_nonprivate_metrics: false
data:
  class_path: lightning_dp.datamodules.CentralizedView
  init_args:
    federated:
      class_path: lightning_dp.datamodules.SyntheticFairnessDataModule
      init_args: {num_clients: 30, samples_per_client: 5, num_val_clients: 5, num_test_clients: 5, batch_size: 40}
trainer:
  max_steps: 2
  logger: {class_path: tests.helpers.RecordingLogger}
  log_every_n_steps: 1
  enable_progress_bar: false
  enable_model_summary: false
  enable_checkpointing: false
  callbacks:
    - class_path: lightning_dp.callbacks.DPSGD
      init_args:
        noise_multiplier: 1.0
        max_grad_norm: 1.0
        privacy_unit: user
        max_examples_per_user: 3
        user_accounting: mixture
        accountant_kwargs: {value_discretization_interval: 1.0e-3}
        seed: 1
        log_nonprivate_metrics: false
""")
    cli = LightningDPCLI(args=["fit", "--config", str(config)])
    assert isinstance(cli.datamodule, CentralizedView)
    assert isinstance(cli.datamodule.federated, SyntheticFairnessDataModule)
    (dp,) = [cb for cb in cli.trainer.callbacks if isinstance(cb, DPSGD)]
    assert cli.trainer.global_step == 2
    assert dp.data_facts.dataset_size == 30 * 3  # N: every user's 5 records bounded to 3
    assert 0 < dp.epsilon < float("inf")
    params = cli.trainer.logger.params  # the federated DataModule's hyperparameters are logged through the view
    assert params["data/view"] == "centralized" and params["data/num_clients"] == 30
    assert params["data/batch_size"] == 40 and not any(name.startswith("data/federated") for name in params)
    assert params["privacy/privacy_unit"] == "user" and params["privacy/max_examples_per_user"] == 3
