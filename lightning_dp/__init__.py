"""lightning-dp: differentially private and personalized federated learning for PyTorch Lightning.

What a user imports from the top level (each name loads its subpackage on first use, so ``import lightning_dp``
stays light, as the command line needs)::

    from lightning_dp import DPSGD, OnlineSensitivity, QuantileClipping     # DP-SGD as a Trainer callback
    from lightning_dp import OneRunAudit, RestoreBestWeights                 # audits, best-checkpoint restore
    from lightning_dp import FederatedRound, PersonalizedFederatedModule     # federated rounds from parts
    from lightning_dp import MLFlowLogger                                    # MLflow with the project's defaults
    from lightning_dp import calibrate_noise_multiplier, get_accountant      # accounting

Everything else lives in its subpackage: ``lightning_dp.privacy`` (the functional core), ``callbacks``,
``federated`` (and ``federated.parts``), ``datamodules``, ``models``, ``metrics``, ``audit``, ``tracking``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_API = {
    "DPSGD": "lightning_dp.callbacks",
    "OnlineSensitivity": "lightning_dp.callbacks",
    "QuantileClipping": "lightning_dp.callbacks",
    "OneRunAudit": "lightning_dp.callbacks",
    "RestoreBestWeights": "lightning_dp.callbacks",
    "FederatedRound": "lightning_dp.federated",
    "PersonalizedFederatedModule": "lightning_dp.federated",
    "MLFlowLogger": "lightning_dp.tracking",
    "calibrate_noise_multiplier": "lightning_dp.privacy",
    "get_accountant": "lightning_dp.privacy",
}

__all__ = ["__version__", *sorted(_API)]

if TYPE_CHECKING:  # what type checkers and IDEs see; at run time the names load lazily (below)
    from lightning_dp.callbacks import DPSGD, OneRunAudit, OnlineSensitivity, QuantileClipping, RestoreBestWeights
    from lightning_dp.federated import FederatedRound, PersonalizedFederatedModule
    from lightning_dp.privacy import calibrate_noise_multiplier, get_accountant
    from lightning_dp.tracking import MLFlowLogger


def __getattr__(name: str) -> Any:
    """PEP 562: the public names above, imported from their subpackage when first used."""
    if name in _API:
        value = getattr(importlib.import_module(_API[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'lightning_dp' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_API))
