"""MNIST and Fashion-MNIST DataModules on generated official-format fixtures."""

from __future__ import annotations

import gzip
import shutil
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from jsonargparse import ArgumentParser
from torch.utils.data import RandomSampler, SequentialSampler

from lightning_dp.datamodules import (
    DatasetUnavailableError,
    FashionMNISTDataModule,
    MNISTDataModule,
    MNISTFamilyDataModule,
    write_idx,
)
from lightning_dp.datamodules.mnist import OFFICIAL_FILES, download_resource, transform_images
from lightning_dp.datamodules.offline import md5sum

MODULES = [MNISTDataModule, FashionMNISTDataModule]


def _expected(images: torch.Tensor, module: type[MNISTFamilyDataModule], normalize: bool = True) -> torch.Tensor:
    x = images.to(torch.float32).unsqueeze(1) / 255.0
    return (x - module.mean) / module.std if normalize else x


# ---------------------------------------------------------------- full subset, idx source
@pytest.mark.parametrize("module", MODULES)
@pytest.mark.parametrize("gz", [True, False])
def test_full_subset_sizes_shapes_and_normalization(tmp_path, mnist_files, module, gz):
    written = mnist_files(tmp_path, n_train=400, n_test=200, gz=gz)
    datamodule = module(data_dir=tmp_path, val_size=100)
    datamodule.prepare_data()
    datamodule.setup()
    assert [len(datamodule.train_dataset), len(datamodule.val_dataset), len(datamodule.test_dataset)] == [
        300,
        100,
        200,
    ]
    assert datamodule.num_classes == 10 and datamodule.input_shape == (1, 28, 28)
    for dataset in (datamodule.train_dataset, datamodule.val_dataset, datamodule.test_dataset):
        x, y = dataset.tensors
        assert x.dtype == torch.float32 and x.shape[1:] == (1, 28, 28)
        assert y.dtype == torch.int64
    # The test split is the official t10k split, in file order, normalized with the dataset's constants.
    test_images, test_labels = written["test"]
    assert torch.allclose(datamodule.test_dataset.tensors[0], _expected(test_images, module), atol=1e-6)
    assert torch.equal(datamodule.test_dataset.tensors[1], test_labels.to(torch.int64))
    # Train + val are exactly the official training split.
    train_images, train_labels = written["train"]
    merged = torch.cat([datamodule.train_dataset.tensors[1], datamodule.val_dataset.tensors[1]])
    assert torch.equal(torch.bincount(merged), torch.bincount(train_labels.to(torch.int64)))
    # Validation is stratified: 100 of 400 balanced images -> 10 per digit.
    assert torch.bincount(datamodule.val_dataset.tensors[1]).tolist() == [10] * 10


def test_dataset_constants():
    assert (MNISTDataModule.mean, MNISTDataModule.std) == (0.1307, 0.3081)
    assert (FashionMNISTDataModule.mean, FashionMNISTDataModule.std) == (0.2860, 0.3530)
    assert MNISTDataModule.hf_dataset == "ylecun/mnist"
    assert FashionMNISTDataModule.hf_dataset == "zalando-datasets/fashion_mnist"
    assert MNISTDataModule().data_dir == Path("./data/mnist")
    assert FashionMNISTDataModule().data_dir == Path("./data/fashion_mnist")
    assert len(FashionMNISTDataModule.classes) == 10
    for module in MODULES:
        assert set(module.md5s) == {f"{name}.gz" for pair in OFFICIAL_FILES.values() for name in pair}


def test_normalize_false_keeps_unit_range(mnist_dir):
    directory, written = mnist_dir
    datamodule = MNISTDataModule(data_dir=directory, val_size=50, normalize=False)
    datamodule.setup("test")
    x = datamodule.test_dataset.tensors[0]
    assert torch.equal(x, _expected(written["test"][0], MNISTDataModule, normalize=False))
    assert float(x.min()) >= 0.0 and float(x.max()) <= 1.0


def test_setup_loads_only_what_the_stage_needs(tmp_path, mnist_files):
    mnist_files(tmp_path, splits=("train",))  # no t10k files at all
    datamodule = MNISTDataModule(data_dir=tmp_path, val_size=50)
    datamodule.setup("fit")
    assert len(datamodule.train_dataset) == 350 and datamodule.test_dataset is None
    train_before = datamodule.train_dataset
    with pytest.raises(FileNotFoundError, match=r"missing: t10k-images-idx3-ubyte\.gz, t10k-labels-idx1-ubyte\.gz"):
        datamodule.setup("test")
    datamodule.setup("validate")  # already built: kept as is
    assert datamodule.train_dataset is train_before


def test_split_is_deterministic_by_seed(mnist_dir):
    directory, _ = mnist_dir
    datamodules = [MNISTDataModule(data_dir=directory, val_size=80, seed=seed) for seed in (1, 1, 2)]
    for datamodule in datamodules:
        datamodule.setup("fit")
    first, again, other = (datamodule.val_dataset.tensors[0] for datamodule in datamodules)
    assert torch.equal(first, again)
    assert not torch.equal(first, other)


def test_loaders(mnist_dir):
    directory, _ = mnist_dir
    datamodule = MNISTDataModule(data_dir=directory, val_size=100, batch_size=32)
    datamodule.setup()
    assert isinstance(datamodule.train_dataloader().sampler, RandomSampler)
    assert isinstance(datamodule.val_dataloader().sampler, SequentialSampler)
    assert isinstance(datamodule.test_dataloader().sampler, SequentialSampler)
    x, y = next(iter(datamodule.train_dataloader()))
    assert x.shape == (32, 1, 28, 28) and x.dtype == torch.float32 and y.dtype == torch.int64
    assert torch.equal(next(iter(datamodule.train_dataloader()))[1], y)  # seeded shuffle


# ---------------------------------------------------------------- t10k subset
def test_t10k_subset_needs_only_the_test_files(t10k_dir):
    directory, written = t10k_dir
    datamodule = MNISTDataModule(data_dir=directory, subset="t10k", train_fraction=0.6, val_fraction=0.2)
    assert datamodule.missing_files() == []
    datamodule.setup("fit")
    sizes = [len(datamodule.train_dataset), len(datamodule.val_dataset), len(datamodule.test_dataset)]
    assert sizes == [300, 100, 100]
    for dataset in (datamodule.train_dataset, datamodule.val_dataset, datamodule.test_dataset):
        assert torch.bincount(dataset.tensors[1]).tolist() == [len(dataset) // 10] * 10  # stratified
    # Together the three splits are exactly the 500 t10k images (compared through per-image pixel sums).
    splits = (datamodule.train_dataset, datamodule.val_dataset, datamodule.test_dataset)
    pixel_sums = torch.cat([dataset.tensors[0].sum(dim=(1, 2, 3)) for dataset in splits])
    expected = _expected(written["test"][0], MNISTDataModule).sum(dim=(1, 2, 3))
    assert torch.allclose(torch.sort(pixel_sums).values, torch.sort(expected).values, atol=1e-3)


def test_t10k_subset_is_deterministic_by_seed(t10k_dir):
    directory, _ = t10k_dir
    test_images = []
    for seed in (0, 0, 1):
        datamodule = FashionMNISTDataModule(data_dir=directory, subset="t10k", seed=seed)
        datamodule.setup("test")
        test_images.append(datamodule.test_dataset.tensors[0])
    assert torch.equal(test_images[0], test_images[1]) and not torch.equal(test_images[0], test_images[2])


def test_t10k_fractions_that_leave_a_split_empty(t10k_dir):
    directory, _ = t10k_dir
    datamodule = MNISTDataModule(data_dir=directory, subset="t10k", train_fraction=0.999, val_fraction=0.0005)
    with pytest.raises(ValueError, match="empty split"):
        datamodule.setup()


# ---------------------------------------------------------------- errors
def test_missing_files_error_names_directory_files_and_fixes(tmp_path):
    directory = tmp_path / "nothing-here"
    datamodule = FashionMNISTDataModule(data_dir=directory)
    with pytest.raises(FileNotFoundError) as info:
        datamodule.setup("fit")
    message = str(info.value)
    assert str(directory.resolve()) in message
    for pair in OFFICIAL_FILES.values():
        for name in pair:
            assert name in message
    assert "download=True" in message and "copy the official files" in message
    assert FashionMNISTDataModule.mirrors[0] in message


def test_missing_files_error_in_t10k_mode_names_only_t10k_files(tmp_path):
    with pytest.raises(FileNotFoundError) as info:
        MNISTDataModule(data_dir=tmp_path, subset="t10k").setup()
    assert "t10k-images-idx3-ubyte" in str(info.value) and "train-images" not in str(info.value)


def test_inconsistent_files_raise(tmp_path, mnist_files):
    mnist_files(tmp_path, splits=("test",), n_test=100)
    write_idx(tmp_path / "t10k-labels-idx1-ubyte.gz", torch.zeros(99, dtype=torch.uint8))
    with pytest.raises(ValueError, match="100 images but labels of shape"):
        MNISTDataModule(data_dir=tmp_path, subset="t10k").setup()
    write_idx(tmp_path / "t10k-labels-idx1-ubyte.gz", torch.full((100,), 10, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"labels must be in 0\.\.9"):
        MNISTDataModule(data_dir=tmp_path, subset="t10k").setup()
    write_idx(tmp_path / "t10k-images-idx3-ubyte.gz", torch.zeros(100, 32, 32, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"shape \(N, 28, 28\)"):
        MNISTDataModule(data_dir=tmp_path, subset="t10k").setup()


def test_val_size_larger_than_training_split(mnist_dir):
    directory, _ = mnist_dir
    with pytest.raises(ValueError, match="val_size=400 must be below"):
        MNISTDataModule(data_dir=directory, val_size=400).setup("fit")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"source": "torchvision"}, "source must be 'idx' or 'huggingface'"),
        ({"subset": "train"}, "subset must be 'full'"),
        ({"batch_size": -2}, "batch_size must be a positive integer"),
        ({"val_size": 0}, "val_size must be a positive integer"),
        ({"train_fraction": 0.9, "val_fraction": 0.1}, "must be below 1"),
        ({"download": "yes"}, "download must be True or False"),
        ({"normalize": 1}, "normalize must be True or False"),
        ({"num_workers": 1.5}, "num_workers"),
    ],
)
def test_invalid_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        MNISTDataModule(**kwargs)


def test_base_class_is_abstract_and_arguments_keyword_only():
    with pytest.raises(TypeError, match="base class"):
        MNISTFamilyDataModule(data_dir=".")
    with pytest.raises(TypeError):
        MNISTDataModule("./data")  # type: ignore[misc]


def test_loader_before_setup_raises():
    with pytest.raises(RuntimeError, match=r"call setup\('test'\) first"):
        MNISTDataModule().test_dataloader()


def test_configurable_from_the_command_line():
    """LightningCLI (jsonargparse) sees every argument of the base class through **kwargs."""
    parser = ArgumentParser()
    parser.add_class_arguments(FashionMNISTDataModule, "data")
    config = parser.parse_args(["--data.subset=t10k", "--data.val_fraction=0.2"]).data
    assert config.data_dir == "./data/fashion_mnist" and config.subset == "t10k" and config.val_fraction == 0.2
    assert config.batch_size == 256 and config.val_size == 5000 and config.normalize is True
    hparams = MNISTDataModule(data_dir="x", batch_size=8).hparams
    assert hparams["data_dir"] == "x" and hparams["batch_size"] == 8 and hparams["source"] == "idx"


def test_transform_images_rejects_wrong_input():
    with pytest.raises(ValueError, match="uint8 images of shape"):
        transform_images(torch.zeros(2, 28, 28))


# ---------------------------------------------------------------- download
@pytest.fixture
def mirror(tmp_path: Path, mnist_files) -> tuple[Path, dict[str, str]]:
    """A local mirror of generated .gz files and their md5 sums."""
    mirror = tmp_path / "mirror"
    mnist_files(mirror, n_train=200, n_test=100)
    return mirror, {path.name: md5sum(path) for path in mirror.iterdir()}


@pytest.mark.parametrize("module", MODULES)
def test_prepare_data_downloads_missing_files_with_mirror_fallback(tmp_path, monkeypatch, mirror, module):
    mirror, md5s = mirror
    broken = (tmp_path / "no-such-mirror").as_uri() + "/"
    monkeypatch.setattr(module, "mirrors", (broken, mirror.as_uri() + "/"))
    monkeypatch.setattr(module, "md5s", md5s)
    data_dir = tmp_path / "data"
    datamodule = module(data_dir=data_dir, download=True, val_size=20)
    datamodule.prepare_data()
    assert sorted(path.name for path in data_dir.iterdir()) == sorted(md5s)
    for name, md5 in md5s.items():
        assert md5sum(data_dir / name) == md5
    datamodule.setup()
    assert [len(datamodule.train_dataset), len(datamodule.val_dataset), len(datamodule.test_dataset)] == [
        180,
        20,
        100,
    ]
    # Present files are not downloaded again, even with no reachable mirror.
    monkeypatch.setattr(module, "mirrors", (broken,))
    datamodule.prepare_data()


def test_prepare_data_t10k_downloads_only_t10k(tmp_path, monkeypatch, mirror):
    mirror, md5s = mirror
    monkeypatch.setattr(MNISTDataModule, "mirrors", (mirror.as_uri(),))
    monkeypatch.setattr(MNISTDataModule, "md5s", md5s)
    data_dir = tmp_path / "data"
    MNISTDataModule(data_dir=data_dir, download=True, subset="t10k").prepare_data()
    downloaded = sorted(path.name for path in data_dir.iterdir())
    assert downloaded == ["t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"]


def test_prepare_data_without_download_does_nothing(tmp_path):
    data_dir = tmp_path / "data"
    MNISTDataModule(data_dir=data_dir).prepare_data()
    assert not data_dir.exists()


def test_wrong_md5_is_rejected_and_leaves_no_file(tmp_path, monkeypatch, mirror):
    mirror, md5s = mirror
    wrong = dict(md5s, **{"t10k-images-idx3-ubyte.gz": "0" * 32})
    monkeypatch.setattr(MNISTDataModule, "mirrors", (mirror.as_uri() + "/",))
    monkeypatch.setattr(MNISTDataModule, "md5s", wrong)
    data_dir = tmp_path / "data"
    with pytest.raises(DatasetUnavailableError) as info:
        MNISTDataModule(data_dir=data_dir, download=True, subset="t10k").prepare_data()
    message = str(info.value)
    assert "md5 mismatch: expected 00000000000000000000000000000000" in message
    assert md5s["t10k-images-idx3-ubyte.gz"] in message
    assert "t10k-images-idx3-ubyte.gz" in message and str(data_dir.resolve()) in message
    assert not data_dir.exists()  # nothing half-made: not the other file, no .part, no directory


def test_download_resource_uses_injected_opener(tmp_path):
    payload = b"official bytes"
    source = tmp_path / "payload"
    source.write_bytes(payload)
    calls = []

    def opener(request, timeout):
        calls.append((request.full_url, request.get_header("User-agent"), timeout))
        if "first" in request.full_url:
            raise OSError("connection refused")
        return open(source, "rb")

    path = download_resource(
        "file.gz",
        directory=tmp_path / "out",
        mirrors=["https://first.example/mnist", "http://second.example/mnist/"],
        md5=md5sum(source),
        urlopen=opener,
        timeout=5,
    )
    assert path.read_bytes() == payload
    assert calls == [
        ("https://first.example/mnist/file.gz", "lightning-dp", 5),
        ("http://second.example/mnist/file.gz", "lightning-dp", 5),
    ]


# ---------------------------------------------------------------- huggingface source
class _FakeDatasets(types.ModuleType):
    """Stands in for the `datasets` package: load_dataset returns splits of PIL images."""

    def __init__(self, splits: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        super().__init__("datasets")
        from PIL import Image

        self.calls: list[tuple[str, str]] = []
        self._splits = {
            name: {
                "image": [Image.fromarray(image.numpy(), mode="L") for image in images],
                "label": [int(label) for label in labels],
            }
            for name, (images, labels) in splits.items()
        }

    def load_dataset(self, path: str, *, cache_dir: str):
        self.calls.append((path, cache_dir))
        return self._splits


@pytest.mark.parametrize("module", MODULES)
@pytest.mark.parametrize("subset", ["full", "t10k"])
def test_huggingface_source(tmp_path, monkeypatch, random_split, module, subset):
    splits = {"train": random_split(200, seed=0), "test": random_split(100, seed=1)}
    fake = _FakeDatasets(splits)
    monkeypatch.setitem(sys.modules, "datasets", fake)
    datamodule = module(data_dir=tmp_path / "hf", source="huggingface", subset=subset, val_size=40)
    datamodule.prepare_data()
    datamodule.setup()
    assert fake.calls[0] == (module.hf_dataset, str(tmp_path / "hf"))
    if subset == "full":
        sizes = [160, 40, 100]
        assert torch.allclose(datamodule.test_dataset.tensors[0], _expected(splits["test"][0], module), atol=1e-6)
    else:
        sizes = [80, 10, 10]
    assert [len(datamodule.train_dataset), len(datamodule.val_dataset), len(datamodule.test_dataset)] == sizes
    assert datamodule.train_dataset.tensors[0].shape[1:] == (1, 28, 28)
    assert datamodule.train_dataset.tensors[1].dtype == torch.int64


def test_huggingface_source_without_datasets_installed(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # makes `import datasets` fail
    with pytest.raises(ImportError, match=r"pip install 'lightning-dp\[hf\]'"):
        MNISTDataModule(data_dir=tmp_path, source="huggingface")  # refused before any data is read


# ---------------------------------------------------------------- Lightning integration
def test_trainer_runs_on_the_datamodule(t10k_dir):
    import lightning.pytorch as pl
    from torch import nn

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Flatten(), nn.Linear(784, 10))

        def _loss(self, batch):
            x, y = batch
            return nn.functional.cross_entropy(self.net(x), y)

        def training_step(self, batch, batch_idx):
            return self._loss(batch)

        def validation_step(self, batch, batch_idx):
            self.log("val/loss", self._loss(batch))

        def test_step(self, batch, batch_idx):
            self.log("test/loss", self._loss(batch))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    directory, _ = t10k_dir
    datamodule = MNISTDataModule(data_dir=directory, subset="t10k", batch_size=50)
    trainer = pl.Trainer(
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
    )
    model = Tiny()
    trainer.fit(model, datamodule=datamodule)
    results = trainer.test(model, datamodule=datamodule, verbose=False)
    assert np.isfinite(results[0]["test/loss"])


# ---------------------------------------------------------------- plain and gz files
def test_plain_and_gz_copies_are_interchangeable(mnist_dir, tmp_path):
    directory, _ = mnist_dir
    plain = tmp_path / "plain"
    plain.mkdir()
    for path in directory.iterdir():
        with gzip.open(path) as source, open(plain / path.name[: -len(".gz")], "wb") as target:
            shutil.copyfileobj(source, target)
    datamodules = [MNISTDataModule(data_dir=d, val_size=50) for d in (directory, plain)]
    for datamodule in datamodules:
        datamodule.setup()
    for attribute in ("train_dataset", "val_dataset", "test_dataset"):
        first, second = (getattr(datamodule, attribute).tensors[0] for datamodule in datamodules)
        assert torch.equal(first, second)
