"""FEMNIST on generated LEAF JSON directories, and on a mocked Hugging Face `datasets`."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from lightning_dp.datamodules.femnist import FEMNISTDataModule, LEAFFormatError, read_leaf_dir, rotate_images


def _writer_data(rng: np.random.Generator, count: int) -> dict[str, list]:
    # float32 values survive the JSON round trip exactly (float32 -> repr of float64 -> float32).
    x = rng.random((count, 784), dtype=np.float32)
    y = rng.integers(0, 62, size=count)
    return {"x": x.tolist(), "y": y.tolist()}


def write_leaf(directory: Path, *, train_sizes: dict[str, int], test_sizes: dict[str, int], shards: int = 2,
               seed: int = 0) -> dict[str, dict[str, tuple[np.ndarray, np.ndarray]]]:
    """Write LEAF-format ``train/`` and ``test/`` shards; return ``{split: {writer: (x, y)}}`` as written."""
    rng = np.random.default_rng(seed)
    written = {}
    for split, sizes in (("train", train_sizes), ("test", test_sizes)):
        (directory / split).mkdir(parents=True, exist_ok=True)
        users = list(sizes)
        written[split] = {}
        for shard in range(shards):
            members = users[shard::shards]
            data = {"users": members, "num_samples": [sizes[u] for u in members], "user_data": {}}
            for user in members:
                record = _writer_data(rng, sizes[user])
                data["user_data"][user] = record
                written[split][user] = (np.asarray(record["x"], dtype=np.float32), np.asarray(record["y"]))
            name = f"all_data_{shard}_niid_05_keep_0_{split}_9.json"
            (directory / split / name).write_text(json.dumps(data))
    return written


@pytest.fixture
def leaf_dir(tmp_path):
    train_sizes = {f"f{i:04d}_{i % 100:02d}": 3 + i % 4 for i in range(10)}
    test_sizes = {writer: 1 + i % 2 for i, writer in enumerate(train_sizes)}
    test_sizes["f9999_99"] = 2  # a writer with test samples only: not a client
    directory = tmp_path / "femnist"
    return directory, write_leaf(directory, train_sizes=train_sizes, test_sizes=test_sizes)


def _expected_images(x: np.ndarray, rotated: bool, invert: bool = True) -> torch.Tensor:
    images = x.reshape(-1, 1, 28, 28)
    if invert:
        images = 1.0 - images
    if rotated:
        images = np.rot90(images, k=1, axes=(-2, -1))
    return torch.from_numpy(np.ascontiguousarray(images))


# ---------------------------------------------------------------- LEAF source
def test_read_leaf_dir(leaf_dir):
    directory, written = leaf_dir
    data = read_leaf_dir(directory / "train")
    assert set(data) == set(written["train"])
    for writer, (x, y) in data.items():
        assert x.dtype == np.float32 and x.shape[1] == 784 and y.dtype == np.int64
        assert np.array_equal(x, written["train"][writer][0]) and np.array_equal(y, written["train"][writer][1])
    only = read_leaf_dir(directory / "test", users=["f0000_00"])
    assert list(only) == ["f0000_00"]


def test_writers_are_clients_with_shapes_dtypes_and_split(leaf_dir):
    directory, written = leaf_dir
    datamodule = FEMNISTDataModule(data_dir=directory, val_fraction=0.3, seed=0)
    datamodule.setup()
    assert datamodule.task == "classification" and datamodule.num_classes == 62
    assert datamodule.input_shape == (1, 28, 28)
    train_ids = {c.client_id for c in datamodule.train_clients}
    val_ids = {c.client_id for c in datamodule.val_clients}
    assert (len(train_ids), len(val_ids)) == (7, 3) and not train_ids & val_ids
    assert train_ids | val_ids == set(written["train"])
    for client in datamodule.train_clients + datamodule.val_clients + datamodule.test_clients:
        assert client.x.dtype == torch.float32 and client.x.shape[1:] == (1, 28, 28)
        assert client.y.dtype == torch.int64 and client.x.is_contiguous()
    # The test clients hold each writer's LEAF test samples; a test-only writer is not a client.
    test_ids = [c.client_id for c in datamodule.test_clients]
    assert set(test_ids) == train_ids | val_ids and "f9999_99" not in test_ids
    for client in datamodule.test_clients:
        assert torch.equal(client.y, torch.from_numpy(written["test"][client.client_id][1]))
    assert datamodule.summary()["test"]["samples"] == sum(len(written["test"][w][1]) for w in test_ids)


def test_rotation_matches_np_rot90_on_train_and_test_samples(leaf_dir):
    directory, written = leaf_dir
    datamodule = FEMNISTDataModule(data_dir=directory, seed=1)
    datamodule.setup()
    assert 0 < sum(datamodule.rotated.values()) < len(datamodule.rotated)  # both kinds present here
    for split, clients in (("train", datamodule.train_clients + datamodule.val_clients),
                           ("test", datamodule.test_clients)):
        for client in clients:
            expected = _expected_images(written[split][client.client_id][0], datamodule.rotated[client.client_id])
            assert torch.equal(client.x, expected)
    assert set(datamodule.rotated) == set(written["train"])
    summary = datamodule.summary()
    assert summary["train"]["rotated"] + summary["val"]["rotated"] == sum(datamodule.rotated.values())


def test_rotate_images_is_np_rot90():
    images = torch.rand(3, 1, 28, 28)
    expected = np.rot90(images.numpy(), k=1, axes=(-2, -1))
    assert torch.equal(rotate_images(images), torch.from_numpy(expected.copy()))
    assert torch.equal(rotate_images(rotate_images(rotate_images(rotate_images(images)))), images)


def test_invert_false_keeps_leaf_pixels(leaf_dir):
    directory, written = leaf_dir
    datamodule = FEMNISTDataModule(data_dir=directory, invert=False, rotate_probability=0.0)
    datamodule.setup()
    assert not any(datamodule.rotated.values())
    for client in datamodule.train_clients:
        assert torch.equal(client.x, _expected_images(written["train"][client.client_id][0], False, invert=False))


def test_rotation_probability_and_per_writer_seeding(leaf_dir):
    directory, _ = leaf_dir
    writers = [f"w{i:05d}" for i in range(4000)]
    for probability in (0.5, 0.2):
        datamodule = FEMNISTDataModule(data_dir=directory, rotate_probability=probability, seed=0)
        share = np.mean([datamodule.is_rotated(w) for w in writers])
        # Binomial(4000, p): standard deviation <= 0.008; tolerance 0.04 is 5 sigma (false failures < 1e-6).
        assert share == pytest.approx(probability, abs=0.04)
    assert not any(FEMNISTDataModule(data_dir=directory, rotate_probability=0.0).is_rotated(w) for w in writers[:200])
    assert all(FEMNISTDataModule(data_dir=directory, rotate_probability=1.0).is_rotated(w) for w in writers[:200])
    # A writer's draw depends on (seed, writer) only: not on the other writers loaded.
    full = FEMNISTDataModule(data_dir=directory, seed=2)
    full.setup()
    subset = FEMNISTDataModule(data_dir=directory, seed=2, max_clients=4)
    subset.setup()
    assert all(subset.rotated[w] == full.rotated[w] for w in subset.rotated)


def test_max_clients_and_determinism(leaf_dir):
    directory, written = leaf_dir
    first = FEMNISTDataModule(data_dir=directory, max_clients=5, seed=3)
    first.setup()
    ids = [c.client_id for c in first.train_clients + first.val_clients]
    assert len(ids) == 5 and set(ids) <= set(written["train"])
    assert first.summary()["writers_available"] == 10
    assert {c.client_id for c in first.test_clients} == set(ids)
    again = FEMNISTDataModule(data_dir=directory, max_clients=5, seed=3)
    again.setup()
    assert [c.client_id for c in again.train_clients + again.val_clients] == ids
    assert all(torch.equal(a.x, b.x) for a, b in zip(first.train_clients, again.train_clients))
    assert again.rotated == first.rotated
    other_ids = set()
    for seed in (4, 5, 6):
        other = FEMNISTDataModule(data_dir=directory, max_clients=5, seed=seed)
        other.setup()
        other_ids.add(tuple(c.client_id for c in other.train_clients + other.val_clients))
    assert len(other_ids | {tuple(ids)}) > 1


def test_missing_files_and_format_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"(?s)train/\*\.json, test/\*\.json.*source='huggingface'"):
        FEMNISTDataModule(data_dir=tmp_path / "none").setup()
    bad = tmp_path / "bad" / "train"
    bad.mkdir(parents=True)
    record = {"users": ["u"], "num_samples": [1], "user_data": {"u": {"x": [[0.5] * 783], "y": [1]}}}
    (bad / "a.json").write_text(json.dumps(record))
    with pytest.raises(LEAFFormatError, match="a.json: user 'u': x must be a list of 784-pixel images"):
        FEMNISTDataModule(data_dir=tmp_path / "bad").setup()
    record["user_data"]["u"] = {"x": [[0.5] * 784], "y": [62]}
    (bad / "a.json").write_text(json.dumps(record))
    with pytest.raises(LEAFFormatError, match=r"labels must be in 0..61"):
        FEMNISTDataModule(data_dir=tmp_path / "bad").setup()
    (bad / "a.json").write_text(json.dumps({"writers": []}))
    with pytest.raises(LEAFFormatError, match="expected LEAF keys"):
        FEMNISTDataModule(data_dir=tmp_path / "bad").setup()


def test_missing_test_dir_warns_and_leaves_test_empty(tmp_path):
    directory = tmp_path / "femnist"
    write_leaf(directory, train_sizes={"a": 2, "b": 2, "c": 2}, test_sizes={})
    for path in (directory / "test").iterdir():
        path.unlink()
    datamodule = FEMNISTDataModule(data_dir=directory, val_fraction=0.34)
    with pytest.warns(UserWarning, match="no LEAF test files"):
        datamodule.setup()
    assert datamodule.test_clients == []


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"source": "tff"}, "source must be 'leaf' or 'huggingface'"),
        ({"val_fraction": 0.0}, "val_fraction must be a number in the open interval"),
        ({"rotate_probability": 1.5}, r"rotate_probability must be a probability in \[0, 1\]"),
        ({"max_clients": 1}, "max_clients must be at least 2"),
        ({"max_clients": 0}, "max_clients must be a positive integer"),
        ({"invert": 1}, "invert must be True or False"),
        ({"hf_test_fraction": 1.0}, "hf_test_fraction must be a number in the open interval"),
    ],
)
def test_constructor_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        FEMNISTDataModule(**kwargs)


# ---------------------------------------------------------------- Hugging Face source (mocked)
class _FakeSplit:
    """The slice of the `datasets.Dataset` API the loader uses: column access and select()."""

    def __init__(self, columns: dict[str, list]):
        self.columns = columns

    def __getitem__(self, name: str) -> list:
        return self.columns[name]

    def __len__(self) -> int:
        return len(self.columns["writer_id"])

    def select(self, indices):
        return _FakeSplit({name: [values[i] for i in indices] for name, values in self.columns.items()})


def _fake_hf(sizes: dict[str, int], seed: int = 0):
    rng = np.random.default_rng(seed)
    columns = {"image": [], "writer_id": [], "hsf_id": [], "character": []}
    for writer, count in sizes.items():
        for _ in range(count):
            columns["image"].append(rng.integers(0, 256, size=(28, 28), dtype=np.uint8))
            columns["writer_id"].append(writer)
            columns["hsf_id"].append(0)
            columns["character"].append(int(rng.integers(0, 62)))
    # Interleave the writers, as a shuffled parquet would.
    order = rng.permutation(len(columns["writer_id"]))
    columns = {name: [values[i] for i in order] for name, values in columns.items()}
    calls = []

    def load_dataset(name, cache_dir=None):
        calls.append((name, cache_dir))
        return {"train": _FakeSplit(columns)}

    return types.SimpleNamespace(load_dataset=load_dataset), columns, calls


def test_huggingface_source_partitions_by_writer(tmp_path, monkeypatch):
    sizes = {"f0001_01": 8, "f0002_02": 12, "f0003_03": 4, "f0004_04": 8, "f0005_05": 9}
    fake, columns, calls = _fake_hf(sizes)
    monkeypatch.setitem(sys.modules, "datasets", fake)
    datamodule = FEMNISTDataModule(data_dir=tmp_path / "hf", source="huggingface", val_fraction=0.4, hf_test_fraction=0.25,
                         seed=0)
    datamodule.prepare_data()
    datamodule.setup()
    assert calls[0] == ("flwrlabs/femnist", str(tmp_path / "hf"))
    clients = datamodule.train_clients + datamodule.val_clients
    assert (len(datamodule.train_clients), len(datamodule.val_clients)) == (3, 2)
    tests = {c.client_id: c for c in datamodule.test_clients}
    for client in clients:
        writer = client.client_id
        rows = [i for i, w in enumerate(columns["writer_id"]) if w == writer]
        n_test = {8: 2, 12: 3, 4: 1, 9: 2}[sizes[writer]]
        assert len(client) == sizes[writer] - n_test and len(tests[writer]) == n_test
        # Together, the writer's train and test samples are exactly its rows (matched by image content).
        images = np.stack([columns["image"][i] for i in rows]).astype(np.float32) / 255.0
        expected = _expected_images(images, datamodule.rotated[writer])
        got = torch.cat([client.x, tests[writer].x])
        key = lambda t: sorted(t.reshape(len(t), -1).sum(1).tolist())  # noqa: E731
        assert key(got) == pytest.approx(key(expected))
        labels = sorted(columns["character"][i] for i in rows)
        assert sorted(torch.cat([client.y, tests[writer].y]).tolist()) == labels
        assert client.x.dtype == torch.float32 and client.x.shape[1:] == (1, 28, 28)


def test_huggingface_source_without_datasets_installed(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # makes `import datasets` fail
    with pytest.raises(ImportError, match=r"pip install 'lightning-dp\[hf\]'.*source='leaf'"):
        FEMNISTDataModule(data_dir=tmp_path, source="huggingface")  # refused before any data is read
