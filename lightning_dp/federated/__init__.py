"""Personalized federated learning with metric privacy (Galli et al.): the round and its parts.

:class:`FederatedRound` (the round, from parts) and :class:`PersonalizedFederatedModule` (the preset). Each name
loads its module on first use, so :mod:`lightning_dp.federated.parts` works without Lightning. The modules:
docs/federated.md, "One round, step by step".
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_API = {
    "FederatedRound": "lightning_dp.federated.round",
    "PersonalizedFederatedModule": "lightning_dp.federated.module",
}
#: importable from here as before, documented in their modules (not the package's API)
_MODULE_NAMES = {
    "FlatParams": "lightning_dp.federated.local",
    "choose_hypotheses": "lightning_dp.federated.local",
    "client_losses": "lightning_dp.federated.local",
    "local_sgd": "lightning_dp.federated.local",
    "local_sgd_loop": "lightning_dp.federated.local",
    "kmeans_aggregate": "lightning_dp.federated.kmeans",
}

__all__ = sorted(_API)

if TYPE_CHECKING:
    from lightning_dp.federated.kmeans import kmeans_aggregate
    from lightning_dp.federated.local import FlatParams, choose_hypotheses, client_losses, local_sgd, local_sgd_loop
    from lightning_dp.federated.module import PersonalizedFederatedModule
    from lightning_dp.federated.round import FederatedRound


def __getattr__(name: str) -> Any:
    """PEP 562: the names above, imported from their module when first used."""
    module = _API.get(name) or _MODULE_NAMES.get(name)
    if module is None:
        raise AttributeError(f"module 'lightning_dp.federated' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_API) | set(_MODULE_NAMES))
