"""How aligned are the clients' updates? (Galli, thesis Fig. 5.4.)

The sector sanitizer (:mod:`lightning_dp.privacy.local_dp`) pays off when the updates of a
round point in similar directions. These functions measure it: the mean pairwise cosine
similarity of a set of vectors, and per-sample gradients of a model (the centralized
counterpart: the gradients of single examples, whose directions DP-SGD clips). Both are
computed on unsanitized values: the round logs them as ``nonprivate/*`` metrics, for
analysis, never as a release.
"""

from __future__ import annotations

from torch import Tensor, nn
from torch.func import grad, vmap

from lightning_dp.federated.local import FlatParams, example_loss

__all__ = ["mean_pairwise_cosine", "per_sample_gradients"]


def mean_pairwise_cosine(vectors: Tensor) -> float:
    """Mean of ``cos(v_i, v_j)`` over the ordered pairs ``i != j`` of the rows of ``vectors`` (n, P).

    Rows of norm 0 have no direction and are left out; NaN when fewer than two rows are left.
    Computed as ``(||sum_i u_i||^2 - n) / (n (n - 1))`` with ``u_i`` the unit rows, in float64
    (no n x n matrix).
    """
    v = vectors.detach().double().flatten(1)
    norms = v.norm(dim=1)
    u = v[norms > 0] / norms[norms > 0, None]
    n = u.shape[0]
    if n < 2:
        return float("nan")
    return float((u.sum(0).square().sum() - n) / (n * (n - 1)))


def per_sample_gradients(template: nn.Module, spec: FlatParams, theta: Tensor, x: Tensor, y: Tensor,
                         loss: str) -> Tensor:
    """Gradients ``(n, P)`` of the loss of each example ``(x[i], y[i])`` at the flat parameters ``theta``.

    ``theta`` is one vector ``(P,)`` or one per example ``(n, P)`` (each example's own model,
    e.g. the hypothesis its client started from). One ``vmap`` of ``grad`` over examples.
    """
    per_example = theta.dim() == 2
    return vmap(grad(example_loss(template, spec, loss)), in_dims=(0 if per_example else None, 0, 0),
                randomness="different")(theta, x, y)
