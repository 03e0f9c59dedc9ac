"""What a client may release, for the DLG audit: the federated round's sanitizers as release functions.

One sanitizer family (:mod:`lightning_dp.federated.parts.sanitizers`) serves the round and the audit: an audit
release is a :class:`~lightning_dp.federated.parts.ClientSanitizer` called as ``(start, trained, generator) ->
released`` on flat parameter vectors (:class:`PartRelease`; see :mod:`lightning_dp.audit.dlg` for the threat
model). The names below build the part the DLG audit's ``--sanitizer`` means.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Optional

import torch
from torch import Tensor, nn

from lightning_dp import checks
from lightning_dp.audit._common import SanitizerFactory, parameter_sizes
from lightning_dp.federated.parts.sanitizers import ClipSanitizer, ClientSanitizer, EuclideanLaplace, GaussianLocalDP
from lightning_dp.federated.parts.sanitizers import NoSanitizer as _NoSanitizerPart  # the name: the alias below
from lightning_dp.privacy.clipping import check_max_grad_norm

__all__ = ["EuclideanLaplaceSanitizer", "GaussianSanitizer", "PartRelease", "SANITIZERS", "Unsanitized",
           "make_sanitizer_factory"]


class PartRelease:
    """A federated sanitizer part as the audit's release function ``(start, trained, generator) -> released``.

    Args:
        part: the :class:`~lightning_dp.federated.parts.ClientSanitizer` (the round's, unchanged).
        layer_sizes: the sizes of the model's parameter tensors in flat order (layer-wise sanitizers).
    """

    def __init__(self, part: ClientSanitizer, layer_sizes: Optional[Sequence[int]] = None) -> None:
        self.part = part
        self.layer_sizes = None if layer_sizes is None else [int(s) for s in layer_sizes]

    def __call__(self, start: Tensor, trained: Tensor, generator: Optional[torch.Generator]) -> Tensor:
        if start.shape != trained.shape or start.dim() != 1:
            raise ValueError(f"start {tuple(start.shape)} and trained {tuple(trained.shape)} must be flat vectors of "
                             "the same shape (flatten_parameters(model)).")
        sizes = self.layer_sizes if self.layer_sizes is not None else [start.numel()]
        return self.part.sanitize(trained, start, generator=generator, layer_sizes=sizes).released  # type: ignore[arg-type]

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.part!r})"


class Unsanitized(PartRelease):
    """Releases the trained model as it is (the attack's best case): the round's ``none`` sanitizer
    (:class:`~lightning_dp.federated.parts.NoSanitizer`) as a release.

    Example:
        >>> Unsanitized()(torch.zeros(2), torch.ones(2), None)
        tensor([1., 1.])
    """

    def __init__(self) -> None:
        super().__init__(_NoSanitizerPart())

    def __call__(self, start: Tensor, trained: Tensor, generator: Optional[torch.Generator] = None) -> Tensor:
        return super().__call__(start, trained, generator).clone()  # a copy, as before: callers may modify it

    def __repr__(self) -> str:
        return "Unsanitized()"


class EuclideanLaplaceSanitizer(PartRelease):
    """The seed's release, the round's :class:`~lightning_dp.federated.parts.EuclideanLaplace`: ``trained + rho``,
    ``rho`` Euclidean Laplace with expected norm ``nu ||delta||`` (per layer: ``nu ||delta_l||``).

    One SGD step gives ``delta = -lr g``, so the attacker's gradient estimate carries noise of expected norm
    ``nu ||g||`` whatever ``lr`` is (formula and guarantee: :func:`lightning_dp.privacy.mechanisms.sanitize_update`).

    Args:
        noise_multiplier: ``nu >= 0``; 0 releases the trained model (no noise).
        per_layer: sanitize each parameter tensor separately (needs ``layer_sizes``).
        min_delta_norm: floor on the update norm used for calibration (0 refuses a client whose update is zero).
        layer_sizes: the sizes ``n_l`` of the parameter tensors, in flat order (:meth:`for_model`).

    Example:
        >>> from lightning_dp.audit._common import flatten_parameters
        >>> model = nn.Linear(3, 2)
        >>> sanitizer = EuclideanLaplaceSanitizer.for_model(model, 1.0)
        >>> start = flatten_parameters(model)
        >>> sanitizer(start, start + 0.1, torch.Generator().manual_seed(0)).shape
        torch.Size([8])
    """

    def __init__(self, noise_multiplier: float, *, per_layer: bool = True, min_delta_norm: float = 1e-8,
                 layer_sizes: Optional[Sequence[int]] = None) -> None:
        if not isinstance(per_layer, bool):
            raise ValueError(f"per_layer={per_layer!r} must be True or False.")
        if per_layer and layer_sizes is None:
            raise ValueError(
                "per_layer=True needs the sizes of the model's parameter tensors, got layer_sizes=None. Use "
                "EuclideanLaplaceSanitizer.for_model(model, noise_multiplier), or pass layer_sizes="
                "lightning_dp.audit.sanitizers.parameter_sizes(model), or per_layer=False for one release of the whole vector.")
        super().__init__(EuclideanLaplace(noise_multiplier, per_layer=per_layer, min_delta_norm=min_delta_norm),
                         layer_sizes)
        self.noise_multiplier, self.per_layer = self.part.noise_multiplier, per_layer  # type: ignore[attr-defined]
        self.min_delta_norm = self.part.min_delta_norm  # type: ignore[attr-defined]

    @classmethod
    def for_model(cls, model: nn.Module, noise_multiplier: float, *, per_layer: bool = True,
                  min_delta_norm: float = 1e-8) -> EuclideanLaplaceSanitizer:
        """The sanitizer of ``model``'s releases (layer sizes from its trainable parameters)."""
        return cls(noise_multiplier, per_layer=per_layer, min_delta_norm=min_delta_norm,
                   layer_sizes=parameter_sizes(model))

    def __repr__(self) -> str:
        return (f"EuclideanLaplaceSanitizer(noise_multiplier={self.noise_multiplier!r}, per_layer={self.per_layer}, "
                f"min_delta_norm={self.min_delta_norm!r})")


class GaussianSanitizer(PartRelease):
    """DP-SGD for one example: clip the update-implied gradient to ``C``, add ``N(0, (sigma C)^2 I)``.

    Abadi et al. 2016, Algorithm 1 with a batch of one: the update ``trained - start = -lr g`` gives the gradient
    ``g``, clipped to norm ``C`` and noised with ``N(0, (sigma C)^2 I)``; the release is ``start - lr (clip(g) +
    noise)``, so the attacker's gradient estimate is exactly the noisy clipped gradient. That is the round's
    :class:`~lightning_dp.federated.parts.GaussianLocalDP` on the update with clip ``lr C`` and the same ``sigma``
    (:class:`~lightning_dp.federated.parts.ClipSanitizer` for ``sigma = 0``); with ``lr=1`` it is DP-FedAvg's update
    clipping (McMahan et al., ICLR 2018).

    Args:
        max_grad_norm: the clipping norm ``C > 0``.
        noise_multiplier: ``sigma >= 0`` (noise std over ``C``); 0 clips without noise.
        lr: the client's learning rate, the same as in :func:`client_release`.

    Example:
        >>> sanitizer = GaussianSanitizer(1.0, 0.0, lr=0.5)  # clipping only
        >>> sanitizer(torch.zeros(2), torch.tensor([3.0, 4.0]), None)  # g = (-6, -8), clipped to norm 1
        tensor([0.3000, 0.4000])
    """

    def __init__(self, max_grad_norm: float, noise_multiplier: float, *, lr: float = 1.0) -> None:
        self.max_grad_norm = check_max_grad_norm(max_grad_norm)
        self.noise_multiplier = checks.non_negative_real(
            "noise_multiplier", noise_multiplier, hint="sigma, the Gaussian noise std over the clipping norm C (0 "
            "clips without noise); pass e.g. 1.0")
        self.lr = checks.positive_real("lr", lr, hint="pass the client's learning rate, as in client_release(lr=...)")
        clip = self.lr * self.max_grad_norm
        part: ClientSanitizer = (GaussianLocalDP(self.noise_multiplier, clip=clip) if self.noise_multiplier > 0
                                 else ClipSanitizer(clip))
        super().__init__(part)

    def __call__(self, start: Tensor, trained: Tensor, generator: Optional[torch.Generator]) -> Tensor:
        if self.noise_multiplier > 0:
            generator = checks.generator("generator", generator, device=start.device)
        return super().__call__(start, trained, generator)

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


def _renamed(module: str) -> type:
    """The audit's release under its former name ``NoSanitizer``, warned (one NoSanitizer: the round's part)."""
    import warnings

    warnings.warn(f"{module}.NoSanitizer is now {module}.Unsanitized (the federated part keeps the name NoSanitizer)",
                  FutureWarning, stacklevel=3)
    return Unsanitized


def __getattr__(name: str) -> type:
    if name == "NoSanitizer":
        return _renamed(__name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
