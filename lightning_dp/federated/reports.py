"""The federated round's figures, tables and end-of-fit summary.

The figures and tables are pure functions of what the round recorded (no Trainer, no logging). Three functions read
a fitted round (:class:`~lightning_dp.federated.round.FederatedRound`) and place them: :func:`log_artifacts` logs
them where the record's names put them (``privacy/``, ``nonprivate/``, ``federated/``, decided by what the values
are), :func:`summary_title` and :func:`summary_rows` are the summary the run's protocol prints.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import math

import torch

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["cosine_figure", "cosine_table", "log_artifacts", "parameter_figure", "record_table", "spend_histogram",
           "spend_table", "summary_rows", "summary_title"]


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


# ---------------------------------------------------------------------- a fitted round's artifacts and summary
def log_artifacts(rnd: Any) -> None:
    """On global zero, the round's artifacts: the clients' ledger (histogram and table), the parameter plot of a
    model of <= 2 parameters, the record-level ledger (local DP-SGD) and the cosine diagnostics; each passes the gate
    by its name (under ``nonprivate/`` when the selection is secret)."""
    from lightning_dp import tracking

    trainer, names, step = rnd.trainer, rnd.names, rnd.private_step
    if not trainer.is_global_zero:
        return
    if len(rnd.ledger):
        values = list(rnd.ledger.as_dict().values())
        fig = spend_histogram(values, xlabel=rnd.sanitizer.ledger_label,
                              title=f"privacy spend per client, {rnd.sanitizer.name}, n={rnd.spec.numel}")
        tracking.log_figure(trainer, fig, names.ledger("client_epsilon_hist.png"))
        table = spend_table(clients=len(values), median=rnd.ledger.median(), maximum=rnd.ledger.max(),
                            cost_per_participation=rnd.participation_cost())
        tracking.log_text(trainer, table, names.ledger("client_epsilon.tsv"))
    if step.history:
        tracking.log_figure(trainer, parameter_figure(step.history, rnd.k), "federated/parameters.png")
    update = rnd.update
    if update.accountable and len(update.ledger):  # every client's record-level epsilon, noise and participations
        ledger = update.ledger
        spend = ledger.as_dict()
        table = record_table(
            (client.client_id, spend.get(client.client_id, 0.0), budget, plan, ledger.participations(client.client_id))
            for client, plan, budget in zip(rnd.clients.splits["train"], update.client_plans(),
                                            update.client_budgets()))
        tracking.log_text(trainer, table, names.ledger("record_epsilon.tsv"))
        fig = spend_histogram(
            list(spend.values()),
            xlabel=f"record-level epsilon at delta={ledger.delta:g} ({ledger.accountant}, {ledger.adjacency})",
            title=f"local DP-SGD spend per client ({update.sampling} batches)")
        tracking.log_figure(trainer, fig, names.ledger("record_epsilon_hist.png"))
    if step.cosines:
        tracking.log_figure(trainer, cosine_figure(step.cosines, update_name=update.name), "nonprivate/cosine.png")
        tracking.log_text(trainer, cosine_table(step.cosines), "nonprivate/cosine.tsv")


def summary_title(rnd: Any) -> str:
    """The summary's title: the round's class, its rounds, and those of this fit when it resumed."""
    rounds, fit_rounds = int(rnd.rounds), rnd.private_step.fit_rounds
    resumed = f", {fit_rounds} in this fit" if fit_rounds != rounds else ""
    return f"{type(rnd).__name__}: {rounds} rounds{resumed}"


def summary_rows(rnd: Any) -> list[tuple[str, str]]:
    """``(label, value)`` rows of the end-of-training summary (:mod:`lightning_dp.callbacks.summary`)."""
    trainer, names, protocol, step = rnd.trainer, rnd.names, rnd.protocol, rnd.private_step
    num_train = len(rnd.clients.splits["train"])
    mean = step.fit_participants / max(step.fit_rounds, 1)
    if not protocol.shown(trainer, names.stat("participants")):  # the exact counts are nonprivate, and off
        rows = [("clients", f"{rnd.selection.expected_count(num_train):.3g} expected per round ({num_train} "
                            f"training clients, {rnd.selection.name} selection; who took part is secret)")]
    else:
        rows = [("clients", f"{mean:.3g} per round ({step.fit_participants} participations this fit; {num_train} "
                            f"training clients, {rnd.selection.name} selection)")]
    if len(rnd.ledger) and protocol.shown(trainer, names.ledger("client_epsilon_max")):
        cap = "" if rnd.client_privacy_cap is None else f", cap {rnd.client_privacy_cap:g}"
        rows.append(("client epsilon", f"median {rnd.ledger.median():.4g}, max {rnd.ledger.max():.4g} "
                                       f"({rnd.sanitizer.ledger_label}{cap})"))
    privacy = rnd.server_privacy
    if privacy.accountable:
        eps = privacy.epsilon_metrics().get("privacy/epsilon", math.nan)
        target = getattr(privacy, "target_epsilon", None)
        of = "" if target is None else f" of target_epsilon {target:g}"
        rows.append(("epsilon", f"{eps:.4g}{of} at delta {getattr(privacy, 'target_delta', math.nan):g} "
                                f"(client-level, {type(privacy).__name__})"))
    record = (rnd.update.privacy_metrics() if rnd.update.accountable
              and protocol.shown(trainer, names.ledger("record_epsilon_max")) else {})
    if record:
        med, top = record["privacy/record_epsilon_median"], record["privacy/record_epsilon_max"]
        rows.append(("record epsilon", f"median {med:.4g}, max {top:.4g} (per client, {rnd.update.name})"))
    if not (rnd.sanitizer.accountable or privacy.accountable or rnd.update.accountable):
        rows.append(("privacy", "none: the clients' releases are not sanitized and nothing is accounted"))
    return rows  # the last validation's rows: the protocol's (lightning_dp.protocol.validation_rows)
