"""What a run spent, in the units a grid composes: one interface for every privacy component.

Every component that protects a run reports ``privacy_spend() -> list[Spend]`` (:class:`SpendReporter`) at one
of the levels ``"example"``, ``"user"``, ``"client"``, ``"client_ledger"``, ``"record"``; the grid composes the reports level
by level with :func:`compose`, and a level some run leaves unprotected is infinite for the grid. The levels and
an example: docs/privacy.md, "What a run spent".
"""

from __future__ import annotations

import copy
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

__all__ = ["LEVELS", "Spend", "SpendReporter", "compose", "reporters_of", "spends_of", "unreported_components"]

#: The levels a spend can be stated at (module docstring).
LEVELS = ("example", "user", "client", "client_ledger", "record")
#: The (epsilon, delta) levels, of which a grid reports one as ``grid/epsilon``.
_ACCOUNTED = ("example", "user", "client")


@dataclass(frozen=True)
class Spend:
    """One component's spend at one level (build it with the class methods).

    Attributes:
        level: one of :data:`LEVELS`.
        accountants: for ``"example"``/``"user"``/``"client"``: ``{name: accountant}``, each a valid bound of the
            whole run (e.g. the replace-one and the disjoint-pair bound); the spend is the smallest.
        delta: the delta the epsilon is stated at.
        ledger: for ``"client_ledger"``/``"record"``: the run's per-client ledger (a copy).
        unsanitized: the run released data at this level without protection (infinite spend).
        why: what the component is, for messages and the report.
        secret_participation: the ledger shows who took part in a selection that another accountant amplifies
            (a federated round under central DP): the grid's per-client totals are then ``nonprivate/``.
        unit: for ledgers, what one unit of spend means (the sanitizer's ``ledger_label``: d-privacy per
            ||delta||-neighbourhood, local DP Gaussian or Laplace); ledgers of different units do not add.
    """

    level: str
    accountants: Mapping[str, Any] = field(default_factory=dict)
    delta: float | None = None
    ledger: Any = None
    unsanitized: bool = False
    why: str = ""
    secret_participation: bool = False
    unit: str = ""

    def __post_init__(self) -> None:
        if self.level not in LEVELS:
            raise ValueError(f"level={self.level!r} is not allowed; choose one of {LEVELS}")

    @classmethod
    def accounted(cls, level: str, accountant: Any, *, delta: float, alternatives: Mapping[str, Any] | None = None,
                  why: str = "") -> Spend:
        """An (epsilon, delta) spend from ``accountant`` (its history is copied), and optional further accountants
        that each bound the whole run too (the smallest bound is the spend)."""
        if level not in _ACCOUNTED:
            raise ValueError(f"an accountant's spend is stated at level 'example', 'user' or 'client', got {level!r}")
        accountants = {"main": copy.deepcopy(accountant)}
        accountants.update({k: copy.deepcopy(v) for k, v in (alternatives or {}).items() if v is not None})
        return cls(level, accountants=accountants, delta=float(delta), why=why)

    @classmethod
    def per_client(cls, level: str, ledger: Any, *, why: str = "", secret_participation: bool = False,
                   unit: str = "") -> Spend:
        """A per-client spend: a :class:`~lightning_dp.privacy.ledger.PrivacyLedger` (or a subclass) at
        ``"client_ledger"``, a :class:`~lightning_dp.privacy.ledger.RecordLedger` at ``"record"``; ``unit`` says
        what its spend measures (ledgers of different units are refused by :func:`compose`)."""
        if level not in ("client_ledger", "record"):
            raise ValueError(f"a ledger's spend is stated at level 'client_ledger' or 'record', got {level!r}")
        return cls(level, ledger=copy.deepcopy(ledger), why=why, secret_participation=bool(secret_participation),
                   unit=unit)

    @classmethod
    def unprotected(cls, level: str, why: str) -> Spend:
        """The run released data at ``level`` without protection: an infinite spend."""
        return cls(level, unsanitized=True, why=why)

    @property
    def epsilon(self) -> float:
        """The run's own spend (for ledgers: the largest client's)."""
        if self.unsanitized:
            return math.inf
        if self.level in _ACCOUNTED:
            assert self.delta is not None
            return min(acc.get_epsilon(self.delta) for acc in self.accountants.values())
        return float(self.ledger.max()) if len(self.ledger) else 0.0


@runtime_checkable
class SpendReporter(Protocol):
    """A component that reports its spend (DPSGD, the federated round, ...)."""

    def privacy_spend(self) -> list[Spend]:
        """What the run spent so far, one :class:`Spend` per level it protects or releases unprotected."""
        ...


# attributes by which a component shows that it holds privacy state: one that has them but reports
# no spend cannot be composed (and must not be counted as private)
_PRIVACY_MARKS = ("set_secret_seed", "ledger", "accountant", "noise_multiplier", "SECRET_ARGUMENTS")


def reporters_of(components: Sequence[Any]) -> list[Any]:
    """The components that report a spend (:class:`SpendReporter`)."""
    return [c for c in components if callable(getattr(c, "privacy_spend", None))]


def spends_of(components: Sequence[Any]) -> list[Spend]:
    """Every spend the reporting components of a run state (:func:`reporters_of`, in order)."""
    return [s for c in reporters_of(components) for s in c.privacy_spend()]


def unreported_components(components: Sequence[Any]) -> list[str]:
    """Names of the components that hold privacy state (a secret seed, a ledger, an accountant, a noise
    multiplier) but report no spend: a grid cannot compose them and refuses the run."""
    out = []
    for c in components:
        if callable(getattr(c, "privacy_spend", None)):
            continue
        marks = [m for m in _PRIVACY_MARKS if getattr(type(c), m, None) is not None or m in getattr(c, "__dict__", {})]
        if marks:
            out.append(f"{type(c).__name__} (has {', '.join(marks)})")
    return out


def _compose_accounted(spends: Sequence[Spend]) -> tuple[float, float]:
    """``(epsilon, delta)`` of the composition of one accounted level over runs: each bound (by name) that
    every run reports is composed on its own; the smallest composed bound is the grid's."""
    names = set(spends[0].accountants)
    for s in spends[1:]:
        names &= set(s.accountants)
    def kind(accountant: Any) -> str:
        unit = accountant.unit_key() if callable(getattr(accountant, "unit_key", None)) else (
            str(getattr(accountant, "adjacency", None)),)
        return f"{type(accountant).__name__} {unit}"

    kinds = {kind(s.accountants["main"]) for s in spends}
    if len(kinds) != 1:
        raise ValueError(f"the grid's runs state {spends[0].level}-level epsilon with different accountants "
                         f"{sorted(kinds)}; a composition needs one accountant kind, adjacency and privacy unit (for "
                         "users: the same examples_per_user and user_accounting): set the same in every run.")
    delta = max(float(s.delta) for s in spends if s.delta is not None)
    bounds = []
    for name in sorted(names):
        composed = copy.deepcopy(spends[0].accountants[name])
        for s in spends[1:]:
            for sigma, q, steps in s.accountants[name].history:
                composed.step(noise_multiplier=sigma, sample_rate=q, num_steps=steps)
        bounds.append(composed.get_epsilon(delta))
    return min(bounds), delta


def _ledger_kind(spend: Spend) -> str:
    """What a ledger's spend measures: its class, unit, delta, accountant and adjacency (as text)."""
    ledger = spend.ledger
    parts = [type(ledger).__name__, spend.unit] + [f"{a}={getattr(ledger, a)}" for a in ("delta", "accountant",
                                                                                        "adjacency")
                                                   if getattr(ledger, a, None) is not None]
    return " ".join(p for p in parts if p)


def _compose_ledgers(spends: Sequence[Spend]) -> dict[Any, float]:
    """Per-client spend of the composition over runs, with the ledgers' own composition."""
    from lightning_dp.privacy.ledger import PrivacyLedger, RecordLedger

    kinds = {_ledger_kind(s) for s in spends}
    if len(kinds) != 1:
        raise ValueError(f"the grid's runs keep {spends[0].level} ledgers of different kinds {sorted(kinds)} (another "
                         "ledger class, unit, delta, accountant or adjacency): their spends measure different "
                         "neighbours and do not add. Grid one kind at a time (e.g. the same sampling and adjacency "
                         "in every run).")
    composed = copy.deepcopy(spends[0].ledger)
    for s in spends[1:]:
        other = s.ledger
        for cid in other.as_dict():
            if isinstance(other, RecordLedger):
                for sigma, q, steps in other.history(cid):
                    composed.charge(cid, noise_multiplier=sigma, sample_rate=q, num_steps=steps)
            else:  # the ledger's raw additive cost (a GaussianLedger keeps precisions, which add)
                composed.charge(cid, PrivacyLedger.spent(other, cid))
    return composed.as_dict()


def compose(runs: Sequence[Sequence[Spend]]) -> dict[str, Any]:
    """The grid's privacy totals from every run's spends (one list per run).

    Returns:
        ``grid/epsilon``, ``grid/delta`` and ``grid/privacy_level`` for the (epsilon, delta) level;
        ``grid/client_epsilon_median``/``_max`` for client ledgers; ``grid/record_epsilon_median``/``_max``
        for record ledgers (``nonprivate/grid_...`` when a run's participation is secret: the totals show how
        often each client took part); ``math.inf`` where some run did not protect a level another run reports.

    Raises:
        ValueError: If the runs state epsilon at both the example and the client level, or with
            accountants (ledgers) of different kinds.
    """
    by_level: dict[str, list[list[Spend]]] = {}
    for spends in runs:
        for level in LEVELS:
            by_level.setdefault(level, []).append([s for s in spends if s.level == level])
    present = [level for level in LEVELS if any(by_level[level])]
    accounted = [level for level in present if level in _ACCOUNTED]
    if len(accounted) > 1:
        raise ValueError(f"the grid mixes {' and '.join(accounted)}-level epsilon (example: DP-SGD per example; user: "
                         "DP-SGD per user; client: DP-FedAvg), which measure different neighbours and do not "
                         "compose; grid one privacy unit at a time.")
    totals: dict[str, Any] = {}
    for level in present:
        per_run = by_level[level]
        # a run that releases at this level unprotected, or states no guarantee at it: infinite for the grid
        infinite = any(not spends or any(s.unsanitized for s in spends) for spends in per_run)
        if level in _ACCOUNTED:
            totals["grid/privacy_level"] = level
            flat = [s for spends in per_run for s in spends if not s.unsanitized]
            epsilon, delta = _compose_accounted(flat) if flat else (math.inf, math.nan)
            totals["grid/epsilon"] = math.inf if infinite else epsilon
            if not math.isnan(delta):
                totals["grid/delta"] = delta
            continue
        name = "client_epsilon" if level == "client_ledger" else "record_epsilon"
        flat = [s for spends in per_run for s in spends]
        prefix = "nonprivate/grid_" if any(s.secret_participation for s in flat) else "grid/"
        if infinite:
            totals[f"{prefix}{name}_median"] = totals[f"{prefix}{name}_max"] = math.inf
            continue
        per_client = _compose_ledgers(flat)
        if per_client:
            totals[f"{prefix}{name}_median"] = float(statistics.median(per_client.values()))
            totals[f"{prefix}{name}_max"] = max(per_client.values())
    return totals
