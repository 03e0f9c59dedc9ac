"""Where DPSGD takes over the training data: the fit's DataLoader is privatized wherever Lightning takes it from.

``trainer.fit(model, train_dataloaders=dl)`` (Lightning's documented call), ``datamodule=...``, or the module's own
``train_dataloader``. For the first, the ``dataloader()`` of the fit loop's data source is wrapped (Lightning keeps it
in the private ``fit_loop._data_source``: checked, with a clear refusal should Lightning move it); for the other two
the public ``train_dataloader`` hook of the DataModule or LightningModule. The loader is privatized when Lightning
asks for it, after a checkpoint has restored the seed. Everything set is put back at teardown (:class:`Shadows`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from lightning.pytorch import LightningDataModule, LightningModule, Trainer
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch.utils.data import DataLoader

__all__ = ["Shadows", "attach"]


class Shadows:
    """Instance attributes set until :meth:`restore`, which puts back what was there
    (``LightningDataModule.from_datasets`` keeps its ``train_dataloader`` as an instance attribute itself)."""

    def __init__(self) -> None:
        self._undo: list[Callable[[], None]] = []

    def set(self, owner: Any, name: str, value: Any) -> None:
        missing = object()
        before = owner.__dict__.get(name, missing)
        setattr(owner, name, value)

        def restore() -> None:
            if before is missing:
                owner.__dict__.pop(name, None)
            else:
                setattr(owner, name, before)

        self._undo.append(restore)

    def restore(self) -> None:
        while self._undo:
            self._undo.pop()()


def attach(trainer: Trainer, privatize: Callable[[Any], DataLoader], shadows: Shadows) -> None:
    """Makes the fit's training data pass through ``privatize`` (loader -> Poisson-sampled loader).

    Raises:
        MisconfigurationException: Lightning keeps the data elsewhere, no ``train_dataloader``, or a collection of
            loaders.
    """
    source = getattr(trainer.fit_loop, "_data_source", None)
    instance = getattr(source, "instance", None)
    if source is None or not hasattr(source, "instance"):
        raise MisconfigurationException(
            "DPSGD could not find where this Lightning version keeps the training data (fit_loop._data_source); "
            "it refuses to train rather than miss the Poisson sampling. Please report your Lightning version.")
    if isinstance(instance, (LightningDataModule, LightningModule)):
        if not is_overridden("train_dataloader", instance):
            raise MisconfigurationException(
                f"{type(instance).__name__} defines no train_dataloader; DPSGD needs a training DataLoader: pass "
                "trainer.fit(model, train_dataloaders=DataLoader(dataset, batch_size=...)) or a DataModule.")
        original = instance.train_dataloader

        @functools.wraps(original)
        def train_dataloader() -> DataLoader:
            return privatize(original())

        shadows.set(instance, "train_dataloader", train_dataloader)
    else:  # trainer.fit(model, train_dataloaders=...): a loader (or a collection of them)
        if not isinstance(instance, DataLoader):
            raise MisconfigurationException(
                f"train_dataloaders={type(instance).__name__}: DPSGD needs one torch DataLoader over a map-style "
                "dataset (it rebuilds it with Poisson sampling); a collection of loaders (CombinedLoader, dict, "
                "list) has no single sampling rate. Pass one DataLoader.")
        # privatized when Lightning asks for it (after a checkpoint restored the seed), like the hooks above
        shadows.set(source, "dataloader", lambda: privatize(instance))
