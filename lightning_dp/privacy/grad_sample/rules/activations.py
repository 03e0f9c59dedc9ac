"""``nn.PReLU``: ``y = max(0, x) + w * min(0, x)``, the slope ``w`` one number or one per channel (dimension 1).

Per example, ``dw = sum go * min(0, x)`` over every position (and over the channels too for one slope): the
gradient of a parameter shared by positions, summed from terms that can cancel, so floored as a norm layer's
(``Dense(terms=...)``: each position's term, the vector over the channels, or each entry for one slope;
docs/per_sample_gradients.md, "Floating point"). Written here rather than left to the ``torch.func`` fallback, which
computed the same gradients exactly but without a floor (and replayed the layer per example).
"""

from __future__ import annotations

from torch import nn

from lightning_dp.privacy.grad_sample.contributions import Dense, add_terms, position_terms
from lightning_dp.privacy.grad_sample.registry import LayerRule, PerSampleGradientError, register_rule

__all__ = ["PReLURule"]


@register_rule(nn.PReLU)
class PReLURule(LayerRule):
    def check_dims(self, module, inputs, outputs, broadcast):
        # one slope: every entry alike, any layout (the records hold the batch first); a slope per channel reads the
        # channels at dimension 1, which a layout with the batch elsewhere (time first) would not give it
        if module.num_parameters > 1 and not broadcast and (inputs[0] != 0 or outputs[0] != 0):
            raise PerSampleGradientError(f"sees the batch at dimension {inputs[0]}; nn.PReLU({module.num_parameters}) "
                                         "takes (batch, channels, ...) inputs, its slopes along dimension 1: move the "
                                         "batch first, or use one slope (nn.PReLU())")

    def contributions(self, layer, records, batch_size):
        m = layer.module
        total, terms = None, None
        for r in records:
            x, go = r.input(0), r.grad_outputs[0]
            prod = (go * x.clamp(max=0)).reshape(batch_size, x.shape[1] if x.dim() > 1 else 1, -1)  # (B, C, S)
            if m.num_parameters == 1:  # one slope: every entry a term
                grad = prod.sum((1, 2)).unsqueeze(1)
                t = position_terms(prod.reshape(batch_size, -1).abs())
            else:  # a slope per channel: each position's term the vector over the channels
                grad = prod.sum(2)
                t = position_terms((prod * prod).sum(1).sqrt())
            total = grad if total is None else total + grad
            terms = add_terms(terms, t)
        assert total is not None
        return {"weight": Dense(total, m.weight.shape, terms=terms)}
