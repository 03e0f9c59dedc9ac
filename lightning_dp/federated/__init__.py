"""Personalized federated learning with metric privacy (Galli et al.): the round's pieces.

- :mod:`~lightning_dp.federated.local`: hypothesis choice and local SGD, vectorized over clients.
- :mod:`~lightning_dp.federated.kmeans`: clustered averaging of the released models.
- :mod:`~lightning_dp.federated.parts`: the parts a round is assembled from, registered by name.
- :class:`FederatedRound`: the round as a LightningModule, from parts.
- :class:`PersonalizedFederatedModule`: the personalized algorithm of Galli et al. (a preset).
"""

from lightning_dp.federated.kmeans import kmeans_aggregate
from lightning_dp.federated.local import FlatParams, choose_hypotheses, client_losses, local_sgd, local_sgd_loop
from lightning_dp.federated.module import PersonalizedFederatedModule
from lightning_dp.federated.round import FederatedRound

__all__ = ["FederatedRound", "FlatParams", "PersonalizedFederatedModule", "choose_hypotheses", "client_losses", "kmeans_aggregate", "local_sgd", "local_sgd_loop"]
