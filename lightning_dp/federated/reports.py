"""The federated round's figures and tables, as pure functions of what the round recorded (no Trainer, no logging).

The round (:class:`~lightning_dp.federated.round.FederatedRound`) logs what these return: where each lands in the
record (``privacy/``, ``nonprivate/``, ``federated/``) is decided there, by what the values are.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["cosine_figure", "cosine_table", "parameter_figure", "record_table", "spend_histogram", "spend_table"]


def spend_histogram(values: Sequence[float], *, xlabel: str, title: str) -> Figure:
    """A histogram of the clients' privacy spend (one value per client)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6, 4))
    ax = fig.subplots()
    ax.hist(list(values), bins=min(30, max(5, len(set(values)))))
    ax.set_xlabel(xlabel)
    ax.set_ylabel("clients")
    ax.set_title(title)
    return fig


def spend_table(*, clients: int, median: float, maximum: float, cost_per_participation: float) -> str:
    """The d-privacy ledger's summary, a two-column TSV."""
    return (f"clients\t{clients}\nmedian\t{median:.6g}\nmax\t{maximum:.6g}\n"
            f"cost_per_participation\t{cost_per_participation:.6g}\n")


def record_table(rows: Iterable[tuple[str, float, float | None, Any, int]]) -> str:
    """Every client's record-level ledger, a TSV: ``(client, epsilon, budget (None: none), plan, participations)``
    per client, ``plan`` a :class:`~lightning_dp.federated.local_dp_sgd.ClientPlan` (noise, rate, steps)."""
    lines = ["client\tepsilon\tbudget\tnoise_multiplier\tsample_rate\tsteps_per_participation\tparticipations"]
    for client, epsilon, budget, plan, participations in rows:
        lines.append(f"{client}\t{epsilon:.6g}\t{'inf' if budget is None else f'{budget:.6g}'}\t"
                     f"{plan.noise_multiplier:.6g}\t{plan.sample_rate:.6g}\t{plan.steps}\t{participations}")
    return "\n".join(lines) + "\n"


def cosine_figure(cosines: Sequence[tuple[int, float, float]], *, update_name: str) -> Figure:
    """Mean pairwise cosine of the participants' updates and of per-sample gradients, per round (thesis Fig. 5.4)."""
    from matplotlib.figure import Figure

    rounds, updates, gradients = zip(*cosines)
    fig = Figure(figsize=(6, 4))
    ax = fig.subplots()
    ax.plot(rounds, updates, marker=".", label="client updates")
    ax.plot(rounds, gradients, marker=".", label="per-sample gradients (one example per client)")
    ax.axhline(0.0, color="grey", linewidth=0.5)
    ax.set_xlabel("round")
    ax.set_ylabel("mean pairwise cosine similarity")
    ax.legend()
    ax.set_title(f"alignment of the participants' updates ({update_name})")
    return fig


def cosine_table(cosines: Sequence[tuple[int, float, float]]) -> str:
    """The same per round, a TSV."""
    return "round\tupdate_cosine\tgradient_cosine\n" + "".join(f"{r}\t{u:.6g}\t{g:.6g}\n" for r, u, g in cosines)


def parameter_figure(history: Sequence[dict[str, Any]], num_hypotheses: int) -> Figure:
    """Released 2-d parameters (grey) and each hypothesis' path over the rounds (the seed's synthetic figure)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6, 5))
    ax = fig.subplots()
    for h in history:
        r = h["releases"]
        ax.scatter(r[:, 0], r[:, 1], s=6, alpha=0.25, color="tab:gray")
    path = torch.stack([h["hypotheses"] for h in history])  # (rounds, k, 2)
    for j in range(num_hypotheses):
        ax.plot(path[:, j, 0], path[:, j, 1], marker=".", label=f"hypothesis {j}")
    ax.set_xlabel("theta[0]")
    ax.set_ylabel("theta[1]")
    ax.legend()
    ax.set_title("released parameters (grey) and hypotheses per round")
    return fig
