"""Server-side aggregation of a round (Algorithm 2 of the seed): clustered averaging.

The server sees only the released (sanitized) parameter vectors, neither the clients'
choices nor their sample counts. It runs k-means on the releases, initialized at the
current hypotheses (a single initialization), and each hypothesis becomes the mean of its
cluster; a hypothesis whose cluster is empty is kept unchanged.

Why hand-written: scikit-learn's KMeans relocates empty clusters to far-away points, which
is not the algorithm; here an empty cluster keeps its centroid. Lloyd iterations are a few
lines of tensor code and stay deterministic (ties go to the lowest index).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["kmeans_aggregate"]


def kmeans_aggregate(releases: Tensor, hypotheses: Tensor, *, max_iter: int = 100) -> tuple[Tensor, Tensor]:
    """Lloyd's k-means on ``releases`` (U, P) started at ``hypotheses`` (k, P).

    Returns:
        ``(new_hypotheses, assignment)``: (k, P) cluster means (an empty cluster keeps its
        hypothesis from the start of the round), and (U,) the cluster of each release.

    Example:
        >>> r = torch.tensor([[0.0], [0.2], [9.8], [10.0]])
        >>> h, a = kmeans_aggregate(r, torch.tensor([[1.0], [8.0], [100.0]]))
        >>> [round(v, 3) for v in h.flatten().tolist()], a.tolist()
        ([0.1, 9.9, 100.0], [0, 0, 1, 1])
    """
    if releases.dim() != 2 or hypotheses.dim() != 2 or releases.shape[1] != hypotheses.shape[1]:
        raise ValueError(f"releases {tuple(releases.shape)} and hypotheses {tuple(hypotheses.shape)} must be "
                         "(U, P) and (k, P)")
    k = hypotheses.shape[0]
    centroids = hypotheses.clone()
    assignment = torch.full((releases.shape[0],), -1, dtype=torch.long, device=releases.device)
    if releases.shape[0] == 0:
        return centroids, assignment
    for _ in range(max_iter):
        new = torch.cdist(releases.double(), centroids.double()).argmin(dim=1)
        if torch.equal(new, assignment):
            break
        assignment = new
        counts = torch.bincount(assignment, minlength=k)
        sums = torch.zeros_like(centroids).index_add_(0, assignment, releases)
        filled = counts > 0
        centroids[filled] = sums[filled] / counts[filled].unsqueeze(1).to(sums.dtype)
    counts = torch.bincount(assignment, minlength=k)
    centroids[counts == 0] = hypotheses[counts == 0]
    return centroids, assignment
