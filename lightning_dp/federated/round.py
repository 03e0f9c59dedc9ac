"""The federated round as a LightningModule, assembled from parts (:mod:`lightning_dp.federated.parts`).

One training step (one epoch, one optimizer step for Lightning) is one round: ``selection`` draws the clients,
``update`` trains each from its best hypothesis, ``sanitizer`` makes its release, ``server_privacy`` wraps the
``aggregator``. Public draws come from ``seed``; every draw an accountant relies on from the secret ``noise_seed``.
This class is the Lightning shell; the concepts live in ``settings``, ``clients``, ``step``, ``evaluation``,
``state`` and ``reports``. Steps, seeds, resume and DDP: docs/federated.md, "One round, step by step".
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import torch
from lightning.pytorch import LightningModule
from torch import Tensor, nn

from lightning_dp.federated import evaluation, state
from lightning_dp.federated.clients import STATS, SUM_BLOCK_ENTRIES, RoundClients
from lightning_dp.federated.parts import Aggregator, ClientSanitizer, ClientSelection, ClientUpdate, ServerPrivacy
from lightning_dp.federated.settings import initial_hypotheses, round_settings
from lightning_dp.federated.step import PrivateStep
# the round's stream table, read by tests/privacy/test_noise.py
from lightning_dp.federated.streams import (  # noqa: F401
    _CLIENTS, _DIAGNOSTICS, _INIT, _LOCAL, _LOCAL_NOISE, _NOISE, _SERVER_COUNT, _SERVER_NOISE, _VAL)
from lightning_dp.privacy.ledger import PrivacyLedger
from lightning_dp.privacy.record import RoundNames
from lightning_dp.privacy.seeds import check_seed, fresh_seed
from lightning_dp.protocol import RunProtocol

__all__ = ["STATS", "SUM_BLOCK_ENTRIES", "FederatedRound"]


class _RoundOptimizer(torch.optim.Optimizer):
    """Runs the closure it is given: the round's aggregation, counted by Lightning as a step."""

    def __init__(self, params: list[Tensor]) -> None:
        super().__init__(params, {})

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        return closure() if closure is not None else None


class _Setting:
    """The round's attribute of that name, a field of its frozen
    :class:`~lightning_dp.federated.settings.RoundSettings` (setting it replaces the settings)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        return self if obj is None else getattr(obj.settings, self.name)

    def __set__(self, obj: Any, value: Any) -> None:
        obj.settings = dataclasses.replace(obj.settings, **{self.name: value})


class FederatedRound(LightningModule):
    """A federated round from parts (see the module docstring).

    Args:
        model: the network template; ``num_hypotheses`` parameter vectors of its shape are trained.
        num_hypotheses: k (1: one global model).
        warm_start_rounds: for the first this many rounds, a training client starts from the hypothesis of a
            fixed public assignment (:func:`~lightning_dp.federated.local.assigned_hypotheses`: a hash of ``seed``
            and the client's id, uniform over the k) instead of its best one; afterwards it chooses as
            usual. IFCA's "trained initialization" (Ghosh et al.'s FEMNIST code trains each hypothesis on a random
            group of clients before the choice starts): from independent random initializations, one
            hypothesis can win every client's first choice and the others are never trained
            (docs/federated.md, "Starting the hypotheses apart"). 0 (default): the choice from round 0. Needs k > 1.
        selection: a :class:`~lightning_dp.federated.parts.ClientSelection` or its registered name.
        update: a :class:`~lightning_dp.federated.parts.ClientUpdate` or its name.
        sanitizer: a :class:`~lightning_dp.federated.parts.ClientSanitizer` or its name.
        aggregator: an :class:`~lightning_dp.federated.parts.Aggregator` or its name.
        server_privacy: a :class:`~lightning_dp.federated.parts.ServerPrivacy` or its name.
        loss: ``"rmse"`` (regression; on class scores, the root Brier score),
            ``"cross_entropy"`` (logits of C classes) or ``"binary_cross_entropy"`` (one
            logit per example, labels in {0, 1}); see :func:`~lightning_dp.federated.local.masked_loss`.
        client_privacy_cap: a client whose sanitizer spend would exceed this declines to participate.
        val_clients_per_check: evaluate a random sample of this many validation clients per check
            (default: all).
        test_every_check: at every validation check, also evaluate the test clients (all of them) and
            log ``test/*`` at that round: a learning curve on test data, for when the validation clients
            do not represent it (one held-out client of a label-skewed partition holds a few classes).
            Do not select models or stop on it.
        seed: seed of the public streams (initialization, local shuffles of non-private updates,
            validation subsample); default: a fresh random seed. Logged.
        noise_seed: seed of every privacy noise of the run and of the client selection, a secret:
            whoever knows it can subtract the noise from every release and recompute who took part
            (which voids the amplification by client sampling). Default: a fresh seed from the OS, kept in local
            checkpoints (a run resumed without ``noise_seed`` continues its streams) and never
            logged or uploaded. A given seed wins over a checkpoint's, so that runs branched
            from one checkpoint draw different noise. Fix it only for reproducible
            experiments whose releases stay private (``lightning-dp grid`` gives every run its own).
        log_nonprivate_metrics: log exact statistics of the clients' private data under
            ``nonprivate/`` (their losses; the fraction of updates central DP clipped). The
            server never sees them in the protocol and no accountant covers them; set False to
            keep them off the record.
        diagnostics: per round, log ``nonprivate/update_cosine``, the mean pairwise cosine similarity of
            the participants' (unsanitized) updates, and ``nonprivate/gradient_cosine``, the same for
            per-sample gradients of one random example of each participant at its starting model
            (the centralized counterpart, a batch of U examples; thesis Fig. 5.4), with the plot
            ``nonprivate/cosine.png`` at the end. Needs ``log_nonprivate_metrics``.
    """

    #: Constructor arguments that are secrets: redacted from configs logged by ``lightning-dp``.
    SECRET_ARGUMENTS: tuple[str, ...] = ("noise_seed",)
    # buffers (registered in __init__), declared for type checkers
    hypotheses: Tensor
    rounds: Tensor
    previous_step: Tensor
    # the settings (a frozen RoundSettings), under the names they always had
    k = _Setting()
    warm_start_rounds = _Setting()
    loss_name = _Setting()
    client_privacy_cap = _Setting()
    val_clients_per_check = _Setting()
    test_every_check = _Setting()
    log_nonprivate_metrics = _Setting()
    diagnostics = _Setting()
    spec = _Setting()

    def __init__(
        self,
        model: nn.Module,
        *,
        num_hypotheses: int = 1,
        warm_start_rounds: int = 0,
        # typed so that a config (or --model.init_args.sanitizer.init_args.clip=...) can build and override them
        selection: ClientSelection | str = "uniform",
        update: ClientUpdate | str = "local_sgd",
        sanitizer: ClientSanitizer | str = "none",
        aggregator: Aggregator | str = "fedavg",
        server_privacy: ServerPrivacy | str = "none",
        loss: Literal["rmse", "cross_entropy", "binary_cross_entropy"] = "rmse",
        client_privacy_cap: float | None = None,
        val_clients_per_check: int | None = None,
        test_every_check: bool = False,
        seed: int | None = None,
        noise_seed: int | None = None,
        log_nonprivate_metrics: bool = True,
        diagnostics: bool = False,
    ) -> None:
        super().__init__()
        self.settings, parts = round_settings(
            model, num_hypotheses=num_hypotheses, warm_start_rounds=warm_start_rounds, loss=loss,
            parts={"selection": selection, "update": update, "sanitizer": sanitizer, "aggregator": aggregator,
                   "server_privacy": server_privacy},
            client_privacy_cap=client_privacy_cap, val_clients_per_check=val_clients_per_check,
            test_every_check=test_every_check, seed=seed, noise_seed=noise_seed,
            log_nonprivate_metrics=log_nonprivate_metrics, diagnostics=diagnostics)
        self.selection, self.update, self.sanitizer = parts["selection"], parts["update"], parts["sanitizer"]
        self.aggregator, self.server_privacy = parts["aggregator"], parts["server_privacy"]
        if type(self) is FederatedRound:  # a preset saves its own (flat) arguments
            self.save_hyperparameters(ignore=["model", "noise_seed", "selection", "update", "sanitizer", "aggregator",
                                              "server_privacy"])
            self.save_hyperparameters(self.part_hparams())
        self.save_hyperparameters({"model_class": f"{type(model).__module__}.{type(model).__qualname__}"})

        self.template = model
        if self._accountable():  # noise on the whole model: a Householder orthogonal weight breaks at once
            from lightning_dp.privacy.validators import (describe_noise_broken_parametrizations,
                                                         find_noise_broken_parametrizations)

            broken = find_noise_broken_parametrizations(model)
            if broken:
                raise ValueError(describe_noise_broken_parametrizations(broken))
        self.seed = int(seed) if seed is not None else fresh_seed()
        # the secret seed, the gate, the final spend, the summary (drawn now: a Flower node's round never fits)
        self.protocol = RunProtocol(self, seed=noise_seed, seed_name="noise_seed", draw_now=True, warn_fresh=True)
        self.register_buffer("hypotheses", initial_hypotheses(model, self.spec, self.k, self.seed))
        # training progress, not model state: saved in checkpoint["federated"], so that restoring the
        # best weights (RestoreBestWeights, load_state_dict) does not rewind it
        self.register_buffer("rounds", torch.zeros((), dtype=torch.long), persistent=False)
        # the released change of every hypothesis in the previous round (zeros before the first): public, the
        # reference direction of direction-aware sanitizers; saved in checkpoint["federated"] like the rounds
        self.register_buffer("previous_step", torch.zeros_like(self.hypotheses), persistent=False)
        self.automatic_optimization = False
        self.clients = RoundClients(self)  # the clients' data, draws, training and releases
        self.private_step = PrivateStep(self, self.sanitizer.make_ledger())  # the server's step, accounted

    # ----------------------------------------------------------------- what the round is
    @property
    def ledger(self) -> PrivacyLedger:
        """The clients' ledger of their sanitized releases (charged by the :attr:`private_step`)."""
        return self.private_step.ledger

    @property
    def remote(self) -> Any:
        """The clients' side of a Flower deployment (:class:`lightning_dp.flower.server.NodeRound`), None in
        simulation."""
        return self.clients.remote

    @remote.setter
    def remote(self, value: Any) -> None:
        self.clients.remote = value

    @property
    def _noise_seed(self) -> int:
        """The secret seed of every draw an accountant relies on (:attr:`protocol`)."""
        return self.protocol.seed

    @property
    def _noise_seed_given(self) -> bool:
        return self.protocol.given

    def parts(self) -> dict[str, Any]:
        """``{kind: part}`` of the round."""
        return {"selection": self.selection, "update": self.update, "sanitizer": self.sanitizer,
                "aggregator": self.aggregator, "server_privacy": self.server_privacy}

    def part_hparams(self) -> dict[str, Any]:
        """What the parts are, and their parameters, for the logged hyperparameters."""
        out: dict[str, Any] = {}
        for kind, part in self.parts().items():
            out[kind] = part.name
            # a value decided later (a calibrated z, the sample rate) is logged once known: MLflow refuses a
            # parameter that changes, so None is not recorded first
            out.update({k: v for k, v in part.hparams().items() if v is not None})
        return out

    def _accountable(self) -> bool:
        """Whether any part accounts a spend (the run claims privacy)."""
        return bool(self.sanitizer.accountable or self.server_privacy.accountable or self.update.accountable)

    def selection_is_secret(self) -> bool:
        """Whether an accountant claims amplification by client sampling (central DP: ``server_privacy``
        accounted): who took part, and how many, must then stay off the record. The exact counts, the
        per-client ledgers (which show each client's participations) and statistics of the participants'
        updates are ``nonprivate/``."""
        return bool(self.server_privacy.accountable)

    def releases_are_sanitized(self) -> bool:
        """Whether every client's release is itself private (a local sanitizer with a ledger, or local DP-SGD
        with a record-level accountant): statistics of the releases are then post-processing. Otherwise (no
        sanitizer, or clip/sector without local noise, as under central DP) they are exact statistics of the
        clients' data: ``nonprivate/``."""
        return bool(self.sanitizer.accountable or self.update.accountable)

    @property
    def names(self) -> RoundNames:
        """Where the round's statistics go in the record (:class:`~lightning_dp.privacy.record.RoundNames`)."""
        return RoundNames(self.selection_is_secret(), self.releases_are_sanitized())

    def _sanitizer_follows_clip(self) -> bool:
        """Whether the clients clip at the server's adaptive threshold (:meth:`PrivateStep.follows_clip`)."""
        return self.private_step.follows_clip()

    def _forward_engine(self) -> str:
        """How the hypotheses' losses on the clients are computed (:meth:`RoundClients.forward_engine`)."""
        return self.clients.forward_engine()

    def participation_cost(self) -> float:
        """The sanitizer's cost of one participation from the current hypotheses (d-privacy: n/nu; local DP:
        the choice among k > 1 hypotheses included, so it changes as they move apart)."""
        return self.clients.participation_cost()

    def privacy_spend(self) -> list[Any]:
        """What the run spent, per level (:mod:`lightning_dp.privacy.spend`; ``lightning-dp grid`` composes it):
        the server's client-level epsilon, the clients' ledger of their sanitized releases, the record-level
        ledger of local DP-SGD; a run that protects none of them released the clients' updates unsanitized
        (client level, infinite)."""
        return self.private_step.spend()

    def set_secret_seed(self, seed: int) -> None:
        """Replace the noise seed before ``fit`` (``lightning-dp grid`` does this, so that no two runs of a
        grid draw the same noise)."""
        seed = check_seed(seed, optional=False, name="noise_seed")
        if seed == self.seed and self._accountable():
            raise ValueError("the noise seed equals the round's public seed (logged, in the uploaded checkpoint and "
                             "in every message of a deployment): anyone with the record could regenerate the noise "
                             "and recompute who took part. Use another noise seed, or none (a fresh secret one).")
        self.protocol.give_seed(seed)

    # ----------------------------------------------------------------- the clients (also a Flower node's)
    def read_clients(self, dm: Any) -> None:
        """Take the clients and the task from a :class:`~lightning_dp.datamodules.federated.FederatedDataModule` that is
        set up: what ``setup`` reads, and what a SuperNode of a Flower deployment reads from its own data
        (:mod:`lightning_dp.flower`)."""
        self.clients.read(dm)

    def train_clients(self, mine: list[int], r: int, x: Tensor, y: Tensor,
                      mask: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
        """What the training clients at positions ``mine`` (their padded data ``x, y, mask``) compute in round ``r``
        from the public hypotheses and previous step: the choice, the local training, the release
        (:meth:`RoundClients.client_round`'s returns). Every draw is the client's own (public shuffles from ``seed``,
        noise from ``noise_seed``, both by client position), so a SuperNode of a Flower deployment that runs this for
        its clients computes what the simulation computes (:mod:`lightning_dp.flower`)."""
        return self.clients.train(mine, r, x, y, mask)

    def evaluation_sums(self, split: str, mine: list[int], fairness: Any = None) -> Tensor:
        """What the logged evaluation is made of, for the clients at positions ``mine`` of ``split``: float64
        ``[sum of their chosen hypotheses' losses, clients, correct predictions, examples, clients that chose
        hypothesis 0, ..., k - 1]`` (correct predictions and examples 0 for regression). Sums over disjoint sets of
        clients add up: a DDP process's, or a Flower node's reply to an evaluation (:mod:`lightning_dp.flower`).
        ``fairness``: a :class:`~lightning_dp.metrics.GroupFairness` updated with the predictions."""
        return evaluation.evaluation_sums(self, split, mine, fairness)

    # ----------------------------------------------------------------- Lightning hooks
    def setup(self, stage: str) -> None:
        self.private_step.setup(stage)

    def teardown(self, stage: str) -> None:
        if stage == "fit" and self._trainer is not None:
            self.protocol.teardown(self.trainer)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        # local SGD and aggregation are the optimization; this optimizer only makes each round an
        # optimizer step for Lightning (global_step, ModelCheckpoint, max_steps count rounds)
        return _RoundOptimizer([self.hypotheses])

    def on_train_start(self) -> None:
        self.private_step.start()

    def training_step(self, batch: Any, batch_idx: int) -> None:
        """One round: select, train and sanitize on the clients, aggregate (with the server's privacy), log."""
        self.private_step.run()

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        evaluation.validate(self)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        evaluation.evaluate(self, "test" if self.clients.splits["test"] else "val", "test")

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        state.save_state(self, checkpoint)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if checkpoint.get("federated") is not None:
            state.load_state(self, checkpoint["federated"])

    def on_train_end(self) -> None:
        self.private_step.end()

    def on_fit_end(self) -> None:
        self.protocol.print_summary(self.trainer)
