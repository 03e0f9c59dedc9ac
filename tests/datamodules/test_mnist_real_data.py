"""The real official MNIST test split, when a copy is at hand (skipped otherwise).

Looks in ``$LIGHTNING_DP_SHARED_DATA/mnist``, default ``<repo>/../shared/data/mnist``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from lightning_dp.datamodules import MNISTDataModule, read_idx
from lightning_dp.datamodules.offline import md5sum

_DEFAULT_SHARED_DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data"
SHARED_DATA = Path(os.environ.get("LIGHTNING_DP_SHARED_DATA", _DEFAULT_SHARED_DATA))
MNIST_DIR = SHARED_DATA / "mnist"
T10K_FILES = ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz")

pytestmark = pytest.mark.skipif(
    not all((MNIST_DIR / name).is_file() for name in T10K_FILES),
    reason=f"the official MNIST t10k files are not in {MNIST_DIR}",
)


def test_real_t10k_files_match_the_official_md5():
    for name in T10K_FILES:
        assert md5sum(MNIST_DIR / name) == MNISTDataModule.md5s[name]


def test_real_t10k_split():
    images, labels = read_idx(MNIST_DIR / T10K_FILES[0]), read_idx(MNIST_DIR / T10K_FILES[1])
    assert images.shape == (10000, 28, 28) and images.dtype == torch.uint8
    assert labels.shape == (10000,) and labels[:5].tolist() == [7, 2, 1, 0, 4]
    assert float(images.float().mean() / 255) == pytest.approx(0.1325, abs=1e-3)

    datamodule = MNISTDataModule(data_dir=MNIST_DIR, subset="t10k")
    datamodule.setup()
    splits = (datamodule.train_dataset, datamodule.val_dataset, datamodule.test_dataset)
    assert [len(dataset) for dataset in splits] == [8000, 1000, 1000]
    merged = torch.cat([dataset.tensors[1] for dataset in splits])
    assert torch.equal(torch.bincount(merged), torch.bincount(labels.long()))
    x = datamodule.train_dataset.tensors[0]
    assert x.shape == (8000, 1, 28, 28) and x.dtype == torch.float32
    # Standardized with the training-set constants: close to, not exactly, zero mean and unit std.
    assert float(x.mean()) == pytest.approx(0.0, abs=0.02) and float(x.std()) == pytest.approx(1.0, abs=0.02)
