"""The synthetic mixture of linear regressions of "Group privacy for personalized FL".

Galli et al., "Group privacy for personalized federated learning" (thesis ch. 2),
synthetic setting: every client belongs to one of ``k`` groups, group ``c`` having a
true hypothesis ``theta_c*``; a client of group ``c`` holds samples
``y = x^T theta_c* + u`` with ``u ~ U[0, 1)``. The seed uses ``k = 2``,
``theta_1* = [5, 6]`` and ``theta_2* = [4, -4.5]``. A personalized federated
algorithm should recover one model per group without learning who is in which group;
:attr:`SyntheticLinearMixture.cluster_of` keeps the truth for tests and plots.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Literal, Optional

import torch

from lightning_dp.datamodules.base import _check_non_negative_int, _check_positive_int
from lightning_dp.datamodules.federated import (
    ClientDataset,
    FederatedDataModule,
    _block_sizes,
    derived_seed,
)

__all__ = ["DEFAULT_THETAS", "SyntheticLinearMixture"]

#: The two true hypotheses of the seed's synthetic setting.
DEFAULT_THETAS: tuple[tuple[float, ...], ...] = ((5.0, 6.0), (4.0, -4.5))

XDistribution = Literal["normal", "uniform"]


class SyntheticLinearMixture(FederatedDataModule):
    """Clients drawn from a mixture of ``k`` linear models ``y = x^T theta_c* + u`` (regression).

    Each split's clients are assigned to the ``k`` hypotheses in the given
    ``proportions`` (exact counts by largest-remainder rounding, balanced by default),
    in an order drawn from a seeded generator. Each client then draws
    ``samples_per_client`` inputs ``x`` and noises ``u ~ U[noise_range)`` and gets
    ``y = x^T theta_c* + u``. Because ``u`` has mean ``(low + high) / 2`` (0.5 by
    default), least squares with an intercept on one group's samples recovers
    ``theta_c*`` and an intercept of 0.5.

    The input distribution is not stated in the material at hand, so it is an
    argument: ``x_distribution="normal"`` (default) draws ``x ~ N(0, I_d)``, a
    well-conditioned, centred design; ``"uniform"`` draws ``x ~ U[0, 1)^d``.

    Training, validation and test clients are generated the same way from independent
    streams derived from ``seed`` (changing ``num_val_clients`` does not change the
    training clients). Client ids are ``"train-000"``, ``"val-000"``, ``"test-000"``, ...

    After ``setup()``, ``x`` is float32 of shape ``(samples_per_client, d)``, ``y``
    float32 of shape ``(samples_per_client,)``; :attr:`cluster_of` maps every client id
    to its hypothesis index and :attr:`true_thetas` holds the hypotheses, shape ``(k, d)``.

    Args:
        num_clients: Training clients, a positive integer.
        samples_per_client: Samples of every client, a positive integer.
        num_val_clients: Held-out validation clients, a positive integer.
        num_test_clients: Extra held-out test clients (0: ``test_clients`` is empty).
        thetas: The ``k`` true hypotheses, each a list of ``d`` numbers (same ``d`` for all).
        proportions: Share of the clients of each hypothesis (``k`` non-negative numbers,
            normalized to sum to 1); ``None`` for equal shares.
        x_distribution: ``"normal"`` (``N(0, I)``) or ``"uniform"`` (``U[0, 1)^d``).
        noise_range: ``(low, high)`` of the additive uniform noise ``u``, ``low <= high``.
        batch_size: Samples per batch of the centralized loaders.
        num_workers: DataLoader worker processes.
        seed: Seed of the generation and of the training-loader shuffling.

    Raises:
        ValueError: If an argument is outside its range.

    Example:
        >>> dm = SyntheticLinearMixture(num_clients=10, num_val_clients=4, seed=0)
        >>> dm.setup()
        >>> len(dm.train_clients), tuple(dm.train_clients[0].x.shape), dm.summary()["train"]["samples"]
        (10, (10, 2), 100)
        >>> sorted(dm.cluster_of[c.client_id] for c in dm.train_clients)
        [0, 0, 0, 0, 0, 1, 1, 1, 1, 1]
    """

    task = "regression"
    num_classes = None

    def __init__(
        self,
        *,
        num_clients: int = 100,
        samples_per_client: int = 10,
        num_val_clients: int = 20,
        num_test_clients: int = 0,
        thetas: Sequence[Sequence[float]] = DEFAULT_THETAS,
        proportions: Optional[Sequence[float]] = None,
        x_distribution: XDistribution = "normal",
        noise_range: tuple[float, float] = (0.0, 1.0),
        batch_size: int = 64,
        num_workers: int = 0,
        seed: int = 0,
    ) -> None:
        super().__init__(batch_size=batch_size, num_workers=num_workers, seed=seed)
        owner = type(self).__name__
        _check_positive_int("num_clients", num_clients, owner)
        _check_positive_int("samples_per_client", samples_per_client, owner)
        _check_positive_int("num_val_clients", num_val_clients, owner)
        _check_non_negative_int("num_test_clients", num_test_clients, owner)
        self.true_thetas = _validated_thetas(thetas, owner)
        k = self.true_thetas.shape[0]
        self.proportions = _validated_proportions(proportions, k, owner)
        if x_distribution not in ("normal", "uniform"):
            raise ValueError(
                f"{owner}: x_distribution must be 'normal' (x ~ N(0, I)) or 'uniform' (x ~ U[0, 1)^d), "
                f"got {x_distribution!r}"
            )
        try:
            low, high = (float(value) for value in noise_range)
        except (TypeError, ValueError):
            raise ValueError(
                f"{owner}: noise_range must be a pair (low, high) of numbers, got {noise_range!r}"
            ) from None
        if not (math.isfinite(low) and math.isfinite(high) and low <= high):
            raise ValueError(f"{owner}: noise_range must be finite with low <= high, got {noise_range!r}")
        self.save_hyperparameters()
        self.num_clients = num_clients
        self.samples_per_client = samples_per_client
        self.num_val_clients = num_val_clients
        self.num_test_clients = num_test_clients
        self.x_distribution = x_distribution
        self.noise_range = (low, high)
        self.input_shape = (self.true_thetas.shape[1],)
        #: Hypothesis index of every client id (all splits), filled by ``setup()``.
        self.cluster_of: dict[str, int] = {}

    @property
    def num_hypotheses(self) -> int:
        """``k``, the number of true hypotheses."""
        return int(self.true_thetas.shape[0])

    def theta_of(self, client_id: str) -> torch.Tensor:
        """The true hypothesis (float64, shape ``(d,)``) of a client, after ``setup()``."""
        return self.true_thetas[self.cluster_of[client_id]]

    def _generate(self, split: str, count: int) -> list[ClientDataset]:
        generator = torch.Generator().manual_seed(derived_seed(self.seed, "synthetic", split))
        sizes = _block_sizes(count, self.proportions)
        clusters = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
        clusters = clusters[torch.randperm(count, generator=generator)]
        shape = (count, self.samples_per_client, self.input_shape[0])
        if self.x_distribution == "normal":
            x = torch.randn(shape, generator=generator, dtype=torch.float64)
        else:
            x = torch.rand(shape, generator=generator, dtype=torch.float64)
        low, high = self.noise_range
        noise = low + (high - low) * torch.rand(shape[:2], generator=generator, dtype=torch.float64)
        y = torch.einsum("cnd,cd->cn", x, self.true_thetas[clusters]) + noise
        clients = []
        for index in range(count):
            client_id = f"{split}-{index:03d}"
            self.cluster_of[client_id] = int(clusters[index])
            clients.append(ClientDataset(client_id, x[index].to(torch.float32), y[index].to(torch.float32)))
        return clients

    def _build_clients(self) -> tuple[list[ClientDataset], list[ClientDataset], list[ClientDataset]]:
        return (
            self._generate("train", self.num_clients),
            self._generate("val", self.num_val_clients),
            self._generate("test", self.num_test_clients),
        )

    def summary(self) -> dict[str, Any]:
        """:meth:`FederatedDataModule.summary` plus ``clients_per_hypothesis`` per split and ``thetas``."""
        out = super().summary()
        for split in ("train", "val", "test"):
            counts = [0] * self.num_hypotheses
            for client in self.clients(split):
                counts[self.cluster_of[client.client_id]] += 1
            out[split]["clients_per_hypothesis"] = counts
        out["thetas"] = self.true_thetas.tolist()
        return out


def _validated_thetas(thetas: Any, owner: str) -> torch.Tensor:
    problem = f"{owner}: thetas must be a non-empty list of hypotheses, each a non-empty list of finite numbers " \
              f"of one common length, e.g. [[5, 6], [4, -4.5]]; got {thetas!r}"
    try:
        rows = [[float(value) for value in theta] for theta in thetas]
    except (TypeError, ValueError):
        raise ValueError(problem) from None
    if not rows or not rows[0] or any(len(row) != len(rows[0]) for row in rows):
        raise ValueError(problem)
    if not all(math.isfinite(value) for row in rows for value in row):
        raise ValueError(problem)
    return torch.tensor(rows, dtype=torch.float64)


def _validated_proportions(proportions: Optional[Sequence[float]], k: int, owner: str) -> list[float]:
    if proportions is None:
        return [1.0 / k] * k
    try:
        values = [float(value) for value in proportions]
    except (TypeError, ValueError):
        values = []
    if len(values) != k or any(not (math.isfinite(v) and v >= 0.0) for v in values) or sum(values) <= 0.0:
        raise ValueError(
            f"{owner}: proportions must be {k} non-negative numbers (one per hypothesis) with a positive sum, "
            f"got {proportions!r}; pass None for equal shares"
        )
    total = sum(values)
    return [value / total for value in values]
