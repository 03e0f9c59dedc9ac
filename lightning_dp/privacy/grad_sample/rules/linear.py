"""``nn.Linear`` (and its subclasses) and Hugging Face ``transformers``' ``Conv1D`` (a linear layer with the weight
transposed, GPT-2's projections).

Per example, ``dW = sum_t go_t (x) x_t`` over the positions t of the example (tokens of a
``(B, T, d)`` input; any number of middle dimensions): a :class:`~lightning_dp.privacy.grad_sample.contributions.Factored`
contribution, whose norm is a ghost norm or an instantiated gradient as the cost model
says; ``db = sum_t go_t``.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from lightning_dp.privacy.grad_sample.contributions import Dense, Factored, position_terms, term_norms
from lightning_dp.privacy.grad_sample.registry import LayerRule, Record, register_rule

__all__ = ["LinearRule", "TransposedLinearRule", "positions"]


def positions(records: list[Record], batch_size: int) -> tuple[Tensor, Tensor]:
    """Inputs ``(B, T, d)`` and output gradients ``(B, T, p)`` of all calls, positions concatenated
    (several calls of one layer are one call over all their positions)."""
    xs, gs = [], []
    for r in records:
        x, go = r.input(0), r.grad_outputs[0]
        assert go is not None  # the output of a Linear holds the batch (probed by the engine)
        xs.append(x.reshape(batch_size, -1, x.shape[-1]))
        gs.append(go.reshape(batch_size, -1, go.shape[-1]))
    return (xs[0], gs[0]) if len(xs) == 1 else (torch.cat(xs, 1), torch.cat(gs, 1))


@register_rule(nn.Linear)
class LinearRule(LayerRule):
    """``y = x W^T + b``."""

    #: the weight is ``(d_in, d_out)``, as in ``transformers``' ``Conv1D``
    transposed = False

    def contributions(self, layer, records, batch_size):
        if len(records) == 1 and records[0].input(0).dim() == 2:
            # a batch of vectors: one position per example, the factors as they are (2-D), and the bias' gradient
            # is the output gradient itself, whose squared norms the weight's norm computes anyway
            x, go = records[0].input(0), records[0].grad_outputs[0]
            assert go is not None
        else:
            x, go = positions(records, batch_size)
        out = {}
        weight = None
        # the output gradient's norms per position, where the bias's floor needs them: the weight's rule reuses them
        go_norms = term_norms(go) if "bias" in layer.trainable and go.dim() > 2 else None
        if "weight" in layer.trainable:
            left, right = (x, go) if self.transposed else (go, x)
            weight = Factored(left, right, layer.module.weight.shape, instantiate_limit=layer.instantiate_limit,
                              factor_norms=(None, go_norms) if self.transposed else (go_norms, None))
            out["weight"] = weight
        if "bias" in layer.trainable:
            if go.dim() == 2:
                shared = None if weight is None else (weight.right_sq_norms if self.transposed else weight.left_sq_norms)
                out["bias"] = Dense(go, sq_norms=shared)
            else:  # summed over positions: clipped as at least term_floor() of them (floating point, contributions.py)
                assert go_norms is not None
                out["bias"] = Dense(go.sum(1), terms=position_terms(go_norms))
        return out


@register_rule("transformers.pytorch_utils.Conv1D")  # by name: transformers is not imported for this
class TransposedLinearRule(LinearRule):
    """``y = x W + b`` with ``W`` of shape ``(d_in, d_out)`` (``transformers.pytorch_utils.Conv1D``)."""

    transposed = True
