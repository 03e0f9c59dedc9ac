"""DigitsDataModule and the stratified split helper."""

from __future__ import annotations

import pytest
import torch
from sklearn.datasets import load_digits
from torch.utils.data import RandomSampler, SequentialSampler

from lightning_dp.datamodules import DigitsDataModule, stratified_split


def _labels(dataset) -> torch.Tensor:
    return dataset.tensors[1]


# ---------------------------------------------------------------- stratified_split
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_stratified_split_is_a_stratified_partition(seed):
    labels = torch.tensor([0] * 500 + [1] * 300 + [2] * 150 + [3] * 49 + [4])
    sizes = [700, 150, 150]
    blocks = stratified_split(labels, sizes, seed=seed)
    assert [block.numel() for block in blocks] == sizes
    assert torch.equal(torch.sort(torch.cat(blocks)).values, torch.arange(labels.numel()))
    overall = torch.bincount(labels).double()
    for block, size in zip(blocks, sizes):
        counts = torch.bincount(labels[block], minlength=5).double()
        # Systematic sampling: each class within 2 samples of its proportional share.
        assert (counts - overall * size / labels.numel()).abs().max() < 2.0


def test_stratified_split_is_seeded():
    labels = torch.arange(1000) % 7
    first = stratified_split(labels, [800, 200], seed=3)
    again = stratified_split(labels, [800, 200], seed=3)
    other = stratified_split(labels, [800, 200], seed=4)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert not torch.equal(first[1], other[1])


def test_stratified_split_rejects_bad_sizes():
    with pytest.raises(ValueError, match="sum to the number of samples"):
        stratified_split(torch.zeros(10, dtype=torch.long), [5, 4], seed=0)
    with pytest.raises(ValueError, match="non-negative"):
        stratified_split(torch.zeros(10, dtype=torch.long), [11, -1], seed=0)
    with pytest.raises(ValueError, match="one-dimensional"):
        stratified_split(torch.zeros(2, 5, dtype=torch.long), [5, 5], seed=0)


# ---------------------------------------------------------------- DigitsDataModule
@pytest.fixture(scope="module")
def digits() -> DigitsDataModule:
    datamodule = DigitsDataModule()
    datamodule.setup("fit")
    return datamodule


def test_sizes_shapes_and_dtypes(digits):
    sizes = [len(digits.train_dataset), len(digits.val_dataset), len(digits.test_dataset)]
    assert sizes == [1257, 270, 270]
    assert sum(sizes) == 1797 == DigitsDataModule.num_samples
    assert digits.num_classes == 10 and digits.input_shape == (1, 8, 8)
    for dataset in (digits.train_dataset, digits.val_dataset, digits.test_dataset):
        x, y = dataset.tensors
        assert x.dtype == torch.float32 and x.shape[1:] == (1, 8, 8)
        assert y.dtype == torch.int64 and int(y.min()) == 0 and int(y.max()) == 9


def test_splits_are_stratified(digits):
    overall = torch.bincount(torch.as_tensor(load_digits().target)).double()
    for dataset in (digits.train_dataset, digits.val_dataset, digits.test_dataset):
        counts = torch.bincount(_labels(dataset), minlength=10).double()
        assert (counts - overall * len(dataset) / 1797).abs().max() < 2.0


def test_standardized_with_train_statistics_only(digits):
    bunch = load_digits()
    images = torch.as_tensor(bunch.data, dtype=torch.float32) / 16.0
    labels = torch.as_tensor(bunch.target)
    train_idx, val_idx, test_idx = stratified_split(labels, [1257, 270, 270], seed=0)
    assert digits.mean == pytest.approx(float(images[train_idx].mean()), abs=1e-6)
    assert digits.std == pytest.approx(float(images[train_idx].std()), abs=1e-6)
    assert digits.mean != pytest.approx(float(images.mean()), abs=1e-6)  # not the all-data mean
    x_train = digits.train_dataset.tensors[0]
    assert float(x_train.mean()) == pytest.approx(0.0, abs=1e-5)
    assert float(x_train.std()) == pytest.approx(1.0, abs=1e-5)
    # Val and test use the train statistics, so they are not exactly standardized themselves.
    expected_test = (images[test_idx].reshape(-1, 1, 8, 8) - digits.mean) / digits.std
    assert torch.allclose(digits.test_dataset.tensors[0], expected_test, atol=1e-6)
    assert torch.equal(_labels(digits.test_dataset), labels[test_idx])
    # Scaled to [0, 1] before standardizing: 0 and 16 map to the two ends.
    raw = x_train * digits.std + digits.mean
    assert float(raw.min()) == pytest.approx(0.0, abs=1e-5) and float(raw.max()) == pytest.approx(1.0, abs=1e-5)


def test_split_depends_on_seed_only():
    first, again, other = DigitsDataModule(seed=5), DigitsDataModule(seed=5), DigitsDataModule(seed=6)
    for datamodule in (first, again, other):
        datamodule.setup()
    assert torch.equal(first.val_dataset.tensors[0], again.val_dataset.tensors[0])
    assert not torch.equal(_labels(first.val_dataset), _labels(other.val_dataset))


def test_fractions_set_sizes():
    datamodule = DigitsDataModule(val_fraction=0.1, test_fraction=0.2)
    datamodule.setup("test")
    assert [len(datamodule.train_dataset), len(datamodule.val_dataset), len(datamodule.test_dataset)] == [
        1258,
        180,
        359,
    ]


def test_loaders(digits):
    train = digits.train_dataloader()
    assert isinstance(train.sampler, RandomSampler)
    assert isinstance(digits.val_dataloader().sampler, SequentialSampler)
    assert isinstance(digits.test_dataloader().sampler, SequentialSampler)
    x, y = next(iter(train))
    assert x.shape == (64, 1, 8, 8) and y.shape == (64,)
    # Seeded shuffling: two fresh loaders give the same first batch.
    assert torch.equal(next(iter(digits.train_dataloader()))[1], y)
    val_x, _ = next(iter(digits.val_dataloader()))
    assert torch.equal(val_x, digits.val_dataset.tensors[0][:64])


def test_loader_before_setup_raises():
    with pytest.raises(RuntimeError, match="call setup"):
        DigitsDataModule().train_dataloader()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"batch_size": 0}, "batch_size must be a positive integer"),
        ({"val_fraction": 0.0}, r"val_fraction must be a number in the open interval \(0, 1\)"),
        ({"test_fraction": 1.5}, "test_fraction"),
        ({"val_fraction": 0.5, "test_fraction": 0.5}, "must be below 1"),
        ({"num_workers": -1}, "num_workers must be a non-negative integer"),
        ({"seed": 1.5}, "seed must be an integer"),
    ],
)
def test_invalid_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DigitsDataModule(**kwargs)


def test_arguments_are_keyword_only():
    with pytest.raises(TypeError):
        DigitsDataModule(32)  # type: ignore[misc]


def test_hyperparameters_are_saved():
    assert dict(DigitsDataModule(batch_size=16).hparams) == {
        "batch_size": 16,
        "val_fraction": 0.15,
        "test_fraction": 0.15,
        "seed": 0,
        "num_workers": 0,
    }
