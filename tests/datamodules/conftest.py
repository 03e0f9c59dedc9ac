"""Fixtures of the DataModule tests: small generated files in the official MNIST IDX format."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_dp.datamodules.idx import write_idx
from lightning_dp.datamodules.mnist import OFFICIAL_FILES


def make_split(num_samples: int, *, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random uint8 28x28 images and balanced uint8 labels (each digit num_samples/10 times)."""
    generator = torch.Generator().manual_seed(seed)
    labels = (torch.arange(num_samples) % 10)[torch.randperm(num_samples, generator=generator)].to(torch.uint8)
    images = torch.randint(0, 256, (num_samples, 28, 28), generator=generator, dtype=torch.uint8)
    return images, labels


def write_mnist_files(
    directory: Path,
    *,
    n_train: int = 400,
    n_test: int = 200,
    gz: bool = True,
    splits: tuple[str, ...] = ("train", "test"),
    seed: int = 0,
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Write the official files of ``splits`` into ``directory``; return the written tensors."""
    directory.mkdir(parents=True, exist_ok=True)
    suffix = ".gz" if gz else ""
    written = {}
    for offset, split in enumerate(splits):
        images, labels = make_split(n_train if split == "train" else n_test, seed=seed + offset)
        image_name, label_name = OFFICIAL_FILES[split]
        write_idx(directory / f"{image_name}{suffix}", images)
        write_idx(directory / f"{label_name}{suffix}", labels)
        written[split] = (images, labels)
    return written


@pytest.fixture
def mnist_files():
    """Factory fixture: ``write_mnist_files(directory, n_train=..., n_test=..., gz=..., splits=...)``."""
    return write_mnist_files


@pytest.fixture
def random_split():
    """Factory fixture: ``make_split(num_samples, seed=...) -> (uint8 images, uint8 labels)``."""
    return make_split


@pytest.fixture
def mnist_dir(tmp_path: Path) -> tuple[Path, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """A directory holding the four official files (gz): 400 train and 200 test images."""
    directory = tmp_path / "mnist"
    return directory, write_mnist_files(directory)


@pytest.fixture
def t10k_dir(tmp_path: Path) -> tuple[Path, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """A directory holding only the two t10k files (gz), 500 images."""
    directory = tmp_path / "t10k"
    return directory, write_mnist_files(directory, n_test=500, splits=("test",))
