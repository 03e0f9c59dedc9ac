"""SyntheticFairnessDataModule and FEMNISTFairnessDataModule: groups, label rules, sensitive ids, determinism, errors."""

from __future__ import annotations

import pytest
import torch

from lightning_dp.datamodules import ClientDataset, FEMNISTFairnessDataModule, SyntheticFairnessDataModule
from lightning_dp.datamodules.federated import padded_sensitive
from tests.datamodules.test_federated_femnist import _expected_images, write_leaf


def test_synthetic_fairness_groups_and_label_rules_match_the_paper():
    dm = SyntheticFairnessDataModule(seed=3)
    dm.setup()
    summary = dm.summary()
    assert summary["train"]["clients_per_group"] == [800, 200]  # the paper: 1000 clients, 800 in g1, 200 in g2
    assert summary["train"]["samples"] == 10_000 and summary["train"]["samples_min"] == 10
    assert summary["val"]["clients_per_group"] == [80, 20] and summary["test"]["clients_per_group"] == [160, 40]
    theta1, theta2 = dm.true_thetas
    for split in ("train", "val", "test"):
        for client in dm.clients(split):
            group = dm.group_of[client.client_id]
            assert torch.equal(client.sensitive, torch.full((10,), group))
            assert client.y.dtype == torch.int64 and client.x.dtype == torch.float32
            x = client.x.double()
            scores = dm.scores[client.client_id]
            u = scores - x @ (theta1 if group == 0 else theta2) - (15.0 if group else 0.0)
            assert bool(((u > -1e-6) & (u < 1 + 1e-6)).all())  # u ~ U[0, 1), up to float32 inputs
            # the paper's rules, literally through the sigmoid (the module compares the scores, exactly)
            if group == 0:
                expected = torch.sigmoid(scores) >= 0.5
            else:
                expected = torch.sigmoid(scores - 15.0) <= 0.5
            far = (scores - 15.0 * group).abs() > 1e-9  # away from the threshold, where rounding could differ
            assert torch.equal(client.y.bool()[far], expected[far])
    rates = summary["train"]["positive_rate_per_group"]
    # P(x^T theta + u >= 0) with x ~ N(0, I): Phi(0.5 / |theta1|) = 0.525; g2: Phi(-0.5 / |theta2|) = 0.467
    assert rates[0] == pytest.approx(0.525, abs=0.02) and rates[1] == pytest.approx(0.467, abs=0.03)


def test_synthetic_fairness_is_deterministic_and_splits_are_independent_streams():
    a, b = SyntheticFairnessDataModule(num_clients=20, seed=1), SyntheticFairnessDataModule(num_clients=20, seed=1, num_test_clients=7)
    a.setup(), b.setup()
    for ca, cb in zip(a.train_clients + a.val_clients, b.train_clients + b.val_clients):
        assert ca.client_id == cb.client_id and torch.equal(ca.x, cb.x) and torch.equal(ca.y, cb.y)
    c = SyntheticFairnessDataModule(num_clients=20, seed=2)
    c.setup()
    assert not torch.equal(a.train_clients[0].x, c.train_clients[0].x)
    assert len(b.test_clients) == 7 and b.summary()["test"]["clients_per_group"] == [6, 1]


@pytest.mark.parametrize("kwargs, message", [
    ({"minority_fraction": 1.0}, "minority_fraction"),
    ({"minority_fraction": 0}, "minority_fraction"),
    ({"num_test_clients": 0}, "num_test_clients"),
    ({"thetas": [[1.0, 2.0]]}, "exactly two hypotheses"),
    ({"thetas": [[1.0], [2.0, 3.0]]}, "one common length"),
    ({"minority_offset": float("nan")}, "minority_offset"),
    ({"x_distribution": "beta"}, "x_distribution"),
])
def test_synthetic_fairness_rejects_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SyntheticFairnessDataModule(**kwargs)


def test_uniform_inputs_option():
    dm = SyntheticFairnessDataModule(num_clients=10, num_val_clients=2, num_test_clients=2, x_distribution="uniform")
    dm.setup()
    x = torch.cat([c.x for c in dm.train_clients])
    assert float(x.min()) >= 0 and float(x.max()) < 1


def test_client_dataset_sensitive_validation_and_padding():
    with pytest.raises(ValueError, match="sensitive must be an integer tensor of shape"):
        ClientDataset("a", torch.zeros(3, 2), torch.zeros(3), torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="sensitive must be an integer tensor"):
        ClientDataset("a", torch.zeros(3, 2), torch.zeros(3), torch.zeros(3))
    a = ClientDataset("a", torch.zeros(3, 2), torch.zeros(3), torch.tensor([0, 1, 1]))
    assert torch.equal(a.to("cpu").sensitive, a.sensitive)
    b = ClientDataset("b", torch.zeros(1, 2), torch.zeros(1), torch.tensor([2]))
    assert padded_sensitive([a, b]).tolist() == [[0, 1, 1], [2, -1, -1]]
    assert padded_sensitive([a, ClientDataset("c", torch.zeros(1, 2), torch.zeros(1))]) is None


@pytest.fixture
def leaf_fairness_dir(tmp_path):
    train_sizes = {f"f{i:04d}_{i % 100:02d}": 3 + i % 4 for i in range(10)}
    test_sizes = {writer: 2 for writer in train_sizes}
    directory = tmp_path / "femnist"
    return directory, write_leaf(directory, train_sizes=train_sizes, test_sizes=test_sizes)


def test_femnist_fairness_minority_is_rotated_with_flipped_parity_labels(leaf_fairness_dir):
    directory, written = leaf_fairness_dir
    dm = FEMNISTFairnessDataModule(data_dir=directory, minority_fraction=0.2, val_fraction=0.2, seed=0)
    dm.setup()
    assert sum(dm.rotated.values()) == 2  # exactly 20 % of the 10 writers
    summary = dm.summary()
    assert summary["train"]["clients_per_group"][1] + summary["val"]["clients_per_group"][1] == 2
    for split, source in (("train", "train"), ("val", "train"), ("test", "test")):
        for client in dm.clients(split):
            x, y = written[source][client.client_id]
            group = int(dm.rotated[client.client_id])
            assert torch.equal(client.sensitive, torch.full((len(y),), group))
            assert torch.equal(client.x, _expected_images(x, bool(group)))
            expected = [int(c % 2 == 0) if group == 0 else int(c % 2 == 1) for c in y.tolist()]
            assert client.y.tolist() == expected
    assert dm.num_classes == 2 and dm.num_groups == 2


def test_femnist_fairness_minority_draw_is_seeded(leaf_fairness_dir):
    directory, _ = leaf_fairness_dir
    draws = []
    for seed in (0, 0, 1, 2, 3):
        dm = FEMNISTFairnessDataModule(data_dir=directory, minority_fraction=0.3, seed=seed)
        dm.setup()
        draws.append(frozenset(w for w, r in dm.rotated.items() if r))
        assert len(draws[-1]) == 3
    assert draws[0] == draws[1] and len(set(draws)) > 2
    with pytest.raises(KeyError, match="not loaded"):
        dm.is_rotated("nobody")
    with pytest.raises(ValueError, match="minority_fraction"):
        FEMNISTFairnessDataModule(data_dir=directory, minority_fraction=1.5)
