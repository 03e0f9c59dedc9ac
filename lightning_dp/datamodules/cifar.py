"""CIFAR-10 from its official "python version" archive, read without trusting pickle.

:func:`read_cifar_batch` reads a batch file with an unpickler that builds only numpy arrays, lists, dicts, bytes and
numbers (anything else is refused); ``download_cifar10`` fetches the md5-verified archive and extracts only the
batch files, renamed into place when complete. The layout: docs/data.md, "CIFAR-10".
"""

from __future__ import annotations

import io
import os
import pickle
import shutil
import tarfile
from pathlib import Path
from typing import Any, Optional, Union

import numpy as np
import torch

from lightning_dp.datamodules.mnist import download_resource
from lightning_dp.datamodules.offline import (
    DataFormatError,
    DatasetUnavailableError,
    dataset_unavailable,
    import_datasets,
    load_hf_dataset,
    publish,
    removing_on_failure,
    staging_area,
)

__all__ = ["CIFAR10_FILES", "CIFAR10_MEAN", "CIFAR10_STD", "CIFARFormatError", "HF_DATASET", "cifar10_dir",
           "cifar10_unavailable", "download_cifar10", "load_cifar10", "load_cifar10_hf", "read_cifar_batch",
           "transform_cifar"]

PathLike = Union[str, "os.PathLike[str]"]

ARCHIVE = "cifar-10-python.tar.gz"
ARCHIVE_MD5 = "c58f30108f718f92721af3b95e74349a"
MIRRORS = ("https://www.cs.toronto.edu/~kriz/",)
FOLDER = "cifar-10-batches-py"
#: the official batch files of each split
CIFAR10_FILES: dict[str, tuple[str, ...]] = {
    "train": tuple(f"data_batch_{i}" for i in range(1, 6)),
    "test": ("test_batch",),
}
#: per-channel pixel mean and std of the training split, in [0, 1] scale
CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)
#: the Hugging Face Hub copy (columns ``img``: PIL 32x32 RGB, ``label``), for ``source="huggingface"``
HF_DATASET = "uoft-cs/cifar10"
CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")

# what a CIFAR batch pickle may construct: numpy arrays (numpy 1 and 2 module paths) and their dtypes
_ALLOWED = {
    ("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
    ("numpy", "ndarray"), ("numpy", "dtype"), ("_codecs", "encode"),
}


class CIFARFormatError(DataFormatError):
    """A file is not an official CIFAR-10 batch (or it asks the unpickler for anything but arrays)."""


class _ArraysOnly(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        raise CIFARFormatError(f"refusing to build {module}.{name}: a CIFAR batch holds only arrays, lists and bytes")


def read_cifar_batch(path: PathLike) -> tuple[torch.Tensor, torch.Tensor]:
    """One official batch file as ``(images uint8 (N, 3, 32, 32), labels int64 (N,))``.

    Raises:
        CIFARFormatError: If the file is not a batch dict with ``data`` (N, 3072) uint8 and N
            ``labels`` in 0..9, or its pickle asks for anything else than arrays.
    """
    path = Path(path)
    try:
        with open(path, "rb") as handle:
            batch = _ArraysOnly(io.BufferedReader(handle), encoding="bytes").load()
    except CIFARFormatError as err:
        raise CIFARFormatError(f"{path}: {err}") from None
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError) as err:
        raise CIFARFormatError(f"{path}: not a CIFAR-10 batch pickle ({err})") from None
    if not isinstance(batch, dict):
        raise CIFARFormatError(f"{path}: expected a dict with b'data' and b'labels', got {type(batch).__name__}")
    data = batch.get(b"data", batch.get("data"))
    labels = batch.get(b"labels", batch.get("labels"))
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3072:
        raise CIFARFormatError(f"{path}: b'data' must be a uint8 array of shape (N, 3072), got "
                               f"{getattr(data, 'dtype', type(data).__name__)} {getattr(data, 'shape', '')}")
    labels = np.asarray(labels, dtype=np.int64)
    if labels.shape != (data.shape[0],) or (labels.size and (labels.min() < 0 or labels.max() > 9)):
        raise CIFARFormatError(f"{path}: b'labels' must hold {data.shape[0]} class indices in 0..9")
    images = torch.from_numpy(data.reshape(-1, 3, 32, 32).copy())
    return images, torch.from_numpy(labels)


def cifar10_dir(data_dir: PathLike) -> Path:
    """The folder holding the batch files: ``data_dir/cifar-10-batches-py`` or ``data_dir`` itself."""
    root = Path(data_dir).expanduser()
    return root / FOLDER if (root / FOLDER).is_dir() else root


def missing_cifar10_files(data_dir: PathLike, splits: tuple[str, ...] = ("train", "test")) -> list[str]:
    folder = cifar10_dir(data_dir)
    return [name for split in splits for name in CIFAR10_FILES[split] if not (folder / name).is_file()]


def cifar10_unavailable(data_dir: PathLike, splits: tuple[str, ...] = ("train", "test"), *,
                        error: Optional[str] = None, owner: str = "CIFAR-10", source: str = "files",
                        download: bool = False) -> DatasetUnavailableError:
    """The error of missing CIFAR-10 data: the batch files of ``splits``, where to get them, and the
    download's ``error`` (one line) when one failed (``source="huggingface"``: the Hub copy)."""
    expected = [f"{FOLDER}/{name}" for split in splits for name in CIFAR10_FILES[split]]
    archive = f"{MIRRORS[0]}{ARCHIVE} (md5 {ARCHIVE_MD5})"
    hub = f"Hugging Face dataset {HF_DATASET} (source='huggingface')"
    if source == "huggingface":
        return dataset_unavailable(
            owner, "CIFAR-10", data_dir=data_dir, expected=[f"the Hugging Face cache of {HF_DATASET}"],
            sources=[f"https://huggingface.co/datasets/{HF_DATASET}"], error=error,
            fix=f"offline, use the official files ({', '.join(expected)}, extracted from {ARCHIVE}) in data_dir, "
                "or copy a filled Hugging Face cache into data_dir and set HF_DATASETS_OFFLINE=1.")
    folder = cifar10_dir(data_dir)
    missing = [f"{FOLDER}/{name}" for split in splits for name in CIFAR10_FILES[split]
               if not (folder / name).is_file()]
    fix = (f"extract {ARCHIVE} into data_dir (the batch files may also lie in data_dir itself)"
           + ("." if error is not None or download else ", or pass download=True."))
    return dataset_unavailable(owner, "CIFAR-10", data_dir=data_dir, expected=expected, missing=missing,
                               layout="the official python-version batches", sources=[archive, hub], error=error,
                               fix=fix)


def download_cifar10(data_dir: PathLike, **kwargs: Any) -> Path:
    """Fetch and extract the official archive into ``data_dir/cifar-10-batches-py`` (if files are missing).

    ``kwargs`` go to :func:`~lightning_dp.datamodules.mnist.download_resource` (``urlopen``, ``timeout``).
    Only the seven batch and meta files are extracted (no path from the archive is trusted), into
    a temporary folder inside ``data_dir``; the folder is renamed into place only once all of them
    are there (an existing ``cifar-10-batches-py`` only gets the files it lacks). A failed attempt
    leaves ``data_dir`` as it was (a directory created for it is removed again).

    Raises:
        RuntimeError: (:class:`~lightning_dp.datamodules.offline.DownloadError`) If no mirror served
            the archive; :class:`CIFARFormatError` if it is not the official one.
    """
    root = Path(data_dir).expanduser()
    target = root / FOLDER
    if not missing_cifar10_files(root):
        return cifar10_dir(root)
    with removing_on_failure(root):
        return _download_into(root, target, kwargs)


def _download_into(root: Path, target: Path, kwargs: dict[str, Any]) -> Path:
    with staging_area(root) as tmp:
        archive = download_resource(ARCHIVE, directory=tmp, mirrors=MIRRORS, md5=ARCHIVE_MD5, **kwargs)
        staged = tmp / FOLDER
        staged.mkdir()
        wanted = {f"{FOLDER}/{name}" for names in CIFAR10_FILES.values() for name in names} | {f"{FOLDER}/batches.meta"}
        with tarfile.open(archive, "r:gz") as tar:
            for member in tar.getmembers():
                if member.name in wanted and member.isfile():
                    source = tar.extractfile(member)
                    assert source is not None
                    with source, open(staged / Path(member.name).name, "wb") as out:
                        shutil.copyfileobj(source, out)
        missing = missing_cifar10_files(tmp)
        if missing:
            raise CIFARFormatError(f"{ARCHIVE} lacks {missing}: not the official CIFAR-10 python archive")
        if not publish(staged, target):  # the user's folder stays; it only gets the files it lacks
            for path in sorted(staged.iterdir()):
                publish(path, target / path.name)
    return target


def load_cifar10(data_dir: PathLike, split: str, *, owner: str = "CIFAR-10") -> tuple[torch.Tensor, torch.Tensor]:
    """The official ``"train"`` (50,000) or ``"test"`` (10,000) split from ``data_dir``.

    Raises:
        DatasetUnavailableError: (a :class:`FileNotFoundError`) If a batch file is missing (the
            message lists them and how to get them); ``owner`` names the caller in it.
    """
    if missing_cifar10_files(data_dir, (split,)):
        raise cifar10_unavailable(data_dir, (split,), owner=owner)
    parts = [read_cifar_batch(cifar10_dir(data_dir) / name) for name in CIFAR10_FILES[split]]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def load_cifar10_hf(cache_dir: PathLike, split: str, *, owner: str = "CIFAR-10") -> tuple[torch.Tensor, torch.Tensor]:
    """The ``"train"`` or ``"test"`` split of :data:`HF_DATASET` through ``datasets.load_dataset`` (cached in
    ``cache_dir``; ``HF_DATASETS_OFFLINE=1`` forbids downloads), as the same tensors as :func:`load_cifar10`.

    Raises:
        DatasetUnavailableError: If the dataset is neither cached nor downloadable.
    """
    datasets = import_datasets("CIFAR-10 from Hugging Face", "the official python batches in data_dir")
    table = load_hf_dataset(datasets, HF_DATASET, cache_dir=cache_dir, unavailable=lambda error:
                            cifar10_unavailable(cache_dir, owner=owner, source="huggingface", error=error))[split]
    images = np.stack([np.asarray(image, dtype=np.uint8) for image in table["img"]])  # (N, 32, 32, 3)
    if images.ndim != 4 or images.shape[1:] != (32, 32, 3):
        raise CIFARFormatError(f"{HF_DATASET}[{split}]: expected 32x32 RGB images, got shape {images.shape[1:]}")
    labels = torch.as_tensor(np.asarray(list(table["label"]), dtype=np.int64))
    return torch.from_numpy(images).permute(0, 3, 1, 2).contiguous(), labels


def transform_cifar(images: torch.Tensor, *, normalize: bool = True) -> torch.Tensor:
    """uint8 ``(N, 3, 32, 32)`` to float32 in [0, 1], standardized per channel when ``normalize``."""
    x = images.to(torch.float32).div_(255.0)
    if normalize:
        x.sub_(torch.tensor(CIFAR10_MEAN)[:, None, None]).div_(torch.tensor(CIFAR10_STD)[:, None, None])
    return x
