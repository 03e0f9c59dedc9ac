"""Planning a DP-SGD run: the facts of its training data, the event each step is accounted as, the planned length.

Pure functions of public configuration; DPSGD reads the facts from the training DataLoader and the limits from
the Trainer. Poisson sampling: one subsampled Gaussian per step at ``q = expected batch / N``; shuffled batches:
one Gaussian per epoch at ``sigma / 2`` (docs/privacy.md, "Shuffled batches").

Example:
    >>> facts = DataFacts.of(dataset_size=1000, batch_size=50, world_size=2, parts=1, poisson_sampling=True)
    >>> facts.sample_rate, facts.steps_per_epoch, event_shape(True, facts.sample_rate)
    (0.1, 10, (0.1, 1.0))
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["BatchShape", "CALIBRATE_FOR", "DataFacts", "event_shape", "own_planned_events", "planned_events", "trainer_events",
           "trainer_steps"]

#: Which planned length a calibrated noise multiplier is for when the callback's and the Trainer's disagree.
CALIBRATE_FOR = ("auto", "trainer", "callback")


@dataclass(frozen=True)
class DataFacts:
    """What the accounting needs to know of the training data (public: sizes, never contents)."""

    dataset_size: int  #: N (with the slots an audit appends)
    sample_rate: float  #: q = expected_batch_size / N
    expected_batch_size: int  #: batch_size x processes x micro-batches per step
    steps_per_epoch: int  #: optimizer steps per epoch
    parts: int  #: micro-batches per step (accumulate_grad_batches)

    @classmethod
    def of(cls, *, dataset_size: int, batch_size: int, world_size: int, parts: int, poisson_sampling: bool,
           batches_per_epoch: int | None = None) -> DataFacts:
        """The facts of a loader of ``batch_size`` over ``dataset_size`` examples on ``world_size`` processes, with
        ``parts`` micro-batches per optimizer step (``batches_per_epoch``: the loader's length, for shuffled batches).

        Raises:
            ValueError: ``parts`` is not a positive integer, the dataset is empty, or the expected batch exceeds
                the dataset.
        """
        if isinstance(parts, bool) or not isinstance(parts, int) or parts < 1:
            raise ValueError(f"accumulate_grad_batches={parts!r} is not allowed: pass a positive integer")
        if dataset_size < 1:  # no batch size can help: say what is wrong with the data
            raise ValueError(
                f"the training set is empty (N={dataset_size}): the training DataLoader's dataset has no examples, so "
                "there is nothing to sample or train on. Give it data: check the DataModule's data_dir and files, "
                "its split (train/val fractions that leave no training example) or a filter that removes every "
                "example; len(train_dataloader().dataset) must be at least the batch size.")
        expected = batch_size * world_size * parts
        if expected > dataset_size:
            accumulated = f" x accumulate_grad_batches={parts}" if parts > 1 else ""
            raise ValueError(
                f"expected batch size {expected} (batch_size={batch_size} x {world_size} processes{accumulated}) "
                f"exceeds the training set size N={dataset_size}; lower batch_size"
                + (" or accumulate_grad_batches." if parts > 1 else "."))
        if poisson_sampling:
            steps = math.ceil(dataset_size / expected)
        else:
            if batches_per_epoch is None:
                raise ValueError("shuffled batches need batches_per_epoch (the loader's length)")
            steps = math.ceil(batches_per_epoch / parts)
        return cls(dataset_size=dataset_size, sample_rate=expected / dataset_size, expected_batch_size=expected,
                   steps_per_epoch=steps, parts=parts)


@dataclass(frozen=True)
class BatchShape:
    """Batches of one shape: each step holds at most ``max_batch_size`` examples (all processes together; ``per_rank``
    rows on each process, ``per_rank / parts`` per micro-batch, padded), accounted as dp-accounting's
    ``TruncatedSubsampledGaussianDpEvent(accounted_size, q, max_batch_size, sigma)``.

    The truncation is one draw over the whole training set, the same on every process, before the kept examples are
    dealt out (:class:`~lightning_dp.privacy.sampling.PoissonBatchSampler`): the release is the one truncated Poisson
    sample whatever the shards. ``accounted_size = N + 1``: the most records the sample is drawn from, in the training
    set or in a neighbour with one more record (the truncation probability, and epsilon, grow with it).

    Example:
        >>> facts = DataFacts.of(dataset_size=1000, batch_size=50, world_size=2, parts=1, poisson_sampling=True)
        >>> shape = BatchShape.of(128, facts, world_size=2)
        >>> shape.per_rank, shape.accounted_size, round(shape.overflow_probability, 4)
        (64, 1001, 0.0132)
    """

    max_batch_size: int  #: all processes and micro-batches together (the truncated event's ``truncated_batch_size``)
    per_rank: int  #: the rows of one process' logical batch
    accounted_size: int  #: the truncated event's ``dataset_size``
    overflow_probability: float  #: the chance per step that the Poisson batch exceeds ``max_batch_size``

    @classmethod
    def of(cls, max_batch_size: int | str, facts: DataFacts, *, world_size: int,
           overflow_probability: float = 1e-6) -> BatchShape:
        """The shape of ``max_batch_size`` (``"auto"``: suggested for ``overflow_probability``) for ``facts``.

        Raises:
            ValueError: a bound that is not a multiple of ``world_size * parts``, or below the expected batch.
        """
        from scipy import stats

        from lightning_dp.privacy.sampling import suggest_max_batch_size

        unit = world_size * facts.parts
        if max_batch_size == "auto":
            max_batch_size = suggest_max_batch_size(facts.dataset_size, facts.sample_rate, world_size=world_size,
                                                    parts=facts.parts, overflow_probability=overflow_probability)
        size = int(max_batch_size)
        if size % unit:
            raise ValueError(f"max_batch_size={size} is not a multiple of {unit} ({world_size} process(es) x "
                             f"{facts.parts} micro-batch(es) per step): every process and micro-batch holds the same "
                             f"number of rows. Pass {-(-size // unit) * unit}.")
        if size < facts.expected_batch_size:
            suggested = suggest_max_batch_size(facts.dataset_size, facts.sample_rate, world_size=world_size,
                                               parts=facts.parts)
            raise ValueError(f"max_batch_size={size} is below the expected batch size {facts.expected_batch_size}: "
                             "most steps would be truncated, which costs privacy (a truncated step's record can "
                             "replace another: twice the sensitivity) and biases the gradient. Pass a bound that a "
                             f"Poisson batch rarely exceeds, e.g. {suggested} (max_batch_size='auto').")
        accounted = facts.dataset_size + 1
        overflow = float(stats.binom.sf(size, accounted, facts.sample_rate))
        return cls(size, size // world_size, accounted, overflow)


def event_shape(poisson_sampling: bool, sample_rate: float) -> tuple[float, float]:
    """``(rate, multiplier scale)`` of one accounted event: Gaussian(``scale * sigma``) at that rate.

    Poisson sampling: one subsampled Gaussian per step, ``(q, 1)``. Shuffled batches: one Gaussian per epoch at half
    the multiplier, ``(1, 1/2)`` (replacement adjacency moves a clipped sum by ``2C``). A noise multiplier calibrated
    for the event is ``sigma_event / scale``.
    """
    return (sample_rate, 1.0) if poisson_sampling else (1.0, 0.5)


def own_planned_events(facts: DataFacts, poisson_sampling: bool, *, epochs: int | None,
                       max_steps: int | None) -> int | None:
    """Accounted events of the callback's own plan (``epochs`` or ``max_steps``; None: no plan)."""
    if max_steps is not None:
        return max_steps if poisson_sampling else math.ceil(max_steps / facts.steps_per_epoch)
    if epochs is not None:
        return epochs * (facts.steps_per_epoch if poisson_sampling else 1)
    return None


def trainer_steps(facts: DataFacts, *, max_epochs: int | None, max_steps: int | None) -> int | None:
    """The most optimizer steps the Trainer's limits allow (None or <= 0: no limit; None: unlimited)."""
    limits = []
    if max_steps is not None and max_steps > 0:
        limits.append(max_steps)
    if max_epochs is not None and max_epochs > 0:
        limits.append(max_epochs * facts.steps_per_epoch)
    return min(limits) if limits else None


def trainer_events(facts: DataFacts, poisson_sampling: bool, *, max_epochs: int | None,
                   max_steps: int | None) -> int | None:
    """Accounted events of the Trainer's limits (None: unlimited)."""
    steps = trainer_steps(facts, max_epochs=max_epochs, max_steps=max_steps)
    if steps is None or poisson_sampling:
        return steps
    return math.ceil(steps / facts.steps_per_epoch)


def planned_events(own: int | None, limit: int | None, calibrate_for: str) -> int | None:
    """The planned events by ``calibrate_for``: the shorter (``"auto"``), the Trainer's or the callback's first;
    either when only one is known; None when neither is."""
    if own is None or limit is None:
        return own if limit is None else limit
    if calibrate_for == "auto":
        return min(own, limit)
    return limit if calibrate_for == "trainer" else own
