"""Per-client d-privacy accounting for personalized federated learning.

Each release by :func:`~lightning_dp.privacy.mechanisms.sanitize_update` costs ``n / nu``; by the composition
theorem of d-privacy a client's costs **add up**, and :class:`PrivacyLedger` keeps their sum (data-independent,
so publishable) and count per client. Background: docs/privacy.md, "The Euclidean Laplace mechanism".

Example:
    >>> ledger = PrivacyLedger()
    >>> ledger.charge("alice", 5.0)
    >>> ledger.charge("alice", 5.0)
    >>> ledger.spent("alice"), ledger.spent("bob"), ledger.would_exceed("alice", 5.0, cap=12.0)
    (10.0, 0.0, True)
"""

from __future__ import annotations

import math
import numbers
import statistics
from typing import Any, Union

__all__ = ["ClientId", "GaussianLedger", "PrivacyLedger", "RecordLedger"]

ClientId = Union[str, int]
"""A client identifier: a string or an integer (kept as such through ``state_dict``)."""


def _check_client_id(client_id: Any) -> ClientId:
    if isinstance(client_id, bool) or not isinstance(client_id, (str, numbers.Integral)):
        raise ValueError(
            f"client_id={client_id!r} must be a str or an int (the identifier the federated partition gives a "
            "client), so that the ledger can be saved as JSON; pass e.g. str(client_id)."
        )
    return client_id if isinstance(client_id, str) else int(client_id)


def _check_cost(cost: Any) -> float:
    if isinstance(cost, bool) or not isinstance(cost, numbers.Real) or math.isnan(cost) or cost < 0:
        raise ValueError(
            f"cost={cost!r} must be a number >= 0 (inf allowed: a release without noise): it is the d-privacy "
            "cost of one participation, n / nu from sanitize_update(...).cost."
        )
    return float(cost)


def _check_cap(cap: Any) -> float:
    if isinstance(cap, bool) or not isinstance(cap, numbers.Real) or math.isnan(cap) or cap <= 0:
        raise ValueError(
            f"cap={cap!r} must be a number > 0 (inf for no cap): it is the largest total cost a client may "
            "spend, e.g. 10 * n / nu for ten participations."
        )
    return float(cap)


def _saved_entries(state: dict[str, Any], what: str) -> list[tuple[ClientId, Any, int]]:
    """The ``[client_id, <what>, participations]`` entries of a saved ledger, checked (ids once, counts >= 1)."""
    entries, seen = [], set()
    for entry in state.get("clients", []):
        if not isinstance(entry, (list, tuple)) or len(entry) != 3:
            raise ValueError(f"Each ledger entry must be [client_id, {what}, participations], got {entry!r}.")
        cid, value, count = _check_client_id(entry[0]), entry[1], entry[2]
        if isinstance(count, bool) or not isinstance(count, numbers.Integral) or count < 1:
            raise ValueError(f"participations of client {cid!r} must be an integer >= 1, got {count!r}.")
        if cid in seen:
            raise ValueError(f"client {cid!r} appears twice in the saved ledger.")
        seen.add(cid)
        entries.append((cid, value, int(count)))
    return entries


class PrivacyLedger:
    """Sums the d-privacy costs charged to each client.

    Clients that were never charged have spent ``0.0`` and are not counted by
    :meth:`__len__`, :meth:`median` or :meth:`max`. Costs add by plain floating-point
    summation in the order of the charges, so a resumed ledger (see
    :meth:`state_dict`) continues with exactly the numbers of an uninterrupted run.
    :meth:`would_exceed` compares strictly (``spent + cost > cap``); if the cap is meant
    to admit exactly ``k`` participations of cost ``c``, give it a little headroom
    (``k * c * (1 + 1e-9)``) since ``c + ... + c`` may round above ``k * c``.
    """

    _kind: str | None = None  # None: additive costs (d-privacy, pure epsilon); saved states carry no "kind"

    def __init__(self) -> None:
        self._spent: dict[ClientId, float] = {}
        self._participations: dict[ClientId, int] = {}

    def charge(self, client_id: ClientId, cost: float) -> None:
        """Adds ``cost`` to the client's spend and counts one participation.

        Args:
            client_id: The client (str or int).
            cost: The d-privacy cost ``>= 0`` of this release (``inf`` for no noise).

        Raises:
            ValueError: If ``client_id`` or ``cost`` is invalid.
        """
        client_id = _check_client_id(client_id)
        cost = _check_cost(cost)
        self._spent[client_id] = self._spent.get(client_id, 0.0) + cost
        self._participations[client_id] = self._participations.get(client_id, 0) + 1

    def spent(self, client_id: ClientId) -> float:
        """The client's total cost so far (``0.0`` if it was never charged)."""
        return self._spent.get(_check_client_id(client_id), 0.0)

    def participations(self, client_id: ClientId) -> int:
        """How many times the client was charged (``0`` if never)."""
        return self._participations.get(_check_client_id(client_id), 0)

    def would_exceed(self, client_id: ClientId, cost: float, cap: float) -> bool:
        """Whether charging ``cost`` would take the client's spend above ``cap``.

        Args:
            client_id: The client.
            cost: The cost ``>= 0`` of the planned participation.
            cap: The per-client budget ``> 0`` (``inf`` for none).

        Returns:
            ``spent(client_id) + cost > cap``; records nothing.
        """
        return self.spent(client_id) + _check_cost(cost) > _check_cap(cap)

    def as_dict(self) -> dict[ClientId, float]:
        """``{client_id: spent}`` for every charged client (a copy, in first-charge order)."""
        return dict(self._spent)

    def median(self) -> float:
        """The median spend over charged clients (``0.0`` if none was charged)."""
        return float(statistics.median(self._spent.values())) if self._spent else 0.0

    def max(self) -> float:
        """The largest spend over charged clients (``0.0`` if none was charged)."""
        return max(self._spent.values()) if self._spent else 0.0

    def state_dict(self) -> dict[str, Any]:
        """The ledger as plain, JSON-able Python types.

        Client ids are stored inside lists, not as JSON object keys, so integer ids come
        back as integers. A spend of ``inf`` is written by :mod:`json` as ``Infinity``
        and read back by it.

        Returns:
            ``{"clients": [[client_id, spent, participations], ...]}``.
        """
        return {"clients": [[cid, spent, self._participations[cid]] for cid, spent in self._spent.items()]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Replaces the ledger's content with a state saved by :meth:`state_dict`.

        Args:
            state: ``{"clients": [[client_id, spent, participations], ...]}``.

        Raises:
            ValueError: If the state is malformed (the ledger is then left unchanged).
        """
        if not isinstance(state, dict) or not isinstance(state.get("clients", []), (list, tuple)):
            raise ValueError(f"state must be a dict from PrivacyLedger.state_dict(), got {state!r:.200}.")
        if state.get("kind") != self._kind:
            raise ValueError(f"the saved ledger is of kind {state.get('kind') or 'additive'!r} but this one is "
                             f"{self._kind or 'additive'!r}: its numbers mean something else. Resume with the "
                             "sanitizer of the run that wrote it.")
        spent: dict[ClientId, float] = {}
        participations: dict[ClientId, int] = {}
        for cid, total, count in _saved_entries(state, "spent"):
            spent[cid], participations[cid] = _check_cost(total), count
        self._spent, self._participations = spent, participations

    def __len__(self) -> int:
        """Number of clients charged at least once."""
        return len(self._spent)

    def __contains__(self, client_id: object) -> bool:
        return client_id in self._spent

    def __repr__(self) -> str:
        return f"PrivacyLedger(clients={len(self)}, max={self.max()!r}, median={self.median()!r})"


class GaussianLedger(PrivacyLedger):
    """Per-client ledger of local Gaussian releases: epsilon of the exact composition, at one delta.

    A participation released with Gaussian noise of multiplier ``m`` (noise std over the
    L2 sensitivity of the release) is charged ``m^-2``. A client's releases compose exactly
    into ONE Gaussian mechanism with multiplier ``(sum m^-2)^(-1/2)`` (privacy losses of
    Gaussian mechanisms are Gaussian and add; :mod:`lightning_dp.privacy.local_dp`), so the
    ledger keeps the sum and reports the epsilon of that mechanism at ``delta`` through the
    project's accountant (dp-accounting). :meth:`spent`, :meth:`as_dict`, :meth:`median`,
    :meth:`max` and :meth:`would_exceed` speak epsilon; :meth:`charge` takes ``m^-2``.

    The ``delta < 1/N`` rule (:mod:`lightning_dp.privacy.delta`) asks nothing more here: a local release
    protects the client's whole data, ONE unit (any two datasets of the client are neighbours), so
    ``N = 1`` and ``delta < 1`` is already required.

    Args:
        delta: the delta at which every client's epsilon is stated.
        accountant: ``"pld"`` or ``"rdp"``.

    Example:
        >>> ledger = GaussianLedger(delta=1e-5)
        >>> ledger.charge("alice", 1 / 4.0**2)
        >>> ledger.charge("alice", 1 / 4.0**2)  # two releases at m = 4: one Gaussian at m = 4 / sqrt(2)
        >>> from lightning_dp.privacy.local_dp import gaussian_epsilon
        >>> abs(ledger.spent("alice") - gaussian_epsilon(4.0 / 2**0.5, 1e-5)) < 1e-9
        True
    """

    def __init__(self, delta: float = 1e-5, accountant: str = "pld") -> None:
        super().__init__()
        if isinstance(delta, bool) or not isinstance(delta, numbers.Real) or not 0 < delta < 1:
            raise ValueError(f"delta={delta!r} is not allowed: pass a number in (0, 1), well below 1 / (records of "
                             "a client)")
        from lightning_dp.privacy.accounting import get_accountant

        get_accountant(accountant)  # validates the name
        self.delta: float = float(delta)
        self.accountant: str = accountant
        self._cache: dict[float, float] = {}

    def epsilon_of(self, precision: float) -> float:
        """Epsilon at :attr:`delta` of the Gaussian mechanism with multiplier ``precision^(-1/2)``."""
        if precision == 0:
            return 0.0
        if math.isinf(precision):
            return math.inf
        eps = self._cache.get(precision)
        if eps is None:
            from lightning_dp.privacy.local_dp import gaussian_epsilon

            eps = self._cache[precision] = gaussian_epsilon(precision**-0.5, self.delta, self.accountant)
        return eps

    def precision(self, client_id: ClientId) -> float:
        """The client's ``sum m^-2`` (0.0 if never charged)."""
        return super().spent(client_id)

    def spent(self, client_id: ClientId) -> float:
        return self.epsilon_of(self.precision(client_id))

    def would_exceed(self, client_id: ClientId, cost: float, cap: float) -> bool:
        return self.epsilon_of(self.precision(client_id) + _check_cost(cost)) > _check_cap(cap)

    def as_dict(self) -> dict[ClientId, float]:
        return {cid: self.epsilon_of(p) for cid, p in self._spent.items()}

    def median(self) -> float:
        return float(statistics.median(self.as_dict().values())) if self._spent else 0.0

    def max(self) -> float:
        # epsilon grows with the precision: the client with the largest sum
        return self.epsilon_of(max(self._spent.values())) if self._spent else 0.0

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "kind": "gaussian", "delta": self.delta, "accountant": self.accountant}

    _kind = "gaussian"

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict) or state.get("kind") != "gaussian" or state.get("delta") != self.delta \
                or state.get("accountant") != self.accountant:
            raise ValueError(
                f"this ledger states Gaussian compositions at delta={self.delta} with the {self.accountant!r} "
                f"accountant; the saved ledger is {({k: state.get(k) for k in ('kind', 'delta', 'accountant')} if isinstance(state, dict) else state)!r}. "
                "Resume with the sanitizer settings of the run that wrote it.")
        super().load_state_dict(state)

    def __repr__(self) -> str:
        return f"GaussianLedger(clients={len(self)}, delta={self.delta}, max={self.max()!r})"


class RecordLedger:
    """Per-client record-level DP-SGD accounting (local DP-SGD inside federated clients).

    Each client has its own accountant (:func:`~lightning_dp.privacy.accounting.get_accountant`,
    dp-accounting underneath) whose history holds the client's DP-SGD steps over all its
    participations, ``(noise_multiplier, sample_rate, steps)`` run-length encoded; the client's
    epsilon at :attr:`delta` is the accountant's composition of that history, with respect to
    one record of the client (add/remove or replacement, as the accountant's adjacency). Client
    selection is public, so a participation is charged whole (no amplification by the client
    being sampled). The numbers depend only on public settings, so they may be logged.

    One delta serves every client, while the ``delta < 1/N`` rule (:mod:`lightning_dp.privacy.delta`) depends
    on each client's number of records ``n_c``, which the ledger does not know: the update that plans the
    clients checks it (:meth:`lightning_dp.federated.parts.LocalDPSGD.plan`, one warning for all clients).

    Args:
        delta: the delta every client's epsilon is stated at.
        accountant: ``"pld"`` or ``"rdp"``.
        adjacency: ``"add_remove"`` or ``"replace"`` (of one record).

    Example:
        >>> ledger = RecordLedger(delta=1e-5, accountant="rdp")
        >>> ledger.charge("alice", noise_multiplier=1.0, sample_rate=0.1, num_steps=10)
        >>> ledger.charge("alice", noise_multiplier=1.0, sample_rate=0.1, num_steps=10)
        >>> ledger.history("alice"), ledger.participations("alice")
        ([(1.0, 0.1, 20)], 2)
        >>> 0 < ledger.spent("alice") == ledger.max(), ledger.spent("bob")
        (True, 0.0)
    """

    def __init__(self, delta: float = 1e-5, accountant: str = "pld", adjacency: str = "add_remove") -> None:
        from lightning_dp.privacy.accounting import check_delta, check_adjacency, get_accountant

        self.delta = check_delta(delta)
        self.adjacency = check_adjacency(adjacency)
        self.accountant = get_accountant(accountant, adjacency=self.adjacency).name
        self._accountants: dict[ClientId, Any] = {}
        self._participations: dict[ClientId, int] = {}

    def _fresh(self) -> Any:
        from lightning_dp.privacy.accounting import get_accountant

        return get_accountant(self.accountant, adjacency=self.adjacency)

    def _of(self, client_id: ClientId) -> Any:
        return self._accountants.get(_check_client_id(client_id)) or self._fresh()

    def charge(self, client_id: ClientId, *, noise_multiplier: float, sample_rate: float, num_steps: int) -> None:
        """Records one participation of ``num_steps`` DP-SGD steps of the client."""
        client_id = _check_client_id(client_id)
        accountant = self._accountants.get(client_id) or self._fresh()
        accountant.step(noise_multiplier=noise_multiplier, sample_rate=sample_rate, num_steps=num_steps)
        self._accountants[client_id] = accountant
        self._participations[client_id] = self._participations.get(client_id, 0) + 1

    def history(self, client_id: ClientId) -> list[tuple[float, float, int]]:
        """The client's run-length encoded ``(noise_multiplier, sample_rate, steps)`` history."""
        return self._of(client_id).history

    def participations(self, client_id: ClientId) -> int:
        return self._participations.get(_check_client_id(client_id), 0)

    def spent(self, client_id: ClientId) -> float:
        """The client's epsilon at :attr:`delta` (0.0 if never charged)."""
        return self._of(client_id).get_epsilon(self.delta)

    def epsilon_after(self, client_id: ClientId, *, noise_multiplier: float, sample_rate: float,
                      num_steps: int) -> float:
        """The client's epsilon after one more such participation; records nothing."""
        return self._of(client_id).epsilon_after(self.delta, noise_multiplier=noise_multiplier,
                                                 sample_rate=sample_rate, num_steps=num_steps)

    def participations_left(self, client_id: ClientId, target_epsilon: float, *, noise_multiplier: float,
                            sample_rate: float, num_steps: int, limit: int) -> int:
        """How many more participations of ``num_steps`` such steps fit within ``target_epsilon`` (at most
        ``limit``): the accountant's ``max_steps`` over whole participations (every returned count was evaluated
        to fit)."""
        if limit <= 0:
            return 0
        steps = self._of(client_id).max_steps(target_epsilon, self.delta, noise_multiplier=noise_multiplier,
                                              sample_rate=sample_rate, limit=limit * num_steps)
        return steps // num_steps

    def as_dict(self) -> dict[ClientId, float]:
        """``{client_id: epsilon}`` for every charged client."""
        return {cid: a.get_epsilon(self.delta) for cid, a in self._accountants.items()}

    def median(self) -> float:
        return float(statistics.median(self.as_dict().values())) if self._accountants else 0.0

    def max(self) -> float:
        return max(self.as_dict().values()) if self._accountants else 0.0

    def state_dict(self) -> dict[str, Any]:
        """Plain Python types: ``{"kind": "record", delta, accountant, adjacency, "clients": [[id, history,
        participations], ...]}``."""
        return {"kind": "record", "delta": self.delta, "accountant": self.accountant, "adjacency": self.adjacency,
                "clients": [[cid, [list(e) for e in a.history], self._participations[cid]]
                            for cid, a in self._accountants.items()]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        settings = {k: state.get(k) for k in ("kind", "delta", "accountant", "adjacency")} \
            if isinstance(state, dict) else state
        if settings != {"kind": "record", "delta": self.delta, "accountant": self.accountant,
                        "adjacency": self.adjacency}:
            raise ValueError(f"this ledger accounts records at delta={self.delta} with the {self.accountant!r} "
                             f"accountant under {self.adjacency!r} adjacency; the saved ledger is {settings!r}. "
                             "Resume with the settings of the run that wrote it.")
        accountants: dict[ClientId, Any] = {}
        participations: dict[ClientId, int] = {}
        for cid, history, count in _saved_entries(state, "history"):
            accountant = self._fresh()
            accountant.load_state_dict({**accountant.state_dict(), "history": history})
            accountants[cid], participations[cid] = accountant, count
        self._accountants, self._participations = accountants, participations

    def __len__(self) -> int:
        return len(self._accountants)

    def __contains__(self, client_id: object) -> bool:
        return client_id in self._accountants

    def __repr__(self) -> str:
        return (f"RecordLedger(clients={len(self)}, delta={self.delta}, accountant={self.accountant!r}, "
                f"adjacency={self.adjacency!r})")
