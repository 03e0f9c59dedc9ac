"""Server privacy: central noise on the aggregate, and its client-level accountant.

:class:`CentralGaussian` is client-level DP-FedAvg (McMahan et al., ICLR 2018): updates clipped at ``C``, one
``N(0, (z C)^2 I)`` on the sum, divided by the expected number of participants; each round is one
Poisson-subsampled Gaussian with multiplier ``z``, accounted over rounds. ``adaptive=True`` adds Andrew et al.'s
quantile clipping; the noise comes from the round's secret noise seed. Adaptive clipping, replacement, and how
Flower's DP wrappers differ: docs/federated.md, "Client-level DP-FedAvg" and "Adjacency".
"""

from __future__ import annotations

import abc
import math
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

from lightning_dp.federated.local import delta_norms_and_sum
from lightning_dp.federated.parts.registry import Combination, Part, register_part
from lightning_dp.privacy.accounting import check_adjacency, check_delta, check_target_epsilon, get_accountant
from lightning_dp.privacy.adaptive import default_count_noise_std, quantile_clip_update, quantile_noise_split
from lightning_dp.privacy.calibration import calibrate_noise_multiplier
from lightning_dp.privacy.clipping import check_clip, clip_factors
from lightning_dp.privacy.delta import LargeDeltaWarning, check_delta_for_size
from lightning_dp.privacy.noise import check_noise_multiplier, gaussian_noise, require_secret

__all__ = ["CentralGaussian", "NoServerPrivacy", "RoundReleases", "ServerPrivacy"]


@dataclass(frozen=True)
class RoundReleases:
    """What the server holds at the end of a round: the sanitized releases and what is public about them."""

    releases: Tensor  #: (U, P) the round's releases
    hypotheses: Tensor  #: (k, P) the models the clients started from
    weights: Tensor | None  #: the aggregator's weights of the releases (None: plain)
    expected_count: float  #: the expected number of participants (the divisor of a noisy average)
    #: ``(radius, diameter)`` of a set every release's update lies in (public, from the sanitizer:
    #: :meth:`~lightning_dp.federated.parts.ClientSanitizer.update_set`), or None
    update_set: tuple[float, float] | None = None
    #: one 0/1 per release, whether the client's raw update was within the threshold it clipped at (sanitizers
    #: that follow the server's adaptive threshold); None: the server reads the norms of the releases
    unclipped: Tensor | None = None
    #: ``(norms (U,) float64, sum (P,))`` of the releases, summed as the round made them (a server whose input is
    #: a sum, :attr:`ServerPrivacy.sums_releases`: :meth:`CentralGaussian.partial_sum` of every block, added up
    #: over blocks and processes); ``releases`` is then (0, P). None: the server reads ``releases``
    sums: tuple[Tensor, Tensor] | None = None


class ServerPrivacy(Part):
    """Wraps the aggregation of a round (Flower's view of DP as a wrapper: clip, aggregate, noise)."""

    kind = "server_privacy"

    #: True when the part accounts a client-level epsilon
    accountable = False
    #: True when all it reads of the releases is per-release norms and :meth:`partial_sum`, a sum over releases:
    #: the round then sums each block of clients as it is trained (and all-reduces the sums over DDP processes)
    #: instead of holding and gathering the (U, P) releases
    sums_releases = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "accounted" in vars(cls):  # renamed: a subclass still setting it would silently claim nothing
            raise TypeError(f"{cls.__name__} sets 'accounted', which is now 'accountable' (one vocabulary for every "
                            "part): rename the attribute")

    def problems(self, parts: Combination) -> list[str]:
        if not self.accountable:
            return []
        found = []
        if parts.num_hypotheses != 1:
            found.append(f"num_hypotheses={parts.num_hypotheses} (central DP averages one global model: use 1)")
        if not parts.aggregator.plain_mean:
            found.append("the aggregator must be fedavg with weighted=False (weights by example counts depend "
                         "on private data and change the sensitivity)")
        if parts.selection.poisson_rate is None:
            found.append("client selection must be poisson (the accountant claims amplification by Poisson "
                         "sampling; a fixed number of clients per round is not accounted)")
        return [f"{type(self).__name__}: " + "; ".join(found)] if found else []

    @abc.abstractmethod
    def aggregate(self, held: RoundReleases, aggregator: Any, *, noise_generator: torch.Generator,
                  count_generator: torch.Generator,
                  report_epsilon: Literal["final", "interim"] | None = "final") -> tuple[Tensor, Tensor, dict[str, float]]:
        """``(new hypotheses, assignment, metrics)`` of the round, its noise from the two secret generators.

        ``report_epsilon``: include :meth:`epsilon_metrics`, ``"interim"`` from the accountants' cheaper variant
        (the round passes None between log writes and "interim" at the writes before its last: a PLD composition
        per round can cost more than the round).
        """

    def partial_sum(self, releases: Tensor, origin: Tensor) -> tuple[Tensor, Tensor]:
        """``(norms (m,) float64, sum (P,))`` of a block of releases around ``origin``: what :meth:`aggregate` reads
        of them, for a part with :attr:`sums_releases` (the sums of disjoint blocks add up to the whole's)."""
        raise NotImplementedError(f"{type(self).__name__} reads the releases themselves (sums_releases=False)")

    def sum_weights(self, norms: Tensor) -> Tensor | None:
        """``w(norms)`` (m,) float64 when :meth:`partial_sum` is ``(norms, sum_i w(norm_i) (release_i - origin))``
        with ``w`` a function of each update's float64 norm only; None (the default) when it is not. The round may
        then compute the sum from factors of the updates instead of the releases
        (:meth:`~lightning_dp.federated.clients.RoundClients.fused_block`): a subclass that changes
        :meth:`partial_sum` returns None here."""
        return None

    def epsilon_metrics(self, *, interim: bool = False) -> dict[str, float]:
        """The spend so far, as metrics (``privacy/epsilon``, ...); empty when nothing is accounted.

        ``interim``: from the accountants' cheaper variant (:meth:`~lightning_dp.privacy.accounting.Accountant.
        interim_epsilon`, also an upper bound), for the writes between a run's first and last."""
        return {}

    def privacy_spend(self) -> list[Any]:
        """The client-level spend (:class:`~lightning_dp.privacy.spend.Spend`), empty when nothing is accounted."""
        return []


@register_part("server_privacy", "none")
class NoServerPrivacy(ServerPrivacy):
    """The aggregator's result as it is."""

    def aggregate(self, held, aggregator, *, noise_generator, count_generator, report_epsilon="final"):
        new, assignment = aggregator.aggregate(held.releases, held.hypotheses, held.weights)
        return new, assignment, {}


@register_part("server_privacy", "gaussian")
class CentralGaussian(ServerPrivacy):
    """Client-level DP-FedAvg with fixed or adaptive clipping (module docstring).

    Args:
        noise_multiplier: z. If omitted, calibrated so that the planned rounds spend at most
            ``target_epsilon`` (the planned length: ``rounds``, else the Trainer's ``max_epochs``).
        target_epsilon: the budget; the run stops before a round that would exceed it.
        target_delta: the delta at which epsilon is reported and enforced; :meth:`plan` warns
            (:class:`~lightning_dp.privacy.delta.LargeDeltaWarning`) when it is not below 1/N for the N
            training clients.
        clip: C, the clipping threshold of the update norms (the initial one when adaptive).
        adaptive: move C to the ``target_quantile`` of the update norms (Andrew et al. 2021).
        target_quantile: gamma, the fraction of updates to leave unclipped.
        clip_lr: eta_C, the step of log C per round.
        count_noise_std: sigma_b; default ``q N / 20``. Must exceed ``z / 2``.
        accountant: ``"pld"`` or ``"rdp"``.
        rounds: planned rounds, for calibration.
        adjacency: ``"add_remove"`` (one client added or removed, McMahan et al.'s
            guarantee) or ``"replace"`` (one client's data replaced by another's: the clipped
            sum moves by up to 2C; accounted with the library's replace-one analysis of the
            Poisson-subsampled Gaussian, ``pld`` only unless every client takes part).
    """

    accountable = True
    sums_releases = True  # norms and the clipped sum: the plain mean of one model (problems() refuses others)

    def __init__(self, noise_multiplier: float | None = None, target_epsilon: float | None = None,
                 target_delta: float = 1e-5, clip: float = 1.0, adaptive: bool = False, target_quantile: float = 0.5,
                 clip_lr: float = 0.2, count_noise_std: float | None = None, accountant: str = "pld",
                 rounds: int | None = None, adjacency: str = "add_remove") -> None:
        if noise_multiplier is None and target_epsilon is None:
            raise ValueError("CentralGaussian needs noise_multiplier=<z> or target_epsilon=<budget> (or both)")
        self.requested_z = None if noise_multiplier is None else check_noise_multiplier(noise_multiplier)
        self.target_epsilon = None if target_epsilon is None else check_target_epsilon(target_epsilon, finite=True)
        self.target_delta = check_delta(target_delta, name="target_delta")
        self.clip = check_clip(clip, name="clip")
        self.initial_clip = self.clip
        self.adaptive = bool(adaptive)
        if not 0 <= float(target_quantile) <= 1:
            raise ValueError(f"target_quantile={target_quantile!r} must be in [0, 1]")
        self.target_quantile, self.clip_lr = float(target_quantile), float(clip_lr)
        if count_noise_std is not None and not float(count_noise_std) > 0:
            raise ValueError(f"count_noise_std={count_noise_std!r} must be > 0")
        self.requested_count_std = None if count_noise_std is None else float(count_noise_std)
        self.accountant_name = accountant
        self.adjacency = check_adjacency(adjacency)
        self.accountant = get_accountant(accountant, adjacency=self.adjacency)  # validates the name
        if rounds is not None and (isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1):
            raise ValueError(f"rounds={rounds!r} must be a positive integer or None")
        self.rounds = rounds
        self.z: float | None = self.requested_z
        self.q: float | None = None
        self.count_std: float | None = None
        self.allowed_rounds: int | None = None
        self.last_estimate: float | None = None
        self.set_accountant: Any = None  # DisjointPairPLDAccountant, once a round's updates lie in a known set

    def hparams(self) -> dict[str, Any]:
        return {"privacy/noise_multiplier": self.z, "privacy/target_epsilon": self.target_epsilon,
                "privacy/target_delta": self.target_delta, "privacy/initial_clip": self.initial_clip,
                "privacy/max_grad_norm": None if self.adaptive else self.clip,
                "privacy/adaptive_clipping": self.adaptive, "privacy/accountant": self.accountant_name,
                "privacy/client_sample_rate": self.q, "privacy/count_noise_std": self.count_std,
                "privacy/level": "client",
                "privacy/adjacency": "add/remove" if self.adjacency == "add_remove" else "replacement"}

    # ----------------------------------------------------------------- set-up
    def plan(self, *, sample_rate: float | None, num_clients: int, expected_count: float,
             planned_rounds: int | None,
             update_sets: tuple[tuple[float, float] | None, tuple[float, float] | None] | None = None) -> None:
        """Calibrate z (if needed), split it for adaptive clipping, and compute the rounds the budget allows.

        ``update_sets``: the public sets the releases' updates lie in, in the first round and in later ones
        (:meth:`~lightning_dp.federated.parts.ClientSanitizer.update_set` without and with a reference), or
        None. Under replacement, z is then calibrated to the spend the run will report: the smaller of the
        replace-one and the disjoint-pair bound over the planned rounds (:meth:`planned_epsilon`).
        """
        if sample_rate is None:
            raise ValueError("CentralGaussian accounts amplification by client sampling and needs Poisson client "
                             "selection: selection: {class_path: lightning_dp.federated.parts.PoissonSelection, "
                             "init_args: {sample_rate: q}}. A fixed number of clients per round is not accounted.")
        self.q = sample_rate
        self.accountant.check_supported(sample_rate)
        large_delta = self.large_delta(num_clients)
        if large_delta is not None:  # 10 clients at delta 0.3 reported epsilon 0.0 silently (issue 24, item 6)
            from lightning.pytorch.utilities import rank_zero_warn  # only when a warning is due

            rank_zero_warn(large_delta)
        if self.adaptive:
            self.count_std = self.requested_count_std or default_count_noise_std(expected_count)
        if self.z is None:
            rounds = self.rounds or planned_rounds
            if rounds is None:
                raise ValueError("CentralGaussian(target_epsilon=...) without noise_multiplier needs the planned "
                                 "number of rounds: pass rounds=... or the Trainer's max_epochs")
            assert self.target_epsilon is not None  # the constructor requires it without noise_multiplier
            self.z = calibrate_noise_multiplier(target_epsilon=self.target_epsilon, target_delta=self.target_delta,
                                                sample_rate=self.q, steps=max(rounds - len(self.accountant), 1),
                                                accountant=self.accountant_name,
                                                accountant_kwargs={"adjacency": self.adjacency})
            if self.count_std is not None:  # adaptive
                quantile_noise_split(self.z, count_noise_std=self.count_std)  # z < 2 sigma_b, or a clear error
            if self.adjacency == "replace" and update_sets is not None and any(update_sets) \
                    and not len(self.accountant):
                self.z = self._calibrate_bounded(rounds, update_sets)
        if self.count_std is not None:  # adaptive
            quantile_noise_split(self.z, count_noise_std=self.count_std)  # z < 2 sigma_b, or a clear error
        if self.target_epsilon is not None:
            limit = self.rounds or planned_rounds or 10**7
            self.allowed_rounds = self.accountant.max_steps(self.target_epsilon, self.target_delta,
                                                            noise_multiplier=self.z, sample_rate=self.q, limit=limit)

    def large_delta(self, num_clients: int) -> LargeDeltaWarning | None:
        """The warning :meth:`plan` gives when ``target_delta`` is not below ``1/N`` for the ``N`` training clients
        (:func:`~lightning_dp.privacy.delta.check_delta_for_size`; ``lightning-dp epsilon`` prints the same), or None.
        ``num_clients`` 0: N unknown, nothing to say."""
        return check_delta_for_size(self.target_delta, num_clients, unit="clients", who=type(self).__name__)

    @property
    def update_noise_multiplier(self) -> float:
        """The multiplier of the update noise: z, or z_Delta with adaptive clipping."""
        assert self.z is not None
        if self.adaptive:
            assert self.count_std is not None  # set with z, by plan()
            return quantile_noise_split(self.z, count_noise_std=self.count_std)
        return self.z

    @property
    def epsilon(self) -> float:
        """The spend: under replacement with a bounded update set, the smaller of the two valid bounds."""
        return self._spent()[0]

    def _spent(self, interim: bool = False) -> tuple[float, float, float | None]:
        """``(spend, replace-one bound, disjoint-pair bound or None)``; ``interim``: from the cheaper accountants."""
        def of(accountant: Any) -> float:
            return accountant.interim_epsilon(self.target_delta) if interim else accountant.get_epsilon(self.target_delta)

        one = of(self.accountant)
        pair = of(self.set_accountant) if self.set_accountant is not None and len(self.set_accountant) else None
        return (one if pair is None else min(one, pair)), one, pair

    def _calibrate_bounded(self, rounds: int, update_sets: tuple[Any, Any]) -> float:
        """The smallest z whose :meth:`planned_epsilon` meets the budget, starting from the replace-one z.

        The replace-one calibration already fits (the reported spend is the smaller bound); when z / 1.01
        exceeds the budget it is the answer. Otherwise a search at a coarse PLD discretization (1e-2,
        5%) finds the neighbourhood and one at the accountants' own discretization decides.
        """
        from lightning_dp.privacy.calibration import calibrate_spend

        assert self.z is not None and self.target_epsilon is not None
        ceiling = self.z  # fits; larger z fit too (and may not split for adaptive clipping): never evaluated

        def spend(z: float, interval: float | None = None) -> float:
            return self.planned_epsilon(min(z, ceiling), rounds, *update_sets, interval=interval)

        if spend(ceiling / 1.01) > self.target_epsilon:
            return ceiling
        describe = f"{rounds} rounds at client rate {self.q:g} with bounded updates"
        coarse = calibrate_spend(lambda z: spend(z, 1e-2), target_epsilon=self.target_epsilon, describe=describe,
                                 tolerance=0.05, guess=ceiling)
        return min(ceiling, calibrate_spend(spend, target_epsilon=self.target_epsilon, describe=describe,
                                            guess=min(coarse, ceiling), first_ratio=1.01))

    def planned_epsilon(self, z: float, rounds: int, first_set: tuple[float, float] | None,
                        later_set: tuple[float, float] | None, *, interval: float | None = None) -> float:
        """The spend :meth:`epsilon` would report after ``rounds`` rounds at multiplier z, the first with
        ``first_set`` and the others with ``later_set`` (fresh accountants, fixed clipping). ``interval``: a PLD
        discretization for a coarse search (None: the accountants' own)."""
        from lightning_dp.privacy.accounting import DisjointPairPLDAccountant

        assert self.q is not None
        coarse = {} if interval is None else {"value_discretization_interval": interval}
        replace_one = get_accountant(self.accountant_name, adjacency=self.adjacency,
                                     **(coarse if self.accountant_name == "pld" else {}))
        disjoint = DisjointPairPLDAccountant(**coarse)
        for count, update_set in ((1, first_set), (rounds - 1, later_set)):
            if count > 0:
                one, pair = self._multipliers(z, update_set, self.clip)
                replace_one.step(noise_multiplier=one, sample_rate=self.q, num_steps=count)
                disjoint.step(noise_multiplier=pair, sample_rate=self.q, num_steps=count)
        spent = replace_one.get_epsilon(self.target_delta)
        if first_set is not None or later_set is not None:
            spent = min(spent, disjoint.get_epsilon(self.target_delta))
        return spent

    def _multipliers(self, z: float, update_set: tuple[float, float] | None, clip: float) -> tuple[float, float]:
        """``(replace-one, disjoint-pair)`` multipliers of a round at z that clipped at ``clip`` (C).

        Fixed clipping: the noise ``z C`` over the radius ``s`` and over the diameter ``D`` of the set the
        updates lie in (the ball: ``s = C``, ``D = 2C``, when none is known). Adaptive clipping releases, per
        round, the clipped sum with noise ``z_Delta C`` and the count of unclipped updates with noise
        ``sigma_b``: together one Gaussian mechanism on the vector (update / (z_Delta C), bit / sigma_b).
        A client's vector lies within ``sqrt((s / (z_Delta C))^2 + (1 / (2 sigma_b))^2)`` of an absent
        client's (the centred bit is +-1/2), and two clients' vectors within
        ``sqrt((D / (z_Delta C))^2 + (1 / sigma_b)^2)`` of each other (their bits differ by at most 1): the
        multipliers are the inverses. For the ball the first is z (Andrew et al.'s split) and the second z / 2.
        """
        if update_set is None:  # the ball, exactly (for adaptive clipping this is the identity of the split)
            return z, z / 2
        s, d = self._set_scales(update_set, clip)
        # radius and diameter in units of C, rounded UP to a 2^-40 grid: a threshold that moves every round
        # gives the same multipliers (one history entry, not one per round) and never a smaller set
        s, d = (math.ceil(v / clip * 2**40) / 2**40 for v in (s, d))
        if not self.adaptive:
            return z / s, z / d
        assert self.count_std is not None
        z_update = quantile_noise_split(z, count_noise_std=self.count_std)
        return (1 / math.hypot(s / z_update, 1 / (2 * self.count_std)),
                1 / math.hypot(d / z_update, 1 / self.count_std))

    def _account(self, update_set: tuple[float, float] | None, metrics: dict[str, float], clip: float) -> None:
        """Records the round. Add/remove, or no known set: one subsampled Gaussian with multiplier z. Replacement
        with the releases' updates known to lie in a set of radius ``s <= C`` and diameter ``D`` (a sector):
        the replace-one bound with ``z C / s`` AND the disjoint-pair bound with ``z C / D``
        (:class:`~lightning_dp.privacy.accounting.DisjointPairPLDAccountant`); both are valid for the whole run,
        the smaller is reported."""
        assert self.z is not None and self.q is not None
        if update_set is None or self.adjacency != "replace":
            one, pair = self._multipliers(self.z, None, clip)
            if self.set_accountant is not None and len(self.set_accountant):
                # a round without a known set after rounds with one: its diameter is the ball's, 2C
                self.set_accountant.step(noise_multiplier=pair, sample_rate=self.q)
            self.accountant.step(noise_multiplier=one, sample_rate=self.q)
            return
        _, d = self._set_scales(update_set, clip)
        if self.set_accountant is None:
            from lightning_dp.privacy.accounting import DisjointPairPLDAccountant

            self.set_accountant = DisjointPairPLDAccountant()
            if len(self.accountant):  # earlier rounds without a known set: diameter 2C
                for z, q, n in self.accountant.history:
                    self.set_accountant.step(noise_multiplier=z / 2, sample_rate=q, num_steps=n)
        one, pair = self._multipliers(self.z, update_set, clip)
        self.accountant.step(noise_multiplier=one, sample_rate=self.q)
        self.set_accountant.step(noise_multiplier=pair, sample_rate=self.q)
        metrics["privacy/update_set_diameter"] = d

    def privacy_spend(self) -> list[Any]:
        """Client-level (epsilon, delta): the replace-one (or add/remove) accountant, and under replacement with a
        bounded update set the disjoint-pair one too (both bound the whole run; :attr:`epsilon` is the smaller)."""
        from lightning_dp.privacy.spend import Spend

        pair = self.set_accountant if self.set_accountant is not None and len(self.set_accountant) else None
        return [Spend.accounted("client", self.accountant, delta=self.target_delta,
                                alternatives={"disjoint_pair": pair}, why=type(self).__name__)]

    def epsilon_metrics(self, *, interim: bool = False) -> dict[str, float]:
        spent, one, pair = self._spent(interim)
        out = {"privacy/epsilon": spent}
        if pair is not None:
            out["privacy/epsilon_replace_one"] = one
            out["privacy/epsilon_disjoint_pair"] = pair
        return out

    def budget_left(self, update_set: tuple[float, float] | None = None) -> bool:
        """Whether one more round fits in the budget; ``update_set``: the next round's (see :meth:`aggregate`).

        Under replacement with a known set, a round that no longer fits the replace-one bound may still
        fit the disjoint-pair bound (both bound the whole run; the spend is the smaller).
        """
        if self.allowed_rounds is None or self.allowed_rounds > 0:
            return True
        if update_set is None or self.adjacency != "replace" or self.set_accountant is None:
            return False
        assert self.z is not None and self.q is not None and self.target_epsilon is not None
        return self.set_accountant.max_steps(self.target_epsilon, self.target_delta,
                                             noise_multiplier=self._multipliers(self.z, update_set, self.clip)[1],
                                             sample_rate=self.q, limit=1) >= 1

    @staticmethod
    def _set_scales(update_set: tuple[float, float], clip: float) -> tuple[float, float]:
        """``(s, d)``: the radius and diameter a round that clipped at ``clip`` is accounted with (never above the
        ball's C and 2s)."""
        radius, diameter = (float(v) for v in update_set)
        s = min(clip, radius)
        return s, min(diameter, 2 * s)

    # ----------------------------------------------------------------- round
    def partial_sum(self, releases: Tensor, origin: Tensor) -> tuple[Tensor, Tensor]:
        """The norms of the updates ``releases - origin`` and the sum of the updates clipped at the current C."""
        # a block of updates at a time: no (U, P) copy of the releases beside them (delta_norms), each update
        # computed once for its norm and its clipped share of the sum
        return delta_norms_and_sum(releases, origin, self.sum_weights)

    def sum_weights(self, norms: Tensor) -> Tensor:
        """The clipping factors ``min(1, C / (norm + 1e-6))`` at the current C (:func:`~lightning_dp.privacy.clipping.
        clip_factors`)."""
        return clip_factors(norms, self.clip)

    def aggregate(self, held, aggregator, *, noise_generator, count_generator, report_epsilon="final"):
        releases, hypotheses, expected_count = held.releases, held.hypotheses, held.expected_count
        update_set, unclipped = held.update_set, held.unclipped
        if hypotheses.shape[0] != 1:
            raise ValueError("CentralGaussian averages one model (num_hypotheses=1)")
        if not self.budget_left(update_set):
            raise RuntimeError(f"CentralGaussian: the budget target_epsilon={self.target_epsilon} is spent (epsilon="
                               f"{self.epsilon:.4g}); refusing to release another round.")
        require_secret(noise_generator, "CentralGaussian's noise")
        require_secret(count_generator, "CentralGaussian's count noise")
        glob = hypotheses[0]
        clip = self.clip
        norms, total = held.sums if held.sums is not None else self.partial_sum(releases, glob)
        z_update = self.update_noise_multiplier
        (noise,) = gaussian_noise([glob.shape], z_update * clip, noise_generator, dtype=glob.dtype, device=glob.device)
        new = glob + (total + noise) / expected_count
        # C moves under adaptive clipping (a metric); a fixed C is the param privacy/max_grad_norm (hparams)
        metrics = {"privacy/max_grad_norm": clip} if self.adaptive else {}
        # the clients' own bits when they clipped at this threshold before releasing, else the releases' norms
        within = unclipped.bool() if unclipped is not None else norms <= clip
        if len(norms):  # exact, not covered by epsilon (docs/privacy.md): logged under nonprivate/ if asked
            metrics["nonprivate/clipped_fraction"] = float((~within).double().mean())
        if self.adaptive:
            self.clip, self.last_estimate = quantile_clip_update(
                clip, int(within.sum()), len(norms), expected_count, target_quantile=self.target_quantile,
                clip_lr=self.clip_lr, count_noise_std=self.count_std, generator=count_generator)
            metrics["privacy/unclipped_fraction_estimate"] = self.last_estimate
        self._account(update_set, metrics, clip)
        if self.allowed_rounds is not None:
            self.allowed_rounds -= 1
        if report_epsilon is not None:
            metrics.update(self.epsilon_metrics(interim=report_epsilon == "interim"))
        assignment = torch.zeros(len(norms), dtype=torch.long, device=glob.device)
        return new[None], assignment, metrics

    # ----------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        return {"accountant": self.accountant.state_dict(), "clip": self.clip, "noise_multiplier": self.z,
                "set_accountant": None if self.set_accountant is None else self.set_accountant.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("accountant") is not None:
            self.accountant.load_state_dict(state["accountant"])
        if state.get("set_accountant") is not None:
            from lightning_dp.privacy.accounting import DisjointPairPLDAccountant

            self.set_accountant = DisjointPairPLDAccountant()
            self.set_accountant.load_state_dict(state["set_accountant"])
        self.clip = float(state.get("clip", self.clip))
        if self.requested_z is None and state.get("noise_multiplier") is not None:
            self.z = float(state["noise_multiplier"])  # the calibrated z of the run, not a new calibration
