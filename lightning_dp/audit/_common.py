"""What the audits share: argument checks, flat parameter vectors, the sanitizer type and the random streams.

Torch only (no Lightning), like the rest of :mod:`lightning_dp.audit`'s DLG audit.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Optional

import torch
from torch import Tensor, nn

from lightning_dp.federated.local import FlatParams


__all__ = ["DUMMY_STREAM", "LOSSES", "NOISE_STREAM", "Sanitizer", "SanitizerFactory", "flatten_parameters",
           "parameter_sizes"]


#: ``(start, trained, generator) -> released``: flat vectors of the model's trainable parameters.
Sanitizer = Callable[[Tensor, Tensor, Optional[torch.Generator]], Tensor]
#: ``noise_multiplier -> Sanitizer``: how :func:`run_dlg_audit` builds the sanitizer of each noise level.
SanitizerFactory = Callable[[float], Sanitizer]

#: Streams of :func:`~lightning_dp.privacy.noise.derive_generator`: the sanitizer's noise
#: (per image and noise level, the level named by its float64 bits) and the attacker's dummy initialization (per image).
NOISE_STREAM, DUMMY_STREAM = 21, 22
#: Losses the client can train with (a mean over its batch, as in :mod:`lightning_dp.federated.local`).
LOSSES = ("cross_entropy",)


# --------------------------------------------------------------------------- validation


def _trainable(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}.")
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    if not named:
        raise ValueError(f"{type(model).__name__} has no trainable parameters: a client that trains nothing "
                         "releases nothing to audit. Pass a model with parameters that require grad.")
    return named


# --------------------------------------------------------------------------- flat parameters


def parameter_sizes(model: nn.Module) -> list[int]:
    """Number of elements of each trainable parameter, in ``named_parameters`` order: the layout of
    :class:`lightning_dp.federated.local.FlatParams` (the round's, one home; it imports no Lightning).

    Example:
        >>> parameter_sizes(nn.Linear(3, 2))
        [6, 2]
    """
    return _layout(model).sizes


def flatten_parameters(model: nn.Module) -> Tensor:
    """The trainable parameters as one detached flat vector (``FlatParams.of(model).flatten(model)``).

    Example:
        >>> flatten_parameters(nn.Linear(3, 2)).shape
        torch.Size([8])
    """
    return _layout(model).flatten(model)


def _layout(model: nn.Module) -> FlatParams:
    _trainable(model)  # the audit's own refusals (not a module, nothing trainable), worded for the audit
    return FlatParams.of(model)


def _unflatten(model: nn.Module, flat: Tensor) -> list[Tensor]:
    layout = _layout(model)
    if flat.dim() != 1 or flat.numel() != layout.numel:
        raise ValueError(f"the flat vector has shape {tuple(flat.shape)} but {type(model).__name__} has "
                         f"{layout.numel} trainable parameters; flatten it with flatten_parameters(model).")
    return list(layout.unflatten(flat).values())
