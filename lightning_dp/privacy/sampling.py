"""Poisson sampling of training batches, sharded over distributed ranks.

Every example enters every batch independently with probability ``q``; rank r owns examples ``r, r + W, ...``
(no padding), and batch ``k`` is drawn from ``(seed, SAMPLING, k, rank)``, so a resumed run samples what the
uninterrupted one sampled. ``parts=k`` yields each batch as ``k`` micro-batches (virtual batches). Batches of one
shape (``max_batch_size``) are one draw over the whole set from ``(seed, SAMPLING, k, 0)`` on every rank, truncated,
then dealt out (every ``W``-th kept example). Details: docs/privacy.md, "Sampling", "Virtual batches" and "Batches of
one shape".
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset, RandomSampler, Sampler, SequentialSampler

from lightning_dp.privacy.noise import SAMPLING, derive_secret_generator

__all__ = ["EmptySafeCollate", "PassMarkingBatchSampler", "PoissonBatchSampler", "UserPoissonBatchSampler",
           "check_partition_sampler", "check_sample_rate", "PaddingCollate", "poisson_dataloader",
           "rebuild_dataloader", "split_indices", "suggest_max_batch_size", "user_poisson_dataloader"]


def check_sample_rate(sample_rate: float) -> float:
    """Validates a Poisson sampling rate q in (0, 1] and returns it as a float (used by the sampler and accountants)."""
    if isinstance(sample_rate, bool) or not isinstance(sample_rate, numbers.Real) or not 0 < sample_rate <= 1:
        raise ValueError(
            f"sample_rate must be a number in (0, 1], got {sample_rate!r}. It is the Poisson sampling probability "
            "q = expected_batch_size / dataset_size (1.0 means full batch, i.e. the unsampled Gaussian "
            "mechanism). Pass expected_batch_size / len(dataset): lower the batch size or use a larger training set.")
    return float(sample_rate)


class PoissonBatchSampler(BatchSampler):
    """Yields ``steps_per_epoch`` Poisson-sampled batches of this rank's indices per epoch.

    Args:
        sampler: ignored; present so that Lightning can re-instantiate the class with a
            distributed sampler (this class shards by rank itself, without padding).
        batch_size: the expected batch size *per rank* (kept for the BatchSampler API).
        drop_last: must be False (kept for the BatchSampler API).
        num_samples: the size N of the whole training set.
        sample_rate: q, the inclusion probability of every example in every batch.
        seed: the run's SECRET sampling seed (DPSGD's ``seed``): every batch is drawn from a
            :class:`~lightning_dp.privacy.noise.SecretGenerator` derived from it.
        rank: this process' rank (which shard it samples).
        world_size: the number of processes (shards).
        start_step: a callable giving the number of batches already released when an
            epoch starts; batch k of that epoch uses counter ``start_step() + k``.
        steps_per_epoch: (logical) batches per epoch; default ``ceil(1 / q)``.
        parts: micro-batches per logical batch (see the module docstring); ``len()`` is
            ``steps_per_epoch * parts``.
        max_batch_size: batches of one shape: the logical batch of ALL processes holds at most this many examples.
            Every process then draws the same Poisson sample of the whole training set (one stream, without the
            rank), keeps a uniformly random subset of ``max_batch_size`` when more are drawn, and takes every
            ``world_size``-th of the kept examples from its rank on: at most ``max_batch_size / world_size`` rows,
            which :class:`PaddingCollate` fills to ``max_batch_size / (world_size * parts)`` per micro-batch
            (:meth:`rows` says how many are real). The release is then the one truncated Poisson sample of the
            whole set, whichever process computes which example: dp-accounting's
            ``TruncatedSubsampledGaussianDpEvent(N + 1, q, max_batch_size, sigma)`` whatever the shards (a per-process
            truncation would depend on which records share a process, which a neighbour that shifts the shards
            changes). None: no bound.

    Example:
        >>> s = PoissonBatchSampler(None, 2, False, num_samples=10, sample_rate=0.2, seed=0)
        >>> len(s), all(0 <= i < 10 for b in s for i in b)
        (5, True)
        >>> v = PoissonBatchSampler(None, 2, False, num_samples=10, sample_rate=0.2, seed=0, parts=2)
        >>> len(v), [a + b for a, b in zip(*[iter(v)] * 2)] == list(s)  # the same logical batches, in halves
        (10, True)
    """

    def __init__(self, sampler: object = None, batch_size: int = 1, drop_last: bool = False, *, num_samples: int,
                 sample_rate: float, seed: int, rank: int = 0, world_size: int = 1,
                 start_step: Callable[[], int] | None = None, steps_per_epoch: int | None = None,
                 parts: int = 1, max_batch_size: int | None = None) -> None:
        if drop_last:
            raise ValueError("drop_last=True is not allowed with Poisson sampling: batch sizes are random by design")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} must be in [0, world_size={world_size})")
        if num_samples <= 0:
            raise ValueError(f"num_samples={num_samples} must be > 0: the training set is empty")
        if isinstance(parts, bool) or not isinstance(parts, int) or parts < 1:
            raise ValueError(f"parts={parts!r} must be a positive integer (micro-batches per logical batch)")
        self.parts = parts
        unit = parts * world_size
        if max_batch_size is not None and (isinstance(max_batch_size, bool) or not isinstance(max_batch_size, int)
                                           or max_batch_size < unit or max_batch_size % unit):
            raise ValueError(f"max_batch_size={max_batch_size!r} must be a positive multiple of world_size x parts = "
                             f"{unit} (every micro-batch of every process holds max_batch_size / {unit} rows)")
        self.max_batch_size = max_batch_size
        self.batch_size = batch_size
        self.drop_last = False
        self.num_samples = int(num_samples)
        self.sample_rate = check_sample_rate(sample_rate)
        self.seed = int(seed)
        self.rank, self.world_size = int(rank), int(world_size)
        self.start_step = start_step if start_step is not None else (lambda: 0)
        self.steps_per_epoch = int(steps_per_epoch) if steps_per_epoch else math.ceil(1 / self.sample_rate)
        self.indices = torch.arange(self.rank, self.num_samples, self.world_size)

    def __len__(self) -> int:
        return self.steps_per_epoch * self.parts

    def batch(self, step: int) -> list[int]:
        """The indices of this rank's batch at global batch counter ``step``."""
        # the seed is the run's secret one (DPSGD's): amplification by sampling assumes nobody can recompute the batch
        cap = self.max_batch_size
        if cap is None:
            g = derive_secret_generator(self.seed, SAMPLING, step, self.rank)
            mask = torch.rand(self.indices.numel(), generator=g) < self.sample_rate
            return self.indices[mask].tolist()
        # batches of one shape: ONE Poisson sample of the whole set (the same stream on every process: rank 0's key,
        # which is also a single process' own), truncated (arXiv 2508.15089) to a uniformly random subset of `cap`
        # from the same secret stream, then dealt out to the processes (every world_size-th, in index order)
        g = derive_secret_generator(self.seed, SAMPLING, step, 0)
        drawn = (torch.rand(self.num_samples, generator=g) < self.sample_rate).nonzero().squeeze(1)
        if drawn.numel() > cap:
            drawn = drawn[torch.randperm(drawn.numel(), generator=g)[:cap].sort().values]
        return drawn[self.rank::self.world_size].tolist()

    def rows(self, step: int, part: int) -> int:
        """How many of the rows of micro-batch ``part`` of step ``step`` are real examples (the rest pad it to
        ``max_batch_size / (world_size * parts)``); recomputed from the secret seed, as any copy of this sampler
        would."""
        key = (int(step), int(part))
        cached = getattr(self, "_rows", {})
        if key not in cached:
            parts = split_indices(self.batch(step), self.parts)
            cached = {(int(step), j): len(chunk) for j, chunk in enumerate(parts)}  # only the latest step's
            self._rows = cached
        return cached[key]

    def __iter__(self) -> Iterator[list[int]]:
        start = int(self.start_step())
        for k in range(self.steps_per_epoch):
            if self.parts == 1:
                yield self.batch(start + k)
            else:
                yield from split_indices(self.batch(start + k), self.parts)


class UserPoissonBatchSampler(PoissonBatchSampler):
    """Poisson sampling of USERS (ULS): every user enters every batch independently with probability ``q``, with
    all of their (bounded) records, which the batch holds next to each other, user after user.

    Rank r owns users ``r, r + W, ...``; batch ``k`` is drawn from ``(seed, SAMPLING, k, rank)`` as
    :class:`PoissonBatchSampler`'s. With ``parts > 1`` the sampled users (never a user's records) are split over the
    micro-batches. :meth:`groups` gives, for the micro-batch at global step ``k`` and part ``j``, how many records
    each of its users holds, in order: the private step clips each user's gradient as one unit.

    Args:
        users: the dataset indices of every user's records (one list per user).
        sample_rate: q, the inclusion probability of every user in every batch.
        num_samples: ignored (the number of users is ``len(users)``); present for Lightning's re-instantiation.
        (the rest as :class:`PoissonBatchSampler`'s.)

    Example:
        >>> s = UserPoissonBatchSampler(None, 1, False, users=[[0, 1], [2], [3, 4, 5]], sample_rate=0.5, seed=0)
        >>> batches = list(s)
        >>> all(sum(s.groups(k, 0)) == len(b) for k, b in enumerate(batches))
        True
    """

    def __init__(self, sampler: object = None, batch_size: int = 1, drop_last: bool = False, *,
                 users: list[list[int]], sample_rate: float, seed: int, rank: int = 0, world_size: int = 1,
                 start_step: Callable[[], int] | None = None, steps_per_epoch: int | None = None,
                 parts: int = 1, num_samples: int | None = None) -> None:
        super().__init__(sampler, batch_size, drop_last, num_samples=len(users), sample_rate=sample_rate, seed=seed,
                         rank=rank, world_size=world_size, start_step=start_step, steps_per_epoch=steps_per_epoch,
                         parts=parts)
        self.users = [list(map(int, records)) for records in users]
        self._groups: dict[tuple[int, int], list[int]] = {}

    def _split(self, step: int) -> list[list[int]]:
        """The users (positions in :attr:`users`) of each micro-batch of step ``step``."""
        return split_indices(PoissonBatchSampler.batch(self, step), self.parts)

    def batch(self, step: int) -> list[int]:
        """The record indices of this rank's batch at global batch counter ``step`` (every part)."""
        return [i for part in self._split(step) for u in part for i in self.users[u]]

    def groups(self, step: int, part: int) -> list[int]:
        """How many records each user of micro-batch ``part`` of step ``step`` holds, in the batch's order."""
        key = (int(step), int(part))
        if key not in self._groups:
            self._groups = {k: v for k, v in self._groups.items() if k[0] >= step}  # earlier steps are released
            for j, users in enumerate(self._split(step)):
                self._groups[(int(step), j)] = [len(self.users[u]) for u in users]
        return self._groups[key]

    def __iter__(self) -> Iterator[list[int]]:
        # nothing is cached here: Lightning may iterate a re-instantiated copy while the private step asks another
        # (groups() recomputes from the seed), and a cache filled here would only grow
        start = int(self.start_step())
        for k in range(self.steps_per_epoch):
            for users in self._split(start + k):
                yield [i for u in users for i in self.users[u]]


def user_poisson_dataloader(loader: DataLoader, *, users: list[list[int]], sample_rate: float, seed: int,
                            rank: int = 0, world_size: int = 1, start_step: Callable[[], int] | None = None,
                            parts: int = 1, steps_per_epoch: int | None = None) -> DataLoader:
    """A copy of ``loader`` whose batches are Poisson-sampled users with their records
    (:class:`UserPoissonBatchSampler`)."""
    batch_sampler = UserPoissonBatchSampler(None, loader.batch_size or 1, False, users=users, sample_rate=sample_rate,
                                            seed=seed, rank=rank, world_size=world_size, start_step=start_step,
                                            parts=parts, steps_per_epoch=steps_per_epoch)
    return rebuild_dataloader(loader, batch_sampler=batch_sampler,
                              collate_fn=EmptySafeCollate(loader.collate_fn, loader.dataset))


def split_indices(indices: list[int], parts: int) -> list[list[int]]:
    """``indices`` in ``parts`` consecutive runs whose sizes differ by at most one (the first ones larger).

    Example:
        >>> split_indices([1, 2, 3, 4, 5], 3), split_indices([7], 2)
        ([[1, 2], [3, 4], [5]], [[7], []])
    """
    n = len(indices)
    bounds = [(j * n + parts - 1) // parts for j in range(parts + 1)]
    return [indices[bounds[j]:bounds[j + 1]] for j in range(parts)]


def _map_structure(obj: object, leaf: Callable[[object], object]) -> object:
    """``obj`` with ``leaf`` applied to every value inside its (named) tuples, lists and dicts, structure kept."""
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        namedtuple_class: Any = type(obj)
        return namedtuple_class(*(_map_structure(v, leaf) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map_structure(v, leaf) for v in obj)
    if isinstance(obj, dict):
        return type(obj)((k, _map_structure(v, leaf)) for k, v in obj.items())
    return leaf(obj)


def _empty_like(batch: object) -> object:
    """The batch structure with every tensor cut to length 0 along dimension 0."""
    return _map_structure(batch, lambda t: t[:0] if isinstance(t, torch.Tensor) else t)


class EmptySafeCollate:
    """Wraps a collate function so that an empty Poisson batch becomes a batch of size 0.

    The empty batch keeps the structure, dtypes and trailing shapes of a real one (built
    from example 0 and cut to length 0), so the model runs on it and the step releases
    noise only; skipping the step instead would reveal that the batch was empty.
    """

    def __init__(self, collate_fn: Callable[[list[object]], object], dataset: object) -> None:
        self.collate_fn = collate_fn
        self.dataset = dataset

    def __call__(self, samples: list[object]) -> object:
        if samples:
            return self.collate_fn(samples)
        return _empty_like(self.collate_fn([self.dataset[0]]))  # type: ignore[index]


def _zero_like(sample: object) -> object:
    """An example of ``sample``'s structure, dtypes and shapes that holds nothing: tensors and arrays of zeros,
    numbers 0, strings empty.

    Raises:
        TypeError: a value of another kind (its content cannot be blanked).
    """
    return _map_structure(sample, _blank)


def _blank(value: object) -> object:
    """One value of an example (no container) with its content zeroed (:func:`_zero_like`)."""
    if isinstance(value, torch.Tensor):
        return torch.zeros_like(value)
    if isinstance(value, (bool, np.bool_)):
        return type(value)(False)
    if isinstance(value, numbers.Number):
        return type(value)(0)  # type: ignore[call-arg]
    if isinstance(value, (str, bytes)):
        return type(value)()
    if isinstance(value, np.ndarray):
        return np.zeros_like(value)
    raise TypeError(f"an example holds a {type(value).__name__}, which cannot be blanked to pad a batch of one shape "
                    "(tensors, arrays, numbers, strings and lists, tuples or dicts of them can).")


class PaddingCollate:
    """Wraps a collate function so that every batch holds exactly ``rows`` examples: the sampled ones first, then
    blank ones that the private step masks out (:meth:`PoissonBatchSampler.rows` says how many are real). A blank is
    :func:`_zero_like` of the batch's first SAMPLED example (its structure and shapes, none of its values), so a
    collate that pads to the longest example pads as it would without the blanks; an empty batch takes example 0's
    structure (its release is noise only, whatever the shapes). Batches of one shape let a compiled step (and CUDA
    graphs) run every step without recompiling, with memory bounded by ``rows``.

    Example:
        >>> collate = PaddingCollate(torch.utils.data.default_collate, [torch.ones(2)], rows=3)
        >>> collate([torch.full((2,), 5.0)])
        tensor([[5., 5.],
                [0., 0.],
                [0., 0.]])
    """

    def __init__(self, collate_fn: Callable[[list[object]], object], dataset: object, rows: int) -> None:
        self.collate_fn, self.rows = collate_fn, int(rows)
        # example 0's shapes never decide a batch's (a sampled example's do): only its structure, for an empty batch
        self.empty_blank = _zero_like(dataset[0])  # type: ignore[index]

    def __call__(self, samples: list[object]) -> object:
        if len(samples) > self.rows:
            raise RuntimeError(f"a batch exceeds max_batch_size's {self.rows} rows (internal; please report)")
        blank = _zero_like(samples[0]) if samples else self.empty_blank
        return self.collate_fn(list(samples) + [blank] * (self.rows - len(samples)))


def rebuild_dataloader(loader: DataLoader, *, batch_sampler: Sampler[list[int]] | Iterable[list[int]],
                       collate_fn: Callable | None = None) -> DataLoader:
    """A copy of ``loader`` (same dataset, collate and worker settings) drawing batches from ``batch_sampler``."""
    workers = loader.num_workers
    return DataLoader(
        loader.dataset, batch_sampler=batch_sampler, collate_fn=collate_fn or loader.collate_fn,
        num_workers=workers, pin_memory=loader.pin_memory, timeout=loader.timeout,
        worker_init_fn=loader.worker_init_fn, multiprocessing_context=loader.multiprocessing_context,
        prefetch_factor=loader.prefetch_factor if workers > 0 else None,
        persistent_workers=loader.persistent_workers if workers > 0 else False, pin_memory_device=loader.pin_memory_device)


def with_dataset(loader: DataLoader, dataset: Dataset, *, collate_fn: Callable | None = None) -> DataLoader:
    """A copy of ``loader`` (batch size, worker settings, ...) over another ``dataset``, shuffled or sequential as
    ``loader`` was (a custom sampler of the old dataset cannot cover the new one: it becomes a shuffle)."""
    workers = loader.num_workers
    return DataLoader(
        dataset, batch_size=loader.batch_size, shuffle=not isinstance(loader.sampler, SequentialSampler),
        drop_last=loader.drop_last, collate_fn=collate_fn or loader.collate_fn, num_workers=workers,
        pin_memory=loader.pin_memory, timeout=loader.timeout, worker_init_fn=loader.worker_init_fn,
        multiprocessing_context=loader.multiprocessing_context, generator=loader.generator,
        prefetch_factor=loader.prefetch_factor if workers > 0 else None,
        persistent_workers=loader.persistent_workers if workers > 0 else False, pin_memory_device=loader.pin_memory_device)


def poisson_dataloader(loader: DataLoader, *, sample_rate: float, seed: int, rank: int = 0, world_size: int = 1,
                       start_step: Callable[[], int] | None = None, parts: int = 1,
                       steps_per_epoch: int | None = None, max_batch_size: int | None = None) -> DataLoader:
    """A copy of ``loader`` (same dataset, collate and worker settings) with Poisson batches, each yielded in
    ``parts`` micro-batches (:class:`PoissonBatchSampler`); with ``max_batch_size`` (all processes together),
    batches of one shape: truncated to it and padded (:class:`PaddingCollate`)."""
    # a map-style dataset has __len__, which torch's Dataset does not declare
    batch_sampler = PoissonBatchSampler(None, loader.batch_size or 1, False, num_samples=len(loader.dataset),  # type: ignore[arg-type]
                                        sample_rate=sample_rate, seed=seed, rank=rank, world_size=world_size,
                                        start_step=start_step, parts=parts, steps_per_epoch=steps_per_epoch,
                                        max_batch_size=max_batch_size)
    collate: Callable[[list[object]], object] = (
        EmptySafeCollate(loader.collate_fn, loader.dataset) if max_batch_size is None else
        PaddingCollate(loader.collate_fn, loader.dataset, rows=max_batch_size // (parts * world_size)))
    return rebuild_dataloader(loader, batch_sampler=batch_sampler, collate_fn=collate)


def suggest_max_batch_size(dataset_size: int, sample_rate: float, *, overflow_probability: float = 1e-6,
                           world_size: int = 1, parts: int = 1) -> int:
    """The smallest ``max_batch_size`` (all processes together, a multiple of ``world_size * parts``) that a Poisson
    batch exceeds with probability at most ``overflow_probability`` per step.

    The batch is drawn from at most ``N + 1`` examples (one more in a neighbouring dataset): Binomial(N + 1, q). An
    overflow costs privacy, not correctness: the truncated event's epsilon grows with the overflow probability (at
    ``p = 1e-6`` it is within 0.1 % of plain Poisson sampling's over thousands of steps; docs/privacy.md, "Batches
    of one shape").

    Example:
        >>> suggest_max_batch_size(60_000, 256 / 60_000)
        335
    """
    from scipy import stats

    if not 0 < overflow_probability < 1:
        raise ValueError(f"overflow_probability={overflow_probability!r} must be in (0, 1): the chance per step that a "
                         "Poisson batch holds more than max_batch_size examples (e.g. 1e-6)")
    n, q, unit = int(dataset_size) + 1, check_sample_rate(sample_rate), int(world_size) * int(parts)
    bound = int(stats.binom.isf(overflow_probability, n, q))
    while stats.binom.sf(bound, n, q) > overflow_probability:
        bound += 1
    return max(-(-bound // unit) * unit, unit)  # every micro-batch of every process holds the same rows


class PassMarkingBatchSampler:
    """Forwards a batch sampler and calls ``on_pass()`` whenever a new pass over it begins.

    For shuffled (non-Poisson) DP-SGD one pass over a permutation of the data is one
    Gaussian mechanism by parallel composition. What is charged must therefore follow
    the passes actually started, not Lightning's epoch counter: a run resumed in the
    middle of an epoch starts a NEW permutation, whose examples may already have been
    used in the interrupted part of the epoch.
    """

    def __init__(self, batch_sampler: object, on_pass: Callable[[], None]) -> None:
        self.batch_sampler = batch_sampler
        self.on_pass = on_pass

    def __len__(self) -> int:
        return len(self.batch_sampler)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[list[int]]:
        self.on_pass()
        yield from self.batch_sampler  # type: ignore[misc]


def check_partition_sampler(loader: DataLoader) -> None:
    """Raises unless every pass of ``loader`` uses each example at most once (shuffled DP-SGD's premise).

    Accepted: ``RandomSampler`` without replacement over exactly the dataset, and
    ``SequentialSampler``, inside the ordinary ``BatchSampler``. Refused: sampling with
    replacement, ``WeightedRandomSampler``, ``num_samples`` other than ``len(dataset)``,
    custom samplers and batch samplers, whose passes may repeat an example.
    """
    sampler = loader.sampler
    n = len(loader.dataset)  # type: ignore[arg-type]
    ok = type(loader.batch_sampler) is BatchSampler and (
        type(sampler) is SequentialSampler
        or (type(sampler) is RandomSampler and not sampler.replacement and sampler.num_samples == n))
    if not ok:
        detail = type(sampler).__name__
        if isinstance(sampler, RandomSampler):
            detail += f"(replacement={sampler.replacement}, num_samples={sampler.num_samples}) over N={n}"
        raise ValueError(
            f"the training DataLoader samples with {detail} (batch sampler {type(loader.batch_sampler).__name__}). "
            "Shuffled DP-SGD (poisson_sampling=False) accounts one pass over the data as one Gaussian mechanism, "
            "which holds only if a pass uses every example at most once; this sampler can repeat examples, and the "
            "reported epsilon would be too small. Use DataLoader(shuffle=True) or shuffle=False, or "
            "poisson_sampling=True (which replaces the sampler by Poisson sampling).")
