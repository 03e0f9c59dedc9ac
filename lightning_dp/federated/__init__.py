"""Personalized federated learning with metric privacy (Galli et al.): the round's pieces.

- :mod:`~lightning_dp.federated.local`: hypothesis choice and local SGD, vectorized over clients.
- :mod:`~lightning_dp.federated.aggregation`: clustered averaging of the released models.
- :class:`PersonalizedFederatedModule`: the round as a LightningModule.
"""

from lightning_dp.federated.aggregation import kmeans_aggregate
from lightning_dp.federated.local import FlatParams, choose_hypotheses, client_losses, local_sgd, local_sgd_loop
from lightning_dp.federated.module import PersonalizedFederatedModule

__all__ = ["FlatParams", "PersonalizedFederatedModule", "choose_hypotheses", "client_losses", "kmeans_aggregate", "local_sgd", "local_sgd_loop"]
