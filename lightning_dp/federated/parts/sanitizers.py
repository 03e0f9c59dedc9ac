"""Client sanitizers: what a client releases of its trained model, and what one release costs it."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from lightning_dp.federated.parts.registry import Part, register_part
from lightning_dp.privacy.mechanisms import SanitizedUpdate, sanitize_update

__all__ = ["ClientSanitizer", "EuclideanLaplace", "NoSanitizer"]


class ClientSanitizer(Part):
    """Turns a client's trained model into its release.

    ``sanitize`` returns the released parameter vector and the participation's cost, which
    the round charges to the client's ledger when :attr:`accountable` (a d-privacy ledger:
    costs add up over participations, :class:`~lightning_dp.privacy.ledger.PrivacyLedger`).
    """

    #: whether releases cost privacy that the round must charge to the clients' ledgers
    accountable = False

    def participation_cost(self, numel: int) -> float:
        """The cost of one participation for a model of ``numel`` parameters (inf: unprotected)."""
        return math.inf

    def sanitize(self, trained: Tensor, start: Tensor, *, generator: torch.Generator,
                 layer_sizes: list[int]) -> SanitizedUpdate:
        raise NotImplementedError


@register_part("sanitizer", "none")
class NoSanitizer(ClientSanitizer):
    """Releases the trained model as it is: no privacy from the client (e.g. under central DP, or a baseline)."""

    def sanitize(self, trained, start, *, generator, layer_sizes):
        return SanitizedUpdate(released=trained, epsilon=math.inf, cost=math.inf)


@register_part("sanitizer", "euclidean_laplace")
class EuclideanLaplace(ClientSanitizer):
    """Metric privacy (Galli et al., "Group privacy for personalized FL"): ``released = trained + Laplace_d``.

    The noise is Euclidean Laplace with ``epsilon = n / (nu ||delta||)``, ``delta`` the update from
    the client's starting model, so its expected norm is ``nu ||delta||``; one release costs
    ``n / nu`` with respect to the client's ``||delta||``-neighbourhood, and a client's costs add
    up over participations (:func:`~lightning_dp.privacy.mechanisms.sanitize_update`). Not an
    (epsilon, delta)-DP guarantee (docs/privacy.md).

    Args:
        noise_multiplier: nu; 0 releases the models unsanitized (a baseline; nothing is charged).
        per_layer: every parameter tensor gets its own epsilon (n_l, delta_l); the same total cost.
        min_delta_norm: the noise is calibrated to ``max(||delta||, min_delta_norm)``.
    """

    def __init__(self, noise_multiplier: float = 1.0, per_layer: bool = False, min_delta_norm: float = 1e-8) -> None:
        if not (float(noise_multiplier) >= 0 and math.isfinite(float(noise_multiplier))):
            raise ValueError(f"noise_multiplier={noise_multiplier!r} is not allowed: nu must be >= 0 (0 = no "
                             "sanitization); the seed's experiments use 0.1 to 5")
        if not (float(min_delta_norm) >= 0 and math.isfinite(float(min_delta_norm))):
            raise ValueError(f"min_delta_norm={min_delta_norm!r} is not allowed: pass a finite number >= 0")
        self.noise_multiplier, self.per_layer = float(noise_multiplier), bool(per_layer)
        self.min_delta_norm = float(min_delta_norm)
        self.accountable = self.noise_multiplier > 0

    def hparams(self) -> dict[str, Any]:
        return {"noise_multiplier": self.noise_multiplier, "per_layer": self.per_layer}

    def participation_cost(self, numel: int) -> float:
        return math.inf if self.noise_multiplier == 0 else numel / self.noise_multiplier

    def sanitize(self, trained, start, *, generator, layer_sizes):
        return sanitize_update(trained, start, noise_multiplier=self.noise_multiplier, generator=generator,
                               per_layer_sizes=layer_sizes if self.per_layer else None,
                               min_delta_norm=self.min_delta_norm)
