"""``lightning-dp fit``, ``validate`` and ``test``: :class:`~lightning_dp.config.lightning_cli.LightningDPCLI`
(LightningCLI with MLflow tracking), which :mod:`lightning_dp.cli` runs.

The class lives in :mod:`lightning_dp.config.lightning_cli`, below the commands, because the grid and the Flower
apps build configs with it too; it is imported from here as before.
"""

from lightning_dp.config.lightning_cli import (
    DEFAULT_LOGGER,
    LightningDPCLI,
    MLflowSaveConfigCallback,
    quiet_third_party,
)

__all__ = ["DEFAULT_LOGGER", "LightningDPCLI", "MLflowSaveConfigCallback", "quiet_third_party"]
