"""Client update: what a client computes from its starting model on its own data."""

from __future__ import annotations

import abc
import math
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
from torch import Tensor, nn

from lightning_dp.federated.budgets import ClientBudgets
from lightning_dp.federated.dense import dense_chain
from lightning_dp.federated.local import FlatParams, local_sgd, local_sgd_loop
from lightning_dp.federated.parts.registry import Combination, Part, register_part
from lightning_dp.privacy.delta import LargeDeltaWarning, check_delta_for_size

__all__ = ["AUTO_VMAP_MAX_PARAMETERS", "ClientUpdate", "LocalDPSGD", "LocalSGD", "auto_engine"]

#: models with more parameters than this train their clients one by one on the CPU ("auto" engine): vmap over
#: clients turns convolutions into grouped ones, slower than a loop there (benchmarks/bench_federated_round.py: 30x
#: faster for 11 parameters, 4x slower for 1.4 M). On a CUDA device "auto" vmaps at any size: the 1.76 M-parameter
#: CIFAR CNN's 100 clients train 9.2x faster than in the loop on an H200 (docs/gpu.md).
AUTO_VMAP_MAX_PARAMETERS = 100_000


def auto_engine(numel: int, device: torch.device | str | None = None) -> str:
    """``"vmap"`` over clients on a CUDA ``device`` or for a model of at most :data:`AUTO_VMAP_MAX_PARAMETERS`
    parameters, else ``"loop"``."""
    if device is not None and torch.device(device).type == "cuda":
        return "vmap"
    return "vmap" if numel <= AUTO_VMAP_MAX_PARAMETERS else "loop"


class ClientUpdate(Part):
    """Trains the round's clients from their starting models.

    An update that protects the clients' records (:attr:`accountable`, e.g. :class:`LocalDPSGD`)
    also plans its noise before training (:meth:`plan`), lets a client whose record-level budget
    is spent decline (:meth:`eligible`), charges its per-client ledger after each round
    (:meth:`charge`) and reports it (:meth:`privacy_metrics`).
    """

    kind = "update"

    #: whether the update is record-level private and keeps a per-client ledger
    accountable = False

    def problems(self, parts: Combination) -> list[str]:
        if not self.accountable:
            return []
        found = []
        if parts.num_hypotheses != 1:
            found.append(f"update {self.name!r} with num_hypotheses={parts.num_hypotheses}: each client would choose "
                         "its starting model by the loss of every hypothesis on all of its records, a data-dependent "
                         "choice that its release shows and no record-level accountant covers; use num_hypotheses=1")
        if parts.aggregator.weights_by_counts:
            found.append(f"update {self.name!r} with {parts.aggregator.name} weighted=True: the weights are the "
                         "clients' exact record counts, which add/remove of one record changes; use weighted=False")
        return found

    @abc.abstractmethod
    def train(self, template, spec, start: Tensor, x: Tensor, y: Tensor, mask: Tensor, *, loss: str,
              shuffles: Any, clients: Sequence[int] | None = None,
              noise: Callable[[int], torch.Generator] | None = None) -> Tensor:
        """``(m, P)`` trained parameter vectors of the m clients (padded data ``x``, ``y``, ``mask``).

        ``shuffles`` draws public local shuffles; ``clients`` are the clients' positions among the
        training clients and ``noise(i)`` the secret generator of client i in this round (for
        record-level private updates).
        """
        raise NotImplementedError

    def one_step(self, template, spec, start: Tensor, x: Tensor, y: Tensor, mask: Tensor, *, loss: str) -> Any:
        """The clients' updates as :meth:`train` would make them, held as the factors of ONE SGD step
        (:class:`~lightning_dp.federated.dense.DenseSteps`) where that is what :meth:`train` computes, else None
        (the default: the round then calls :meth:`train`). The trained model of client c is ``start[c]`` plus
        its step, up to float rounding."""
        return None

    def plan(self, client_ids: Sequence[Any], sizes: Sequence[int], *, planned_rounds: int | None,
             inclusion_rate: float) -> None:
        """Fix the per-client settings before training (``sizes``: records per training client, public)."""

    def eligible(self, i: int) -> bool:
        """Whether training client i may take part in the next round (its record-level budget allows it)."""
        return True

    def charge(self, index: Sequence[int]) -> None:
        """Record one participation of each training client in ``index``."""

    def privacy_metrics(self) -> dict[str, float]:
        """Record-level privacy metrics of the ledger (computed when written)."""
        return {}

    @property
    def reveals_budgets(self) -> bool:
        """Whether every client has a record-level budget it can reveal (:meth:`revealed_budgets`)."""
        return False

    def true_public(self, index: Sequence[int]) -> list[bool] | None:
        """Whether each client in ``index`` is in truth in the relaxed budget group (None: no budget groups): the
        simulation's ground truth for scoring a public/private split, never given to the server."""
        return None

    def revealed_budgets(self, index: Sequence[int]) -> list[float]:
        """The record-level budgets the clients in ``index`` reveal (for aggregators that ask for them)."""
        raise ValueError(f"update {self.name!r} has no per-client privacy budgets to reveal; use local_dp_sgd "
                         "with target_epsilon or budgets")


@register_part("update", "local_sgd")
class LocalSGD(ClientUpdate):
    """E epochs of mini-batch SGD (rate s, batch B_s) per client, all clients at once or one by one.

    Args:
        epochs: E.
        lr: s.
        batch_size: B_s.
        engine: ``"dense"`` (all clients at once, hand-written gradients for a chain of ``Linear`` layers and
            activations, :mod:`~lightning_dp.federated.dense`), ``"vmap"`` (all clients at once, any model),
            ``"loop"`` (one client at a time) or ``"auto"``: dense where the model is such a chain, else vmap, each
            up to :data:`AUTO_VMAP_MAX_PARAMETERS` parameters, loop above (on a CUDA device: vmap at any size).
    """

    def __init__(self, epochs: int = 1, lr: float = 0.1, batch_size: int = 10,
                 engine: Literal["auto", "dense", "vmap", "loop"] = "auto") -> None:
        for name, value in (("local_epochs", epochs), ("local_batch_size", batch_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} is not allowed: pass a positive integer")
        if not (float(lr) > 0 and math.isfinite(float(lr))):
            raise ValueError(f"local_lr={lr!r} is not allowed: pass a finite learning rate > 0")
        if engine not in ("auto", "dense", "vmap", "loop"):
            raise ValueError(f"client_engine={engine!r} is not allowed; choose 'auto', 'dense', 'vmap' or 'loop'")
        self.epochs, self.lr, self.batch_size, self.engine = epochs, float(lr), batch_size, engine
        #: the engine the last :meth:`train` ran ("dense", "vmap" or "loop"; None before the first)
        self.engine_used: str | None = None

    def hparams(self) -> dict[str, Any]:
        return {"local_epochs": self.epochs, "local_lr": self.lr, "local_batch_size": self.batch_size,
                "client_engine": self.engine}

    def resolved_engine(self, numel: int, device: torch.device | str | None = None) -> str:
        """``"vmap"`` or ``"loop"``: the engine of a model of ``numel`` parameters on ``device`` where no dense chain
        is used (``"dense"`` reads as ``"vmap"``: what :class:`LocalDPSGD`'s per-example gradients run on; it passes
        no device: its per-example gradients over all clients at once would hold clients x batch x parameters)."""
        if self.engine == "auto":
            return auto_engine(numel, device)
        return "vmap" if self.engine == "dense" else self.engine

    def dense_chain(self, template: nn.Module, spec: FlatParams, x: Tensor, y: Tensor, loss: str,
                    start: Tensor | None = None):
        """The model's :class:`~lightning_dp.federated.dense.DenseChain` where this update trains with it, else
        None; ``engine="dense"`` with a model or data it does not cover raises ``ValueError`` with the reason.
        With the clients' starting points ``start`` (C, P), the chain's output is also compared with the model's
        own forward on the first client's first examples (:meth:`~lightning_dp.federated.dense.DenseChain.disagrees`)."""
        if self.engine not in ("auto", "dense"):
            return None
        chain, why = dense_chain(template, spec)
        if chain is not None:
            why = chain.refusal(template, spec, x, y, loss, start)
        if self.engine == "dense":
            if why:
                raise ValueError(f"client_engine='dense' cannot train {type(template).__name__}: {why}. It covers "
                                 "chains of Linear layers, ReLU/Tanh/Sigmoid, flatten and squeeze(dim); use "
                                 "client_engine='auto' or 'vmap'")
            return chain
        return chain if not why and spec.numel <= AUTO_VMAP_MAX_PARAMETERS else None

    def one_step(self, template, spec, start, x, y, mask, *, loss):
        """One epoch whose one batch holds every client's examples (``epochs=1``, the padded width at most
        ``batch_size``) on the dense engine, from a start in float32 or float64: :func:`~lightning_dp.federated.local.
        local_sgd`'s one step, without the shuffle (it orders the examples of the batch, which a sum over them does
        not see but for rounding), with the same checks and errors; else None. Also None where a client's factors
        would not be smaller than its model (:meth:`~lightning_dp.federated.dense.DenseChain.factor_entries`: the
        hospital MLP's 11 parameters from 4 examples of 3 features take 32), where writing the models is cheaper."""
        if self.epochs != 1 or x.shape[1] > self.batch_size or start.dtype not in (torch.float32, torch.float64):
            return None
        chain = self.dense_chain(template, spec, x, y, loss, start)
        if chain is None or not chain.covers(spec.numel) or chain.factor_entries(x.shape[1]) >= spec.numel:
            return None
        if loss == "cross_entropy":
            chain.check_labels(y, mask, tuple(x.shape[2:]))
        self.engine_used = "dense"
        scale = (mask.any(dim=1).to(start.dtype) * -self.lr).unsqueeze(1)  # local_sgd's: 0 for a client without data
        return chain.steps_from(start, x, y, mask, loss, scale)

    def train(self, template, spec, start, x, y, mask, *, loss, shuffles, clients=None, noise=None):
        chain = self.dense_chain(template, spec, x, y, loss, start)
        self.engine_used = "dense" if chain is not None else self.resolved_engine(spec.numel, start.device)
        if self.engine_used != "loop":
            return local_sgd(template, spec, start, x, y, mask, epochs=self.epochs, lr=self.lr,
                             batch_size=self.batch_size, loss=loss, generator=shuffles, chain=chain)
        return local_sgd_loop(template, spec, start, x, y, mask, epochs=self.epochs, lr=self.lr,
                              batch_size=self.batch_size, loss=loss, generator=shuffles)


@register_part("update", "local_dp_sgd")
class LocalDPSGD(ClientUpdate):
    """Record-level DP-SGD inside every client, with a per-client accountant (local DP-SGD).

    Client c (``n_c`` records) runs ``steps_c = epochs * max(1, floor(n_c / B))`` DP-SGD steps per
    participation (:func:`~lightning_dp.federated.local_dp_sgd.local_dp_sgd`): Poisson batches at
    rate ``q_c = min(1, B / n_c)`` (or shuffled batches of B), per-example clipping at C, Gaussian noise
    ``sigma_c C``, division by B. Its epsilon with respect to one of its records is the composition
    of all its participations (:class:`~lightning_dp.privacy.ledger.RecordLedger`, dp-accounting):
    Poisson steps as subsampled Gaussians at ``q_c``; a shuffled epoch as one Gaussian under
    replacement (every record is in exactly one batch of the epoch). Selection of the client is
    public: no amplification by it is claimed. As Opacus and TF Privacy do, the number of records
    ``n_c`` (hence ``q_c`` and ``steps_c``) is treated as public.

    The noise is either given (``noise_multiplier``) or calibrated per client (``target_epsilon``)
    for ``participations`` participations (default: the expected number,
    ``ceil(rounds x inclusion rate)``, from the Trainer's ``max_epochs`` and the selection). With a
    ``target_epsilon``, a client whose next participation would exceed it declines (the budget is
    enforced, whatever the number of rounds).

    Args:
        epochs: local epochs per participation.
        lr: local learning rate.
        batch_size: B, the expected (Poisson) or exact (shuffled) batch size.
        max_grad_norm: C, the per-example clipping norm.
        noise_multiplier: sigma for every client (None: calibrate to ``target_epsilon``).
        target_epsilon: each client's record-level budget at ``delta`` (None: unlimited; needs
            ``noise_multiplier``).
        delta: the delta of every client's epsilon (well below 1 / n_c: :meth:`plan` warns once, with
            :class:`~lightning_dp.privacy.delta.LargeDeltaWarning`, for the clients where it is not).
        sampling: ``"poisson"`` or ``"shuffle"``.
        adjacency: ``"add_remove"`` (Poisson only) or ``"replace"`` (of one record); default:
            add/remove for Poisson, replace for shuffled batches.
        accountant: ``"pld"`` (tight) or ``"rdp"`` (faster to calibrate; refused with Poisson under replace).
        participations: participations the calibration plans for.
        engine: ``"vmap"``, ``"loop"`` or ``"auto"`` (as :class:`LocalSGD`).
        budgets: per-client budgets instead of one ``target_epsilon``
            (:mod:`lightning_dp.federated.budgets`: a fixed list, or drawn from the PFA experiments'
            distributions); each client's sigma is calibrated to its own epsilon_m and enforced.
        train_at: ``"own"`` (each client at its budget) or ``"minimum"`` (every client at the smallest
            budget of the federation: PFA's "Minimum" baseline).
    """

    accountable = True

    def __init__(self, epochs: int = 1, lr: float = 0.1, batch_size: int = 64, max_grad_norm: float = 1.0,
                 noise_multiplier: float | None = None, target_epsilon: float | None = None, delta: float = 1e-5,
                 sampling: Literal["poisson", "shuffle"] = "poisson",
                 adjacency: Literal["add_remove", "replace"] | None = None, accountant: Literal["pld", "rdp"] = "pld",
                 participations: int | None = None, engine: Literal["auto", "vmap", "loop"] = "auto",
                 budgets: ClientBudgets | None = None, train_at: Literal["own", "minimum"] = "own") -> None:
        from lightning_dp.privacy.accounting import check_adjacency, check_delta, check_target_epsilon, get_accountant
        from lightning_dp.privacy.clipping import check_max_grad_norm
        from lightning_dp.privacy.noise import check_noise_multiplier

        self._sgd = LocalSGD(epochs, lr, batch_size, engine)  # the same checks and engine choice
        self.epochs, self.lr, self.batch_size, self.engine = epochs, float(lr), batch_size, engine
        self.max_grad_norm = check_max_grad_norm(max_grad_norm)
        if budgets is not None and not isinstance(budgets, ClientBudgets):
            raise ValueError(f"budgets={budgets!r} is not allowed: pass a lightning_dp.federated.budgets.ClientBudgets "
                             "(FixedBudgets, DistributionBudgets) or None")
        if budgets is not None and target_epsilon is not None:
            raise ValueError("pass target_epsilon (one budget for every client) or budgets (one per client), not both")
        if train_at not in ("own", "minimum"):
            raise ValueError(f"train_at={train_at!r} is not allowed; choose 'own' or 'minimum'")
        self.budgets, self.train_at = budgets, train_at
        if noise_multiplier is None and target_epsilon is None and budgets is None:
            raise ValueError("local_dp_sgd needs noise_multiplier (sigma), target_epsilon or budgets (sigma "
                             "calibrated per client); pass one of them")
        self.noise_multiplier = None if noise_multiplier is None else check_noise_multiplier(noise_multiplier)
        self.target_epsilon = None if target_epsilon is None else check_target_epsilon(target_epsilon, finite=True)
        self.delta = check_delta(delta)
        if sampling not in ("poisson", "shuffle"):
            raise ValueError(f"sampling={sampling!r} is not allowed; choose 'poisson' or 'shuffle'")
        self.sampling = sampling
        if adjacency is None:
            adjacency = "add_remove" if sampling == "poisson" else "replace"
        else:
            check_adjacency(adjacency)
        if sampling == "shuffle" and adjacency == "add_remove":
            raise ValueError("sampling='shuffle' with adjacency='add_remove' is not allowed: shuffled batches "
                             "partition the records, and adding one shifts every later batch; the bound holds for "
                             "adjacency='replace'. Use sampling='poisson' for add/remove.")
        if sampling == "poisson" and adjacency == "replace" and accountant == "rdp":
            raise ValueError("adjacency='replace' with Poisson sampling needs accountant='pld': dp_accounting has no "
                             "RDP bound for the Poisson-subsampled Gaussian under replacement.")
        self.adjacency = adjacency
        self.accountant = get_accountant(accountant).name
        if participations is not None and (isinstance(participations, bool) or not isinstance(participations, int)
                                           or participations < 1):
            raise ValueError(f"participations={participations!r} is not allowed: pass a positive integer or None")
        self.participations = participations
        self.ledger = self._make_ledger()
        self._ids: list[Any] = []
        self._plans: list[Any] = []  # one ClientPlan per training client, from plan()
        self._sigmas: dict[str, float] | None = None  # saved per-client sigmas of a resumed run
        self._fits: dict[int, int] = {}  # training client -> participations known to fit the budget
        self._fresh_fits: dict[Any, int] = {}  # the same for a client without history, by (event, budget)
        self._planned_rounds: int | None = None
        self.participations_planned: int | None = None
        self._targets: list[float | None] = []  # each training client's budget (the one it trains at)
        self._own: list[float | None] = []  # each training client's own budget (what it would reveal)
        self._groups: list[bool] | None = None  # whether each client is in the relaxed ("public") group, in truth

    def _make_ledger(self):
        from lightning_dp.privacy.ledger import RecordLedger

        return RecordLedger(self.delta, self.accountant, self.adjacency)

    def hparams(self) -> dict[str, Any]:
        return {"local_epochs": self.epochs, "local_lr": self.lr, "local_batch_size": self.batch_size,
                "client_engine": self.engine, "local_max_grad_norm": self.max_grad_norm,
                "local_noise_multiplier": self.noise_multiplier, "local_target_epsilon": self.target_epsilon,
                "local_delta": self.delta, "local_sampling": self.sampling, "local_adjacency": self.adjacency,
                "local_accountant": self.accountant, "local_participations": self.participations,
                "local_train_at": self.train_at, **({} if self.budgets is None else self.budgets.hparams())}

    # ---------------------------------------------------------------- planning
    def _event(self, plan) -> tuple[float, float, int]:
        """``(noise multiplier, sampling rate, events)`` of one participation for the accountant."""
        if self.sampling == "poisson":
            return plan.noise_multiplier, plan.sample_rate, plan.steps
        return plan.noise_multiplier, 1.0, self.epochs  # one Gaussian per shuffled epoch (replacement)

    def plan(self, client_ids, sizes, *, planned_rounds, inclusion_rate):
        from lightning_dp.federated.local_dp_sgd import ClientPlan, steps_per_participation
        from lightning_dp.privacy.calibration import calibrate_noise_multiplier

        self._ids, self._planned_rounds, self._fits, self._fresh_fits = list(client_ids), planned_rounds, {}, {}
        large_delta = self.large_delta(sizes)
        if large_delta is not None:
            from lightning.pytorch.utilities import rank_zero_warn  # only when a warning is due

            rank_zero_warn(large_delta)
        if self.budgets is not None:
            self._own, self._groups = self.budgets.assign_with_groups(self._ids)
        else:
            self._own, self._groups = [self.target_epsilon] * len(self._ids), None
        floor = min((t for t in self._own if t is not None), default=None)
        self._targets = [floor] * len(self._ids) if self.train_at == "minimum" else list(self._own)
        shapes = [(steps_per_participation(int(n), self.batch_size, self.epochs), min(1.0, self.batch_size / int(n)))
                  for n in sizes]
        if self._sigmas is not None:  # a resumed run keeps the noise it was calibrated with
            missing = [cid for cid in self._ids if str(cid) not in self._sigmas]
            if missing:
                raise ValueError(f"the checkpoint's local_dp_sgd holds no noise multiplier for clients {missing[:5]}: "
                                 "resume with the clients of the run that wrote it")
            self._plans = [ClientPlan(s, q, self._sigmas[str(cid)]) for cid, (s, q) in zip(self._ids, shapes)]
            return
        if self.noise_multiplier is not None:
            self._plans = [ClientPlan(s, q, self.noise_multiplier) for s, q in shapes]
            return
        count = self.participations
        if count is None:
            if planned_rounds is None:
                raise ValueError("local_dp_sgd with budgets calibrates the noise for a planned number of "
                                 "participations: set the Trainer's max_epochs (rounds) or local_dp_sgd's "
                                 "participations, or pass noise_multiplier")
            count = max(1, math.ceil(planned_rounds * inclusion_rate - 1e-9))
        self.participations_planned = count
        cache: dict[tuple[float, float, int, float], float] = {}
        plans = []
        for (s, q), target in zip(shapes, self._targets):
            _, rate, events = self._event(ClientPlan(s, q, 1.0))
            key = (rate, events, count, target)
            if key not in cache:
                cache[key] = calibrate_noise_multiplier(
                    target_epsilon=target, target_delta=self.delta, sample_rate=rate,
                    steps=events * count, accountant=self.accountant, accountant_kwargs={"adjacency": self.adjacency})
            plans.append(ClientPlan(s, q, cache[key]))
            if not self.ledger.participations(self._ids[len(plans) - 1]):
                self._fits[len(plans) - 1] = count  # verified by the calibration
        self._plans = plans

    def large_delta(self, sizes: Sequence[int]) -> LargeDeltaWarning | None:
        """The ONE warning :meth:`plan` gives when ``delta`` is not below ``1/n_c`` for some clients (``sizes``: the
        records ``n_c`` of every training client; each client's record-level epsilon is stated at ``delta``), naming
        how many and their sizes (:func:`~lightning_dp.privacy.delta.check_delta_for_size`), or None."""
        return check_delta_for_size(self.delta, [int(n) for n in sizes], unit="records", who=type(self).__name__,
                                    name="delta")

    def client_plans(self) -> list[Any]:
        """The :class:`~lightning_dp.federated.local_dp_sgd.ClientPlan` of every training client (after :meth:`plan`)."""
        return list(self._plans)

    def noise_multipliers(self) -> list[float]:
        """The planned sigma of every training client."""
        return [p.noise_multiplier for p in self._plans]

    def client_budgets(self) -> list[float | None]:
        """The budget every training client trains at (None: unlimited), after :meth:`plan`."""
        return list(self._targets)

    @property
    def reveals_budgets(self) -> bool:
        return self.target_epsilon is not None or self.budgets is not None

    def true_public(self, index):
        return None if self._groups is None else [self._groups[i] for i in index]

    def revealed_budgets(self, index):
        if self._own and all(self._own[i] is not None for i in index):
            return [float(self._own[i]) for i in index]
        return super().revealed_budgets(index)

    def eligible(self, i):
        target = self._targets[i] if self._targets else None
        if target is None:
            return True
        cid = self._ids[i]
        taken = self.ledger.participations(cid)
        if i not in self._fits:
            event = self._event(self._plans[i])
            limit = max(1, (self._planned_rounds or 1) + 1)  # one past the planned rounds: enough to decide
            if taken == 0 and (event, target) in self._fresh_fits:  # clients alike share the search
                self._fits[i] = self._fresh_fits[(event, target)]
            else:
                self._fits[i] = taken + self.ledger.participations_left(
                    cid, target, noise_multiplier=event[0], sample_rate=event[1], num_steps=event[2], limit=limit)
                if taken == 0:
                    self._fresh_fits[(event, target)] = self._fits[i]
        return taken < self._fits[i]

    def charge(self, index):
        for i in index:
            sigma, rate, events = self._event(self._plans[i])
            self.ledger.charge(self._ids[i], noise_multiplier=sigma, sample_rate=rate, num_steps=events)
            if i in self._fits and self.ledger.participations(self._ids[i]) > self._fits[i]:
                raise RuntimeError(f"local_dp_sgd: client {self._ids[i]!r} took part beyond its record-level budget "
                                   f"{self._targets[i]}; please report this")

    def privacy_metrics(self):
        if not len(self.ledger):
            return {}
        return {"privacy/record_epsilon_median": self.ledger.median(), "privacy/record_epsilon_max": self.ledger.max()}

    # ---------------------------------------------------------------- training
    def train(self, template, spec, start, x, y, mask, *, loss, shuffles, clients=None, noise=None):
        from lightning_dp.federated.local_dp_sgd import local_dp_sgd

        if clients is None or noise is None:
            raise ValueError("local_dp_sgd trains with each client's secret noise generator: pass clients and noise")
        if not self._plans:
            raise RuntimeError("local_dp_sgd: plan() was not called before train(); FederatedRound calls it when "
                               "training starts")
        return local_dp_sgd(template, spec, start, x, y, mask, plans=[self._plans[i] for i in clients],
                            generators=[noise(i) for i in clients], batch_size=self.batch_size,
                            max_grad_norm=self.max_grad_norm, lr=self.lr, loss=loss, sampling=self.sampling,
                            engine=self._sgd.resolved_engine(spec.numel))

    # -------------------------------------------------------------- checkpoint
    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"ledger": self.ledger.state_dict()}
        if self._plans:
            state["noise_multipliers"] = {str(cid): p.noise_multiplier for cid, p in zip(self._ids, self._plans)}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "ledger" in state:
            self.ledger.load_state_dict(state["ledger"])
        self._sigmas = dict(state["noise_multipliers"]) if "noise_multipliers" in state else None
