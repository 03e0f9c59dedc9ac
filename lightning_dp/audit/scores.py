"""Membership scores from a model's per-example loss (the loss attack; Yeom et al., CSF 2018).

:func:`loss_scores` returns ``-loss`` per example (higher means "member"), in eval mode without gradients. The
loss is the module's ``per_example_loss(batch)`` if it has one, else cross-entropy for ``(x, y)`` batches, else the
mean next-token loss for ``(B, T)`` token ids, or ``loss=(model, batch) -> (B,)`` (docs/audit.md, "Loss scores").
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["default_per_example_loss", "loss_scores", "per_example_losses"]

PerExampleLoss = Callable[[nn.Module, Any], Tensor]


def default_per_example_loss(model: nn.Module, batch: Any) -> Tensor:
    """The per-example loss of one batch by the conventions in the module docstring."""
    hook = getattr(model, "per_example_loss", None)
    if callable(hook):
        return hook(batch)
    if isinstance(batch, Tensor) and not batch.is_floating_point() and batch.dim() == 2:
        from lightning_dp.models.language import per_example_token_loss

        return per_example_token_loss(model(batch), batch)
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        x, y = batch
        return F.cross_entropy(model(x), y, reduction="none")
    raise ValueError(f"cannot score a batch of type {type(batch).__name__}: give the model a per_example_loss(batch) "
                     "method, or pass loss=(model, batch) -> per-example losses; the defaults take (x, y) "
                     "classification batches and (B, T) token-id tensors")


def per_example_losses(model: nn.Module, batches: Iterable[Any], *, loss: PerExampleLoss | None = None,
                       device: torch.device | str | None = None) -> np.ndarray:
    """Every example's loss under ``model``, in the order of ``batches`` (float64, shape ``(N,)``).

    Args:
        model: the trained model (any ``nn.Module``).
        batches: an iterable of batches, e.g. a DataLoader without shuffling.
        loss: ``(model, batch) -> (B,)`` losses; default :func:`default_per_example_loss`.
        device: where to evaluate (default: the model's first parameter's device); batches are moved there.
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    loss = loss or default_per_example_loss
    if device is None:
        first = next(model.parameters(), None)
        device = first.device if first is not None else torch.device("cpu")
    was_training = model.training
    model.eval()
    out: list[np.ndarray] = []
    try:
        with torch.no_grad():
            for batch in batches:
                batch = _to(batch, device)
                values = loss(model, batch)
                if not isinstance(values, Tensor) or values.dim() != 1:
                    raise ValueError(f"the per-example loss must be a 1-D tensor (one value per example), got "
                                     f"{type(values).__name__} of shape {getattr(values, 'shape', None)}")
                out.append(values.detach().double().cpu().numpy())
    finally:
        model.train(was_training)
    return np.concatenate(out) if out else np.zeros(0)


def loss_scores(model: nn.Module, batches: Iterable[Any], **kwargs: Any) -> np.ndarray:
    """Membership scores ``-loss`` (higher: more likely a member) of every example; see :func:`per_example_losses`."""
    return -per_example_losses(model, batches, **kwargs)


def _to(batch: Any, device: torch.device | str) -> Any:
    if isinstance(batch, Tensor):
        return batch.to(device)
    if isinstance(batch, (tuple, list)):
        return type(batch)(_to(b, device) for b in batch)
    return batch
