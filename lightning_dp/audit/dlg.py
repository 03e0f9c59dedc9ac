"""Deep Leakage from Gradients (DLG) as an audit of what a federated client releases.

Zhu, Liu & Han, "Deep leakage from gradients", NeurIPS 2019 (code:
github.com/mit-han-lab/dlg). An attacker who knows the model and sees the gradient
of the loss on one private example ``(x, y)`` finds a dummy example ``(x', y')`` whose
gradient matches it (their Algorithm 1)::

    x', y'  <-  argmin  sum_l || d loss(F(x'), softmax(y')) / d theta_l  -  g_l ||^2

with L-BFGS, starting from ``x', y' ~ N(0, 1)``; the loss is the cross-entropy with the
soft label ``softmax(y')`` so that the label is optimized too, and the objective is
differentiated through the gradient (``create_graph=True``), which needs a twice
differentiable model (:class:`lightning_dp.models.SigmoidLeNet`).

**Threat model of the audit.** In personalized federated learning (Galli et al.,
"Group privacy for personalized federated learning"; :mod:`lightning_dp.federated`)
a client starts from a hypothesis ``theta_j`` the server knows, runs local SGD with a
learning rate ``lr`` and releases its model through a sanitizer. The attacker (the
server, or anyone who sees the release) knows ``theta_j`` (``start``), the release,
``lr``, the architecture and the loss, and estimates the client's gradient as

.. math::

    \\hat g = (\\theta_{start} - \\theta_{released}) / lr,

exact for one unsanitized SGD step on the client's batch (:func:`observed_gradient`).
It then runs DLG against ``\\hat g`` (:func:`dlg_attack`). The audit
(:func:`run_dlg_audit`) repeats this for several noise levels and reports how close
the reconstruction is to the private image (:func:`mse`, :func:`psnr`) and whether
the label was recovered. A failed attack is evidence, not proof, of protection:
stronger attacks exist (other objectives, priors, more restarts).

**Sanitizers** are callables ``(start, trained, generator) -> released`` on flat
parameter vectors (the order of ``model.named_parameters()`` restricted to trainable
parameters, the layout of :class:`lightning_dp.federated.FlatParams`):

- :class:`EuclideanLaplaceSanitizer`: the seed's metric-privacy release,
  :func:`lightning_dp.privacy.mechanisms.sanitize_update` (noise of expected norm
  ``nu * ||delta||``, per layer by default);
- :class:`GaussianSanitizer`: DP-SGD for one example (clip the update-implied
  gradient to ``C``, add ``N(0, (sigma C)^2 I)``);
- :class:`NoSanitizer`: the release is the trained model.

Every random draw comes from a ``torch.Generator``; :func:`run_dlg_audit` derives them
from one seed with :func:`lightning_dp.privacy.noise.derive_generator`, so an audit is
reproducible and the global RNG is never used. This module imports torch only (no
Lightning): it is the functional core of ``lightning-dp audit``
(:mod:`lightning_dp.audit.command`).

Example:
    >>> import torch
    >>> from torch import nn
    >>> model = nn.Sequential(nn.Flatten(), nn.Linear(4, 8), nn.Sigmoid(), nn.Linear(8, 3))
    >>> x, y = torch.rand(1, 1, 2, 2), torch.tensor([2])
    >>> out = run_dlg_audit(model, x, y, noise_multipliers=(0.0, 10.0), lr=0.1, iterations=20, seed=0,
    ...                     sanitizer_factory=lambda nu: EuclideanLaplaceSanitizer(nu, per_layer=False))
    >>> [row.noise_multiplier for row in out.rows]
    [0.0, 10.0]
"""

from __future__ import annotations

import math
import numbers
import struct
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call

from lightning_dp.privacy.clipping import check_max_grad_norm, clip_factors
from lightning_dp.privacy.mechanisms import _check_noise_multiplier, sanitize_update
from lightning_dp.privacy.noise import derive_generator, gaussian_noise

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = [
    "AuditResult",
    "AuditRow",
    "ClientRelease",
    "DLGResult",
    "EuclideanLaplaceSanitizer",
    "GaussianSanitizer",
    "NoSanitizer",
    "SANITIZERS",
    "Sanitizer",
    "client_release",
    "dlg_attack",
    "flatten_parameters",
    "gradient_matching_loss",
    "image_grid",
    "make_sanitizer_factory",
    "mse",
    "observed_gradient",
    "parameter_sizes",
    "psnr",
    "run_dlg_audit",
]

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


def _is_real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _check_positive_real(name: str, value: Any, hint: str) -> float:
    if not _is_real(value) or not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name}={value!r} is not allowed: it must be a finite number > 0. {hint}")
    return float(value)


def _check_positive_int(name: str, value: Any, hint: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name}={value!r} is not allowed: it must be an integer >= 1. {hint}")
    return int(value)


def _trainable(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}.")
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    if not named:
        raise ValueError(f"{type(model).__name__} has no trainable parameters: a client that trains nothing "
                         "releases nothing to audit. Pass a model with parameters that require grad.")
    return named


def _check_generator(generator: Any, name: str = "generator") -> Optional[torch.Generator]:
    if generator is not None and not isinstance(generator, torch.Generator):
        raise ValueError(f"{name}={generator!r} must be a torch.Generator (or None for a fresh, non-reproducible "
                         "one); pass e.g. lightning_dp.privacy.noise.derive_generator(seed, stream).")
    return generator


def _fresh_generator(device: torch.device) -> torch.Generator:
    generator = torch.Generator(device=device)
    generator.seed()  # OS entropy, never the global RNG
    return generator


# --------------------------------------------------------------------------- flat parameters


def parameter_sizes(model: nn.Module) -> list[int]:
    """Number of elements of each trainable parameter, in ``named_parameters`` order.

    The same layout as :class:`lightning_dp.federated.FlatParams` (``FlatParams.of(model).sizes``),
    computed here without importing the federated package (which imports Lightning).

    Example:
        >>> parameter_sizes(nn.Linear(3, 2))
        [6, 2]
    """
    return [p.numel() for _, p in _trainable(model)]


def flatten_parameters(model: nn.Module) -> Tensor:
    """The trainable parameters as one detached flat vector (``FlatParams.of(model).flatten(model)``).

    Example:
        >>> flatten_parameters(nn.Linear(3, 2)).shape
        torch.Size([8])
    """
    return torch.cat([p.detach().reshape(-1) for _, p in _trainable(model)])


def _unflatten(model: nn.Module, flat: Tensor) -> list[Tensor]:
    named = _trainable(model)
    sizes = [p.numel() for _, p in named]
    if flat.dim() != 1 or flat.numel() != sum(sizes):
        raise ValueError(f"the flat vector has shape {tuple(flat.shape)} but {type(model).__name__} has "
                         f"{sum(sizes)} trainable parameters; flatten it with flatten_parameters(model).")
    return [chunk.reshape(p.shape) for chunk, (_, p) in zip(torch.split(flat, sizes), named)]


# --------------------------------------------------------------------------- sanitizers


class NoSanitizer:
    """Releases the trained model as it is (the attack's best case).

    Example:
        >>> NoSanitizer()(torch.zeros(2), torch.ones(2), None)
        tensor([1., 1.])
    """

    def __call__(self, start: Tensor, trained: Tensor, generator: Optional[torch.Generator] = None) -> Tensor:
        return trained.clone()

    def __repr__(self) -> str:
        return "NoSanitizer()"


class EuclideanLaplaceSanitizer:
    """The seed's release: ``trained + rho``, ``rho`` Euclidean Laplace with expected norm ``nu ||delta||``.

    A thin wrapper of :func:`lightning_dp.privacy.mechanisms.sanitize_update` (Galli et
    al., "Group privacy for personalized federated learning"; the formula, its
    d-privacy guarantee and the layer-wise variant are documented there) with
    ``reference = start``: ``delta = trained - start``, ``epsilon = n / (nu * max(||delta||,
    min_delta_norm))``, cost ``n / nu`` per release. Layer-wise (``per_layer=True``, the
    default of the audit) each parameter tensor gets its own ``epsilon_l = n_l / (nu ||delta_l||)``.
    One SGD step gives ``delta = -lr g``, so the attacker's gradient estimate carries
    noise of expected norm ``nu ||g||`` (per layer: ``nu ||g_l||``) whatever ``lr`` is.

    Args:
        noise_multiplier: ``nu >= 0``; 0 releases the trained model (no noise).
        per_layer: Sanitize each parameter tensor separately (needs ``layer_sizes``).
        min_delta_norm: Floor on the update norm used for calibration (the federated
            module's default 1e-8; 0 refuses a client whose update is zero).
        layer_sizes: The sizes ``n_l`` of the parameter tensors, in flat order; use
            :meth:`for_model` to take them from a model.

    Raises:
        ValueError: If an argument is outside its range.

    Example:
        >>> model = nn.Linear(3, 2)
        >>> sanitizer = EuclideanLaplaceSanitizer.for_model(model, 1.0)
        >>> start = flatten_parameters(model)
        >>> released = sanitizer(start, start + 0.1, torch.Generator().manual_seed(0))
        >>> released.shape
        torch.Size([8])
    """

    def __init__(self, noise_multiplier: float, *, per_layer: bool = True, min_delta_norm: float = 1e-8,
                 layer_sizes: Optional[Sequence[int]] = None) -> None:
        self.noise_multiplier = _check_noise_multiplier(noise_multiplier)
        if not isinstance(per_layer, bool):
            raise ValueError(f"per_layer={per_layer!r} must be True or False.")
        if not _is_real(min_delta_norm) or not (math.isfinite(min_delta_norm) and min_delta_norm >= 0):
            raise ValueError(f"min_delta_norm={min_delta_norm!r} is not allowed: it must be a finite number >= 0 "
                             "(the smallest update norm the noise is calibrated to); pass e.g. 1e-8.")
        if per_layer and layer_sizes is None:
            raise ValueError(
                "per_layer=True needs the sizes of the model's parameter tensors, got layer_sizes=None. Use "
                "EuclideanLaplaceSanitizer.for_model(model, noise_multiplier), or pass layer_sizes="
                "lightning_dp.audit.parameter_sizes(model), or per_layer=False for one release of the whole vector."
            )
        self.per_layer = per_layer
        self.min_delta_norm = float(min_delta_norm)
        self.layer_sizes = None if layer_sizes is None else [int(s) for s in layer_sizes]

    @classmethod
    def for_model(cls, model: nn.Module, noise_multiplier: float, *, per_layer: bool = True,
                  min_delta_norm: float = 1e-8) -> EuclideanLaplaceSanitizer:
        """The sanitizer of ``model``'s releases (layer sizes from its trainable parameters)."""
        return cls(noise_multiplier, per_layer=per_layer, min_delta_norm=min_delta_norm,
                   layer_sizes=parameter_sizes(model))

    def __call__(self, start: Tensor, trained: Tensor, generator: Optional[torch.Generator]) -> Tensor:
        return sanitize_update(
            trained,
            start,
            noise_multiplier=self.noise_multiplier,
            generator=generator,
            per_layer_sizes=self.layer_sizes if self.per_layer else None,
            min_delta_norm=self.min_delta_norm,
        ).released

    def __repr__(self) -> str:
        return (f"EuclideanLaplaceSanitizer(noise_multiplier={self.noise_multiplier!r}, per_layer={self.per_layer}, "
                f"min_delta_norm={self.min_delta_norm!r})")


class GaussianSanitizer:
    """DP-SGD for one example: clip the update-implied gradient to ``C``, add ``N(0, (sigma C)^2 I)``.

    Abadi et al., "Deep learning with differential privacy", CCS 2016, Algorithm 1 with a
    batch of one: the update ``trained - start = -lr g`` gives the gradient
    ``g = (start - trained) / lr``, which is clipped to norm ``C``
    (:func:`lightning_dp.privacy.clipping.clip_factors`) and noised with
    ``N(0, (sigma C)^2 I)`` (:func:`lightning_dp.privacy.noise.gaussian_noise`); the release
    is ``start - lr (clip(g) + noise)``, so the attacker's gradient estimate is exactly
    the noisy clipped gradient. After several local steps ``g`` is the average
    pseudo-gradient ``(start - trained) / lr`` of the whole update. With ``lr=1`` it is
    the update itself, i.e. update clipping as in DP-FedAvg (McMahan et al., ICLR 2018).

    Args:
        max_grad_norm: The clipping norm ``C > 0``.
        noise_multiplier: ``sigma >= 0`` (noise std over ``C``); 0 clips without noise.
        lr: The client's learning rate, the same as in :func:`client_release`.

    Raises:
        ValueError: If an argument is outside its range.

    Example:
        >>> sanitizer = GaussianSanitizer(1.0, 0.0, lr=0.5)  # clipping only
        >>> sanitizer(torch.zeros(2), torch.tensor([3.0, 4.0]), None)  # g = (-6, -8), clipped to norm 1
        tensor([0.3000, 0.4000])
    """

    def __init__(self, max_grad_norm: float, noise_multiplier: float, *, lr: float = 1.0) -> None:
        self.max_grad_norm = check_max_grad_norm(max_grad_norm)
        if not _is_real(noise_multiplier) or not (math.isfinite(noise_multiplier) and noise_multiplier >= 0):
            raise ValueError(
                f"noise_multiplier={noise_multiplier!r} is not allowed: sigma must be a finite number >= 0, the "
                "Gaussian noise std over the clipping norm C (0 clips without noise). Pass e.g. 1.0."
            )
        self.noise_multiplier = float(noise_multiplier)
        self.lr = _check_positive_real("lr", lr, "Pass the client's learning rate, as in client_release(lr=...).")

    def __call__(self, start: Tensor, trained: Tensor, generator: Optional[torch.Generator]) -> Tensor:
        if start.shape != trained.shape or start.dim() != 1:
            raise ValueError(f"start {tuple(start.shape)} and trained {tuple(trained.shape)} must be flat vectors of "
                             "the same shape (flatten_parameters(model)).")
        gradient = (start - trained) / self.lr
        factor = clip_factors(torch.linalg.vector_norm(gradient).reshape(1), self.max_grad_norm)[0]
        noisy = gradient * factor
        if self.noise_multiplier > 0:
            generator = _check_generator(generator) or _fresh_generator(start.device)
            noisy = noisy + gaussian_noise([gradient.shape], self.noise_multiplier * self.max_grad_norm, generator,
                                           dtype=gradient.dtype, device=gradient.device)[0]
        return start - self.lr * noisy

    def __repr__(self) -> str:
        return (f"GaussianSanitizer(max_grad_norm={self.max_grad_norm!r}, noise_multiplier={self.noise_multiplier!r}, "
                f"lr={self.lr!r})")


def _laplace_factory(model: nn.Module, *, per_layer: bool, lr: float, max_grad_norm: float,
                     min_delta_norm: float) -> SanitizerFactory:
    sizes = parameter_sizes(model)
    return lambda nu: EuclideanLaplaceSanitizer(nu, per_layer=per_layer, min_delta_norm=min_delta_norm,
                                                layer_sizes=sizes)


#: Sanitizer names of :func:`make_sanitizer_factory` (and of ``lightning-dp audit --sanitizer``):
#: what a noise multiplier ``nu`` means for each.
SANITIZERS: dict[str, tuple[str, Callable[..., SanitizerFactory]]] = {
    "laplace_per_layer": (
        "Euclidean Laplace per parameter tensor, expected noise norm nu * ||delta_l|| (the seed's per_layer=True)",
        lambda model, **kw: _laplace_factory(model, per_layer=True, **kw),
    ),
    "laplace": (
        "Euclidean Laplace on the whole vector, expected noise norm nu * ||delta|| (per_layer=False)",
        lambda model, **kw: _laplace_factory(model, per_layer=False, **kw),
    ),
    "gaussian": (
        "DP-SGD for one example: clip the gradient to max_grad_norm C, add N(0, (nu C)^2) per coordinate",
        lambda model, *, lr, max_grad_norm, min_delta_norm: (
            lambda nu: GaussianSanitizer(max_grad_norm, nu, lr=lr)),
    ),
}


def make_sanitizer_factory(name: str, *, model: nn.Module, lr: float, max_grad_norm: float = 1.0,
                           min_delta_norm: float = 1e-8) -> SanitizerFactory:
    """The factory ``nu -> sanitizer`` of a named sanitizer (:data:`SANITIZERS`).

    Args:
        name: ``"laplace_per_layer"``, ``"laplace"`` or ``"gaussian"``.
        model: The audited model (layer sizes of the layer-wise release).
        lr: The client's learning rate (the Gaussian sanitizer's gradient is ``-update / lr``).
        max_grad_norm: ``C`` of ``"gaussian"``.
        min_delta_norm: Calibration floor of the Laplace sanitizers.

    Raises:
        ValueError: For an unknown name or a parameter outside its range.

    Example:
        >>> factory = make_sanitizer_factory("gaussian", model=nn.Linear(2, 1), lr=0.1, max_grad_norm=2.0)
        >>> factory(1.5)
        GaussianSanitizer(max_grad_norm=2.0, noise_multiplier=1.5, lr=0.1)
    """
    if name not in SANITIZERS:
        raise ValueError(f"sanitizer={name!r} is not supported; choose one of {sorted(SANITIZERS)}: "
                         + "; ".join(f"{key}: {doc}" for key, (doc, _) in SANITIZERS.items()) + ".")
    lr = _check_positive_real("lr", lr, "Pass the client's learning rate, e.g. 0.1.")
    check_max_grad_norm(max_grad_norm)
    EuclideanLaplaceSanitizer(0.0, per_layer=False, min_delta_norm=min_delta_norm)  # validates min_delta_norm
    return SANITIZERS[name][1](model, lr=lr, max_grad_norm=float(max_grad_norm), min_delta_norm=float(min_delta_norm))


# --------------------------------------------------------------------------- the client's release


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
        >>> model = nn.Linear(4, 3)
        >>> start, released = client_release(model, torch.ones(1, 4), torch.tensor([1]), lr=0.1,
        ...                                  sanitizer=NoSanitizer(), generator=None)
        >>> observed = observed_gradient(start, released, 0.1, model)
        >>> [tuple(g.shape) for g in observed]
        [(3, 4), (3,)]
    """
    lr = _check_positive_real("lr", lr, "Pass the client's learning rate, e.g. lr=0.1.")
    local_steps = _check_positive_int("local_steps", local_steps, "One step lets the attacker recover the exact "
                                      "gradient; more steps blur it. Pass e.g. local_steps=1.")
    if loss not in LOSSES:
        raise ValueError(f"loss={loss!r} is not supported; choose one of {LOSSES} (DLG attacks classifiers).")
    if not callable(sanitizer):
        raise ValueError(f"sanitizer={sanitizer!r} must be a callable (start, trained, generator) -> released, e.g. "
                         "EuclideanLaplaceSanitizer.for_model(model, 1.0) or NoSanitizer().")
    _check_generator(generator)
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
    lr = _check_positive_real("lr", lr, "Pass the client's learning rate (the attacker knows it).")
    if not isinstance(start, Tensor) or not isinstance(released, Tensor) or start.shape != released.shape:
        raise ValueError(f"start and released must be tensors of the same shape, got "
                         f"{tuple(getattr(start, 'shape', ()))} and {tuple(getattr(released, 'shape', ()))}.")
    return _unflatten(model, (start - released) / lr)


# --------------------------------------------------------------------------- the attack


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
    return sum(((g - t) ** 2).sum() for g, t in zip(grads, target_gradients))


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
    num_classes = _check_positive_int("num_classes", num_classes, "Pass the number of the model's output logits.")
    iterations = _check_positive_int("iterations", iterations, "The DLG paper runs 300 L-BFGS steps.")
    attack_lr = _check_positive_real("attack_lr", attack_lr, "The DLG code uses L-BFGS's default lr=1.")
    restarts = _check_positive_int("restarts", restarts, "Pass restarts=1 for the paper's single run.")
    if known_label is not None and (isinstance(known_label, bool) or not isinstance(known_label, numbers.Integral)
                                    or not 0 <= known_label < num_classes):
        raise ValueError(f"known_label={known_label!r} must be None or a class index in 0..{num_classes - 1}.")
    reference = target[0]
    generator = _check_generator(generator) or _fresh_generator(reference.device)
    options = {"dtype": reference.dtype, "device": reference.device}
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


# --------------------------------------------------------------------------- metrics


def mse(a: Tensor, b: Tensor) -> float:
    """Mean squared error ``mean((a - b)^2)`` over all elements, computed in float64.

    Example:
        >>> mse(torch.zeros(4), torch.tensor([0.0, 0.0, 1.0, 1.0]))
        0.5
    """
    if not isinstance(a, Tensor) or not isinstance(b, Tensor) or a.shape != b.shape:
        raise ValueError(f"mse needs two tensors of the same shape, got {tuple(getattr(a, 'shape', ()))} and "
                         f"{tuple(getattr(b, 'shape', ()))}.")
    return float((a.detach().double() - b.detach().double()).pow(2).mean())


def psnr(a: Tensor, b: Tensor, data_range: float = 1.0) -> float:
    """Peak signal-to-noise ratio ``10 log10(data_range^2 / mse(a, b))`` in dB (``inf`` when equal).

    Compare images on the scale whose range is ``data_range`` (pixels in [0, 1]: 1.0).

    Example:
        >>> round(psnr(torch.zeros(4), torch.full((4,), 0.1)), 6)  # mse 0.01 -> 20 dB
        20.0
    """
    data_range = _check_positive_real("data_range", data_range, "Pass the pixel range, 1.0 for images in [0, 1].")
    error = mse(a, b)
    return math.inf if error == 0 else 10.0 * math.log10(data_range ** 2 / error)


# --------------------------------------------------------------------------- the audit


@dataclass(frozen=True)
class AuditRow:
    """One attack: image ``image`` released with noise multiplier ``noise_multiplier``.

    ``mse``/``psnr`` compare the reconstruction with the private image on the image
    scale (after ``x * input_std + input_mean`` and clipping to ``pixel_range``).
    """

    image: int
    noise_multiplier: float
    label: int
    recovered_label: int
    label_recovered: bool
    mse: float
    psnr: float
    match_loss: float
    seconds: float


@dataclass
class AuditResult:
    """Everything :func:`run_dlg_audit` measured.

    Attributes:
        noise_multipliers: The audited noise levels, in order (the ``step`` of the metrics).
        rows: One :class:`AuditRow` per image and noise level (image-major).
        originals: The private images on the image scale, ``(N, *input_shape)``.
        reconstructions: The reconstructions on the image scale, ``(N, K, *input_shape)``.
        labels: The private labels.
        pixel_range: The image scale's ``(low, high)``.
    """

    noise_multipliers: list[float]
    rows: list[AuditRow]
    originals: Tensor
    reconstructions: Tensor
    labels: list[int]
    pixel_range: tuple[float, float] = (0.0, 1.0)

    def summary(self) -> list[dict[str, float]]:
        """Per noise level (in order): mean MSE, mean PSNR, fraction of labels recovered, median matching loss."""
        out = []
        for nu in self.noise_multipliers:
            rows = [row for row in self.rows if row.noise_multiplier == nu]
            losses = sorted(row.match_loss for row in rows)
            out.append({
                "noise_multiplier": nu,
                "mse": sum(row.mse for row in rows) / len(rows),
                "psnr": sum(row.psnr for row in rows) / len(rows),
                "label_recovered": sum(row.label_recovered for row in rows) / len(rows),
                "match_loss": losses[len(losses) // 2] if len(losses) % 2 else
                0.5 * (losses[len(losses) // 2 - 1] + losses[len(losses) // 2]),
                "images": float(len(rows)),
            })
        return out

    def table(self) -> str:
        """The summary as a Markdown table."""
        lines = ["| nu | MSE (mean) | PSNR dB (mean) | labels recovered | matching loss (median) |",
                 "|---|---|---|---|---|"]
        for s in self.summary():
            lines.append(f"| {s['noise_multiplier']:g} | {s['mse']:.4g} | {s['psnr']:.2f} | "
                         f"{round(s['label_recovered'] * s['images'])}/{int(s['images'])} | {s['match_loss']:.3g} |")
        return "\n".join(lines) + "\n"

    def tsv(self) -> str:
        """Every row as tab-separated values with a header line."""
        names = list(AuditRow.__dataclass_fields__)
        lines = ["\t".join(names)]
        for row in self.rows:
            lines.append("\t".join(repr(v) if isinstance(v, float) else str(v) for v in
                                   (getattr(row, name) for name in names)))
        return "\n".join(lines) + "\n"

    def figure(self) -> Figure:
        """:func:`image_grid` of the originals and reconstructions, titled with nu and MSE."""
        k = len(self.noise_multipliers)
        mses = [[row.mse for row in self.rows[i * k:(i + 1) * k]] for i in range(len(self.labels))]
        recovered = [[row.recovered_label for row in self.rows[i * k:(i + 1) * k]] for i in range(len(self.labels))]
        return image_grid(self.originals, self.reconstructions, self.labels, noise_multipliers=self.noise_multipliers,
                          mses=mses, recovered_labels=recovered, value_range=self.pixel_range)


def _check_noise_multipliers(noise_multipliers: Any) -> list[float]:
    try:
        values = list(noise_multipliers)
    except TypeError:
        values = None
    if not values or any(not _is_real(v) or not (math.isfinite(v) and v >= 0) for v in values):
        raise ValueError(f"noise_multipliers={noise_multipliers!r} is not allowed: it must be a non-empty sequence of "
                         "finite numbers >= 0 (0 = no noise), e.g. [0, 0.001, 0.01, 0.1, 1, 3, 5, 10].")
    if len(set(map(float, values))) != len(values):
        raise ValueError(f"noise_multipliers={noise_multipliers!r} lists a value twice; each noise level is audited "
                         "once (its release is seeded by the level), so pass distinct values.")
    return [float(v) for v in values]


def _float_key(value: float) -> int:
    """The bits of a float64 as an integer: a counter of :func:`derive_generator` that names a noise level."""
    return int.from_bytes(struct.pack("<d", float(value)), "little")


def run_dlg_audit(model: nn.Module, x: Tensor, y: Tensor, *,
                  noise_multipliers: Sequence[float] = (0.0, 1e-3, 1e-2, 1e-1, 1.0, 3.0, 5.0, 10.0),
                  lr: float = 0.1, local_steps: int = 1, iterations: int = 300, attack_lr: float = 1.0,
                  restarts: int = 1, seed: int = 0, sanitizer_factory: Optional[SanitizerFactory] = None,
                  known_label: bool = False, num_classes: Optional[int] = None, input_mean: float = 0.0,
                  input_std: float = 1.0, pixel_range: tuple[float, float] = (0.0, 1.0),
                  on_row: Optional[Callable[[AuditRow], None]] = None) -> AuditResult:
    """DLG against every image (one client each, a batch of one) at every noise level.

    For image ``i`` and noise level ``nu``: the client releases
    ``client_release(model, x[i:i+1], y[i:i+1], lr, local_steps, sanitizer_factory(nu))``
    with noise from ``derive_generator(seed, NOISE_STREAM, i, bits of nu)`` (the release
    depends on the seed, the image and ``nu`` only, not on the other audited levels); the attacker runs
    :func:`dlg_attack` on :func:`observed_gradient` with dummies from
    ``derive_generator(seed, DUMMY_STREAM, i)``: the same initializations at every
    noise level (common random numbers, so the noise is the only difference between
    the columns). Reconstruction and image are compared on the image scale
    ``clip(x * input_std + input_mean, *pixel_range)`` (the attacker knows the pixel
    range; clipping never increases the error), PSNR with ``data_range = high - low``.

    Args:
        model: The model at the clients' starting point (e.g. a freshly initialized
            :class:`~lightning_dp.models.SigmoidLeNet`); not modified.
        x: Private images ``(N, *input_shape)`` in the model's input scale.
        y: Their labels ``(N,)``.
        noise_multipliers: The noise levels ``nu >= 0`` to audit.
        lr: The client's learning rate (known to the attacker).
        local_steps: The client's SGD steps on its image.
        iterations: L-BFGS steps of the attack.
        attack_lr: L-BFGS learning rate.
        restarts: Attack initializations per release (the lowest matching loss wins).
        seed: Seed of all noise and initializations.
        sanitizer_factory: ``nu -> sanitizer``; ``None`` for
            ``EuclideanLaplaceSanitizer.for_model(model, nu)`` (layer-wise, the seed's
            release), or e.g. ``make_sanitizer_factory("gaussian", model=model, lr=lr)``.
        known_label: Give the attacker the true label (only the image is reconstructed).
        num_classes: Number of classes; ``None`` reads it from ``model``'s output.
        input_mean: Mean the inputs were standardized with (0 if not standardized).
        input_std: Standard deviation the inputs were standardized with (1 if not).
        pixel_range: ``(low, high)`` of the image scale.
        on_row: Called with every :class:`AuditRow` as soon as it is measured (progress).

    Returns:
        An :class:`AuditResult`.

    Raises:
        ValueError: On arguments outside their range.
    """
    _check_batch(x, y)
    nus = _check_noise_multipliers(noise_multipliers)
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise ValueError(f"seed={seed!r} must be an integer.")
    input_std = _check_positive_real("input_std", input_std, "Pass the std the inputs were standardized with, or 1.")
    if not _is_real(input_mean) or not math.isfinite(input_mean):
        raise ValueError(f"input_mean={input_mean!r} must be a finite number (0 if the inputs are not standardized).")
    try:
        low, high = (float(v) for v in pixel_range)
    except (TypeError, ValueError):
        low, high = math.nan, math.nan
    if not (math.isfinite(low) and math.isfinite(high) and low < high):
        raise ValueError(f"pixel_range={pixel_range!r} must be two finite numbers (low, high) with low < high, e.g. "
                         "(0.0, 1.0) for images in [0, 1].")
    if sanitizer_factory is None:
        sizes = parameter_sizes(model)
        sanitizer_factory = lambda nu: EuclideanLaplaceSanitizer(nu, layer_sizes=sizes)  # noqa: E731
    if num_classes is None:
        with torch.no_grad():
            num_classes = int(model(x[:1]).shape[-1])
    if int(y.min()) < 0 or int(y.max()) >= num_classes:
        raise ValueError(f"labels {y.tolist()} must be class indices in 0..{num_classes - 1} (the model has "
                         f"{num_classes} outputs); use a model with as many outputs as the data has classes.")

    def to_image(t: Tensor) -> Tensor:
        return (t.detach() * input_std + input_mean).clamp(low, high)

    rows, reconstructions = [], []
    for i in range(x.shape[0]):
        xi, yi = x[i:i + 1], y[i:i + 1]
        original = to_image(xi[0])
        per_image = []
        for nu in nus:
            began = time.perf_counter()
            start, released = client_release(model, xi, yi, lr=lr, local_steps=local_steps,
                                              sanitizer=sanitizer_factory(nu),
                                              generator=derive_generator(seed, NOISE_STREAM, i, _float_key(nu),
                                                                         device=x.device))
            result = dlg_attack(model, observed_gradient(start, released, lr, model), input_shape=xi.shape[1:],
                                num_classes=num_classes, iterations=iterations, attack_lr=attack_lr,
                                generator=derive_generator(seed, DUMMY_STREAM, i, device=x.device), restarts=restarts,
                                known_label=int(yi[0]) if known_label else None)
            image = to_image(result.reconstruction[0])
            row = AuditRow(image=i, noise_multiplier=nu, label=int(yi[0]), recovered_label=result.label,
                           label_recovered=result.label == int(yi[0]), mse=mse(image, original),
                           psnr=psnr(image, original, data_range=high - low), match_loss=result.match_loss,
                           seconds=time.perf_counter() - began)
            rows.append(row)
            per_image.append(image)
            if on_row is not None:
                on_row(row)
        reconstructions.append(torch.stack(per_image))
    return AuditResult(nus, rows, to_image(x), torch.stack(reconstructions), [int(v) for v in y], (low, high))


# --------------------------------------------------------------------------- the figure


def image_grid(original: Tensor, reconstructions: Tensor, labels: Optional[Sequence[int]] = None, *,
               noise_multipliers: Sequence[float], mses: Optional[Sequence[Sequence[float]]] = None,
               recovered_labels: Optional[Sequence[Sequence[int]]] = None,
               value_range: tuple[float, float] = (0.0, 1.0)) -> Figure:
    """One row per image: the original, then its reconstruction at every noise level.

    The columns are titled with ``nu`` and, when given, the MSE and the recovered label
    (the layout of the seed's reconstruction figure). Images are drawn on
    ``value_range`` (grayscale for one channel, RGB for three). Built on the Agg
    canvas without ``pyplot``: no display is needed and no global figure stays open.

    Args:
        original: ``(N, C, H, W)`` (or one image ``(C, H, W)``).
        reconstructions: ``(N, K, C, H, W)`` (or ``(K, C, H, W)`` for one image).
        labels: The true label of each image (shown above the original).
        noise_multipliers: The ``K`` noise levels.
        mses: ``mses[i][k]``, shown under ``nu``.
        recovered_labels: ``recovered_labels[i][k]``, shown next to the MSE.
        value_range: ``(low, high)`` mapped to black and white.

    Raises:
        ValueError: If the shapes do not agree.

    Example:
        >>> fig = image_grid(torch.rand(2, 1, 8, 8), torch.rand(2, 3, 1, 8, 8), [3, 5], noise_multipliers=[0, 1, 10])
        >>> len(fig.axes)
        8
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    if original.dim() == 3:
        original, reconstructions = original.unsqueeze(0), reconstructions.unsqueeze(0)
    nus = list(noise_multipliers)
    if (original.dim() != 4 or reconstructions.dim() != 5 or reconstructions.shape[0] != original.shape[0]
            or reconstructions.shape[1] != len(nus) or reconstructions.shape[2:] != original.shape[1:]):
        raise ValueError(f"original {tuple(original.shape)} must be (N, C, H, W) and reconstructions "
                         f"{tuple(reconstructions.shape)} (N, K, C, H, W) with K = {len(nus)} noise multipliers.")
    n, k = original.shape[0], len(nus)
    low, high = value_range
    figure = Figure(figsize=(1.4 * (k + 1), 1.6 * n + 0.3), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(n, k + 1, squeeze=False)

    def show(ax: Any, image: Tensor, title: str) -> None:
        picture = image.detach().cpu().float()
        if picture.shape[0] == 1:
            ax.imshow(picture[0].numpy(), cmap="gray", vmin=low, vmax=high)
        else:
            ax.imshow(((picture.permute(1, 2, 0) - low) / (high - low)).clamp(0, 1).numpy())
        ax.set_title(title, fontsize=7)
        ax.set_xticks([])
        ax.set_yticks([])

    for i in range(n):
        show(axes[i][0], original[i], "original" + (f" (y={labels[i]})" if labels is not None else ""))
        for j, nu in enumerate(nus):
            title = f"nu={nu:g}"
            if mses is not None:
                title += f"\nMSE {mses[i][j]:.3g}"
            if recovered_labels is not None:
                title += f" y={recovered_labels[i][j]}"
            show(axes[i][j + 1], reconstructions[i, j], title)
    return figure
