"""``nn.Embedding`` and ``nn.EmbeddingBag`` (sum and mean, with offsets or 2-D input, per-sample weights;
``sparse=True``; ``max_norm``).

A :class:`~lightning_dp.privacy.grad_sample.contributions.OneHotFactored` contribution per lookup. The release
is dense whatever ``sparse`` says; with ``max_norm`` every row is renormalized before each forward
(``prepare_call``), so which rows change does not depend on the batch. Why: docs/per_sample_gradients.md, "How
the rules work".
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from lightning_dp.privacy.grad_sample.contributions import OneHotFactored
from lightning_dp.privacy.grad_sample.registry import LayerRule, PerSampleGradientError, register_rule

__all__ = ["EmbeddingBagRule", "EmbeddingRule"]


def _error(text: str):
    return PerSampleGradientError(text)


@register_rule(nn.Embedding)
class EmbeddingRule(LayerRule):
    """``nn.Embedding`` (``padding_idx`` rows receive nothing)."""

    def check(self, module, trainable):
        if module.scale_grad_by_freq:
            raise _error("nn.Embedding(scale_grad_by_freq=True) scales each token's gradient by its frequency in "
                         "the whole batch, so one example's gradient depends on the others; use "
                         "scale_grad_by_freq=False")

    def prepare_call(self, module):
        """``max_norm``: renormalizes EVERY row of the table before the forward (see the module docstring)."""
        if module.max_norm is not None:
            with torch.no_grad():
                rows = torch.arange(module.weight.shape[0], device=module.weight.device)
                torch.embedding_renorm_(module.weight, rows, module.max_norm, module.norm_type)

    def contributions(self, layer, records, batch_size):
        pad = layer.module.padding_idx
        ids, gs = [], []
        for r in records:
            idx = r.input(0).reshape(batch_size, -1)
            g = r.grad_outputs[0].reshape(batch_size, -1, r.grad_outputs[0].shape[-1])
            if pad is not None:
                g = g * (idx != pad).unsqueeze(-1).to(g.dtype)
            ids.append(idx)
            gs.append(g)
        idx, go = (ids[0], gs[0]) if len(ids) == 1 else (torch.cat(ids, 1), torch.cat(gs, 1))
        return {"weight": OneHotFactored(idx, go, layer.module.weight.shape)}


@register_rule(nn.EmbeddingBag)
class EmbeddingBagRule(LayerRule):
    """``nn.EmbeddingBag`` with ``mode="sum"`` or ``"mean"``; ``"max"`` is refused."""

    def check(self, module, trainable):
        EmbeddingRule.check(self, module, trainable)  # the same refusal of scale_grad_by_freq
        if module.mode == "max":
            raise _error("nn.EmbeddingBag(mode='max') routes each bag's gradient to the row of its largest entry; "
                         "per-sample gradients of that are not supported: use mode='sum' or 'mean'")

    prepare_call = EmbeddingRule.prepare_call  # max_norm: the whole table, as for nn.Embedding

    #: with 1-D input and ``include_last_offset=True`` no input tensor has one entry per example: the output does
    batch_from_output = True

    def check_dims(self, module, inputs, outputs, broadcast):
        if broadcast:
            raise _error("an EmbeddingBag on inputs shared by all examples (bags that are the same for every example) "
                         "is not supported: give it one bag per example, or freeze it")
        if outputs[0] != 0:
            raise _error("an EmbeddingBag's output must hold one bag per example in dimension 0")

    def contributions(self, layer, records, batch_size):
        m = layer.module
        ids, gs = [], []
        for r in records:
            idx, weights = self._bags(r, batch_size, m)
            ids.append(idx)
            gs.append(r.grad_outputs[0].unsqueeze(1) * weights.unsqueeze(-1).to(r.grad_outputs[0].dtype))
        idx, go = (ids[0], gs[0]) if len(ids) == 1 else (torch.cat(ids, 1), torch.cat(gs, 1))
        return {"weight": OneHotFactored(idx, go, m.weight.shape)}

    @staticmethod
    def _bags(r, batch_size: int, m: nn.EmbeddingBag) -> tuple[Tensor, Tensor]:
        """Indices ``(B, L)`` of each bag, padded, and what each position's row receives of ``go[b]``.

        The weight is the per-sample weight (sum mode) or ``1 / bag size`` (mean mode, the
        size counting no ``padding_idx`` entry, as PyTorch's reduction does); 0 for padding.
        """
        inp = r.call_args[0] if r.call_args else r.call_kwargs["input"]
        offsets = r.call_args[1] if len(r.call_args) > 1 else r.call_kwargs.get("offsets")
        psw = r.call_args[2] if len(r.call_args) > 2 else r.call_kwargs.get("per_sample_weights")
        if inp.dim() == 2:  # (B, L): bags of equal size
            idx = inp.reshape(batch_size, -1)
            valid = torch.ones(idx.shape, dtype=torch.bool, device=idx.device)
            weight_of = None if psw is None else psw.reshape(batch_size, -1)
        else:
            if offsets is None:
                raise _error("nn.EmbeddingBag called with 1-D input and no offsets")
            n = inp.shape[0]
            starts = offsets[:batch_size]
            ends = offsets[1:batch_size + 1] if m.include_last_offset else \
                torch.cat([offsets[1:batch_size], offsets.new_tensor([n])])
            lengths = ends - starts
            width = int(lengths.max()) if lengths.numel() else 0
            steps = torch.arange(width, device=inp.device)
            valid = steps < lengths.unsqueeze(1)
            pos = (starts.unsqueeze(1) + steps).clamp(max=max(n - 1, 0))
            idx = torch.where(valid, inp[pos], torch.zeros_like(pos))
            weight_of = None if psw is None else psw[pos]
        if m.padding_idx is not None:
            valid = valid & (idx != m.padding_idx)
        w = valid.to(torch.float64)
        if weight_of is not None:
            w = w * weight_of.to(torch.float64)
        if m.mode == "mean":
            w = w / valid.sum(1, keepdim=True).clamp_min(1).to(torch.float64)
        return idx, w
