"""FederatedVisionDataModule: MNIST / Fashion-MNIST IDX and CIFAR-10 batch fixtures partitioned by flwr-datasets."""

from __future__ import annotations

import io
import pickle
import tarfile

import lightning as L
import numpy as np
import pytest
import torch

from lightning_dp.datamodules.cifar import CIFARFormatError, download_cifar10, load_cifar10, read_cifar_batch
from lightning_dp.datamodules.federated_vision import FederatedVisionDataModule, partition_labels
from lightning_dp.datamodules.idx import write_idx

pytest.importorskip("flwr_datasets")


def _images_with_ids(n: int, size: int = 28, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 images whose first three pixels encode their index (to trace every image to one client)."""
    g = torch.Generator().manual_seed(seed)
    images = torch.randint(0, 256, (n, size, size), generator=g, dtype=torch.uint8)
    idx = torch.arange(n)
    images[:, 0, 0], images[:, 0, 1], images[:, 0, 2] = (idx % 256).to(torch.uint8), (idx // 256 % 256).to(
        torch.uint8), (idx // 65536).to(torch.uint8)
    labels = torch.arange(n) % 10
    return images, labels[torch.randperm(n, generator=g)]


def _ids(x: torch.Tensor, mean: float = 0.0, std: float = 1.0) -> list[int]:
    raw = torch.round((x[:, 0, 0, :3] * std + mean) * 255).long()
    return (raw[:, 0] + 256 * raw[:, 1] + 65536 * raw[:, 2]).tolist()


@pytest.fixture
def mnist_dir(tmp_path):
    images, labels = _images_with_ids(1000)
    write_idx(tmp_path / "t10k-images-idx3-ubyte", images)
    write_idx(tmp_path / "t10k-labels-idx1-ubyte", labels.to(torch.uint8))
    train_images, train_labels = _images_with_ids(1200, seed=1)
    write_idx(tmp_path / "train-images-idx3-ubyte", train_images)
    write_idx(tmp_path / "train-labels-idx1-ubyte", train_labels.to(torch.uint8))
    return tmp_path


def build(data_dir, **kwargs):
    defaults = dict(dataset="mnist", data_dir=data_dir, subset="test", num_clients=20, num_val_clients=4,
                    num_test_clients=3, normalize=False, min_partition_size=5)
    defaults.update(kwargs)
    dm = FederatedVisionDataModule(**defaults)
    dm.setup("fit")
    return dm


@pytest.mark.parametrize("partition", ["iid", "pathological", "shards", "dirichlet"])
def test_every_image_is_in_at_most_one_client_and_val_clients_are_whole_partitions(mnist_dir, partition):
    dm = build(mnist_dir, partition=partition)
    assert len(dm.train_clients) == 20 and len(dm.val_clients) == 4 and len(dm.test_clients) == 3
    ids = [i for c in dm.train_clients + dm.val_clients for i in _ids(c.x)]
    test_ids = [i for c in dm.test_clients for i in _ids(c.x)]
    assert len(ids) == len(set(ids)) and not set(ids) & set(test_ids)
    assert len(ids) >= 800 - (60 if partition in ("shards", "pathological") else 0)  # 80 % of 1000 in the pool
    assert len(test_ids) == 200
    for c in dm.train_clients + dm.val_clients:
        assert c.x.shape[1:] == (1, 28, 28) and c.x.dtype == torch.float32 and c.y.dtype == torch.int64
        if partition == "pathological":
            assert torch.unique(c.y).numel() <= 2
        if partition == "dirichlet":
            assert len(c) >= 5
    if partition == "iid":
        sizes = [len(c) for c in dm.train_clients]
        assert max(sizes) - min(sizes) <= 1
        assert np.mean([torch.unique(c.y).numel() for c in dm.train_clients]) > 8  # about 33 images each, 10 classes


def test_the_partition_is_a_function_of_the_seed(mnist_dir):
    a, b = build(mnist_dir, partition="dirichlet", seed=3), build(mnist_dir, partition="dirichlet", seed=3)
    c = build(mnist_dir, partition="dirichlet", seed=4)
    assert [_ids(x.x) for x in a.train_clients] == [_ids(x.x) for x in b.train_clients]
    assert [_ids(x.x) for x in a.train_clients] != [_ids(x.x) for x in c.train_clients]


def test_full_subset_partitions_the_training_split_and_tests_on_the_test_split(mnist_dir):
    dm = build(mnist_dir, subset="full", normalize=True)
    assert sum(len(c) for c in dm.train_clients + dm.val_clients) == 1200
    assert sum(len(c) for c in dm.test_clients) == 1000
    assert abs(float(torch.cat([c.x for c in dm.train_clients]).mean())) < 2.5  # standardized with MNIST's stats


def test_missing_files_name_what_is_needed_and_leave_nothing_behind(tmp_path):
    target = tmp_path / "absent"
    with pytest.raises(FileNotFoundError, match="t10k-images-idx3-ubyte"):
        build(target)
    with pytest.raises(FileNotFoundError, match="(?s)test_batch.*cs.toronto.edu"):
        build(target, dataset="cifar10")
    assert not target.exists()


def test_bad_arguments_are_refused_with_the_allowed_values(tmp_path):
    with pytest.raises(ValueError, match="partition='niid'.*iid"):
        FederatedVisionDataModule(partition="niid")
    with pytest.raises(ValueError, match="dataset='cifar100'"):
        FederatedVisionDataModule(dataset="cifar100")
    with pytest.raises(ValueError, match="alpha"):
        FederatedVisionDataModule(alpha=0)
    with pytest.raises(ValueError, match="classes_per_client=11"):
        FederatedVisionDataModule(classes_per_client=11)


# ----------------------------------------------------------------------------- CIFAR-10
def _cifar_batch(n, seed):
    g = np.random.default_rng(seed)
    return {b"batch_label": b"fixture", b"labels": [int(v) for v in g.integers(0, 10, n)],
            b"data": g.integers(0, 256, (n, 3072), dtype=np.uint8), b"filenames": [b"x.png"] * n}


@pytest.fixture
def cifar_dir(tmp_path):
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    for i in range(1, 6):
        (folder / f"data_batch_{i}").write_bytes(pickle.dumps(_cifar_batch(40, i), protocol=2))
    (folder / "test_batch").write_bytes(pickle.dumps(_cifar_batch(50, 9), protocol=2))
    return tmp_path


def test_cifar_batches_are_read_channel_first(cifar_dir):
    images, labels = load_cifar10(cifar_dir, "train")
    assert images.shape == (200, 3, 32, 32) and images.dtype == torch.uint8 and labels.shape == (200,)
    raw = _cifar_batch(40, 1)[b"data"]
    assert torch.equal(images[0, 1].flatten(), torch.from_numpy(raw[0, 1024:2048]))  # the green plane
    dm = build(cifar_dir, dataset="cifar10", subset="full", partition="iid", num_clients=8, num_val_clients=2,
               num_test_clients=2, normalize=True)
    assert dm.train_clients[0].x.shape[1:] == (3, 32, 32) and sum(len(c) for c in dm.test_clients) == 50


class _Evil:
    def __reduce__(self):
        import os

        return os.system, ("echo owned",)


def test_a_batch_pickle_that_asks_for_code_is_refused(tmp_path):
    path = tmp_path / "data_batch_1"
    path.write_bytes(pickle.dumps({b"data": _Evil(), b"labels": []}, protocol=2))
    with pytest.raises(CIFARFormatError, match="refusing to build"):
        read_cifar_batch(path)


def test_download_extracts_only_the_batch_files(tmp_path, cifar_dir, monkeypatch):
    import lightning_dp.datamodules.cifar as cifar
    from lightning_dp.datamodules.offline import md5sum

    archive = tmp_path / "mirror" / cifar.ARCHIVE
    archive.parent.mkdir()
    with tarfile.open(archive, "w:gz") as tar:
        for path in sorted((cifar_dir / "cifar-10-batches-py").iterdir()):
            tar.add(path, arcname=f"cifar-10-batches-py/{path.name}")
        evil = tarfile.TarInfo("../escaped")
        evil.size = 3
        tar.addfile(evil, io.BytesIO(b"bad"))
    monkeypatch.setattr(cifar, "ARCHIVE_MD5", md5sum(archive))
    monkeypatch.setattr(cifar, "MIRRORS", (archive.parent.as_uri() + "/",))
    target = tmp_path / "data"
    download_cifar10(target)
    assert sorted(p.name for p in (target / "cifar-10-batches-py").iterdir()) == sorted(
        [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"])
    assert not (tmp_path / "escaped").exists() and [p.name for p in target.iterdir()] == ["cifar-10-batches-py"]


# ------------------------------------------------------------------- in a federated round
def test_dp_fedavg_rounds_run_on_partitioned_mnist(mnist_dir):
    from lightning_dp.federated import FederatedRound
    from lightning_dp.federated.parts import CentralGaussian, LocalSGD, PoissonSelection
    from lightning_dp.models import LogisticRegression

    privacy = CentralGaussian(noise_multiplier=1.0, clip=0.5)
    m = FederatedRound(LogisticRegression(), selection=PoissonSelection(0.5),
                       update=LocalSGD(epochs=1, lr=0.1, batch_size=16), server_privacy=privacy,
                       loss="cross_entropy", seed=0, noise_seed=1)
    t = L.Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                  accelerator="cpu", devices=1, max_epochs=2, num_sanity_val_steps=0)
    t.fit(m, build(mnist_dir, partition="pathological"))
    assert len(privacy.accountant) == 2 and 0 < privacy.epsilon < float("inf")
    assert "val/acc" in t.callback_metrics


def test_cifar_from_the_hugging_face_copy(tmp_path, monkeypatch):
    import datasets
    from PIL import Image

    g = np.random.default_rng(0)
    pixels = g.integers(0, 256, (30, 32, 32, 3), dtype=np.uint8)
    labels = [int(v) for v in np.arange(30) % 10]
    calls = []

    def load_dataset(name, cache_dir=None):
        calls.append((name, cache_dir))
        split = {"img": [Image.fromarray(p) for p in pixels], "label": labels}
        return {"train": split, "test": split}

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    dm = build(tmp_path / "hf", dataset="cifar10", source="huggingface", subset="test", partition="iid",
               num_clients=4, num_val_clients=1, num_test_clients=1, train_fraction=0.5)
    assert calls[0] == ("uoft-cs/cifar10", str(tmp_path / "hf"))
    client = dm.train_clients[0]
    assert client.x.shape[1:] == (3, 32, 32)
    first = torch.round(client.x[0] * 255).to(torch.uint8).permute(1, 2, 0).numpy()
    assert any(np.array_equal(first, p) for p in pixels)  # channel-first, unnormalized, exact


def test_a_failed_download_leaves_no_data_directory(tmp_path, monkeypatch):
    import lightning_dp.datamodules.cifar as cifar

    monkeypatch.setattr(cifar, "MIRRORS", ((tmp_path / "nowhere").as_uri() + "/",))
    target = tmp_path / "data" / "cifar"
    with pytest.raises(RuntimeError):
        download_cifar10(target)
    assert not target.exists()


@pytest.mark.parametrize("n, k, seed", [(1000, 7, 3), (60000, 100, 0), (13, 5, 9)])
def test_iid_is_flwr_datasets_iid_partitioner_without_the_libraries(n, k, seed):
    """The plain install's IID cut equals IidPartitioner on datasets' seeded shuffle, index for index."""
    import numpy as np

    datasets = pytest.importorskip("datasets")
    partitioner = pytest.importorskip("flwr_datasets.partitioner")
    labels = torch.randint(0, 10, (n,), generator=torch.Generator().manual_seed(seed))
    table = datasets.Dataset.from_dict({"index": np.arange(n), "label": labels.numpy()}).shuffle(seed=seed)
    reference = partitioner.IidPartitioner(num_partitions=k)
    reference.dataset = table
    ours = partition_labels(labels, k, "iid", seed=seed)
    assert len(ours) == k
    for i, part in enumerate(ours):
        assert np.array_equal(part, np.asarray(reference.load_partition(i)["index"]))


def test_a_missing_partitioner_library_is_one_line_naming_the_extra(monkeypatch):
    import sys

    from lightning_dp.extras import MissingExtraError

    monkeypatch.setitem(sys.modules, "flwr_datasets", None)  # as if not installed
    monkeypatch.setitem(sys.modules, "flwr_datasets.partitioner", None)
    labels = torch.arange(100) % 10
    assert len(partition_labels(labels, 4, "iid", seed=0)) == 4  # IID needs no library
    with pytest.raises(MissingExtraError) as info:
        partition_labels(labels, 4, "dirichlet", seed=0)
    assert str(info.value) == ("FederatedVisionDataModule(partition='dirichlet') needs flwr_datasets, which is not installed: "
                               "pip install 'lightning-dp[fl]', or use partition='iid'")
    assert info.value.extra == "fl"
