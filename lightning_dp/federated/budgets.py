"""Per-client privacy budgets for personalized-DP federated learning (PFA and the budget-agnostic split).

A :class:`ClientBudgets` gives every training client its own record-level epsilon_m (delta is
shared), the budget :class:`~lightning_dp.federated.parts.LocalDPSGD` calibrates that client's
noise to and enforces. It also knows which clients are "public" (relaxed budgets) in truth, for
scoring a split (``pdpfl/split_accuracy``); the server never reads either in the indirect
(budget-agnostic) mode.

- :class:`FixedBudgets`: a list, in the training clients' order (or by client id).
- :class:`DistributionBudgets`: drawn, with a public seed, from the distributions of the PFA
  experiments (Liu et al., VLDB 2022, Section 6.1 and their code; :data:`DISTRIBUTIONS`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["DISTRIBUTIONS", "ClientBudgets", "DistributionBudgets", "FixedBudgets"]


class ClientBudgets:
    """Assigns a budget to every training client."""

    def assign(self, client_ids: Sequence[Any]) -> list[float]:
        """epsilon_m of every client, in the order of ``client_ids``."""
        return self.assign_with_groups(client_ids)[0]

    def assign_with_groups(self, client_ids: Sequence[Any]) -> tuple[list[float], list[bool]]:
        """``(epsilons, public)``: every client's budget and whether it belongs to the relaxed ("public") group."""
        raise NotImplementedError

    def hparams(self) -> dict[str, Any]:
        return {}


def _check_epsilon(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value > 0):
        raise ValueError(f"{where}: epsilon={value!r} is not allowed: pass a finite number > 0")
    return float(value)


class FixedBudgets(ClientBudgets):
    """Budgets given explicitly.

    Args:
        epsilons: one epsilon per training client, in their order; or a mapping ``{client_id: epsilon}``
            covering every training client.
        public: which clients are public in truth (same form); default: the clients with the largest
            epsilon value (every client when all are equal: no private group).
    """

    def __init__(self, epsilons: Sequence[float] | dict[Any, float], public: Sequence[bool] | None = None) -> None:
        if isinstance(epsilons, dict):
            self.epsilons: Any = {k: _check_epsilon(v, f"budgets[{k!r}]") for k, v in epsilons.items()}
        else:
            self.epsilons = [_check_epsilon(v, f"budgets[{i}]") for i, v in enumerate(epsilons)]
            if not self.epsilons:
                raise ValueError("FixedBudgets needs at least one epsilon")
        self.public = None if public is None else [bool(p) for p in public]

    def hparams(self) -> dict[str, Any]:
        return {"budgets": "fixed"}

    def assign_with_groups(self, client_ids):
        ids = list(client_ids)
        if isinstance(self.epsilons, dict):
            missing = [cid for cid in ids if cid not in self.epsilons]
            if missing:
                raise ValueError(f"FixedBudgets has no epsilon for clients {missing[:5]}; give one per training "
                                 "client")
            eps = [self.epsilons[cid] for cid in ids]
        else:
            if len(self.epsilons) != len(ids):
                raise ValueError(f"FixedBudgets has {len(self.epsilons)} epsilons for {len(ids)} training clients; "
                                 "give one per training client, in their order")
            eps = list(self.epsilons)
        if self.public is not None:
            if len(self.public) != len(ids):
                raise ValueError(f"public has {len(self.public)} entries for {len(ids)} training clients")
            return eps, list(self.public)
        top = max(eps)
        return eps, [e == top for e in eps]


#: The budget distributions of the PFA experiments: each a mixture of (weight, low, high, mean, std, public)
#: components, an epsilon drawn from N(mean, std^2) clipped to [low, high] (std 0: uniform on [low, high]).
DISTRIBUTIONS: dict[str, list[tuple[float, float, float, float, float, bool]]] = {}


class DistributionBudgets(ClientBudgets):
    """Budgets drawn from a named distribution of the PFA experiments (:data:`DISTRIBUTIONS`).

    Args:
        distribution: its name.
        seed: public seed of the draw (the budgets are the clients' preferences, not secrets of the run).
    """

    def __init__(self, distribution: str = "MixGauss1", seed: int = 0) -> None:
        if distribution not in DISTRIBUTIONS:
            raise ValueError(f"distribution={distribution!r} is not known; choose one of {sorted(DISTRIBUTIONS)}")
        self.distribution, self.seed = distribution, int(seed)

    def hparams(self) -> dict[str, Any]:
        return {"budgets": self.distribution, "budgets_seed": self.seed}

    def assign_with_groups(self, client_ids):
        components = DISTRIBUTIONS[self.distribution]
        rng = np.random.default_rng(self.seed)
        weights = np.array([c[0] for c in components], dtype=np.float64)
        picks = rng.choice(len(components), size=len(client_ids), p=weights / weights.sum())
        eps, public = [], []
        for j in picks:
            _, low, high, mean, std, is_public = components[j]
            value = rng.uniform(low, high) if std == 0 else float(np.clip(rng.normal(mean, std), low, high))
            eps.append(float(value))
            public.append(bool(is_public))
        return eps, public
