"""MNIST, Fashion-MNIST and CIFAR-10 split into federated clients by flwr-datasets partitioners.

The training pool is partitioned into ``num_clients + num_val_clients`` clients (``"iid"``, ``"pathological"``,
``"shards"`` or ``"dirichlet"``; the partitioners see only labels and indices); ``num_val_clients`` partitions are
held out whole, and the test split is cut IID into ``num_test_clients``. Official files in ``data_dir`` or
``source="huggingface"``. Each partitioner and the sources: docs/data.md, "Federated images".
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any, Literal, Optional, Union

import numpy as np
import torch

from lightning_dp import checks
from lightning_dp.datamodules.base import renamed, stratified_split
from lightning_dp.datamodules.federated import (
    ClientDataset,
    FederatedDataModule,
    derived_seed,
)
from lightning_dp.datamodules.offline import DatasetUnavailableError, download_guard, import_datasets, load_hf_dataset

__all__ = ["DATASETS", "PARTITIONS", "FederatedVisionDataModule", "partition_labels"]

Dataset = Literal["mnist", "fashion_mnist", "cifar10"]
Partition = Literal["iid", "pathological", "shards", "dirichlet"]
DATASETS = ("mnist", "fashion_mnist", "cifar10")
PARTITIONS = ("iid", "pathological", "shards", "dirichlet")


def _flwr_partitioners(partition: str) -> Any:
    from lightning_dp.extras import require

    needed_by = f"FederatedVisionDataModule(partition={partition!r})"
    require("datasets", "fl", needed_by, "partition='iid'")
    return require("flwr_datasets.partitioner", "fl", needed_by, "partition='iid'")


def partition_labels(labels: torch.Tensor, num_partitions: int, partition: str, *, seed: int,
                     classes_per_client: int = 2, alpha: float = 0.5, min_partition_size: int = 10,
                     shard_size: Optional[int] = None) -> list[np.ndarray]:
    """Indices into ``labels`` of each of ``num_partitions`` partitions, by a flwr-datasets partitioner.

    Deterministic in ``seed``. Every index lands in at most one partition (the shard and
    pathological partitioners may leave a remainder out, as Flower's do).

    ``partition="iid"`` needs neither flwr-datasets nor datasets: it is the permutation that
    ``datasets.Dataset.shuffle(seed=seed)`` draws (``numpy.random.default_rng(seed)``), cut into contiguous
    shards as flwr-datasets' ``IidPartitioner`` cuts them (``Dataset.shard(contiguous=True)``: the first
    ``n % num_partitions`` shards one longer, which is ``numpy.array_split``); the same indices, tested
    against the libraries. The other partitions use the libraries (the ``fl`` extra).
    """
    if partition == "iid":
        permutation = np.random.default_rng(seed).permutation(len(labels))
        return [np.asarray(part, dtype=np.int64) for part in np.array_split(permutation, num_partitions)]
    if partition not in PARTITIONS:
        raise ValueError(f"partition={partition!r} is not one of {PARTITIONS}")
    P = _flwr_partitioners(partition)
    import datasets

    table = datasets.Dataset.from_dict({"index": np.arange(len(labels)), "label": labels.numpy()})
    if partition == "pathological":
        part = P.PathologicalPartitioner(num_partitions=num_partitions, partition_by="label",
                                         num_classes_per_partition=classes_per_client,
                                         class_assignment_mode="random", seed=seed)
    elif partition == "shards":
        part = P.ShardPartitioner(num_partitions=num_partitions, partition_by="label",
                                  num_shards_per_partition=classes_per_client, shard_size=shard_size, seed=seed)
    elif partition == "dirichlet":
        part = P.DirichletPartitioner(num_partitions=num_partitions, partition_by="label", alpha=alpha,
                                      min_partition_size=min_partition_size, self_balancing=False, seed=seed)
    else:
        raise ValueError(f"partition={partition!r} is not one of {PARTITIONS}")
    part.dataset = table
    with warnings.catch_warnings():  # pyarrow's deprecation inside flwr-datasets' sort: nothing a user can act on
        warnings.filterwarnings("ignore", category=FutureWarning, module="pyarrow")
        return [np.asarray(part.load_partition(i)["index"], dtype=np.int64) for i in range(num_partitions)]


class FederatedVisionDataModule(FederatedDataModule):
    """Image classification clients partitioned from MNIST, Fashion-MNIST or CIFAR-10 (module docstring).

    The clients are partitions of an image pool, not people: :meth:`concatenated`'s ``user_ids`` (the partition of
    every image) makes ``DPSGD(privacy_unit="user")`` protect one partition, a simulation of a user, no one's data.

    Args:
        dataset: ``"mnist"``, ``"fashion_mnist"`` or ``"cifar10"``.
        data_dir: the official files (default ``./data/<dataset>``).
        subset: ``"full"``: clients from the official training split, test clients from the test
            split; ``"test"``: only the official test split is needed (MNIST's t10k files, CIFAR's
            ``test_batch``): ``train_fraction`` of it (stratified) is partitioned into clients, the
            rest makes the test clients.
        download: fetch missing official files first (md5-verified).
        source: ``"files"`` (the official files in ``data_dir``) or ``"huggingface"`` (the Hub copy).
        num_clients: training clients.
        num_val_clients: held-out validation clients (whole partitions).
        num_test_clients: test clients (IID shares of the test images).
        partition: ``"iid"``, ``"pathological"``, ``"shards"`` or ``"dirichlet"``.
        classes_per_client: classes (pathological) or shards (shards) per client.
        alpha: Dirichlet concentration (smaller: more skewed).
        min_partition_size: Dirichlet: resample until every client has this many images.
        shard_size: shards: images per shard (default: pool size / (clients x shards per client)).
        train_fraction: ``subset="test"``: share of the test split partitioned into clients.
        normalize: standardize with the dataset's pixel statistics.
        batch_size: as :class:`~lightning_dp.datamodules.FederatedDataModule`.
        num_workers: as :class:`~lightning_dp.datamodules.FederatedDataModule`.
        seed: as :class:`~lightning_dp.datamodules.FederatedDataModule`.
    """

    task = "classification"
    num_classes = 10

    def __init__(self, *, dataset: Dataset = "mnist", data_dir: Optional[Union[str, "os.PathLike[str]"]] = None,
                 subset: Literal["full", "test"] = "full", download: bool = False,
                 source: Literal["files", "huggingface"] = "files", num_clients: int = 100,
                 num_val_clients: int = 10, num_test_clients: int = 10, partition: Partition = "iid",
                 classes_per_client: int = 2, alpha: float = 0.5, min_partition_size: int = 10,
                 shard_size: Optional[int] = None, train_fraction: float = 0.8, normalize: bool = True,
                 batch_size: int = 64, num_workers: int = 0, seed: int = 0) -> None:
        super().__init__(batch_size=batch_size, num_workers=num_workers, seed=seed)
        owner = type(self).__name__
        if dataset not in DATASETS:
            raise ValueError(f"{owner}: dataset={dataset!r} is not one of {DATASETS}")
        if partition not in PARTITIONS:
            raise ValueError(f"{owner}: partition={partition!r} is not one of {PARTITIONS}")
        if source not in ("files", "huggingface"):
            raise ValueError(f"{owner}: source={source!r} must be 'files' (the official files in data_dir) or "
                             "'huggingface' (the Hub copy)")
        if subset not in ("full", "test"):
            raise ValueError(f"{owner}: subset={subset!r} must be 'full' (official train and test splits) or "
                             "'test' (the official test split alone)")
        for name, value, low in (("num_clients", num_clients, 1), ("num_val_clients", num_val_clients, 1),
                                 ("num_test_clients", num_test_clients, 0),
                                 ("classes_per_client", classes_per_client, 1),
                                 ("min_partition_size", min_partition_size, 0)):
            checks.integer(name, value, owner=owner)
            if value < low:
                raise ValueError(f"{owner}: {name}={value} must be >= {low}")
        if classes_per_client > 10:
            raise ValueError(f"{owner}: classes_per_client={classes_per_client} exceeds the 10 classes")
        if shard_size is not None:
            checks.integer("shard_size", shard_size, owner=owner)
            if shard_size < 1:
                raise ValueError(f"{owner}: shard_size={shard_size} must be >= 1 (or None: as large as fits)")
        if not (isinstance(alpha, (int, float)) and not isinstance(alpha, bool) and np.isfinite(alpha) and alpha > 0):
            raise ValueError(f"{owner}: alpha={alpha!r} must be a finite number > 0 (Dirichlet concentration)")
        checks.open_fraction("train_fraction", train_fraction, owner=owner)
        for name, flag in (("download", download), ("normalize", normalize)):
            if not isinstance(flag, bool):
                raise ValueError(f"{owner}: {name} must be True or False, got {flag!r}")
        self.save_hyperparameters()
        self.dataset, self.subset, self.download, self.source = dataset, subset, download, source
        self.data_dir = Path(data_dir if data_dir is not None else f"./data/{dataset}").expanduser()
        self.num_clients, self.num_val_clients, self.num_test_clients = num_clients, num_val_clients, num_test_clients
        self.partition, self.classes_per_client, self.alpha = partition, classes_per_client, float(alpha)
        self.min_partition_size, self.shard_size = min_partition_size, shard_size
        if partition != "iid":
            _flwr_partitioners(partition)  # a missing extra is refused now, before any data is read
        if source == "huggingface":  # a missing extra is refused now, before any data is read
            import_datasets("FederatedVisionDataModule(source='huggingface')", "source='files' with the official files")
        self.train_fraction, self.normalize = float(train_fraction), normalize
        self.input_shape = (3, 32, 32) if dataset == "cifar10" else (1, 28, 28)

    # ----------------------------------------------------------------- files
    def _official(self) -> Any:
        """The centralized MNIST-family DataModule that knows the official files (None for CIFAR-10)."""
        if self.dataset == "cifar10":
            return None
        from lightning_dp.datamodules.mnist import FashionMNISTDataModule, MNISTDataModule

        cls = MNISTDataModule if self.dataset == "mnist" else FashionMNISTDataModule
        return cls(data_dir=self.data_dir, download=self.download, subset="t10k" if self.subset == "test" else "full",
                   normalize=self.normalize, source="huggingface" if self.source == "huggingface" else "idx")

    def _splits(self) -> tuple[str, ...]:
        return ("test",) if self.subset == "test" else ("train", "test")

    def _cifar10_unavailable(self, error: Optional[str] = None) -> DatasetUnavailableError:
        from lightning_dp.datamodules.cifar import cifar10_unavailable

        return cifar10_unavailable(self.data_dir, self._splits(), error=error, owner=type(self).__name__,
                                   source=self.source, download=self.download)

    def prepare_data(self) -> None:
        """Download the official files when ``download=True``; fill the Hugging Face cache with that source.

        Raises:
            DatasetUnavailableError: If the download failed (nothing is left behind in ``data_dir``).
        """
        if self.dataset == "cifar10" and self.source == "huggingface":
            from lightning_dp.datamodules.cifar import HF_DATASET

            load_hf_dataset(import_datasets("FederatedVisionDataModule(source='huggingface')",
                                            "source='files' with the official files"), HF_DATASET, cache_dir=self.data_dir,
                            unavailable=self._cifar10_unavailable)
            return
        if self.source == "huggingface":
            self._official().prepare_data()
            return
        if not self.download:
            return
        if self.dataset == "cifar10":
            from lightning_dp.datamodules.cifar import download_cifar10, missing_cifar10_files

            if missing_cifar10_files(self.data_dir):
                with download_guard(self.data_dir, self._cifar10_unavailable):
                    download_cifar10(self.data_dir)
        else:
            self._official().prepare_data()

    def _read(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """``{split: (float32 inputs, int64 labels)}`` of the official splits the subset needs."""
        if self.dataset == "cifar10":
            from lightning_dp.datamodules.cifar import (
                load_cifar10,
                load_cifar10_hf,
                missing_cifar10_files,
                transform_cifar,
            )

            if self.source == "files" and missing_cifar10_files(self.data_dir, self._splits()):
                raise self._cifar10_unavailable()  # names every file the subset needs, so one fix is enough
            load = load_cifar10_hf if self.source == "huggingface" else load_cifar10
            out = {}
            for split in self._splits():
                images, labels = load(self.data_dir, split, owner=type(self).__name__)
                out[split] = (transform_cifar(images, normalize=self.normalize), labels)
            return out
        from lightning_dp.datamodules.mnist import transform_images

        official = self._official()
        raw = official._load_splits(list(self._splits()))  # checks files, shapes and labels; one clear error
        mean, std = (official.mean, official.std) if self.normalize else (None, None)
        return {split: (transform_images(images, mean=mean, std=std), labels) for split, (images, labels) in raw.items()}

    # ----------------------------------------------------------------- clients
    def _build_clients(self) -> tuple[list[ClientDataset], list[ClientDataset], list[ClientDataset]]:
        data = self._read()
        if self.subset == "test":
            x, y = data["test"]
            n_pool = int(round(self.train_fraction * len(y)))
            pool_index, test_index = stratified_split(y, [n_pool, len(y) - n_pool], seed=derived_seed(self.seed, "pool"))
            pool, test = (x[pool_index], y[pool_index]), (x[test_index], y[test_index])
        else:
            pool, test = data["train"], data["test"]
        total = self.num_clients + self.num_val_clients
        shard_size = self.shard_size
        if self.partition == "shards" and shard_size is None:
            shard_size = len(pool[1]) // (total * self.classes_per_client)
            if shard_size < 1:
                raise ValueError(f"{type(self).__name__}: {len(pool[1])} images cannot make "
                                 f"{total * self.classes_per_client} shards; use fewer clients")
        try:
            parts = partition_labels(pool[1], total, self.partition, seed=derived_seed(self.seed, "partition"),
                                     classes_per_client=self.classes_per_client, alpha=self.alpha,
                                     min_partition_size=self.min_partition_size, shard_size=shard_size)
        except ValueError as err:
            raise ValueError(f"{type(self).__name__}: partition={self.partition!r} of {len(pool[1])} images into "
                             f"{total} clients failed: {err}") from None
        empty = [i for i, p in enumerate(parts) if len(p) == 0]
        if empty:
            raise ValueError(f"{type(self).__name__}: {len(empty)} of {total} clients got no images "
                             f"(partition={self.partition!r}); use fewer clients or more data")
        order = torch.randperm(total, generator=torch.Generator().manual_seed(derived_seed(self.seed, "val")))
        val_ids = set(order[: self.num_val_clients].tolist())
        train: list[ClientDataset] = []
        val: list[ClientDataset] = []
        for i, idx in enumerate(parts):
            index = torch.from_numpy(np.sort(idx))
            client = ClientDataset(f"{'val' if i in val_ids else 'train'}-{i:04d}", pool[0][index], pool[1][index])
            (val if i in val_ids else train).append(client)
        tests = []
        if self.num_test_clients:
            perm = torch.randperm(len(test[1]), generator=torch.Generator().manual_seed(derived_seed(self.seed, "test")))
            for j, chunk in enumerate(torch.tensor_split(perm, self.num_test_clients)):
                if len(chunk):
                    index = chunk.sort().values
                    tests.append(ClientDataset(f"test-{j:04d}", test[0][index], test[1][index]))
        return train, val, tests

    def summary(self) -> dict[str, Any]:
        """:meth:`FederatedDataModule.summary` plus the partition and the classes per training client."""
        out = super().summary()
        counts = [int(torch.unique(c.y).numel()) for c in self.clients("train")]
        out.update({"dataset": self.dataset, "partition": self.partition,
                    "classes_per_train_client": _size_summary_values(counts)})
        return out


def _size_summary_values(values: list[int]) -> dict[str, float]:
    arr = np.asarray(values)
    return {"min": int(arr.min()), "median": float(np.median(arr)), "max": int(arr.max())}


def __getattr__(name: str) -> type:  # the former names (datamodules.base.RENAMED), warned
    return renamed(__name__, name, globals())
