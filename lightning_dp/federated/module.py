"""The federated round as a LightningModule: personalized FL with metric privacy.

Galli et al., "Group privacy for personalized federated learning" (Algorithms 1 and 2) and
thesis chapter 2. One training step is one round:

1. sample U training clients without replacement (a client whose next participation would
   exceed ``client_privacy_cap`` declines and is replaced, or skipped: ``cap_policy``);
2. every sampled client evaluates the k hypotheses on its own data and takes the argmin of
   the loss, then runs E epochs of SGD (rate s, batch size B_s) from it
   (:mod:`lightning_dp.federated.local`, vectorized over clients);
3. every client sanitizes its model: ``delta = theta_client - theta_j``,
   ``epsilon = n / (nu ||delta||)``, ``released = theta_client + EuclideanLaplace(n, epsilon)``
   (per layer with ``per_layer=True``), and the per-client ledger is charged n/nu
   (:mod:`lightning_dp.privacy.mechanisms`, :mod:`lightning_dp.privacy.ledger`);
4. the server sees only the releases; k-means initialized at the hypotheses, each
   hypothesis becomes the mean of its cluster, an empty cluster keeps its hypothesis
   (:mod:`lightning_dp.federated.aggregation`).

Validation clients are held out from training; each picks its best hypothesis and
``val/loss`` is the mean of those best losses (monitor it with Lightning's
``EarlyStopping``; validation runs every ``check_val_every_n_epoch`` rounds). Each round is
one optimizer step for Lightning (``global_step``, ``max_steps`` and ``ModelCheckpoint``
count rounds). The clients
come from a :class:`~lightning_dp.datamodules.federated.FederatedDataModule`, whose loaders
yield one item per round (one training epoch = one round: ``max_epochs`` is the number of
rounds).

Every random draw comes from a generator derived from ``(seed, stream, round, ...)``; a
client's shuffles and noise depend on its index, not on the other clients of its process
(:meth:`_shuffle_keys`); with the round counter and the ledger in the checkpoint, a resumed
run equals the uninterrupted one. Two seeds: ``seed`` drives what is public (initialization,
client sampling, which the ledger does not count as amplification, local shuffles, the
validation subsample) and is logged; ``noise_seed`` drives the sanitizers' noise and is a
secret (:mod:`lightning_dp.privacy.seeds`): fresh from the OS by default, kept in local
checkpoints under ``"secret"``, never logged nor uploaded.

Under DDP (``strategy="ddp"``) every process samples the same clients, trains and sanitizes
its share of them (positions rank, rank + W, ...), and the releases are all-gathered in the
round's order; every process then runs the same k-means and charges the same ledger, so a
run on W processes equals the run on one (tests/federated/test_module_ddp.py). Validation
clients are sharded the same way.
"""

from __future__ import annotations

import copy
import math
from typing import Any, Literal

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import Tensor, nn

from lightning_dp.datamodules.federated import padded_sensitive
from lightning_dp.federated.aggregation import kmeans_aggregate
from lightning_dp.federated.local import (
    FlatParams,
    check_loss,
    choose_hypotheses,
    client_losses,
    client_outputs_and_losses,
    local_sgd,
    local_sgd_loop,
    predictions,
)
from lightning_dp.privacy.ledger import PrivacyLedger
from lightning_dp.privacy.mechanisms import sanitize_update
from lightning_dp.privacy.noise import derive_generator
from lightning_dp.privacy.seeds import SECRET_KEY, check_seed, fresh_seed

__all__ = ["PersonalizedFederatedModule"]

# streams of derive_generator
_CLIENTS, _LOCAL, _NOISE, _INIT, _VAL = 11, 12, 13, 14, 15
#: models with more parameters than this train their clients one by one ("auto" engine):
#: vmap over clients turns convolutions into grouped ones, slower than a loop on CPU
#: (benchmarks/bench_federated_round.py: 30x faster for 11 parameters, 4x slower for 1.4 M).
AUTO_VMAP_MAX_PARAMETERS = 100_000


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} is not allowed: pass a positive integer")
    return value


class _RoundOptimizer(torch.optim.Optimizer):
    """Runs the closure it is given: the round's aggregation, counted by Lightning as a step."""

    def __init__(self, params: list[Tensor]) -> None:
        super().__init__(params, {})

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        return closure() if closure is not None else None


class PersonalizedFederatedModule(LightningModule):
    """IFCA-style personalized federated learning with Euclidean d-privacy (see the module docstring).

    Args:
        model: the network template; k hypotheses of its shape are trained.
        num_hypotheses: k.
        clients_per_round: U, sampled without replacement among the training clients.
        local_epochs: E.
        local_lr: s.
        local_batch_size: B_s.
        noise_multiplier: nu; 0 releases the clients' models unsanitized (non-private baseline).
        loss: ``"rmse"`` (regression; on class scores, the root Brier score),
            ``"cross_entropy"`` (logits of C classes) or ``"binary_cross_entropy"`` (one
            logit per example, labels in {0, 1}); see :func:`~lightning_dp.federated.local.masked_loss`.
        per_layer: sanitize each parameter tensor with its own epsilon (n_l, delta_l).
        client_privacy_cap: a client whose spend would exceed this declines to participate.
        cap_policy: ``"replace"`` (declined clients are replaced by eligible ones) or
            ``"skip"`` (the round runs with fewer clients).
        val_clients_per_check: evaluate a random sample of this many validation clients
            per check (default: all).
        client_engine: ``"vmap"`` (all clients at once), ``"loop"`` (one by one) or ``"auto"``.
        min_delta_norm: the noise is calibrated to ``max(||delta||, min_delta_norm)``: a client
            whose update is (numerically) zero still releases noise of mean norm
            ``nu * min_delta_norm``, for the same cost n/nu over a neighbourhood at least as
            large (see :func:`~lightning_dp.privacy.mechanisms.sanitize_update`).
        seed: seed of the public streams (initialization, client sampling, local
            shuffles, validation subsample); default: a fresh random seed. Logged.
        noise_seed: seed of the sanitizers' noise, a secret: whoever knows it can subtract
            the noise from every release. Default: a fresh seed from the OS, kept in local
            checkpoints (a run resumed without ``noise_seed`` continues its streams) and never
            logged or uploaded. A given seed wins over a checkpoint's, so that runs branched
            from one checkpoint draw different noise. Fix it only for reproducible
            experiments whose releases stay private (``lightning-dp grid`` gives every run its own).
        log_nonprivate_metrics: log ``nonprivate/train_loss``, the mean over the round's
            clients of their chosen hypothesis' loss on their private data. The server never
            sees these losses in the protocol and the ledger does not cover them; set False
            to keep them off the record.
    """

    #: Constructor arguments that are secrets: redacted from configs logged by ``lightning-dp``.
    SECRET_ARGUMENTS: tuple[str, ...] = ("noise_seed",)

    def __init__(
        self,
        model: nn.Module,
        *,
        num_hypotheses: int = 2,
        clients_per_round: int = 10,
        local_epochs: int = 1,
        local_lr: float = 0.1,
        local_batch_size: int = 10,
        noise_multiplier: float = 0.0,
        loss: Literal["rmse", "cross_entropy", "binary_cross_entropy"] = "rmse",
        per_layer: bool = False,
        client_privacy_cap: float | None = None,
        cap_policy: Literal["replace", "skip"] = "replace",
        val_clients_per_check: int | None = None,
        client_engine: Literal["auto", "vmap", "loop"] = "auto",
        min_delta_norm: float = 1e-8,
        seed: int | None = None,
        noise_seed: int | None = None,
        log_nonprivate_metrics: bool = True,
    ) -> None:
        super().__init__()
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        self.k = _positive_int("num_hypotheses", num_hypotheses)
        self.clients_per_round = _positive_int("clients_per_round", clients_per_round)
        self.local_epochs = _positive_int("local_epochs", local_epochs)
        self.local_batch_size = _positive_int("local_batch_size", local_batch_size)
        if not (float(local_lr) > 0 and math.isfinite(float(local_lr))):
            raise ValueError(f"local_lr={local_lr!r} is not allowed: pass a finite learning rate > 0")
        self.local_lr = float(local_lr)
        if not (float(noise_multiplier) >= 0 and math.isfinite(float(noise_multiplier))):
            raise ValueError(f"noise_multiplier={noise_multiplier!r} is not allowed: nu must be >= 0 (0 = no "
                             "sanitization); the seed's experiments use 0.1 to 5")
        self.noise_multiplier = float(noise_multiplier)
        check_loss(loss)
        self.loss_name = loss
        self.per_layer = bool(per_layer)
        if client_privacy_cap is not None and not float(client_privacy_cap) > 0:
            raise ValueError(f"client_privacy_cap={client_privacy_cap!r} is not allowed: pass a number > 0 or None")
        if client_privacy_cap is not None and self.noise_multiplier == 0:
            raise ValueError("client_privacy_cap needs noise_multiplier > 0: without sanitization every "
                             "participation has an infinite cost")
        self.client_privacy_cap = None if client_privacy_cap is None else float(client_privacy_cap)
        if cap_policy not in ("replace", "skip"):
            raise ValueError(f"cap_policy={cap_policy!r} is not allowed; choose 'replace' or 'skip'")
        self.cap_policy = cap_policy
        self.val_clients_per_check = (None if val_clients_per_check is None
                                      else _positive_int("val_clients_per_check", val_clients_per_check))
        if client_engine not in ("auto", "vmap", "loop"):
            raise ValueError(f"client_engine={client_engine!r} is not allowed; choose 'auto', 'vmap' or 'loop'")
        if not (float(min_delta_norm) >= 0 and math.isfinite(float(min_delta_norm))):
            raise ValueError(f"min_delta_norm={min_delta_norm!r} is not allowed: pass a finite number >= 0")
        self.min_delta_norm = float(min_delta_norm)
        check_seed(seed)
        check_seed(noise_seed, "noise_seed")
        self.log_nonprivate_metrics = bool(log_nonprivate_metrics)
        self.save_hyperparameters(ignore=["model", "noise_seed"])  # the noise seed is a secret
        self.save_hyperparameters({"model_class": f"{type(model).__module__}.{type(model).__qualname__}"})

        self.template = model
        self.spec = FlatParams.of(model)
        self.engine = client_engine if client_engine != "auto" else (
            "vmap" if self.spec.numel <= AUTO_VMAP_MAX_PARAMETERS else "loop")
        self.seed = int(seed) if seed is not None else fresh_seed()
        self._noise_seed = int(noise_seed) if noise_seed is not None else fresh_seed()
        self._noise_seed_given = noise_seed is not None  # a given seed wins over a checkpoint's
        self.register_buffer("hypotheses", self._initial_hypotheses())
        # training progress, not model state: saved in checkpoint["federated"], so that restoring the
        # best weights (RestoreBestWeights, load_state_dict) does not rewind it
        self.register_buffer("rounds", torch.zeros((), dtype=torch.long), persistent=False)
        self.ledger = PrivacyLedger()
        self.automatic_optimization = False
        self._history: list[dict[str, Any]] = []

    # ----------------------------------------------------------------- set-up
    def _initial_hypotheses(self) -> Tensor:
        """k independent initializations of the template (its own ``reset_parameters``)."""
        rows = []
        for j in range(self.k):
            net = copy.deepcopy(self.template)
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(int(derive_generator(self.seed, _INIT, j).initial_seed()) % 2**63)
                for mod in net.modules():
                    if hasattr(mod, "reset_parameters"):
                        mod.reset_parameters()
            rows.append(self.spec.flatten(net))
        return torch.stack(rows)

    def setup(self, stage: str) -> None:
        from lightning_dp.datamodules.federated import FederatedDataModule

        dm = self.trainer.datamodule if self._trainer is not None else None
        if not isinstance(dm, FederatedDataModule):
            raise MisconfigurationException(
                "PersonalizedFederatedModule reads its clients from a FederatedDataModule (e.g. "
                "lightning_dp.datamodules.SyntheticLinearMixture): pass it as trainer.fit(module, datamodule=...).")
        self._clients = {"train": dm.train_clients, "val": dm.val_clients, "test": dm.test_clients}
        self._classification = dm.task == "classification"
        if self._classification and self.loss_name == "rmse" and dm.num_classes is not None and dm.num_classes < 2:
            raise MisconfigurationException(f"{type(dm).__name__} is a classification task with num_classes="
                                            f"{dm.num_classes}; the rmse loss needs class scores of >= 2 classes")
        # group fairness of the held-out clients' predictions: binary labels with sensitive groups
        self._num_groups = dm.num_groups if self._classification and dm.num_classes == 2 else None
        self._key_width = max((len(c) for c in dm.train_clients), default=1)
        if stage == "fit" and len(dm.train_clients) < self.clients_per_round:
            raise MisconfigurationException(
                f"clients_per_round={self.clients_per_round} exceeds the {len(dm.train_clients)} training clients; "
                "lower clients_per_round.")
        if self.per_layer and self.noise_multiplier == 0:
            rank_zero_warn("per_layer=True has no effect with noise_multiplier=0 (no sanitization)")
        if self.noise_multiplier > 0:
            from lightning_dp.tracking import refuse_checkpoint_uploads

            refuse_checkpoint_uploads(self.trainer, type(self).__name__)
        if self.trainer.world_size > 1:  # default seeds are drawn per process: every process must use rank 0's
            self.seed, self._noise_seed = (int(v) for v in self.trainer.strategy.broadcast((self.seed,
                                                                                           self._noise_seed)))

    def set_secret_seed(self, seed: int) -> None:
        """Replace the noise seed before ``fit`` (``lightning-dp grid`` does this, so that no two runs of a
        grid draw the same noise)."""
        self._noise_seed = check_seed(seed, optional=False)
        self._noise_seed_given = True

    def configure_optimizers(self) -> torch.optim.Optimizer:
        # local SGD and aggregation are the optimization; this optimizer only makes each round an
        # optimizer step for Lightning (global_step, ModelCheckpoint, max_steps count rounds)
        return _RoundOptimizer([self.hypotheses])

    # ------------------------------------------------------------------ round
    def _padded(self, split: str, index: list[int]):
        clients = [self._clients[split][i] for i in index]
        return self.trainer.datamodule.padded(clients)

    def participation_cost(self) -> float:
        """The d-privacy cost n/nu of one participation (per-layer: sum of n_l/nu, the same total)."""
        return math.inf if self.noise_multiplier == 0 else self.spec.numel / self.noise_multiplier

    def _sample_clients(self, r: int) -> tuple[list[int], int]:
        clients = self._clients["train"]
        order = torch.randperm(len(clients), generator=derive_generator(self.seed, _CLIENTS, r)).tolist()
        if self.client_privacy_cap is None:
            return order[: self.clients_per_round], 0
        cost = self.participation_cost()

        def eligible(i: int) -> bool:
            return not self.ledger.would_exceed(clients[i].client_id, cost, self.client_privacy_cap)

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

    def _train_clients(self, start: Tensor, x: Tensor, y: Tensor, mask: Tensor, r: int, index: list[int]) -> Tensor:
        fn = local_sgd if self.engine == "vmap" else local_sgd_loop
        return fn(self.template, self.spec, start, x, y, mask, epochs=self.local_epochs, lr=self.local_lr,
                  batch_size=self.local_batch_size, loss=self.loss_name, generator=self._shuffle_keys(r, index, mask))

    def _shuffle_keys(self, r: int, index: list[int], mask: Tensor) -> Any:
        """Local shuffles of round r as a pure function of (seed, round, epoch, client index).

        A client's training then does not depend on which other clients share its process
        (DDP shards) or its vmap call. One (clients x largest client) table of uniform keys
        per epoch, rows taken by client index: one generator call instead of one generator per
        client (derive_generator costs ~10 us, as much as a whole vectorized round of 100
        hospital clients). Above 16 M keys, one generator per client instead.
        """
        clients = self._clients["train"]
        width = self._key_width
        if len(clients) * width > 2**24:
            return [derive_generator(self.seed, _LOCAL, r, i, device=mask.device) for i in index]
        rows = torch.tensor(index, device=mask.device)

        def keys(epoch: int) -> Tensor:
            table = torch.rand((len(clients), width), device=mask.device,
                               generator=derive_generator(self.seed, _LOCAL, r, epoch, device=mask.device))
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

    def _client_round(self, index: list[int], r: int) -> tuple[Tensor, Tensor]:
        """Choice, local training and sanitization of this process's share of the round's clients.

        Returns ``(releases, stats)``: (m, P) released vectors and (m, 2) float64
        ``[loss of the chosen hypothesis, privacy cost]`` for the m clients of the shard.
        """
        hyps = self.hypotheses
        mine = self._shard(index)
        if not mine:
            return hyps.new_zeros((0, self.spec.numel)), torch.zeros((0, 2), dtype=torch.float64, device=hyps.device)
        x, y, mask = self._padded("train", mine)
        with torch.no_grad():
            losses = client_losses(self.template, self.spec, hyps, x, y, mask, self.loss_name)
        choice = choose_hypotheses(losses)
        start = hyps[choice]
        trained = self._train_clients(start, x, y, mask, r, mine)
        released, costs = [], []
        for c, i in enumerate(mine):
            out = sanitize_update(trained[c], start[c], noise_multiplier=self.noise_multiplier,
                                  generator=derive_generator(self._noise_seed, _NOISE, r, i, device=x.device),
                                  per_layer_sizes=self.spec.sizes if self.per_layer else None,
                                  min_delta_norm=self.min_delta_norm)
            released.append(out.released)
            costs.append(out.cost)
        chosen = losses.gather(1, choice[:, None]).squeeze(1).double()
        return torch.stack(released), torch.stack([chosen, chosen.new_tensor(costs)], dim=1)

    def training_step(self, batch: Any, batch_idx: int) -> None:
        r = int(self.rounds)
        index, declined = self._sample_clients(r)  # the same on every process (seeded by round)
        hyps = self.hypotheses
        metrics: dict[str, float] = {"round/participants": float(len(index)), "round/declined": float(declined)}
        if index:
            local_releases, local_stats = self._client_round(index, r)
            # the server's view: every release, in the round's client order, on every process
            releases = self._gather_rows(local_releases, len(index))
            stats = self._gather_rows(local_stats, len(index))
            if self.noise_multiplier > 0:  # nu = 0 is the non-private baseline: nothing to account
                for i, cost in zip(index, stats[:, 1].tolist()):
                    self.ledger.charge(self._clients["train"][i].client_id, cost)
            new, assignment = kmeans_aggregate(releases, hyps)
            self.optimizers().step(closure=lambda: self.hypotheses.copy_(new))
            sizes = torch.bincount(assignment, minlength=self.k)
            if self.log_nonprivate_metrics:  # the clients' private losses: not covered by the ledger
                metrics["nonprivate/train_loss"] = float(stats[:, 0].mean())
            for j in range(self.k):
                metrics[f"round/cluster_size_{j}"] = float(sizes[j])
            if self.spec.numel <= 2:
                self._history.append({"round": r, "releases": releases.detach().cpu().clone(),
                                      "hypotheses": new.detach().cpu().clone()})
        else:
            self.optimizers().step(closure=lambda: None)  # a round without participants is still a round
        if len(self.ledger):
            metrics["privacy/client_epsilon_median"] = self.ledger.median()
            metrics["privacy/client_epsilon_max"] = self.ledger.max()
        self.rounds += 1
        self.log_dict(metrics, on_step=True, on_epoch=False, batch_size=1)

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
        mine = self._shard(index)
        fairness = None
        if self._num_groups is not None:
            from lightning_dp.metrics import GroupFairness

            fairness = GroupFairness(self._num_groups).to(self.hypotheses.device)
        if mine:
            x, y, mask = self._padded(split, mine)
            outputs, losses = client_outputs_and_losses(self.template, self.spec, self.hypotheses, x, y, mask,
                                                        self.loss_name)
            choice = losses.argmin(dim=1)
            columns = [losses.min(dim=1).values.double(), choice.double()]
            if self._classification:
                chosen = outputs[torch.arange(len(mine), device=choice.device), choice]  # (C, Nmax, ...)
                preds = predictions(chosen.flatten(0, 1), self.loss_name).view(mask.shape)
                columns += [((preds == y.long()) & mask).sum(1).double(), mask.sum(1).double()]
                if fairness is not None:
                    groups = padded_sensitive([self._clients[split][i] for i in mine])
                    if groups is None:
                        raise MisconfigurationException(
                            f"the DataModule declares num_groups={self._num_groups} but some {split} clients have "
                            "no sensitive ids (ClientDataset.sensitive)")
                    fairness.update(preds[mask], y[mask].long(), groups.to(mask.device)[mask])
            local = torch.stack(columns, dim=1)
        else:
            local = torch.zeros((0, 4 if self._classification else 2), dtype=torch.float64,
                                device=self.hypotheses.device)
        rows = self._gather_rows(local, len(index))  # every evaluated client, on every process
        best, choice = rows[:, 0], rows[:, 1].long()
        # identical on every process (computed from the gathered rows): sync_dist averages equal values
        sync = self.trainer.world_size > 1
        self.log(f"{stage}/loss", best.mean(), batch_size=1, sync_dist=sync)
        for j in range(self.k):
            self.log(f"{stage}/chose_{j}", (choice == j).double().mean(), batch_size=1, sync_dist=sync)
        if self._classification:
            self.log(f"{stage}/acc", rows[:, 2].sum() / rows[:, 3].sum().clamp_min(1), batch_size=1, sync_dist=sync)
        if fairness is not None:  # compute() sums the per-group counts over processes
            values = fairness.compute()
            # its overall accuracy is {stage}/acc (same predictions); NaN rates (absent groups) are not logged
            self.log_dict({f"{stage}/fairness/{name}": value.double() for name, value in values.items()
                           if name != "accuracy" and torch.isfinite(value)}, batch_size=1, sync_dist=sync)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self._evaluate("val", "val")

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self._evaluate("test" if self._clients["test"] else "val", "test")

    # -------------------------------------------------------------- checkpoint
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["federated"] = {"ledger": self.ledger.state_dict(), "seed": self.seed, "rounds": int(self.rounds),
                                   SECRET_KEY: {"noise_seed": self._noise_seed}, "version": 3}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        state = checkpoint.get("federated")
        if state is not None:
            self.ledger.load_state_dict(state["ledger"])
            self.seed = int(state["seed"])
            self.rounds.fill_(int(state["rounds"]))
            if self._noise_seed_given:
                pass  # runs branched from one checkpoint (a grid) must not continue the same noise
            elif SECRET_KEY in state:
                self._noise_seed = int(state[SECRET_KEY]["noise_seed"])
            else:
                # a public checkpoint, or one from before version 3, whose noise came from the logged (public) seed:
                # the resumed rounds draw from the fresh secret seed of __init__
                rank_zero_warn("the checkpoint holds no secret noise seed (a public checkpoint, or one written before "
                               "lightning-dp kept the noise seed apart from the logged seed); the resumed run draws its "
                               "noise from a fresh secret seed.")

    def on_train_end(self) -> None:
        if self.trainer.is_global_zero and len(self.ledger):
            self._log_ledger_artifacts()
            if self._history:
                self._log_parameter_plot()

    # ------------------------------------------------------------------ plots
    def _log_ledger_artifacts(self) -> None:
        from matplotlib.figure import Figure

        from lightning_dp import tracking

        spend = self.ledger.as_dict()
        values = list(spend.values())
        fig = Figure(figsize=(6, 4))
        ax = fig.subplots()
        ax.hist(values, bins=min(30, max(5, len(set(values)))))
        ax.set_xlabel("client epsilon spent (d-privacy, per ||delta||-neighbourhood)")
        ax.set_ylabel("clients")
        ax.set_title(f"privacy spend per client, nu={self.noise_multiplier:g}, n={self.spec.numel}")
        tracking.log_figure(self.trainer, fig, "privacy/client_epsilon_hist.png")
        table = (f"clients\t{len(values)}\nmedian\t{self.ledger.median():.6g}\nmax\t{self.ledger.max():.6g}\n"
                 f"cost_per_participation\t{self.participation_cost():.6g}\n")
        tracking.log_text(self.trainer, table, "privacy/client_epsilon.tsv")

    def _log_parameter_plot(self) -> None:
        from matplotlib.figure import Figure

        from lightning_dp import tracking

        fig = Figure(figsize=(6, 5))
        ax = fig.subplots()
        for h in self._history:
            r = h["releases"]
            ax.scatter(r[:, 0], r[:, 1], s=6, alpha=0.25, color="tab:gray")
        path = torch.stack([h["hypotheses"] for h in self._history])  # (rounds, k, 2)
        for j in range(self.k):
            ax.plot(path[:, j, 0], path[:, j, 1], marker=".", label=f"hypothesis {j}")
        ax.set_xlabel("theta[0]")
        ax.set_ylabel("theta[1]")
        ax.legend()
        ax.set_title("released parameters (grey) and hypotheses per round")
        tracking.log_figure(self.trainer, fig, "federated/parameters.png")
