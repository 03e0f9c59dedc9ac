"""The federated round as a LightningModule, assembled from parts (:mod:`lightning_dp.federated.parts`).

One training step is one round:

1. the ``selection`` part draws the round's clients (a client whose next participation would
   exceed ``client_privacy_cap``, or the record-level budget of a private ``update``, declines);
2. every selected client evaluates the k hypotheses on its own data and starts from the one
   with the lowest loss (IFCA; with k = 1 the global model), then the ``update`` part trains
   it (local SGD, vectorized over clients or looped, :mod:`lightning_dp.federated.local`; or
   record-level DP-SGD with a per-client accountant, :mod:`lightning_dp.federated.local_dp_sgd`);
3. the ``sanitizer`` part turns each trained model into the client's release and says what
   it costs (Euclidean Laplace d-privacy charges ``n / nu`` to the client's
   :class:`~lightning_dp.privacy.ledger.PrivacyLedger`);
4. the server sees only the releases: the ``server_privacy`` part wraps the ``aggregator``
   (k-means per cluster, or FedAvg); :class:`~lightning_dp.federated.parts.CentralGaussian`
   clips the updates, adds central Gaussian noise and accounts a client-level epsilon
   (DP-FedAvg).

The personalized algorithm of Galli et al. is a preset of these parts
(:class:`~lightning_dp.federated.PersonalizedFederatedModule`); DP-FedAvg is
``FederatedRound(model, selection=PoissonSelection(q), aggregator="fedavg",
server_privacy=CentralGaussian(...))``. Each round is one optimizer step for Lightning
(``global_step``, ``max_steps`` and ``ModelCheckpoint`` count rounds); one training epoch is
one round (``max_epochs`` is the number of rounds). Validation clients are held out; each
picks its best hypothesis and ``val/loss`` is the mean of those best losses.

Every random draw comes from a generator derived from ``(seed, stream, round, ...)``; a
client's shuffles and noise depend on its index, not on the other clients of its process;
with the round counter, the ledger and the parts' state in the checkpoint, a resumed run
equals the uninterrupted one. Two seeds: ``seed`` drives what is public (initialization,
the local shuffles of non-private updates, the validation subsample, diagnostics) and is
logged; ``noise_seed`` drives every draw an accountant relies on (client selection, whose
Poisson rate the client-level accountant amplifies; the sanitizers' and the server's noise;
local DP-SGD's batches) and is a secret (:mod:`lightning_dp.privacy.seeds`): fresh from the OS
by default, kept in local checkpoints under ``"secret"``, never logged nor uploaded. Those draws
use :func:`~lightning_dp.privacy.noise.derive_secret_generator`; the selection refuses any other
generator.

Under DDP (``strategy="ddp"``) every process selects the same clients, trains and sanitizes
its share of them (positions rank, rank + W, ...), and the releases are all-gathered in the
round's order; every process then aggregates the same releases with the same server noise
and charges the same ledger, so a run on W processes equals the run on one. Validation
clients are sharded the same way.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from typing import Any, Literal

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import Tensor, nn

from lightning_dp import checks
from lightning_dp.datamodules.federated import (
    ClientDataset,
    ClientPopulation,
    client_ids,
    client_sizes,
    padded_sensitive,
)
from lightning_dp.federated.local import (
    FlatParams,
    assigned_hypotheses,
    check_loss,
    choose_hypotheses,
    client_losses,
    client_outputs_and_losses,
    delta_norms,
    predictions,
)
from lightning_dp.federated.parts import (
    Aggregator,
    ClientSanitizer,
    ClientSelection,
    ClientUpdate,
    ServerPrivacy,
    resolve_part,
)
from lightning_dp.federated.parts.server_privacy import RoundReleases
from lightning_dp.privacy.finite import drop_non_finite
from lightning_dp.privacy.ledger import PrivacyLedger
from lightning_dp.privacy.noise import counter_uniform, derive_generator, derive_secret_generator
from lightning_dp.privacy.record import RoundNames
from lightning_dp.privacy.seeds import SECRET_KEY, check_seed, fresh_seed
from lightning_dp.protocol import RunProtocol

__all__ = ["FederatedRound"]

# streams of derive_generator (public: seed, for _INIT, _LOCAL, _VAL, _DIAGNOSTICS) and of derive_secret_generator
# (secret: noise_seed, for _CLIENTS, _NOISE, _SERVER_NOISE, _SERVER_COUNT, _LOCAL_NOISE)
_CLIENTS, _LOCAL, _NOISE, _INIT, _VAL = 11, 12, 13, 14, 15
_SERVER_NOISE, _SERVER_COUNT, _DIAGNOSTICS, _LOCAL_NOISE = 16, 17, 18, 19
#: releases (entries) a process holds at a time when the server's input is a sum (FederatedRound._summed_client_round):
#: the blocks whose sums add up, as large as :func:`~lightning_dp.federated.local.row_blocks`' default
SUM_BLOCK_ENTRIES = 2**22
#: the columns of a round's per-client statistics (float64; NaN: not reported): the loss of the chosen hypothesis,
#: the participation's cost, the number of examples, whether the update was within the clip (a bit), and whether
#: it was dropped as not finite (a bit; :func:`~lightning_dp.privacy.finite.drop_non_finite`)
STATS = ("loss", "cost", "count", "unclipped", "dropped")


class _RoundOptimizer(torch.optim.Optimizer):
    """Runs the closure it is given: the round's aggregation, counted by Lightning as a step."""

    def __init__(self, params: list[Tensor]) -> None:
        super().__init__(params, {})

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        return closure() if closure is not None else None


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
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        self.k = checks.positive_int("num_hypotheses", num_hypotheses)
        self.warm_start_rounds = checks.non_negative_int("warm_start_rounds", warm_start_rounds)
        if self.warm_start_rounds and self.k == 1:
            raise ValueError(f"warm_start_rounds={warm_start_rounds} needs num_hypotheses > 1 (with one hypothesis "
                             "every client starts from it): pass warm_start_rounds=0, or num_hypotheses >= 2")
        self.selection = resolve_part("selection", selection)
        self.update = resolve_part("update", update)
        self.sanitizer = resolve_part("sanitizer", sanitizer)
        self.aggregator = resolve_part("aggregator", aggregator)
        self.server_privacy = resolve_part("server_privacy", server_privacy)
        check_loss(loss)
        self.loss_name = loss
        if client_privacy_cap is not None and not float(client_privacy_cap) > 0:
            raise ValueError(f"client_privacy_cap={client_privacy_cap!r} is not allowed: pass a number > 0 or None")
        if client_privacy_cap is not None and not self.sanitizer.accountable:
            raise ValueError("client_privacy_cap needs a sanitizer that charges the clients (e.g. euclidean_laplace "
                             "with noise_multiplier > 0): without sanitization every participation has an infinite "
                             "cost")
        self.client_privacy_cap = None if client_privacy_cap is None else float(client_privacy_cap)
        self.val_clients_per_check = (None if val_clients_per_check is None
                                      else checks.positive_int("val_clients_per_check", val_clients_per_check))
        self.test_every_check = bool(test_every_check)
        check_seed(seed)
        check_seed(noise_seed, "noise_seed")
        if seed is not None and seed == noise_seed and (self.sanitizer.accountable or self.server_privacy.accountable
                                                         or self.update.accountable):
            raise ValueError(f"noise_seed={noise_seed} equals seed, which is public (logged, and in the uploaded "
                             "checkpoint): anyone with the record could regenerate every noise draw and recompute "
                             "who took part. Pass another noise_seed, or none (a fresh secret one).")
        self.log_nonprivate_metrics = bool(log_nonprivate_metrics)
        if diagnostics and not self.log_nonprivate_metrics:
            raise ValueError("diagnostics=True logs statistics of unsanitized updates and gradients (nonprivate/*): "
                             "it needs log_nonprivate_metrics=True")
        self.diagnostics = bool(diagnostics)
        if type(self) is FederatedRound:  # a preset saves its own (flat) arguments
            self.save_hyperparameters(ignore=["model", "noise_seed", "selection", "update", "sanitizer", "aggregator",
                                              "server_privacy"])
            self.save_hyperparameters(self.part_hparams())
        self.save_hyperparameters({"model_class": f"{type(model).__module__}.{type(model).__qualname__}"})

        self.template = model
        self.spec = FlatParams.of(model)
        self.seed = int(seed) if seed is not None else fresh_seed()
        # the secret seed, the gate, the final spend, the summary (drawn now: a Flower node's round never fits)
        self.protocol = RunProtocol(self, seed=noise_seed, seed_name="noise_seed", draw_now=True, warn_fresh=True)
        self.register_buffer("hypotheses", self._initial_hypotheses())
        # training progress, not model state: saved in checkpoint["federated"], so that restoring the
        # best weights (RestoreBestWeights, load_state_dict) does not rewind it
        self.register_buffer("rounds", torch.zeros((), dtype=torch.long), persistent=False)
        # the released change of every hypothesis in the previous round (zeros before the first): public, the
        # reference direction of direction-aware sanitizers; saved in checkpoint["federated"] like the rounds
        self.register_buffer("previous_step", torch.zeros_like(self.hypotheses), persistent=False)
        self.ledger: PrivacyLedger = self.sanitizer.make_ledger()
        self.automatic_optimization = False
        self._history: list[dict[str, Any]] = []
        self._cosines: list[tuple[int, float, float]] = []  # (round, update cosine, gradient cosine), diagnostics
        self._epsilon_written = -1  # the last round whose metrics carried the final privacy/epsilon
        self._key_tables: dict[int, Tensor] | None = None  # a round's shuffle tables by epoch, while it trains blocks
        self._fit_rounds, self._fit_participants = 0, 0  # rounds and participations of this fit (end summary)
        self._split_scored = False  # pdpfl/split_accuracy is logged once, when the split is made
        self._ledgers_missing = False  # loaded from a public checkpoint without its ledgers (on_load_checkpoint)
        #: the clients' side of a Flower deployment (:class:`lightning_dp.flower.server.NodeRound`), None in simulation
        self.remote: Any = None

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

    # ----------------------------------------------------------------- set-up
    def _initial_hypotheses(self) -> Tensor:
        """k independent initializations of the template (its own ``reset_parameters``)."""
        rows = []
        for j in range(self.k):
            net = copy.deepcopy(self.template)
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(int(derive_generator(self.seed, _INIT, j).initial_seed()) % 2**63)
                for mod in net.modules():
                    reset = getattr(mod, "reset_parameters", None)
                    if callable(reset):
                        reset()
            rows.append(self.spec.flatten(net))
        return torch.stack(rows)

    def setup(self, stage: str) -> None:
        from lightning_dp.datamodules.federated import FederatedDataModule

        # Trainer.datamodule is set by Lightning's data connector, not declared on the class
        dm = self.trainer.datamodule if self._trainer is not None else None  # type: ignore[attr-defined]
        if not isinstance(dm, FederatedDataModule):
            raise MisconfigurationException(
                "PersonalizedFederatedModule reads its clients from a FederatedDataModule (e.g. "
                "lightning_dp.datamodules.SyntheticLinearMixtureDataModule): pass it as trainer.fit(module, datamodule=...).")
        self.read_clients(dm)
        if stage == "fit":
            try:
                self.selection.check(len(self._clients["train"]))
            except ValueError as err:
                raise MisconfigurationException(str(err)) from None
            self._check_parts()
            if self.test_every_check and not self._clients["test"]:
                raise MisconfigurationException(
                    f"test_every_check=True but {type(dm).__name__} has no test clients: give it some (e.g. "
                    "num_test_clients for FederatedVisionDataModule), or set test_every_check=False")
        if stage == "fit":  # uploads refused, the gate, the secret seed the same on every process
            self.protocol.setup(self.trainer, refuse_uploads=self._accountable())
        if self.trainer.world_size > 1:  # a default public seed is drawn per process: every process must use rank 0's
            self.seed = int(self.trainer.strategy.broadcast(self.seed, src=0))

    def read_clients(self, dm: Any) -> None:
        """Take the clients and the task from a :class:`~lightning_dp.datamodules.federated.FederatedDataModule` that is
        set up: what ``setup`` reads, and what a SuperNode of a Flower deployment reads from its own data
        (:mod:`lightning_dp.flower`)."""
        self._data = dm
        self._clients: dict[str, Sequence[ClientDataset]] = {
            "train": dm.train_clients or [], "val": dm.val_clients or [], "test": dm.test_clients or []}
        self._classification = dm.task == "classification"
        if self._classification and self.loss_name == "rmse" and dm.num_classes is not None and dm.num_classes < 2:
            raise MisconfigurationException(f"{type(dm).__name__} is a classification task with num_classes="
                                            f"{dm.num_classes}; the rmse loss needs class scores of >= 2 classes")
        # group fairness of the held-out clients' predictions: binary labels with sensitive groups
        self._num_groups = dm.num_groups if self._classification and dm.num_classes == 2 else None
        sizes = client_sizes(self._clients["train"])  # a population's stored sizes: no client is built
        self._key_width = int(sizes.max()) if len(sizes) else 1  # the local shuffles' key table's width

    def teardown(self, stage: str) -> None:
        if stage == "fit" and self._trainer is not None:
            self.protocol.teardown(self.trainer)

    def _accountable(self) -> bool:
        """Whether any part accounts a spend (the run claims privacy)."""
        return bool(self.sanitizer.accountable or self.server_privacy.accountable or self.update.accountable)

    def _check_parts(self) -> None:
        """Refuse combinations of parts whose privacy claims would not hold, before any client trains: every part
        checks the combination it is in (:meth:`~lightning_dp.federated.parts.Part.problems`), and all the problems
        are reported together."""
        from lightning_dp.federated.parts import Combination

        parts = Combination(self.selection, self.update, self.sanitizer, self.aggregator, self.server_privacy, self.k)
        problems = [problem for part in (self.selection, self.update, self.sanitizer, self.aggregator,
                                         self.server_privacy) for problem in part.problems(parts)]
        if len(problems) == 1:
            raise MisconfigurationException(problems[0])
        if problems:
            raise MisconfigurationException(f"{len(problems)} problems with these parts:\n  - " + "\n  - ".join(problems))

    def _sanitizer_follows_clip(self) -> bool:
        """Whether the clients clip at the server's adaptive threshold (clip and sector sanitizers without local
        noise under ``CentralGaussian(adaptive=True)``): they report whether their raw update was within it."""
        return bool(getattr(self.server_privacy, "adaptive", False) and self.sanitizer.follows_clip)

    def on_train_start(self) -> None:
        self.protocol.start(self.trainer)
        if self._ledgers_missing:
            self._refuse_missing_ledgers()
        self._fit_rounds, self._fit_participants = 0, 0
        planned_rounds = self.trainer.max_epochs if self.trainer.max_epochs and self.trainer.max_epochs > 0 else None
        if self._sanitizer_follows_clip():  # the sets the releases lie in are the server's threshold's
            self.sanitizer.follow_clip(self.server_privacy.clip)
        if self.update.accountable:
            self._plan_update(planned_rounds)
        privacy = self.server_privacy
        if not privacy.accountable:
            return
        num_clients = len(self._clients["train"])
        try:
            privacy.plan(sample_rate=self.selection.poisson_rate, num_clients=num_clients,
                         expected_count=self.selection.expected_count(num_clients),
                         planned_rounds=planned_rounds,
                         update_sets=(self.sanitizer.update_set(False), self.sanitizer.update_set(True)))
        except ValueError as err:
            raise MisconfigurationException(f"{type(privacy).__name__}: {err}") from None
        for logger in self.trainer.loggers:
            logger.log_hyperparams({k: v for k, v in privacy.hparams().items() if v is not None})
        if not privacy.budget_left(self._update_set()):
            rank_zero_warn(f"{type(privacy).__name__}: no round fits in the remaining budget; stopping before the "
                           "first round.")
            self.trainer.should_stop = True

    def _plan_update(self, planned_rounds: int | None) -> None:
        """Fix the record-level private update's per-client noise (calibrated to its budget) and log it."""
        clients = self._clients["train"]
        num_clients = len(clients)
        try:
            self.update.plan(client_ids(clients, range(num_clients)), client_sizes(clients).tolist(),
                             planned_rounds=planned_rounds,
                             inclusion_rate=self.selection.expected_count(num_clients) / num_clients)
        except ValueError as err:
            raise MisconfigurationException(f"{type(self.update).__name__}: {err}") from None
        sigmas = sorted(self.update.noise_multipliers())
        params = {"local_noise_multiplier_min": sigmas[0], "local_noise_multiplier_max": sigmas[-1],
                  "local_participations_planned": getattr(self.update, "participations_planned", None)}
        for logger in self.trainer.loggers:
            logger.log_hyperparams({k: v for k, v in params.items() if v is not None})

    def privacy_spend(self) -> list[Any]:
        """What the run spent, per level (:mod:`lightning_dp.privacy.spend`; ``lightning-dp grid`` composes it):
        the server's client-level epsilon, the clients' ledger of their sanitized releases, the record-level
        ledger of local DP-SGD; a run that protects none of them released the clients' updates unsanitized
        (client level, infinite)."""
        from lightning_dp.privacy.spend import Spend

        spends = list(self.server_privacy.privacy_spend())
        secret = self.selection_is_secret()  # the ledgers then show who took part: nonprivate in the grid's record
        if self.sanitizer.accountable:
            spends.append(Spend.per_client("client_ledger", self.ledger, why=self.sanitizer.name,
                                           secret_participation=secret, unit=self.sanitizer.ledger_label))
        if self.update.accountable:
            spends.append(Spend.per_client("record", self.update.ledger, why=self.update.name,
                                           secret_participation=secret))
        if not spends:
            spends.append(Spend.unprotected("client", f"{type(self).__name__}: the clients' releases are not "
                                                      "sanitized and nothing is accounted"))
        return spends

    def set_secret_seed(self, seed: int) -> None:
        """Replace the noise seed before ``fit`` (``lightning-dp grid`` does this, so that no two runs of a
        grid draw the same noise)."""
        seed = check_seed(seed, optional=False, name="noise_seed")
        if seed == self.seed and self._accountable():
            raise ValueError("the noise seed equals the round's public seed (logged, in the uploaded checkpoint and "
                             "in every message of a deployment): anyone with the record could regenerate the noise "
                             "and recompute who took part. Use another noise seed, or none (a fresh secret one).")
        self.protocol.give_seed(seed)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        # local SGD and aggregation are the optimization; this optimizer only makes each round an
        # optimizer step for Lightning (global_step, ModelCheckpoint, max_steps count rounds)
        return _RoundOptimizer([self.hypotheses])

    # ------------------------------------------------------------------ round
    def _padded(self, split: str, index: list[int]) -> tuple[Tensor, Tensor, Tensor]:
        """The padded data of the clients at positions ``index`` of ``split`` on the hypotheses' device (the
        DataModule holds its clients on the CPU; a GPU round trains and evaluates them there)."""
        device = self.hypotheses.device
        return tuple(t.to(device, non_blocking=True) for t in self._data.padded_rows(split, index))

    def participation_cost(self) -> float:
        """The sanitizer's cost of one participation from the current hypotheses (d-privacy: n/nu; local DP:
        the choice among k > 1 hypotheses included, so it changes as they move apart)."""
        return self.sanitizer.participation_cost(self.spec.numel, self._choices())

    def _forward_engine(self) -> str:
        """How the hypotheses' losses on the clients are computed: ``vmap`` over clients for small models, a loop
        above ``AUTO_VMAP_MAX_PARAMETERS`` (grouped convolutions are slower on CPU). On a GPU too: vmap's forward
        holds every evaluated client's whole data's activations at once (100 CIFAR CNN clients of 455 images:
        22 GiB against 0.2 GiB in the loop on an H200), where training holds one batch per client."""
        from lightning_dp.federated.parts.update import auto_engine

        return auto_engine(self.spec.numel)

    def _update_set(self) -> tuple[float, float] | None:
        """The public set the next round's released updates lie in (one hypothesis; the reference is the
        previous round's released change), for the server's accounting under replacement."""
        if self.k != 1:
            return None
        return self.sanitizer.update_set(reference_given=bool(self.previous_step[0].norm() > 0))

    def _choices(self) -> Tensor | None:
        """The public hypotheses a client chooses its start among on its data (None for one hypothesis)."""
        return self.hypotheses.detach() if self.k > 1 else None

    def _sample_clients(self, r: int) -> tuple[list[int], int]:
        clients = self._clients["train"]
        eligible = None
        cap = self.client_privacy_cap
        if cap is not None:
            cost = self.participation_cost()

            def eligible(i: int) -> bool:
                return (not self.ledger.would_exceed(client_ids(clients, [i])[0], cost, cap)
                        and self.update.eligible(i))
        elif self.update.accountable:
            eligible = self.update.eligible

        # secret: the client-level accountant amplifies by this draw (ClientSelection.draw refuses a public generator)
        return self.selection.draw(len(clients), derive_secret_generator(self._noise_seed, _CLIENTS, r), eligible)

    def _shuffle_keys(self, r: int, index: list[int], mask: Tensor) -> Any:
        """Local shuffles of round r as a pure function of (seed, round, epoch, client index).

        A client's training then does not depend on which other clients share its process
        (DDP shards) or its vmap call. One (clients x largest client) table of uniform keys
        per epoch, rows taken by client index: one generator call instead of one generator per
        client (derive_generator costs ~10 us, as much as a whole vectorized round of 100
        hospital clients). For a :class:`~lightning_dp.datamodules.federated.ClientPopulation` or above 16 M keys,
        the keys of the round's clients only, each a hash of (seed, round, epoch, client, position)
        (:func:`~lightning_dp.privacy.noise.counter_uniform`): a table over a population of 1M clients would cost
        more than a round of 1,000 of them.
        """
        clients = self._clients["train"]
        width = self._key_width
        rows = torch.tensor(index, device=mask.device)
        if isinstance(clients, ClientPopulation) or len(clients) * width > 2**24:
            positions = torch.arange(mask.shape[1], device=mask.device)

            def hashed(epoch: int) -> Tensor:
                return counter_uniform(self.seed, _LOCAL, r, epoch, rows[:, None], positions[None]).float()

            return hashed

        def keys(epoch: int) -> Tensor:
            cache = self._key_tables  # the round's blocks share its tables (_summed_client_round)
            table = None if cache is None else cache.get(epoch)
            if table is None:
                table = torch.rand((len(clients), width), device=mask.device,
                                   generator=derive_generator(self.seed, _LOCAL, r, epoch, device=mask.device))
                if cache is not None:
                    if (len(cache) + 1) * table.numel() > 2**24:  # at most 2^24 keys held: then the latest only
                        cache.clear()
                    cache[epoch] = table
            return table[rows, : mask.shape[1]]

        return keys

    # ------------------------------------------------------------------- DDP
    def _shard(self, index: list[int]) -> list[int]:
        """This process's share of a list of clients: positions rank, rank + W, rank + 2W, ..."""
        return index[self.trainer.global_rank::self.trainer.world_size]

    def _gather_rows(self, rows: Tensor, total: int) -> Tensor:
        """Every process's ``rows`` (one per client of its :meth:`_shard`) back in the list's order, on all ranks."""
        world = self.trainer.world_size
        if world == 1:
            return rows
        per_rank = -(-total // world)
        padded = rows.new_zeros((per_rank, *rows.shape[1:]))
        padded[: rows.shape[0]] = rows
        parts = [torch.empty_like(padded) for _ in range(world)]
        torch.distributed.all_gather(parts, padded.contiguous())
        gathered = torch.stack(parts)  # (world, per_rank, ...)
        return gathered.transpose(0, 1).reshape(per_rank * world, *rows.shape[1:])[:total]

    def _client_round(self, index: list[int], r: int) -> tuple[Tensor, Tensor, Tensor | None]:
        """Choice, local training and sanitization of this process's share of the round's clients.

        Returns ``(releases, stats)``: (m, P) released vectors and (m, 5) float64 :data:`STATS`
        ``[loss of the chosen hypothesis, privacy cost, number of examples, unclipped bit, dropped bit]`` (NaN: not
        reported) for the m clients of the shard;
        with ``diagnostics``, also (m, 2P) rows ``[update, per-sample gradient of one random example]``.
        """
        hyps = self.hypotheses
        if self.remote is not None:  # the server of a deployment: the clients compute on their nodes
            return self.remote.client_round(self, index, r)
        mine = self._shard(index)
        if not mine:
            return (hyps.new_zeros((0, self.spec.numel)),
                    torch.zeros((0, len(STATS)), dtype=torch.float64, device=hyps.device),
                    hyps.new_zeros((0, 2 * self.spec.numel)) if self.diagnostics else None)
        x, y, mask = self._padded("train", mine)
        return self.train_clients(mine, r, x, y, mask)

    def train_clients(self, mine: list[int], r: int, x: Tensor, y: Tensor,
                      mask: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
        """What the training clients at positions ``mine`` (their padded data ``x, y, mask``) compute in round ``r``
        from the public hypotheses and previous step: the choice, the local training, the release
        (:meth:`_client_round`'s returns). Every draw is the client's own (public shuffles from ``seed``, noise
        from ``noise_seed``, both by client position), so a SuperNode of a Flower deployment that runs this for
        its clients computes what the simulation computes (:mod:`lightning_dp.flower`)."""
        hyps = self.hypotheses
        warm = self.k > 1 and r < self.warm_start_rounds
        if (self.k == 1 or warm) and not self.log_nonprivate_metrics:  # nothing to choose, no loss to log
            losses = torch.full((len(mine), self.k), float("nan"), device=hyps.device)
        else:
            with torch.no_grad():
                losses = client_losses(self.template, self.spec, hyps, x, y, mask, self.loss_name,
                                       self._forward_engine())
        if warm:  # public: the client's id and the public seed, no data (nonprivate/train_loss: the assigned one's)
            choice = assigned_hypotheses(self.seed, client_ids(self._clients["train"], mine), self.k).to(hyps.device)
        else:
            choice = choose_hypotheses(losses)
        # one hypothesis: a view, not m copies of the model (m x P floats are the round's memory traffic)
        start = hyps[choice] if self.k > 1 else hyps[0].expand(len(mine), -1)
        trained = self.update.train(
            self.template, self.spec, start, x, y, mask, loss=self.loss_name, shuffles=self._shuffle_keys(r, mine, mask),
            clients=mine, noise=lambda i: derive_secret_generator(self._noise_seed, _LOCAL_NOISE, r, i, device=x.device))
        # a client whose update is not finite (broken data, a diverged training) contributes a zero update: it is
        # still sanitized, released and charged as planned (a NaN release, or a stop, would tell its data apart)
        trained, dropped = drop_non_finite(trained, start)
        # one copy per hypothesis (not per client, not a view of the buffer the round overwrites afterwards)
        references = [step.clone() if bool(step.norm() > 0) else None for step in self.previous_step]
        released, costs, bits = self.sanitizer.sanitize_rows(
            trained, start, layer_sizes=self.spec.sizes, references=references, choice=choice,
            hypotheses=self._choices(),
            generator_of=lambda c: derive_secret_generator(self._noise_seed, _NOISE, r, mine[c], device=x.device))
        chosen = losses.gather(1, choice[:, None]).squeeze(1).double()
        stats = torch.stack([chosen, costs.to(chosen.device), mask.sum(1).double(), bits.to(chosen.device),
                             dropped.to(chosen.device, torch.float64)], dim=1)
        return released, stats, self._diagnostic_rows(mine, r, start, trained, x, y, mask)

    def _diagnostic_rows(self, mine: list[int], r: int, start: Tensor, trained: Tensor, x: Tensor, y: Tensor,
                         mask: Tensor) -> Tensor | None:
        """(m, 2P) ``[update, per-sample gradient]`` of the shard's clients (None without diagnostics)."""
        if not self.diagnostics:
            return None
        from lightning_dp.federated.diagnostics import per_sample_gradients

        counts = mask.sum(1)
        pick = torch.stack([torch.randint(int(n), (), generator=derive_generator(self.seed, _DIAGNOSTICS, r, i))
                            for i, n in zip(mine, counts.tolist())]).to(x.device)
        rows = torch.arange(len(mine), device=x.device)
        grads = per_sample_gradients(self.template, self.spec, start, x[rows, pick], y[rows, pick], self.loss_name)
        return torch.cat([trained - start, grads.to(start.dtype)], dim=1).detach()

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

    def _record_metrics(self) -> dict[str, float]:
        """The record-level ledger's metrics (local DP-SGD) under their recorded names."""
        return {self.names.ledger(k.split("/", 1)[1]): v for k, v in self.update.privacy_metrics().items()}

    def training_step(self, batch: Any, batch_idx: int) -> None:
        """One round: select, train and sanitize on the clients, aggregate (with the server's privacy), log."""
        self.protocol.cover(self.trainer)  # a logger added by a hook since setup
        r = int(self.rounds)
        index, declined = self._sample_clients(r)  # the same on every process (seeded by round)
        metrics: dict[str, float] = {self.names.stat("participants"): float(len(index)),
                                     self.names.stat("declined"): float(declined)}
        epochs, steps = self.trainer.max_epochs, self.trainer.max_steps
        last = bool((epochs is not None and epochs > 0 and self.trainer.current_epoch + 1 >= epochs)
                    or (steps is not None and steps > 0 and self.trainer.global_step + 1 >= steps))  # ends anyway
        # epsilon (a PLD composition) only when Lightning writes this round's metrics, or the run ends; the writes
        # before the last from the accountants' cheaper variant (an upper bound too), the last from their own
        written = bool(getattr(self.trainer, "_logger_connector", None) is None
                       or self.trainer._logger_connector.should_update_logs)
        report: Literal["final", "interim"] | None = "final" if last else "interim" if written else None
        if index or self.server_privacy.accountable:  # an accounted round without participants still releases noise
            releases, stats, sums = self._client_releases(index, r, metrics)
            self._server_step(index, releases, stats, r, report=report, metrics=metrics, sums=sums)
        else:
            # a round without participants is still a round
            self.optimizers().step(closure=lambda: None)  # type: ignore[union-attr]  # one optimizer
        self._end_round(index, r, last=last, written=written, metrics=metrics)

    def _client_releases(self, index: list[int], r: int,
                         metrics: dict[str, float]) -> tuple[Tensor, Tensor, tuple[Tensor, Tensor] | None]:
        """The server's view of round ``r``: every release and its statistics, in the round's client order, on every
        process; the clients' costs charged to their ledgers. For a server whose input is a sum
        (:meth:`_sums_releases`), no releases ((0, P)) but their norms and sum (:attr:`RoundReleases.sums`)."""
        hyps = self.hypotheses
        sums = None
        if self._sums_releases():
            local_stats, local_norms, total = self._summed_client_round(index, r)
            if self.trainer.world_size > 1:  # P floats per process instead of its (U / W, P) releases
                # gloo's and NCCL's all-reduce hand every process the same bits: every process then adds the same
                # server noise (one secret stream) to the same sum and holds the same hypotheses
                torch.distributed.all_reduce(total)
            sums = (self._gather_rows(local_norms, len(index)), total)
            local_releases, local_diagnostics = hyps.new_zeros((0, self.spec.numel)), None
        elif index:
            local_releases, local_stats, local_diagnostics = self._client_round(index, r)
        else:
            local_releases = hyps.new_zeros((0, self.spec.numel))
            local_stats = torch.zeros((0, len(STATS)), dtype=torch.float64, device=hyps.device)
            local_diagnostics = hyps.new_zeros((0, 2 * self.spec.numel)) if self.diagnostics else None
        if local_diagnostics is not None:
            self._log_cosines(r, self._gather_rows(local_diagnostics, len(index)), metrics)
        releases = local_releases if sums is not None else self._gather_rows(local_releases, len(index))
        stats = self._gather_rows(local_stats, len(index))
        if self.sanitizer.accountable:  # e.g. nu = 0, the non-private baseline: nothing to account
            for client_id, cost in zip(client_ids(self._clients["train"], index), stats[:, 1].tolist()):
                self.ledger.charge(client_id, cost)
        self.update.charge(index)  # record-level ledger (local DP-SGD)
        if self.k == 1 and len(index):  # the released updates' norms: post-processing only of sanitized releases
            norms = sums[0] if sums is not None else delta_norms(releases, hyps[0])
            metrics[self.names.stat("update_norm_mean", of_releases=True)] = float(norms.mean())
            metrics[self.names.stat("update_norm_std", of_releases=True)] = float(norms.std()) if len(index) > 1 else 0.0
        return releases, stats, sums

    def _sums_releases(self) -> bool:
        """Whether the round sums its releases as it makes them: the server reads only their norms and a sum
        (:attr:`~lightning_dp.federated.parts.ServerPrivacy.sums_releases`: DP-FedAvg's clipped sum), the clients
        train here (not on a deployment's nodes), and nothing else reads the releases (diagnostics, the recorded
        releases of a tiny model)."""
        return (self.server_privacy.sums_releases and self.k == 1 and self.remote is None and not self.diagnostics
                and not (self.spec.numel <= 2 and self.names.records_releases))

    def _summed_client_round(self, index: list[int], r: int) -> tuple[Tensor, Tensor, Tensor]:
        """``(stats (m, 5), norms (m,), sum (P,))`` of this process's clients, trained and summed a block at a time.

        A block is :func:`~lightning_dp.federated.local.row_blocks`' (2^22 entries of releases): one block when the
        round's releases fit, so that a small round computes exactly what summing the held releases computes; a
        round of 1,000 CNN clients holds two of their models at a time instead of 1,000. The sums of the blocks
        add up in order (on one process, the same additions as the held releases' sum)."""
        hyps = self.hypotheses
        glob = hyps[0]
        total = torch.zeros_like(glob)
        mine = self._shard(index)
        stats = [torch.zeros((0, len(STATS)), dtype=torch.float64, device=hyps.device)]
        norms = [torch.zeros(0, dtype=torch.float64, device=hyps.device)]
        per = max(1, SUM_BLOCK_ENTRIES // self.spec.numel)
        self._key_tables = {} if len(mine) > per else None
        try:
            for start in range(0, len(mine), per):
                block = mine[start:start + per]
                x, y, mask = self._padded("train", block)
                released, block_stats, _ = self.train_clients(block, r, x, y, mask)
                block_norms, partial = self.server_privacy.partial_sum(released, glob)
                total += partial
                stats.append(block_stats)
                norms.append(block_norms)
                del released, x, y, mask
        finally:
            self._key_tables = None
        return torch.cat(stats), torch.cat(norms), total

    def _server_step(self, index: list[int], releases: Tensor, stats: Tensor, r: int, *,
                     report: Literal["final", "interim"] | None, metrics: dict[str, float],
                     sums: tuple[Tensor, Tensor] | None = None) -> None:
        """The server's aggregation of round ``r`` (through its privacy part) and the optimizer step to it."""
        hyps, privacy = self.hypotheses, self.server_privacy
        self.aggregator.observe(client_ids=client_ids(self._clients["train"], index),
                                layer_sizes=self.spec.sizes, round_index=r,
                                budgets=self.update.revealed_budgets(index) if self.aggregator.needs_budgets else None)
        following = self._sanitizer_follows_clip()
        held = RoundReleases(releases, hyps, weights=stats[:, 2],
                             expected_count=self.selection.expected_count(len(self._clients["train"])),
                             update_set=self._update_set(), unclipped=stats[:, 3] if following else None, sums=sums)
        new, assignment, privacy_metrics = privacy.aggregate(
            held, self.aggregator,
            noise_generator=derive_secret_generator(self._noise_seed, _SERVER_NOISE, r, device=hyps.device),
            count_generator=derive_secret_generator(self._noise_seed, _SERVER_COUNT, r), report_epsilon=report)
        if self.trainer.world_size > 1 and hyps.device.type == "cuda":
            # every process aggregated the same releases, but CUDA's float index_add_ (the k-means' cluster sums) is
            # not deterministic: rank 0's result for all, so that the processes keep the same hypotheses
            new = new.contiguous()
            torch.distributed.broadcast(new, src=0)
            on_device = assignment.to(hyps.device).contiguous()  # NCCL sends device tensors only
            torch.distributed.broadcast(on_device, src=0)
            assignment = on_device.to(assignment.device)
        if following:  # the next round's clients clip at the server's new (public) threshold
            self.sanitizer.follow_clip(privacy.clip)
        self._split_metrics(index, metrics)
        self.previous_step.copy_(new - hyps)
        self.optimizers().step(closure=lambda: self.hypotheses.copy_(new))  # type: ignore[union-attr]  # one optimizer
        metrics.update(privacy_metrics)
        sizes = torch.bincount(assignment, minlength=self.k)
        if len(index):  # the clients' private losses: covered by no accountant
            losses = stats[:, 0][stats[:, 0].isfinite()]  # NaN: withheld (lightning_dp.flower), or a broken client's
            if len(losses):
                metrics["nonprivate/train_loss"] = float(losses.mean())
            dropped = float(stats[:, 4].nansum())  # NaN: withheld by a deployment's node (lightning_dp.flower)
            if dropped:
                metrics["nonprivate/dropped_updates"] = dropped
        for j in range(self.k):  # the server's clustering of the releases
            metrics[self.names.stat(f"cluster_size_{j}", of_releases=True)] = float(sizes[j])
        if self.spec.numel <= 2 and self.names.records_releases:
            self._history.append({"round": r, "releases": releases.detach().cpu().clone(),
                                  "hypotheses": new.detach().cpu().clone()})

    def _end_round(self, index: list[int], r: int, *, last: bool, written: bool, metrics: dict[str, float]) -> None:
        """The round's spend and ledgers as metrics, the budget's stop, the logging."""
        privacy = self.server_privacy
        if self.sanitizer.accountable and self.k > 1:  # the choice's share of the cost grows as hypotheses separate
            metrics["privacy/cost_per_participation"] = self.participation_cost()
        if len(self.ledger):
            metrics[self.names.ledger("client_epsilon_median")] = self.ledger.median()
            metrics[self.names.ledger("client_epsilon_max")] = self.ledger.max()
        if (last or written) and self.update.accountable:  # per-client compositions: only when written
            metrics.update(self._record_metrics())
        self.rounds += 1
        final = last or not privacy.accountable  # the server's spend written (if at all) from its own accountant
        if privacy.accountable and not last and not privacy.budget_left(self._update_set()) and not self.trainer.should_stop:
            metrics.update(privacy.epsilon_metrics())  # the final spend is always recorded
            final = True
            rank_zero_info(f"{type(privacy).__name__}: stopping after round {r + 1}: the next round would exceed "
                           f"target_epsilon={privacy.target_epsilon} (spent {metrics['privacy/epsilon']:.4f}).")
            self.trainer.should_stop = True
        if ("privacy/epsilon" in metrics or self.names.ledger("record_epsilon_max") in metrics) and written and final:
            self._epsilon_written = r  # an interim write is not: on_train_end writes the final spend after it
        if not self.log_nonprivate_metrics:  # exact statistics of the clients' data, covered by no accountant
            metrics = {k: v for k, v in metrics.items() if not k.startswith("nonprivate/")}
        # float64: Lightning would store a Python float as float32 and round the spend
        self.log_dict({k: torch.tensor(v, dtype=torch.float64) for k, v in metrics.items()}, on_step=True,
                      on_epoch=False, batch_size=1)
        self._fit_rounds += 1
        self._fit_participants += len(index)
        self._log_progress(metrics)

    def _log_progress(self, metrics: dict[str, float]) -> None:
        """The round's progress on Lightning's progress bar, under short names (not sent to the loggers, which
        get the metrics under their full names): ``round`` (rounds done), ``clients`` (this round's
        participants), ``client_eps_med``/``client_eps_max`` (the per-client ledger), ``eps`` (the server's
        client-level epsilon, when written) and ``record_eps_max`` (local DP-SGD, when written)."""
        short = {self.names.stat("participants"): "clients", self.names.ledger("client_epsilon_median"): "client_eps_med",
                 self.names.ledger("client_epsilon_max"): "client_eps_max", "privacy/epsilon": "eps",
                 self.names.ledger("record_epsilon_max"): "record_eps_max"}
        bar = {"round": float(self.rounds)}
        bar.update({name: metrics[key] for key, name in short.items() if key in metrics})
        self.log_dict({k: torch.tensor(v, dtype=torch.float64) for k, v in bar.items()}, prog_bar=True, logger=False,
                      on_step=True, on_epoch=False, batch_size=1)

    def _split_metrics(self, index: list[int], metrics: dict[str, float]) -> None:
        """A public/private split of the aggregator (PFA): its size per round, and once, when the split is made from
        released updates (the warm start), its accuracy against the clients' true budget groups (a simulation
        diagnostic: the server never sees the truth)."""
        public = self.aggregator.last_public
        if not public or len(public) != len(index):
            return
        metrics["pdpfl/public_clients"] = float(sum(public))
        truth = self.update.true_public(index)
        if truth is not None and not self._split_scored and self.aggregator.warm_started:
            metrics["pdpfl/split_accuracy"] = sum(p == t for p, t in zip(public, truth)) / len(index)
            self._split_scored = True

    def _log_cosines(self, r: int, rows: Tensor, metrics: dict[str, float]) -> None:
        from lightning_dp.federated.diagnostics import mean_pairwise_cosine

        p = self.spec.numel
        updates, gradients = mean_pairwise_cosine(rows[:, :p]), mean_pairwise_cosine(rows[:, p:])
        metrics["nonprivate/update_cosine"], metrics["nonprivate/gradient_cosine"] = updates, gradients
        self._cosines.append((r, updates, gradients))

    # -------------------------------------------------------------- evaluation
    def _evaluate(self, split: str, stage: str) -> None:
        """Each evaluated client picks its best hypothesis; log the loss, choices, accuracy and group fairness.

        ``{stage}/loss`` is the mean over clients of the chosen hypothesis' loss. For a
        classification DataModule, ``{stage}/acc`` is the accuracy over all evaluated
        samples of their client's chosen hypothesis (the personalized model; with k = 1
        the global model). When the labels are binary and the clients carry sensitive
        groups (:attr:`FederatedDataModule.num_groups`), every output of
        :class:`~lightning_dp.metrics.GroupFairness` on those predictions is logged as
        ``{stage}/fairness/<name>`` (e.g. ``test/fairness/equalized_odds_difference``).
        """
        clients = self._clients[split]
        if not clients:
            return
        index = list(range(len(clients)))
        # only validation checks subsample; ``test`` (even on validation clients) evaluates every client
        if stage == "val" and self.val_clients_per_check is not None and self.val_clients_per_check < len(clients):
            g = derive_generator(self.seed, _VAL, int(self.rounds))
            index = torch.randperm(len(clients), generator=g)[: self.val_clients_per_check].tolist()
        fairness = None
        if self._num_groups is not None and self.remote is not None:
            rank_zero_warn("the group-fairness metrics of a Flower deployment's evaluation are not computed: the "
                           "nodes send sums of losses, choices and correct predictions only", category=UserWarning)
        elif self._num_groups is not None:
            from lightning_dp.metrics import GroupFairness

            fairness = GroupFairness(self._num_groups).to(self.hypotheses.device)
        if self.remote is not None:  # the server of a deployment: the clients evaluate on their nodes
            sums = self.remote.evaluate(self, split, index)
        else:
            sums = self.evaluation_sums(split, self._shard(index), fairness)
            if self.trainer.world_size > 1:  # identical on every process afterwards
                torch.distributed.all_reduce(sums)
        sync = self.trainer.world_size > 1  # equal values on every process: sync_dist averages them
        count = sums[1].clamp_min(1)
        self.log(f"{stage}/loss", sums[0] / count, batch_size=1, sync_dist=sync)
        for j in range(self.k):
            self.log(f"{stage}/chose_{j}", sums[4 + j] / count, batch_size=1, sync_dist=sync)
        if self._classification:
            self.log(f"{stage}/acc", sums[2] / sums[3].clamp_min(1), batch_size=1, sync_dist=sync)
        if fairness is not None:  # compute() sums the per-group counts over processes
            values = fairness.compute()
            # its overall accuracy is {stage}/acc (same predictions); NaN rates (absent groups) are not logged
            self.log_dict({f"{stage}/fairness/{name}": value.double() for name, value in values.items()
                           if name != "accuracy" and torch.isfinite(value)}, batch_size=1, sync_dist=sync)

    def evaluation_sums(self, split: str, mine: list[int], fairness: Any = None) -> Tensor:
        """What the logged evaluation is made of, for the clients at positions ``mine`` of ``split``: float64
        ``[sum of their chosen hypotheses' losses, clients, correct predictions, examples, clients that chose
        hypothesis 0, ..., k - 1]`` (correct predictions and examples 0 for regression). Sums over disjoint sets of
        clients add up: a DDP process's, or a Flower node's reply to an evaluation (:mod:`lightning_dp.flower`).
        ``fairness``: a :class:`~lightning_dp.metrics.GroupFairness` updated with the predictions."""
        sums = torch.zeros(4 + self.k, dtype=torch.float64, device=self.hypotheses.device)
        if not mine:
            return sums
        x, y, mask = self._padded(split, mine)
        outputs, losses = client_outputs_and_losses(self.template, self.spec, self.hypotheses, x, y, mask,
                                                    self.loss_name, self._forward_engine())
        choice = losses.argmin(dim=1)
        sums[0], sums[1] = losses.min(dim=1).values.double().sum(), float(len(mine))
        sums[4:] = torch.bincount(choice, minlength=self.k).double()
        if self._classification:
            chosen = outputs[torch.arange(len(mine), device=choice.device), choice]  # (C, Nmax, ...)
            preds = predictions(chosen.flatten(0, 1), self.loss_name).view(mask.shape)
            sums[2], sums[3] = ((preds == y.long()) & mask).sum().double(), mask.sum().double()
            if fairness is not None:
                groups = padded_sensitive([self._clients[split][i] for i in mine])
                if groups is None:
                    raise MisconfigurationException(
                        f"the DataModule declares num_groups={self._num_groups} but some {split} clients have "
                        "no sensitive ids (ClientDataset.sensitive)")
                fairness.update(preds[mask], y[mask].long(), groups.to(mask.device)[mask])
        return sums

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self._evaluate("val", "val")
        if self.test_every_check:
            self._evaluate("test", "test")

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self._evaluate("test" if self._clients["test"] else "val", "test")

    # -------------------------------------------------------------- checkpoint
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        parts = {kind: part.state_dict() for kind, part in self.parts().items()}
        secret: dict[str, Any] = self.protocol.state_dict()
        state = {"seed": self.seed, "rounds": int(self.rounds), "previous_step": self.previous_step.detach().cpu().clone(),
                 "split_scored": self._split_scored, "version": 4}
        if self.selection_is_secret():
            # the ledgers show who took part (participations per client), which the client-level accountant's
            # amplification needs kept secret: local checkpoints only, like the noise seed; the server's accountant
            # (its history is a function of the rounds) stays public
            secret["ledger"] = self.ledger.state_dict()
            secret["parts"] = {kind: s for kind, s in parts.items() if kind != "server_privacy"}
            state["parts"] = {"server_privacy": parts["server_privacy"]}
        else:
            state["ledger"], state["parts"] = self.ledger.state_dict(), parts
        state[SECRET_KEY] = secret
        checkpoint["federated"] = state

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        state = checkpoint.get("federated")
        if state is not None:
            secret = state.get(SECRET_KEY, {})
            ledger = state.get("ledger", secret.get("ledger"))
            # a public checkpoint of a run whose selection is secret has no ledgers: training on from it (resume, or
            # load_from_checkpoint then fit) is refused when training starts (on_train_start); testing is fine
            self._ledgers_missing = ledger is None and (self.sanitizer.accountable or self.update.accountable)
            if self._ledgers_missing and self._trainer is not None and self.trainer.state.fn == "fit":
                self._refuse_missing_ledgers()  # a resume (ckpt_path): before Lightning restores anything else
            if ledger is not None:
                self.ledger.load_state_dict(ledger)
            self.seed = int(state["seed"])
            self.rounds.fill_(int(state["rounds"]))
            self._split_scored = bool(state.get("split_scored", False))
            if state.get("previous_step") is not None:
                self.previous_step.copy_(state["previous_step"])
            parts = {**secret.get("parts", {}), **state.get("parts", {})}
            for kind, part in self.parts().items():
                part.load_state_dict(parts.get(kind, {}))
            # a public checkpoint, or one from before version 3 (its noise from the logged seed): a fresh secret seed
            self.protocol.load_state_dict(secret)

    def _refuse_missing_ledgers(self) -> None:
        raise MisconfigurationException(
            f"{type(self).__name__}: the checkpoint holds no per-client ledger: it is a public checkpoint (the "
            "uploaded model/final.ckpt) of a run whose client selection is secret, stripped of who took part. "
            "Training on from it would restart the clients' privacy ledgers at zero while the rounds and the "
            "server's accountant continue. Resume from the run's local checkpoint (ModelCheckpoint's file), or start "
            "a new run from fresh weights.")

    def on_train_end(self) -> None:
        step = int(self.trainer.global_step)
        if step > 0 and self._epsilon_written != int(self.rounds) - 1:
            # a run ended between log writes or after an interim one (max_time, an interrupt, another callback's
            # stop): write the final spend from the accountants' own configuration, at the step numbering of the
            # round's own metrics (those of optimizer step n are written at n - 1; after an interim write of the same
            # round this one is the later, which MLflow takes as the latest)
            final = self.server_privacy.epsilon_metrics() if self.server_privacy.accountable else {}
            final.update(self._record_metrics())
            self.protocol.write_final(self.trainer, final, step)
        # the artifacts pass the gate by their names (under nonprivate/ when the selection is secret)
        if self.trainer.is_global_zero and len(self.ledger):
            self._log_ledger_artifacts()
        if self.trainer.is_global_zero and self._history:
            self._log_parameter_plot()
        if self.trainer.is_global_zero and self.update.accountable and len(self.update.ledger):
            self._log_record_ledger()
        if self.trainer.is_global_zero and self._cosines:
            self._log_cosine_plot()
        self.protocol.end(self._summary_title, self._summary_rows)

    def on_fit_end(self) -> None:
        self.protocol.print_summary(self.trainer)

    def _summary_title(self) -> str:
        rounds = int(self.rounds)
        resumed = f", {self._fit_rounds} in this fit" if self._fit_rounds != rounds else ""
        return f"{type(self).__name__}: {rounds} rounds{resumed}"

    def _summary_rows(self) -> list[tuple[str, str]]:
        """``(label, value)`` rows of the end-of-training summary (:mod:`lightning_dp.callbacks.summary`)."""
        num_train = len(self._clients["train"])
        mean = self._fit_participants / max(self._fit_rounds, 1)
        if not self.protocol.shown(self.trainer, self.names.stat("participants")):  # the exact counts are nonprivate, and off
            rows = [("clients", f"{self.selection.expected_count(num_train):.3g} expected per round ({num_train} "
                                f"training clients, {self.selection.name} selection; who took part is secret)")]
        else:
            rows = [("clients", f"{mean:.3g} per round ({self._fit_participants} participations this fit; {num_train} "
                                f"training clients, {self.selection.name} selection)")]
        if len(self.ledger) and self.protocol.shown(self.trainer, self.names.ledger("client_epsilon_max")):
            cap = "" if self.client_privacy_cap is None else f", cap {self.client_privacy_cap:g}"
            rows.append(("client epsilon", f"median {self.ledger.median():.4g}, max {self.ledger.max():.4g} "
                                           f"({self.sanitizer.ledger_label}{cap})"))
        privacy = self.server_privacy
        if privacy.accountable:
            eps = privacy.epsilon_metrics().get("privacy/epsilon", math.nan)
            target = getattr(privacy, "target_epsilon", None)
            of = "" if target is None else f" of target_epsilon {target:g}"
            rows.append(("epsilon", f"{eps:.4g}{of} at delta {getattr(privacy, 'target_delta', math.nan):g} "
                                    f"(client-level, {type(privacy).__name__})"))
        record = self.update.privacy_metrics() if self.update.accountable and self.protocol.shown(self.trainer, 
            self.names.ledger("record_epsilon_max")) else {}
        if record:
            med, top = record["privacy/record_epsilon_median"], record["privacy/record_epsilon_max"]
            rows.append(("record epsilon", f"median {med:.4g}, max {top:.4g} (per client, {self.update.name})"))
        if not (self.sanitizer.accountable or privacy.accountable or self.update.accountable):
            rows.append(("privacy", "none: the clients' releases are not sanitized and nothing is accounted"))
        metrics = self.trainer.callback_metrics
        for name in ("val/loss", "val/acc"):
            if name in metrics:
                rows.append((name, f"{float(metrics[name]):.4g} (last validation)"))
        return rows

    # ------------------------------------------------------------------ plots (drawn by federated/reports.py)
    def _log_ledger_artifacts(self) -> None:
        from lightning_dp import tracking
        from lightning_dp.federated import reports

        values = list(self.ledger.as_dict().values())
        fig = reports.spend_histogram(values, xlabel=self.sanitizer.ledger_label,
                                      title=f"privacy spend per client, {self.sanitizer.name}, n={self.spec.numel}")
        tracking.log_figure(self.trainer, fig, self.names.ledger("client_epsilon_hist.png"))
        table = reports.spend_table(clients=len(values), median=self.ledger.median(), maximum=self.ledger.max(),
                                    cost_per_participation=self.participation_cost())
        tracking.log_text(self.trainer, table, self.names.ledger("client_epsilon.tsv"))

    def _log_record_ledger(self) -> None:
        """``privacy/record_epsilon.tsv`` (every client's record-level epsilon, noise and participations) and its
        histogram ``privacy/record_epsilon_hist.png`` (under ``nonprivate/`` when the selection is secret)."""
        from lightning_dp import tracking
        from lightning_dp.federated import reports

        ledger, update = self.update.ledger, self.update
        spend = ledger.as_dict()
        table = reports.record_table(
            (client.client_id, spend.get(client.client_id, 0.0), budget, plan, ledger.participations(client.client_id))
            for client, plan, budget in zip(self._clients["train"], update.client_plans(), update.client_budgets()))
        tracking.log_text(self.trainer, table, self.names.ledger("record_epsilon.tsv"))
        fig = reports.spend_histogram(
            list(spend.values()),
            xlabel=f"record-level epsilon at delta={ledger.delta:g} ({ledger.accountant}, {ledger.adjacency})",
            title=f"local DP-SGD spend per client ({update.sampling} batches)")
        tracking.log_figure(self.trainer, fig, self.names.ledger("record_epsilon_hist.png"))

    def _log_cosine_plot(self) -> None:
        from lightning_dp import tracking
        from lightning_dp.federated import reports

        tracking.log_figure(self.trainer, reports.cosine_figure(self._cosines, update_name=self.update.name),
                            "nonprivate/cosine.png")
        tracking.log_text(self.trainer, reports.cosine_table(self._cosines), "nonprivate/cosine.tsv")

    def _log_parameter_plot(self) -> None:
        from lightning_dp import tracking
        from lightning_dp.federated import reports

        tracking.log_figure(self.trainer, reports.parameter_figure(self._history, self.k), "federated/parameters.png")
