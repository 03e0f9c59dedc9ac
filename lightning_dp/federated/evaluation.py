"""The federated round's evaluation: held-out clients pick their best hypothesis; their losses, choices, accuracy
and group fairness are logged.

Apart from training because it touches no ledger and releases nothing: the sums a process (or a Flower node,
:mod:`lightning_dp.flower`) computes for disjoint sets of clients add up, and the round logs their ratios.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import Tensor

from lightning_dp.datamodules.federated import padded_sensitive
from lightning_dp.federated.local import client_outputs_and_losses, predictions
from lightning_dp.federated.streams import _VAL
from lightning_dp.privacy.noise import derive_generator

__all__ = ["evaluate", "evaluation_sums", "validate"]


def validate(rnd: Any) -> None:
    """A validation check: the validation clients, and the test clients with ``test_every_check``."""
    evaluate(rnd, "val", "val")
    if rnd.test_every_check:
        evaluate(rnd, "test", "test")


def evaluate(rnd: Any, split: str, stage: str) -> None:
    """Each evaluated client picks its best hypothesis; log the loss, choices, accuracy and group fairness.

    ``{stage}/loss`` is the mean over clients of the chosen hypothesis' loss. For a
    classification DataModule, ``{stage}/acc`` is the accuracy over all evaluated
    samples of their client's chosen hypothesis (the personalized model; with k = 1
    the global model). When the labels are binary and the clients carry sensitive
    groups (:attr:`FederatedDataModule.num_groups`), every output of
    :class:`~lightning_dp.metrics.GroupFairness` on those predictions is logged as
    ``{stage}/fairness/<name>`` (e.g. ``test/fairness/equalized_odds_difference``).
    """
    side = rnd.clients
    clients = side.splits[split]
    if not clients:
        return
    index = list(range(len(clients)))
    # only validation checks subsample; ``test`` (even on validation clients) evaluates every client
    per_check = rnd.val_clients_per_check
    if stage == "val" and per_check is not None and per_check < len(clients):
        g = derive_generator(rnd.seed, _VAL, int(rnd.rounds))
        index = torch.randperm(len(clients), generator=g)[:per_check].tolist()
    fairness = None
    if side.num_groups is not None:
        from lightning_dp.metrics import GroupFairness

        fairness = GroupFairness(side.num_groups).to(rnd.hypotheses.device)
    if side.remote is not None:  # the server of a deployment: the clients evaluate on their nodes (and send their
        sums = side.remote.evaluate(rnd, split, index, fairness)  # per-group confusion counts, which add up)
    else:
        sums = rnd.evaluation_sums(split, side.shard(index), fairness)
        if rnd.trainer.world_size > 1:  # identical on every process afterwards
            torch.distributed.all_reduce(sums)
    sync = rnd.trainer.world_size > 1  # equal values on every process: sync_dist averages them
    count = sums[1].clamp_min(1)
    rnd.log(f"{stage}/loss", sums[0] / count, batch_size=1, sync_dist=sync)
    for j in range(rnd.k):
        rnd.log(f"{stage}/chose_{j}", sums[4 + j] / count, batch_size=1, sync_dist=sync)
    if side.classification:
        rnd.log(f"{stage}/acc", sums[2] / sums[3].clamp_min(1), batch_size=1, sync_dist=sync)
    if fairness is not None:  # compute() sums the per-group counts over processes
        values = fairness.compute()
        # its overall accuracy is {stage}/acc (same predictions); NaN rates (absent groups) are not logged
        rnd.log_dict({f"{stage}/fairness/{name}": value.double() for name, value in values.items()
                      if name != "accuracy" and torch.isfinite(value)}, batch_size=1, sync_dist=sync)


def evaluation_sums(rnd: Any, split: str, mine: list[int], fairness: Any = None) -> Tensor:
    """What the logged evaluation is made of (:meth:`FederatedRound.evaluation_sums`)."""
    side, k = rnd.clients, rnd.k
    sums = torch.zeros(4 + k, dtype=torch.float64, device=rnd.hypotheses.device)
    if not mine:
        return sums
    x, y, mask = side.padded(split, mine)
    outputs, losses = client_outputs_and_losses(rnd.template, rnd.spec, rnd.hypotheses, x, y, mask,
                                                rnd.loss_name, side.forward_engine())
    choice = losses.argmin(dim=1)
    sums[0], sums[1] = losses.min(dim=1).values.double().sum(), float(len(mine))
    sums[4:] = torch.bincount(choice, minlength=k).double()
    if side.classification:
        chosen = outputs[torch.arange(len(mine), device=choice.device), choice]  # (C, Nmax, ...)
        preds = predictions(chosen.flatten(0, 1), rnd.loss_name).view(mask.shape)
        sums[2], sums[3] = ((preds == y.long()) & mask).sum().double(), mask.sum().double()
        if fairness is not None:
            groups = padded_sensitive([side.splits[split][i] for i in mine])
            if groups is None:
                raise MisconfigurationException(
                    f"the DataModule declares num_groups={side.num_groups} but some {split} clients have "
                    "no sensitive ids (ClientDataset.sensitive)")
            fairness.update(preds[mask], y[mask].long(), groups.to(mask.device)[mask])
    return sums
