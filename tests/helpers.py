"""Tiny, ordinary Lightning objects used by the callback tests (nothing DP-specific in them), and test utilities."""

from __future__ import annotations

import shutil
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def blobs(n: int = 200, d: int = 6, classes: int = 3, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, classes, (n,), generator=g)
    centers = torch.randn(classes, d, generator=g) * 2
    x = centers[y] + torch.randn(n, d, generator=g)
    return TensorDataset(x, y)


class BlobsData(L.LightningDataModule):
    def __init__(self, n: int = 200, batch_size: int = 20, d: int = 6, classes: int = 3):
        super().__init__()
        self.n, self.batch_size, self.d, self.classes = n, batch_size, d, classes

    def setup(self, stage: str) -> None:
        self.train_set = blobs(self.n, self.d, self.classes)
        self.val_set = blobs(60, self.d, self.classes, seed=1)

    def train_dataloader(self):
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self):
        return DataLoader(self.val_set, batch_size=30)


class Classifier(L.LightningModule):
    """An unmodified, ordinary LightningModule: batch-mean cross-entropy, one SGD optimizer."""

    def __init__(self, d: int = 6, classes: int = 3, hidden: int = 16, lr: float = 0.5, net: nn.Module | None = None,
                 loss_name: str = "nonprivate/train_loss"):
        super().__init__()
        # the exact loss of a (private) batch: under nonprivate/ by default, as the record's gate requires of a
        # private run (tests/test_gate.py logs it under an ordinary name to see the gate refuse it)
        self.loss_name = loss_name
        self.net = net if net is not None else nn.Sequential(nn.Linear(d, hidden), nn.Tanh(), nn.Linear(hidden, classes))
        self.lr = lr

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log(self.loss_name, loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val/acc", (self(x).argmax(1) == y).float().mean())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


#: The accelerators of the device-parametrized tests: the CPU, and a CUDA GPU where one is present. The GPU variants
#: are collected only on a machine with one (the lent GPU machine: docs/gpu.md); CI has none and runs the CPU ones.
ACCELERATORS = ["cpu"] + (["gpu"] if torch.cuda.is_available() else [])
#: The torch device type of each accelerator.
DEVICE = {"cpu": "cpu", "gpu": "cuda"}


class DeviceProbe(L.Callback):
    """The device types the module trained on (Lightning moves a module back to the CPU when its fit ends)."""

    def __init__(self) -> None:
        self.devices: set[str] = set()

    def on_train_batch_end(self, trainer, pl_module, *args) -> None:
        self.devices.add(pl_module.device.type)


def trainer(**kwargs) -> L.Trainer:
    defaults = dict(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                    enable_progress_bar=False, enable_model_summary=False, max_epochs=1)
    defaults.update(kwargs)
    return L.Trainer(**defaults)


def seed_store(template: Path, database: Path) -> None:
    """Put a ready (empty) MLflow database at ``database``: a copy of the ``store_template`` fixture's."""
    database.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(template, database)


def output_shapes(layers: nn.Sequential, x: torch.Tensor) -> list[tuple[int, ...]]:
    """The per-example output shape after each layer of ``layers``, fed ``x`` (one example's shape per entry)."""
    shapes = []
    for layer in layers:
        x = layer(x)
        shapes.append(tuple(x.shape[1:]))
    return shapes


def probe(engine, forward, *batch: torch.Tensor) -> None:
    """Establish the engine's batch dimensions by running ``forward`` on rows of ``batch`` (examples in dim 0)."""
    engine.probe(lambda n: forward(*(t[torch.arange(n) % t.shape[0]] for t in batch)))


class RecordingLogger(L.pytorch.loggers.Logger):
    """A logger that keeps every write: ``calls`` ``[(step, metrics)]`` and ``params`` (the record a test reads)."""

    name, version = "recorder", "0"

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[int | None, dict]] = []
        self.params: dict = {}

    def log_metrics(self, metrics, step=None):
        self.calls.append((step, dict(metrics)))

    def log_hyperparams(self, params, *args, **kwargs):
        self.params.update(dict(vars(params) if hasattr(params, "__dict__") and not isinstance(params, dict)
                                else params))

    def names(self) -> set[str]:
        """Every metric name written."""
        return {k for _, m in self.calls for k in m}

    def series(self, name: str) -> list:
        """The values written under ``name``, in order."""
        return [m[name] for _, m in self.calls if name in m]
