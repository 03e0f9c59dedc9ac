"""Client selection: which training clients take part in a round.

The round draws its clients with :meth:`ClientSelection.draw`, from a generator derived from
the run's SECRET noise seed (:func:`~lightning_dp.privacy.noise.derive_secret_generator`): the
client-level accountant of :class:`~lightning_dp.federated.parts.server_privacy.CentralGaussian`
claims amplification by :class:`PoissonSelection`'s rate, which holds only if nobody who reads
the record can recompute who took part (the module's public ``seed`` is in the logged params and
the uploaded checkpoint). :meth:`~ClientSelection.draw` refuses any other generator, so a new
selection inherits the check. The personalized algorithm claims no amplification by its uniform
selection; its draws are secret all the same (one rule for every selection).
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import Any, Literal

import torch

from lightning_dp.federated.parts.registry import Part, register_part
from lightning_dp.privacy.noise import require_secret
from lightning_dp.privacy.sampling import check_sample_rate

__all__ = ["ClientSelection", "PoissonSelection", "UniformSelection"]


class ClientSelection(Part):
    """Chooses the clients of a round."""

    kind = "selection"

    #: Poisson inclusion rate of every client (for amplification by sampling), or None
    poisson_rate: float | None = None

    def draw(self, num_clients: int, generator: torch.Generator,
             eligible: Callable[[int], bool] | None = None) -> tuple[list[int], int]:
        """:meth:`select` from a secret generator: what the round calls.

        Raises:
            TypeError: If ``generator`` is not a :class:`~lightning_dp.privacy.noise.SecretGenerator`.
        """
        require_secret(generator, f"client selection ({type(self).__name__})")
        return self.select(num_clients, generator, eligible)

    @abc.abstractmethod
    def select(self, num_clients: int, generator: torch.Generator,
               eligible: Callable[[int], bool] | None = None) -> tuple[list[int], int]:
        """``(chosen client positions, number declined)``; ``eligible(i)`` False means client i declines
        (its privacy cap would be exceeded). Implemented by each selection; called through :meth:`draw`."""
        raise NotImplementedError

    @abc.abstractmethod
    def expected_count(self, num_clients: int) -> float:
        """The expected number of participants (the divisor of a noisy average)."""
        raise NotImplementedError

    def check(self, num_clients: int) -> None:
        """Raise ValueError if the selection cannot run over ``num_clients`` training clients."""


@register_part("selection", "uniform")
class UniformSelection(ClientSelection):
    """``clients_per_round`` clients drawn uniformly without replacement (a random permutation's head).

    Args:
        clients_per_round: U.
        cap_policy: when a drawn client declines (privacy cap), ``"replace"`` walks on along
            the permutation until U clients said yes; ``"skip"`` runs the round with fewer.
    """

    def __init__(self, clients_per_round: int = 10, cap_policy: Literal["replace", "skip"] = "replace") -> None:
        if isinstance(clients_per_round, bool) or not isinstance(clients_per_round, int) or clients_per_round < 1:
            raise ValueError(f"clients_per_round={clients_per_round!r} is not allowed: pass a positive integer")
        if cap_policy not in ("replace", "skip"):
            raise ValueError(f"cap_policy={cap_policy!r} is not allowed; choose 'replace' or 'skip'")
        self.clients_per_round, self.cap_policy = clients_per_round, cap_policy

    def hparams(self) -> dict[str, Any]:
        return {"clients_per_round": self.clients_per_round, "cap_policy": self.cap_policy}

    def check(self, num_clients: int) -> None:
        if num_clients < self.clients_per_round:
            raise ValueError(f"clients_per_round={self.clients_per_round} exceeds the {num_clients} training clients; "
                             "lower clients_per_round.")

    def expected_count(self, num_clients: int) -> float:
        return float(self.clients_per_round)

    def select(self, num_clients, generator, eligible=None):
        permutation = torch.randperm(num_clients, generator=generator)
        if eligible is None:  # only the head becomes a list (a population of 1M: 1M Python ints otherwise)
            return permutation[: self.clients_per_round].tolist(), 0
        order = permutation.tolist()
        if self.cap_policy == "replace":  # walk the random order until U eligible clients said yes
            chosen, declined = [], 0
            for i in order:
                if len(chosen) == self.clients_per_round:
                    break
                if eligible(i):
                    chosen.append(i)
                else:
                    declined += 1
            return chosen, declined
        first = order[: self.clients_per_round]
        chosen = [i for i in first if eligible(i)]
        return chosen, len(first) - len(chosen)


@register_part("selection", "poisson")
class PoissonSelection(ClientSelection):
    """Every client takes part with probability ``sample_rate``, independently (client-level Poisson sampling).

    The number of participants is random, as DP-FedAvg's accounting with amplification by
    sampling requires (McMahan et al. 2018); a client that declines (privacy cap) is dropped.

    Args:
        sample_rate: q, in (0, 1].
    """

    poisson_rate: float  # set in __init__: never None here

    def __init__(self, sample_rate: float = 0.1) -> None:
        self.poisson_rate = check_sample_rate(sample_rate)

    def hparams(self) -> dict[str, Any]:
        return {"client_sample_rate": self.poisson_rate}

    def expected_count(self, num_clients: int) -> float:
        return self.poisson_rate * num_clients

    def select(self, num_clients, generator, eligible=None):
        drawn = (torch.rand(num_clients, generator=generator) < self.poisson_rate).nonzero().flatten().tolist()
        if eligible is None:
            return drawn, 0
        chosen = [i for i in drawn if eligible(i)]
        return chosen, len(drawn) - len(chosen)
