"""Privacy accountants for DP-SGD: thin, cached adapters over Google's ``dp_accounting``.

The spend is a pure function of the run-length encoded history ``[(noise_multiplier, sample_rate, num_steps),
...]``, translated into one ``dp_accounting`` event: ``"pld"`` (:class:`PLDAccountant`, the default, an upper
bound) or ``"rdp"`` (:class:`RDPAccountant`). The module-level caches replay the library's exact floating-point
operations: they change the cost, never the number. Adjacency, the event, the references and the caches:
docs/privacy.md, "The accountants".
"""

from __future__ import annotations

import abc
import contextlib
import copy
import logging
import math
from collections import OrderedDict
from collections.abc import Hashable, Iterator, Sequence
from typing import Any, ClassVar

import numpy as np
from dp_accounting import dp_event
from dp_accounting.pld import privacy_loss_distribution
from dp_accounting.privacy_accountant import NeighboringRelation
from dp_accounting.rdp import rdp_privacy_accountant

from lightning_dp import checks
from lightning_dp.privacy.pld_arrays import (
    epsilon_for_delta,
    gaussian_pld,
    mixture_gaussian_pld,
    self_compose,
    truncated_gaussian_pld,
)
from lightning_dp.privacy.noise import check_noise_multiplier
from lightning_dp.privacy.registry import Registry
from lightning_dp.privacy.sampling import check_sample_rate

__all__ = [
    "ACCOUNTANTS",
    "ADJACENCIES",
    "DisjointPairPLDAccountant",
    "Accountant",
    "HistoryEntry",
    "PLDAccountant",
    "USER_ACCOUNTING",
    "binomial_sensitivities",
    "check_examples_per_user",
    "group_epsilon",
    "RDPAccountant",
    "check_adjacency",
    "check_delta",
    "check_target_epsilon",
    "clear_caches",
    "get_accountant",
    "history_to_dp_event",
]

HistoryEntry = tuple[float, float, int]
"""One run of identical DP-SGD steps: ``(noise_multiplier, sample_rate, num_steps)``."""

ADJACENCIES = {"add_remove": NeighboringRelation.ADD_OR_REMOVE_ONE, "replace": NeighboringRelation.REPLACE_ONE}
"""Neighbouring relations by name: ``add_remove`` (the default) and ``replace``."""


def check_adjacency(adjacency: Any) -> str:
    """Validates an adjacency name (``"add_remove"`` or ``"replace"``)."""
    if adjacency not in ADJACENCIES:
        raise ValueError(
            f"adjacency={adjacency!r} is not allowed; choose 'add_remove' (datasets differ by one example added or "
            "removed: the usual DP-SGD guarantee) or 'replace' (one example replaced by another: twice the "
            "sensitivity of a clipped sum, a larger epsilon for the same noise)."
        )
    return str(adjacency)


USER_ACCOUNTING = ("mixture", "group", "users")
"""How an accountant states a user-level spend (``examples_per_user`` set). Example-level sampling of users' bounded
records (ELS): ``"mixture"`` (the user's sampled records as one mixture-of-Gaussians mechanism, Charles et al.
2025's ELS accountant) or ``"group"`` (group privacy of the example-level guarantee, the papers' baseline). User-level
sampling (ULS): ``"users"`` (users Poisson-sampled and clipped as units: each step is the Poisson-subsampled Gaussian
at the users' rate, the example-level event with users for examples)."""


def check_examples_per_user(examples_per_user: Any, *, name: str = "examples_per_user") -> int | None:
    """``examples_per_user`` as an int >= 1 (the most records a user contributes), or None (example-level)."""
    if examples_per_user is None:
        return None
    if not checks.is_int(examples_per_user) or examples_per_user < 1:
        raise ValueError(
            f"{name}={examples_per_user!r} is not allowed: pass a whole number >= 1, the most records one user "
            "contributes (a user's other records are left out before training), or None for example-level privacy.")
    return int(examples_per_user)


def binomial_sensitivities(examples_per_user: int, sample_rate: float) -> tuple[list[float], list[float]]:
    """Sensitivities ``0..k`` (in units of C) and their Binomial(k, q) probabilities: how many of a user's ``k``
    records one Poisson-sampled batch holds, each adding a clipped gradient (norm <= C) to the sum.

    Example:
        >>> binomial_sensitivities(2, 0.5)
        ([0.0, 1.0, 2.0], [0.25, 0.5, 0.25])
    """
    k, q = int(examples_per_user), float(sample_rate)
    return ([float(j) for j in range(k + 1)], [math.comb(k, j) * q**j * (1.0 - q) ** (k - j) for j in range(k + 1)])


def group_epsilon(delta_for_epsilon: Any, group_size: int, delta: float, *, tolerance: float = 1e-6) -> float:
    """The group-privacy epsilon of a group of ``group_size`` from an example-level privacy profile.

    An ``(eps, delta_ex(eps))``-DP mechanism is ``(k eps, k e^((k-1) eps) delta_ex(eps))``-DP for neighbours that
    differ in ``k`` examples (Dwork & Roth 2014, Theorem 2.2 with its delta term; Vadhan 2017, Lemma 2.2). The group
    delta is not monotone in ``eps`` (``delta_ex`` falls, the factor grows; a pessimistic profile never falls below
    its truncated mass, so a large ``eps`` fails too): the smallest ``k eps`` meeting ``delta`` is searched on a
    geometric grid of 400 values of ``eps`` in ``[1e-4, 100]``, then refined by bisection below the first one
    that meets it. Every value returned was evaluated to meet ``delta`` (sound whatever the profile's shape; a
    window of ``eps`` narrower than the grid's 3.5 % steps can be missed, which over-reports); ``inf`` when no
    grid value meets it.

    Args:
        delta_for_epsilon: ``eps -> delta_ex(eps)`` of the example-level mechanism (an upper bound), taking a
            list of epsilons and returning their deltas.
        group_size: ``k >= 1``.
        delta: the group's delta.

    Example:
        >>> import math
        >>> profile = lambda eps: [1e-6 * math.exp(-e) for e in eps]
        >>> round(group_epsilon(profile, 1, 1e-7), 4)  # k = 1: the profile's own epsilon, ln 10
        2.3026
    """
    k = int(group_size)
    log_target = math.log(delta) - math.log(k)

    def log_group_delta(epsilons: np.ndarray) -> np.ndarray:
        with np.errstate(all="ignore"):  # the library's exp(eps) * mass at large eps; log(0) = -inf meets any delta
            deltas = np.asarray(delta_for_epsilon(list(map(float, epsilons))), float)
            return (k - 1) * epsilons + np.log(np.maximum(deltas, 0.0))

    grid = np.concatenate([[0.0], np.geomspace(1e-4, 100.0, 400)])
    meets = log_group_delta(grid) <= log_target
    if not meets.any():
        return math.inf
    first = int(np.argmax(meets))
    if first == 0:
        return 0.0
    low, high = float(grid[first - 1]), float(grid[first])
    while high - low > tolerance * high:
        middle = (low + high) / 2
        if log_group_delta(np.array([middle]))[0] <= log_target:
            high = middle
        else:
            low = middle
    return k * high


# --------------------------------------------------------------------------- validation


def _check_num_steps(num_steps: Any, *, name: str = "num_steps", minimum: int = 1) -> int:
    if not checks.is_int(num_steps) or num_steps < minimum:
        raise ValueError(
            f"{name} must be an integer >= {minimum}, got {num_steps!r}. Pass a whole number of DP-SGD steps."
        )
    return int(num_steps)


def check_delta(delta: Any, *, name: str = "delta") -> float:
    """``delta`` as a float in (0, 1), else a ValueError naming ``name`` (every component's delta check)."""
    if not checks.is_real(delta) or not 0 < delta < 1:
        raise ValueError(
            f"{name} must be a number in (0, 1), got {delta!r}. Delta is the probability mass allowed to exceed "
            "the epsilon bound; use delta well below 1 / dataset_size (for example 1e-5 for 60 000 examples)."
        )
    return float(delta)


def check_target_epsilon(target_epsilon: Any, *, name: str = "target_epsilon", finite: bool = False) -> float:
    """``target_epsilon`` as a float > 0, else a ValueError naming ``name`` (every component's budget check);
    ``finite``: infinity is refused too (a component whose budget is optional takes None for none)."""
    if not checks.is_real(target_epsilon) or math.isnan(target_epsilon) or target_epsilon <= 0:
        raise ValueError(
            f"{name} must be a number > 0, got {target_epsilon!r}. It is the privacy budget epsilon; "
            "common choices are 1 to 8."
        )
    if finite and math.isinf(target_epsilon):
        raise ValueError(f"{name} must be finite, got {target_epsilon!r}: pass None for no budget.")
    return float(target_epsilon)


_check_target_epsilon = check_target_epsilon  # the name before it was public (lightning_dp.privacy.calibration)


def _append(history: tuple[HistoryEntry, ...], entry: HistoryEntry) -> tuple[HistoryEntry, ...]:
    """Appends ``entry`` to a run-length encoded history, merging with an equal last run."""
    sigma, q, n = entry
    if history and history[-1][0] == sigma and history[-1][1] == q:
        return history[:-1] + ((sigma, q, history[-1][2] + n),)
    return history + (entry,)


def history_to_dp_event(history: Sequence[HistoryEntry], examples_per_user: int | None = None,
                        truncation: tuple[int, int] | None = None) -> dp_event.DpEvent:
    """Translates a DP-SGD history into the ``dp_accounting`` event it stands for.

    Args:
        history: Run-length encoded ``(noise_multiplier, sample_rate, num_steps)`` entries.
        examples_per_user: ``k`` for the user-level event of example-level sampling over users' records bounded to
            ``k`` (ELS): each step is ``MixtureOfGaussiansDpEvent(sigma, 0..k, Binomial(k, q))``, and a full batch
            (``q == 1``) the Gaussian mechanism with sensitivity ``k``, ``GaussianDpEvent(sigma / k)``.
        truncation: ``(dataset_size, truncated_batch_size)`` of batches of one shape (Poisson sampling truncated to
            at most ``truncated_batch_size`` records, a uniformly random subset kept when more are drawn): each step
            is ``TruncatedSubsampledGaussianDpEvent(dataset_size, q, truncated_batch_size, sigma)``.

    Returns:
        ``ComposedDpEvent`` of one ``SelfComposedDpEvent(PoissonSampledDpEvent(q,
        GaussianDpEvent(sigma)), n)`` per entry; a plain ``GaussianDpEvent(sigma)`` is
        used when ``q == 1`` (no sampling).

    Example:
        >>> from dp_accounting.rdp import RdpAccountant
        >>> event = history_to_dp_event([(1.0, 0.01, 100)])
        >>> float(RdpAccountant().compose(event).get_epsilon(1e-5)) > 0
        True
    """
    events: list[dp_event.DpEvent] = []
    for sigma, q, n in history:
        if truncation is not None:
            size, cap = truncation
            events.append(dp_event.SelfComposedDpEvent(
                dp_event.TruncatedSubsampledGaussianDpEvent(int(size), float(q), int(cap), float(sigma)), int(n)))
            continue
        if examples_per_user is not None:
            k = int(examples_per_user)
            single = (dp_event.GaussianDpEvent(float(sigma) / k) if q == 1.0 else
                      dp_event.MixtureOfGaussiansDpEvent(float(sigma), *binomial_sensitivities(k, q)))
            events.append(dp_event.SelfComposedDpEvent(single, int(n)))
            continue
        gaussian = dp_event.GaussianDpEvent(float(sigma))
        single = gaussian if q == 1.0 else dp_event.PoissonSampledDpEvent(float(q), gaussian)
        events.append(dp_event.SelfComposedDpEvent(single, int(n)))
    return dp_event.ComposedDpEvent(events)


# --------------------------------------------------------------------------- caches


class _LRUCache:
    """A small least-recently-used mapping (``functools.lru_cache`` cannot look up prefixes)."""

    def __init__(self, maxsize: int) -> None:
        self.maxsize = maxsize
        self._data: OrderedDict[Hashable, Any] = OrderedDict()

    def get(self, key: Hashable) -> Any:
        value = self._data.get(key)
        if value is not None:
            self._data.move_to_end(key)
        return value

    def put(self, key: Hashable, value: Any) -> None:
        self._data[key] = value
        self._data.move_to_end(key)
        while len(self._data) > self.maxsize:
            self._data.popitem(last=False)

    def clear(self) -> None:
        self._data.clear()

    def __len__(self) -> int:
        return len(self._data)


# Floats are cheap; distributions can weigh tens of MB each (more for sigma < 0.5).
_EPSILON_CACHE = _LRUCache(maxsize=4096)
_PLD_SINGLE_STEP_CACHE = _LRUCache(maxsize=8)
_PLD_COMPOSED_CACHE = _LRUCache(maxsize=4)
_RDP_SINGLE_STEP_CACHE = _LRUCache(maxsize=256)


def clear_caches() -> None:
    """Empties every accounting cache (epsilons, privacy loss distributions, RDP curves).

    Only memory and time change: the next query recomputes the identical numbers.
    """
    for cache in (_EPSILON_CACHE, _PLD_SINGLE_STEP_CACHE, _PLD_COMPOSED_CACHE, _RDP_SINGLE_STEP_CACHE):
        cache.clear()


def _no_coarse() -> None:
    """``_coarse_kwargs`` of the cheaper variant inside :meth:`Accountant.max_steps`: none (a subclass whose variant
    would have one of its own would otherwise recurse without end)."""
    return None


# --------------------------------------------------------------------------- base class


class Accountant(abc.ABC):
    """Tracks the privacy spend of DP-SGD steps (add/remove adjacency, Poisson sampling).

    Subclasses define :attr:`name`, their JSON-able configuration and the canonical
    epsilon of a history; this base class holds the history, validation, the epsilon
    cache, the step budget search and checkpointing.

    Attributes:
        name: Registry name of the accountant (``"pld"``, ``"rdp"``), stored in the state.
    """

    name: ClassVar[str]

    def __init__(self, adjacency: str = "add_remove") -> None:
        self._history: tuple[HistoryEntry, ...] = ()
        self.adjacency = check_adjacency(adjacency)

    #: The most records one user contributes where the spend is stated per user (None: per example).
    examples_per_user: int | None = None
    #: How a user-level spend is stated (:data:`USER_ACCOUNTING`); unused per example.
    user_accounting: str = "mixture"

    @property
    def privacy_unit(self) -> str:
        """``"user"`` where the spend is stated per user (``examples_per_user`` set), else ``"example"``."""
        return "example" if self.examples_per_user is None else "user"

    def unit_key(self) -> tuple[Any, ...]:
        """What the spend's neighbours are: unit, ``k``, the user-level statement and the adjacency (histories of
        accountants with different keys measure different neighbours and do not compose)."""
        if self.examples_per_user is None:
            return ("example", self.adjacency)
        return ("user", self.examples_per_user, self.user_accounting, self.adjacency)

    @property
    def neighboring_relation(self) -> NeighboringRelation:
        """The ``dp_accounting`` neighbouring relation of :attr:`adjacency`."""
        return ADJACENCIES[self.adjacency]

    def check_supported(self, sample_rate: float) -> None:
        """Raises ValueError for a sampling rate the accountant cannot analyse under its adjacency (call it
        before training: :meth:`step` raises the same error, too late to be harmless)."""

    def _entry(self, noise_multiplier: Any, sample_rate: Any, num_steps: Any) -> HistoryEntry:
        entry = (check_noise_multiplier(noise_multiplier), check_sample_rate(sample_rate), _check_num_steps(num_steps))
        self.check_supported(entry[1])
        return entry

    # ------------------------------------------------------------------ subclass hooks

    @abc.abstractmethod
    def _config(self) -> dict[str, Any]:
        """The configuration that changes epsilon, as plain JSON-able Python types."""

    @abc.abstractmethod
    def _load_config(self, state: dict[str, Any]) -> None:
        """Restores (and validates) the configuration from a state dict."""

    @abc.abstractmethod
    def _compute_epsilon(self, history: tuple[HistoryEntry, ...], delta: float) -> float:
        """The canonical epsilon of a non-empty history; identical to the library's."""

    def _coarse_kwargs(self) -> dict[str, Any] | None:
        """Constructor arguments of a cheaper, more pessimistic variant, or ``None``.

        Calibration uses it only to find a starting point; every accepted value is
        checked with this accountant's own configuration.
        """
        return None

    def _interim_kwargs(self) -> dict[str, Any] | None:
        """The configuration of :meth:`interim_epsilon`'s cheaper variant (an upper bound too), or ``None``."""
        return self._coarse_kwargs()

    def _config_key(self) -> Hashable:
        return (self.adjacency,) + tuple((key, tuple(value) if isinstance(value, list) else value)
                                        for key, value in self._config().items())

    # ------------------------------------------------------------------ public API

    @property
    def history(self) -> list[HistoryEntry]:
        """Run-length encoded ``(noise_multiplier, sample_rate, num_steps)`` entries (a copy).

        Consecutive steps with the same ``(noise_multiplier, sample_rate)`` are merged.
        """
        return list(self._history)

    def step(self, *, noise_multiplier: float, sample_rate: float, num_steps: int = 1) -> None:
        """Records ``num_steps`` DP-SGD steps with noise multiplier sigma and sampling rate q.

        Args:
            noise_multiplier: sigma > 0, noise standard deviation over the clipping norm.
            sample_rate: Poisson sampling rate q in (0, 1]; 1.0 means no sampling.
            num_steps: Number of steps (>= 1).

        Raises:
            ValueError: If an argument is outside its range.
        """
        self._history = _append(self._history, self._entry(noise_multiplier, sample_rate, num_steps))

    def get_epsilon(self, delta: float) -> float:
        """Epsilon spent by the whole history at the given delta.

        Args:
            delta: Target delta in (0, 1).

        Returns:
            The smallest epsilon the accountant can certify for ``(epsilon, delta)``-DP
            under add/remove adjacency (``0.0`` for an empty history; ``inf`` if no finite
            epsilon exists at that delta).
        """
        return self._epsilon(self._history, check_delta(delta))

    def interim_epsilon(self, delta: float) -> float:
        """Epsilon of the whole history from the accountant's cheaper variant (:meth:`get_epsilon` where it has none).

        For the writes between a run's first and last (a federated round writes its spend at Lightning's logging
        cadence): the PLD at discretization 1e-3 instead of 1e-4 builds and composes 5-10 times faster
        (docs/benchmarks.md). Its pessimistic estimate is an upper bound of the true epsilon as the fine one is, so
        an interim write never under-reports; it is usually the larger (2 % at epsilon 0.23, 6e-6 at 29.7, for
        1,000 rounds at z = 1) but not always (a coarser grid need not be the looser bound). The run's final spend
        is always :meth:`get_epsilon`.

        Args:
            delta: Target delta in (0, 1).
        """
        coarse = self._interim_kwargs()
        if coarse is None or not self._history:
            return self.get_epsilon(delta)
        sibling = copy.copy(self)  # the same history and adjacency; _load_config rebinds, never mutates, attributes
        sibling._load_config({**self._config(), **coarse})  # noqa: SLF001
        if not getattr(sibling, "pessimistic_estimate", True):
            raise AssertionError("an interim epsilon must be an upper bound (a pessimistic estimate)")
        return sibling.get_epsilon(delta)

    def epsilon_after(
        self, delta: float, *, noise_multiplier: float, sample_rate: float, num_steps: int = 1
    ) -> float:
        """Epsilon that the history plus ``num_steps`` more steps would spend; records nothing.

        Args:
            delta: Target delta in (0, 1).
            noise_multiplier: sigma > 0 of the hypothetical steps.
            sample_rate: q in (0, 1] of the hypothetical steps.
            num_steps: Number of hypothetical steps (>= 1).

        Returns:
            Exactly the value :meth:`get_epsilon` would return after the corresponding
            :meth:`step` call.
        """
        return self._epsilon(_append(self._history, self._entry(noise_multiplier, sample_rate, num_steps)),
                             check_delta(delta))

    def max_steps(
        self, target_epsilon: float, delta: float, *, noise_multiplier: float, sample_rate: float, limit: int
    ) -> int:
        """The largest number of further steps that keeps the spend within ``target_epsilon``.

        Epsilon is non-decreasing in the number of steps, so an exponential search
        followed by a binary search finds the largest ``k`` in ``[0, limit]`` with
        ``epsilon_after(delta, ..., num_steps=k) <= target_epsilon``. Every returned
        ``k > 0`` has been evaluated, so the spend after ``k`` steps never exceeds the
        target; unless ``k == limit``, ``k + 1`` steps were evaluated to exceed it.
        ``0`` means that not even one more step fits (or the budget is already spent).
        Where the accountant has a cheaper variant (the PLD's coarser grid), the search runs
        with it first, and the search at this accountant's own configuration starts from its
        answer (the same result, from fewer of its own evaluations).

        Args:
            target_epsilon: The budget (> 0).
            delta: Target delta in (0, 1).
            noise_multiplier: sigma > 0 of the further steps.
            sample_rate: q in (0, 1] of the further steps.
            limit: Upper end of the search (>= 0), e.g. the remaining steps of training.

        Returns:
            The number of further steps ``k`` that fit into the budget.
        """
        target_epsilon = _check_target_epsilon(target_epsilon)
        delta = check_delta(delta)
        sigma, q, _ = self._entry(noise_multiplier, sample_rate, 1)
        limit = _check_num_steps(limit, name="limit", minimum=0)

        def fits(k: int) -> bool:
            return self._epsilon(_append(self._history, (sigma, q, k)), delta) <= target_epsilon

        if limit == 0:
            return 0
        guess = 0
        coarse = self._coarse_kwargs()
        if coarse is not None and limit > 2:
            # The same search with the cheaper variant (the PLD at 1e-3: 5-10 times cheaper a query) gives a guess;
            # the search at this accountant's own configuration then starts from it instead of from one step: two
            # queries where the guess is the answer (k fits, k + 1 does not), a few more where the coarser grid
            # put it a few steps short or beyond (it need not be the looser bound). The README's first fit spent
            # 0.7 s in eleven queries here.
            sibling = copy.copy(self)  # the same history; _load_config rebinds, never mutates, attributes
            sibling._load_config({**self._config(), **coarse})  # noqa: SLF001
            sibling._coarse_kwargs = _no_coarse  # type: ignore[method-assign]  # one level: no variant of the variant
            guess = sibling.max_steps(target_epsilon, delta, noise_multiplier=noise_multiplier,
                                      sample_rate=sample_rate, limit=limit)
        if guess and not fits(guess):  # down from the guess, doubling the step: the first k that fits
            bad, step = guess, 1
            probe = bad - step
            while probe >= 1 and not fits(probe):
                bad, step = probe, 2 * step
                probe = bad - step
            if probe < 1:
                if not fits(1):
                    return 0
                probe = 1
            good = probe
        else:  # up from the guess (or from one step), doubling the step: the first k that does not fit
            if not guess:
                if not fits(1):
                    return 0
                guess = 1
            good, step = guess, 1  # invariant: fits(good); the first failing k lies above good
            probe = good + step
            while probe < limit and fits(probe):
                good, step = probe, 2 * step
                probe = good + step
            if probe >= limit:
                if fits(limit):
                    return limit
                probe = limit
            bad = probe  # not fits(bad)
        while bad - good > 1:
            middle = (good + bad) // 2
            if fits(middle):
                good = middle
            else:
                bad = middle
        return good

    def to_dp_event(self) -> dp_event.DpEvent:
        """The ``dp_accounting`` event of the recorded history (see :func:`history_to_dp_event`)."""
        return history_to_dp_event(self._history)

    def state_dict(self) -> dict[str, Any]:
        """The accountant as plain Python types (JSON and ``torch.load(weights_only=True)`` safe).

        Returns:
            ``{"name": ..., "history": [[sigma, q, n], ...], **configuration}``.
        """
        return {
            "name": self.name,
            "history": [[sigma, q, n] for sigma, q, n in self._history],
            "adjacency": self.adjacency,
            **self._config(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores the history and configuration saved by :meth:`state_dict`.

        Args:
            state: A dict produced by :meth:`state_dict` of an accountant with the same name.

        Raises:
            ValueError: If the state belongs to another accountant or is malformed.
        """
        if not isinstance(state, dict):
            raise ValueError(f"state must be a dict from Accountant.state_dict(), got {type(state).__name__}.")
        saved_name = state.get("name")
        if saved_name != self.name:
            raise ValueError(
                f"Cannot load a state saved by the {saved_name!r} accountant into the {self.name!r} accountant: "
                "the spend is only reproducible with the accountant that computed it. Create the matching one "
                f"with get_accountant({saved_name!r}) (allowed names: {sorted(ACCOUNTANTS)})."
            )
        saved_adjacency = state.get("adjacency", "add_remove")  # states written before the setting: add/remove
        if saved_adjacency != self.adjacency:
            raise ValueError(
                f"Cannot load a privacy history accounted under adjacency={saved_adjacency!r} into an accountant "
                f"with adjacency={self.adjacency!r}: the guarantee would change meaning mid-run. Resume with "
                f"adjacency={saved_adjacency!r}."
            )
        raw_history = state.get("history", [])
        if not isinstance(raw_history, (list, tuple)):
            raise ValueError(f"state['history'] must be a list of [sigma, q, num_steps], got {raw_history!r}.")
        history: tuple[HistoryEntry, ...] = ()
        for raw in raw_history:
            if not isinstance(raw, (list, tuple)) or len(raw) != 3:
                raise ValueError(f"Each history entry must be [sigma, q, num_steps], got {raw!r}.")
            history = _append(history, self._entry(raw[0], raw[1], raw[2]))
        self._load_config(state)
        self._history = history

    def __len__(self) -> int:
        """Total number of recorded steps."""
        return sum(n for _, _, n in self._history)

    def __repr__(self) -> str:
        items = {**({"adjacency": self.adjacency} if self.adjacency != "add_remove" else {}), **self._config()}
        config = ", ".join(f"{key}={value!r}" for key, value in items.items() if key != "orders")
        return f"{type(self).__name__}({config}{', ' if config else ''}steps={len(self)})"

    # ------------------------------------------------------------------ internals

    def _epsilon(self, history: tuple[HistoryEntry, ...], delta: float) -> float:
        if not history:
            return 0.0
        key = (self.name, self._config_key(), history, delta)
        epsilon = _EPSILON_CACHE.get(key)
        if epsilon is None:
            epsilon = float(self._compute_epsilon(history, delta))
            _EPSILON_CACHE.put(key, epsilon)
        return epsilon


# --------------------------------------------------------------------------- PLD


class PLDAccountant(Accountant):
    """Privacy loss distribution accountant (``dp_accounting.pld``), pessimistic estimate.

    Composes discretized privacy loss distributions by FFT convolution; the
    pessimistic "connect the dots" discretization (Doroshenko et al., PETS 2022) makes
    the reported epsilon an upper bound of the true one, within about the
    discretization interval times the number of compositions (in practice much less).
    Both the add and the remove direction are tracked; the larger epsilon is reported.

    Args:
        value_discretization_interval: Grid spacing of the privacy losses (> 0, default
            ``1e-4``, the library default). Smaller is tighter and slower. Saved in the state.
        truncated_batch_size, dataset_size: batches of one shape (DPSGD's ``max_batch_size``): each step samples
            every one of ``dataset_size`` records with probability q and keeps a uniformly random subset of
            ``truncated_batch_size`` when more are drawn; accounted as dp-accounting's
            ``TruncatedSubsampledGaussianDpEvent`` (arXiv 2508.15089: a mixture of the sampled Gaussian and, when
            the batch overflows, a sensitivity-2 one). Add/remove, example-level only. Saved in the state.

    Example:
        >>> accountant = PLDAccountant(value_discretization_interval=1e-3)
        >>> accountant.step(noise_multiplier=1.0, sample_rate=0.01, num_steps=100)
        >>> 0.0 < accountant.get_epsilon(1e-5) < 1.0
        True
    """

    name = "pld"

    def __init__(self, value_discretization_interval: float = 1e-4, adjacency: str = "add_remove",
                 pessimistic_estimate: bool = True, examples_per_user: int | None = None,
                 user_accounting: str = "mixture", truncated_batch_size: int | None = None,
                 dataset_size: int | None = None) -> None:
        super().__init__(adjacency)
        self.value_discretization_interval = self._check_interval(value_discretization_interval)
        # False gives dp-accounting's optimistic estimate, a LOWER bound of the true epsilon: never for reporting a
        # spend, only where a lower bound is what is wanted (the epsilon of a curve an audit refuted)
        self.pessimistic_estimate = bool(pessimistic_estimate)
        self.examples_per_user, self.user_accounting = self._check_unit(examples_per_user, user_accounting,
                                                                        self.adjacency)
        self.truncation = self._check_truncation(truncated_batch_size, dataset_size)

    def _check_truncation(self, truncated_batch_size: Any, dataset_size: Any) -> tuple[int, int] | None:
        """``(dataset_size, truncated_batch_size)`` of batches of one shape, or None (plain Poisson sampling)."""
        if truncated_batch_size is None and dataset_size is None:
            return None
        if truncated_batch_size is None or dataset_size is None:
            raise ValueError(f"truncated_batch_size={truncated_batch_size!r} and dataset_size={dataset_size!r}: pass "
                             "both (batches of one shape: Poisson sampling over dataset_size records, truncated to "
                             "truncated_batch_size) or neither (plain Poisson sampling).")
        for name, value in (("truncated_batch_size", truncated_batch_size), ("dataset_size", dataset_size)):
            if not checks.is_int(value) or value < 1:
                raise ValueError(f"{name}={value!r} is not allowed: pass a whole number >= 1.")
        problems = []
        if self.examples_per_user is not None:
            problems.append(f"a user-level spend (examples_per_user={self.examples_per_user}): dp-accounting has no "
                            "truncated event for a user's records")
        if self.adjacency != "add_remove":
            problems.append(f"adjacency={self.adjacency!r}: the truncated event is stated for add/remove")
        if not self.pessimistic_estimate:
            problems.append("pessimistic_estimate=False: dp-accounting builds the truncated event's distribution "
                            "pessimistically only")
        if problems:
            raise ValueError("truncated batches (truncated_batch_size) are accounted with dp-accounting's "
                             "TruncatedSubsampledGaussianDpEvent, which does not cover " + "; ".join(problems) + ".")
        return int(dataset_size), int(truncated_batch_size)

    def truncate(self, *, dataset_size: int, truncated_batch_size: int) -> None:
        """From now on each step is the truncated event over ``dataset_size`` records with bound
        ``truncated_batch_size`` (DPSGD sets it once the training data is known).

        Raises:
            ValueError: steps were recorded as another mechanism (plain Poisson batches, or another bound or
                dataset size): one history holds one kind of step.
        """
        truncation = self._check_truncation(truncated_batch_size, dataset_size)
        if self._history and truncation != self.truncation:
            before = ("plain Poisson batches" if self.truncation is None else
                      f"truncated_batch_size={self.truncation[1]}, dataset_size={self.truncation[0]}")
            raise ValueError(f"this accountant recorded {len(self)} steps of {before}; its steps cannot become "
                             f"truncated_batch_size={truncation[1] if truncation else None}, dataset_size="
                             f"{truncation[0] if truncation else None} mid-run. Keep the training set and "
                             "max_batch_size the run started with (or start a new run).")
        self.truncation = truncation

    def unit_key(self) -> tuple[Any, ...]:
        """The neighbours (:meth:`Accountant.unit_key`) and, for batches of one shape, the truncation: a truncated
        run's steps are another mechanism than plain Poisson steps at the same rate, and do not compose with them."""
        key = super().unit_key()
        return key if self.truncation is None else (*key, "truncated", *self.truncation)

    @staticmethod
    def _check_unit(examples_per_user: Any, user_accounting: Any, adjacency: str) -> tuple[int | None, str]:
        """The user-level configuration: ``k`` (None: example-level) and how the spend is stated."""
        k = check_examples_per_user(examples_per_user)
        if user_accounting not in USER_ACCOUNTING:
            raise ValueError(f"user_accounting={user_accounting!r} is not allowed; choose 'mixture' (the user's "
                             "sampled records as one mixture of Gaussians: tight), 'group' (group privacy of the "
                             "example-level guarantee: the papers' baseline, looser), or 'users' (users sampled and "
                             "clipped as units: the sampled Gaussian at the users' rate).")
        if k is not None and adjacency != "add_remove":
            raise ValueError(f"a user-level spend (examples_per_user={k}) is stated for a user added or removed "
                             f"with all their records: adjacency={adjacency!r} is not supported; use 'add_remove'.")
        return k, str(user_accounting)

    @staticmethod
    def _check_interval(value: Any) -> float:
        if not checks.is_real(value) or not math.isfinite(value) or not 0 < value <= 0.1:
            raise ValueError(
                f"value_discretization_interval must be a number in (0, 0.1], got {value!r}. It is the grid "
                "spacing of the privacy loss distribution: 1e-4 (default) is tight, 1e-3 is faster and slightly "
                "more pessimistic."
            )
        return float(value)

    def _config(self) -> dict[str, Any]:
        config: dict[str, Any] = {"value_discretization_interval": self.value_discretization_interval}
        if not self.pessimistic_estimate:
            config["pessimistic_estimate"] = False
        if self.examples_per_user is not None:  # example-level states keep their keys (checkpoints before 0.5)
            config.update(examples_per_user=self.examples_per_user, user_accounting=self.user_accounting)
        if self.truncation is not None:
            config.update(dataset_size=self.truncation[0], truncated_batch_size=self.truncation[1])
        return config

    def _coarse_kwargs(self) -> dict[str, Any] | None:
        coarse = 1e-3
        if self.value_discretization_interval >= coarse or not self.pessimistic_estimate:
            return None
        unit = ({} if self.examples_per_user is None else
                {"examples_per_user": self.examples_per_user, "user_accounting": self.user_accounting})
        if self.truncation is not None:
            unit.update(dataset_size=self.truncation[0], truncated_batch_size=self.truncation[1])
        return {"value_discretization_interval": coarse, **unit}  # the same unit and event: a search that starts near

    def _load_config(self, state: dict[str, Any]) -> None:
        saved = (state.get("examples_per_user"), state.get("user_accounting", "mixture"))
        mine = (self.examples_per_user, self.user_accounting)
        if saved[0] != mine[0] or (saved[0] is not None and saved[1] != mine[1]):
            def unit(k: Any, how: str) -> str:
                return "example-level" if k is None else f"user-level (examples_per_user={k}, {how})"

            raise ValueError(f"Cannot load a privacy history accounted {unit(*saved)} into an accountant that states "
                             f"a {unit(*mine)} spend: the guarantee would change meaning mid-run. Resume with the "
                             "privacy unit the run started with.")
        saved_truncation = (None if state.get("truncated_batch_size") is None else
                            (int(state["dataset_size"]), int(state["truncated_batch_size"])))
        if saved_truncation != self.truncation:
            def shape(t: tuple[int, int] | None) -> str:
                return ("plain Poisson batches" if t is None else
                        f"batches of one shape (truncated_batch_size={t[1]}, dataset_size={t[0]})")

            raise ValueError(f"Cannot load a privacy history accounted for {shape(saved_truncation)} into an "
                             f"accountant of {shape(self.truncation)}: each step's mechanism would change mid-run. "
                             "Resume with the batch shape (max_batch_size) and training set the run started with.")
        self.value_discretization_interval = self._check_interval(
            state.get("value_discretization_interval", self.value_discretization_interval)
        )
        self.pessimistic_estimate = bool(state.get("pessimistic_estimate", True))

    @property
    def _mixture(self) -> bool:
        """Whether each step is the user-level mixture of Gaussians (ELS), not the example-level Gaussian."""
        return self.examples_per_user is not None and self.user_accounting == "mixture"

    @property
    def _group(self) -> bool:
        """Whether the spend is the group-privacy conversion of the example-level one."""
        return self.examples_per_user is not None and self.user_accounting == "group"

    def _single_step_pld(self, sigma: float, q: float) -> privacy_loss_distribution.PrivacyLossDistribution:
        # Mirrors PLDAccountant._maybe_compose for PoissonSampledDpEvent(q, GaussianDpEvent(sigma)), and for
        # MixtureOfGaussiansDpEvent(sigma, 0..k, Binomial(k, q)) where the unit is a user (ELS).
        key = (self.name, sigma, q, self.value_discretization_interval, self.adjacency, self.pessimistic_estimate,
               self.examples_per_user if self._mixture else None, self.truncation)
        pld = _PLD_SINGLE_STEP_CACHE.get(key)
        if pld is None and self.truncation is not None:
            # Mirrors the library's TruncatedSubsampledGaussianDpEvent branch (pessimistic, connect the dots)
            size, cap = self.truncation
            pld = truncated_gaussian_pld(
                dataset_size=size, sampling_probability=q, truncated_batch_size=cap, noise_multiplier=sigma,
                value_discretization_interval=self.value_discretization_interval,
                neighboring_relation=self.neighboring_relation)
            _PLD_SINGLE_STEP_CACHE.put(key, pld)
        if pld is None and self._mixture:
            assert self.examples_per_user is not None
            sensitivities, probabilities = binomial_sensitivities(self.examples_per_user, q)
            pld = mixture_gaussian_pld(
                standard_deviation=sigma, sensitivities=sensitivities, sampling_probs=probabilities,
                pessimistic_estimate=self.pessimistic_estimate, use_connect_dots=self.pessimistic_estimate,
                value_discretization_interval=self.value_discretization_interval)
            _PLD_SINGLE_STEP_CACHE.put(key, pld)
        if pld is None:
            pld = gaussian_pld(
                standard_deviation=sigma,
                pessimistic_estimate=self.pessimistic_estimate,
                use_connect_dots=self.pessimistic_estimate,  # the library's optimistic path needs privacy buckets
                value_discretization_interval=self.value_discretization_interval,
                sampling_prob=q,
                neighboring_relation=self.neighboring_relation,
            )
            _PLD_SINGLE_STEP_CACHE.put(key, pld)
        return pld

    def _entry_pld(self, entry: HistoryEntry) -> privacy_loss_distribution.PrivacyLossDistribution:
        sigma, q, n = entry
        if q == 1.0 and self.truncation is None:
            # Mirrors the library's GaussianDpEvent branch: n Gaussian releases with std sigma
            # compose exactly into one with std sigma / sqrt(n) (a user's k records: sensitivity k, sigma / k).
            k = self.examples_per_user if self._mixture and self.examples_per_user is not None else 1
            return gaussian_pld(
                standard_deviation=sigma / k / math.sqrt(n),
                pessimistic_estimate=self.pessimistic_estimate,
                use_connect_dots=self.pessimistic_estimate,
                value_discretization_interval=self.value_discretization_interval,
                neighboring_relation=self.neighboring_relation,
            )
        return self_compose(self._single_step_pld(sigma, q), n)

    def _composed_pld(self, history: tuple[HistoryEntry, ...]) -> privacy_loss_distribution.PrivacyLossDistribution:
        # The library folds identity.compose(e1).compose(e2)...; a cached prefix of that
        # fold followed by the remaining composes is the same sequence of operations.
        interval = self.value_discretization_interval
        flavour = (self.name, interval, self.adjacency, self.pessimistic_estimate,
                   self.examples_per_user if self._mixture else None, self.truncation)
        start, pld = 0, None
        for length in range(len(history), 0, -1):
            pld = _PLD_COMPOSED_CACHE.get((*flavour, history[:length]))
            if pld is not None:
                start = length
                break
        if pld is None:
            pld = privacy_loss_distribution.identity(
                value_discretization_interval=interval, pessimistic_estimate=self.pessimistic_estimate
            )
        for length in range(start + 1, len(history) + 1):
            pld = pld.compose(self._entry_pld(history[length - 1]))
            if length >= len(history) - 1:  # keep the history and its prefix without the last run
                _PLD_COMPOSED_CACHE.put((*flavour, history[:length]), pld)
        return pld

    def _compute_epsilon(self, history: tuple[HistoryEntry, ...], delta: float) -> float:
        pld = self._composed_pld(history)
        if self._group and self.examples_per_user is not None:
            return group_epsilon(pld.get_delta_for_epsilon, self.examples_per_user, delta)
        return float(epsilon_for_delta(pld, delta))

    def to_dp_event(self) -> dp_event.DpEvent:
        """The ``dp_accounting`` event of the history; per user (``"mixture"``) the ELS mixture of Gaussians.

        Raises:
            ValueError: for ``user_accounting="group"``: group privacy is a conversion of the example-level event's
                guarantee, not an event of its own (compose the example-level events, then convert).
        """
        if self._group:
            raise ValueError("a group-privacy spend has no dp_accounting event: it converts the example-level "
                             "guarantee (group_epsilon); compose the example-level events, then convert.")
        return history_to_dp_event(self._history, self.examples_per_user if self._mixture else None,
                                   truncation=self.truncation)

    def privacy_profile(self, epsilons: Sequence[float]) -> np.ndarray:
        """``delta(eps)`` of the whole history at every epsilon of ``epsilons`` (the PLD's hockey-stick
        divergence, pessimistic; both directions of add/remove, the larger). The one-run f-DP audit turns it
        into a trade-off function (:func:`lightning_dp.audit.one_run.tradeoff_from_profile`)."""
        if self._group:
            raise ValueError("the privacy profile of a group-privacy spend is not computed (only its epsilon); use "
                             "user_accounting='mixture' or the example-level accountant")
        if not self._history:
            return np.zeros(len(epsilons))
        return np.asarray(self._composed_pld(self._history).get_delta_for_epsilon(list(map(float, epsilons))),
                          dtype=np.float64)


class DisjointPairPLDAccountant(PLDAccountant):
    """Replacement of one record whose contribution stays in a set of diameter ``D`` (but may be far from 0).

    Poisson sampling under replacement compares ``P = (1-q) A + q B`` with ``Q = (1-q) A + q B'``:
    ``A`` the output without the record's slot (its contribution 0), ``B``, ``B'`` the outputs with
    the record and with its replacement, Gaussians whose means differ by at most ``D``. The
    library's replace-one pair places ``A`` halfway between ``B`` and ``B'``, which holds when every
    contribution lies within ``D / 2`` of 0 (a ball of radius C: ``D = 2C``). A set far from 0 (a
    hollow sector, :mod:`lightning_dp.privacy.local_dp`) breaks that; for ANY position of ``A``

        H_a(P || Q) = sup_E (1-q)(1-a) A(E) + q (B(E) - a B'(E))
                    <= (1-q) max(0, 1-a) + q H_a(B || B'),

    which is the hockey-stick divergence of the pair with ``A`` disjoint from ``B``, ``B'``: its
    privacy loss is 0 with probability ``1 - q`` and the Gaussian mechanism's (sensitivity ``D``)
    with probability ``q``. That pair therefore dominates ``(P, Q)`` for every ``a >= 0``, and
    dominating pairs compose (Zhu, Dong & Wang, AISTATS 2022). Its PLD is the library's Gaussian
    PLD mixed with the identity PLD (``PrivacyLossDistribution.compute_mixture``), pessimistic.

    History entries are ``(sigma / D, q, n)``. Note that epsilon is not amplified by sampling here
    (only delta scales with q): it is a valid bound, and the smaller of it and the library's
    replace-one bound with the set's radius is reported by :class:`~lightning_dp.federated.parts.CentralGaussian`.
    Internal: not in :data:`ACCOUNTANTS`.
    """

    name = "pld_disjoint_pair"

    def __init__(self, value_discretization_interval: float = 1e-4) -> None:
        super().__init__(value_discretization_interval, adjacency="replace")

    def _single_step_pld(self, sigma: float, q: float) -> privacy_loss_distribution.PrivacyLossDistribution:
        key = (self.name, sigma, q, self.value_discretization_interval, self.adjacency)
        pld = _PLD_SINGLE_STEP_CACHE.get(key)
        if pld is None:
            gaussian = gaussian_pld(
                standard_deviation=sigma, pessimistic_estimate=True,
                value_discretization_interval=self.value_discretization_interval,
                neighboring_relation=NeighboringRelation.ADD_OR_REMOVE_ONE)  # unsampled: sensitivity 1 = D
            identity = privacy_loss_distribution.identity(
                value_discretization_interval=self.value_discretization_interval, pessimistic_estimate=True)
            pld = gaussian.compute_mixture(identity, q)
            _PLD_SINGLE_STEP_CACHE.put(key, pld)
        return pld

    def _entry_pld(self, entry: HistoryEntry) -> privacy_loss_distribution.PrivacyLossDistribution:
        sigma, q, n = entry
        if q == 1.0:  # the Gaussian mechanism with sensitivity D, composed exactly
            return gaussian_pld(
                standard_deviation=sigma / math.sqrt(n), pessimistic_estimate=True,
                value_discretization_interval=self.value_discretization_interval,
                neighboring_relation=NeighboringRelation.ADD_OR_REMOVE_ONE)
        return self_compose(self._single_step_pld(sigma, q), n)

    def _coarse_kwargs(self) -> dict[str, Any] | None:
        return None  # not in ACCOUNTANTS: calibration's coarse search builds accountants by name

    def _interim_kwargs(self) -> dict[str, Any] | None:
        # pessimistic at any discretization (its PLDs are the library's pessimistic Gaussian and identity, mixed)
        return None if self.value_discretization_interval >= 1e-3 else {"value_discretization_interval": 1e-3}


# --------------------------------------------------------------------------- RDP


class RDPAccountant(Accountant):
    """Renyi DP accountant (``dp_accounting.rdp``) for the Poisson-sampled Gaussian.

    RDP curves add up under composition; the conversion to ``(epsilon, delta)`` picks
    the best order. Mironov, Talwar & Zhang (2019) give the RDP of the sampled
    Gaussian; ``q == 1`` is the Gaussian mechanism with ``rdp(a) = a / (2 sigma^2)``.

    Args:
        orders: Renyi orders (> 1) to optimize over; ``None`` uses the library's
            ``DEFAULT_RDP_ORDERS``. Saved in the state.

    Example:
        >>> accountant = RDPAccountant()
        >>> accountant.epsilon_after(1e-5, noise_multiplier=1.0, sample_rate=0.01, num_steps=100) > 0
        True
    """

    name = "rdp"

    def __init__(self, orders: Sequence[float] | None = None, adjacency: str = "add_remove",
                 examples_per_user: int | None = None, user_accounting: str = "mixture") -> None:
        super().__init__(adjacency)
        self.orders = self._check_orders(orders)
        if examples_per_user is not None:
            raise ValueError(
                f"the RDP accountant states example-level spends only (examples_per_user={examples_per_user!r} was "
                "given): dp_accounting has no RDP bound for the mixture of Gaussians of a user's records, and RDP's "
                "group privacy is looser than PLD's. Use accountant='pld' for a user-level spend.")

    def check_supported(self, sample_rate: float) -> None:
        if self.adjacency == "replace" and sample_rate != 1.0:
            raise ValueError(
                f"the RDP accountant cannot analyse Poisson sampling (sample_rate={sample_rate:g}) under "
                "adjacency='replace': dp_accounting has no RDP bound for it. Use accountant='pld', which does."
            )

    @staticmethod
    def _check_orders(orders: Sequence[float] | None) -> list[float]:
        if orders is None:
            orders = rdp_privacy_accountant.DEFAULT_RDP_ORDERS
        try:
            values = [float(order) for order in orders if checks.is_real(order)]
        except TypeError:
            values = []
        if not values or len(values) != len(orders) or not all(1 < v < math.inf for v in values):
            raise ValueError(
                f"orders must be a non-empty sequence of finite Renyi orders > 1, got {orders!r}. "
                "Pass None to use dp_accounting's DEFAULT_RDP_ORDERS."
            )
        return values

    def _config(self) -> dict[str, Any]:
        return {"orders": list(self.orders)}

    def _load_config(self, state: dict[str, Any]) -> None:
        self.orders = self._check_orders(state.get("orders", self.orders))

    def _single_step_rdp(self, sigma: float, q: float, orders: np.ndarray) -> np.ndarray:
        key = (sigma, q, tuple(self.orders))
        rdp = _RDP_SINGLE_STEP_CACHE.get(key)
        if rdp is None:
            # The function both of the library's Gaussian branches call (GaussianDpEvent with q = 1).
            # An order whose series does not converge gets RDP = inf there (excluded: epsilon stays an
            # upper bound); the library's absl warning for it, one per order and call, is not shown.
            with _absl_filtered("failed to converge"):
                rdp = rdp_privacy_accountant._compute_rdp_poisson_subsampled_gaussian(  # noqa: SLF001
                    q=q, noise_multiplier=sigma, orders=orders
                )
            _RDP_SINGLE_STEP_CACHE.put(key, rdp)
        return rdp

    def _compute_epsilon(self, history: tuple[HistoryEntry, ...], delta: float) -> float:
        # Mirrors RdpAccountant: rdp starts at zero and accumulates count * single-step curve.
        orders = np.array(self.orders)
        rdp = np.zeros_like(orders, dtype=np.float64)
        for sigma, q, n in history:
            # replace at q == 1 (the only rate check_supported admits): the Gaussian mechanism with sensitivity 2
            rdp += n * self._single_step_rdp(sigma / 2 if self.adjacency == "replace" else sigma, q, orders)
        epsilon, _ = rdp_privacy_accountant.compute_epsilon(orders, rdp, delta)
        return float(epsilon)


class _DropMessages(logging.Filter):
    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        return self.text not in record.getMessage()


@contextlib.contextmanager
def _absl_filtered(text: str) -> Iterator[None]:
    """Drop absl log records (dp-accounting logs through absl) that contain ``text`` while the block runs."""
    logger, drop = logging.getLogger("absl"), _DropMessages(text)
    logger.addFilter(drop)
    try:
        yield
    finally:
        logger.removeFilter(drop)


# --------------------------------------------------------------------------- registry

ACCOUNTANTS: Registry[type[Accountant]] = Registry("accountant", base=Accountant, argument="accountant",
                                                  class_paths=False)
"""Registry of accountant classes by name (a read-only mapping; ``ACCOUNTANTS.register(name, cls)`` adds one);
:func:`get_accountant` instantiates them. No class paths: an accountant is rebuilt from the ``name`` it saves."""
ACCOUNTANTS.register(PLDAccountant.name, PLDAccountant)
ACCOUNTANTS.register(RDPAccountant.name, RDPAccountant)


def get_accountant(name: str = "pld", **kwargs: Any) -> Accountant:
    """Creates an accountant by registry name.

    Args:
        name: One of :data:`ACCOUNTANTS` (``"pld"``, the default, or ``"rdp"``).
        **kwargs: Passed to the accountant's constructor (e.g.
            ``value_discretization_interval`` for PLD, ``orders`` for RDP).

    Returns:
        A fresh accountant with an empty history.

    Raises:
        ValueError: If the name is not registered (with the registered names and the closest one).

    Example:
        >>> get_accountant("pld", value_discretization_interval=1e-3)
        PLDAccountant(value_discretization_interval=0.001, steps=0)
        >>> get_accountant("pdl")
        Traceback (most recent call last):
        ...
        ValueError: accountant='pdl' is not a registered accountant; choose one of ['pld', 'rdp']. Did you mean \
'pld'? 'pld' (privacy loss distributions) is tight and the default; 'rdp' (Renyi DP) is a cheaper upper bound.
    """
    key = name.lower() if isinstance(name, str) and name.lower() in ACCOUNTANTS else name
    cls = ACCOUNTANTS.resolve(key, hint="'pld' (privacy loss distributions) is tight and the default; 'rdp' (Renyi "
                                        "DP) is a cheaper upper bound.")
    return cls(**kwargs)
