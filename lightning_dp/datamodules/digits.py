"""The scikit-learn 8x8 digits: the embedded, offline default dataset of the project.

"""

from __future__ import annotations

from typing import Optional

import torch
from torch.utils.data import TensorDataset

from lightning_dp import checks
from lightning_dp.datamodules.base import (
    SplitDataModule,
    _check_fractions,
    stratified_split,
)

__all__ = ["DigitsDataModule"]


class DigitsDataModule(SplitDataModule):
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
        checks.positive_int("batch_size", batch_size, owner=owner)
        _check_fractions(owner, val_fraction=val_fraction, test_fraction=test_fraction)
        checks.non_negative_int("num_workers", num_workers, owner=owner)
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
        mean, std = float(train_images.mean()), float(train_images.std())
        self.mean, self.std = mean, std

        def standardized(index: torch.Tensor) -> TensorDataset:
            return TensorDataset((images[index] - mean) / std, labels[index])

        self.train_dataset = standardized(train_idx)
        self.val_dataset = standardized(val_idx)
        self.test_dataset = standardized(test_idx)

