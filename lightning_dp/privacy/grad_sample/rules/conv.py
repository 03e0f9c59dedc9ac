"""Convolutions: ``nn.Conv1d/2d/3d`` and ``nn.ConvTranspose1d/2d/3d`` (any groups, stride, padding, dilation).

On a CPU, a convolution with :data:`GROUPED_BACKWARD_MIN_CHANNELS` or more input channels per group and
:data:`GROUPED_BACKWARD_MIN_POSITIONS` or more output positions gets its per-sample weight gradients from one grouped
convolution backward (the batch folded into the groups: measured only on CPUs). Otherwise: input
windows (``Tensor.unfold``) and the output gradient, contracted by one batched matrix product per step (ghost norms
past the engine's ``instantiate_limit``); a transposed convolution swaps the roles. Why this layout and the
measurements: docs/per_sample_gradients.md, "How the rules work", and docs/benchmarks.md.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_dp.privacy.grad_sample.contributions import Dense, Factored
from lightning_dp.privacy.grad_sample.registry import LayerRule, PerSampleGradientError, register_rule

__all__ = ["ConvRule", "ConvTransposeRule"]


def _windows(x: Tensor, kernel, stride, dilation, count: list[int] | None = None) -> Tensor:
    """Strided windows of a padded ``(B, C, *S)`` tensor as a view ``(B, C, *T, *K)``."""
    for i in range(len(kernel)):
        k, dil, st = kernel[i], dilation[i], stride[i]
        x = x.unfold(2 + i, (k - 1) * dil + 1, st)
        if dil > 1:
            x = x[..., ::dil]
        if count is not None:  # a transposed convolution's output_padding can add a window
            x = x.narrow(2 + i, 0, count[i])
    return x


#: The orders in which a chunk's windows are copied, per example and group (dimension indices of the view
#: ``(B, groups, c, *T, *K)``, filled in by :func:`_order`): "d" rows ``(c, *K)`` by columns ``*T`` (the product gives
#: ``(d, p)``); "t" rows ``*T`` by columns ``(c, *K)``; "tc" rows ``*T`` by columns ``(*K, c)``, copied from the input in
#: channels-last layout (gives ``(p, *K, c)``).
LAYOUTS = ("d", "t", "tc")


def _order(layout: str, nd: int) -> list[int]:
    c, t, k = [2], list(range(3, 3 + nd)), list(range(3 + nd, 3 + 2 * nd))
    return [0, 1, *{"d": c + k + t, "t": t + c + k, "tc": t + k + c}[layout]]


def _run(view: Tensor, order: list[int]) -> int:
    """Elements of ``view`` that lie contiguously in memory along the innermost dimensions of ``order``: what the
    copy into that order reads in one stretch."""
    run = 1
    for dim in reversed(order):
        size, stride = view.shape[dim], view.stride(dim)
        if size == 1:
            continue
        if stride != run:
            break
        run *= size
    return run


def _channels_last(x: Tensor) -> Tensor:
    """``x`` ``(B, C, *S)`` with the channels innermost in memory (the same shape; a copy unless they already are)."""
    return x.movedim(1, -1).contiguous().movedim(-1, 1)


def _grouped_view(w: Tensor, groups: int) -> Tensor:
    """Windows ``(B, C, *T, *K)`` as ``(B, groups, C / groups, *T, *K)`` (a view)."""
    return w.view(w.shape[0], groups, w.shape[1] // groups, *w.shape[2:])


def _layout(x: Tensor, kernel, stride, dilation, count, groups: int) -> str:
    """The order in which the windows of the padded input ``x`` are copied: the one whose innermost dimensions read
    the longest contiguous stretch of the input. With stride 1 that is usually ``"d"`` (a row of output positions:
    the stride-1 CNN's first layer, 21 positions), with a larger stride ``"t"`` (a row of the kernel: 8 for the
    MNIST CNN's first layer against 1) or, with several channels, ``"tc"`` (a row of the kernel times the channels,
    from the input in channels-last layout: 64 for the MNIST CNN's second layer against 4). An input not already in
    that layout is converted first (one pass over it), so ``"tc"`` is taken then only for a stretch at least twice
    as long as the others' and windows at least twice as many as the input's elements (ResNet-8's 1 x 1 stride-2
    shortcut, a quarter: 1.55 ms converted against 0.48). Ties keep ``"d"``, as does every device but the CPU, where
    this was measured (docs/benchmarks.md, "The windows in the order of the input")."""
    if x.device.type != "cpu":  # measured on CPUs only; elsewhere the order before (docs/gpu.md)
        return "d"
    nd = len(kernel)
    w = _grouped_view(_windows(x, kernel, stride, dilation, count), groups)
    runs = {layout: _run(w, _order(layout, nd)) for layout in ("d", "t")}
    if x.stride(1) == 1 or x.shape[1] == 1:
        runs["tc"] = _run(w, _order("tc", nd))
    elif w.numel() >= 2 * x.numel():  # as it would be after the conversion (a meta tensor: strides only, no data)
        meta = _channels_last(torch.empty(x.shape, device="meta"))
        converted = _run(_grouped_view(_windows(meta, kernel, stride, dilation, count), groups), _order("tc", nd))
        runs["tc"] = converted if converted >= 2 * max(runs.values()) else 0
    else:  # windows fewer than twice the input (a 1 x 1 kernel with stride 2: a quarter): converting costs more
        runs["tc"] = 0
    return max(LAYOUTS, key=lambda layout: (runs[layout], -LAYOUTS.index(layout)))


def _grouped_grads(layer, x: Tensor, go: Tensor, groups: int, key: str, kernel, stride, dilation,
                   count: list[int] | None = None, layout: str | None = None) -> tuple[Tensor, str]:
    """Per-example gradients from the padded input ``x`` ``(B, C, *S)`` (its windows) and ``go`` ``(B, P, *T)``, in
    ``layout`` (default: :func:`_layout`'s): ``(B, groups, d, p)`` for ``"d"``, ``(B, groups, p, d)`` for ``"t"``
    and ``"tc"`` (``d`` running over ``(c, *K)``, or ``(*K, c)`` for ``"tc"``). Returns them and the layout.

    The windows are copied in that order (``prod(k)`` times the input over the batch), a chunk of examples at a
    time, into one scratch buffer shared by all layers (:func:`_chunk`): on a CPU about :data:`CPU_CHUNK_BYTES`, so
    that the product reads the copy from the cache it was just written to; elsewhere no larger than the input itself
    or :data:`SCRATCH_FLOOR_ELEMENTS`, whichever is larger.
    """
    layout = layout or _layout(x, kernel, stride, dilation, count, groups)
    # "tc" from an input whose channels are not innermost: each chunk's input is first copied channels-last into a
    # scratch buffer (read back from the cache by the windows' copy)
    convert = layout == "tc" and x.stride(1) != 1 and x.shape[1] != 1
    order = _order(layout, len(kernel))
    b, c = x.shape[:2]
    d = c // groups * math.prod(kernel)
    p = go.shape[1] // groups
    t = math.prod(go.shape[2:])
    out = layer.workspace(f"{key}:grads:{layout}", (b, groups, d, p) if layout == "d" else (b, groups, p, d), x)
    per_example = groups * d * t
    chunk = min(b, _chunk(b, per_example, c * t, x.element_size(), x.device.type))
    w = None if convert else _grouped_view(_windows(x, kernel, stride, dilation, count), groups).permute(order)
    for start in range(0, b, chunk):
        n = min(chunk, b - start)
        if w is None:
            part = x[start:start + n]
            cl = layer.workspace("conv:channels_last", (n, *part.shape[2:], c), x, shared=True)
            cl.copy_(part.movedim(1, -1))
            windows = _grouped_view(_windows(cl.movedim(-1, 1), kernel, stride, dilation, count), groups).permute(order)
        else:
            windows = w[start:start + n]
        patches = layer.workspace("conv:patches", tuple(windows.shape), x, shared=True)
        patches.copy_(windows)
        g = go[start:start + n].reshape(n * groups, p, t)
        if layout == "d":
            torch.bmm(patches.view(n * groups, d, t), g.transpose(1, 2), out=out[start:start + n].view(n * groups, d, p))
        else:
            torch.bmm(g, patches.view(n * groups, t, d), out=out[start:start + n].view(n * groups, p, d))
    return out, layout


#: The windows' scratch buffer may always hold this many elements (64 MiB in float32, 128 in float64; kept between
#: steps with the engine's buffers): below it, splitting the batch
#: saves no memory worth having and costs two kernel launches per chunk. On a GPU the step is launch-bound: the
#: thesis' MNIST CNN at batch 256 (8 x 8 kernels: 4 examples per chunk by the input's size alone) took 80 chunks and
#: 5.9 ms of per-sample norms per step on an H200 against 1.6 ms for the recorded forward and backward (docs/gpu.md).
SCRATCH_FLOOR_ELEMENTS = 2**24


#: Bytes of windows a chunk copies on a CPU (:func:`_grouped_grads`): the copy is then read back by the batched product
#: from the cache rather than from memory. Measured on 2 CPU cores (1 thread, thread CPU time, torch 2.13, 2026-12-06;
#: docs/benchmarks.md, "Windows a cache at a time"): the copy and the product of the stride-1 CNN's first layer (1 -> 16,
#: 8 x 8, 441 positions, batch 256) took 8.4 ms as one chunk and 5.0 ms in chunks of 2 MiB (1 MiB: 5.2, 8 MiB: 5.2);
#: the MNIST CNN's first 4.2 against 3.7 ms, its second 3.8 against 3.7, ResNet-8's stem 1.25 against 1.25.
CPU_CHUNK_BYTES = 2 * 2**20


def _chunk(batch: int, patch_elements: int, input_elements: int, itemsize: int, device_type: str) -> int:
    """Examples per chunk: on a CPU, so that the windows' copy of a chunk holds about :data:`CPU_CHUNK_BYTES`; on
    other devices about as many elements as the whole batch's input (``input_elements`` per example: channels x
    output positions), or :data:`SCRATCH_FLOOR_ELEMENTS` if that is more (fewer launches); at least one example."""
    if device_type == "cpu":
        return max(1, CPU_CHUNK_BYTES // max(patch_elements * itemsize, 1))
    return max(1, max(batch * input_elements, SCRATCH_FLOOR_ELEMENTS) // max(patch_elements, 1))


#: Input channels per group and output positions per example from which a convolution's per-sample gradients are one
#: grouped convolution backward (:func:`_grouped_conv_grads`) rather than windows and a batched matrix product
#: (:func:`_grouped_grads`). Measured on 2 CPU cores (1 thread, thread CPU time, torch 2.13; docs/benchmarks.md): one
#: layer at a time, with 16 and more channels the grouped backward took 0.4-1.1x the time of the windows (3.95 vs 9.4
#: ms for ResNet-8's 16 -> 16 3x3 convolutions at 32 x 32, 15.5 vs 60 ms for the stride-1 CNN's 16 -> 32 4x4), with 1
#: or 3 channels 1.0-2.8x (5.2 vs 1.9 ms for ResNet-8's 3-channel stem); in whole steps, ResNet-8 (64 to 1,024
#: positions) 120 vs 147 ms and the stride-1 CNN (289 and 441) 159 vs 196 ms, but the MNIST CNN's 16 -> 32 4x4 layer
#: at 25 positions 53 vs 42 ms, though 3.5 vs 4.4 ms alone.
GROUPED_BACKWARD_MIN_CHANNELS = 8
GROUPED_BACKWARD_MIN_POSITIONS = 64


def _grouped_conv_grads(m: nn.modules.conv._ConvNd, x: Tensor, go: Tensor) -> Tensor:
    """Per-example weight gradients ``(B, *weight.shape)`` of ``nn.ConvNd`` ``m`` on input ``x`` ``(B, C, *S)`` with
    output gradient ``go`` ``(B, O, *T)``: the weight gradient of one convolution whose groups are the examples' groups
    (the batch folded into the channels, ``B * groups`` groups), computed by PyTorch's own convolution backward (one
    call, no windows in memory)."""
    b = x.shape[0]
    if m.padding_mode != "zeros" or isinstance(m.padding, str):
        x = ConvRule._padded(m, x)  # reflect/circular/"same": padded here, then none
        padding: list[int] = [0] * (x.dim() - 2)
    else:
        padding = list(m.padding)
    xi = x.reshape(1, b * x.shape[1], *x.shape[2:])
    gi = go.reshape(1, b * go.shape[1], *go.shape[2:])
    # only the weight's shape is read (output_mask asks for the weight gradient alone)
    shape = (b * m.out_channels, m.in_channels // m.groups, *m.kernel_size)
    _, grads, _ = torch.ops.aten.convolution_backward(
        gi, xi, x.new_empty(shape), None, list(m.stride), padding, list(m.dilation), False,
        [0] * len(padding), b * m.groups, [False, True, False])
    return grads.view(b, *m.weight.shape)


def _to_weight(weight_shape, layout: str, nd: int):
    """Per-example gradients as :func:`_grouped_grads` lays them out, ``(groups, d, p)`` or ``(groups, p, d)``,
    batched or not -> the weight's layout ``(groups * p, c, *k)`` (``nn.ConvTranspose``'s ``(C_in, C_out/groups, *k)``
    is that convolution's)."""
    def convert(t: Tensor) -> Tensor:
        lead = t.shape[:-3]
        if layout == "d":
            t = t.transpose(-1, -2)
        elif layout == "tc":  # (groups, p, *K, c) -> (groups, p, c, *K)
            k = math.prod(weight_shape[2:])
            t = t.reshape(*lead, t.shape[-3], t.shape[-2], k, weight_shape[1]).transpose(-1, -2)
        return t.reshape(*lead, *weight_shape)
    assert layout in LAYOUTS and nd == len(weight_shape) - 2
    return convert


class _ConvBase(LayerRule):
    def _instantiates(self, layer, batch_size: int) -> bool:
        w = layer.module.weight  # the per-sample gradients are in the records' dtype (float32 under bf16-true)
        itemsize = torch.empty((), dtype=getattr(layer, "compute_dtype", w.dtype)).element_size()
        return batch_size * w.numel() * itemsize <= layer.instantiate_limit

    def check_dims(self, module, inputs, outputs, broadcast):
        if not broadcast and (inputs[0] != 0 or outputs[0] != 0):
            raise _error(f"sees the batch at dimension {inputs[0]} of its input; a convolution needs "
                         "(batch, channels, ...)")


def _error(text: str):
    return PerSampleGradientError(text)


@register_rule(nn.Conv1d, nn.Conv2d, nn.Conv3d)
class ConvRule(_ConvBase):
    """``nn.Conv1d/2d/3d``: windows of the input, contracted with the output gradient."""

    @staticmethod
    def _padded(m: nn.modules.conv._ConvNd, x: Tensor) -> Tensor:
        pad = m._reversed_padding_repeated_twice
        if any(pad):
            x = F.pad(x, pad, mode="constant" if m.padding_mode == "zeros" else m.padding_mode)
        return x

    def contributions(self, layer, records, batch_size):
        m = layer.module
        out = {}
        if "weight" in layer.trainable:
            if self._instantiates(layer, batch_size) and m.in_channels // m.groups >= GROUPED_BACKWARD_MIN_CHANNELS \
                    and math.prod(m.kernel_size) > 1 and m.weight.device.type == "cpu" \
                    and math.prod(records[0].grad_outputs[0].shape[2:]) >= GROUPED_BACKWARD_MIN_POSITIONS:
                total = None
                for r in records:
                    g = _grouped_conv_grads(m, r.input(0), r.grad_outputs[0])
                    total = g if total is None else total + g
                out["weight"] = Dense(total, m.weight.shape)
            elif self._instantiates(layer, batch_size):
                total, layout = None, None
                for i, r in enumerate(records):  # every call of the layer in the first call's layout
                    g, layout = _grouped_grads(layer, self._padded(m, r.input(0)), r.grad_outputs[0], m.groups,
                                               f"call{i}", m.kernel_size, m.stride, m.dilation, layout=layout)
                    total = g if total is None else total + g
                assert layout is not None
                out["weight"] = Dense(total, m.weight.shape, to_param=_to_weight(m.weight.shape, layout,
                                                                                  len(m.kernel_size)))
            else:
                out["weight"] = self._ghost(layer, records, batch_size)
        if "bias" in layer.trainable:
            out["bias"] = Dense(sum(r.grad_outputs[0].flatten(2).sum(2) for r in records))
        return out

    def _ghost(self, layer, records, batch_size):
        m = layer.module
        if m.groups != 1 or isinstance(m, nn.Conv3d):
            raise _error(f"layer {layer.name} is too large to instantiate per-sample gradients (instantiate_limit="
                         f"{layer.instantiate_limit} bytes) and the ghost norm supports Conv1d/Conv2d with groups=1 "
                         "only; raise instantiate_limit or lower the batch size.")
        xs, gs = [], []
        for r in records:
            x = self._padded(m, r.input(0))
            kernel, dilation, stride = m.kernel_size, m.dilation, m.stride
            if isinstance(m, nn.Conv1d):
                x = x.unsqueeze(2)
                kernel, dilation, stride = (1, *kernel), (1, *dilation), (1, *stride)
            xs.append(F.unfold(x, kernel, dilation=dilation, padding=0, stride=stride).transpose(1, 2))
            gs.append(r.grad_outputs[0].reshape(batch_size, m.out_channels, -1).transpose(1, 2))
        x, go = (torch.cat(xs, 1), torch.cat(gs, 1)) if len(xs) > 1 else (xs[0], gs[0])
        return Factored(go, x, m.weight.shape, instantiate_limit=layer.instantiate_limit)


@register_rule(nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)
class ConvTransposeRule(_ConvBase):
    """``nn.ConvTranspose1d/2d/3d``: windows of the output gradient, contracted with the input."""

    def check(self, module, trainable):
        if module.padding_mode != "zeros":
            raise _error(f"{type(module).__name__}(padding_mode={module.padding_mode!r}) is not supported (PyTorch "
                         "itself only supports 'zeros' for transposed convolutions)")

    def contributions(self, layer, records, batch_size):
        m = layer.module
        out = {}
        if "weight" in layer.trainable:
            if not self._instantiates(layer, batch_size):
                raise _error(f"layer {layer.name} is too large to instantiate per-sample gradients (instantiate_limit"
                             f"={layer.instantiate_limit} bytes); raise instantiate_limit or lower the batch size.")
            total, layout = None, None
            for i, r in enumerate(records):  # every call of the layer in the first call's layout
                x, go = r.input(0), r.grad_outputs[0]
                pad = [p for q in reversed(m.padding) for p in (q, q)]
                g, layout = _grouped_grads(layer, F.pad(go, pad) if any(pad) else go, x, m.groups, f"call{i}",
                                           m.kernel_size, m.stride, m.dilation, count=list(x.shape[2:]), layout=layout)
                total = g if total is None else total + g
            assert layout is not None
            out["weight"] = Dense(total, m.weight.shape, to_param=_to_weight(m.weight.shape, layout,
                                                                              len(m.kernel_size)))
        if "bias" in layer.trainable:
            out["bias"] = Dense(sum(r.grad_outputs[0].flatten(2).sum(2) for r in records))
        return out
