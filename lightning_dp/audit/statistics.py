"""Membership-inference statistics: ROC, AUC, TPR at low FPR, and empirical epsilon lower bounds.

Scores are higher for members. (epsilon, delta)-DP bounds every threshold attack's TPR and FPR; with one-sided
Clopper-Pearson bounds this gives an epsilon lower bound. :func:`two_stage_epsilon` (threshold chosen on one
half, bound on the other) is the claim to report; :func:`empirical_epsilon` without a threshold is optimistic, a
diagnostic. The inequalities and the tests: docs/audit.md, "Membership-inference statistics".
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

__all__ = ["EmpiricalEpsilon", "RocCurve", "clopper_pearson", "empirical_epsilon", "epsilon_lower_bound", "roc",
           "tpr_at_fpr", "two_stage_epsilon"]


@dataclass(frozen=True)
class RocCurve:
    """``fpr``, ``tpr`` and the ``thresholds`` they belong to (scikit-learn's ``roc_curve``), and the ``auc``."""

    fpr: np.ndarray
    tpr: np.ndarray
    thresholds: np.ndarray
    auc: float


def _scores(values, name: str) -> np.ndarray:
    array = np.asarray(values, dtype=np.float64).ravel()
    if array.size == 0 or not np.isfinite(array).all():
        raise ValueError(f"{name} must be a non-empty array of finite scores, got {array.size} values"
                         + ("" if array.size == 0 else " with NaN or inf"))
    return array


def roc(members, nonmembers) -> RocCurve:
    """The ROC curve and AUC of the scores of members (positives) against non-members (higher = member).

    Example:
        >>> curve = roc([0.9, 0.8, 0.3], [0.1, 0.4, 0.2])
        >>> round(curve.auc, 4)
        0.8889
    """
    from sklearn.metrics import roc_auc_score, roc_curve

    pos, neg = _scores(members, "members"), _scores(nonmembers, "nonmembers")
    y = np.concatenate([np.ones(pos.size), np.zeros(neg.size)])
    s = np.concatenate([pos, neg])
    fpr, tpr, thresholds = roc_curve(y, s, drop_intermediate=False)
    return RocCurve(fpr, tpr, thresholds, float(roc_auc_score(y, s)))


def tpr_at_fpr(curve: RocCurve, fpr: float) -> float:
    """The largest TPR among the curve's points with FPR at most ``fpr`` (0 if none)."""
    if not 0 <= fpr <= 1:
        raise ValueError(f"fpr={fpr!r} must be in [0, 1]")
    ok = curve.fpr <= fpr
    return float(curve.tpr[ok].max()) if ok.any() else 0.0


def clopper_pearson(successes: int, trials: int, alpha: float) -> tuple[float, float]:
    """One-sided exact binomial bounds ``(low, high)``, each holding with probability at least ``1 - alpha``.

    ``low`` is the ``alpha`` quantile of Beta(k, n - k + 1) (0 when k = 0), ``high`` the ``1 - alpha``
    quantile of Beta(k + 1, n - k) (1 when k = n).

    Example:
        >>> low, high = clopper_pearson(10, 10, 0.05)
        >>> round(low, 6) == round(0.05 ** (1 / 10), 6), high
        (True, 1.0)
    """
    if isinstance(trials, bool) or int(trials) != trials or trials < 1:
        raise ValueError(f"trials={trials!r} must be a positive integer")
    if int(successes) != successes or not 0 <= successes <= trials:
        raise ValueError(f"successes={successes!r} must be an integer in [0, trials={trials}]")
    if not 0 < alpha < 1:
        raise ValueError(f"alpha={alpha!r} must be in (0, 1)")
    k = np.asarray(int(successes))
    return float(_lower_bound(k, int(trials), alpha)), float(_upper_bound(k, int(trials), alpha))


def _lower_bound(k: np.ndarray, n: int, alpha: float) -> np.ndarray:
    """The lower end of :func:`clopper_pearson` for every count in ``k`` (unchecked)."""
    from scipy.stats import beta

    return np.where(k == 0, 0.0, beta.ppf(alpha, np.maximum(k, 1), n - k + 1))


def _upper_bound(k: np.ndarray, n: int, alpha: float) -> np.ndarray:
    """The upper end of :func:`clopper_pearson` for every count in ``k`` (unchecked)."""
    from scipy.stats import beta

    return np.where(k == n, 1.0, beta.ppf(1 - alpha, k + 1, np.maximum(n - k, 1)))


def _check_audit(delta: float, confidence: float) -> None:
    if not 0 <= delta < 1:
        raise ValueError(f"delta={delta!r} must be in [0, 1)")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence={confidence!r} must be in (0, 1)")


def _epsilon_bounds(tp: np.ndarray, members: int, fp: np.ndarray, nonmembers: int, delta: float,
                    confidence: float) -> np.ndarray:
    """:func:`epsilon_lower_bound` of every threshold's counts ``(tp, fp)`` (unchecked)."""
    alpha = (1 - confidence) / 2
    tpr_low, fpr_high = _lower_bound(tp, members, alpha), _upper_bound(fp, nonmembers, alpha)
    with np.errstate(divide="ignore", invalid="ignore"):  # FPR_high = 0 or TPR_low = 1: an infinite bound
        first = np.where(tpr_low - delta > 0, np.log(np.maximum(tpr_low - delta, 1e-300) / fpr_high), 0.0)
        second = np.where(1 - fpr_high - delta > 0,
                          np.log(np.maximum(1 - fpr_high - delta, 1e-300) / (1 - tpr_low)), 0.0)
    return np.maximum(np.maximum(first, second), 0.0)


def epsilon_lower_bound(true_positives: int, members: int, false_positives: int, nonmembers: int, *,
                        delta: float = 0.0, confidence: float = 0.95) -> float:
    """The epsilon lower bound of one attack threshold (module docstring); 0 when the attack shows nothing.

    Args:
        true_positives: members the attack flagged, out of ``members``.
        false_positives: non-members it flagged, out of ``nonmembers``.
        delta: the delta of the guarantee being audited.
        confidence: the probability with which the returned bound holds.
    """
    _check_audit(delta, confidence)
    for k, n, name in ((true_positives, members, "true_positives"), (false_positives, nonmembers, "false_positives")):
        if isinstance(n, bool) or int(n) != n or n < 1 or int(k) != k or not 0 <= k <= n:
            raise ValueError(f"{name}={k!r} must be an integer in [0, {n!r}] out of a positive count")
    return float(_epsilon_bounds(np.asarray(int(true_positives)), int(members), np.asarray(int(false_positives)),
                                 int(nonmembers), delta, confidence))


@dataclass(frozen=True)
class EmpiricalEpsilon:
    """An empirical epsilon lower bound, the threshold it was measured at, and that threshold's rates."""

    epsilon: float
    threshold: float
    tpr: float
    fpr: float


def empirical_epsilon(members, nonmembers, *, delta: float = 0.0, confidence: float = 0.95,
                      threshold: float | None = None) -> EmpiricalEpsilon:
    """The epsilon lower bound of "member if score >= threshold".

    With ``threshold`` given (chosen on other samples), the bound holds with probability ``confidence``.
    Without, the best threshold of these samples' ROC is taken: the usual reported number, optimistic by
    the choice (module docstring).
    """
    pos, neg = _scores(members, "members"), _scores(nonmembers, "nonmembers")
    if threshold is not None:
        tp, fp = int((pos >= threshold).sum()), int((neg >= threshold).sum())
        eps = epsilon_lower_bound(tp, pos.size, fp, neg.size, delta=delta, confidence=confidence)
        return EmpiricalEpsilon(eps, float(threshold), tp / pos.size, fp / neg.size)
    _check_audit(delta, confidence)
    # every distinct score as a threshold, vectorized: counts at or above each by binary search
    candidates = np.unique(np.concatenate([pos, neg]))
    tps = pos.size - np.searchsorted(np.sort(pos), candidates, side="left")
    fps = neg.size - np.searchsorted(np.sort(neg), candidates, side="left")
    bounds = _epsilon_bounds(tps, pos.size, fps, neg.size, delta, confidence)
    i = int(np.argmax(bounds))
    return EmpiricalEpsilon(float(bounds[i]), float(candidates[i]), float(tps[i] / pos.size),
                            float(fps[i] / neg.size))


def two_stage_epsilon(members, nonmembers, *, delta: float = 0.0, confidence: float = 0.95, fraction: float = 0.5,
                      seed: int = 0) -> EmpiricalEpsilon:
    """An epsilon lower bound that holds with probability ``confidence``: the threshold is the best one on a
    random ``fraction`` of each group's samples, the bound is measured on the rest."""
    pos, neg = _scores(members, "members"), _scores(nonmembers, "nonmembers")
    if not 0 < fraction < 1:
        raise ValueError(f"fraction={fraction!r} must be in (0, 1)")
    rng = np.random.default_rng(seed)
    pos, neg = rng.permutation(pos), rng.permutation(neg)
    cut_pos, cut_neg = int(round(fraction * pos.size)), int(round(fraction * neg.size))
    if not (0 < cut_pos < pos.size and 0 < cut_neg < neg.size):
        raise ValueError(f"{pos.size} members and {neg.size} non-members are too few to split at fraction={fraction}")
    chosen = empirical_epsilon(pos[:cut_pos], neg[:cut_neg], delta=delta, confidence=confidence)
    if not math.isfinite(chosen.threshold):  # nothing leaked on the selection half
        return EmpiricalEpsilon(0.0, math.inf, 0.0, 0.0)
    return empirical_epsilon(pos[cut_pos:], neg[cut_neg:], delta=delta, confidence=confidence,
                             threshold=chosen.threshold)
