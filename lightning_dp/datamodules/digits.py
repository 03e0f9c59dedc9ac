"""The scikit-learn 8x8 digits: the embedded, offline default dataset of the project.

Also holds the two small helpers every split-based DataModule of the package uses:
:func:`stratified_split` (seeded, stratified, exact sizes) and :func:`make_dataloader`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import torch
from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader, Dataset, TensorDataset

__all__ = ["DigitsDataModule", "make_dataloader", "stratified_split"]


def stratified_split(labels: torch.Tensor, sizes: Sequence[int], *, seed: int) -> list[torch.Tensor]:
    """Split ``range(len(labels))`` into blocks of exact sizes, stratified by label.

    Every sample gets a key ``(r + u_c) / n_c``, where ``n_c`` is the size of its class
    ``c``, ``r`` its rank in a random permutation of that class and ``u_c`` a uniform
    offset drawn per class (systematic sampling). Sorting by key interleaves the
    classes evenly, so any contiguous block of the sorted order holds each class in
    its overall proportion up to about one sample per class; the blocks are taken in
    order. Unlike :func:`sklearn.model_selection.train_test_split` this works for any
    class sizes, including classes smaller than the number of splits.

    Args:
        labels: Integer labels of shape ``(N,)``.
        sizes: Non-negative block sizes that sum to ``N``.
        seed: Seed of the ``torch.Generator`` that draws the permutations and offsets.

    Returns:
        One sorted ``int64`` index tensor per entry of ``sizes``; together a partition of ``range(N)``.

    Raises:
        ValueError: If ``labels`` is not one-dimensional, or ``sizes`` are negative or do not sum to ``N``.

    Example:
        >>> labels = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
        >>> first, second = stratified_split(labels, [4, 4], seed=0)
        >>> labels[first].bincount().tolist(), labels[second].bincount().tolist()
        ([2, 2], [2, 2])
    """
    labels = torch.as_tensor(labels)
    if labels.ndim != 1:
        raise ValueError(f"stratified_split: labels must be one-dimensional, got shape {tuple(labels.shape)}")
    sizes = [int(size) for size in sizes]
    if any(size < 0 for size in sizes) or sum(sizes) != labels.numel():
        raise ValueError(
            f"stratified_split: sizes {sizes} must be non-negative and sum to the number of samples "
            f"({labels.numel()})"
        )
    generator = torch.Generator().manual_seed(seed)
    keys = torch.empty(labels.numel(), dtype=torch.float64)
    for label in torch.unique(labels):
        members = torch.nonzero(labels == label).flatten()
        count = members.numel()
        permuted = members[torch.randperm(count, generator=generator)]
        offset = torch.rand((), generator=generator, dtype=torch.float64)
        keys[permuted] = (torch.arange(count, dtype=torch.float64) + offset) / count
    order = torch.argsort(keys, stable=True)
    blocks = torch.split(order, sizes)
    return [torch.sort(block).values for block in blocks]


def make_dataloader(
    dataset: Dataset, *, batch_size: int, shuffle: bool, num_workers: int, seed: int
) -> DataLoader:
    """Build the DataLoader of one split.

    Args:
        dataset: The split.
        batch_size: Samples per batch.
        shuffle: Reshuffle every epoch (training split only); the order is drawn from a
            ``torch.Generator`` seeded with ``seed``, so it is reproducible.
        num_workers: Worker processes; 0 loads in the main process.
        seed: Seed of the shuffling generator.

    Returns:
        The DataLoader.
    """
    generator = torch.Generator().manual_seed(seed) if shuffle else None
    return DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=shuffle,
        num_workers=num_workers,
        persistent_workers=num_workers > 0,
        generator=generator,
    )


def _check_positive_int(name: str, value: int, owner: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{owner}: {name} must be a positive integer, got {value!r}")


def _check_non_negative_int(name: str, value: int, owner: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{owner}: {name} must be a non-negative integer, got {value!r}")


def _check_fractions(owner: str, **fractions: float) -> None:
    for name, value in fractions.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 < value < 1.0:
            raise ValueError(f"{owner}: {name} must be a number in the open interval (0, 1), got {value!r}")
    if sum(fractions.values()) >= 1.0:
        described = " + ".join(f"{name}={value}" for name, value in fractions.items())
        raise ValueError(
            f"{owner}: {described} = {sum(fractions.values()):.4g} must be below 1 so that the "
            "remaining split is not empty; lower one of them"
        )


class DigitsDataModule(LightningDataModule):
    """The 1,797 8x8 handwritten digits bundled with scikit-learn (no download).

    ``setup()`` loads :func:`sklearn.datasets.load_digits`, scales the pixels (0..16)
    to [0, 1], and splits the images into train/val/test with :func:`stratified_split`
    (seeded, every split holds each digit in the overall proportion). The images are
    then standardized with the mean and standard deviation of the *training* split
    only (one scalar each, available as :attr:`mean` and :attr:`std`), so nothing
    about the validation or test images leaks into the preprocessing.

    Batches are ``(x, y)`` with ``x`` float32 of shape ``(B, 1, 8, 8)`` and ``y`` int64.

    Args:
        batch_size: Samples per batch, a positive integer.
        val_fraction: Fraction of the 1,797 images used for validation, in (0, 1).
        test_fraction: Fraction used for testing, in (0, 1); ``val_fraction +
            test_fraction`` must be below 1, the rest is the training split.
        seed: Seed of the split and of the training-loader shuffling.
        num_workers: DataLoader worker processes (0: load in the main process).

    Raises:
        ValueError: If an argument is outside its range.

    Example:
        >>> dm = DigitsDataModule(batch_size=32)
        >>> dm.setup("fit")
        >>> len(dm.train_dataset), len(dm.val_dataset), len(dm.test_dataset)
        (1257, 270, 270)
        >>> x, y = next(iter(dm.train_dataloader()))
        >>> tuple(x.shape), y.dtype
        ((32, 1, 8, 8), torch.int64)
    """

    name = "digits"
    num_classes: int = 10
    input_shape: tuple[int, int, int] = (1, 8, 8)
    num_samples: int = 1797

    def __init__(
        self,
        *,
        batch_size: int = 64,
        val_fraction: float = 0.15,
        test_fraction: float = 0.15,
        seed: int = 0,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        owner = type(self).__name__
        _check_positive_int("batch_size", batch_size, owner)
        _check_fractions(owner, val_fraction=val_fraction, test_fraction=test_fraction)
        _check_non_negative_int("num_workers", num_workers, owner)
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"{owner}: seed must be an integer, got {seed!r}")
        self.save_hyperparameters()
        self.batch_size = batch_size
        self.val_fraction = val_fraction
        self.test_fraction = test_fraction
        self.seed = seed
        self.num_workers = num_workers
        self.train_dataset: Optional[TensorDataset] = None
        self.val_dataset: Optional[TensorDataset] = None
        self.test_dataset: Optional[TensorDataset] = None
        self.mean: Optional[float] = None
        self.std: Optional[float] = None

    def setup(self, stage: Optional[str] = None) -> None:
        """Load, split and standardize the digits (all splits, once; later calls do nothing).

        Args:
            stage: ``"fit"``, ``"validate"``, ``"test"``, ``"predict"`` or ``None``; the
                dataset is tiny, so every stage loads all three splits.
        """
        if self.train_dataset is not None:
            return
        from sklearn.datasets import load_digits

        bunch = load_digits()
        images = torch.as_tensor(bunch.data, dtype=torch.float32).reshape(-1, *self.input_shape) / 16.0
        labels = torch.as_tensor(bunch.target, dtype=torch.int64)
        total = labels.numel()
        n_val = round(self.val_fraction * total)
        n_test = round(self.test_fraction * total)
        train_idx, val_idx, test_idx = stratified_split(
            labels, [total - n_val - n_test, n_val, n_test], seed=self.seed
        )
        train_images = images[train_idx]
        self.mean = float(train_images.mean())
        self.std = float(train_images.std())

        def standardized(index: torch.Tensor) -> TensorDataset:
            return TensorDataset((images[index] - self.mean) / self.std, labels[index])

        self.train_dataset = standardized(train_idx)
        self.val_dataset = standardized(val_idx)
        self.test_dataset = standardized(test_idx)

    def _require(self, dataset: Optional[Dataset], split: str) -> Dataset:
        if dataset is None:
            raise RuntimeError(f"{type(self).__name__}: the {split} split is not loaded; call setup() first")
        return dataset

    def train_dataloader(self) -> DataLoader:
        """Training batches, reshuffled every epoch (seeded)."""
        return make_dataloader(
            self._require(self.train_dataset, "train"),
            batch_size=self.batch_size,
            shuffle=True,
            num_workers=self.num_workers,
            seed=self.seed,
        )

    def val_dataloader(self) -> DataLoader:
        """Validation batches in a fixed order."""
        return make_dataloader(
            self._require(self.val_dataset, "val"),
            batch_size=self.batch_size,
            shuffle=False,
            num_workers=self.num_workers,
            seed=self.seed,
        )

    def test_dataloader(self) -> DataLoader:
        """Test batches in a fixed order."""
        return make_dataloader(
            self._require(self.test_dataset, "test"),
            batch_size=self.batch_size,
            shuffle=False,
            num_workers=self.num_workers,
            seed=self.seed,
        )
