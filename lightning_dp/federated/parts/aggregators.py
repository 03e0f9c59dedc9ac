"""Aggregators: how the server turns the round's releases into the next hypotheses."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lightning_dp.federated.aggregation import kmeans_aggregate
from lightning_dp.federated.parts.registry import Part, register_part

__all__ = ["Aggregator", "FedAvg", "KMeans"]


class Aggregator(Part):
    """Combines the releases ``(U, P)`` of a round with the current hypotheses ``(k, P)``."""

    def aggregate(self, releases: Tensor, hypotheses: Tensor, weights: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """``(new hypotheses (k, P), cluster of each release (U,))``."""
        raise NotImplementedError


@register_part("aggregator", "kmeans")
class KMeans(Aggregator):
    """Clustered averaging (Algorithm 2 of the seed): k-means on the releases, started at the hypotheses;
    each hypothesis becomes its cluster's mean; an empty cluster keeps its hypothesis."""

    def __init__(self, max_iter: int = 100) -> None:
        if isinstance(max_iter, bool) or not isinstance(max_iter, int) or max_iter < 1:
            raise ValueError(f"max_iter={max_iter!r} must be a positive integer")
        self.max_iter = max_iter

    def aggregate(self, releases, hypotheses, weights=None):
        return kmeans_aggregate(releases, hypotheses, max_iter=self.max_iter)


@register_part("aggregator", "fedavg")
class FedAvg(Aggregator):
    """Federated averaging (McMahan et al. 2017): the one hypothesis becomes the mean of the releases.

    Args:
        weighted: weight each release by its client's number of examples (the original FedAvg).
            Under central DP the weights must not depend on the data: the round refuses
            ``weighted=True`` with :class:`~lightning_dp.federated.parts.server_privacy.CentralGaussian`.
    """

    def __init__(self, weighted: bool = False) -> None:
        self.weighted = bool(weighted)

    def hparams(self) -> dict[str, Any]:
        return {"fedavg_weighted": self.weighted}

    def aggregate(self, releases, hypotheses, weights=None):
        if hypotheses.shape[0] != 1:
            raise ValueError(f"FedAvg trains one model; the round has {hypotheses.shape[0]} hypotheses "
                             "(num_hypotheses=1, or aggregator 'kmeans' for clustered models)")
        assignment = torch.zeros(releases.shape[0], dtype=torch.long, device=releases.device)
        if releases.shape[0] == 0:
            return hypotheses.clone(), assignment
        if self.weighted and weights is not None:
            w = weights.to(releases.dtype)
            return ((releases * w[:, None]).sum(0) / w.sum())[None], assignment
        return releases.mean(0, keepdim=True), assignment
