"""Per-sample gradient norms and clipped gradient sums, computed by book-keeping, one rule per layer type.

Why hand-written: Opacus' hooks materialize every per-sample gradient and let autograd
compute the (discarded) batch gradient as well; its ghost clipping needs a second
backward pass. Neither fits a Lightning callback that must not change the user's
``training_step``. This engine follows the book-keeping idea of Bu et al. (2023,
"Differentially private optimization on large model at small cost"): one ordinary
backward pass in which

* a forward pre-hook freezes a layer's own parameters while that layer runs (when its
  input already requires grad), so autograd computes only the input gradients the chain
  rule needs and skips the weight gradients it would otherwise throw away;
* a forward hook records the layer's inputs and a tensor hook on each output records its
  gradient;
* after the backward pass, the rule registered for the layer's type turns the records
  into per-sample gradients in their cheapest form
  (:mod:`~lightning_dp.privacy.grad_sample.contributions`: ghost-norm factors, one-hot
  embedding factors, or instantiated gradients), from which the engine forms the
  per-sample norms (cross terms included for tied parameters) and the clipped sum.

Where each layer holds the batch is established, not assumed: :meth:`GradSampleEngine.probe`
runs the forward pass on probe batches of several sizes and finds, for every tensor a hooked
layer receives or returns, the dimension that follows the number of examples
(:mod:`lightning_dp.privacy.batch_dims`). Sequence-first layers are handled by moving that
dimension first; a layer whose inputs are shared by all examples (nanoGPT's and GPT-2's
``wpe(arange(T))``) is handled by expanding its output to the batch, when that provably
leaves the forward's result unchanged, and refused otherwise. Every step is checked against
the probe.

Rules (:mod:`~lightning_dp.privacy.grad_sample.rules`, one module per layer family,
registered by type, :func:`register_rule` for your own): Linear and transformers' Conv1D;
Conv1d/2d/3d and ConvTranspose1d/2d/3d; Embedding and EmbeddingBag; LayerNorm, GroupNorm,
InstanceNorm, RMSNorm; RNN, LSTM, GRU; MultiheadAttention; anything else through
``torch.func`` (exact, slower).

Contract (checked, with clear errors): the loss is the batch MEAN of per-example losses,
so the per-example gradient is ``batch_size`` times the recorded contribution; every
trainable parameter is used only inside the forward of a module that owns it (a
parameter owned by two modules, tied weights, is fine); the set of trainable parameters is
the one the engine was built for (:meth:`GradSampleEngine.trainable_changed`). Only
trainable parameters count in the per-sample norm.

Example:
    >>> import torch
    >>> from lightning_dp.privacy.clipping import clip_factors
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))
    >>> engine = GradSampleEngine(model)
    >>> x, y = torch.randn(8, 4), torch.randint(0, 2, (8,))
    >>> engine.probe(lambda n: model(x[:n]))  # where the batch is: dimension 0 here
    >>> with engine.record():
    ...     torch.nn.functional.cross_entropy(model(x), y).backward()
    >>> norms = engine.per_sample_norms()
    >>> grads = engine.clipped_sum(clip_factors(norms, max_grad_norm=1.0))
    >>> engine.remove()
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
