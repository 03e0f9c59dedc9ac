"""Clustered aggregation against scikit-learn's Lloyd k-means and by hand."""

import numpy as np
import pytest
import torch
from sklearn.cluster import KMeans

from lightning_dp.federated import kmeans_aggregate


@pytest.mark.parametrize("seed", range(5))
def test_matches_sklearn_lloyd_with_the_same_initialization(seed):
    g = torch.Generator().manual_seed(seed)
    centers = torch.tensor([[5.0, 6.0], [4.0, -4.5], [-3.0, 0.0]], dtype=torch.float64)
    releases = centers[torch.randint(0, 3, (60,), generator=g)] + torch.randn(60, 2, generator=g, dtype=torch.float64)
    init = centers + torch.randn(3, 2, generator=g, dtype=torch.float64)
    ours, assignment = kmeans_aggregate(releases, init)
    km = KMeans(3, init=init.numpy(), n_init=1, algorithm="lloyd", tol=0, max_iter=300).fit(releases.numpy())
    np.testing.assert_allclose(ours.numpy(), km.cluster_centers_, rtol=1e-10)
    assert assignment.tolist() == km.labels_.tolist()


def test_empty_cluster_keeps_its_hypothesis():
    releases = torch.tensor([[0.0, 0.0], [1.0, 0.0], [0.0, 1.0]])
    hyps = torch.tensor([[0.3, 0.3], [50.0, 50.0]])
    new, assignment = kmeans_aggregate(releases, hyps)
    assert assignment.tolist() == [0, 0, 0]
    torch.testing.assert_close(new[0], releases.mean(0))
    assert torch.equal(new[1], hyps[1])


def test_no_releases_keeps_all_hypotheses():
    hyps = torch.randn(2, 4)
    new, assignment = kmeans_aggregate(torch.zeros(0, 4), hyps)
    assert torch.equal(new, hyps) and assignment.numel() == 0


def test_shape_errors():
    with pytest.raises(ValueError, match="must be"):
        kmeans_aggregate(torch.zeros(3, 2), torch.zeros(2, 3))
