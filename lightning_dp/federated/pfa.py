"""Projected federated averaging (PFA; Liu, Lou, Xiong, Liu & Meng, VLDB 2022) and the public/private split.

The private clients' mean is projected, per layer, on the top-k right singular vectors of the public clients'
updates (``torch.linalg.svd`` in float64) and averaged with the public mean; PFA+ uses the previous round's
basis. The split: :func:`split_by_budgets` (revealed budgets) or :func:`split_by_norms` (a 2-component Gaussian
mixture on the noisy updates' norms). The formulas and why it works: docs/federated.md, "Personal budgets and
projected averaging".
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

__all__ = ["Subspace", "pfa_combine", "split_by_budgets", "split_by_norms", "top_subspace"]


class Subspace(NamedTuple):
    """A round's projection target: per-layer orthonormal ``bases`` (d_l, k) and the ``origin`` (P,) the affine
    subspace passes through (zeros unless centred)."""

    bases: list[Tensor]
    origin: Tensor


def top_subspace(rows: Tensor, k: int) -> Tensor:
    """``(d, k')`` orthonormal basis of the top-k eigenvectors of ``rows^T rows``, ``k' = min(k, n, d)``.

    Example:
        >>> u = torch.tensor([[3.0, 0.0, 0.0], [0.0, 1.0, 0.0]])
        >>> top_subspace(u, 1).abs().flatten().tolist()
        [1.0, 0.0, 0.0]
    """
    if rows.dim() != 2:
        raise ValueError(f"rows must be (n, d), got shape {tuple(rows.shape)}")
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k={k!r} is not allowed: pass the number of eigenvectors, a positive integer")
    _, _, vh = torch.linalg.svd(rows.double(), full_matrices=False)
    return vh[: min(k, vh.shape[0])].T


def pfa_combine(updates: Tensor, public: Tensor, *, layer_sizes: Sequence[int], k: int = 1,
                weights: Tensor | None = None, previous: Subspace | None = None, centered: bool = False
                ) -> tuple[Tensor, Subspace | None]:
    """The PFA aggregate of one round's updates, and the subspace of this round's public updates.

    Args:
        updates: ``(m, P)`` released updates (release minus the global model).
        public: ``(m,)`` bool, the public clients.
        layer_sizes: the sizes of the parameter tensors, in the flat order (the projection is per layer).
        k: eigenvectors per layer.
        weights: ``(m,)`` client weights (WeiPFA: the epsilons); None: every client 1, so the groups weigh
            by their sizes.
        previous: project the private updates on this subspace (PFA+: the previous round's, bases and origin)
            instead of this round's.
        centered: PFA's code (``Pfizer`` in ``modules/server.py``): the eigenvectors of the public updates'
            covariance (centred at their mean) and an affine projection through that mean,
            ``mean_pub + V V^T (m_priv - mean_pub)``; default: the second-moment matrix and a projection
            through 0 (the seed's Algorithm 1). With a single public client there is nothing to centre (the
            centred update is 0 and its eigenvectors arbitrary): as PFA's ``__standardize``, the projection then
            goes through 0 on that client's update.

    Returns:
        ``(P,)`` the aggregated update and this round's :class:`Subspace` (None without public clients). Without
        public clients the private updates are averaged as they are (nothing to project on); without private
        ones, the public average.
    """
    if updates.dim() != 2 or public.shape != updates.shape[:1]:
        raise ValueError(f"updates {tuple(updates.shape)} and public {tuple(public.shape)} must be (m, P) and (m,)")
    if sum(layer_sizes) != updates.shape[1]:
        raise ValueError(f"layer_sizes sum to {sum(layer_sizes)}, the updates have {updates.shape[1]} parameters")
    w = (torch.ones(updates.shape[0], dtype=torch.float64, device=updates.device) if weights is None
         else weights.double().to(updates.device))
    if bool((w < 0).any()) or not bool(w.sum() > 0):
        raise ValueError("weights must be >= 0 with a positive sum")
    x = updates.double()
    pub, priv = public.bool(), ~public.bool()
    w_pub, w_priv = w[pub].sum(), w[priv].sum()
    mean_pub = (w[pub, None] * x[pub]).sum(0) / w_pub if bool(pub.any()) else None
    mean_priv = (w[priv, None] * x[priv]).sum(0) / w_priv if bool(priv.any()) else None
    if mean_pub is None:
        assert mean_priv is not None  # the weights have a positive sum: some client is public or private
        return mean_priv.to(updates.dtype), None
    # Unweighted, as PFA's code; one public client: through 0 (its __standardize returns the matrix as it is).
    origin = x[pub].mean(0) if centered and int(pub.sum()) > 1 else torch.zeros_like(mean_pub)
    current = Subspace([top_subspace(chunk, k) for chunk in torch.split(x[pub] - origin, list(layer_sizes), dim=1)],
                       origin)
    if mean_priv is None:
        return mean_pub.to(updates.dtype), current
    use = current if previous is None else Subspace([b.to(x.device, torch.float64) for b in previous.bases],
                                                    previous.origin.to(x.device, torch.float64))
    offset = mean_priv - use.origin
    projected = use.origin + torch.cat([v @ (v.T @ chunk)
                                        for v, chunk in zip(use.bases, torch.split(offset, list(layer_sizes)))])
    combined = (w_pub * mean_pub + w_priv * projected) / (w_pub + w_priv)
    return combined.to(updates.dtype), current


def split_by_budgets(epsilons: Sequence[float], *, rule: str = "top_fraction", public_fraction: float = 0.1,
                     seed: int = 0) -> np.ndarray:
    """Public (True) / private split from revealed budgets.

    ``top_fraction``: the ``max(1, int(public_fraction * m))`` largest epsilons are public, ties included (PFA's
    code);
    ``gmm``: a 2-component Gaussian mixture on epsilon, the component with the larger mean is public
    (every client public or private when the budgets are all equal).
    """
    eps = np.asarray(epsilons, dtype=np.float64)
    if eps.ndim != 1 or len(eps) == 0 or not np.isfinite(eps).all():
        raise ValueError(f"epsilons must be a non-empty list of finite numbers, got {epsilons!r}")
    if rule == "top_fraction":
        if not 0 < public_fraction <= 1:
            raise ValueError(f"public_fraction={public_fraction!r} must be in (0, 1]")
        # PFA's code (Server.set_public_clients): the threshold is the int(fraction * m)-th largest epsilon, ties
        # included; at least one client
        count = max(1, int(public_fraction * len(eps) + 1e-9))
        return eps >= np.sort(eps)[-count]
    if rule == "gmm":
        return _upper_component(eps, seed)
    raise ValueError(f"rule={rule!r} is not allowed; choose 'top_fraction' or 'gmm'")


def split_by_norms(norms: Sequence[float], *, seed: int = 0) -> np.ndarray:
    """Public (True) / private split of the budget-agnostic method: a 2-component Gaussian mixture on the
    clients' noisy update norms; the component with the LARGER mean norm (more noise) is private."""
    values = np.asarray(norms, dtype=np.float64)
    if values.ndim != 1 or len(values) == 0 or not np.isfinite(values).all():
        raise ValueError(f"norms must be a non-empty list of finite numbers, got {norms!r}")
    return ~_upper_component(values, seed)


def _upper_component(values: np.ndarray, seed: int) -> np.ndarray:
    """Membership of the 2-component GaussianMixture's component with the larger mean (scikit-learn)."""
    from sklearn.mixture import GaussianMixture

    if len(values) < 2 or np.ptp(values) == 0:
        return np.zeros(len(values), dtype=bool)  # one group: nothing to separate
    gmm = GaussianMixture(n_components=2, random_state=seed, n_init=5).fit(values.reshape(-1, 1))
    labels = gmm.predict(values.reshape(-1, 1))
    return labels == int(np.argmax(gmm.means_.ravel()))
