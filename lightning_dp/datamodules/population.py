"""Generated client populations too large to hold as one :class:`ClientDataset` per client.

A :class:`~lightning_dp.datamodules.federated.ClientPopulation` is a ``Sequence`` of clients that keeps only
what a round needs of all of them (the sizes: 8 bytes per client) and builds the data of the clients a round reads,
already padded, so a population of 1,000,000 clients costs the memory of the clients drawn,
not of the population (docs/federated.md, "Populations").

:class:`SyntheticPopulation` generates every client's data as a pure function of
``(seed, split, client index, sample index)`` (:func:`~lightning_dp.privacy.noise.counter_normal`):
a mixture of linear models (regression, or logistic for binary labels) or class-prototype
images, for measuring the round at scale (``benchmarks/bench_federated_round.py --whole``);
:class:`SyntheticPopulationDataModule` is its DataModule.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Literal, Optional

import torch
from torch import Tensor

from lightning_dp import checks
from lightning_dp.datamodules.federated import ClientPopulation, FederatedDataModule
from lightning_dp.privacy.noise import counter_normal, counter_uniform

__all__ = ["SyntheticPopulation", "SyntheticPopulationDataModule"]


# counters of the synthetic streams (counter_uniform / counter_normal keys after the seed)
_SIZE, _CLUSTER, _X, _Y, _WEIGHTS, _LABEL, _PROTOTYPE, _MIXING = 1, 2, 3, 4, 5, 6, 7, 8
_SPLIT_KEYS = {"train": 0, "val": 1, "test": 2}
SyntheticTask = Literal["regression", "binary", "image"]


class SyntheticPopulation(ClientPopulation):
    """``num_clients`` generated clients (module docstring); the data of client ``i`` depend only on
    ``(seed, split, i)``, so a client reads the same data whichever clients it is drawn with.

    Each client belongs to one of ``num_clusters`` clusters (uniform), which share a model:

    - ``"regression"``: ``x ~ N(0, I_F)``, ``y = x . w_c + noise * N(0, 1)``, ``w_c ~ N(0, I_F)`` (float32 targets);
    - ``"binary"``: ``x ~ N(0, I_F)``, ``y ~ Bernoulli(sigmoid(x . w_c / noise))`` (float32 in {0, 1});
    - ``"image"``: label ``y`` uniform over ``num_classes`` (int64), ``x = prototype_{c, y} + A z`` with
      ``prototype ~ N(0, I)`` of ``input_shape`` (e.g. ``(3, 32, 32)``), ``z ~ N(0, I_d)`` per sample and a fixed
      ``A ~ N(0, I / d)`` (``d = latent_dim``: each pixel's noise has variance 1, of rank d, which costs d draws
      per sample instead of one per pixel). The draws are rounded to grids and clamped at 8 standard deviations
      (:func:`_image_grids`: for d = 16, ``z`` to 1/64, ``A`` to 1/128 of its standard deviation) on which every
      sum forming ``x`` is exact in float32: one matrix product over a block of samples then gives each sample
      the same bits whatever its companions (a product's rounding otherwise depends on the batch's shape).

    Args:
        num_clients: N.
        task: ``"regression"``, ``"binary"`` or ``"image"``.
        seed: the generation's seed (public).
        split: ``"train"``, ``"val"`` or ``"test"`` (its own data; the id prefix ``"<split>-"``).
        samples: ``(min, max)`` samples per client, uniform.
        input_shape: one sample's shape.
        num_clusters: clusters of clients sharing a model.
        num_classes: classes of the ``"image"`` task.
        noise: the label noise (regression: std; binary: logit temperature).
        latent_dim: d, the rank of the images' noise.
    """

    def __init__(self, num_clients: int, *, task: SyntheticTask = "regression", seed: int = 0, split: str = "train",
                 samples: Sequence[int] = (1, 4), input_shape: Sequence[int] = (3,), num_clusters: int = 1,
                 num_classes: int = 10, noise: float = 0.1, latent_dim: int = 16) -> None:
        if split not in _SPLIT_KEYS:
            raise ValueError(f"split={split!r} is not allowed; choose one of {tuple(_SPLIT_KEYS)}")
        super().__init__(f"{split}-")
        owner = type(self).__name__
        self.num_clients = checks.non_negative_int("num_clients", num_clients, owner=owner)
        if num_clients > 2**32:
            raise ValueError(f"{owner}: num_clients={num_clients} is not allowed: at most 2^32 clients")
        if task not in ("regression", "binary", "image"):
            raise ValueError(f"{owner}: task={task!r} is not allowed; choose 'regression', 'binary' or 'image'")
        self.task = task
        self.seed = checks.integer("seed", seed, owner=owner)
        self.split = split
        lo, hi = (int(v) for v in samples)
        if not 1 <= lo <= hi:
            raise ValueError(f"{owner}: samples={tuple(samples)!r} is not allowed: pass (min, max) with "
                             "1 <= min <= max")
        self.samples = (lo, hi)
        self.input_shape = tuple(checks.positive_int("input_shape", int(v), owner=owner) for v in input_shape)
        self.num_clusters = checks.positive_int("num_clusters", num_clusters, owner=owner)
        self.num_classes = checks.positive_int("num_classes", num_classes, owner=owner)
        if not (float(noise) > 0 and math.isfinite(float(noise))):
            raise ValueError(f"{owner}: noise={noise!r} is not allowed: pass a finite number > 0")
        self.noise = float(noise)
        self.latent_dim = checks.positive_int("latent_dim", latent_dim, owner=owner)
        self._key = (self.seed, _SPLIT_KEYS[split])
        index = torch.arange(self.num_clients, dtype=torch.int64)
        draw = counter_uniform(self.seed, _SPLIT_KEYS[split], _SIZE, index)
        self._sizes = lo + (draw * (hi - lo + 1)).long().clamp_max(hi - lo)
        features = math.prod(self.input_shape)
        clusters = torch.arange(self.num_clusters)
        if task == "image":  # (clusters, classes, F): one prototype per cluster and class; the noise's mixing (d, F)
            self._z_grid, mixing_grid, sum_grid = _image_grids(self.latent_dim, owner)
            self._prototypes = _on_grid(counter_normal(self.seed, _PROTOTYPE, clusters[:, None, None],
                                                       torch.arange(self.num_classes)[None, :, None],
                                                       torch.arange(features)[None, None]), 1.0, sum_grid).float()
            sd = 1 / math.sqrt(self.latent_dim)
            self._mixing = _on_grid(counter_normal(self.seed, _MIXING, torch.arange(self.latent_dim)[:, None],
                                                   torch.arange(features)[None]) * sd, sd, mixing_grid).float()
            # the prototypes as rows of one table, and a zero row last for the padding
            self._table = torch.cat([self._prototypes.reshape(-1, features), self._prototypes.new_zeros(1, features)])
        else:  # (clusters, F), the same for every split: the val and test clients follow the training clusters
            self._weights = counter_normal(self.seed, _WEIGHTS, clusters[:, None], torch.arange(features)[None]).float()

    @property
    def sizes(self) -> Tensor:
        return self._sizes

    def clusters(self, index: Sequence[int] | Tensor) -> Tensor:
        """int64: the cluster of each client at ``index``."""
        rows = torch.as_tensor(index, dtype=torch.int64)
        return (counter_uniform(*self._key, _CLUSTER, rows) * self.num_clusters).long().clamp_max(self.num_clusters - 1)

    def rows(self, index: Sequence[int]) -> tuple[Tensor, Tensor, Tensor]:
        rows = torch.as_tensor(index, dtype=torch.int64)
        if rows.ndim != 1 or not len(rows):
            raise ValueError(f"{type(self).__name__}.rows: needs a non-empty list of client indices, got {index!r}")
        if int(rows.min()) < 0 or int(rows.max()) >= self.num_clients:
            raise IndexError(f"client indices {int(rows.min())}..{int(rows.max())} out of range for a population of "
                             f"{self.num_clients} clients")
        sizes = self._sizes[rows]
        width = int(sizes.max())
        mask = torch.arange(width)[None] < sizes[:, None]
        features = math.prod(self.input_shape)
        # the real samples only, in the padded layout's order: sample s is example j[s] of client who[s] (a third
        # of the padded entries of 1-4 samples per client are padding); each draw keeps its counters, so the
        # values are those of the padded computation, and the padding is 0
        at, j = mask.nonzero(as_tuple=True)
        who = rows[at]
        cluster = self.clusters(who)
        if self.task == "image":  # noise of rank latent_dim: latent_dim hashes per sample, not one per pixel
            z = _on_grid(counter_normal(*self._key, _X, who[:, None],
                                        j[:, None] * self.latent_dim + torch.arange(self.latent_dim)[None]),
                         1.0, self._z_grid).float()
            label = (counter_uniform(*self._key, _LABEL, who, j) * self.num_classes).long()
            label = label.clamp_max(self.num_classes - 1)
            # written in the padded layout at once: the padding takes the table's zero row and z = 0; the sum of the
            # prototype and A z is exact on the grids (_image_grids), so one product over the block gives each sample
            # the bits it has alone
            slots = at * width + j
            latent = z.new_zeros((len(rows) * width, self.latent_dim))
            latent[slots] = z
            which = torch.full((len(rows) * width,), len(self._table) - 1, dtype=torch.int64)
            which[slots] = cluster * self.num_classes + label
            x = torch.index_select(self._table, 0, which).addmm_(latent, self._mixing)
            y = label.new_zeros(len(rows) * width)
            y[slots] = label
            return x.view(len(rows), width, *self.input_shape), y.view(len(rows), width), mask
        else:  # one hash per (sample, feature) entry
            flat = counter_normal(*self._key, _X, who[:, None],
                                  j[:, None] * features + torch.arange(features)[None]).float()
            signal = (flat * self._weights[cluster]).sum(-1)
            if self.task == "regression":
                flat_y = signal + self.noise * counter_normal(*self._key, _Y, who, j).float()
            else:  # logistic: P(y = 1) = sigmoid(signal / noise), drawn by inverting a uniform
                u = counter_uniform(*self._key, _Y, who, j).float()
                flat_y = (u < torch.sigmoid(signal / self.noise)).float()
        x = flat.new_zeros((len(rows), width, features))
        x[at, j] = flat
        y = flat_y.new_zeros((len(rows), width))
        y[at, j] = flat_y
        return x.view(len(rows), width, *self.input_shape), y, mask


#: float32's significand (bits): an integer multiple of a grid step 2^-f up to 2^24 steps is exact
_FLOAT32_BITS = 24
#: draws are clamped at this many standard deviations (the normal quantiles of counter_uniform's draws stay within
#: 8.21, so the clamp moves draws of probability about 1e-15 each)
_CLAMP = 8.0
#: the coarsest grid allowed for z (bits below 1: 1/16)
_MIN_Z_BITS = 4


def _image_grids(latent_dim: int, owner: str) -> tuple[float, float, float]:
    """``(z grid, A grid, sum grid)`` of the ``"image"`` task with ``latent_dim`` = d: steps (powers of two) on which
    ``prototype + A z`` is exact in float32 in any order of summation. Every term ``A_fd z_d`` and the prototype are
    integer multiples of the sum grid ``2^-f`` (the product of the two other steps), and every partial sum is at most
    ``8 + d * 8 * 8 / sqrt(d)`` in magnitude (the clamps), below ``2^24`` steps. The bits left are shared so that z
    and A have about the same resolution relative to their standard deviations (1 and 1 / sqrt(d)): for d = 16, z
    to 1/64, A to 2^-9 (1/128 of its 1/4), prototypes to 2^-15. A d so large that z's grid would be coarser than
    1/16 is refused."""
    bits, z_bits = _grid_bits(latent_dim)
    if z_bits < _MIN_Z_BITS:
        largest, above = 1, latent_dim  # z_bits does not grow with d: the largest d allowed, by bisection
        while above - largest > 1:
            middle = (largest + above) // 2
            largest, above = (middle, above) if _grid_bits(middle)[1] >= _MIN_Z_BITS else (largest, middle)
        raise ValueError(f"{owner}: latent_dim={latent_dim} is not allowed: at most {largest} (the images' noise is "
                         "summed exactly in float32, which leaves too few bits for a larger rank)")
    return 2.0**-z_bits, 2.0**-(bits - z_bits), 2.0**-bits


def _grid_bits(latent_dim: int) -> tuple[int, int]:
    """``(bits, z_bits)`` of :func:`_image_grids`: the sum grid ``2^-bits``, z's ``2^-z_bits``."""
    bound = _CLAMP + latent_dim * _CLAMP * _CLAMP / math.sqrt(latent_dim)
    bits = math.floor(_FLOAT32_BITS - math.log2(bound))  # bound * 2^bits <= 2^24
    scale = math.floor(math.log2(math.sqrt(latent_dim)))  # A's standard deviation is about 2^-scale
    return bits, (bits - scale) // 2


def _on_grid(draws: Tensor, sd: float, step: float) -> Tensor:
    """float64 ``draws`` of standard deviation ``sd`` rounded to ``step`` and clamped at the last step within
    :data:`_CLAMP` of it (clamped after the rounding: a rounded value never exceeds the bound the grids assume)."""
    limit = math.floor(_CLAMP * sd / step)
    return (draws / step).round().clamp(-limit, limit) * step


class SyntheticPopulationDataModule(FederatedDataModule):
    """A :class:`SyntheticPopulation` per split: a population of ``num_clients`` training clients at the memory
    cost of its sizes (8 bytes per client), for the round at scale (module docstring). Its splits are not pooled
    (:meth:`concatenated` refuses a population: it would build every client), so it has no centralized view.

    Args:
        num_clients: training clients (e.g. 1,000,000).
        num_val_clients: validation clients (their own population, ids ``val-<i>``).
        num_test_clients: test clients (0: none).
        task: ``"regression"`` (the hospital MLP's shape: 3 features, one target), ``"binary"`` (logistic
            regression) or ``"image"`` (class-prototype images, e.g. CIFAR-10's shape).
        samples: ``[min, max]`` samples per client, uniform.
        input_shape: one sample's shape (default: ``[3]``; ``[3, 32, 32]`` for CIFAR-10's).
        num_clusters: clusters of clients sharing a model.
        num_classes: classes of the ``"image"`` task.
        noise: label noise (:class:`SyntheticPopulation`).
        latent_dim: the rank of the images' noise (:class:`SyntheticPopulation`).
        batch_size: as :class:`~lightning_dp.datamodules.federated.FederatedDataModule`.
        num_workers: as :class:`~lightning_dp.datamodules.federated.FederatedDataModule`.
        seed: the seed that generates the data (public).
    """

    def __init__(self, num_clients: int = 1_000_000, num_val_clients: int = 100, num_test_clients: int = 0, *,
                 task: SyntheticTask = "regression", samples: Sequence[int] = (1, 4),
                 input_shape: Optional[Sequence[int]] = None, num_clusters: int = 1, num_classes: int = 10,
                 noise: float = 0.1, latent_dim: int = 16, batch_size: int = 64, num_workers: int = 0,
                 seed: int = 0) -> None:
        super().__init__(batch_size=batch_size, num_workers=num_workers, seed=seed)
        owner = type(self).__name__
        checks.positive_int("num_clients", num_clients, owner=owner)
        checks.positive_int("num_val_clients", num_val_clients, owner=owner)
        checks.non_negative_int("num_test_clients", num_test_clients, owner=owner)
        shape = tuple(input_shape) if input_shape is not None else ((3, 32, 32) if task == "image" else (3,))
        self._args: dict[str, Any] = dict(task=task, seed=seed, samples=tuple(samples), input_shape=shape,
                                          num_clusters=num_clusters, num_classes=num_classes, noise=noise,
                                          latent_dim=latent_dim)
        self._counts = {"train": num_clients, "val": num_val_clients, "test": num_test_clients}
        SyntheticPopulation(0, **self._args)  # validates the arguments now, before setup
        self.task = "regression" if task == "regression" else "classification"
        self.num_classes = None if task == "regression" else (2 if task == "binary" else num_classes)
        self.input_shape = shape
        self.save_hyperparameters()

    def _build_clients(self):
        made = [SyntheticPopulation(self._counts[s], split=s, **self._args) for s in ("train", "val", "test")]
        return made[0], made[1], made[2]
