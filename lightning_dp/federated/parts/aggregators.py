"""Aggregators: how the server turns the round's releases into the next hypotheses."""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_dp.federated.kmeans import kmeans_aggregate
from lightning_dp.federated.local import row_norms
from lightning_dp.federated.parts.registry import Combination, Part, register_part

__all__ = ["Aggregator", "FedAvg", "KMeans", "PFA"]


class Aggregator(Part):
    """Combines the releases ``(U, P)`` of a round with the current hypotheses ``(k, P)``.

    Before each aggregation the round tells the aggregator what the server knows about the
    releases (:meth:`observe`): whose they are, the model's layer sizes, and, only for an
    aggregator that declares :attr:`needs_budgets` (clients reveal their privacy budgets), each
    client's epsilon.
    """

    kind = "aggregator"

    #: whether the clients reveal their privacy budgets to this aggregator (PFA's direct split)
    needs_budgets = False
    #: whether it averages one global model only (the round refuses num_hypotheses > 1 before training)
    one_model = False
    #: whether a metric it reports once (:meth:`round_metrics`; PFA's split accuracy) was reported: the round keeps it
    #: in its checkpoint (``checkpoint["federated"]["split_scored"]``), so that a resumed run does not report it again
    scored = False

    @property
    def weights_by_counts(self) -> bool:
        """Whether its weights are the clients' example counts (private: they change with one record)."""
        return False

    @property
    def plain_mean(self) -> bool:
        """Whether it is the plain mean of the releases (the sum whose sensitivity central DP accounts)."""
        return False

    def round_metrics(self, update: Any, index: Sequence[int]) -> dict[str, float]:
        """Metrics of the aggregation just made, logged with the round's (default: none). ``update`` is the round's
        :class:`~lightning_dp.federated.parts.ClientUpdate`, ``index`` the participants (positions among the training
        clients) in the releases' order. Their names must be declared in the record
        (:mod:`lightning_dp.privacy.record`)."""
        return {}

    def observe(self, *, client_ids: Sequence[Any], layer_sizes: list[int], round_index: int,
                budgets: list[float] | None = None) -> None:
        """What the server knows about the coming :meth:`aggregate`'s releases (in their order)."""

    @abc.abstractmethod
    def aggregate(self, releases: Tensor, hypotheses: Tensor, weights: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """``(new hypotheses (k, P), cluster of each release (U,))``."""
        raise NotImplementedError

    def problems(self, parts: Combination) -> list[str]:
        found = []
        if self.needs_budgets and not parts.update.reveals_budgets:
            found.append(f"aggregator {self.name!r} splits the clients by their revealed privacy budgets, but update "
                         f"{parts.update.name!r} has none: use update local_dp_sgd with target_epsilon or budgets "
                         "(or the budget-agnostic partition='indirect')")
        if self.one_model and parts.num_hypotheses != 1:
            found.append(f"aggregator {self.name!r} averages one global model; num_hypotheses={parts.num_hypotheses} "
                         "is not allowed: use 1")
        return found


@register_part("aggregator", "kmeans")
class KMeans(Aggregator):
    """Clustered averaging (Algorithm 2 of the seed): k-means on the releases, started at the hypotheses;
    each hypothesis becomes its cluster's mean; an empty cluster keeps its hypothesis."""

    def __init__(self, max_iter: int = 100) -> None:
        if isinstance(max_iter, bool) or not isinstance(max_iter, int) or max_iter < 1:
            raise ValueError(f"max_iter={max_iter!r} must be a positive integer")
        self.max_iter = max_iter

    def aggregate(self, releases, hypotheses, weights=None):
        return kmeans_aggregate(releases, hypotheses, max_iter=self.max_iter)


@register_part("aggregator", "fedavg")
class FedAvg(Aggregator):
    """Federated averaging (McMahan et al. 2017): the one hypothesis becomes the mean of the releases.

    Args:
        weighted: weight each release by its client's number of examples (the original FedAvg).
            Under central DP the weights must not depend on the data: the round refuses
            ``weighted=True`` with :class:`~lightning_dp.federated.parts.server_privacy.CentralGaussian`.
    """

    def __init__(self, weighted: bool = False) -> None:
        self.weighted = bool(weighted)

    # derived from ``weighted`` when asked, so a changed ``weighted`` can never leave a stale capability behind
    @property
    def weights_by_counts(self) -> bool:
        return self.weighted

    @property
    def plain_mean(self) -> bool:
        return not self.weighted

    def hparams(self) -> dict[str, Any]:
        return {"fedavg_weighted": self.weighted}

    def aggregate(self, releases, hypotheses, weights=None):
        if hypotheses.shape[0] != 1:
            raise ValueError(f"FedAvg trains one model; the round has {hypotheses.shape[0]} hypotheses "
                             "(num_hypotheses=1, or aggregator 'kmeans' for clustered models)")
        assignment = torch.zeros(releases.shape[0], dtype=torch.long, device=releases.device)
        if releases.shape[0] == 0:
            return hypotheses.clone(), assignment
        if self.weighted and weights is not None:
            w = weights.to(releases.dtype)
            return ((releases * w[:, None]).sum(0) / w.sum())[None], assignment
        return releases.mean(0, keepdim=True), assignment


@register_part("aggregator", "pfa")
class PFA(Aggregator):
    """Projected federated averaging (:mod:`lightning_dp.federated.pfa`) over one global model.

    Args:
        partition: ``"direct"``: the clients reveal their budgets (:attr:`needs_budgets`) and the
            split is recomputed every round from them (``rule``); ``"indirect"`` (budget-agnostic):
            the first round is a warm start, averaged as FedAvg, after which a 2-component Gaussian
            mixture on the L2 norms of that round's released updates fixes the split (the
            larger-norm component is private); the server never sees a budget. A client first
            seen after the warm start counts as private (its update is projected).
        rule: the direct split: ``"top_fraction"`` (the ``public_fraction`` largest epsilons, as PFA's
            code) or ``"gmm"`` (a Gaussian mixture on epsilon).
        public_fraction: for ``rule="top_fraction"``.
        components: k, eigenvectors per layer.
        weighted: WeiPFA: every client weighted by its epsilon (direct only).
        plus: PFA+: private updates projected on the previous round's subspace (public: from the previous round's
            public releases), so a private client could send k numbers per layer; the first PFA round projects on
            its own.
        centered: project as PFA's code does (covariance of the public updates, affine projection through
            their mean; :func:`~lightning_dp.federated.pfa.pfa_combine`); default: the second-moment matrix,
            through 0.
        seed: random state of the Gaussian mixtures.
    """

    one_model = True

    def __init__(self, partition: str = "indirect", rule: str = "top_fraction", public_fraction: float = 0.1,
                 components: int = 1, weighted: bool = False, plus: bool = False, centered: bool = False,
                 seed: int = 0) -> None:
        if partition not in ("direct", "indirect"):
            raise ValueError(f"partition={partition!r} is not allowed; choose 'direct' (budgets revealed) or "
                             "'indirect' (budget-agnostic, a mixture on the update norms)")
        if rule not in ("top_fraction", "gmm"):
            raise ValueError(f"rule={rule!r} is not allowed; choose 'top_fraction' or 'gmm'")
        if not 0 < float(public_fraction) <= 1:
            raise ValueError(f"public_fraction={public_fraction!r} must be in (0, 1]")
        if isinstance(components, bool) or not isinstance(components, int) or components < 1:
            raise ValueError(f"components={components!r} is not allowed: pass a positive integer (k eigenvectors)")
        if weighted and partition != "direct":
            raise ValueError("weighted=True (WeiPFA) weights clients by their budgets, which only the direct "
                             "partition reveals; use partition='direct'")
        self.partition, self.rule, self.public_fraction = partition, rule, float(public_fraction)
        self.components, self.weighted, self.plus, self.seed = components, bool(weighted), bool(plus), int(seed)
        self.centered = bool(centered)
        self.needs_budgets = partition == "direct"
        self._round: dict[str, Any] = {}
        self._split: dict[Any, bool] = {}  # indirect: client id -> public, fixed after the warm start
        self._subspace: Any = None  # the last round's public subspace (PFA+ projects on it)
        self.last_public: list[bool] = []

    def hparams(self) -> dict[str, Any]:
        return {"pfa_partition": self.partition, "pfa_rule": self.rule if self.partition == "direct" else None,
                "pfa_public_fraction": self.public_fraction if self.rule == "top_fraction" else None,
                "pfa_components": self.components, "pfa_weighted": self.weighted, "pfa_plus": self.plus,
                "pfa_centered": self.centered}

    def observe(self, *, client_ids, layer_sizes, round_index, budgets=None):
        if self.needs_budgets and budgets is None:
            raise ValueError("PFA(partition='direct') needs the clients' budgets: use update local_dp_sgd with "
                             "target_epsilon or budgets")
        self._round = {"ids": list(client_ids), "sizes": list(layer_sizes), "budgets": budgets}

    def split(self) -> dict[Any, bool]:
        """The indirect split (client id -> public), empty before the warm start."""
        return dict(self._split)

    @property
    def warm_started(self) -> bool:
        """Whether the split is final (made from revealed budgets, or after the warm start): then it is scored once."""
        return self.partition == "direct" or bool(self._split)

    def round_metrics(self, update, index):
        """The split's size per round (``pdpfl/public_clients``), and once, when the split is made from released
        updates (the warm start), its accuracy against the clients' true budget groups (``pdpfl/split_accuracy``: a
        simulation diagnostic from :meth:`ClientUpdate.true_public`; the server never sees the truth)."""
        public = self.last_public
        if not public or len(public) != len(index):
            return {}
        metrics = {"pdpfl/public_clients": float(sum(public))}
        truth = update.true_public(index)
        if truth is not None and not self.scored and self.warm_started:
            metrics["pdpfl/split_accuracy"] = sum(p == t for p, t in zip(public, truth)) / len(index)
            self.scored = True
        return metrics

    def aggregate(self, releases, hypotheses, weights=None):
        from lightning_dp.federated.pfa import Subspace, pfa_combine, split_by_budgets, split_by_norms

        if hypotheses.shape[0] != 1:
            raise ValueError(f"PFA trains one model; the round has {hypotheses.shape[0]} hypotheses")
        ids = self._round.get("ids")
        if ids is None or len(ids) != releases.shape[0]:
            raise RuntimeError("PFA.aggregate: observe() was not told about this round's releases (FederatedRound "
                               "does it)")
        assignment = torch.zeros(releases.shape[0], dtype=torch.long, device=releases.device)
        if releases.shape[0] == 0:
            return hypotheses.clone(), assignment
        updates = releases - hypotheses[0]
        budgets = self._round["budgets"]
        if self.partition == "direct":
            public = split_by_budgets(budgets, rule=self.rule, public_fraction=self.public_fraction, seed=self.seed)
        elif not self._split:  # the warm start: FedAvg over everyone, then the split from the released norms
            public = split_by_norms(row_norms(updates).cpu().numpy(), seed=self.seed)
            self._split = {cid: bool(p) for cid, p in zip(ids, public)}
            self.last_public = [bool(p) for p in public]
            return releases.mean(0, keepdim=True), assignment
        else:
            public = [self._split.get(cid, False) for cid in ids]
        self.last_public = [bool(p) for p in public]
        mask = torch.tensor(self.last_public, dtype=torch.bool, device=releases.device)
        w = torch.tensor(budgets, dtype=torch.float64) if self.weighted else None
        combined, subspace = pfa_combine(updates, mask, layer_sizes=self._round["sizes"], k=self.components,
                                         weights=w, previous=self._subspace if self.plus else None,
                                         centered=self.centered)
        if subspace is not None:
            self._subspace = Subspace([b.detach().cpu() for b in subspace.bases], subspace.origin.detach().cpu())
        return (hypotheses[0] + combined)[None], assignment

    def state_dict(self) -> dict[str, Any]:
        sub = self._subspace
        return {"split": [[cid, p] for cid, p in self._split.items()],
                "subspace": None if sub is None else {"bases": [b.clone() for b in sub.bases],
                                                      "origin": sub.origin.clone()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from lightning_dp.federated.pfa import Subspace

        self._split = {cid: bool(p) for cid, p in state.get("split", [])}
        sub = state.get("subspace")
        self._subspace = None if sub is None else Subspace(list(sub["bases"]), sub["origin"])
