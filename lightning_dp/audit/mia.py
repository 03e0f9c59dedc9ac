"""Membership-inference experiments: the member split, the attacks' metrics and figures (shared by the command).

The attacks themselves live in :mod:`~lightning_dp.audit.scores` (loss), :mod:`~lightning_dp.audit.lira`
(shadow models) and :mod:`~lightning_dp.audit.neighbours` (noisy neighbours); the statistics in
:mod:`~lightning_dp.audit.statistics`. This module only cuts the data and turns scores into the metrics
and figures of thesis ch. 4 (Figs 4.2-4.4).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from lightning_dp.audit.statistics import (
    RocCurve,
    _epsilon_bounds,
    roc,
    tpr_at_fpr,
    two_stage_epsilon,
)

__all__ = ["FPRS", "AttackResult", "MemberSplit", "attack_result", "epsilon_vs_fpr", "epsilon_vs_fpr_figure",
           "split_members", "table"]

#: The low false-positive rates at which TPR is reported (Carlini et al. 2022).
FPRS = (1e-3, 1e-2, 1e-1)


@dataclass(frozen=True)
class MemberSplit:
    """Indices into the pool: the target's training set is ``members`` = calibration + evaluation members."""

    calibration_members: np.ndarray
    calibration_nonmembers: np.ndarray
    members: np.ndarray
    nonmembers: np.ndarray

    @property
    def training(self) -> np.ndarray:
        return np.sort(np.concatenate([self.calibration_members, self.members]))

    @property
    def evaluation(self) -> np.ndarray:
        """Evaluation members then evaluation non-members (the order of every score vector)."""
        return np.concatenate([self.members, self.nonmembers])


def split_members(size: int, *, member_fraction: float = 0.6, calibration_fraction: float = 0.2,
                  seed: int = 0) -> MemberSplit:
    """A seeded split of ``size`` pool examples into members (trained on) and non-members (thesis ch. 4: 60 / 40),
    each cut again into a labelled calibration part (for tuning an attack, e.g. the noisy-neighbour sigma) and
    the evaluation part on which every attack is measured.

    Example:
        >>> s = split_members(100, member_fraction=0.6, calibration_fraction=0.25, seed=0)
        >>> len(s.training), len(s.members), len(s.nonmembers), len(s.calibration_nonmembers)
        (60, 45, 30, 10)
    """
    if isinstance(size, bool) or int(size) != size or size < 10:
        raise ValueError(f"the pool holds {size} examples; a membership experiment needs at least 10")
    if not 0 < member_fraction < 1:
        raise ValueError(f"member_fraction={member_fraction!r} must be in (0, 1), e.g. 0.6 (thesis ch. 4)")
    if not 0 <= calibration_fraction < 1:
        raise ValueError(f"calibration_fraction={calibration_fraction!r} must be in [0, 1), e.g. 0.2")
    order = np.random.default_rng(seed).permutation(int(size))
    cut = int(round(member_fraction * size))
    members, nonmembers = order[:cut], order[cut:]
    cm, cn = int(round(calibration_fraction * members.size)), int(round(calibration_fraction * nonmembers.size))
    split = MemberSplit(np.sort(members[:cm]), np.sort(nonmembers[:cn]), np.sort(members[cm:]),
                        np.sort(nonmembers[cn:]))
    if split.members.size < 2 or split.nonmembers.size < 2:
        raise ValueError(f"the split leaves {split.members.size} evaluation members and {split.nonmembers.size} "
                         "non-members; use a larger pool or a smaller calibration_fraction")
    return split


@dataclass(frozen=True)
class AttackResult:
    """One attack's scores on the evaluation members and non-members, their ROC and summary numbers."""

    name: str
    members: np.ndarray
    nonmembers: np.ndarray
    curve: RocCurve
    tpr: dict[float, float]
    epsilon: float
    forward_passes: int
    seconds: float

    def metrics(self) -> dict[str, float]:
        out = {f"audit/auc/{self.name}": self.curve.auc, f"audit/epsilon/{self.name}": self.epsilon,
               f"audit/cost/forward_passes/{self.name}": float(self.forward_passes),
               f"audit/cost/seconds/{self.name}": self.seconds}
        out.update({f"audit/tpr_at_fpr_{f:g}/{self.name}": v for f, v in self.tpr.items()})
        return out


def attack_result(name: str, members, nonmembers, *, forward_passes: int, seconds: float, delta: float = 0.0,
                  confidence: float = 0.95, seed: int = 0) -> AttackResult:
    """ROC, AUC, TPR at :data:`FPRS` and the two-stage empirical epsilon (the number that holds with ``confidence``)
    of an attack's scores."""
    pos, neg = np.asarray(members, dtype=np.float64), np.asarray(nonmembers, dtype=np.float64)
    curve = roc(pos, neg)
    eps = two_stage_epsilon(pos, neg, delta=delta, confidence=confidence, seed=seed).epsilon
    return AttackResult(name, pos, neg, curve, {f: tpr_at_fpr(curve, f) for f in FPRS}, float(eps),
                        int(forward_passes), float(seconds))


def epsilon_vs_fpr(result: AttackResult, *, delta: float = 0.0,
                   confidence: float = 0.95) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(fpr, point, lower)`` along the ROC (thesis Fig. 4.4): the point estimate
    ``max(ln(TPR / FPR), ln((1 - FPR) / (1 - TPR)))`` and the Clopper-Pearson lower bound of
    :func:`~lightning_dp.audit.statistics.epsilon_lower_bound` at each threshold (each a valid bound for that
    threshold alone; their maximum is optimistic)."""
    n_pos, n_neg = result.members.size, result.nonmembers.size
    fpr, tpr = result.curve.fpr, result.curve.tpr
    keep = (fpr > 0) & (tpr < 1)
    fpr, tpr = fpr[keep], tpr[keep]
    with np.errstate(divide="ignore"):
        point = np.maximum(np.where(tpr > 0, np.log(np.maximum(tpr, 1e-300) / fpr), 0.0),
                           np.log((1 - fpr) / (1 - tpr)))
    tp = np.rint(tpr * n_pos).astype(np.int64)
    fp = np.rint(fpr * n_neg).astype(np.int64)
    lower = _epsilon_bounds(tp, n_pos, fp, n_neg, delta, confidence)
    return fpr, np.maximum(point, 0.0), lower


def epsilon_vs_fpr_figure(results: list[AttackResult], *, title: str = "empirical epsilon along the ROC"):
    """Fig. 4.4: the point estimate of :func:`epsilon_vs_fpr` (solid) and its 95 % lower bound (dashed) against
    FPR, per attack."""
    from lightning_dp.audit.plots import _figure

    figure, ax = _figure((5.5, 4.0))
    for i, result in enumerate(results):
        fpr, point, lower = epsilon_vs_fpr(result)
        ax.plot(fpr, point, color=f"C{i}", label=f"{result.name}: point estimate")
        ax.plot(fpr, lower, color=f"C{i}", linestyle="--", label=f"{result.name}: 95 % lower bound")
    ax.set_xscale("log")
    ax.set_xlabel("false positive rate")
    ax.set_ylabel("empirical epsilon")
    ax.set_title(title)
    ax.legend(fontsize=7)
    ax.grid(True, alpha=0.3)
    return figure


def table(results: list[AttackResult]) -> str:
    """A markdown table of the attacks (AUC, TPR at low FPR, two-stage epsilon, cost)."""
    head = "| attack | AUC | " + " | ".join(f"TPR @ FPR {f:g}" for f in FPRS) + \
        " | empirical eps (95 %) | forward passes | seconds |"
    lines = [head, "|---|---|" + "---|" * len(FPRS) + "---|---|---|"]
    for r in results:
        eps = "inf" if math.isinf(r.epsilon) else f"{r.epsilon:.3f}"
        lines.append(f"| {r.name} | {r.curve.auc:.4f} | " + " | ".join(f"{r.tpr[f]:.4f}" for f in FPRS)
                     + f" | {eps} | {r.forward_passes} | {r.seconds:.1f} |")
    return "\n".join(lines)
