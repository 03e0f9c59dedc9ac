"""MNIST and Fashion-MNIST DataModules, from the official IDX files or Hugging Face.

Both share one loader, :class:`MNISTFamilyDataModule`; a subclass only declares its constants (mirrors, md5 sums,
Hugging Face name, normalization statistics, class names). Sources ``"idx"`` (``download=True`` fetches and
md5-checks the missing files) and ``"huggingface"``; subsets ``"full"`` and ``"t10k"`` (only the official test
split, split into train/val/test). docs/data.md, "MNIST and Fashion-MNIST".
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar, Literal, Optional, Union

import numpy as np
import torch
from torch.utils.data import TensorDataset

from lightning_dp import checks
from lightning_dp.datamodules.base import (
    SplitDataModule,
    _check_fractions,
    stratified_split,
)
from lightning_dp.datamodules.idx import read_idx
from lightning_dp.datamodules.offline import (
    DatasetUnavailableError,
    UrlOpener,
    dataset_unavailable,
    download_file,
    download_guard,
    import_datasets,
    load_hf_dataset,
    md5_check,
    publish,
    staging_area,
)

__all__ = [
    "FashionMNISTDataModule",
    "MNISTDataModule",
    "MNISTFamilyDataModule",
    "OFFICIAL_FILES",
    "download_resource",
    "transform_images",
]

#: Official file names (without ``.gz``) of each split: ``split -> (images, labels)``.
OFFICIAL_FILES: dict[str, tuple[str, str]] = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}

Source = Literal["idx", "huggingface"]
Subset = Literal["full", "t10k"]


def download_resource(
    filename: str,
    *,
    directory: Union[str, "os.PathLike[str]"],
    mirrors: Sequence[str],
    md5: str,
    urlopen: Optional[UrlOpener] = None,
    timeout: float = 60.0,
) -> Path:
    """Download one official file from the first mirror that serves it with the right md5 sum
    (:func:`~lightning_dp.datamodules.offline.download_file`: nothing half-made is left behind).

    Args:
        filename: Name of the file on the mirrors, e.g. ``"t10k-images-idx3-ubyte.gz"``.
        directory: Destination directory, created if missing.
        mirrors: Base URLs tried in order (``https://``, ``http://`` or ``file://``).
        md5: Expected md5 hex digest of the file.
        urlopen: Function with the signature of :func:`urllib.request.urlopen`.
        timeout: Seconds before a connection attempt is abandoned.

    Raises:
        DownloadError: If no mirror served the file with the right md5 sum (each URL tried, and why).
    """
    return download_file(filename, directory=directory, urls=[m.rstrip("/") + "/" + filename for m in mirrors],
                         check=md5_check(md5), urlopen=urlopen, timeout=timeout)


def transform_images(
    images: torch.Tensor, *, mean: Optional[float] = None, std: Optional[float] = None
) -> torch.Tensor:
    """Turn ``uint8`` images of shape ``(N, H, W)`` into model inputs ``(N, 1, H, W)``.

    Pixels are scaled to [0, 1] (``/255``) and, when ``mean`` and ``std`` are given,
    standardized: ``(x - mean) / std``.

    Args:
        images: ``uint8`` tensor of shape ``(N, H, W)``.
        mean: Pixel mean of the dataset in [0, 1] scale, or ``None`` for no standardization.
        std: Pixel standard deviation in [0, 1] scale (used with ``mean``).

    Returns:
        A float32 tensor of shape ``(N, 1, H, W)``.

    Example:
        >>> x = transform_images(torch.full((2, 28, 28), 255, dtype=torch.uint8), mean=0.5, std=0.5)
        >>> tuple(x.shape), x.unique().tolist()
        ((2, 1, 28, 28), [1.0])
    """
    if images.dtype != torch.uint8 or images.ndim != 3:
        raise ValueError(
            f"transform_images: expected uint8 images of shape (N, H, W), got {images.dtype} {tuple(images.shape)}"
        )
    x = images.to(torch.float32).div_(255.0).unsqueeze(1)
    if mean is not None and std is not None:
        x.sub_(mean).div_(std)
    return x


def _import_datasets() -> Any:
    return import_datasets("source='huggingface'", "source='idx' with the official IDX files")


def _hf_split_to_tensors(split: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Convert a Hugging Face split with ``image`` (PIL) and ``label`` columns to tensors."""
    images = np.stack([np.asarray(image, dtype=np.uint8) for image in split["image"]])
    labels = np.asarray(list(split["label"]), dtype=np.int64)
    return torch.from_numpy(images), torch.from_numpy(labels)


class MNISTFamilyDataModule(SplitDataModule):
    """Base DataModule of the 28x28 grayscale, 10-class datasets in the MNIST format.

    Subclasses set the class attributes below and a ``data_dir`` default; everything
    else is shared. Batches are ``(x, y)``: ``x`` float32 of shape ``(B, 1, 28, 28)``
    (pixels ``/255``, then ``(x - mean) / std`` with the dataset's standard statistics
    when ``normalize``), ``y`` int64 in 0..9. After ``setup()`` the splits are
    available as ``train_dataset``, ``val_dataset`` and ``test_dataset``
    (:class:`~torch.utils.data.TensorDataset`).

    ``prepare_data()`` only downloads (``source="idx"`` with ``download=True``, or
    the Hugging Face cache); ``setup(stage)`` only reads: ``"fit"``/``"validate"``
    load train and val, ``"test"``/``"predict"`` the test split, ``None`` all three.

    Args:
        data_dir: Directory of the official IDX files (``source="idx"``), or the
            Hugging Face cache directory (``source="huggingface"``).
        batch_size: Samples per batch, a positive integer.
        val_size: ``subset="full"`` only: number of images of the official training
            split held out for validation (seeded, stratified); in [1, 60000).
        download: ``source="idx"`` only: let ``prepare_data()`` download the missing
            official files (md5-verified). With ``source="huggingface"`` the
            ``datasets`` library manages downloads (set ``HF_DATASETS_OFFLINE=1`` to
            forbid them).
        source: ``"idx"`` (official files) or ``"huggingface"``.
        subset: ``"full"`` (official train/test splits) or ``"t10k"`` (split the
            official test split alone into train/val/test).
        train_fraction: ``subset="t10k"`` only: fraction of the 10,000 images used for
            training, in (0, 1).
        val_fraction: ``subset="t10k"`` only: fraction used for validation, in (0, 1);
            the rest (``1 - train_fraction - val_fraction``, must be positive) is the test split.
        seed: Seed of the splits and of the training-loader shuffling.
        num_workers: DataLoader worker processes (0: load in the main process).
        normalize: Standardize with the dataset's mean and std (class attributes
            ``mean`` and ``std``); otherwise pixels stay in [0, 1].

    Raises:
        ValueError: If an argument is outside its range.
        TypeError: If the base class is instantiated directly.
    """

    #: Dataset name (also Lightning's ``LightningDataModule.name``).
    name: str = ""  # an instance attribute on LightningDataModule, so no ClassVar here
    #: The dataset's name in messages.
    title: ClassVar[str] = ""
    #: Hugging Face Hub identifier for ``source="huggingface"``.
    hf_dataset: ClassVar[str] = ""
    #: Base URLs of the official files, tried in order.
    mirrors: ClassVar[tuple[str, ...]] = ()
    #: md5 sums of the official ``.gz`` files, keyed by file name.
    md5s: ClassVar[Mapping[str, str]] = {}
    #: Standard pixel mean and std of the training split, in [0, 1] scale.
    mean: ClassVar[float] = 0.0
    std: ClassVar[float] = 1.0
    #: Human-readable class names, index = label.
    classes: ClassVar[tuple[str, ...]] = ()
    num_classes: ClassVar[int] = 10
    input_shape: ClassVar[tuple[int, int, int]] = (1, 28, 28)

    def __init__(
        self,
        *,
        data_dir: Union[str, "os.PathLike[str]"],
        batch_size: int = 256,
        val_size: int = 5000,
        download: bool = False,
        source: Source = "idx",
        subset: Subset = "full",
        train_fraction: float = 0.8,
        val_fraction: float = 0.1,
        seed: int = 0,
        num_workers: int = 0,
        normalize: bool = True,
    ) -> None:
        super().__init__()
        owner = type(self).__name__
        if not self.hf_dataset or not self.md5s:
            raise TypeError(
                f"{owner} is a base class; use MNISTDataModule or FashionMNISTDataModule, or subclass it "
                "and set name, hf_dataset, mirrors, md5s, mean, std and classes"
            )
        checks.positive_int("batch_size", batch_size, owner=owner)
        checks.positive_int("val_size", val_size, owner=owner)
        checks.non_negative_int("num_workers", num_workers, owner=owner)
        _check_fractions(owner, train_fraction=train_fraction, val_fraction=val_fraction)
        if source not in ("idx", "huggingface"):
            raise ValueError(f"{owner}: source must be 'idx' or 'huggingface', got {source!r}")
        if subset not in ("full", "t10k"):
            raise ValueError(
                f"{owner}: subset must be 'full' (official train/test splits) or 't10k' (split the official "
                f"test split alone), got {subset!r}"
            )
        for flag_name, flag in (("download", download), ("normalize", normalize)):
            if not isinstance(flag, bool):
                raise ValueError(f"{owner}: {flag_name} must be True or False, got {flag!r}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"{owner}: seed must be an integer, got {seed!r}")
        self.save_hyperparameters()
        self.data_dir = Path(data_dir).expanduser()
        self.batch_size = batch_size
        self.val_size = val_size
        self.download = download
        self.source = source
        if source == "huggingface":
            _import_datasets()  # a missing extra is refused now, before any data is read
        self.subset = subset
        self.train_fraction = train_fraction
        self.val_fraction = val_fraction
        self.seed = seed
        self.num_workers = num_workers
        self.normalize = normalize
        self.train_dataset: Optional[TensorDataset] = None
        self.val_dataset: Optional[TensorDataset] = None
        self.test_dataset: Optional[TensorDataset] = None

    # ----------------------------------------------------------------- files
    def required_splits(self, stage: Optional[str] = None) -> list[str]:
        """Official splits (``"train"``, ``"test"``) that ``setup(stage)`` reads.

        Args:
            stage: A Lightning stage or ``None`` (all).

        Returns:
            The split names, in order.
        """
        if self.subset == "t10k":
            return ["test"]
        splits = []
        if stage in (None, "fit", "validate"):
            splits.append("train")
        if stage in (None, "test", "predict"):
            splits.append("test")
        return splits

    def _find_file(self, name: str) -> Optional[Path]:
        for candidate in (self.data_dir / name, self.data_dir / f"{name}.gz"):
            if candidate.is_file():
                return candidate
        return None

    def missing_files(self, splits: Optional[Iterable[str]] = None) -> list[str]:
        """Official file names (without ``.gz``) absent from ``data_dir`` in both forms.

        Args:
            splits: Official splits to check; default: those of ``setup(None)``.

        Returns:
            The missing names, in official order.
        """
        splits = self.required_splits(None) if splits is None else splits
        return [name for split in splits for name in OFFICIAL_FILES[split] if self._find_file(name) is None]

    def unavailable(self, error: Optional[str] = None) -> DatasetUnavailableError:
        """The error of missing data: the official files this subset needs, where to get them, and
        ``error`` (the download's, one line) when a download failed."""
        official = [f"{name}.gz" for split in self.required_splits(None) for name in OFFICIAL_FILES[split]]
        missing = [f"{name}.gz" for name in self.missing_files(None)]
        hub = f"Hugging Face dataset {self.hf_dataset} (source='huggingface')"
        if self.source == "huggingface":
            return dataset_unavailable(
                type(self).__name__, self.title or self.name, data_dir=self.data_dir,
                expected=[f"the Hugging Face cache of {self.hf_dataset}"],
                sources=[f"https://huggingface.co/datasets/{self.hf_dataset}"], error=error,
                fix=f"offline, use source='idx' with the official IDX files {', '.join(official)} in data_dir "
                    f"(from {' or '.join(self.mirrors)}), or copy a cache filled by datasets.load_dataset("
                    f"{self.hf_dataset!r}, cache_dir=...) into data_dir and set HF_DATASETS_OFFLINE=1.")
        if error is not None:
            fix = "copy the official files into data_dir (fetched with internet), or use source='huggingface'."
        elif self.download:
            fix = "call prepare_data() first (the Trainer does) to download them, or copy the files into data_dir."
        else:
            fix = "pass download=True to download them (md5-verified), or copy the official files into data_dir."
        return dataset_unavailable(
            type(self).__name__, self.title or self.name, data_dir=self.data_dir, expected=official,
            missing=missing, layout="official IDX files; uncompressed copies without .gz work too",
            sources=[*self.mirrors, hub], error=error, fix=fix)

    # ----------------------------------------------------------------- hooks
    def prepare_data(self) -> None:
        """Download only: missing official files (``download=True``) or the Hugging Face cache.

        Lightning calls this once per node before ``setup``; it assigns no state. The files
        are downloaded into a temporary folder inside ``data_dir`` and moved into place once
        all of them arrived; a failed attempt leaves ``data_dir`` as it was.

        Raises:
            DatasetUnavailableError: If the download failed (the message names the files and
                where to get them).
        """
        if self.source == "huggingface":
            load_hf_dataset(_import_datasets(), self.hf_dataset, cache_dir=self.data_dir,
                            unavailable=self.unavailable)
            return
        missing = [f"{name}.gz" for name in self.missing_files(self.required_splits(None))]
        if not self.download or not missing:
            return
        with download_guard(self.data_dir, self.unavailable), staging_area(self.data_dir) as staging:
            for filename in missing:
                download_resource(filename, directory=staging, mirrors=self.mirrors, md5=self.md5s[filename])
            for filename in missing:
                publish(staging / filename, self.data_dir / filename)

    def setup(self, stage: Optional[str] = None) -> None:
        """Read the official splits needed by ``stage`` and build the datasets.

        Args:
            stage: ``"fit"``, ``"validate"``, ``"test"``, ``"predict"`` or ``None`` (all).
                Splits already built are kept.

        Raises:
            DatasetUnavailableError: (a :class:`FileNotFoundError`) If official files are missing
                (the message names them, where to get them and the fixes).
            ValueError: If a file's content is not a valid split, or a size does not fit.
        """
        needs_fit = stage in (None, "fit", "validate") and self.train_dataset is None
        needs_test = stage in (None, "test", "predict") and self.test_dataset is None
        if self.subset == "t10k":
            if needs_fit or needs_test:
                images, labels = self._load_splits(["test"])["test"]
                self._build_from_t10k(images, labels)
            return
        wanted = (["train"] if needs_fit else []) + (["test"] if needs_test else [])
        if not wanted:
            return
        raw = self._load_splits(wanted)
        if "train" in raw:
            images, labels = raw["train"]
            if not 0 < self.val_size < labels.numel():
                raise ValueError(
                    f"{type(self).__name__}: val_size={self.val_size} must be below the size of the training "
                    f"split ({labels.numel()}); lower val_size"
                )
            train_idx, val_idx = stratified_split(
                labels, [labels.numel() - self.val_size, self.val_size], seed=self.seed
            )
            self.train_dataset = self._dataset(images[train_idx], labels[train_idx])
            self.val_dataset = self._dataset(images[val_idx], labels[val_idx])
        if "test" in raw:
            self.test_dataset = self._dataset(*raw["test"])

    def _build_from_t10k(self, images: torch.Tensor, labels: torch.Tensor) -> None:
        total = labels.numel()
        n_train = round(self.train_fraction * total)
        n_val = round(self.val_fraction * total)
        n_test = total - n_train - n_val
        if min(n_train, n_val, n_test) < 1:
            raise ValueError(
                f"{type(self).__name__}: train_fraction={self.train_fraction} and val_fraction="
                f"{self.val_fraction} of {total} images give an empty split (sizes {n_train}/{n_val}/{n_test})"
            )
        train_idx, val_idx, test_idx = stratified_split(labels, [n_train, n_val, n_test], seed=self.seed)
        self.train_dataset = self._dataset(images[train_idx], labels[train_idx])
        self.val_dataset = self._dataset(images[val_idx], labels[val_idx])
        self.test_dataset = self._dataset(images[test_idx], labels[test_idx])

    def _dataset(self, images: torch.Tensor, labels: torch.Tensor) -> TensorDataset:
        mean, std = (self.mean, self.std) if self.normalize else (None, None)
        return TensorDataset(transform_images(images, mean=mean, std=std), labels)

    # ----------------------------------------------------------------- loading
    def _load_splits(self, splits: Sequence[str]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        if self.source == "huggingface":
            dataset_dict = load_hf_dataset(_import_datasets(), self.hf_dataset, cache_dir=self.data_dir,
                                           unavailable=self.unavailable)
            raw = {split: _hf_split_to_tensors(dataset_dict[split]) for split in splits}
            sources = {split: f"{self.hf_dataset}[{split}]" for split in splits}
        else:
            if self.missing_files(splits):
                # Name every file the subset needs, not only this stage's, so one fix is enough.
                raise self.unavailable()
            raw, sources = {}, {}
            for split in splits:
                image_path, label_path = (self._find_file(name) for name in OFFICIAL_FILES[split])
                if image_path is None or label_path is None:  # removed since missing_files() looked
                    raise self.unavailable()
                raw[split] = (read_idx(image_path), read_idx(label_path).to(torch.int64))
                sources[split] = f"{image_path} / {label_path}"
        for split, (images, labels) in raw.items():
            self._validate(images, labels, sources[split])
        return raw

    def _validate(self, images: torch.Tensor, labels: torch.Tensor, source: str) -> None:
        owner = type(self).__name__
        expected = tuple(self.input_shape[1:])
        if images.dtype != torch.uint8 or images.ndim != 3 or tuple(images.shape[1:]) != expected:
            raise ValueError(
                f"{owner}: {source}: images must be uint8 of shape (N, {expected[0]}, {expected[1]}), "
                f"got {images.dtype} {tuple(images.shape)}"
            )
        if labels.ndim != 1 or labels.numel() != images.shape[0]:
            raise ValueError(
                f"{owner}: {source}: {images.shape[0]} images but labels of shape {tuple(labels.shape)}"
            )
        if labels.numel() and (int(labels.min()) < 0 or int(labels.max()) >= self.num_classes):
            raise ValueError(
                f"{owner}: {source}: labels must be in 0..{self.num_classes - 1}, "
                f"got {int(labels.min())}..{int(labels.max())}"
            )

    # ----------------------------------------------------------------- loaders


class MNISTDataModule(MNISTFamilyDataModule):
    """MNIST handwritten digits (LeCun et al., 1998): 60,000 train + 10,000 test images.

    See :class:`MNISTFamilyDataModule` for the arguments, sources and subsets.

    Args:
        data_dir: Directory of the official files (or Hugging Face cache).
        **kwargs: The other keyword arguments of :class:`MNISTFamilyDataModule`.

    Example:
        >>> dm = MNISTDataModule(data_dir="../shared/data/mnist", subset="t10k")  # doctest: +SKIP
        >>> dm.setup("fit")  # doctest: +SKIP
        >>> len(dm.train_dataset), len(dm.val_dataset), len(dm.test_dataset)  # doctest: +SKIP
        (8000, 1000, 1000)
    """

    name = "mnist"
    title = "MNIST"
    hf_dataset = "ylecun/mnist"
    mirrors = ("https://ossci-datasets.s3.amazonaws.com/mnist/", "http://yann.lecun.com/exdb/mnist/")
    md5s = {
        "train-images-idx3-ubyte.gz": "f68b3c2dcbeaaa9fbdd348bbdeb94873",
        "train-labels-idx1-ubyte.gz": "d53e105ee54ea40749a09fcbcd1e9432",
        "t10k-images-idx3-ubyte.gz": "9fb629c4189551a2d022fa330f9573f3",
        "t10k-labels-idx1-ubyte.gz": "ec29112dd5afa0611ce80d1b7f02629c",
    }
    mean = 0.1307
    std = 0.3081
    classes = tuple(str(digit) for digit in range(10))

    def __init__(self, *, data_dir: Union[str, "os.PathLike[str]"] = "./data/mnist", **kwargs: Any) -> None:
        super().__init__(data_dir=data_dir, **kwargs)


class FashionMNISTDataModule(MNISTFamilyDataModule):
    """Fashion-MNIST (Xiao et al., 2017): Zalando article images in the MNIST format.

    See :class:`MNISTFamilyDataModule` for the arguments, sources and subsets.

    Args:
        data_dir: Directory of the official files (or Hugging Face cache).
        **kwargs: The other keyword arguments of :class:`MNISTFamilyDataModule`.

    Example:
        >>> dm = FashionMNISTDataModule(download=True)  # doctest: +SKIP
        >>> dm.prepare_data(); dm.setup("fit")  # doctest: +SKIP
        >>> len(dm.train_dataset), len(dm.val_dataset)  # doctest: +SKIP
        (55000, 5000)
    """

    name = "fashion_mnist"
    title = "Fashion-MNIST"
    hf_dataset = "zalando-datasets/fashion_mnist"
    mirrors = ("http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/",)
    md5s = {
        "train-images-idx3-ubyte.gz": "8d4fb7e6c68d591d4c3dfef9ec88bf0d",
        "train-labels-idx1-ubyte.gz": "25c81989df183df01b3e8a0aad5dffbe",
        "t10k-images-idx3-ubyte.gz": "bef4ecab320f06d8554ea6380940ec79",
        "t10k-labels-idx1-ubyte.gz": "bb300cfdad3c16e7a12a480ee83cd310",
    }
    mean = 0.2860
    std = 0.3530
    classes = (
        "T-shirt/top",
        "Trouser",
        "Pullover",
        "Dress",
        "Coat",
        "Sandal",
        "Shirt",
        "Sneaker",
        "Bag",
        "Ankle boot",
    )

    def __init__(
        self, *, data_dir: Union[str, "os.PathLike[str]"] = "./data/fashion_mnist", **kwargs: Any
    ) -> None:
        super().__init__(data_dir=data_dir, **kwargs)
