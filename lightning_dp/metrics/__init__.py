"""torchmetrics Metrics for the evaluation of private and federated models.

:class:`GroupFairness` (:mod:`~lightning_dp.metrics.fairness`): fairlearn's demographic parity, equalized odds and
equal opportunity differences, accuracy and per-group rates of a binary classifier, as a flat dict. ``compute()``
returns a dict, which ``self.log`` cannot take as a Metric: log it yourself at epoch end and ``reset()``. The
outputs and a LightningModule using it: docs/fairness.md, "The GroupFairness metric".
"""

from lightning_dp.metrics.fairness import (
    GroupFairness,
    binary_group_counts,
    group_fairness,
    group_fairness_from_counts,
)

__all__ = ["GroupFairness", "binary_group_counts", "group_fairness", "group_fairness_from_counts"]
