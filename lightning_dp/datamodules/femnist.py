"""FEMNIST (LEAF): handwritten characters, one client per writer, half of the writers rotated.

Galli et al.'s FEMNIST experiment (thesis ch. 2): each writer is a client, and its images are rotated by 90
degrees with probability 0.5 (which ones: :attr:`FEMNISTDataModule.rotated`). Sources ``"leaf"`` (LEAF's JSON
files) and ``"huggingface"`` (``flwrlabs/femnist``, split per writer by ``hf_test_fraction``). The formats:
docs/data.md, "FEMNIST".
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, ClassVar, Literal, Optional, Union

import numpy as np
import torch
from lightning.pytorch.utilities import rank_zero_warn

from lightning_dp import checks
from lightning_dp.datamodules.base import renamed
from lightning_dp.datamodules.federated import (
    ClientDataset,
    FederatedDataModule,
    _block_sizes,
    derived_seed,
    split_clients,
)
from lightning_dp.datamodules.offline import (
    DataFormatError,
    DatasetUnavailableError,
    dataset_unavailable,
    import_datasets,
    load_hf_dataset,
)

__all__ = ["FEMNISTDataModule", "LEAFFormatError", "read_leaf_dir", "rotate_images"]

Source = Literal["leaf", "huggingface"]
NUM_PIXELS = 28 * 28
NUM_CLASSES = 62
#: Where LEAF's FEMNIST files come from, and the command of the thesis' sample.
LEAF_URL = "https://github.com/TalwalkarLab/leaf/tree/master/data/femnist"
LEAF_COMMAND = "./preprocess.sh -s niid --sf 0.05 -k 0 -t sample"
PathLike = Union[str, "os.PathLike[str]"]
WriterData = tuple[np.ndarray, np.ndarray]


class LEAFFormatError(DataFormatError):
    """Raised when a file is not in LEAF's JSON format (the message names the file and the problem)."""


def _leaf_files(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.json"))


def _load_json(path: Path) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
    except json.JSONDecodeError as err:
        raise LEAFFormatError(f"{path}: not valid JSON ({err})") from None
    if not isinstance(data, dict) or not {"users", "user_data"} <= data.keys():
        keys = sorted(data) if isinstance(data, dict) else type(data).__name__
        raise LEAFFormatError(f"{path}: expected LEAF keys 'users', 'num_samples', 'user_data', got {keys}")
    return data


def _leaf_writer(path: Path, user: str, record: Any) -> WriterData:
    if not isinstance(record, dict) or "x" not in record or "y" not in record:
        raise LEAFFormatError(f"{path}: user {user!r}: expected a dict with 'x' and 'y'")
    x = np.asarray(record["x"], dtype=np.float32)
    y = np.asarray(record["y"], dtype=np.int64)
    if x.ndim != 2 or x.shape[1] != NUM_PIXELS or y.shape != (x.shape[0],):
        raise LEAFFormatError(
            f"{path}: user {user!r}: x must be a list of {NUM_PIXELS}-pixel images and y one label per image, "
            f"got x {x.shape} and y {y.shape}"
        )
    if y.size and (y.min() < 0 or y.max() >= NUM_CLASSES):
        raise LEAFFormatError(
            f"{path}: user {user!r}: labels must be in 0..{NUM_CLASSES - 1}, got {y.min()}..{y.max()}"
        )
    if x.size and (x.min() < 0.0 or x.max() > 1.0):
        raise LEAFFormatError(f"{path}: user {user!r}: pixels must be in [0, 1], got {x.min()}..{x.max()}")
    return x, y


def read_leaf_dir(directory: PathLike, *, users: Optional[Iterable[str]] = None) -> dict[str, WriterData]:
    """Read every ``*.json`` of a LEAF split directory.

    Args:
        directory: A LEAF split directory (``.../train`` or ``.../test``).
        users: Convert only these writers (the others are parsed, then dropped, which
            keeps memory low on the full dataset); ``None`` for all.

    Returns:
        ``{writer: (x, y)}`` with ``x`` float32 of shape ``(n, 784)`` (LEAF's values,
        white background 1.0) and ``y`` int64 of shape ``(n,)``; a writer found in
        several files has its samples concatenated in file order. Files are read in
        sorted order.

    Raises:
        LEAFFormatError: If a file is not in LEAF's format.
    """
    wanted = set(users) if users is not None else None
    out: dict[str, list[WriterData]] = {}
    for path in _leaf_files(Path(directory)):
        data = _load_json(path)
        for user in data["users"]:
            if wanted is not None and user not in wanted:
                continue
            if user not in data["user_data"]:
                raise LEAFFormatError(f"{path}: user {user!r} is listed in 'users' but has no 'user_data'")
            out.setdefault(user, []).append(_leaf_writer(path, user, data["user_data"][user]))
    return {user: _concatenate(parts) for user, parts in out.items()}


def _leaf_users(directory: Path) -> list[str]:
    users: list[str] = []
    for path in _leaf_files(directory):
        users.extend(_load_json(path)["users"])
    return users


def _concatenate(parts: Sequence[WriterData]) -> WriterData:
    if len(parts) == 1:
        return parts[0]
    return np.concatenate([x for x, _ in parts]), np.concatenate([y for _, y in parts])


def rotate_images(images: torch.Tensor) -> torch.Tensor:
    """Rotate images ``(..., H, W)`` by 90 degrees counter-clockwise, like ``np.rot90(image)``.

    Example:
        >>> image = torch.arange(4.0).reshape(1, 2, 2)
        >>> bool(torch.equal(rotate_images(image)[0], torch.from_numpy(np.rot90(image[0].numpy()).copy())))
        True
    """
    return torch.rot90(images, k=1, dims=(-2, -1))


def _import_datasets() -> Any:
    return import_datasets("FEMNISTDataModule(source='huggingface')", "source='leaf' with LEAF's JSON files")


def _image_to_array(image: Any) -> np.ndarray:
    if hasattr(image, "convert"):  # PIL image
        image = image.convert("L")
    array = np.asarray(image)
    if array.shape != (28, 28):
        raise ValueError(f"FEMNIST: expected 28x28 grayscale images, got an image of shape {array.shape}")
    return array


class FEMNISTDataModule(FederatedDataModule):
    """LEAF FEMNIST: 62-class handwriting, one client per writer, each writer rotated with probability 0.5.

    ``setup()`` reads the writers that have training data, optionally keeps a seeded
    random ``max_clients`` of them, and splits them (seeded, by writer) into
    ``1 - val_fraction`` training and ``val_fraction`` validation clients. The
    training and validation clients hold the writers' *training* samples;
    :attr:`test_clients` holds, for every selected writer (training and validation
    clients alike) that has some, the writer's *test* samples (LEAF's ``test/``
    files, or the held-out share with ``source="huggingface"``), under the same client id.
    Writers that only appear in the test files are not clients.

    Users: a client is one writer (LEAF's user), so :meth:`concatenated`'s ``user_ids`` is the writer of every
    image and ``DPSGD(privacy_unit="user")`` over :class:`~lightning_dp.datamodules.CentralizedView` protects
    everything one writer wrote (examples/user_level/els_femnist.yaml).

    Rotation: every writer is rotated with probability ``rotate_probability``, decided
    by a uniform draw from a generator seeded with ``(seed, writer id)`` only, so a
    writer's draw does not depend on which other writers are loaded; all of a rotated
    writer's images (training and test) are turned by 90 degrees counter-clockwise
    (:func:`rotate_images`, ``np.rot90``). :attr:`rotated` maps each client id to
    whether it was rotated.

    Pixels: LEAF stores ink dark on a white background of 1.0. With ``invert=True``
    (default) the pixels become ``1 - value``: black background 0 and bright ink, the
    MNIST convention of the package's other image DataModules (zero padding then equals
    background). ``invert=False`` keeps LEAF's values. No standardization. The Hugging
    Face images (``uint8``) are divided by 255 and assumed to follow the same
    white-background convention as the NIST scans LEAF is built from.

    ``x`` is float32 of shape ``(n, 1, 28, 28)``, ``y`` int64 in 0..61 (0-9 digits,
    10-35 upper case, 36-61 lower case).

    Args:
        data_dir: The LEAF directory holding ``train/`` and ``test/``
            (``source="leaf"``), or the Hugging Face cache directory.
        source: ``"leaf"`` or ``"huggingface"``.
        val_fraction: Fraction of the selected writers held out as validation clients, in (0, 1).
        max_clients: Keep a seeded random subset of this many writers; ``None`` for all.
        rotate_probability: Probability that a writer's images are rotated, in [0, 1].
        invert: Invert the pixels to a black background (see above).
        hf_test_fraction: ``source="huggingface"`` only: share of each writer's samples
            held out as its test samples, in (0, 1).
        batch_size: Samples per batch of the centralized loaders.
        num_workers: DataLoader worker processes.
        seed: Seed of the writer subsample, the writer split, the rotations, the
            Hugging Face per-writer test split and the training-loader shuffling.

    Raises:
        ValueError: If an argument is outside its range.

    Example:
        >>> dm = FEMNISTDataModule(data_dir="../shared/data/femnist", max_clients=20)  # doctest: +SKIP
        >>> dm.setup()  # doctest: +SKIP
        >>> len(dm.train_clients), len(dm.val_clients), tuple(dm.train_clients[0].x.shape[1:])  # doctest: +SKIP
        (16, 4, (1, 28, 28))
    """

    task = "classification"
    num_classes = NUM_CLASSES
    input_shape = (1, 28, 28)
    #: Hugging Face Hub identifier of ``source="huggingface"``.
    hf_dataset: ClassVar[str] = "flwrlabs/femnist"

    def __init__(
        self,
        *,
        data_dir: PathLike = "./data/femnist",
        source: Source = "leaf",
        val_fraction: float = 0.2,
        max_clients: Optional[int] = None,
        rotate_probability: float = 0.5,
        invert: bool = True,
        hf_test_fraction: float = 0.1,
        batch_size: int = 64,
        num_workers: int = 0,
        seed: int = 0,
    ) -> None:
        super().__init__(batch_size=batch_size, num_workers=num_workers, seed=seed)
        owner = type(self).__name__
        if source not in ("leaf", "huggingface"):
            raise ValueError(f"{owner}: source must be 'leaf' or 'huggingface', got {source!r}")
        checks.open_fraction("val_fraction", val_fraction, owner=owner)
        checks.open_fraction("hf_test_fraction", hf_test_fraction, owner=owner)
        checks.probability("rotate_probability", rotate_probability, owner=owner)
        if max_clients is not None:
            checks.positive_int("max_clients", max_clients, owner=owner)
            if max_clients < 2:
                raise ValueError(
                    f"{owner}: max_clients must be at least 2 (one training and one validation client), "
                    f"got {max_clients!r}"
                )
        if not isinstance(invert, bool):
            raise ValueError(f"{owner}: invert must be True or False, got {invert!r}")
        self.save_hyperparameters()
        self.data_dir = Path(data_dir).expanduser()
        self.source = source
        if source == "huggingface":
            _import_datasets()  # a missing extra is refused now, before any data is read
        self.val_fraction = float(val_fraction)
        self.max_clients = max_clients
        self.rotate_probability = float(rotate_probability)
        self.invert = invert
        self.hf_test_fraction = float(hf_test_fraction)
        #: Whether each client (writer id) was rotated, filled by ``setup()``.
        self.rotated: dict[str, bool] = {}
        self.num_writers_available = 0

    # ----------------------------------------------------------------- public helpers
    def is_rotated(self, client_id: str) -> bool:
        """The seeded rotation draw of a writer: ``U(seed, writer) < rotate_probability``."""
        generator = torch.Generator().manual_seed(derived_seed(self.seed, "femnist-rotation", client_id))
        return bool(torch.rand((), generator=generator, dtype=torch.float64) < self.rotate_probability)

    def _rotations(self, writers: Sequence[str]) -> dict[str, bool]:
        """Which of the loaded writers are rotated (:meth:`is_rotated` of each, independently)."""
        return {writer: self.is_rotated(writer) for writer in writers}

    def unavailable(self, error: Optional[str] = None) -> DatasetUnavailableError:
        """The error of missing data: LEAF's files (or the Hugging Face cache), where to get them, and
        ``error`` (the download's, one line) when a download failed."""
        owner = type(self).__name__
        leaf = ["train/*.json", "test/*.json"]
        if self.source == "huggingface":
            return dataset_unavailable(
                owner, "FEMNIST", data_dir=self.data_dir, expected=[f"the Hugging Face cache of {self.hf_dataset}"],
                sources=[f"https://huggingface.co/datasets/{self.hf_dataset}"], error=error,
                fix=f"offline, use source='leaf' with LEAF's {' and '.join(leaf)} in data_dir, or copy a filled "
                    "Hugging Face cache into data_dir and set HF_DATASETS_OFFLINE=1.")
        return dataset_unavailable(
            owner, "FEMNIST", data_dir=self.data_dir, expected=leaf,
            layout="LEAF's JSON files with keys users, num_samples, user_data; test/ is optional",
            sources=[f"{LEAF_URL} (run `{LEAF_COMMAND}`)", f"Hugging Face dataset {self.hf_dataset} "
                     "(source='huggingface')"],
            error=error, fix="point data_dir at the LEAF FEMNIST directory holding train/ and test/ "
                             "(LEAF's data/femnist/data), or use source='huggingface'.")

    def prepare_data(self) -> None:
        """Download only: fills the Hugging Face cache (``source="huggingface"``); LEAF files are made by LEAF.

        Raises:
            DatasetUnavailableError: If the Hugging Face dataset is neither cached nor downloadable.
        """
        if self.source == "huggingface":
            load_hf_dataset(_import_datasets(), self.hf_dataset, cache_dir=self.data_dir,
                            unavailable=self.unavailable)

    # ----------------------------------------------------------------- setup
    def _select_writers(self, writers: Iterable[str]) -> list[str]:
        writers = sorted(set(writers))
        self.num_writers_available = len(writers)
        if self.max_clients is not None and self.max_clients < len(writers):
            generator = torch.Generator().manual_seed(derived_seed(self.seed, "femnist-subsample"))
            keep = torch.randperm(len(writers), generator=generator)[: self.max_clients]
            writers = [writers[i] for i in sorted(keep.tolist())]
        return writers

    def _load_leaf(self) -> tuple[dict[str, WriterData], dict[str, WriterData]]:
        owner = type(self).__name__
        train_dir, test_dir = self.data_dir / "train", self.data_dir / "test"
        if not _leaf_files(train_dir):
            raise self.unavailable()
        if self.max_clients is None:
            train = read_leaf_dir(train_dir)
            selected = self._select_writers(train)
        else:
            selected = self._select_writers(_leaf_users(train_dir))
            train = read_leaf_dir(train_dir, users=selected)
        if _leaf_files(test_dir):
            test = read_leaf_dir(test_dir, users=selected)
        else:
            rank_zero_warn(f"{owner}: no LEAF test files in {test_dir}; test_clients will be empty")
            test = {}
        return {w: train[w] for w in selected}, test

    def _load_huggingface(self) -> tuple[dict[str, WriterData], dict[str, WriterData]]:
        dataset = load_hf_dataset(_import_datasets(), self.hf_dataset, cache_dir=self.data_dir,
                                  unavailable=self.unavailable)
        split = dataset["train"]
        rows_of: dict[str, list[int]] = {}
        for index, writer in enumerate(split["writer_id"]):
            rows_of.setdefault(str(writer), []).append(index)
        selected = self._select_writers(rows_of)
        order = [index for writer in selected for index in rows_of[writer]]
        subset = split.select(order)
        images = np.stack([_image_to_array(image) for image in subset["image"]]).reshape(len(order), NUM_PIXELS)
        pixels = images.astype(np.float32) / 255.0
        labels = np.asarray(list(subset["character"]), dtype=np.int64)
        train, test, start = {}, {}, 0
        for writer in selected:
            count = len(rows_of[writer])
            x, y = pixels[start:start + count], labels[start:start + count]
            start += count
            n_test = min(_block_sizes(count, [1.0 - self.hf_test_fraction, self.hf_test_fraction])[1], count - 1)
            generator = torch.Generator().manual_seed(derived_seed(self.seed, "femnist-hf-test", writer))
            permutation = torch.randperm(count, generator=generator)
            test_idx = np.sort(permutation[:n_test].numpy())
            train_idx = np.sort(permutation[n_test:].numpy())
            train[writer] = (x[train_idx], y[train_idx])
            if n_test:
                test[writer] = (x[test_idx], y[test_idx])
        return train, test

    def _client(self, writer: str, data: WriterData) -> ClientDataset:
        x = torch.from_numpy(np.ascontiguousarray(data[0])).reshape(-1, *self.input_shape)
        if self.invert:
            x = 1.0 - x
        if self.rotated[writer]:
            x = rotate_images(x)
        return ClientDataset(writer, x.contiguous(), torch.from_numpy(np.ascontiguousarray(data[1])))

    def _build_clients(self) -> tuple[list[ClientDataset], list[ClientDataset], list[ClientDataset]]:
        train, test = self._load_leaf() if self.source == "leaf" else self._load_huggingface()
        writers = list(train)
        self.rotated = self._rotations(writers)
        train_writers, val_writers = split_clients(writers, [1.0 - self.val_fraction, self.val_fraction],
                                                   seed=self.seed)
        return (
            [self._client(w, train[w]) for w in train_writers],
            [self._client(w, train[w]) for w in val_writers],
            [self._client(w, test[w]) for w in train_writers + val_writers if w in test],
        )

    def summary(self) -> dict[str, Any]:
        """:meth:`FederatedDataModule.summary` plus ``source``, ``writers_available``, the settings and,
        per split, the number of ``rotated`` clients."""
        out = super().summary()
        for split in ("train", "val", "test"):
            out[split]["rotated"] = sum(self.rotated[client.client_id] for client in self.clients(split))
        out["source"] = self.source
        out["writers_available"] = self.num_writers_available
        out["rotate_probability"] = self.rotate_probability
        out["invert"] = self.invert
        return out


def __getattr__(name: str) -> type:  # the former names (datamodules.base.RENAMED), warned
    return renamed(__name__, name, globals())
