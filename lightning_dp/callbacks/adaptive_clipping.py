"""OSO-DPSGD and quantile clipping as ready-made callbacks: :class:`~lightning_dp.callbacks.DPSGD` with a strategy.

``OnlineSensitivity(...)`` is ``DPSGD(clipping=OnlineSensitivityClip(...), ...)`` and ``QuantileClipping(...)`` is
``DPSGD(clipping=QuantileClip(...), ...)``, with the strategy's arguments at the top level of the callback. The rules
(:mod:`lightning_dp.callbacks.clipping`, :mod:`lightning_dp.privacy.adaptive`) and an example: docs/privacy.md,
"Adaptive clipping".
"""

from __future__ import annotations

from typing import Any

from lightning_dp.callbacks.clipping import (
    QUANTILE_CLIP_LR,
    QUANTILE_INITIAL_CLIP,
    OnlineSensitivityClip,
    QuantileClip,
)
from lightning_dp.callbacks.dp_sgd import DPSGD
from lightning_dp.privacy.adaptive import OSO_CLIP_LR, OSO_INITIAL_CLIP, OSO_LR_LR

__all__ = ["OnlineSensitivity", "QuantileClipping"]


def _no_max_grad_norm(name: str, kwargs: dict[str, Any]) -> None:
    """Refuses DPSGD's own choice of C (a config parser passes DPSGD's defaults, None and "fixed": dropped)."""
    max_grad_norm, clipping = kwargs.pop("max_grad_norm", None), kwargs.pop("clipping", "fixed")
    if max_grad_norm is not None:
        raise ValueError(f"{name} learns the clipping threshold: pass initial_clip=<C_0> instead of "
                         f"max_grad_norm={max_grad_norm!r}")
    if clipping != "fixed":
        raise ValueError(f"{name} is DPSGD with its own clipping strategy; for clipping={clipping!r} use "
                         "DPSGD(clipping=...) instead")


class OnlineSensitivity(DPSGD):
    """OSO-DPSGD (Galli et al., AAAI 2024; thesis Algorithm 3): DPSGD with the ``online_sensitivity`` strategy.

    C and the learning rate adapt at every step from the signs of two dot products of released vectors
    (:class:`~lightning_dp.callbacks.clipping.OnlineSensitivityClip`); each step is accounted as one Gaussian with
    ``noise_multiplier``. The learning rate ``rho_0`` is your optimizer's: with a learning-rate scheduler, pass
    ``lr_lr=0``. Logged: as DPSGD plus ``privacy/max_grad_norm`` (``C_t``) and ``train/lr`` (``rho_t``); the artifact
    ``privacy/max_grad_norm.png``. ``C_t``, ``rho_t`` and the previous releases are checkpointed.

    Args:
        noise_multiplier: ``nu``, the overall per-step multiplier the accountant records (or calibrated).
        target_epsilon: the budget (enforced as in :class:`DPSGD`).
        initial_clip: ``C_0`` (default 0.1).
        clip_lr: ``rho_c``, the step of ``log C`` (default 2.5e-3).
        lr_lr: ``rho_r``, the step of ``log rho`` (default 2.5e-3); 0 keeps the optimizer's learning rate.
        q_noise_multiplier: ``nu_q`` (> ``nu``); default ``7.124 nu`` (``nu_g = 1.01 nu``).
        **kwargs: the other arguments of :class:`DPSGD`, not ``max_grad_norm`` (use ``initial_clip``).
    """

    def __init__(self, *, noise_multiplier: float | None = None, target_epsilon: float | None = None,
                 initial_clip: float = OSO_INITIAL_CLIP, clip_lr: float = OSO_CLIP_LR, lr_lr: float = OSO_LR_LR,
                 q_noise_multiplier: float | None = None, **kwargs: Any) -> None:
        _no_max_grad_norm("OnlineSensitivity", kwargs)
        strategy = OnlineSensitivityClip(initial_clip=initial_clip, clip_lr=clip_lr, lr_lr=lr_lr,
                                         q_noise_multiplier=q_noise_multiplier)
        # max_grad_norm and clipping given here keep them out of the signature a config parser reads
        super().__init__(noise_multiplier=noise_multiplier, target_epsilon=target_epsilon, max_grad_norm=None,
                         clipping=strategy, **kwargs)
        self.clipping: OnlineSensitivityClip

    @property
    def initial_clip(self) -> float:
        return self.clipping.initial_clip

    @property
    def clip_lr(self) -> float:
        return self.clipping.clip_lr

    @property
    def lr_lr(self) -> float:
        return self.clipping.lr_lr

    @property
    def q_noise_multiplier(self) -> float | None:
        """``nu_q`` (None until the noise multiplier is known)."""
        nu = self.noise_multiplier
        return None if nu is None else self.clipping.noise_split(nu)[1]

    @property
    def gradient_noise_multiplier(self) -> float | None:
        """``nu_g``, the multiplier of the gradient noise (None until the noise multiplier is known)."""
        nu = self.noise_multiplier
        return None if nu is None else self.clipping.noise_split(nu)[0]

    @property
    def lr_scale(self) -> float:
        """``rho_t / rho_0``."""
        return self.clipping.lr_scale


class QuantileClipping(DPSGD):
    """Quantile clipping (Andrew et al., NeurIPS 2021; the thesis' FixedQuantile): DPSGD with the ``quantile``
    strategy (:class:`~lightning_dp.callbacks.clipping.QuantileClip`).

    C tracks the ``target_quantile`` of the per-example gradient norms from a noisy count; the clipped sum's noise is
    ``z_Delta = (z^-2 - (2 sigma_b)^-2)^(-1/2)`` so that each step is accounted with ``z`` (``noise_multiplier``).
    Logged: as DPSGD plus ``privacy/max_grad_norm`` and ``privacy/unclipped_fraction_estimate``; the artifact
    ``privacy/max_grad_norm.png``. C is checkpointed.

    Args:
        noise_multiplier: ``z``, the overall multiplier the accountant records (or calibrated).
        target_epsilon: the budget (enforced as in :class:`DPSGD`).
        initial_clip: ``C_0`` (default 0.1).
        target_quantile: ``gamma`` in [0, 1] (default 0.5): the fraction of examples left unclipped.
        clip_lr: ``eta_C`` (default 0.2).
        count_noise_std: ``sigma_b``; default ``m / 20`` (Andrew et al.). Must exceed ``z / 2``.
        **kwargs: the other arguments of :class:`DPSGD`, not ``max_grad_norm``.
    """

    def __init__(self, *, noise_multiplier: float | None = None, target_epsilon: float | None = None,
                 initial_clip: float = QUANTILE_INITIAL_CLIP, target_quantile: float = 0.5,
                 clip_lr: float = QUANTILE_CLIP_LR, count_noise_std: float | None = None, **kwargs: Any) -> None:
        _no_max_grad_norm("QuantileClipping", kwargs)
        strategy = QuantileClip(initial_clip=initial_clip, target_quantile=target_quantile, clip_lr=clip_lr,
                                count_noise_std=count_noise_std)
        # max_grad_norm and clipping given here keep them out of the signature a config parser reads
        super().__init__(noise_multiplier=noise_multiplier, target_epsilon=target_epsilon, max_grad_norm=None,
                         clipping=strategy, **kwargs)
        self.clipping: QuantileClip

    @property
    def initial_clip(self) -> float:
        return self.clipping.initial_clip

    @property
    def target_quantile(self) -> float:
        return self.clipping.target_quantile

    @property
    def clip_lr(self) -> float:
        return self.clipping.clip_lr

    @property
    def count_noise_std(self) -> float | None:
        """``sigma_b`` (None until the expected batch size is known, when it is the default)."""
        return self.clipping.count_noise_std(self._expected_batch_size())

    @property
    def gradient_noise_multiplier(self) -> float | None:
        """``z_Delta``, the multiplier of the gradient noise (None until known)."""
        z = self.noise_multiplier
        return None if z is None else self.clipping.split(z, self._expected_batch_size())

    def _expected_batch_size(self) -> float | None:
        facts = self.data_facts
        return None if facts is None else facts.expected_batch_size
