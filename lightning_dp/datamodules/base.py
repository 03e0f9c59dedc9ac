"""What the split-based DataModules of the package share: seeded stratified splits and loaders."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import torch
from lightning.fabric.utilities.data import AttributeDict
from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader, Dataset

from lightning_dp import checks

__all__ = ["RENAMED", "SplitDataModule", "make_dataloader", "renamed", "stratified_split"]

#: Former names of the DataModules (every LightningDataModule of the package now ends in ``DataModule``, as in
#: Lightning): still importable from their package and modules (so as a config's ``class_path``), with a FutureWarning.
RENAMED = {
    "FEMNIST": "FEMNISTDataModule",
    "FEMNISTFairness": "FEMNISTFairnessDataModule",
    "FederatedVision": "FederatedVisionDataModule",
    "GeneratedClients": "GeneratedClientsDataModule",
    "HospitalCharges": "HospitalChargesDataModule",
    "SyntheticFairness": "SyntheticFairnessDataModule",
    "SyntheticLinearMixture": "SyntheticLinearMixtureDataModule",
}


def renamed(module: str, name: str, namespace: dict) -> type:
    """A module's ``__getattr__`` for the former names: the class under its new name, warned; else AttributeError."""
    new = RENAMED.get(name)
    if new is None or new not in namespace:
        raise AttributeError(f"module {module!r} has no attribute {name!r}")
    import warnings

    warnings.warn(f"{module}.{name} is now {module}.{new} (the old name will be removed); in a config: "
                  f"class_path: {module}.{new}", FutureWarning, stacklevel=3)
    return namespace[new]


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


def _check_fractions(owner: str, **fractions: float) -> None:
    for name, value in fractions.items():
        checks.open_fraction(name, value, owner=owner)
    if sum(fractions.values()) >= 1.0:
        described = " + ".join(f"{name}={value}" for name, value in fractions.items())
        raise ValueError(
            f"{owner}: {described} = {sum(fractions.values()):.4g} must be below 1 so that the "
            "remaining split is not empty; lower one of them"
        )


class DataHparamsMixin:
    """Log a DataModule's hyperparameters as ``data/<name>`` (MLflow params ``data/seed``, ``data/batch_size``, ...).

    Lightning logs the module's and the DataModule's hyperparameters together and raises
    ``RuntimeError: Error while merging hparams`` when both have a key of the same name with
    different values, e.g. a federated module's ``seed=1`` next to the data split's
    ``seed=0``. The prefix keeps both apart. Only logging is affected (``hparams_initial``);
    ``self.hparams`` and checkpoints keep the plain names.
    """

    @property
    def hparams_initial(self) -> AttributeDict:
        plain = super().hparams_initial  # type: ignore[misc]
        return AttributeDict({(k if k.startswith("_") else f"data/{k}"): v for k, v in plain.items()})


class SplitDataModule(DataHparamsMixin, LightningDataModule):
    """A DataModule whose ``setup`` fills ``train_dataset``, ``val_dataset`` and ``test_dataset``.

    Subclasses set those three attributes (None until loaded) and ``batch_size``,
    ``num_workers`` and ``seed``; the loaders are built here: the training split is
    reshuffled every epoch by a seeded generator, the others keep a fixed order.
    """

    train_dataset: Optional[Dataset] = None
    val_dataset: Optional[Dataset] = None
    test_dataset: Optional[Dataset] = None
    batch_size: int  # set by each subclass's __init__
    num_workers: int
    seed: int
    _STAGE_OF_SPLIT = {"train": "fit", "val": "fit", "test": "test"}

    def _require(self, dataset: Optional[Dataset], split: str) -> Dataset:
        if dataset is None:
            raise RuntimeError(f"{type(self).__name__}: the {split} split is not loaded; call "
                               f"setup({self._STAGE_OF_SPLIT[split]!r}) first")
        return dataset

    def _loader(self, dataset: Optional[Dataset], split: str) -> DataLoader:
        return make_dataloader(self._require(dataset, split), batch_size=self.batch_size, shuffle=split == "train",
                               num_workers=self.num_workers, seed=self.seed)

    def train_dataloader(self) -> DataLoader:
        """Training batches, reshuffled every epoch (seeded)."""
        return self._loader(self.train_dataset, "train")

    def val_dataloader(self) -> DataLoader:
        """Validation batches in a fixed order."""
        return self._loader(self.val_dataset, "val")

    def test_dataloader(self) -> DataLoader:
        """Test batches in a fixed order."""
        return self._loader(self.test_dataset, "test")
