"""Deliberately broken privacy components, for checking that audits catch them. Never train with these.

A privacy audit is only worth its cost if it fails loudly on a broken run. :class:`NoiselessDPSGD` is
the classic bug: the gradients are clipped but no noise is added, while the accountant still charges
the configured noise multiplier, so the run reports the epsilon of a private run. The one-run audit
(:class:`~lightning_dp.callbacks.OneRunAudit`) must report a lower bound far above that epsilon.
"""

from __future__ import annotations

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_warn

from lightning_dp.callbacks.dp_sgd import DPSGD
from lightning_dp.privacy.spend import Spend

__all__ = ["NoiselessDPSGD"]


class NoiselessDPSGD(DPSGD):
    """DPSGD that clips but adds NO noise, while accounting (and reporting) epsilon as if it did.

    A fault injection for audits (docs/audit.md); it warns at every fit.
    """

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage == "fit":
            rank_zero_warn("NoiselessDPSGD adds NO noise: its reported epsilon is false. It exists to test audits; "
                           "never use it to train a model you release.")
        super().setup(trainer, pl_module, stage)

    def _gradient_noise_multiplier(self) -> float:
        return 0.0

    def privacy_spend(self) -> list[Spend]:
        """Unsanitized: whatever epsilon the run logs, its releases carry no noise (a grid composes it as infinite)."""
        return [Spend.unprotected(self.accountant.privacy_unit, "NoiselessDPSGD adds no noise")]
