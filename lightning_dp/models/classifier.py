"""A LightningModule that trains any image-classification network with cross-entropy."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from torch import nn
from torchmetrics.classification import MulticlassAccuracy

from lightning_dp.optim import OPTIMIZERS, build_optimizer, check_optimizer_choice

__all__ = ["ImageClassifier"]

_OPTIMIZERS = OPTIMIZERS  # "sgd", "adam", "adamwosm": the names lightning_dp.optim.build_optimizer knows
_NETWORK_CLASS = "network_class"


class ImageClassifier(LightningModule):
    """Cross-entropy classifier around a plain ``nn.Module`` network.

    The network is an argument so that a ``lightning-dp`` YAML config composes it::

        model:
          class_path: lightning_dp.models.ImageClassifier
          init_args:
            network:
              class_path: lightning_dp.models.MNISTConvNet
              init_args: {activation: tanh}
            lr: 0.1

    Contract with the DP-SGD callback: ``training_step`` returns the batch-MEAN
    cross-entropy of the examples in the batch, so that its gradient is the mean of the
    per-example gradients. With Poisson sampling a batch can be empty; for an empty
    batch ``training_step`` returns a zero loss that is still connected to the
    parameters (every gradient is exactly zero, the sum over no examples) and logs
    nothing, instead of the ``nan`` that the mean over zero examples would give.

    Logged metrics: ``nonprivate/train_loss`` (every logged step) and
    ``nonprivate/train_acc`` (per epoch), exact statistics of the training batches that a
    DP-SGD epsilon does NOT cover (``log_nonprivate_metrics=False`` turns them off);
    ``val/loss``, ``val/acc``, ``test/loss``, ``test/acc`` (per epoch, weighted by batch
    size; averaged over ranks under DDP). Accuracies are plain (micro-averaged)
    accuracies, computed over all ranks by torchmetrics.

    The hyperparameters are saved except ``network`` (an ``nn.Module`` is saved in the
    state dict already); its class is logged as the hyperparameter ``network_class``
    (kept out of checkpoints, which hold constructor arguments only). To load a
    checkpoint outside the CLI pass the network again:
    ``ImageClassifier.load_from_checkpoint(path, network=MNISTConvNet())``.

    Args:
        network: Module mapping a batch of inputs to logits of shape
            ``(batch, num_classes)``. It must not mix examples (no BatchNorm).
        num_classes: Number of classes (>= 2), used by the accuracy metrics.
        lr: Learning rate (> 0); Adam's ``alpha`` for ``"adam"`` and ``"adamwosm"``.
        optimizer: ``"sgd"`` (``torch.optim.SGD``), ``"adam"`` (``torch.optim.Adam``) or
            ``"adamwosm"`` (:class:`lightning_dp.optim.AdamWOSM`, DP-Adam without second
            moment, Mohapatra et al. 2022: momentum steps of ``lr / (sigma C / B)``). The
            Adam variants keep their default betas. ``"adamwosm"`` needs the
            :class:`~lightning_dp.callbacks.DPSGD` callback, which gives it ``sigma C / B``
            before every step; without it the first step raises.
        momentum: SGD momentum in ``[0, 1)``; must be 0 with ``"adam"`` and ``"adamwosm"``.
        log_nonprivate_metrics: log the exact training loss and accuracy under ``nonprivate/``.

    Raises:
        TypeError: If ``network`` is not a ``torch.nn.Module``.
        ValueError: If an argument is outside its allowed range (the message names the
            value, the range and the fix).

    Example:
        >>> import torch
        >>> from lightning_dp.models import DigitsConvNet, ImageClassifier
        >>> model = ImageClassifier(DigitsConvNet(), lr=0.05, momentum=0.9)
        >>> model(torch.zeros(2, 1, 8, 8)).shape
        torch.Size([2, 10])
    """

    def __init__(
        self,
        network: nn.Module,
        num_classes: int = 10,
        lr: float = 0.1,
        optimizer: str = "sgd",
        momentum: float = 0.0,
        log_nonprivate_metrics: bool = True,
    ) -> None:
        super().__init__()
        _validate(network=network, num_classes=num_classes, lr=lr, optimizer=optimizer, momentum=momentum)
        self.save_hyperparameters(ignore=["network"])
        # A second call merges into the saved (and logged) hyperparameters.
        self.save_hyperparameters({_NETWORK_CLASS: f"{type(network).__module__}.{type(network).__qualname__}"})
        self.network = network
        self.train_acc = MulticlassAccuracy(num_classes=num_classes, average="micro")
        self.val_acc = MulticlassAccuracy(num_classes=num_classes, average="micro")
        self.test_acc = MulticlassAccuracy(num_classes=num_classes, average="micro")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return the network's logits for ``x``."""
        return self.network(x)

    def setup(self, stage: str) -> None:
        """Refuse, before any batch, a network whose ``in_features`` differs from the width of the datamodule's
        flat features (its ``input_shape``), e.g. ``AGNewsDataModule(pooling="concat")`` with a network built
        for the mean vector; otherwise the first step fails with a bare shape error."""
        datamodule = getattr(self._trainer, "datamodule", None) if self._trainer is not None else None
        shape = getattr(datamodule, "input_shape", None)
        width = getattr(self.network, "in_features", None)
        if isinstance(width, int) and isinstance(shape, tuple) and len(shape) == 1 and shape[0] != width:
            raise ValueError(
                f"{type(self).__name__}: the network takes in_features={width} but {type(datamodule).__name__} "
                f"gives features of shape {shape}; set the network's in_features={shape[0]} (in a config: "
                f"model.init_args.network.init_args.in_features: {shape[0]}) or change the data's settings"
            )

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        """Return the batch-mean cross-entropy; log ``nonprivate/train_loss`` and ``nonprivate/train_acc``."""
        x, y = batch
        logits = self(x)
        if y.numel() == 0:
            # Mean over no example is nan; the sum over no example (0) keeps gradients finite.
            return logits.sum() * 0.0
        loss = F.cross_entropy(logits, y)
        batch_size = y.shape[0]
        if self.hparams["log_nonprivate_metrics"]:  # exact statistics of the private batch: not covered by epsilon
            self.train_acc.update(logits.detach(), y)
            self.log("nonprivate/train_loss", loss, on_step=True, on_epoch=False, prog_bar=True, batch_size=batch_size)
            self.log("nonprivate/train_acc", self.train_acc, on_step=False, on_epoch=True, batch_size=batch_size)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        """Log ``val/loss`` and ``val/acc``."""
        self._evaluate(batch, "val", self.val_acc)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        """Log ``test/loss`` and ``test/acc``."""
        self._evaluate(batch, "test", self.test_acc)

    def _evaluate(self, batch: Any, stage: str, accuracy: MulticlassAccuracy) -> None:
        x, y = batch
        if y.numel() == 0:  # torchmetrics cannot update on empty tensors
            return
        logits = self(x)
        batch_size = y.shape[0]
        accuracy.update(logits, y)
        loss = F.cross_entropy(logits, y)
        self.log(
            f"{stage}/loss", loss, on_step=False, on_epoch=True, prog_bar=True, batch_size=batch_size, sync_dist=True
        )
        self.log(f"{stage}/acc", accuracy, on_step=False, on_epoch=True, prog_bar=True, batch_size=batch_size)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Keep only constructor arguments in the checkpoint's hyperparameters.

        ``network_class`` is logged but is no argument of ``__init__``: left in the
        checkpoint it would break ``load_from_checkpoint`` and ``lightning-dp test
        --ckpt_path`` (``__init__() got an unexpected keyword argument 'network_class'``).
        """
        checkpoint.get(self.CHECKPOINT_HYPER_PARAMS_KEY, {}).pop(_NETWORK_CLASS, None)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        """SGD (with ``momentum``), Adam or AdamWOSM at learning rate ``lr`` over all parameters.

        Built by :func:`lightning_dp.optim.build_optimizer`.
        """
        return build_optimizer(
            self.hparams["optimizer"], self.parameters(), lr=self.hparams["lr"], momentum=self.hparams["momentum"]
        )


def _validate(*, network: Any, num_classes: Any, lr: Any, optimizer: Any, momentum: Any) -> None:
    """Raise on the first invalid constructor argument of :class:`ImageClassifier`."""
    if not isinstance(network, nn.Module):
        raise TypeError(
            f"network={network!r} must be a torch.nn.Module; in a config pass "
            "`network: {class_path: lightning_dp.models.MNISTConvNet}`."
        )
    if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 2:
        raise ValueError(f"num_classes={num_classes!r} must be an integer >= 2; pass e.g. num_classes=10.")
    network_classes = getattr(network, "num_classes", None)
    if isinstance(network_classes, int) and network_classes != num_classes:
        raise ValueError(
            f"num_classes={num_classes} but the network {type(network).__name__} outputs "
            f"{network_classes} logits; set both to the number of classes of the data set."
        )
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not math.isfinite(lr) or lr <= 0:
        raise ValueError(f"lr={lr!r} must be a finite number > 0; pass e.g. lr=0.1.")
    check_optimizer_choice(optimizer, momentum)  # a name of _OPTIMIZERS; momentum in [0, 1), 0 unless SGD
