"""Per-client privacy budgets for personalized-DP federated learning (PFA and the budget-agnostic split).

A :class:`ClientBudgets` gives every training client its own record-level epsilon_m (delta is
shared), the budget :class:`~lightning_dp.federated.parts.LocalDPSGD` calibrates that client's
noise to and enforces. It also knows which clients are "public" (relaxed budgets) in truth, for
scoring a split (``pdpfl/split_accuracy``); the server never reads either in the indirect
(budget-agnostic) mode.

- :class:`FixedBudgets`: a list, in the training clients' order (or by client id).
- :class:`DistributionBudgets`: drawn, with a public seed, from the distributions of the PFA
  experiments (Liu et al., VLDB 2022; the parameters of their code's ``epsfiles``, :data:`DISTRIBUTIONS`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from lightning_dp.privacy.accounting import check_target_epsilon

__all__ = ["DISTRIBUTIONS", "ClientBudgets", "Distribution", "DistributionBudgets", "FixedBudgets"]


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
            self.epsilons: Any = {k: check_target_epsilon(v, name=f"budgets[{k!r}]", finite=True)
                                  for k, v in epsilons.items()}
        else:
            self.epsilons = [check_target_epsilon(v, name=f"budgets[{i}]", finite=True) for i, v in enumerate(epsilons)]
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


@dataclass(frozen=True)
class Distribution:
    """A budget distribution of PFA's code (``epsfiles/<name>.txt``): a mixture of Gaussians ``(weight, mean,
    std)`` or a uniform ``(low, high)``; clients with epsilon above ``threshold`` are public."""

    threshold: float
    components: tuple[tuple[float, float, float], ...] = ()
    uniform: tuple[float, float] | None = None


#: The distributions of PFA's experiments (Liu et al., VLDB 2022, Table 1), under the paper's names, with the
#: thresholds of the official code's budget files (github.com/Emory-AIMS/PFA, ``epsfiles/``). The paper's
#: names and the files' differ: paper MixGauss1 is the file mixgauss3, paper MixGauss2 the file mixgauss1;
#: paper MixGauss3 (std 0.1 on the relaxed component) is closest to the file mixgauss2 (std 1.0 there);
#: MixGauss4 has no file (its threshold, 5, separates its relaxed component as the others do).
DISTRIBUTIONS: dict[str, Distribution] = {
    "MixGauss1": Distribution(1.0, ((0.9, 0.1, 0.01), (0.1, 10.0, 0.1))),
    "MixGauss2": Distribution(1.0, ((0.9, 0.5, 0.01), (0.1, 10.0, 0.1))),
    "MixGauss3": Distribution(2.0, ((0.9, 1.0, 0.1), (0.1, 10.0, 0.1))),
    "MixGauss4": Distribution(5.0, ((0.5, 0.5, 0.01), (0.4, 1.0, 0.1), (0.1, 10.0, 1.0))),
    "Gauss": Distribution(4.0, ((1.0, 3.0, 1.0),)),
    "Uniform": Distribution(9.0, uniform=(1.0, 10.0)),
}


class DistributionBudgets(ClientBudgets):
    """Budgets drawn from a distribution of the PFA experiments (:data:`DISTRIBUTIONS`).

    As PFA's code (``set_epsilons``): every client's epsilon is drawn independently (a mixture
    component with its probability, then the Gaussian; or the uniform), and the whole draw is
    repeated until at least one client is public (epsilon above the distribution's threshold; PFA's
    code repeats for mixtures and the uniform, not for Gauss). Unlike PFA's code, a non-positive
    draw (possible for Gauss, probability 0.13 %) is drawn again: epsilon must be positive. The
    truly public clients are those above the threshold.

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
        spec = DISTRIBUTIONS[self.distribution]
        rng = np.random.default_rng(self.seed)
        m = len(client_ids)
        for _ in range(10_000):
            eps = np.array([self._draw(spec, rng) for _ in range(m)])
            if (eps > spec.threshold).any():
                return [float(e) for e in eps], [bool(e > spec.threshold) for e in eps]
        raise ValueError(f"{self.distribution}: no draw of {m} clients had a public client in 10000 tries")

    @staticmethod
    def _draw(spec: Distribution, rng: np.random.Generator) -> float:
        while True:
            if spec.uniform is not None:
                value = rng.uniform(*spec.uniform)
            else:
                weights = np.array([c[0] for c in spec.components])
                _, mean, std = spec.components[rng.choice(len(spec.components), p=weights / weights.sum())]
                value = rng.normal(mean, std)
            if value > 0:
                return float(value)
