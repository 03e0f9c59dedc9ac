"""SyntheticLinearMixtureDataModule: the seed's two-hypothesis linear regression clients."""

from __future__ import annotations

import pytest
import torch
from jsonargparse import ArgumentParser

from lightning_dp.datamodules.synthetic import DEFAULT_THETAS, SyntheticLinearMixtureDataModule


def _built(**kwargs) -> SyntheticLinearMixtureDataModule:
    datamodule = SyntheticLinearMixtureDataModule(**kwargs)
    datamodule.setup()
    return datamodule


def _by_cluster(datamodule, clients, cluster):
    members = [c for c in clients if datamodule.cluster_of[c.client_id] == cluster]
    return torch.cat([c.x for c in members]).double(), torch.cat([c.y for c in members]).double()


def test_defaults_sizes_shapes_and_balanced_assignment():
    datamodule = _built()
    assert DEFAULT_THETAS == ((5.0, 6.0), (4.0, -4.5))
    assert datamodule.task == "regression" and datamodule.num_classes is None and datamodule.input_shape == (2,)
    summary = datamodule.summary()
    assert (summary["train"]["clients"], summary["val"]["clients"], summary["test"]["clients"]) == (100, 20, 0)
    assert summary["train"]["clients_per_hypothesis"] == [50, 50]
    assert summary["val"]["clients_per_hypothesis"] == [10, 10]
    for client in datamodule.train_clients + datamodule.val_clients:
        assert client.x.shape == (10, 2) and client.y.shape == (10,)
        assert client.x.dtype == torch.float32 and client.y.dtype == torch.float32
    assert datamodule.train_clients[0].client_id == "train-000" and datamodule.val_clients[-1].client_id == "val-019"
    assert torch.equal(datamodule.theta_of("val-003"), datamodule.true_thetas[datamodule.cluster_of["val-003"]])


def test_samples_follow_the_linear_model_with_uniform_noise():
    datamodule = _built(samples_per_client=20)
    for cluster in range(2):
        x, y = _by_cluster(datamodule, datamodule.train_clients, cluster)
        theta = datamodule.true_thetas[cluster]
        # The residual is exactly the noise u ~ U[0, 1) (up to float32 rounding of x and y).
        residual = y - x @ theta
        assert float(residual.min()) > -1e-4 and float(residual.max()) < 1.0 + 1e-4
        # Least squares with an intercept recovers theta and the noise mean 0.5. With 1000 samples the
        # standard error is about 0.29 / sqrt(1000) ~ 0.01; the tolerance 0.06 is 6 standard errors
        # (false-failure rate below 1e-8 for any seed).
        design = torch.cat([x, torch.ones(len(x), 1, dtype=torch.float64)], dim=1)
        solution = torch.linalg.lstsq(design, y[:, None]).solution.flatten()
        assert torch.allclose(solution[:2], theta, atol=0.06)
        assert float(solution[2]) == pytest.approx(0.5, abs=0.06)


def test_uniform_inputs_custom_thetas_proportions_and_noise():
    thetas = [[1.0, 0.0, -1.0], [0.0, 2.0, 0.0], [3.0, 3.0, 3.0]]
    datamodule = _built(num_clients=10, num_val_clients=5, num_test_clients=4, thetas=thetas,
                        proportions=[0.6, 0.2, 0.2], x_distribution="uniform", noise_range=(0.0, 0.0))
    assert datamodule.input_shape == (3,) and datamodule.num_hypotheses == 3
    assert datamodule.summary()["train"]["clients_per_hypothesis"] == [6, 2, 2]
    assert datamodule.summary()["test"]["clients"] == 4
    for client in datamodule.train_clients + datamodule.val_clients + datamodule.test_clients:
        assert float(client.x.min()) >= 0.0 and float(client.x.max()) < 1.0
        expected = client.x.double() @ datamodule.theta_of(client.client_id)
        assert torch.allclose(client.y.double(), expected, atol=1e-5)  # no noise


def test_determinism_and_independent_split_streams():
    first, second = _built(seed=3), _built(seed=3)
    for a, b in zip(first.train_clients + first.val_clients, second.train_clients + second.val_clients):
        assert a.client_id == b.client_id and torch.equal(a.x, b.x) and torch.equal(a.y, b.y)
    assert first.cluster_of == second.cluster_of
    other = _built(seed=4)
    assert not torch.equal(first.train_clients[0].x, other.train_clients[0].x)
    # The training clients do not depend on how many validation clients are generated.
    fewer_val = _built(seed=3, num_val_clients=2)
    assert all(torch.equal(a.x, b.x) for a, b in zip(first.train_clients, fewer_val.train_clients))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"num_clients": 0}, "num_clients must be a positive integer"),
        ({"samples_per_client": 0}, "samples_per_client must be a positive integer"),
        ({"num_val_clients": 0}, "num_val_clients must be a positive integer"),
        ({"num_test_clients": -1}, "num_test_clients must be a non-negative integer"),
        ({"thetas": [[1.0, 2.0], [3.0]]}, "thetas must be a non-empty list"),
        ({"thetas": []}, "thetas must be a non-empty list"),
        ({"proportions": [1.0]}, "proportions must be 2 non-negative numbers"),
        ({"proportions": [0.0, 0.0]}, "positive sum"),
        ({"x_distribution": "gaussian"}, "x_distribution must be 'normal'"),
        ({"noise_range": (1.0, 0.0)}, "low <= high"),
        ({"noise_range": 1.0}, "noise_range must be a pair"),
    ],
)
def test_constructor_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SyntheticLinearMixtureDataModule(**kwargs)


def test_configurable_from_a_config():
    parser = ArgumentParser()
    parser.add_class_arguments(SyntheticLinearMixtureDataModule, "data")
    config = parser.parse_args(["--data.thetas=[[1, 2], [3, 4], [5, 6]]", "--data.num_clients=9",
                                "--data.x_distribution=uniform"])
    datamodule = SyntheticLinearMixtureDataModule(**config.data.as_dict())
    datamodule.setup()
    assert datamodule.num_hypotheses == 3 and datamodule.summary()["train"]["clients_per_hypothesis"] == [3, 3, 3]
