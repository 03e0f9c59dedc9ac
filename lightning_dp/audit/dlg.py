"""Deep Leakage from Gradients (Zhu, Liu & Han, NeurIPS 2019; github.com/mit-han-lab/dlg), the attack of the DLG
audit.

L-BFGS finds a dummy ``(x', y')`` whose gradient matches the target gradient ``g``, differentiating through the
gradient (``create_graph=True``: the model must be twice differentiable,
:class:`lightning_dp.models.SigmoidLeNet`). In the audit, ``g`` is the attacker's estimate from a client's release
(:mod:`~lightning_dp.audit.release`). A failed attack is evidence, not proof, of protection. The objective, the
threat model, the API and an example: docs/audit.md.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call

from lightning_dp import checks
from lightning_dp.audit._common import _trainable

__all__ = ["DLGResult", "dlg_attack", "gradient_matching_loss"]


def _soft_cross_entropy(logits: Tensor, soft_labels: Tensor) -> Tensor:
    """``mean_i sum_c -p_ic log softmax(logits_i)_c``: the DLG code's ``cross_entropy_for_onehot``."""
    return torch.mean(torch.sum(-soft_labels * F.log_softmax(logits, dim=-1), dim=-1))


def gradient_matching_loss(model: nn.Module, target_gradients: Sequence[Tensor], dummy_x: Tensor,
                           dummy_label: Tensor, *, soft_label: bool = True, create_graph: bool = False) -> Tensor:
    """DLG's objective ``sum_l || d loss(F(x'), p') / d theta_l - g_l ||^2`` (Zhu et al. 2019, Algorithm 1).

    Args:
        model: The model at the client's starting point (not modified).
        target_gradients: The observed gradient, one tensor per trainable parameter.
        dummy_x: The dummy input ``(batch, *input_shape)``.
        dummy_label: Logits of the dummy label ``(batch, num_classes)`` (``p' = softmax``),
            or the label distribution itself with ``soft_label=False``.
        soft_label: Whether ``dummy_label`` holds logits (True) or probabilities.
        create_graph: Keep the graph of the gradient (needed to differentiate the
            objective with respect to the dummies).

    Returns:
        The objective, a scalar tensor.
    """
    named = _trainable(model)
    leaves = [p.detach().requires_grad_(True) for _, p in named]
    logits = functional_call(model, {name: leaf for (name, _), leaf in zip(named, leaves)}, (dummy_x,))
    labels = F.softmax(dummy_label, dim=-1) if soft_label else dummy_label
    grads = torch.autograd.grad(_soft_cross_entropy(logits, labels), leaves, create_graph=create_graph)
    return cast(Tensor, sum(((g - t) ** 2).sum() for g, t in zip(grads, target_gradients)))


@dataclass(frozen=True)
class DLGResult:
    """The outcome of :func:`dlg_attack` (the restart with the lowest final matching loss).

    Attributes:
        reconstruction: The dummy input ``(1, *input_shape)``, in the model's input scale.
        label: The recovered label, ``argmax softmax(dummy label)`` (the given label when known).
        label_probabilities: ``softmax(dummy label)``, shape ``(num_classes,)``.
        match_loss: The gradient-matching objective at the end (``inf``: every restart diverged).
        history: The objective at the start of every L-BFGS step of the chosen restart.
        restart: Index of the chosen restart.
        restart_losses: Final objective of every restart (``inf`` for a diverged one).
    """

    reconstruction: Tensor
    label: int
    label_probabilities: Tensor
    match_loss: float
    history: list[float]
    restart: int
    restart_losses: list[float]

    @property
    def diverged(self) -> bool:
        """True when no restart ended with a finite matching loss."""
        return not math.isfinite(self.match_loss)


def _check_target(model: nn.Module, target_gradients: Any) -> list[Tensor]:
    named = _trainable(model)
    target = list(target_gradients) if isinstance(target_gradients, (list, tuple)) else None
    if target is None or len(target) != len(named) or any(
            not isinstance(t, Tensor) or t.shape != p.shape for t, (_, p) in zip(target, named)):
        shapes = [tuple(p.shape) for _, p in named]
        got = ([tuple(getattr(t, "shape", ())) for t in target] if target is not None
               else type(target_gradients).__name__)
        raise ValueError(f"target_gradients must be a list of one tensor per trainable parameter of "
                         f"{type(model).__name__} with shapes {shapes}, got {got}; use observed_gradient(start, "
                         "released, lr, model).")
    if not all(bool(torch.isfinite(t).all()) for t in target):
        raise ValueError("target_gradients contain inf or NaN; the observed gradient of a release must be finite "
                         "(was the release computed from a diverged training?).")
    return [t.detach() for t in target]


def dlg_attack(model: nn.Module, target_gradients: Sequence[Tensor], *, input_shape: Sequence[int],
               num_classes: int, iterations: int = 300, attack_lr: float = 1.0,
               generator: Optional[torch.Generator], restarts: int = 1,
               known_label: Optional[int] = None) -> DLGResult:
    """Deep Leakage from Gradients: reconstruct one example from its gradient (Zhu et al. 2019, Algorithm 1).

    As in the authors' code (``main.py`` of github.com/mit-han-lab/dlg): the dummy
    input and the dummy label logits are drawn from ``N(0, 1)`` (here from
    ``generator``, inputs of all restarts first, then their labels), and
    ``torch.optim.LBFGS([x', y'], lr=attack_lr)`` (PyTorch's defaults otherwise: up
    to 20 inner iterations per step, history 100, no line search) runs ``iterations``
    steps on :func:`gradient_matching_loss`, differentiated with ``create_graph=True``.
    With ``known_label`` only the input is optimized against the one-hot label (the
    label can often be read off the last layer's gradient: Zhao et al., "iDLG", 2020).

    With ``restarts > 1`` the attack is run from that many initializations and the one
    with the lowest final matching loss is returned: the attacker can observe that
    loss, not the reconstruction error. A restart whose objective or dummies become
    inf or NaN stops there and counts as failed (matching loss ``inf``); if all fail,
    the result holds the last finite dummies of the first restart and ``match_loss=inf``.

    Args:
        model: The model at the client's starting point (twice differentiable, e.g.
            :class:`~lightning_dp.models.SigmoidLeNet`; not modified).
        target_gradients: The observed gradient, e.g. from :func:`observed_gradient`.
        input_shape: Shape of one input, e.g. ``(1, 28, 28)``.
        num_classes: Number of classes (size of the dummy label).
        iterations: L-BFGS steps ``>= 1`` (300 in the paper).
        attack_lr: L-BFGS learning rate ``> 0`` (1, PyTorch's default, as in the DLG code).
        generator: Generator of the dummy initializations (``None``: a fresh, non-reproducible one).
        restarts: Number of initializations ``>= 1``.
        known_label: The true label if the attacker knows it, else ``None``.

    Returns:
        A :class:`DLGResult`.

    Raises:
        ValueError: On arguments outside their range or gradients that do not match the model.
    """
    target = _check_target(model, target_gradients)
    try:
        input_shape = tuple(int(s) for s in input_shape)
    except TypeError:
        raise ValueError(f"input_shape={input_shape!r} must be a sequence of positive integers such as "
                         "(1, 28, 28).") from None
    if not input_shape or any(s < 1 for s in input_shape):
        raise ValueError(f"input_shape={input_shape!r} must be a non-empty sequence of positive integers, the shape "
                         "of one input such as (1, 28, 28).")
    num_classes = checks.positive_int("num_classes", num_classes, hint="Pass the number of the model's output logits.")
    iterations = checks.positive_int("iterations", iterations, hint="The DLG paper runs 300 L-BFGS steps.")
    attack_lr = checks.positive_real("attack_lr", attack_lr, hint="The DLG code uses L-BFGS's default lr=1.")
    restarts = checks.positive_int("restarts", restarts, hint="Pass restarts=1 for the paper's single run.")
    if known_label is not None and (isinstance(known_label, bool) or not isinstance(known_label, numbers.Integral)
                                    or not 0 <= known_label < num_classes):
        raise ValueError(f"known_label={known_label!r} must be None or a class index in 0..{num_classes - 1}.")
    reference = target[0]
    generator = checks.generator("generator", generator, device=reference.device)
    options: dict[str, Any] = {"dtype": reference.dtype, "device": reference.device}
    inits_x = torch.randn((restarts, 1, *input_shape), generator=generator, **options)
    inits_y = torch.randn((restarts, 1, num_classes), generator=generator, **options)
    fixed = None if known_label is None else F.one_hot(torch.tensor([int(known_label)]), num_classes).to(**options)

    def objective(dummy_x: Tensor, dummy_y: Tensor, create_graph: bool) -> Tensor:
        if fixed is not None:
            return gradient_matching_loss(model, target, dummy_x, fixed, soft_label=False, create_graph=create_graph)
        return gradient_matching_loss(model, target, dummy_x, dummy_y, create_graph=create_graph)

    runs = []
    for r in range(restarts):
        dummy_x = inits_x[r].clone().requires_grad_(True)
        dummy_y = inits_y[r].clone().requires_grad_(fixed is None)
        optimizer = torch.optim.LBFGS([dummy_x] if fixed is not None else [dummy_x, dummy_y], lr=attack_lr)

        def closure(dummy_x: Tensor = dummy_x, dummy_y: Tensor = dummy_y,
                    optimizer: torch.optim.Optimizer = optimizer) -> Tensor:
            optimizer.zero_grad()
            value = objective(dummy_x, dummy_y, True)
            value.backward()
            return value

        history: list[float] = []
        last = (dummy_x.detach().clone(), dummy_y.detach().clone())
        failed = False
        for _ in range(iterations):
            value = float(optimizer.step(closure).detach())
            if not (math.isfinite(value) and bool(torch.isfinite(dummy_x).all())
                    and bool(torch.isfinite(dummy_y).all())):
                failed = True
                break
            history.append(value)
            last = (dummy_x.detach().clone(), dummy_y.detach().clone())
        final = math.inf
        if not failed:
            final = float(objective(last[0], last[1], False))
            final = final if math.isfinite(final) else math.inf
        runs.append((final, last, history))

    losses = [run[0] for run in runs]
    best = min(range(restarts), key=lambda i: (losses[i], i))  # ties and all-inf: the first
    final, (best_x, best_y), history = runs[best]
    if fixed is not None:
        probabilities, label = fixed[0], int(known_label)
    else:
        probabilities = F.softmax(best_y, dim=-1)[0]
        label = int(probabilities.argmax())
    return DLGResult(best_x, label, probabilities, final, history, best, losses)

