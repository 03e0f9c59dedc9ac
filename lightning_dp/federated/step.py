"""The federated round's private step: from the clients' releases to the new hypotheses, accounted.

One object, :class:`PrivateStep`, does for a round what Opacus' ``DPOptimizer.pre_step`` does for a batch: it takes
what the clients released (:mod:`lightning_dp.federated.clients`), charges the clients' ledgers, has the server
privacy part clip, reduce and noise them through the aggregator, steps the hypotheses, accounts the spend, and
writes the round's metrics under the names the record gives them (:class:`~lightning_dp.privacy.record.RoundNames`).
Each round it receives a frozen :class:`RoundContext` (the round's index, participants, hypotheses and parts). It also
plans the accountants when training starts and writes the final spend when it ends, and keeps what the fit recorded
for the reports (:mod:`lightning_dp.federated.reports`) and the checkpoint (:mod:`lightning_dp.federated.state`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import Tensor

from lightning_dp.datamodules.federated import client_ids, client_sizes
from lightning_dp.federated import reports
from lightning_dp.federated.parts import Combination
from lightning_dp.federated.parts.server_privacy import RoundReleases
from lightning_dp.federated.settings import check_combination
from lightning_dp.federated.streams import _SERVER_COUNT, _SERVER_NOISE
from lightning_dp.federated.local import delta_norms
from lightning_dp.privacy.ledger import PrivacyLedger
from lightning_dp.privacy.noise import derive_secret_generator

__all__ = ["PrivateStep", "RoundContext"]


@dataclass(frozen=True)
class RoundContext:
    """What one round is, fixed before its clients train.

    Attributes:
        r: the round's index (rounds done before it).
        index: its participants (positions among the training clients), the same on every process.
        declined: how many selected clients declined (a privacy cap, a spent record-level budget).
        last: whether the fit ends after it anyway (``max_epochs``, ``max_steps``).
        written: whether Lightning writes its metrics (``log_every_n_steps``).
        hypotheses: the k hypotheses it starts from (the round's buffer, stepped in place).
        parts: the round's parts and k.
    """

    r: int
    index: list[int]
    declined: int
    last: bool
    written: bool
    hypotheses: Tensor
    parts: Combination

    @property
    def report(self) -> Literal["final", "interim"] | None:
        """How the server reports its epsilon this round: a PLD composition only when Lightning writes the round's
        metrics or the run ends; the writes before the last from the accountants' cheaper variant (an upper bound
        too), the last from their own."""
        return "final" if self.last else "interim" if self.written else None

    @classmethod
    def begin(cls, rnd: Any) -> RoundContext:
        """The context of the round ``rnd`` is about to run: its clients drawn (the same on every process)."""
        r = int(rnd.rounds)
        index, declined = rnd.clients.sample(r)
        trainer = rnd.trainer
        epochs, steps = trainer.max_epochs, trainer.max_steps
        last = bool((epochs is not None and epochs > 0 and trainer.current_epoch + 1 >= epochs)
                    or (steps is not None and steps > 0 and trainer.global_step + 1 >= steps))  # ends anyway
        written = bool(getattr(trainer, "_logger_connector", None) is None
                       or trainer._logger_connector.should_update_logs)
        parts = Combination(rnd.selection, rnd.update, rnd.sanitizer, rnd.aggregator, rnd.server_privacy, rnd.k)
        return cls(r, index, declined, last, written, rnd.hypotheses, parts)


class PrivateStep:
    """The round's private step and its accounting (module docstring).

    Args:
        round: the :class:`~lightning_dp.federated.round.FederatedRound` it steps.
        ledger: the clients' ledger of their sanitized releases (the sanitizer's :meth:`make_ledger`).

    Attributes:
        history: the releases and hypotheses of every round of a model of <= 2 parameters (the parameter plot).
        cosines: ``(round, update cosine, gradient cosine)`` per round, with ``diagnostics``.
        epsilon_written: the last round whose written metrics carried the final spend.
        fit_rounds, fit_participants: rounds and participations of this fit (the end-of-fit summary).
        ledgers_missing: loaded from a public checkpoint without its ledgers (training on is refused).
    """

    def __init__(self, round: Any, ledger: PrivacyLedger) -> None:
        self.round = round
        self.ledger = ledger
        self.history: list[dict[str, Any]] = []
        self.cosines: list[tuple[int, float, float]] = []
        self.epsilon_written = -1
        self.fit_rounds, self.fit_participants = 0, 0
        self.ledgers_missing = False

    # ------------------------------------------------------------------ what the parts say
    def follows_clip(self) -> bool:
        """Whether the clients clip at the server's adaptive threshold (clip and sector sanitizers without local
        noise under ``CentralGaussian(adaptive=True)``): they report whether their raw update was within it."""
        rnd = self.round
        return bool(getattr(rnd.server_privacy, "adaptive", False) and rnd.sanitizer.follows_clip)

    def update_set(self) -> tuple[float, float] | None:
        """The public set the next round's released updates lie in (one hypothesis; the reference is the
        previous round's released change), for the server's accounting under replacement."""
        rnd = self.round
        if rnd.k != 1:
            return None
        return rnd.sanitizer.update_set(reference_given=bool(rnd.previous_step[0].norm() > 0))

    def sums_releases(self) -> bool:
        """Whether the round sums its releases as it makes them: the server reads only their norms and a sum
        (:attr:`~lightning_dp.federated.parts.ServerPrivacy.sums_releases`: DP-FedAvg's clipped sum), the clients
        train here (not on a deployment's nodes), and nothing else reads the releases (diagnostics, the recorded
        releases of a tiny model)."""
        rnd = self.round
        return (rnd.server_privacy.sums_releases and rnd.k == 1 and rnd.remote is None and not rnd.diagnostics
                and not (rnd.spec.numel <= 2 and rnd.names.records_releases))

    def record_metrics(self) -> dict[str, float]:
        """The record-level ledger's metrics (local DP-SGD) under their recorded names."""
        names = self.round.names
        return {names.ledger(k.split("/", 1)[1]): v for k, v in self.round.update.privacy_metrics().items()}

    def spend(self) -> list[Any]:
        """What the run spent, per level (:meth:`FederatedRound.privacy_spend`)."""
        from lightning_dp.privacy.spend import Spend

        rnd = self.round
        spends = list(rnd.server_privacy.privacy_spend())
        secret = rnd.selection_is_secret()  # the ledgers then show who took part: nonprivate in the grid's record
        if rnd.sanitizer.accountable:
            spends.append(Spend.per_client("client_ledger", self.ledger, why=rnd.sanitizer.name,
                                           secret_participation=secret, unit=rnd.sanitizer.ledger_label))
        if rnd.update.accountable:
            spends.append(Spend.per_client("record", rnd.update.ledger, why=rnd.update.name,
                                           secret_participation=secret))
        if not spends:
            spends.append(Spend.unprotected("client", f"{type(rnd).__name__}: the clients' releases are not "
                                                      "sanitized and nothing is accounted"))
        return spends

    # ------------------------------------------------------------------ the fit's lifecycle
    def setup(self, stage: str) -> None:
        """Read the clients, check the combination before any client trains, set up the run's protocol (uploads
        refused, the gate, the secret seed the same on every process) and take rank 0's public seed."""
        from lightning_dp.datamodules.federated import FederatedDataModule

        rnd = self.round
        dm = rnd.trainer.datamodule if rnd._trainer is not None else None  # set by Lightning's data connector
        if not isinstance(dm, FederatedDataModule):
            raise MisconfigurationException(
                "PersonalizedFederatedModule reads its clients from a FederatedDataModule (e.g. "
                "lightning_dp.datamodules.SyntheticLinearMixtureDataModule): pass it as "
                "trainer.fit(module, datamodule=...).")
        rnd.read_clients(dm)
        if stage == "fit":
            try:
                rnd.selection.check(len(rnd.clients.splits["train"]))
            except ValueError as err:
                raise MisconfigurationException(str(err)) from None
            check_combination(rnd.parts(), rnd.k)
            if rnd.test_every_check and not rnd.clients.splits["test"]:
                raise MisconfigurationException(
                    f"test_every_check=True but {type(dm).__name__} has no test clients: give it some (e.g. "
                    "num_test_clients for FederatedVisionDataModule), or set test_every_check=False")
            rnd.protocol.setup(rnd.trainer, refuse_uploads=rnd._accountable())
        if rnd.trainer.world_size > 1:  # a default public seed is drawn per process: every process must use rank 0's
            rnd.seed = int(rnd.trainer.strategy.broadcast(rnd.seed, src=0))

    def start(self) -> None:
        """When training starts: refuse a checkpoint without its ledgers, plan the record-level update and the
        server's accountant (its parameters logged), and stop before the first round if none fits the budget."""
        rnd = self.round
        trainer = rnd.trainer
        rnd.protocol.start(trainer)
        if self.ledgers_missing:
            from lightning_dp.federated.state import refuse_missing_ledgers

            refuse_missing_ledgers(rnd)
        self.fit_rounds, self.fit_participants = 0, 0
        planned_rounds = trainer.max_epochs if trainer.max_epochs and trainer.max_epochs > 0 else None
        if self.follows_clip():  # the sets the releases lie in are the server's threshold's
            rnd.sanitizer.follow_clip(rnd.server_privacy.clip)
        if rnd.update.accountable:
            self.plan_update(planned_rounds)
        privacy = rnd.server_privacy
        if not privacy.accountable:
            return
        num_clients = len(rnd.clients.splits["train"])
        try:
            privacy.plan(sample_rate=rnd.selection.poisson_rate, num_clients=num_clients,
                         expected_count=rnd.selection.expected_count(num_clients),
                         planned_rounds=planned_rounds,
                         update_sets=(rnd.sanitizer.update_set(False), rnd.sanitizer.update_set(True)))
        except ValueError as err:
            raise MisconfigurationException(f"{type(privacy).__name__}: {err}") from None
        for logger in trainer.loggers:
            logger.log_hyperparams({k: v for k, v in privacy.hparams().items() if v is not None})
        if not privacy.budget_left(self.update_set()):
            rank_zero_warn(f"{type(privacy).__name__}: no round fits in the remaining budget; stopping before the "
                           "first round.")
            trainer.should_stop = True

    def plan_update(self, planned_rounds: int | None) -> None:
        """Fix the record-level private update's per-client noise (calibrated to its budget) and log it."""
        rnd = self.round
        clients = rnd.clients.splits["train"]
        num_clients = len(clients)
        try:
            rnd.update.plan(client_ids(clients, range(num_clients)), client_sizes(clients).tolist(),
                            planned_rounds=planned_rounds,
                            inclusion_rate=rnd.selection.expected_count(num_clients) / num_clients)
        except ValueError as err:
            raise MisconfigurationException(f"{type(rnd.update).__name__}: {err}") from None
        sigmas = sorted(rnd.update.noise_multipliers())
        params = {"local_noise_multiplier_min": sigmas[0], "local_noise_multiplier_max": sigmas[-1],
                  "local_participations_planned": getattr(rnd.update, "participations_planned", None)}
        for logger in rnd.trainer.loggers:
            logger.log_hyperparams({k: v for k, v in params.items() if v is not None})

    def end(self) -> None:
        """When training ends: the final spend (if Lightning's writes missed it), the artifacts, the summary."""
        rnd = self.round
        step = int(rnd.trainer.global_step)
        if step > 0 and self.epsilon_written != int(rnd.rounds) - 1:
            # a run ended between log writes or after an interim one (max_time, an interrupt, another callback's
            # stop): write the final spend from the accountants' own configuration, at the step numbering of the
            # round's own metrics (those of optimizer step n are written at n - 1; after an interim write of the same
            # round this one is the later, which MLflow takes as the latest)
            final = rnd.server_privacy.epsilon_metrics() if rnd.server_privacy.accountable else {}
            final.update(self.record_metrics())
            rnd.protocol.write_final(rnd.trainer, final, step)
        reports.log_artifacts(rnd)  # they pass the gate by their names (under nonprivate/ when the selection is secret)
        rnd.protocol.end(lambda: reports.summary_title(rnd), lambda: reports.summary_rows(rnd))

    # ------------------------------------------------------------------ one round
    def run(self) -> None:
        """One round: select, train and sanitize on the clients, aggregate (with the server's privacy), log."""
        rnd = self.round
        rnd.protocol.cover(rnd.trainer)  # a logger added by a hook since setup
        ctx = RoundContext.begin(rnd)
        names = rnd.names
        metrics: dict[str, float] = {names.stat("participants"): float(len(ctx.index)),
                                     names.stat("declined"): float(ctx.declined)}
        if ctx.index or ctx.parts.server_privacy.accountable:  # an accounted round without participants releases noise
            releases, stats, sums = self.client_releases(ctx, metrics)
            self.server_step(ctx, releases, stats, metrics=metrics, sums=sums)
        else:
            # a round without participants is still a round
            rnd.optimizers().step(closure=lambda: None)  # one optimizer
        self.end_round(ctx, metrics)

    def client_releases(self, ctx: RoundContext,
                        metrics: dict[str, float]) -> tuple[Tensor, Tensor, tuple[Tensor, Tensor] | None]:
        """The server's view of the round: every release and its statistics, in the round's client order, on every
        process; the clients' costs charged to their ledgers. For a server whose input is a sum
        (:meth:`sums_releases`), no releases ((0, P)) but their norms and sum (:attr:`RoundReleases.sums`)."""
        rnd, index, r, parts = self.round, ctx.index, ctx.r, ctx.parts
        clients, hyps, numel = rnd.clients, ctx.hypotheses, rnd.spec.numel
        sums = None
        if self.sums_releases():
            local_stats, local_norms, total = clients.summed_round(index, r)
            if rnd.trainer.world_size > 1:  # P floats per process instead of its (U / W, P) releases
                # gloo's and NCCL's all-reduce hand every process the same bits: every process then adds the same
                # server noise (one secret stream) to the same sum and holds the same hypotheses
                torch.distributed.all_reduce(total)
            sums = (clients.gather_rows(local_norms, len(index)), total)
            local_releases, local_diagnostics = hyps.new_zeros((0, numel)), None
        elif index:
            local_releases, local_stats, local_diagnostics = clients.client_round(index, r)
        else:
            local_releases, local_stats, local_diagnostics = clients.empty()
        if local_diagnostics is not None:
            self.log_cosines(r, clients.gather_rows(local_diagnostics, len(index)), metrics)
        releases = local_releases if sums is not None else clients.gather_rows(local_releases, len(index))
        stats = clients.gather_rows(local_stats, len(index))
        if parts.sanitizer.accountable:  # e.g. nu = 0, the non-private baseline: nothing to account
            for client_id, cost in zip(client_ids(clients.splits["train"], index), stats[:, 1].tolist()):
                self.ledger.charge(client_id, cost)
        parts.update.charge(index)  # record-level ledger (local DP-SGD)
        if parts.num_hypotheses == 1 and len(index):  # the released updates' norms: post-processing of sanitized ones
            names = rnd.names
            norms = sums[0] if sums is not None else delta_norms(releases, hyps[0])
            metrics[names.stat("update_norm_mean", of_releases=True)] = float(norms.mean())
            metrics[names.stat("update_norm_std", of_releases=True)] = float(norms.std()) if len(index) > 1 else 0.0
        return releases, stats, sums

    def server_step(self, ctx: RoundContext, releases: Tensor, stats: Tensor, *, metrics: dict[str, float],
                    sums: tuple[Tensor, Tensor] | None = None) -> None:
        """The server's aggregation of the round (through its privacy part) and the optimizer step to it."""
        rnd, index, r, parts = self.round, ctx.index, ctx.r, ctx.parts
        hyps, privacy, k = ctx.hypotheses, parts.server_privacy, parts.num_hypotheses
        train = rnd.clients.splits["train"]
        parts.aggregator.observe(client_ids=client_ids(train, index), layer_sizes=rnd.spec.sizes, round_index=r,
                                 budgets=(parts.update.revealed_budgets(index) if parts.aggregator.needs_budgets
                                          else None))
        following = self.follows_clip()
        held = RoundReleases(releases, hyps, weights=stats[:, 2],
                             expected_count=parts.selection.expected_count(len(train)), update_set=self.update_set(),
                             unclipped=stats[:, 3] if following else None, sums=sums)
        new, assignment, privacy_metrics = privacy.aggregate(
            held, parts.aggregator,
            noise_generator=derive_secret_generator(rnd._noise_seed, _SERVER_NOISE, r, device=hyps.device),
            count_generator=derive_secret_generator(rnd._noise_seed, _SERVER_COUNT, r), report_epsilon=ctx.report)
        if rnd.trainer.world_size > 1 and hyps.device.type == "cuda":
            # every process aggregated the same releases, but CUDA's float index_add_ (the k-means' cluster sums) is
            # not deterministic: rank 0's result for all, so that the processes keep the same hypotheses
            new = new.contiguous()
            torch.distributed.broadcast(new, src=0)
            on_device = assignment.to(hyps.device).contiguous()  # NCCL sends device tensors only
            torch.distributed.broadcast(on_device, src=0)
            assignment = on_device.to(assignment.device)
        if following:  # the next round's clients clip at the server's new (public) threshold
            parts.sanitizer.follow_clip(privacy.clip)
        metrics.update(parts.aggregator.round_metrics(parts.update, index))  # e.g. PFA's split (pdpfl/*)
        rnd.previous_step.copy_(new - hyps)
        rnd.optimizers().step(closure=lambda: hyps.copy_(new))  # one optimizer
        metrics.update(privacy_metrics)
        sizes = torch.bincount(assignment, minlength=k)
        if len(index):  # the clients' private losses: covered by no accountant
            losses = stats[:, 0][stats[:, 0].isfinite()]  # NaN: withheld (lightning_dp.flower), or a broken client's
            if len(losses):
                metrics["nonprivate/train_loss"] = float(losses.mean())
            dropped = float(stats[:, 4].nansum())  # NaN: withheld by a deployment's node (lightning_dp.flower)
            if dropped:
                metrics["nonprivate/dropped_updates"] = dropped
        names = rnd.names
        for j in range(k):  # the server's clustering of the releases
            metrics[names.stat(f"cluster_size_{j}", of_releases=True)] = float(sizes[j])
        if rnd.spec.numel <= 2 and names.records_releases:
            self.history.append({"round": r, "releases": releases.detach().cpu().clone(),
                                 "hypotheses": new.detach().cpu().clone()})

    def end_round(self, ctx: RoundContext, metrics: dict[str, float]) -> None:
        """The round's spend and ledgers as metrics, the budget's stop, the logging."""
        rnd, r, parts, names = self.round, ctx.r, ctx.parts, self.round.names
        privacy = parts.server_privacy
        if parts.sanitizer.accountable and parts.num_hypotheses > 1:  # the choice's cost grows as hypotheses separate
            metrics["privacy/cost_per_participation"] = rnd.participation_cost()
        if len(self.ledger):
            metrics[names.ledger("client_epsilon_median")] = self.ledger.median()
            metrics[names.ledger("client_epsilon_max")] = self.ledger.max()
        if (ctx.last or ctx.written) and parts.update.accountable:  # per-client compositions: only when written
            metrics.update(self.record_metrics())
        rnd.rounds += 1
        final = ctx.last or not privacy.accountable  # the server's spend written (if at all) from its own accountant
        if (privacy.accountable and not ctx.last and not privacy.budget_left(self.update_set())
                and not rnd.trainer.should_stop):
            metrics.update(privacy.epsilon_metrics())  # the final spend is always recorded
            final = True
            rank_zero_info(f"{type(privacy).__name__}: stopping after round {r + 1}: the next round would exceed "
                           f"target_epsilon={privacy.target_epsilon} (spent {metrics['privacy/epsilon']:.4f}).")
            rnd.trainer.should_stop = True
        if ("privacy/epsilon" in metrics or names.ledger("record_epsilon_max") in metrics) and ctx.written and final:
            self.epsilon_written = r  # an interim write is not: on_train_end writes the final spend after it
        if not rnd.log_nonprivate_metrics:  # exact statistics of the clients' data, covered by no accountant
            metrics = {k: v for k, v in metrics.items() if not k.startswith("nonprivate/")}
        # float64: Lightning would store a Python float as float32 and round the spend
        rnd.log_dict({k: torch.tensor(v, dtype=torch.float64) for k, v in metrics.items()}, on_step=True,
                     on_epoch=False, batch_size=1)
        self.fit_rounds += 1
        self.fit_participants += len(ctx.index)
        self.log_progress(metrics)

    def log_progress(self, metrics: dict[str, float]) -> None:
        """The round's progress on Lightning's progress bar, under short names (not sent to the loggers, which
        get the metrics under their full names): ``round`` (rounds done), ``clients`` (this round's
        participants), ``client_eps_med``/``client_eps_max`` (the per-client ledger), ``eps`` (the server's
        client-level epsilon, when written) and ``record_eps_max`` (local DP-SGD, when written)."""
        rnd, names = self.round, self.round.names
        short = {names.stat("participants"): "clients", names.ledger("client_epsilon_median"): "client_eps_med",
                 names.ledger("client_epsilon_max"): "client_eps_max", "privacy/epsilon": "eps",
                 names.ledger("record_epsilon_max"): "record_eps_max"}
        bar = {"round": float(rnd.rounds)}
        bar.update({name: metrics[key] for key, name in short.items() if key in metrics})
        rnd.log_dict({k: torch.tensor(v, dtype=torch.float64) for k, v in bar.items()}, prog_bar=True, logger=False,
                     on_step=True, on_epoch=False, batch_size=1)

    def log_cosines(self, r: int, rows: Tensor, metrics: dict[str, float]) -> None:
        """``nonprivate/update_cosine`` and ``nonprivate/gradient_cosine`` of the round's diagnostic rows."""
        from lightning_dp.federated.diagnostics import mean_pairwise_cosine

        p = self.round.spec.numel
        updates, gradients = mean_pairwise_cosine(rows[:, :p]), mean_pairwise_cosine(rows[:, p:])
        metrics["nonprivate/update_cosine"], metrics["nonprivate/gradient_cosine"] = updates, gradients
        self.cosines.append((r, updates, gradients))
