"""What a client may release, for the DLG audit: sanitizers ``(start, trained, generator) -> released`` on flat
parameter vectors (see :mod:`lightning_dp.audit.dlg` for the threat model)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Optional

import torch
from torch import Tensor, nn

from lightning_dp import checks
from lightning_dp.audit._common import (
    SanitizerFactory,
    parameter_sizes,
)
from lightning_dp.privacy.clipping import check_max_grad_norm, clip_factors
from lightning_dp.privacy.mechanisms import check_metric_noise_multiplier, sanitize_update
from lightning_dp.privacy.noise import gaussian_noise

__all__ = ["EuclideanLaplaceSanitizer", "GaussianSanitizer", "NoSanitizer", "SANITIZERS", "make_sanitizer_factory"]


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
        >>> from lightning_dp.audit._common import flatten_parameters
        >>> model = nn.Linear(3, 2)
        >>> sanitizer = EuclideanLaplaceSanitizer.for_model(model, 1.0)
        >>> start = flatten_parameters(model)
        >>> released = sanitizer(start, start + 0.1, torch.Generator().manual_seed(0))
        >>> released.shape
        torch.Size([8])
    """

    def __init__(self, noise_multiplier: float, *, per_layer: bool = True, min_delta_norm: float = 1e-8,
                 layer_sizes: Optional[Sequence[int]] = None) -> None:
        self.noise_multiplier = check_metric_noise_multiplier(noise_multiplier)
        if not isinstance(per_layer, bool):
            raise ValueError(f"per_layer={per_layer!r} must be True or False.")
        if not checks.is_real(min_delta_norm) or not (math.isfinite(min_delta_norm) and min_delta_norm >= 0):
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
        if not checks.is_real(noise_multiplier) or not (math.isfinite(noise_multiplier) and noise_multiplier >= 0):
            raise ValueError(
                f"noise_multiplier={noise_multiplier!r} is not allowed: sigma must be a finite number >= 0, the "
                "Gaussian noise std over the clipping norm C (0 clips without noise). Pass e.g. 1.0."
            )
        self.noise_multiplier = float(noise_multiplier)
        self.lr = checks.positive_real("lr", lr, hint="Pass the client's learning rate, as in client_release(lr=...).")

    def __call__(self, start: Tensor, trained: Tensor, generator: Optional[torch.Generator]) -> Tensor:
        if start.shape != trained.shape or start.dim() != 1:
            raise ValueError(f"start {tuple(start.shape)} and trained {tuple(trained.shape)} must be flat vectors of "
                             "the same shape (flatten_parameters(model)).")
        gradient = (start - trained) / self.lr
        factor = clip_factors(torch.linalg.vector_norm(gradient).reshape(1), self.max_grad_norm)[0]
        noisy = gradient * factor
        if self.noise_multiplier > 0:
            generator = checks.generator("generator", generator, device=start.device)
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
    lr = checks.positive_real("lr", lr, hint="Pass the client's learning rate, e.g. 0.1.")
    check_max_grad_norm(max_grad_norm)
    EuclideanLaplaceSanitizer(0.0, per_layer=False, min_delta_norm=min_delta_norm)  # validates min_delta_norm
    return SANITIZERS[name][1](model, lr=lr, max_grad_norm=float(max_grad_norm), min_delta_norm=float(min_delta_norm))
