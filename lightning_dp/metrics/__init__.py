"""torchmetrics Metrics for the evaluation of private and federated models.

- :mod:`~lightning_dp.metrics.fairness`: :class:`GroupFairness`, the group fairness of a binary
  classifier with exactly fairlearn's definitions. ``compute()`` returns a flat dict:
  ``demographic_parity_difference``, ``equalized_odds_difference`` and ``equal_opportunity_difference``
  (equal to ``fairlearn.metrics``' functions of those names, with their defaults ``method="between_groups"``
  and ``agg="worst_case"``), the overall ``accuracy``, and per group g ``selection_rate/group_{g}``,
  ``true_positive_rate/group_{g}``, ``false_positive_rate/group_{g}``, ``accuracy/group_{g}`` and
  ``count/group_{g}`` (the rows of ``fairlearn.metrics.MetricFrame(...).by_group``). The formulas live in
  plain functions on tensors (:func:`binary_group_counts`, :func:`group_fairness_from_counts`,
  :func:`group_fairness`); the Metric only sums per-group confusion counts, which makes it exact under
  DDP. See ``docs/fairness.md``.

Usage in a LightningModule. The result is a dict, which ``self.log`` cannot take as a Metric object, so
call ``compute()`` yourself at epoch end, log the dict, and ``reset()`` (Lightning resets only the
Metric objects it logs itself)::

    from lightning_dp.metrics import GroupFairness

    class Model(LightningModule):
        def __init__(self):
            super().__init__()
            self.fairness = GroupFairness(2)

        def test_step(self, batch, batch_idx):
            x, y, groups = batch
            preds = self(x).squeeze(-1)  # logits or probabilities, shape (N,)
            self.fairness.update(preds, y, groups)

        def on_test_epoch_end(self):
            self.log_dict({f"test/fairness/{k}": v for k, v in self.fairness.compute().items()})
            self.fairness.reset()
"""

from lightning_dp.metrics.fairness import (
    GroupFairness,
    binary_group_counts,
    group_fairness,
    group_fairness_from_counts,
)

__all__ = ["GroupFairness", "binary_group_counts", "group_fairness", "group_fairness_from_counts"]
