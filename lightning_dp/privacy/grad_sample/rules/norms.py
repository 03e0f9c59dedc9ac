"""Normalization layers: ``nn.LayerNorm``, ``nn.GroupNorm``, ``nn.InstanceNorm1d/2d/3d`` (affine) and ``nn.RMSNorm``.

Each normalizes its input per example and applies an elementwise affine map
``y = x_hat * weight + bias``; per example ``dweight = sum go * x_hat`` and
``dbias = sum go``, summed over the positions the parameter is shared by. For LayerNorm and
RMSNorm ``x_hat`` is recomputed from the recorded input with PyTorch's own functional
(``F.layer_norm``, ``F.rms_norm`` without affine parameters), so it matches the forward's
numerics; GroupNorm and InstanceNorm (a group per channel) take both gradients of every
example from PyTorch's own group-norm backward with the batch folded into the channels
(:func:`_per_channel`: the plain step's formula, no normalized input kept). Native formulas
replace the ``torch.func`` fallback these layers used before (32 ms of a 151 ms ResNet-8 step
for GroupNorm).

BatchNorm is not here: it mixes the examples of a batch and is refused by
:mod:`lightning_dp.privacy.validators` (InstanceNorm with ``track_running_stats=True`` too).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_dp.privacy.grad_sample.contributions import Dense, add_terms, position_terms, term_norms
from lightning_dp.privacy.grad_sample.registry import LayerRule, PerSampleGradientError, register_rule

__all__ = ["GroupNormRule", "InstanceNormRule", "LayerNormRule", "RMSNormRule"]


def _contributions(layer, weight_sum: Tensor | None, bias_sum: Tensor | None,
                   terms: dict[str, tuple[Tensor, Tensor] | None]) -> dict[str, Dense]:
    """The per-sample ``dweight``/``dbias`` (batch first) as the layer's contributions (those it trains), each with
    its positions' terms (``Dense(terms=...)``: docs/per_sample_gradients.md, "Floating point")."""
    out = {}
    if weight_sum is not None:
        out["weight"] = Dense(weight_sum, layer.module.weight.shape, terms=terms["weight"])
    if bias_sum is not None:
        out["bias"] = Dense(bias_sum, layer.module.bias.shape, terms=terms["bias"])
    return out


def _affine(layer, records, batch_size: int, normalize) -> dict[str, Dense]:
    """Per-sample ``dweight``/``dbias`` of ``y = x_hat * w + b`` over trailing normalized dimensions (the
    parameters' shape): summed over every dimension between the batch and them, whose terms (``go_t * x_hat_t``,
    ``go_t``) are floored as a linear layer's on positions."""
    module = layer.module
    shape = module.weight.shape if module.weight is not None else module.bias.shape
    weight_sum, bias_sum = None, None
    terms: dict[str, tuple[Tensor, Tensor] | None] = {"weight": None, "bias": None}
    for r in records:
        go_c = r.grad_outputs[0].reshape(batch_size, -1, shape.numel())  # (B, ..., *normalized_shape)
        if "weight" in layer.trainable:
            prod = go_c * normalize(r.input(0)).reshape(go_c.shape)
            w = prod.sum(1)
            weight_sum = w if weight_sum is None else weight_sum + w
            terms["weight"] = add_terms(terms["weight"], position_terms(term_norms(prod)))
        if "bias" in layer.trainable:
            b = go_c.sum(1)
            bias_sum = b if bias_sum is None else bias_sum + b
            terms["bias"] = add_terms(terms["bias"], position_terms(term_norms(go_c)))
    return _contributions(layer, weight_sum, bias_sum, terms)


def _batch_first_input(self, module, inputs, outputs, broadcast):
    if not broadcast and (inputs[0] != 0 or outputs[0] != 0):
        raise PerSampleGradientError(f"sees the batch at dimension {inputs[0]}; {type(module).__name__} normalizes "
                                     "(batch, channels, ...) inputs")


@register_rule(nn.LayerNorm)
class LayerNormRule(LayerRule):
    def contributions(self, layer, records, batch_size):
        m = layer.module
        return _affine(layer, records, batch_size,
                       lambda x: F.layer_norm(x, m.normalized_shape, eps=m.eps))


def _forward_moments(output: Any, x: Any, groups: int, eps: float) -> tuple[Tensor, Tensor] | None:
    """The ``(mean, rstd)`` ``(B, groups)`` that the forward's group norm computed for exactly ``x`` (read from
    ``output``'s autograd node, which holds them for the plain backward), or None: no such node (an input that
    does not require grad, a compiled forward), one that normalized another tensor (a cast or contiguous copy of
    ``x``: autocast, a sliced input ``at::group_norm`` copied) or with other settings, or saved tensors packed by
    hooks (activation checkpointing, offloading: reading one would unpack it, which for a checkpointed layer runs
    it again inside the forward). Only the saved tensors' raw records are read before that is known; any failure
    of these private autograd attributes (another PyTorch) means None, and the rule computes the moments again."""
    fn: Any = output.grad_fn if isinstance(output, Tensor) else None  # private attributes below: untyped
    if fn is None or type(fn).__name__ != "NativeGroupNormBackward0" or not isinstance(x, Tensor):
        return None
    names = ("input", "result1", "result2")
    try:
        if any(getattr(fn, f"_raw_saved_{n}").unpack_hook is not None for n in names):
            return None
        saved = fn._saved_input
        if (saved.data_ptr() != x.data_ptr() or saved.shape != x.shape or saved.stride() != x.stride()
                or saved.dtype != x.dtype or fn._saved_group != groups or fn._saved_eps != eps
                or fn._saved_N != x.shape[0]):
            return None
        return fn._saved_result1.detach(), fn._saved_result2.detach()
    except Exception:  # noqa: BLE001  (an optimization only: anything unexpected falls back to recomputing)
        return None


def _per_channel(layer, records, batch_size: int, groups: int, eps: float) -> dict[str, Dense]:
    """Per-sample ``dweight``/``dbias`` ``(B, C)`` of a group normalization of ``(B, C, *S)`` inputs into ``groups``
    groups per example, from PyTorch's own group-norm backward with the batch folded into the channels: one
    example's ``(C, *S)`` is ``C`` channels of one ``(1, B * C, *S)`` input in ``B * groups`` groups, whose weight and
    bias gradients are then every example's (the same formula as the plain step's gradient: ``dweight = rstd *
    (sum go x - mean sum go)`` per channel). It reads the input twice and the output gradient once and writes nothing
    of their size but the normalization's output, against the normalized input and its product with the output
    gradient written and read again (ResNet-8's 32 x 32 layers, cache-cold: 0.81 against 1.24 ms; docs/benchmarks.md,
    "The windows gathered, in the order of the input")."""
    mask = ["weight" in layer.trainable, "bias" in layer.trainable]
    weight_sum, bias_sum = None, None
    terms: dict[str, tuple[Tensor, Tensor] | None] = {"weight": None, "bias": None}
    for r in records:
        x, go = r.input(0), r.grad_outputs[0]
        c = x.shape[1]
        positions = math.prod(x.shape[2:])
        # contiguous: the aten kernels read their inputs as contiguous memory without checking (an output gradient
        # expanded with stride 0 by a sum after the layer, or a sliced input, gave wrong values or an error)
        folded = x.reshape(1, batch_size * c, positions).contiguous()
        moments = r.extra.get("moments")
        if moments is not None and moments[0].dtype == folded.dtype and moments[0].numel() == batch_size * groups:
            # the forward's own: the same values the plain backward reads (ResNet-8: 3.9 ms a step less)
            mean, rstd = moments[0].reshape(1, -1), moments[1].reshape(1, -1)
        else:
            _, mean, rstd = torch.ops.aten.native_group_norm(folded, None, None, 1, batch_size * c, positions,
                                                             batch_size * groups, eps)
        grads = go.reshape(1, batch_size * c, positions).contiguous()
        # the positions' terms (docs/per_sample_gradients.md, "Floating point"): go_s * x_hat_s and go_s over the
        # channels at each position s; x_hat from the moments, one pass over the input
        by_group = grads.view(batch_size, groups, c // groups, positions)
        if mask[0]:  # ||go_s * x_hat_s||^2 = sum_g rstd_g^2 ||go_g,s * (x_g,s - mean_g)||^2: two passes written
            d = folded.view(batch_size, groups, c // groups, positions) - mean.view(batch_size, groups, 1, 1)
            d.mul_(by_group).square_()
            # (a sum over a group of one channel took 1.5 ms for ResNet-8's stem: the channel itself)
            per_group = d.squeeze(2) if c == groups else d.sum(2)
            sq = per_group.mul_(rstd.view(batch_size, groups, 1).square()).sum(1)
            terms["weight"] = add_terms(terms["weight"], position_terms(sq.sqrt_()))
        if mask[1]:  # (torch.linalg.vector_norm over the channels: 40 times slower, a strided reduction)
            terms["bias"] = add_terms(terms["bias"], position_terms((grads * grads).view(batch_size, c, positions)
                                                                    .sum(1).sqrt_()))
        _, w, b = torch.ops.aten.native_group_norm_backward(grads, folded, mean, rstd, folded.new_ones(batch_size * c),
                                                            1, batch_size * c, positions, batch_size * groups,
                                                            [False, *mask])
        if mask[0]:
            weight_sum = w.view(batch_size, c) if weight_sum is None else weight_sum + w.view(batch_size, c)
        if mask[1]:
            bias_sum = b.view(batch_size, c) if bias_sum is None else bias_sum + b.view(batch_size, c)
    return _contributions(layer, weight_sum, bias_sum, terms)


@register_rule(nn.GroupNorm)
class GroupNormRule(LayerRule):
    check_dims = _batch_first_input

    def after_call(self, module, args, output, extra):
        if args:
            moments = _forward_moments(output, args[0], module.num_groups, module.eps)
            if moments is not None:
                extra["moments"] = moments

    def contributions(self, layer, records, batch_size):
        m = layer.module
        return _per_channel(layer, records, batch_size, m.num_groups, m.eps)


@register_rule(nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d)
class InstanceNormRule(LayerRule):
    """An instance normalization is a group normalization with one channel per group."""

    check_dims = _batch_first_input

    def contributions(self, layer, records, batch_size):
        m = layer.module
        return _per_channel(layer, records, batch_size, records[0].input(0).shape[1], m.eps)


if hasattr(nn, "RMSNorm"):  # torch >= 2.4
    @register_rule(nn.RMSNorm)
    class RMSNormRule(LayerRule):
        def contributions(self, layer, records, batch_size):
            m = layer.module

            def normalize(x: Tensor) -> Tensor:
                return F.rms_norm(x, m.normalized_shape, eps=m.eps)

            return _affine(layer, records, batch_size, normalize)
else:  # pragma: no cover
    RMSNormRule = None  # type: ignore[assignment, misc]  # torch < 2.4 has no nn.RMSNorm
