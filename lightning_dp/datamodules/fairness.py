"""Federated data with a sensitive group: the fairness settings of Galli et al. (journal paper).

A majority group g1 and a minority g2 whose clients need a different model; every sample carries its client's
group as :attr:`~lightning_dp.datamodules.federated.ClientDataset.sensitive` (0 = g1, 1 = g2), never an input of
the model. :class:`SyntheticFairnessDataModule` and :class:`FEMNISTFairnessDataModule`: docs/data.md, "A sensitive
group".
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from lightning_dp import checks
from lightning_dp.datamodules.base import renamed
from lightning_dp.datamodules.federated import (
    ClientDataset,
    _block_sizes,
    derived_seed,
)
from lightning_dp.datamodules.femnist import FEMNISTDataModule, PathLike, Source, WriterData
from lightning_dp.datamodules.synthetic import (
    DEFAULT_THETAS,
    GeneratedClientsDataModule,
    XDistribution,
    _check_x_distribution,
    _validated_thetas,
    draw_inputs,
)

__all__ = ["FEMNISTFairnessDataModule", "SyntheticFairnessDataModule"]


def _minority_count(total: int, minority_fraction: float) -> int:
    """Clients of g2 among ``total``: ``minority_fraction * total`` rounded like :func:`_block_sizes`."""
    return _block_sizes(total, [1.0 - minority_fraction, minority_fraction])[1]


class SyntheticFairnessDataModule(GeneratedClientsDataModule):
    """The journal paper's synthetic fairness setting: a privileged group and a minority with opposite rules.

    Every split's clients are split into g1 (``1 - minority_fraction`` of them, exact
    count by rounding) and g2, in an order drawn from a seeded generator. A client draws
    ``samples_per_client`` inputs ``x`` (2 features by default) and noises
    ``u ~ U[0, 1)``, and its scores and binary labels are

    - g1 (sensitive 0): ``y = x^T theta_1 + u``, label ``1`` if ``sigmoid(y) >= 0.5``;
    - g2 (sensitive 1): ``y = x^T theta_2 + minority_offset + u``, label ``1`` if
      ``sigmoid(y - minority_offset) <= 0.5``,

    as stated in the paper (offset 15). The offset cancels in g2's label rule: the two
    groups differ by their hyperplanes and by the *direction* of the rule (g2's label is
    1 on the negative side). With ``x ~ N(0, I)`` and the default hypotheses, about 53 %
    of g1's labels and 47 % of g2's are 1. A model of g1 scores g2's samples at chance
    level or worse (its rule disagrees with g2's), so a global model that fits the 80 %
    majority has very different true- and false-positive rates on the two groups.

    The input distribution is not stated in the paper, as in
    :class:`~lightning_dp.datamodules.SyntheticLinearMixtureDataModule` (``x_distribution``).

    Training, validation and test clients come from independent streams derived from
    ``seed``; client ids are ``"train-0000"``, ``"val-0000"``, ``"test-0000"``, ... (as users, e.g. of
    ``DPSGD(privacy_unit="user")`` over :class:`~lightning_dp.datamodules.CentralizedView`: each generated client,
    :meth:`concatenated`'s ``user_ids``; examples/user_level/els_synthetic.yaml). After
    ``setup()``, ``x`` is float32 ``(samples_per_client, d)``, ``y`` int64 in {0, 1},
    ``sensitive`` int64 (the client's group for every sample); :attr:`group_of` maps
    client ids to groups and :attr:`scores` to the float64 scores ``y`` before thresholding.

    Args:
        num_clients: Training clients (1000 in the paper).
        samples_per_client: Samples of every client (10 in the paper).
        minority_fraction: Share of g2 among each split's clients, in (0, 1) (0.2 in the paper).
        num_val_clients: Held-out validation clients (model selection, early stopping).
        num_test_clients: Held-out test clients (the fairness comparison), a positive integer.
        thetas: ``[theta_1, theta_2]``, two lists of ``d`` numbers.
        minority_offset: The offset of g2's scores (15 in the paper; it does not change labels).
        x_distribution: ``"normal"`` (``N(0, I)``) or ``"uniform"`` (``U[0, 1)^d``).
        batch_size: Samples per batch of the centralized loaders.
        num_workers: DataLoader worker processes.
        seed: Seed of the generation and of the training-loader shuffling.

    Raises:
        ValueError: If an argument is outside its range.

    Example:
        >>> dm = SyntheticFairnessDataModule(num_clients=10, num_val_clients=5, num_test_clients=5, seed=0)
        >>> dm.setup()
        >>> sum(dm.group_of[c.client_id] for c in dm.train_clients), dm.train_clients[0].y.dtype
        (2, torch.int64)
    """

    task = "classification"
    num_classes = 2
    num_groups = 2

    def __init__(
        self,
        *,
        num_clients: int = 1000,
        samples_per_client: int = 10,
        minority_fraction: float = 0.2,
        num_val_clients: int = 100,
        num_test_clients: int = 200,
        thetas: Sequence[Sequence[float]] = DEFAULT_THETAS,
        minority_offset: float = 15.0,
        x_distribution: XDistribution = "normal",
        batch_size: int = 64,
        num_workers: int = 0,
        seed: int = 0,
    ) -> None:
        super().__init__(batch_size=batch_size, num_workers=num_workers, seed=seed)
        owner = type(self).__name__
        checks.positive_int("num_clients", num_clients, owner=owner)
        checks.positive_int("samples_per_client", samples_per_client, owner=owner)
        checks.positive_int("num_val_clients", num_val_clients, owner=owner)
        checks.positive_int("num_test_clients", num_test_clients, owner=owner)
        checks.open_fraction("minority_fraction", minority_fraction, owner=owner)
        self.true_thetas = _validated_thetas(thetas, owner)
        if self.true_thetas.shape[0] != 2:
            raise ValueError(f"{owner}: thetas must hold exactly two hypotheses [theta_1, theta_2] (g1 and g2), "
                             f"got {self.true_thetas.shape[0]}: {thetas!r}")
        if isinstance(minority_offset, bool) or not isinstance(minority_offset, (int, float)) \
                or not math.isfinite(float(minority_offset)):
            raise ValueError(f"{owner}: minority_offset must be a finite number (15 in the paper), "
                             f"got {minority_offset!r}")
        _check_x_distribution(x_distribution, owner)
        self.save_hyperparameters()
        self.num_clients = num_clients
        self.samples_per_client = samples_per_client
        self.minority_fraction = float(minority_fraction)
        self.num_val_clients = num_val_clients
        self.num_test_clients = num_test_clients
        self.minority_offset = float(minority_offset)
        self.x_distribution = x_distribution
        self.input_shape = (self.true_thetas.shape[1],)
        #: Group (0 = g1, 1 = g2) of every client id, filled by ``setup()``.
        self.group_of: dict[str, int] = {}
        #: Float64 scores ``y`` (before thresholding) of every client id, filled by ``setup()``.
        self.scores: dict[str, torch.Tensor] = {}

    def _generate(self, split: str, count: int) -> list[ClientDataset]:
        generator = torch.Generator().manual_seed(derived_seed(self.seed, "synthetic-fairness", split))
        minority = _minority_count(count, self.minority_fraction)
        groups = torch.cat([torch.zeros(count - minority, dtype=torch.long), torch.ones(minority, dtype=torch.long)])
        groups = groups[torch.randperm(count, generator=generator)]
        shape = (count, self.samples_per_client, self.input_shape[0])
        x = draw_inputs(shape, self.x_distribution, generator)
        u = torch.rand(shape[:2], generator=generator, dtype=torch.float64)
        offsets = groups.to(torch.float64) * self.minority_offset  # 0 for g1, the offset for g2
        scores = torch.einsum("cnd,cd->cn", x, self.true_thetas[groups]) + offsets[:, None] + u
        # sigmoid(s) >= 0.5 exactly when s >= 0: the comparisons are made on the scores, free of the
        # sigmoid's rounding (float64 sigmoid(s) rounds to 0.5 for |s| < 1e-16)
        g1_label = scores >= 0
        g2_label = (scores - offsets[:, None]) <= 0
        labels = torch.where(groups[:, None] == 0, g1_label, g2_label).long()
        clients = []
        for index in range(count):
            client_id = f"{split}-{index:04d}"
            group = int(groups[index])
            self.group_of[client_id] = group
            self.scores[client_id] = scores[index]
            clients.append(ClientDataset(client_id, x[index].to(torch.float32), labels[index],
                                         torch.full((self.samples_per_client,), group, dtype=torch.long)))
        return clients

    def summary(self) -> dict[str, Any]:
        """:meth:`FederatedDataModule.summary` plus, per split, ``clients_per_group`` and ``positive_rate_per_group``."""
        out = super().summary()
        for split in ("train", "val", "test"):
            out[split].update(_group_summary(self.clients(split)))
        out["thetas"] = self.true_thetas.tolist()
        return out


def _group_summary(clients: Sequence[ClientDataset]) -> dict[str, list[Any]]:
    counts, positives, samples = [0, 0], [0, 0], [0, 0]
    for client in clients:
        group = 0
        if len(client):
            if client.sensitive is None:  # every client of these DataModules carries its group
                raise RuntimeError(f"client {client.client_id!r} has no sensitive group (internal)")
            group = int(client.sensitive[0])
        counts[group] += 1
        positives[group] += int(client.y.sum())
        samples[group] += len(client)
    return {"clients_per_group": counts,
            "positive_rate_per_group": [p / s if s else None for p, s in zip(positives, samples)]}


class FEMNISTFairnessDataModule(FEMNISTDataModule):
    """FEMNIST with a sensitive group: rotated writers are the minority g2, the label is a class-index parity.

    The journal paper's FEMNIST fairness setting. Exactly ``minority_fraction`` of the
    loaded writers (rounded; 20 % by default) are rotated by 90 degrees and form g2
    (sensitive 1); the others, upright, form g1 (sensitive 0). Which writers are rotated
    is a seeded permutation of the sorted writer ids (unlike :class:`FEMNISTDataModule`'s
    independent per-writer draws, which give the share only on average). The binary
    label of a character of class ``c`` (0..61) is

    - g1: ``1`` if ``c`` is even;
    - g2: ``1`` if ``c`` is odd,

    so the two groups need different models twice over: rotated images and the opposite
    rule. ``y`` is int64 in {0, 1}; :attr:`FEMNISTDataModule.rotated` maps clients to their group.
    Everything else (sources, splits, inversion, test samples) is :class:`FEMNISTDataModule`'s; its
    ``rotate_probability`` is replaced by ``minority_fraction``.

    Args:
        minority_fraction: Share of the writers rotated into g2, in (0, 1).
        data_dir: As in :class:`FEMNISTDataModule`.
        source: As in :class:`FEMNISTDataModule`.
        val_fraction: As in :class:`FEMNISTDataModule`.
        max_clients: As in :class:`FEMNISTDataModule`.
        invert: As in :class:`FEMNISTDataModule`.
        hf_test_fraction: As in :class:`FEMNISTDataModule`.
        batch_size: As in :class:`FEMNISTDataModule`.
        num_workers: As in :class:`FEMNISTDataModule`.
        seed: As in :class:`FEMNISTDataModule`; also the seed of the permutation that picks the rotated writers.
    """

    num_classes = 2
    num_groups = 2

    def __init__(
        self,
        *,
        data_dir: PathLike = "./data/femnist",
        source: Source = "leaf",
        minority_fraction: float = 0.2,
        val_fraction: float = 0.2,
        max_clients: int | None = None,
        invert: bool = True,
        hf_test_fraction: float = 0.1,
        batch_size: int = 64,
        num_workers: int = 0,
        seed: int = 0,
    ) -> None:
        checks.open_fraction("minority_fraction", minority_fraction, owner=type(self).__name__)
        super().__init__(data_dir=data_dir, source=source, val_fraction=val_fraction, max_clients=max_clients,
                         rotate_probability=float(minority_fraction), invert=invert,
                         hf_test_fraction=hf_test_fraction, batch_size=batch_size, num_workers=num_workers,
                         seed=seed)
        self.minority_fraction = float(minority_fraction)

    def _rotations(self, writers: Sequence[str]) -> dict[str, bool]:
        ordered = sorted(writers)
        generator = torch.Generator().manual_seed(derived_seed(self.seed, "femnist-fairness-minority"))
        chosen = torch.randperm(len(ordered), generator=generator)[: _minority_count(len(ordered),
                                                                                     self.minority_fraction)]
        minority = {ordered[i] for i in chosen.tolist()}
        return {writer: writer in minority for writer in writers}

    def is_rotated(self, client_id: str) -> bool:
        """Whether a loaded writer is in g2 (after ``setup()``: the rotation is a property of the loaded set)."""
        if client_id not in self.rotated:
            raise KeyError(f"{type(self).__name__}: writer {client_id!r} is not loaded; call setup() first, "
                           "the minority is drawn among the loaded writers")
        return self.rotated[client_id]

    def _client(self, writer: str, data: WriterData) -> ClientDataset:
        client = super()._client(writer, data)
        group = int(self.rotated[writer])
        label = (client.y % 2 == (1 if group else 0)).long()
        return ClientDataset(client.client_id, client.x, label,
                             torch.full((len(client),), group, dtype=torch.long))

    def summary(self) -> dict[str, Any]:
        """:meth:`FEMNISTDataModule.summary` plus, per split, ``clients_per_group`` and ``positive_rate_per_group``."""
        out = super().summary()
        for split in ("train", "val", "test"):
            out[split].update(_group_summary(self.clients(split)))
        out["minority_fraction"] = self.minority_fraction
        return out


def __getattr__(name: str) -> type:  # the former names (datamodules.base.RENAMED), warned
    return renamed(__name__, name, globals())
