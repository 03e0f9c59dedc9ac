"""What every federated DataModule shares: per-client datasets, client splits, padding, loaders.

A :class:`FederatedDataModule` yields lists of :class:`ClientDataset` (``train_clients``, ``val_clients`` held out
as whole clients, ``test_clients``); :class:`CentralizedView` batches the concatenation of a split's clients (a
centralized baseline, or user-level DP-SGD: the pooled samples carry each one's client as ``user_ids``,
:class:`PooledClients`), and :func:`padded` stacks clients into ``(C, Nmax, ...)`` tensors with a mask.
docs/data.md, "Federated data".
"""

from __future__ import annotations

import abc
import bisect
import hashlib
import itertools
import math
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Optional, TypeVar, Union, overload

import numpy as np
import torch
from lightning.fabric.utilities.data import AttributeDict
from lightning.pytorch import LightningDataModule
from torch import Tensor
from torch.utils.data import DataLoader, TensorDataset

from lightning_dp import checks
from lightning_dp.datamodules.base import (
    DataHparamsMixin,
    make_dataloader,
)

__all__ = ["CentralizedView", "ClientDataset", "ClientPopulation", "FederatedDataModule", "PooledClients",
           "SampleClients", "client_ids", "client_sizes", "derived_seed", "padded", "padded_sensitive", "split_clients"]

T = TypeVar("T")
Task = Literal["regression", "classification"]
SPLITS = ("train", "val", "test")


@dataclass(eq=False)
class ClientDataset:
    """The local data of one client: ``len(x) == len(y)`` samples.

    Attributes:
        client_id: A stable identifier (a provider id, a LEAF writer id, ``"train-007"``, ...).
        x: Inputs of shape ``(n, *input_shape)``.
        y: Targets of shape ``(n,)`` (class indices, int64, or regression targets, float32).
        sensitive: Optional sensitive-group id of every sample, int64 of shape ``(n,)``
            (what group-fairness metrics compare, e.g. :class:`~lightning_dp.metrics.GroupFairness`;
            never an input of the model); ``None`` when the data has no sensitive attribute.

    Raises:
        ValueError: If ``x``, ``y`` (and ``sensitive``) do not hold the same number of
            samples, or ``sensitive`` is not an integer tensor.

    Example:
        >>> client = ClientDataset("a", torch.zeros(3, 2), torch.zeros(3))
        >>> len(client)
        3
    """

    client_id: str
    x: Tensor
    y: Tensor
    sensitive: Optional[Tensor] = None

    def __post_init__(self) -> None:
        if self.x.ndim == 0 or self.y.ndim == 0 or self.x.shape[0] != self.y.shape[0]:
            raise ValueError(
                f"ClientDataset {self.client_id!r}: x and y must hold the same number of samples along "
                f"dimension 0, got x {tuple(self.x.shape)} and y {tuple(self.y.shape)}"
            )
        s = self.sensitive
        if s is not None and (s.shape != (self.x.shape[0],) or s.dtype.is_floating_point or s.dtype == torch.bool):
            raise ValueError(
                f"ClientDataset {self.client_id!r}: sensitive must be an integer tensor of shape "
                f"({self.x.shape[0]},) (one group id per sample), got {s.dtype} of shape {tuple(s.shape)}"
            )

    def __len__(self) -> int:
        return int(self.x.shape[0])

    def to(self, device: Union[torch.device, str]) -> "ClientDataset":
        """Return a copy with ``x`` and ``y`` on ``device``."""
        sensitive = None if self.sensitive is None else self.sensitive.to(device)
        return ClientDataset(self.client_id, self.x.to(device), self.y.to(device), sensitive)

    def as_dataset(self) -> TensorDataset:
        """The client's samples as a :class:`~torch.utils.data.TensorDataset` of ``(x, y)`` pairs."""
        return TensorDataset(self.x, self.y)


class ClientPopulation(Sequence[ClientDataset], abc.ABC):
    """A split of clients ``0 .. N-1`` too large to hold as one :class:`ClientDataset` each: it keeps the sizes
    (8 bytes per client) and builds the data of the clients a round reads, already padded; client ``i``'s id is
    ``f"{id_prefix}{i}"``. The federated round reads a split through ``len``,
    :meth:`FederatedDataModule.padded_rows`, :func:`client_sizes` and :func:`client_ids`, so a population of
    1,000,000 clients costs the memory of the clients drawn (e.g.
    :class:`~lightning_dp.datamodules.population.SyntheticPopulation`).

    Subclasses implement :attr:`sizes` and :meth:`rows`. ``population[i]`` builds one
    :class:`ClientDataset` (for inspection; a round reads :meth:`rows` of its clients at once).

    Args:
        id_prefix: the ids' common prefix, ending in a character that is not a digit (so that two populations
            of different prefixes never share an id).
    """

    def __init__(self, id_prefix: str) -> None:
        if not isinstance(id_prefix, str) or not id_prefix or id_prefix[-1].isdigit():
            raise ValueError(f"id_prefix={id_prefix!r} is not allowed: pass a non-empty string that does not end in "
                             "a digit (e.g. 'train-')")
        self.id_prefix = id_prefix

    @property
    @abc.abstractmethod
    def sizes(self) -> Tensor:
        """int64 ``(N,)``: every client's number of samples."""

    @abc.abstractmethod
    def rows(self, index: Sequence[int]) -> tuple[Tensor, Tensor, Tensor]:
        """``(x, y, mask)`` of the clients at ``index``, laid out as
        :func:`~lightning_dp.datamodules.federated.padded` lays out a list of clients."""

    def __len__(self) -> int:
        return int(self.sizes.shape[0])

    @overload
    def __getitem__(self, i: int) -> ClientDataset: ...

    @overload
    def __getitem__(self, i: slice) -> list[ClientDataset]: ...

    def __getitem__(self, i: Union[int, slice]) -> Union[ClientDataset, list[ClientDataset]]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        n = len(self)
        if isinstance(i, bool) or not isinstance(i, int) or not -n <= i < n:
            raise IndexError(f"client index {i!r} out of range for a population of {n} clients")
        i = i % n
        x, y, mask = self.rows([i])
        size = int(mask[0].sum())
        return ClientDataset(self.client_id(i), x[0, :size], y[0, :size])

    def __iter__(self) -> Iterator[ClientDataset]:
        return (self[i] for i in range(len(self)))

    def client_id(self, i: int) -> str:
        return f"{self.id_prefix}{int(i)}"

    def has_id(self, client_id: Any) -> bool:
        """Whether ``client_id`` is one of this population's ids."""
        if not isinstance(client_id, str) or not client_id.startswith(self.id_prefix):
            return False
        rest = client_id[len(self.id_prefix):]
        return re.fullmatch(r"0|[1-9][0-9]*", rest) is not None and int(rest) < len(self)

    def shares_ids_with(self, other: Sequence[ClientDataset]) -> list[Any]:
        """Ids found in both (a population of another prefix shares none: prefixes do not end in digits)."""
        if isinstance(other, ClientPopulation):
            return [f"{self.id_prefix}*"] if other.id_prefix == self.id_prefix and len(self) and len(other) else []
        return [c.client_id for c in other if self.has_id(c.client_id)]

    def __repr__(self) -> str:
        return f"{type(self).__name__}({len(self)} clients, ids {self.id_prefix}0..)"


def client_sizes(clients: Sequence[ClientDataset]) -> Tensor:
    """int64 ``(N,)``: the number of samples of each client (a population's stored sizes, else each ``len``)."""
    if isinstance(clients, ClientPopulation):
        return clients.sizes
    return torch.tensor([len(c) for c in clients], dtype=torch.int64)


class _PopulationIds(Sequence[str]):
    """The ids of some clients of a population, each formatted when read (100,000 ids as strings cost ~50 ms, which
    a round whose parts never read them need not pay)."""

    def __init__(self, population: ClientPopulation, index: Sequence[int]) -> None:
        self._population, self._index = population, index

    def __len__(self) -> int:
        return len(self._index)

    def __getitem__(self, i):  # int or slice, as a list
        if isinstance(i, slice):
            return [self._population.client_id(j) for j in self._index[i]]
        return self._population.client_id(self._index[i])

    def __repr__(self) -> str:
        return f"client ids {list(self[:3])}{'...' if len(self) > 3 else ''} ({len(self)})"


def client_ids(clients: Sequence[ClientDataset], index: Sequence[int]) -> Sequence[Any]:
    """The ids of the clients at ``index``, in order (a population's are formatted when read, without building
    the clients)."""
    if isinstance(clients, ClientPopulation):
        return _PopulationIds(clients, index)
    return [clients[i].client_id for i in index]


class SampleClients(Sequence[Any]):
    """The client id of every sample of clients pooled in order (:class:`PooledClients`), kept as one id and one
    size per client (run lengths): it stores nothing per sample; indexing finds the run, iterating expands them.

    ``ids[i]`` holds ``sizes[i]`` consecutive samples; a client of no samples holds none.

    Example:
        >>> users = SampleClients(["a", "b", "c"], [2, 0, 1])
        >>> len(users), list(users), users[2], users[-1]
        (3, ['a', 'a', 'c'], 'c', 'c')
    """

    def __init__(self, ids: Sequence[Any], sizes: Sequence[int]) -> None:
        self.ids = list(ids)
        self.sizes = [int(size) for size in sizes]
        if len(self.ids) != len(self.sizes) or any(size < 0 for size in self.sizes):
            raise ValueError(f"SampleClients: one non-negative size per id, got {len(self.ids)} ids and sizes "
                             f"{self.sizes[:5]}{'...' if len(self.sizes) > 5 else ''}")
        self._ends = list(itertools.accumulate(self.sizes))

    def __len__(self) -> int:
        return self._ends[-1] if self._ends else 0

    @overload
    def __getitem__(self, i: int) -> Any: ...

    @overload
    def __getitem__(self, i: slice) -> list[Any]: ...

    def __getitem__(self, i: Union[int, slice]) -> Any:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        n = len(self)
        if isinstance(i, bool) or not isinstance(i, int) or not -n <= i < n:
            raise IndexError(f"sample index {i!r} out of range for {n} samples")
        return self.ids[bisect.bisect_right(self._ends, i % n)]

    def __iter__(self) -> Iterator[Any]:
        for client, size in zip(self.ids, self.sizes):
            yield from itertools.repeat(client, size)

    def tolist(self) -> list[Any]:
        """Every sample's client id, as a list."""
        return list(self)

    def __repr__(self) -> str:
        return f"SampleClients({len(self)} samples of {len(self.ids)} clients)"


class PooledClients(TensorDataset):
    """All samples of some clients, in client order, as one :class:`~torch.utils.data.TensorDataset` of
    ``(x, y)`` pairs (the clients' tensors concatenated), which also states the client of every sample.

    Attributes:
        user_ids: the client id of every sample, in the dataset's order (:class:`SampleClients`): what
            DP-SGD's ``privacy_unit="user"`` reads as each example's user
            (:func:`lightning_dp.privacy.users.user_ids_of`). What a client is depends on the data: a FEMNIST
            writer, a CMS provider (hospital), a generated client (:meth:`FederatedDataModule.concatenated`).

    Example:
        >>> pooled = PooledClients([ClientDataset("a", torch.zeros(2, 3), torch.zeros(2)),
        ...                         ClientDataset("b", torch.ones(1, 3), torch.ones(1))])
        >>> len(pooled), list(pooled.user_ids), pooled[2][1].item()
        (3, ['a', 'a', 'b'], 1.0)
    """

    def __init__(self, clients: Sequence[ClientDataset]) -> None:
        clients = list(clients)
        if not clients:
            raise ValueError("PooledClients: needs at least one client")
        super().__init__(torch.cat([client.x for client in clients]), torch.cat([client.y for client in clients]))
        self.user_ids = SampleClients([client.client_id for client in clients], [len(client) for client in clients])


def _block_sizes(total: int, fractions: Sequence[float]) -> list[int]:
    """Largest-remainder rounding of ``fractions * total`` to integers summing to ``total``."""
    raw = [fraction * total for fraction in fractions]
    sizes = [math.floor(value) for value in raw]
    by_remainder = sorted(range(len(raw)), key=lambda i: (-(raw[i] - sizes[i]), i))
    for i in by_remainder[: total - sum(sizes)]:
        sizes[i] += 1
    return sizes


def split_clients(clients: Sequence[T], fractions: Sequence[float], *, seed: int) -> list[list[T]]:
    """Split a list of clients into disjoint groups of the given fractions (by client, never by sample).

    The group sizes are ``fractions * len(clients)`` rounded by largest remainder (they
    sum to ``len(clients)``; a group may be empty when there are few clients). Which
    client goes where is drawn from a ``torch.Generator`` seeded with ``seed``; within
    a group the clients keep their input order.

    Args:
        clients: Anything indexable: :class:`ClientDataset` objects, client ids, ...
        fractions: Positive fractions summing to 1, e.g. ``(0.7, 0.3)``.
        seed: Seed of the permutation.

    Returns:
        One list per fraction.

    Raises:
        ValueError: If a fraction is not positive or the fractions do not sum to 1.

    Example:
        >>> train, val = split_clients(["a", "b", "c", "d", "e"], [0.6, 0.4], seed=0)
        >>> len(train), len(val), sorted(train + val)
        (3, 2, ['a', 'b', 'c', 'd', 'e'])
    """
    fractions = [float(fraction) for fraction in fractions]
    if not fractions or any(not fraction > 0.0 for fraction in fractions) or abs(sum(fractions) - 1.0) > 1e-6:
        raise ValueError(
            f"split_clients: fractions must be positive and sum to 1, got {fractions} "
            f"(sum {sum(fractions):.6g}); e.g. (0.7, 0.3)"
        )
    count = len(clients)
    order = torch.randperm(count, generator=torch.Generator().manual_seed(int(seed))).tolist()
    groups, start = [], 0
    for size in _block_sizes(count, fractions):
        groups.append([clients[i] for i in sorted(order[start:start + size])])
        start += size
    return groups


def padded(clients: Sequence[ClientDataset], *, pad_value: float = 0.0) -> tuple[Tensor, Tensor, Tensor]:
    """Stack clients of unequal sizes into padded tensors for vectorized per-client training.

    Args:
        clients: At least one client; all with the same sample shape and dtypes.
        pad_value: Value written into the padding positions of ``x`` and ``y``.

    Returns:
        ``(x, y, mask)``: ``x`` of shape ``(C, Nmax, *input_shape)``, ``y`` of shape
        ``(C, Nmax, *target_shape)``, and the boolean ``mask`` of shape ``(C, Nmax)``,
        true exactly at the real samples (client ``c`` has ``mask[c].sum() == len(clients[c])``,
        its samples first, in order). Padding must be excluded from losses with the mask,
        e.g. ``(loss * mask).sum(1) / mask.sum(1).clamp_min(1)``.

    Raises:
        ValueError: If ``clients`` is empty or the clients' sample shapes or dtypes differ.

    Example:
        >>> a = ClientDataset("a", torch.ones(2, 3), torch.ones(2))
        >>> b = ClientDataset("b", torch.ones(1, 3), torch.ones(1))
        >>> x, y, mask = padded([a, b])
        >>> tuple(x.shape), tuple(y.shape), mask.tolist()
        ((2, 2, 3), (2, 2), [[True, True], [True, False]])
    """
    clients = list(clients)
    if not clients:
        raise ValueError("padded: needs at least one client, got an empty list")
    first = clients[0]
    for client in clients[1:]:
        if (client.x.shape[1:], client.y.shape[1:], client.x.dtype, client.y.dtype) != (
            first.x.shape[1:], first.y.shape[1:], first.x.dtype, first.y.dtype
        ):
            raise ValueError(
                f"padded: client {client.client_id!r} has samples x {tuple(client.x.shape[1:])} {client.x.dtype}, "
                f"y {tuple(client.y.shape[1:])} {client.y.dtype}, but client {first.client_id!r} has x "
                f"{tuple(first.x.shape[1:])} {first.x.dtype}, y {tuple(first.y.shape[1:])} {first.y.dtype}"
            )
    longest = max(len(client) for client in clients)
    x = first.x.new_full((len(clients), longest, *first.x.shape[1:]), pad_value)
    y = first.y.new_full((len(clients), longest, *first.y.shape[1:]), pad_value)
    mask = torch.zeros(len(clients), longest, dtype=torch.bool, device=first.x.device)
    for index, client in enumerate(clients):
        size = len(client)
        x[index, :size] = client.x
        y[index, :size] = client.y
        mask[index, :size] = True
    return x, y, mask


def padded_sensitive(clients: Sequence[ClientDataset]) -> Optional[Tensor]:
    """The clients' ``sensitive`` ids laid out like :func:`padded`'s mask: int64 ``(C, Nmax)``, ``-1`` at padding.

    Returns ``None`` when any client has no ``sensitive`` ids.

    Example:
        >>> a = ClientDataset("a", torch.ones(2, 3), torch.ones(2), torch.tensor([0, 1]))
        >>> b = ClientDataset("b", torch.ones(1, 3), torch.ones(1), torch.tensor([1]))
        >>> padded_sensitive([a, b]).tolist()
        [[0, 1], [1, -1]]
    """
    clients = list(clients)
    sensitive = [client.sensitive for client in clients if client.sensitive is not None]
    if not clients or len(sensitive) < len(clients):
        return None
    longest = max(len(client) for client in clients)
    out = torch.full((len(clients), longest), -1, dtype=torch.long, device=clients[0].x.device)
    for index, (client, values) in enumerate(zip(clients, sensitive)):
        out[index, : len(client)] = values
    return out


def _size_summary(clients: Sequence[ClientDataset]) -> dict[str, Any]:
    sizes = client_sizes(clients)
    empty = not len(sizes)
    return {
        "clients": len(sizes),
        "samples": int(sizes.sum()),
        "samples_min": None if empty else int(sizes.min()),
        # the mean of the two middle values for an even count, as statistics.median
        "samples_median": None if empty else float(np.median(sizes.numpy())),
        "samples_max": None if empty else int(sizes.max()),
    }


class FederatedDataModule(DataHparamsMixin, LightningDataModule):
    """Base DataModule whose ``setup`` yields per-client data split *by client*.

    Subclasses implement :meth:`_build_clients` (read or generate the data, return the
    three client lists) and set :attr:`task`, :attr:`num_classes` and
    :attr:`input_shape`. ``setup()`` builds everything once (the federated datasets of
    the project are small), later calls do nothing.

    After ``setup()``:

    - :attr:`train_clients`, :attr:`val_clients`, :attr:`test_clients`: lists of
      :class:`ClientDataset` (the test list may be empty); the client ids of the train
      and val lists are disjoint.
    - :meth:`summary`: client counts and sample counts (min/median/max) per split.
    - The Lightning loaders iterate over the concatenation of a split's clients
      (``batch_size``; the training loader is reshuffled every epoch by a seeded generator).

    Args:
        batch_size: Samples per batch of the centralized loaders, a positive integer.
        num_workers: DataLoader worker processes (0: load in the main process).
        seed: Seed of the client split, of the data generation where there is one, and
            of the training-loader shuffling.

    Raises:
        ValueError: If an argument is outside its range.
    """

    #: ``"regression"`` or ``"classification"``.
    task: Task = "regression"
    #: Number of classes (classification), ``None`` for regression.
    num_classes: Optional[int] = None
    #: Shape of one input sample.
    input_shape: tuple[int, ...] = ()
    #: Number of sensitive groups when the clients carry ``sensitive`` ids (0..num_groups-1), else ``None``.
    num_groups: Optional[int] = None

    def __init__(self, *, batch_size: int = 64, num_workers: int = 0, seed: int = 0) -> None:
        super().__init__()
        owner = type(self).__name__
        checks.positive_int("batch_size", batch_size, owner=owner)
        checks.non_negative_int("num_workers", num_workers, owner=owner)
        checks.integer("seed", seed, owner=owner)
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.seed = seed
        # lists, or a ClientPopulation for a split too large to list
        self.train_clients: Optional[Sequence[ClientDataset]] = None
        self.val_clients: Optional[Sequence[ClientDataset]] = None
        self.test_clients: Optional[Sequence[ClientDataset]] = None

    # ----------------------------------------------------------------- subclass API
    def _build_clients(self) -> tuple[list[ClientDataset], list[ClientDataset], list[ClientDataset]]:
        """Read or generate the data; return ``(train_clients, val_clients, test_clients)``."""
        raise NotImplementedError(f"{type(self).__name__} must implement _build_clients()")

    # ----------------------------------------------------------------- hooks
    def setup(self, stage: Optional[str] = None) -> None:
        """Build the three client lists (once; later calls, for any stage, do nothing).

        Args:
            stage: ``"fit"``, ``"validate"``, ``"test"``, ``"predict"`` or ``None``; the
                federated datasets are small, so every stage builds all splits.

        Raises:
            ValueError: If the training or validation split is empty, or a client id
                appears in both.
        """
        if self.train_clients is not None:
            return
        train, val, test = self._build_clients()
        owner = type(self).__name__
        if not train or not val:
            raise ValueError(
                f"{owner}: the client split left {len(train)} training and {len(val)} validation clients; "
                "both must be non-empty: use more clients or change the split fraction"
            )
        if isinstance(train, ClientPopulation):
            shared = set(train.shares_ids_with(val))
        elif isinstance(val, ClientPopulation):
            shared = set(val.shares_ids_with(train))
        else:
            shared = {client.client_id for client in train} & {client.client_id for client in val}
        if shared:
            raise ValueError(f"{owner}: clients {sorted(shared)[:5]} are both training and validation clients")
        # a population stays one (listing it would build every client)
        self.train_clients, self.val_clients, self.test_clients = (
            clients if isinstance(clients, ClientPopulation) else list(clients) for clients in (train, val, test))

    def clients(self, split: str) -> Sequence[ClientDataset]:
        """The client list of ``split`` (``"train"``, ``"val"`` or ``"test"``).

        Raises:
            ValueError: If ``split`` is not one of the three names.
            RuntimeError: If ``setup()`` has not run yet.
        """
        if split not in SPLITS:
            raise ValueError(f"{type(self).__name__}: split must be one of {SPLITS}, got {split!r}")
        clients = getattr(self, f"{split}_clients")
        if clients is None:
            raise RuntimeError(f"{type(self).__name__}: the clients are not built; call setup() first")
        return clients

    def padded(
        self, clients: Union[str, Sequence[ClientDataset]], *, pad_value: float = 0.0
    ) -> tuple[Tensor, Tensor, Tensor]:
        """:func:`padded` over a split name (``"train"``, ...) or an explicit list of clients."""
        return padded(self.clients(clients) if isinstance(clients, str) else clients, pad_value=pad_value)

    def padded_rows(self, split: str, index: Sequence[int], *, pad_value: float = 0.0) -> tuple[Tensor, Tensor, Tensor]:
        """:func:`padded` over the clients at positions ``index`` of ``split`` (a :class:`ClientPopulation` builds
        them at once, padded with zeros)."""
        clients = self.clients(split)
        if isinstance(clients, ClientPopulation):
            return clients.rows(index)
        return padded([clients[i] for i in index], pad_value=pad_value)

    def summary(self) -> dict[str, Any]:
        """Task, shapes and, per split, the number of clients and of samples (total, min/median/max per client).

        Returns:
            ``{"task", "num_classes", "input_shape", "train": {...}, "val": {...}, "test": {...}}``,
            each split holding ``clients``, ``samples``, ``samples_min``, ``samples_median``
            and ``samples_max`` (``None`` for an empty split). Subclasses add their own keys.
        """
        out: dict[str, Any] = {
            "task": self.task,
            "num_classes": self.num_classes,
            "input_shape": tuple(self.input_shape),
        }
        for split in SPLITS:
            out[split] = _size_summary(self.clients(split))
        return out

    # ----------------------------------------------------------------- centralized loaders
    def concatenated(self, split: str) -> PooledClients:
        """All samples of a split's clients, in client order, as one :class:`~torch.utils.data.TensorDataset`
        (:class:`PooledClients`) whose ``user_ids`` holds the client id of every sample.

        The pooled samples are a centralized baseline's data, and, with ``user_ids``, user-level DP-SGD's
        (``DPSGD(privacy_unit="user")``): the client is the user. What a client is depends on the data, and so
        does what a user-level guarantee protects: a FEMNIST writer; a CMS provider (hospital) with all its rows;
        a generated client of the synthetic data; an arbitrary partition of an image pool
        (:class:`~lightning_dp.datamodules.FederatedVisionDataModule`, no person). Each subclass says which.
        Built from the clients every call (the ids as one run per client: nothing per sample).

        Raises:
            RuntimeError: If the split has no clients (the message names the split), or is a
                :class:`ClientPopulation` (pooling would build every client).
        """
        clients = self.clients(split)
        if not clients:
            raise RuntimeError(f"{type(self).__name__}: the {split} split has no clients, so it has no loader")
        if isinstance(clients, ClientPopulation):
            raise RuntimeError(f"{type(self).__name__}: the {split} split is a population of {len(clients)} clients "
                               "built on demand; pooling all their samples would hold every client in memory. Read "
                               "its clients with padded_rows(split, index) instead.")
        return PooledClients(clients)

    def centralized(self) -> CentralizedView:
        """A plain LightningDataModule over the pooled samples of each split (a centralized baseline)."""
        return CentralizedView(self)

    # Lightning takes the loaders from the DataModule. A federated module's step is one
    # round that reads the clients itself (train_clients, padded(...)), so every loader
    # yields one item: one round per training epoch, one evaluation per validation.
    def _round(self) -> DataLoader:
        return DataLoader([0], batch_size=1)  # type: ignore[arg-type]  # any sequence works; torch types it Dataset

    def train_dataloader(self) -> DataLoader:
        """One item per epoch: the federated module runs one round per training step."""
        return self._round()

    def val_dataloader(self) -> DataLoader:
        """One item: the federated module evaluates all validation clients at once."""
        return self._round()

    def test_dataloader(self) -> DataLoader:
        """One item: the federated module evaluates all test clients at once."""
        return self._round()


class CentralizedView(LightningDataModule):
    """Batches over all clients' samples of each split of a :class:`FederatedDataModule`.

    The training split is reshuffled every epoch by a generator seeded with the federated
    DataModule's seed; validation and test keep a fixed order. Every split's dataset is
    :meth:`FederatedDataModule.concatenated`'s :class:`PooledClients`, whose ``user_ids`` is the client of every
    sample, so ``DPSGD(privacy_unit="user")`` trains with the federated data's clients as its users.

    From a ``lightning-dp fit`` config (``batch_size`` and ``seed`` are the federated DataModule's)::

        data:
          class_path: lightning_dp.datamodules.CentralizedView
          init_args:
            federated:
              class_path: lightning_dp.datamodules.SyntheticFairnessDataModule
              init_args: {num_clients: 1000, batch_size: 500, seed: 0}

    ``task``, ``num_classes`` and ``input_shape`` are the federated DataModule's, and so are the hyperparameters
    logged (``data/<name>``, plus ``data/view: centralized``).

    Args:
        federated: The federated DataModule whose clients are pooled.

    Raises:
        TypeError: If ``federated`` is not a :class:`FederatedDataModule`.
    """

    def __init__(self, federated: FederatedDataModule) -> None:
        super().__init__()
        if not isinstance(federated, FederatedDataModule):
            raise TypeError(f"CentralizedView: federated must be a FederatedDataModule (e.g. "
                            f"SyntheticLinearMixtureDataModule), got {type(federated).__name__}")
        self.federated = federated
        # Lightning logs a DataModule's hparams_initial only when it saved its hyperparameters: the federated one did
        self._log_hyperparams = federated._log_hyperparams

    @property
    def task(self) -> Task:
        """The federated DataModule's task."""
        return self.federated.task

    @property
    def num_classes(self) -> Optional[int]:
        """The federated DataModule's number of classes."""
        return self.federated.num_classes

    @property
    def input_shape(self) -> tuple[int, ...]:
        """The shape of one sample (the federated DataModule's)."""
        return tuple(self.federated.input_shape)

    @property
    def hparams_initial(self) -> AttributeDict:
        """The federated DataModule's logged hyperparameters (``data/<name>``) and ``data/view: centralized``."""
        logged = dict(self.federated.hparams_initial)
        # LightningCLI builds the nested DataModule with the instantiator of `data`, which hands it this view's
        # config (its own under `federated`): logged as its own arguments, as when built in Python
        nested = logged.pop("data/federated", None)
        if isinstance(nested, dict):
            arguments = {**nested.get("init_args", {}), **nested.get("dict_kwargs", {})}
            logged.update({f"data/{name}": value for name, value in arguments.items()})
        return AttributeDict({**logged, "data/view": "centralized"})

    def prepare_data(self) -> None:
        self.federated.prepare_data()

    def setup(self, stage: Optional[str] = None) -> None:
        self.federated.setup(stage)

    def _loader(self, split: str) -> DataLoader:
        fed = self.federated
        return make_dataloader(fed.concatenated(split), batch_size=fed.batch_size, shuffle=split == "train",
                               num_workers=fed.num_workers, seed=fed.seed)

    def train_dataloader(self) -> DataLoader:
        """Batches over all training clients' samples, reshuffled every epoch (seeded)."""
        return self._loader("train")

    def val_dataloader(self) -> DataLoader:
        """Batches over all validation clients' samples, in a fixed order."""
        return self._loader("val")

    def test_dataloader(self) -> DataLoader:
        """Batches over all test clients' samples, in a fixed order."""
        return self._loader("test")


def derived_seed(seed: int, *keys: Any) -> int:
    """A 63-bit seed derived from ``seed`` and ``keys`` (SHA-256 of their ``repr``), stable across runs and platforms.

    Lets one seed drive independent streams (one per split, one per client) so that,
    e.g., a client's draw does not change when other clients are added or removed.

    Example:
        >>> derived_seed(0, "train") == derived_seed(0, "train") != derived_seed(0, "val")
        True
    """
    digest = hashlib.sha256(repr((int(seed), *keys)).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1
