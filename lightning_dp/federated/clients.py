"""The clients' side of a federated round: who takes part, and what each participant computes and releases.

Everything here happens before the server sees anything: the selection draw, each client's choice of hypothesis, its
local training, its sanitized release and its statistics, this process's share of the clients under DDP and the
gathering of the shares in the round's order. :class:`RoundClients` reads the round's parts, hypotheses and seeds from
the round (:class:`~lightning_dp.federated.round.FederatedRound`) and holds the clients' data; a Flower deployment
replaces the local computation by its nodes' (:attr:`RoundClients.remote`). What the server makes of the releases is
:mod:`lightning_dp.federated.step`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import Tensor

from lightning_dp.datamodules.federated import ClientDataset, ClientPopulation, client_ids, client_sizes
from lightning_dp.federated.dense import CANCELLATION_LIMIT
from lightning_dp.federated.local import assigned_hypotheses, choose_hypotheses, client_losses
from lightning_dp.federated.streams import _CLIENTS, _DIAGNOSTICS, _LOCAL, _LOCAL_NOISE, _NOISE
from lightning_dp.privacy.finite import drop_non_finite
from lightning_dp.privacy.noise import counter_uniform, derive_generator, derive_secret_generator

__all__ = ["STATS", "SUM_BLOCK_ENTRIES", "RoundClients"]

#: releases (entries) a process holds at a time when the server's input is a sum (:meth:`RoundClients.summed_round`):
#: the blocks whose sums add up, as large as :func:`~lightning_dp.federated.local.row_blocks`' default
SUM_BLOCK_ENTRIES = 2**22
#: the columns of a round's per-client statistics (float64; NaN: not reported): the loss of the chosen hypothesis,
#: the participation's cost, the number of examples, whether the update was within the clip (a bit), and whether
#: it was dropped as not finite (a bit; :func:`~lightning_dp.privacy.finite.drop_non_finite`)
STATS = ("loss", "cost", "count", "unclipped", "dropped")


def _same_owner(part: Any, gate: str, bypassed: str) -> bool:
    """Whether ``part``'s method ``gate`` (which lets the fused round skip ``bypassed``) comes from the class that
    defines the ``bypassed`` method it runs: a subclass that overrides ``bypassed`` alone (a sanitizer's releases
    changed, weight decay in a client's training, another partial sum) inherits a gate written for its parent's
    method, which the fused round would then skip silently."""
    def owner(name: str) -> type | None:
        return next((c for c in type(part).__mro__ if name in vars(c)), None)

    return owner(gate) is owner(bypassed)


class RoundClients:
    """The clients of one round (module docstring): their data, their draws, their training and releases.

    Args:
        round: the :class:`~lightning_dp.federated.round.FederatedRound` whose clients these are.
    """

    def __init__(self, round: Any) -> None:
        self.round = round
        #: the clients' side of a Flower deployment (:class:`lightning_dp.flower.server.NodeRound`), None in simulation
        self.remote: Any = None
        self.splits: dict[str, Sequence[ClientDataset]] = {"train": [], "val": [], "test": []}
        self.key_width = 1  # the local shuffles' key table's width (the largest training client)
        self.key_tables: dict[int, Tensor] | None = None  # a round's shuffle tables by epoch, while it trains blocks
        self.data: Any = None
        self.classification = False
        self.num_groups: int | None = None

    # ----------------------------------------------------------------- data
    def read(self, dm: Any) -> None:
        """Take the clients and the task from a set-up :class:`~lightning_dp.datamodules.federated.FederatedDataModule`
        (:meth:`FederatedRound.read_clients`)."""
        self.data = dm
        self.splits = {"train": dm.train_clients or [], "val": dm.val_clients or [], "test": dm.test_clients or []}
        self.classification = dm.task == "classification"
        if self.classification and self.round.loss_name == "rmse" and dm.num_classes is not None and dm.num_classes < 2:
            raise MisconfigurationException(f"{type(dm).__name__} is a classification task with num_classes="
                                            f"{dm.num_classes}; the rmse loss needs class scores of >= 2 classes")
        # group fairness of the held-out clients' predictions: binary labels with sensitive groups
        self.num_groups = dm.num_groups if self.classification and dm.num_classes == 2 else None
        sizes = client_sizes(self.splits["train"])  # a population's stored sizes: no client is built
        self.key_width = int(sizes.max()) if len(sizes) else 1

    def padded(self, split: str, index: list[int]) -> tuple[Tensor, Tensor, Tensor]:
        """The padded data of the clients at positions ``index`` of ``split`` on the hypotheses' device (the
        DataModule holds its clients on the CPU; a GPU round trains and evaluates them there)."""
        device = self.round.hypotheses.device
        return tuple(t.to(device, non_blocking=True) for t in self.data.padded_rows(split, index))

    def forward_engine(self) -> str:
        """How the hypotheses' losses on the clients are computed: ``vmap`` over clients for small models, a loop
        above ``AUTO_VMAP_MAX_PARAMETERS`` (grouped convolutions are slower on CPU). On a GPU too: vmap's forward
        holds every evaluated client's whole data's activations at once (100 CIFAR CNN clients of 455 images:
        22 GiB against 0.2 GiB in the loop on an H200), where training holds one batch per client."""
        from lightning_dp.federated.parts.update import auto_engine

        return auto_engine(self.round.spec.numel)

    def choices(self) -> Tensor | None:
        """The public hypotheses a client chooses its start among on its data (None for one hypothesis)."""
        return self.round.hypotheses.detach() if self.round.k > 1 else None

    def participation_cost(self) -> float:
        """The sanitizer's cost of one participation from the current hypotheses
        (:meth:`FederatedRound.participation_cost`)."""
        return self.round.sanitizer.participation_cost(self.round.spec.numel, self.choices())

    # ----------------------------------------------------------------- draws
    def sample(self, r: int) -> tuple[list[int], int]:
        """Round ``r``'s participants (positions among the training clients) and the number that declined."""
        rnd = self.round
        clients = self.splits["train"]
        eligible = None
        cap = rnd.client_privacy_cap
        if cap is not None:
            cost = rnd.participation_cost()

            def eligible(i: int) -> bool:
                return (not rnd.ledger.would_exceed(client_ids(clients, [i])[0], cost, cap)
                        and rnd.update.eligible(i))
        elif rnd.update.accountable:
            eligible = rnd.update.eligible

        present = self.remote.present(rnd) if self.remote is not None else None
        if present is not None:  # a Flower deployment whose nodes have not all joined: their clients decline
            inner = eligible
            eligible = present if inner is None else (lambda i: present(i) and inner(i))
        # secret: the client-level accountant amplifies by this draw (ClientSelection.draw refuses a public generator)
        return rnd.selection.draw(len(clients), derive_secret_generator(rnd._noise_seed, _CLIENTS, r), eligible)

    def shuffle_keys(self, r: int, index: list[int], mask: Tensor) -> Any:
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
        clients = self.splits["train"]
        width = self.key_width
        seed = self.round.seed
        rows = torch.tensor(index, device=mask.device)
        if isinstance(clients, ClientPopulation) or len(clients) * width > 2**24:
            positions = torch.arange(mask.shape[1], device=mask.device)

            def hashed(epoch: int) -> Tensor:
                return counter_uniform(seed, _LOCAL, r, epoch, rows[:, None], positions[None]).float()

            return hashed

        def keys(epoch: int) -> Tensor:
            cache = self.key_tables  # the round's blocks share its tables (summed_round)
            table = None if cache is None else cache.get(epoch)
            if table is None:
                table = torch.rand((len(clients), width), device=mask.device,
                                   generator=derive_generator(seed, _LOCAL, r, epoch, device=mask.device))
                if cache is not None:
                    if (len(cache) + 1) * table.numel() > 2**24:  # at most 2^24 keys held: then the latest only
                        cache.clear()
                    cache[epoch] = table
            return table[rows, : mask.shape[1]]

        return keys

    # ------------------------------------------------------------------- DDP
    def shard(self, index: list[int]) -> list[int]:
        """This process's share of a list of clients: positions rank, rank + W, rank + 2W, ..."""
        trainer = self.round.trainer
        return index[trainer.global_rank::trainer.world_size]

    def gather_rows(self, rows: Tensor, total: int) -> Tensor:
        """Every process's ``rows`` (one per client of its :meth:`shard`) back in the list's order, on all ranks."""
        world = self.round.trainer.world_size
        if world == 1:
            return rows
        per_rank = -(-total // world)
        padded = rows.new_zeros((per_rank, *rows.shape[1:]))
        padded[: rows.shape[0]] = rows
        parts = [torch.empty_like(padded) for _ in range(world)]
        torch.distributed.all_gather(parts, padded.contiguous())
        gathered = torch.stack(parts)  # (world, per_rank, ...)
        return gathered.transpose(0, 1).reshape(per_rank * world, *rows.shape[1:])[:total]

    # ----------------------------------------------------------------- rounds
    def empty(self) -> tuple[Tensor, Tensor, Tensor | None]:
        """No releases: (0, P) releases, (0, 5) statistics, and (0, 2P) diagnostic rows with ``diagnostics``."""
        hyps, numel = self.round.hypotheses, self.round.spec.numel
        return (hyps.new_zeros((0, numel)), torch.zeros((0, len(STATS)), dtype=torch.float64, device=hyps.device),
                hyps.new_zeros((0, 2 * numel)) if self.round.diagnostics else None)

    def client_round(self, index: list[int], r: int) -> tuple[Tensor, Tensor, Tensor | None]:
        """Choice, local training and sanitization of this process's share of the round's clients.

        Returns ``(releases, stats, diagnostics)``: (m, P) released vectors and (m, 5) float64 :data:`STATS`
        ``[loss of the chosen hypothesis, privacy cost, number of examples, unclipped bit, dropped bit]`` (NaN: not
        reported) for the m clients of the shard;
        with ``diagnostics``, also (m, 2P) rows ``[update, per-sample gradient of one random example]``.
        """
        if self.remote is not None:  # the server of a deployment: the clients compute on their nodes
            return self.remote.client_round(self.round, index, r)
        mine = self.shard(index)
        if not mine:
            return self.empty()
        x, y, mask = self.padded("train", mine)
        return self.round.train_clients(mine, r, x, y, mask)

    def train(self, mine: list[int], r: int, x: Tensor, y: Tensor,
              mask: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
        """What the training clients at positions ``mine`` compute in round ``r``
        (:meth:`FederatedRound.train_clients`)."""
        rnd = self.round
        losses, choice, start = self.starting_points(mine, r, x, y, mask)
        trained = rnd.update.train(
            rnd.template, rnd.spec, start, x, y, mask, loss=rnd.loss_name, shuffles=self.shuffle_keys(r, mine, mask),
            clients=mine, noise=lambda i: derive_secret_generator(rnd._noise_seed, _LOCAL_NOISE, r, i, device=x.device))
        # a client whose update is not finite (broken data, a diverged training) contributes a zero update: it is
        # still sanitized, released and charged as planned (a NaN release, or a stop, would tell its data apart)
        trained, dropped = drop_non_finite(trained, start)
        # one copy per hypothesis (not per client, not a view of the buffer the round overwrites afterwards)
        references = [step.clone() if bool(step.norm() > 0) else None for step in rnd.previous_step]
        released, costs, bits = rnd.sanitizer.sanitize_rows(
            trained, start, layer_sizes=rnd.spec.sizes, references=references, choice=choice,
            hypotheses=self.choices(),
            generator_of=lambda c: derive_secret_generator(rnd._noise_seed, _NOISE, r, mine[c], device=x.device))
        stats = self.stats(losses, choice, costs, mask, bits, dropped)
        return released, stats, self.diagnostic_rows(mine, r, start, trained, x, y, mask)

    def starting_points(self, mine: list[int], r: int, x: Tensor, y: Tensor,
                        mask: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``(losses (m, k), choice (m,), start (m, P))`` of the training clients at positions ``mine`` in round
        ``r``: every hypothesis' loss on each client's data (NaN where there is nothing to choose nor to log), the
        hypothesis each starts from, and its parameters (for one hypothesis a view, not m copies of the model)."""
        rnd = self.round
        hyps, k = rnd.hypotheses, rnd.k
        warm = k > 1 and r < rnd.warm_start_rounds
        if (k == 1 or warm) and not rnd.log_nonprivate_metrics:  # nothing to choose, no loss to log
            losses = torch.full((len(mine), k), float("nan"), device=hyps.device)
        else:
            with torch.no_grad():
                losses = client_losses(rnd.template, rnd.spec, hyps, x, y, mask, rnd.loss_name, self.forward_engine())
        if warm:  # public: the client's id and the public seed, no data (nonprivate/train_loss: the assigned one's)
            choice = assigned_hypotheses(rnd.seed, client_ids(self.splits["train"], mine), k).to(hyps.device)
        else:
            choice = choose_hypotheses(losses)
        # one hypothesis: a view, not m copies of the model (m x P floats are the round's memory traffic)
        start = hyps[choice] if k > 1 else hyps[0].expand(len(mine), -1)
        return losses, choice, start

    @staticmethod
    def stats(losses: Tensor, choice: Tensor, costs: Tensor, mask: Tensor, bits: Tensor, dropped: Tensor) -> Tensor:
        """The clients' (m, 5) float64 :data:`STATS` rows."""
        chosen = losses.gather(1, choice[:, None]).squeeze(1).double()
        return torch.stack([chosen, costs.to(chosen.device), mask.sum(1).double(), bits.to(chosen.device),
                            dropped.to(chosen.device, torch.float64)], dim=1)

    def diagnostic_rows(self, mine: list[int], r: int, start: Tensor, trained: Tensor, x: Tensor, y: Tensor,
                        mask: Tensor) -> Tensor | None:
        """(m, 2P) ``[update, per-sample gradient]`` of the shard's clients (None without diagnostics)."""
        rnd = self.round
        if not rnd.diagnostics:
            return None
        from lightning_dp.federated.diagnostics import per_sample_gradients

        counts = mask.sum(1)
        pick = torch.stack([torch.randint(int(n), (), generator=derive_generator(rnd.seed, _DIAGNOSTICS, r, i))
                            for i, n in zip(mine, counts.tolist())]).to(x.device)
        rows = torch.arange(len(mine), device=x.device)
        grads = per_sample_gradients(rnd.template, rnd.spec, start, x[rows, pick], y[rows, pick], rnd.loss_name)
        return torch.cat([trained - start, grads.to(start.dtype)], dim=1).detach()

    def summed_round(self, index: list[int], r: int) -> tuple[Tensor, Tensor, Tensor]:
        """``(stats (m, 5), norms (m,), sum (P,))`` of this process's clients, trained and summed a block at a time.

        A block is :func:`~lightning_dp.federated.local.row_blocks`' (2^22 entries of releases): one block when the
        round's releases fit, so that a small round computes exactly what summing the held releases computes; a
        round of 1,000 CNN clients holds two of their models at a time instead of 1,000. The sums of the blocks
        add up in order (on one process, the same additions as the held releases' sum)."""
        hyps = self.round.hypotheses
        glob = hyps[0]
        total = torch.zeros_like(glob)
        mine = self.shard(index)
        stats = [torch.zeros((0, len(STATS)), dtype=torch.float64, device=hyps.device)]
        norms = [torch.zeros(0, dtype=torch.float64, device=hyps.device)]
        per = max(1, SUM_BLOCK_ENTRIES // self.round.spec.numel)
        self.key_tables = {} if len(mine) > per else None
        try:
            for start in range(0, len(mine), per):
                block = mine[start:start + per]
                x, y, mask = self.padded("train", block)
                block_stats, block_norms, partial = self.summed_block(block, r, x, y, mask, glob)
                total += partial
                stats.append(block_stats)
                norms.append(block_norms)
                del x, y, mask
        finally:
            self.key_tables = None
        return torch.cat(stats), torch.cat(norms), total

    def summed_block(self, mine: list[int], r: int, x: Tensor, y: Tensor, mask: Tensor,
                     origin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``(stats (m, 5), norms (m,), sum (P,))`` of one block of clients (padded data ``x, y, mask``) around the
        round's hypothesis ``origin``: :meth:`fused_block` where it applies, else their releases
        (:meth:`FederatedRound.train_clients`) read by the server's :meth:`~lightning_dp.federated.parts.
        ServerPrivacy.partial_sum`."""
        fused = self.fused_block(mine, r, x, y, mask, origin)
        if fused is not None:
            return fused
        released, stats, _ = self.round.train_clients(mine, r, x, y, mask)
        norms, partial = self.round.server_privacy.partial_sum(released, origin)
        return stats, norms, partial

    def fused_block(self, mine: list[int], r: int, x: Tensor, y: Tensor, mask: Tensor,
                    origin: Tensor) -> tuple[Tensor, Tensor, Tensor] | None:
        """What :meth:`summed_block` returns, computed without the (m, P) models, or None where this does not apply.

        It applies when the update is one SGD step of the dense engine from the round's one hypothesis
        (:meth:`~lightning_dp.federated.parts.ClientUpdate.one_step`: local epochs 1, every client's examples in one
        batch), the sanitizer releases the trained models unchanged
        (:meth:`~lightning_dp.federated.parts.ClientSanitizer.unchanged_releases`) and the server's partial sum
        weighs each update by a function of its norm (:meth:`~lightning_dp.federated.parts.ServerPrivacy.
        sum_weights`: DP-FedAvg's clipping): each client's step is then held as its factors
        (:class:`~lightning_dp.federated.dense.DenseSteps`), its float64 norm comes from b x b Gram matrices and the
        block's clipped sum is one product over all the examples. The same law as the releases' path: the same
        clients (the draws are the round's), the same norms, clip factors and sum up to float rounding (the steps are
        not rounded onto the models: more exact, not less), the same statistics; a client whose update is not
        finite is dropped the same way (norm 0, no contribution, its bit set; :class:`~lightning_dp.federated.dense.
        DenseSteps.norms` says why exactly the same clients). The local shuffle is not drawn: it orders the one
        batch's examples, which the step sums over. A block whose steps could overflow the models' float range takes
        the releases' path. Measured: docs/benchmarks.md, "Issue 53 (the population round".
        """
        rnd = self.round
        if rnd.k != 1 or not all(_same_owner(part, gate, bypassed) for part, gate, bypassed in (
                (rnd.sanitizer, "unchanged_releases", "sanitize_rows"), (rnd.update, "one_step", "train"),
                (rnd.server_privacy, "sum_weights", "partial_sum"))):
            return None
        marks = rnd.sanitizer.unchanged_releases(len(mine))
        if marks is None or rnd.server_privacy.sum_weights(origin.new_zeros(0, dtype=torch.float64)) is None:
            return None
        steps = rnd.update.one_step(rnd.template, rnd.spec, origin.expand(len(mine), -1), x, y, mask,
                                    loss=rnd.loss_name)
        if steps is None:
            return None
        norms, bounds, sizes, total = steps.clipped(rnd.server_privacy.sum_weights)
        if not steps.within_limit(bounds, origin):
            return None
        dropped = ~norms.isfinite()
        if origin.dtype != torch.float32 and bool(dropped.any()) and bool(steps.finite_factors(dropped).any()):
            # from float64 factors a norm's float64 squares can overflow where the step itself is finite (an input
            # of 1e160): the releases' path clips that step; from float32 factors a norm is not finite exactly where
            # a factor, and so the step, is not (DenseSteps.norms)
            return None
        if steps.cancellation(norms, sizes) > CANCELLATION_LIMIT:
            # a client's terms cancel to a step far smaller than they are: its influence would be their rounding
            # (DenseSteps.clipped); the releases' path clips the step as written
            return None
        norms = norms.masked_fill(dropped, 0.0)  # a dropped client's update is zero: norm 0, and it adds nothing
        partial = total.to(origin.dtype)
        losses, choice, _ = self.starting_points(mine, r, x, y, mask)
        costs, bits = marks
        return self.stats(losses, choice, costs, mask, bits, dropped), norms, partial
