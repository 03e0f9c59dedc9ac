"""A LightningModule that trains any reconstruction network with the mean squared error."""

from __future__ import annotations

import math
from typing import Any

import torch
from lightning.pytorch import LightningModule
from torch import nn

from lightning_dp.optim import build_optimizer, check_optimizer_choice

__all__ = ["Autoencoder", "per_example_mse"]

_NETWORK_CLASS = "network_class"


def per_example_mse(reconstruction: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean squared error of each example, averaged over all its elements (pixels).

    Args:
        reconstruction: Tensor of shape ``(B, ...)``.
        target: Tensor of the same shape.

    Returns:
        A tensor of shape ``(B,)``.

    Raises:
        ValueError: If the shapes differ.

    Example:
        >>> per_example_mse(torch.ones(2, 1, 2, 2), torch.zeros(2, 1, 2, 2)).tolist()
        [1.0, 1.0]
    """
    if reconstruction.shape != target.shape:
        raise ValueError(
            f"the network's reconstruction has shape {tuple(reconstruction.shape)} but its input has shape "
            f"{tuple(target.shape)}; an autoencoder must map x to a tensor of x's shape."
        )
    return (reconstruction - target).square().flatten(1).mean(1)


class Autoencoder(LightningModule):
    """Reconstruction (MSE) training around a plain ``nn.Module`` network.

    The autoencoder task of thesis chapter 3 (Galli et al., "Online sensitivity
    optimization in differentially private learning", AAAI 2024): a network maps an
    image ``x`` to a reconstruction of the same shape and the loss of an example is its
    mean squared error over pixels. Batches are ``(x, y)`` pairs, as produced by the
    MNIST DataModules (``y`` is ignored), or bare tensors ``x``. A config composes it::

        model:
          class_path: lightning_dp.models.Autoencoder
          init_args:
            network:
              class_path: lightning_dp.models.ConvAutoencoder
            lr: 0.5

    Contract with the DP-SGD callback: ``training_step`` returns the batch-MEAN of the
    per-example losses, so that its gradient is the mean of the per-example gradients.
    With Poisson sampling a batch can be empty; ``training_step`` then returns a zero
    loss that is still connected to the parameters (every gradient is exactly zero, the
    sum over no examples) and logs nothing.

    Logged metrics: ``nonprivate/train_loss`` (every logged step), the exact training loss,
    which a DP-SGD epsilon does NOT cover (``log_nonprivate_metrics=False`` turns it off);
    ``val/loss`` and ``test/loss`` (per epoch, weighted by batch size, averaged over ranks
    under DDP).

    The hyperparameters are saved except ``network`` (its weights are in the state dict);
    its class is logged as the hyperparameter ``network_class`` and kept out of
    checkpoints. To load a checkpoint outside the CLI pass the network again:
    ``Autoencoder.load_from_checkpoint(path, network=ConvAutoencoder())``.

    Args:
        network: Module mapping a batch ``x`` to a reconstruction of ``x``'s shape. It
            must not mix examples (no BatchNorm).
        lr: Learning rate (> 0).
        optimizer: ``"sgd"``, ``"adam"`` or ``"adamwosm"`` (:class:`~lightning_dp.optim.AdamWOSM`,
            whose noise std the DPSGD callbacks set).
        momentum: SGD momentum in ``[0, 1)``; must be 0 with ``"adam"`` and ``"adamwosm"``.
        log_nonprivate_metrics: log the exact training loss as ``nonprivate/train_loss``.

    Raises:
        TypeError: If ``network`` is not a ``torch.nn.Module``.
        ValueError: If an argument is outside its allowed range (the message names the
            value, the range and the fix).

    Example:
        >>> import torch
        >>> from lightning_dp.models import Autoencoder, ConvAutoencoder
        >>> model = Autoencoder(ConvAutoencoder(), lr=0.5)
        >>> model(torch.zeros(2, 1, 28, 28)).shape
        torch.Size([2, 1, 28, 28])
    """

    def __init__(
        self,
        network: nn.Module,
        lr: float = 0.1,
        optimizer: str = "sgd",
        momentum: float = 0.0,
        log_nonprivate_metrics: bool = True,
    ) -> None:
        super().__init__()
        _validate(network=network, lr=lr, optimizer=optimizer, momentum=momentum)
        self.save_hyperparameters(ignore=["network"])
        # A second call merges into the saved (and logged) hyperparameters.
        self.save_hyperparameters({_NETWORK_CLASS: f"{type(network).__module__}.{type(network).__qualname__}"})
        self.network = network

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return the network's reconstruction of ``x``."""
        return self.network(x)

    @staticmethod
    def _inputs(batch: Any) -> torch.Tensor:
        return batch[0] if isinstance(batch, (tuple, list)) else batch

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        """Return the batch mean of the per-example MSE; log ``nonprivate/train_loss``."""
        x = self._inputs(batch)
        reconstruction = self(x)
        if x.shape[0] == 0:
            # Mean over no example is nan; the sum over no example (0) keeps gradients finite.
            return reconstruction.sum() * 0.0
        loss = per_example_mse(reconstruction, x).mean()
        if self.hparams["log_nonprivate_metrics"]:  # an exact statistic of the private batch: not covered by epsilon
            self.log("nonprivate/train_loss", loss, on_step=True, on_epoch=False, prog_bar=True, batch_size=x.shape[0])
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        """Log ``val/loss``."""
        self._evaluate(batch, "val")

    def test_step(self, batch: Any, batch_idx: int) -> None:
        """Log ``test/loss``."""
        self._evaluate(batch, "test")

    def _evaluate(self, batch: Any, stage: str) -> None:
        x = self._inputs(batch)
        if x.shape[0] == 0:
            return
        loss = per_example_mse(self(x), x).mean()
        self.log(f"{stage}/loss", loss, on_step=False, on_epoch=True, prog_bar=True, batch_size=x.shape[0],
                 sync_dist=True)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Keep only constructor arguments in the checkpoint's hyperparameters.

        ``network_class`` is logged but is no argument of ``__init__``: left in the
        checkpoint it would break ``load_from_checkpoint`` and ``lightning-dp test
        --ckpt_path``.
        """
        checkpoint.get(self.CHECKPOINT_HYPER_PARAMS_KEY, {}).pop(_NETWORK_CLASS, None)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        """SGD (with ``momentum``), Adam or AdamWOSM at learning rate ``lr`` over all parameters."""
        return build_optimizer(self.hparams["optimizer"], self.parameters(), lr=self.hparams["lr"],
                               momentum=self.hparams["momentum"])


def _validate(*, network: Any, lr: Any, optimizer: Any, momentum: Any) -> None:
    """Raise on the first invalid constructor argument of :class:`Autoencoder`."""
    if not isinstance(network, nn.Module):
        raise TypeError(
            f"network={network!r} must be a torch.nn.Module; in a config pass "
            "`network: {class_path: lightning_dp.models.ConvAutoencoder}`."
        )
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not math.isfinite(lr) or lr <= 0:
        raise ValueError(f"lr={lr!r} must be a finite number > 0; pass e.g. lr=0.1.")
    check_optimizer_choice(optimizer, momentum)
