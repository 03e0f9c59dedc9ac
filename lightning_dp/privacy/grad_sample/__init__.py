"""Per-sample gradient norms and clipped gradient sums, computed by book-keeping, one rule per layer type.

One ordinary backward pass (after Bu et al. 2023): hooks record each layer's inputs and output gradients, and
the rule registered for the layer's type (:mod:`~lightning_dp.privacy.grad_sample.rules`, :func:`register_rule`
for your own) turns them into per-sample contributions. Where the batch is, is established by
:meth:`GradSampleEngine.probe`. Contract: the loss is the batch MEAN of per-example losses. Why hand-written, the
contract, the supported layers and an example: docs/per_sample_gradients.md.
"""

from lightning_dp.privacy.grad_sample import rules  # noqa: F401  (registers the built-in rules)
from lightning_dp.privacy.grad_sample.contributions import (
    DEFAULT_INSTANTIATE_LIMIT,
    Contribution,
    Dense,
    Factored,
    OneHotFactored,
    choose_layer_strategy,
)
from lightning_dp.privacy.grad_sample.engine import GradSampleEngine, PerSampleGradientError, trainable_parameters
from lightning_dp.privacy.grad_sample.registry import LayerRule, Record, register_rule, registered_rules, rule_for

__all__ = [
    "DEFAULT_INSTANTIATE_LIMIT", "Contribution", "Dense", "Factored", "GradSampleEngine", "LayerRule",
    "OneHotFactored", "PerSampleGradientError", "Record", "choose_layer_strategy", "register_rule",
    "registered_rules", "rule_for", "trainable_parameters",
]
