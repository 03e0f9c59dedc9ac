"""The parts a federated round is assembled from, each registered by kind and name (:mod:`.registry`).

- selection: :class:`UniformSelection` (``"uniform"``), :class:`PoissonSelection` (``"poisson"``);
- update: :class:`LocalSGD` (``"local_sgd"``, vectorized over clients or looped), :class:`LocalDPSGD`
  (``"local_dp_sgd"``, record-level DP-SGD inside every client with a per-client accountant);
- sanitizer: :class:`NoSanitizer` (``"none"``), :class:`EuclideanLaplace` (``"euclidean_laplace"``, d-privacy),
  :class:`ClipSanitizer` (``"clip"``), :class:`GaussianLocalDP` (``"gaussian_ldp"``), :class:`LaplaceLocalDP`
  (``"laplace_ldp"``), :class:`SectorSanitizer` (``"sector"``: upper, lower and angular clipping);
- aggregator: :class:`KMeans` (``"kmeans"``, clustered), :class:`FedAvg` (``"fedavg"``), :class:`PFA`
  (``"pfa"``, projected federated averaging with a direct or budget-agnostic public/private split);
- server_privacy: :class:`NoServerPrivacy` (``"none"``), :class:`CentralGaussian` (``"gaussian"``,
  client-level DP-FedAvg with fixed or adaptive clipping, accounted).
"""

from lightning_dp.federated.parts.aggregators import PFA, Aggregator, FedAvg, KMeans
from lightning_dp.federated.parts.registry import KINDS, Combination, Part, register_part, registered_parts, resolve_part
from lightning_dp.federated.parts.sanitizers import (
    ClientSanitizer,
    ClipSanitizer,
    EuclideanLaplace,
    GaussianLocalDP,
    LaplaceLocalDP,
    NoSanitizer,
    SectorSanitizer,
    choice_spread,
)
from lightning_dp.federated.parts.selection import ClientSelection, PoissonSelection, UniformSelection
from lightning_dp.federated.parts.server_privacy import CentralGaussian, NoServerPrivacy, RoundReleases, ServerPrivacy
from lightning_dp.federated.parts.update import AUTO_VMAP_MAX_PARAMETERS, ClientUpdate, LocalDPSGD, LocalSGD

__all__ = [
    "AUTO_VMAP_MAX_PARAMETERS", "Aggregator", "CentralGaussian", "ClientSanitizer", "ClientSelection", "ClientUpdate",
    "ClipSanitizer", "Combination", "EuclideanLaplace", "FedAvg", "GaussianLocalDP", "KINDS", "KMeans", "LaplaceLocalDP", "LocalDPSGD", "LocalSGD",
    "NoSanitizer", "NoServerPrivacy", "PFA", "Part", "PoissonSelection", "RoundReleases", "SectorSanitizer",
    "ServerPrivacy",
    "UniformSelection", "choice_spread", "register_part", "registered_parts", "resolve_part",
]
