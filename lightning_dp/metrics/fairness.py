"""Group fairness of a binary classifier, with exactly fairlearn's definitions.

A functional part (:func:`binary_group_counts`, :func:`group_rates`, :func:`between_groups_difference`,
:func:`group_fairness_from_counts`, :func:`group_fairness`) and :class:`GroupFairness`, a ``torchmetrics.Metric``
that only holds the four per-group confusion counts (summed across processes, so exact under DDP) and calls it.
The definitions are ``fairlearn.metrics`` 0.15's (``method="between_groups"``, ``agg="worst_case"``); the formulas
and their sources: docs/fairness.md, "The GroupFairness metric".
"""

from __future__ import annotations

import numbers
from typing import Any

import torch
from torch import Tensor
from torchmetrics import Metric
from torchmetrics.utilities.compute import normalize_logits_if_needed

__all__ = [
    "GroupFairness",
    "between_groups_difference",
    "binary_group_counts",
    "group_fairness",
    "group_fairness_from_counts",
    "group_rates",
]

#: Per-group rates, in the order in which :func:`group_fairness_from_counts` lists them.
GROUP_RATES = ("selection_rate", "true_positive_rate", "false_positive_rate", "accuracy", "count")


# --------------------------------------------------------------------------- argument checks


def check_num_groups(num_groups: int) -> int:
    """Validates the number of groups and returns it as an int."""
    if isinstance(num_groups, bool) or not isinstance(num_groups, numbers.Integral) or num_groups < 1:
        raise ValueError(
            f"num_groups={num_groups!r} is not allowed: it must be an integer >= 1, the number of group ids "
            "(groups take the values 0, 1, ..., num_groups - 1). Pass e.g. num_groups=2 for a binary "
            "sensitive attribute.")
    return int(num_groups)


def check_threshold(threshold: float) -> float:
    """Validates the decision threshold for probabilities and returns it as a float."""
    if isinstance(threshold, bool) or not isinstance(threshold, numbers.Real) or not 0.0 < threshold < 1.0:
        raise ValueError(
            f"threshold={threshold!r} is not allowed: it must be a number strictly between 0 and 1 (a "
            "probability p counts as a positive prediction when p >= threshold). Pass e.g. threshold=0.5.")
    return float(threshold)


def _check_inputs(preds: Tensor, target: Tensor, groups: Tensor, num_groups: int) -> None:
    for name, tensor in (("preds", preds), ("target", target), ("groups", groups)):
        if not isinstance(tensor, Tensor):
            raise ValueError(
                f"{name} must be a torch.Tensor, got {type(tensor).__name__}; wrap it with torch.as_tensor({name})")
        if tensor.ndim != 1:
            raise ValueError(
                f"{name} has shape {tuple(tensor.shape)}, but preds, target and groups must all have shape (N,): "
                f"one entry per example. Flatten it, e.g. {name}.reshape(-1) (or {name}.squeeze(-1) for an "
                "(N, 1) output).")
    if not preds.shape == target.shape == groups.shape:
        raise ValueError(
            f"preds, target and groups must have the same shape (N,), got preds {tuple(preds.shape)}, target "
            f"{tuple(target.shape)} and groups {tuple(groups.shape)}; pass one prediction, one label and one "
            "group id per example.")

    if preds.is_floating_point():
        if torch.isnan(preds).any():
            raise ValueError(
                "preds contains NaN; probabilities must lie in [0, 1] (and logits must not be NaN). Check the "
                "model's output before updating the metric.")
    elif not _is_binary(preds):
        raise ValueError(
            f"preds is a {preds.dtype} tensor with values {_values(preds)}, but integer or bool predictions "
            "must be hard labels in {0, 1}. Pass the labels (e.g. (probs >= 0.5).long()) or the probabilities "
            "or logits as a float tensor.")

    if not _is_binary(target):
        raise ValueError(
            f"target has values {_values(target)}, but the labels of a binary classifier must be in {{0, 1}}. "
            "Map the positive class to 1 and the negative class to 0 (e.g. (y == positive_label).long()).")

    if groups.is_floating_point() or groups.is_complex():
        raise ValueError(
            f"groups is a {groups.dtype} tensor, but group ids must be integers in [0, num_groups); convert "
            "them with groups.long() (or map the sensitive attribute to integer codes first).")
    if groups.numel() and (groups.min() < 0 or groups.max() >= num_groups):
        bad = groups[(groups < 0) | (groups >= num_groups)]
        raise ValueError(
            f"groups contains the id(s) {_values(bad)}, outside [0, {num_groups}) for num_groups={num_groups}. "
            "Group ids must be 0, 1, ..., num_groups - 1: raise num_groups or re-code the sensitive attribute.")


def _is_binary(tensor: Tensor) -> bool:
    return bool(((tensor == 0) | (tensor == 1)).all())


def _values(tensor: Tensor, limit: int = 10) -> str:
    values = torch.unique(tensor).tolist()
    return str(values[:limit])[:-1] + ", ...]" if len(values) > limit else str(values)


# --------------------------------------------------------------------------- functional part


def binary_group_counts(
    preds: Tensor, target: Tensor, groups: Tensor, num_groups: int, *, threshold: float = 0.5
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Per-group confusion counts ``(tp, fp, tn, fn)`` of one batch.

    Hard predictions (an int or bool ``preds``) are used as they are. A float ``preds`` holds
    probabilities, thresholded with ``p >= threshold``; if any value of the batch lies outside
    ``[0, 1]``, the whole batch is taken to be logits and passed through a sigmoid first (the torchmetrics
    binary convention, decided per call). Note that torchmetrics' own binary metrics threshold with
    ``p > threshold``: the two differ only for a probability exactly equal to the threshold (a logit of
    exactly 0 with ``threshold=0.5``), which this function counts as a positive prediction.

    Args:
        preds: predictions, shape ``(N,)``: labels in ``{0, 1}``, probabilities or logits.
        target: labels in ``{0, 1}``, shape ``(N,)``.
        groups: integer group ids in ``[0, num_groups)``, shape ``(N,)``.
        num_groups: the number of groups ``G``.
        threshold: decision threshold for probabilities, in ``(0, 1)``.

    Returns:
        Four int64 tensors of shape ``(G,)``: true positives, false positives, true negatives and false
        negatives per group.

    Raises:
        ValueError: on shapes other than ``(N,)``, labels or hard predictions outside ``{0, 1}``, NaN
            predictions, non-integer group ids or ids outside ``[0, num_groups)``.

    Example:
        >>> tp, fp, tn, fn = binary_group_counts(
        ...     torch.tensor([0.9, 0.2, 0.7, 0.4]), torch.tensor([1, 0, 0, 1]), torch.tensor([0, 0, 1, 1]), 2)
        >>> tp, fp, tn, fn
        (tensor([1, 0]), tensor([0, 1]), tensor([1, 0]), tensor([0, 1]))
    """
    num_groups = check_num_groups(num_groups)
    threshold = check_threshold(threshold)
    _check_inputs(preds, target, groups, num_groups)

    if preds.is_floating_point():
        preds = normalize_logits_if_needed(preds, "sigmoid") >= threshold
    # Cell of the 2x2 confusion table: 0 = tn, 1 = fp, 2 = fn, 3 = tp.
    cell = 2 * target.long() + preds.long()
    table = torch.bincount(groups.long() * 4 + cell, minlength=4 * num_groups).view(num_groups, 4)
    return table[:, 3], table[:, 1], table[:, 0], table[:, 2]


def _rate(numerator: Tensor, denominator: Tensor, present: Tensor) -> Tensor:
    """``numerator / denominator`` in float64, 0 where the denominator is 0 (fairlearn's 0/0), NaN for absent groups."""
    numerator, denominator = numerator.double(), denominator.double()
    rate = torch.where(denominator > 0, numerator / denominator.clamp(min=1), torch.zeros_like(numerator))
    return torch.where(present, rate, torch.full_like(rate, float("nan")))


def group_rates(tp: Tensor, fp: Tensor, tn: Tensor, fn: Tensor) -> dict[str, Tensor]:
    """Per-group rates from confusion counts, as ``fairlearn.metrics.MetricFrame(...).by_group`` has them.

    With ``n_g = tp + fp + tn + fn`` the number of examples of group g:

    - ``selection_rate = (tp + fp) / n_g`` (fairlearn's ``selection_rate``),
    - ``true_positive_rate = tp / (tp + fn)``, and 0 when the group has no positive label,
    - ``false_positive_rate = fp / (fp + tn)``, and 0 when the group has no negative label,
    - ``accuracy = (tp + tn) / n_g`` (``sklearn.metrics.accuracy_score``),
    - ``count = n_g``.

    The two 0/0 cases give 0, as fairlearn's ``true_positive_rate`` and ``false_positive_rate`` do (they
    read a row-normalized ``sklearn.metrics.confusion_matrix``, whose empty rows are 0), without a warning.
    A group with ``n_g = 0`` does not exist for fairlearn: all its rates are NaN (its count is 0).

    Args:
        tp: per-group true positives, shape ``(G,)``.
        fp: per-group false positives, shape ``(G,)``.
        tn: per-group true negatives, shape ``(G,)``.
        fn: per-group false negatives, shape ``(G,)``.

    Returns:
        A dict from each name of :data:`GROUP_RATES` to a float64 tensor of shape ``(G,)``.
    """
    count = tp + fp + tn + fn
    present = count > 0
    return {
        "selection_rate": _rate(tp + fp, count, present),
        "true_positive_rate": _rate(tp, tp + fn, present),
        "false_positive_rate": _rate(fp, fp + tn, present),
        "accuracy": _rate(tp + tn, count, present),
        "count": count.double(),
    }


def between_groups_difference(values: Tensor, present: Tensor) -> Tensor:
    """``max - min`` of ``values`` over the groups where ``present`` is true (fairlearn's ``between_groups``).

    Returns a float64 scalar: 0 when one group is present, NaN when none is.
    """
    values = values.double()
    inf = torch.full_like(values, float("inf"))
    difference = torch.where(present, values, -inf).max() - torch.where(present, values, inf).min()
    return torch.where(present.any(), difference, torch.full_like(difference, float("nan")))


def group_fairness_from_counts(tp: Tensor, fp: Tensor, tn: Tensor, fn: Tensor) -> dict[str, Tensor]:
    """Group fairness of a binary classifier from its per-group confusion counts.

    Over the groups present (``n_g > 0``), with the rates of :func:`group_rates`:

    - ``demographic_parity_difference = max_g selection_rate_g - min_g selection_rate_g``,
    - ``equal_opportunity_difference = max_g TPR_g - min_g TPR_g``,
    - ``equalized_odds_difference = max(equal_opportunity_difference, max_g FPR_g - min_g FPR_g)``,
    - ``accuracy = sum_g (tp + tn) / sum_g n_g`` (overall, over all examples),

    which equal ``fairlearn.metrics.demographic_parity_difference``, ``equal_opportunity_difference`` and
    ``equalized_odds_difference`` (``agg="worst_case"``) on the same data. Differences are 0 when a single
    group is present; everything but the counts is NaN when no example has been seen.

    Args:
        tp: per-group true positives, shape ``(G,)``.
        fp: per-group false positives, shape ``(G,)``.
        tn: per-group true negatives, shape ``(G,)``.
        fn: per-group false negatives, shape ``(G,)``.

    Returns:
        A flat dict of float64 scalars: the three differences and ``accuracy``, then
        ``"{rate}/group_{g}"`` for each rate of :data:`GROUP_RATES` and each group ``g = 0 .. G-1``.
    """
    rates = group_rates(tp, fp, tn, fn)
    present = rates["count"] > 0
    tpr_difference = between_groups_difference(rates["true_positive_rate"], present)
    fpr_difference = between_groups_difference(rates["false_positive_rate"], present)
    total = rates["count"].sum()
    correct = (tp + tn).sum().double()
    result = {
        "demographic_parity_difference": between_groups_difference(rates["selection_rate"], present),
        "equalized_odds_difference": torch.maximum(tpr_difference, fpr_difference),
        "equal_opportunity_difference": tpr_difference,
        "accuracy": torch.where(total > 0, correct / total.clamp(min=1), torch.full_like(total, float("nan"))),
    }
    for name in GROUP_RATES:
        result.update({f"{name}/group_{g}": value for g, value in enumerate(rates[name].unbind())})
    return result


def group_fairness(
    preds: Tensor, target: Tensor, groups: Tensor, num_groups: int, *, threshold: float = 0.5
) -> dict[str, Tensor]:
    """One-shot group fairness of a binary classifier (the functional form of :class:`GroupFairness`).

    See :func:`binary_group_counts` for the inputs and :func:`group_fairness_from_counts` for the result.

    Example:
        >>> result = group_fairness(
        ...     torch.tensor([1, 1, 0, 1, 0, 0]), torch.tensor([1, 0, 0, 1, 1, 0]), torch.tensor([0, 0, 0, 1, 1, 1]), 2)
        >>> round(result["demographic_parity_difference"].item(), 4)
        0.3333
        >>> result["true_positive_rate/group_1"]
        tensor(0.5000, dtype=torch.float64)
    """
    return group_fairness_from_counts(*binary_group_counts(preds, target, groups, num_groups, threshold=threshold))


# --------------------------------------------------------------------------- the Metric


class GroupFairness(Metric):
    """Group fairness of a binary classifier: fairlearn's disparity metrics, accumulated over batches.

    States are the per-group confusion counts ``tp``, ``fp``, ``tn``, ``fn`` (int64, shape
    ``(num_groups,)``, summed across processes), so the result is exact under DDP and after
    ``merge_state``. :meth:`compute` returns a flat dict of float64 scalars (see
    :func:`group_fairness_from_counts` for the formulas):

    - ``demographic_parity_difference``, ``equalized_odds_difference``, ``equal_opportunity_difference``
      (fairlearn's functions with their defaults: ``method="between_groups"``, ``agg="worst_case"``),
    - ``accuracy`` over all examples,
    - for each group g: ``selection_rate/group_{g}``, ``true_positive_rate/group_{g}``,
      ``false_positive_rate/group_{g}``, ``accuracy/group_{g}``, ``count/group_{g}``.

    Degenerate groups are treated exactly as fairlearn 0.15 treats them:

    - a group with no example so far is absent for fairlearn: its rates are NaN, its count 0, and it does
      not enter the differences;
    - a group with no positive label has true positive rate 0 (fairlearn returns 0 for 0/0, silently), so
      it enters ``equal_opportunity_difference`` and ``equalized_odds_difference`` as a group with TPR 0: with
      another group at TPR 0.9, the difference is 0.9 although the group gave no evidence about its TPR;
    - likewise a group with no negative label has false positive rate 0;
    - with a single group present, all three differences are 0;
    - with no example at all (fairlearn raises), every value but the counts is NaN.

    Predictions follow :func:`binary_group_counts`: hard labels, or probabilities thresholded with
    ``p >= threshold`` (a batch with values outside ``[0, 1]`` is taken as logits).

    Args:
        num_groups: the number of groups; group ids are ``0, ..., num_groups - 1``.
        threshold: decision threshold for probabilities, in ``(0, 1)``.
        kwargs: passed to ``torchmetrics.Metric`` (e.g. ``sync_on_compute``, ``dist_sync_fn``).

    Example:
        >>> metric = GroupFairness(2)
        >>> metric.update(torch.tensor([0.8, 0.3, 0.6]), torch.tensor([1, 0, 1]), torch.tensor([0, 0, 1]))
        >>> metric.update(torch.tensor([0.9, 0.1]), torch.tensor([0, 0]), torch.tensor([1, 1]))
        >>> result = metric.compute()
        >>> result["equalized_odds_difference"], result["count/group_1"]
        (tensor(0.5000, dtype=torch.float64), tensor(3., dtype=torch.float64))
    """

    is_differentiable = False
    higher_is_better = False  # for the three differences, the headline outputs
    full_state_update = False

    tp: Tensor
    fp: Tensor
    tn: Tensor
    fn: Tensor

    def __init__(self, num_groups: int, *, threshold: float = 0.5, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.num_groups = check_num_groups(num_groups)
        self.threshold = check_threshold(threshold)
        for name in ("tp", "fp", "tn", "fn"):
            self.add_state(name, torch.zeros(self.num_groups, dtype=torch.long), dist_reduce_fx="sum")

    def update(self, preds: Tensor, target: Tensor, groups: Tensor) -> None:
        """Adds one batch: ``preds``, ``target`` and ``groups`` of shape ``(N,)``."""
        tp, fp, tn, fn = binary_group_counts(preds, target, groups, self.num_groups, threshold=self.threshold)
        self.tp += tp
        self.fp += fp
        self.tn += tn
        self.fn += fn

    def compute(self) -> dict[str, Tensor]:
        """The flat dict of differences, overall accuracy and per-group rates (float64 scalars)."""
        return group_fairness_from_counts(self.tp, self.fp, self.tn, self.fn)
