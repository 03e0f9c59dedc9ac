"""The client's side of the DLG audit: local SGD from a known start and the release, and the attacker's estimate
of the client's gradient from it."""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call

from lightning_dp import checks
from lightning_dp.audit._common import (
    LOSSES,
    Sanitizer,
    _trainable,
    _unflatten,
)

__all__ = ["ClientRelease", "client_release", "observed_gradient"]


class ClientRelease(NamedTuple):
    """What the attacker sees of one client: the model it started from and the model it released (flat)."""

    start: Tensor
    released: Tensor


def _check_batch(x: Any, y: Any) -> None:
    if not isinstance(x, Tensor) or not isinstance(y, Tensor):
        raise ValueError(f"x and y must be tensors, got {type(x).__name__} and {type(y).__name__}.")
    if not x.dtype.is_floating_point or x.dim() < 2:
        raise ValueError(f"x must be a floating batch of shape (batch, *input_shape), got dtype {x.dtype} and shape "
                         f"{tuple(x.shape)}; for one image of shape (C, H, W) pass x.unsqueeze(0).")
    if y.dim() != 1 or y.shape[0] != x.shape[0] or y.dtype.is_floating_point or y.dtype == torch.bool:
        raise ValueError(f"y must hold one integer class index per example of x: shape ({x.shape[0]},), got "
                         f"shape {tuple(y.shape)} and dtype {y.dtype}; pass e.g. torch.tensor([label]).")


def client_release(model: nn.Module, x: Tensor, y: Tensor, *, lr: float, local_steps: int = 1,
                   sanitizer: Sanitizer, generator: Optional[torch.Generator],
                   loss: str = "cross_entropy") -> ClientRelease:
    """What a client releases: ``local_steps`` full-batch SGD steps on ``(x, y)`` from ``model``, then the sanitizer.

    ``start`` is ``model``'s flattened trainable parameters (the hypothesis ``theta_j``
    the client starts from); each step is ``theta <- theta - lr * grad mean_i loss(F(x_i), y_i)``
    on the whole batch (the client's local data, one batch of the seed's local SGD);
    ``released = sanitizer(start, trained, generator)``. ``model`` is not modified.

    Args:
        model: The model at the client's starting point.
        x: The client's inputs ``(batch, *input_shape)`` (DLG: one image).
        y: Class indices ``(batch,)``.
        lr: The learning rate ``> 0``.
        local_steps: Number of SGD steps ``>= 1`` (one: the attacker recovers the exact gradient).
        sanitizer: ``(start, trained, generator) -> released``, e.g. :class:`EuclideanLaplaceSanitizer`.
        generator: The sanitizer's generator.
        loss: ``"cross_entropy"`` (batch mean of the cross-entropy of the logits).

    Returns:
        ``ClientRelease(start, released)``, flat vectors.

    Raises:
        ValueError: On bad arguments, or if the sanitizer returns something else than a
            flat vector of the parameters' shape.

    Example:
        >>> from lightning_dp.audit.sanitizers import Unsanitized
        >>> model = nn.Linear(4, 3)
        >>> start, released = client_release(model, torch.ones(1, 4), torch.tensor([1]), lr=0.1,
        ...                                  sanitizer=Unsanitized(), generator=None)
        >>> observed = observed_gradient(start, released, 0.1, model)
        >>> [tuple(g.shape) for g in observed]
        [(3, 4), (3,)]
    """
    lr = checks.positive_real("lr", lr, hint="Pass the client's learning rate, e.g. lr=0.1.")
    local_steps = checks.positive_int("local_steps", local_steps, hint="One step lets the attacker recover the exact "
                                      "gradient; more steps blur it. Pass e.g. local_steps=1.")
    if loss not in LOSSES:
        raise ValueError(f"loss={loss!r} is not supported; choose one of {LOSSES} (DLG attacks classifiers).")
    if not callable(sanitizer):
        raise ValueError(f"sanitizer={sanitizer!r} must be a callable (start, trained, generator) -> released, e.g. "
                         "EuclideanLaplaceSanitizer.for_model(model, 1.0) or Unsanitized().")
    if generator is not None:
        checks.generator("generator", generator, required=True)
    _check_batch(x, y)
    named = _trainable(model)
    start = torch.cat([p.detach().reshape(-1) for _, p in named])
    theta = {name: p.detach().clone() for name, p in named}
    for _ in range(local_steps):
        leaves = {name: t.requires_grad_(True) for name, t in theta.items()}
        value = F.cross_entropy(functional_call(model, leaves, (x,)), y.long())
        grads = torch.autograd.grad(value, list(leaves.values()))
        theta = {name: (t - lr * g).detach() for (name, t), g in zip(leaves.items(), grads)}
    trained = torch.cat([t.reshape(-1) for t in theta.values()])
    released = sanitizer(start, trained, generator)
    if not isinstance(released, Tensor) or released.shape != start.shape:
        raise ValueError(f"the sanitizer {sanitizer!r} returned {type(released).__name__} of shape "
                         f"{tuple(getattr(released, 'shape', ()))}; it must return a flat tensor of shape "
                         f"{tuple(start.shape)}, the released parameters.")
    return ClientRelease(start, released.detach())


def observed_gradient(start: Tensor, released: Tensor, lr: float, model: nn.Module) -> list[Tensor]:
    """The attacker's gradient estimate ``(start - released) / lr``, one tensor per trainable parameter of ``model``.

    Exact (up to float rounding) for one unsanitized SGD step on the client's batch:
    ``released = start - lr g``. With a sanitizer it is ``g`` plus the noise divided by
    ``lr``; with several local steps, the average pseudo-gradient.

    Args:
        start: The flat model the client started from.
        released: The flat model it released.
        lr: The client's learning rate ``> 0``.
        model: The architecture (shapes of the parameters, in flat order).

    Raises:
        ValueError: On mismatched shapes or a non-positive ``lr``.
    """
    lr = checks.positive_real("lr", lr, hint="Pass the client's learning rate (the attacker knows it).")
    if not isinstance(start, Tensor) or not isinstance(released, Tensor) or start.shape != released.shape:
        raise ValueError(f"start and released must be tensors of the same shape, got "
                         f"{tuple(getattr(start, 'shape', ()))} and {tuple(getattr(released, 'shape', ()))}.")
    return _unflatten(model, (start - released) / lr)
