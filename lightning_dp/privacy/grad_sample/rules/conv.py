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

from lightning_dp.privacy.grad_sample.contributions import Dense, Factored, add_terms, position_terms
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


#: The orders in which a chunk's windows are laid out, per example and group (dimension indices of the view
#: ``(B, groups, c, *T, *K)``, filled in by :func:`_order`): "d" rows ``(c, *K)`` by columns ``*T`` (the product gives
#: ``(d, p)``); "t" rows ``*T`` by columns ``(c, *K)``; "tc" rows ``*T`` by columns ``(*K, c)`` (gives ``(p, *K, c)``;
#: for an input whose channels are innermost in memory, channels-last).
LAYOUTS = ("d", "t", "tc")

#: Below this many contiguous input elements per stretch in the best order, a chunk's windows are gathered by one
#: ``index_select`` over its flattened examples instead of copied from the strided view. On 2 CPU cores (1 thread,
#: torch 2.13, 2026-12-06; docs/benchmarks.md, "The windows gathered"): the gather costs about 0.4 ns a window element
#: whatever the order; the strided copy 0.1-0.2 ns with stretches of 17-64 (stride-1 layers: the stride-1 CNN's first,
#: 21 positions, 1.41 ms copied against 2.83 gathered; ResNet-8's stem, 32: 0.19 against 0.69) and 0.6-1.8 ns with
#: stretches of 1-8 (stride 2: the MNIST CNN's first layer, 8: 1.80 against 1.19; its second, 4 and 1: 1.41-2.94
#: against 0.61-0.65).
GATHER_BELOW_RUN = 16


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


def _grouped_view(w: Tensor, groups: int) -> Tensor:
    """Windows ``(B, C, *T, *K)`` as ``(B, groups, C / groups, *T, *K)`` (a view)."""
    return w.view(w.shape[0], groups, w.shape[1] // groups, *w.shape[2:])


def _laid_out(x: Tensor, kernel, stride, dilation, count, groups: int, layout: str) -> Tensor:
    """The windows of ``x`` ``(B, C, *S)`` as a view in ``layout``'s order (:func:`_order`), examples first."""
    return _grouped_view(_windows(x, kernel, stride, dilation, count), groups).permute(_order(layout, len(kernel)))


def _plan(x: Tensor, kernel, stride, dilation, count, groups: int, p: int) -> tuple[str, bool]:
    """How the windows of the padded input ``x`` are laid out: ``(layout, gathered)``.

    On a CPU: the order whose innermost dimensions read the longest contiguous stretch of ``x``, copied from the
    strided view when that stretch has :data:`GATHER_BELOW_RUN` elements or more (a row of output positions with
    stride 1: ``"d"``; a row of the kernel times the channels of a channels-last input: ``"tc"``). Otherwise they are
    gathered (``index_select``), in the order whose batched product measured faster: ``"t"``, giving ``(p, d)``, when
    ``p <= d``, else ``"d"`` (7 geometries, docs/benchmarks.md: the better order in 5, 0.1-0.25 ms from it in the other
    two). Other devices: copied in order ``"d"`` (their step is launch-bound; not measured)."""
    if x.device.type != "cpu":
        return "d", False
    nd = len(kernel)
    w = _grouped_view(_windows(x, kernel, stride, dilation, count), groups)
    runs = {layout: _run(w, _order(layout, nd)) for layout in LAYOUTS}
    best = max(LAYOUTS, key=lambda layout: (runs[layout], -LAYOUTS.index(layout)))  # ties: the earlier one
    if runs[best] >= GATHER_BELOW_RUN:
        return best, False
    return ("t" if p <= x.shape[1] // groups * math.prod(kernel) else "d"), True


_GATHER_INDEX: dict[tuple, Tensor] = {}
#: Bytes of gather indices kept (:func:`_gather_index`); past it the cache starts again.
GATHER_CACHE_BYTES = 64 * 2**20


def _gather_index(shape: tuple[int, ...], kernel, stride, dilation, count, groups: int, layout: str) -> Tensor:
    """Positions in one flattened example ``(C, *S)`` of its windows in ``layout``'s order: int32 (int64 past 2^31
    positions), as many entries as one example's windows (kilobytes for the models here; 7 MiB for a 7 x 7 stride-2
    stem on 230 x 230 x 3). Cached per geometry up to :data:`GATHER_CACHE_BYTES`, except while ``torch.compile``
    traces the pass: there the index is built in the graph (a cache filled during tracing would fail the graph's
    guard on the next step and recompile it)."""
    key = (shape, tuple(kernel), tuple(stride), tuple(dilation), None if count is None else tuple(count), groups, layout)
    compiling = torch.compiler.is_compiling()
    index = None if compiling else _GATHER_INDEX.get(key)
    if index is None:
        n = math.prod(shape)
        positions = torch.arange(n, dtype=torch.int32 if n < 2**31 else torch.int64).view(1, *shape)
        index = _laid_out(positions, kernel, stride, dilation, count, groups, layout).reshape(-1)
        if not compiling:
            if sum(t.numel() * t.element_size() for t in _GATHER_INDEX.values()) > GATHER_CACHE_BYTES:
                _GATHER_INDEX.clear()
            _GATHER_INDEX[key] = index
    return index


def _grouped_grads(layer, x: Tensor, go: Tensor, groups: int, key: str, kernel, stride, dilation,
                   count: list[int] | None = None, plan: tuple[str, bool] | None = None
                   ) -> tuple[Tensor, tuple[str, bool]]:
    """Per-example gradients from the padded input ``x`` ``(B, C, *S)`` (its windows) and ``go`` ``(B, P, *T)``, laid
    out as ``plan`` says (default: :func:`_plan`'s): ``(B, groups, d, p)`` for layout ``"d"``, ``(B, groups, p, d)``
    for ``"t"`` and ``"tc"`` (``d`` running over ``(c, *K)``, or ``(*K, c)`` for ``"tc"``). Returns them and the plan.

    The windows (``prod(k)`` times the input over the batch) are copied or gathered a chunk of examples at a time into
    one scratch buffer shared by all layers (:func:`_chunk`): on a CPU about :data:`CPU_CHUNK_BYTES`, so that the
    product reads them from the cache they were just written to; elsewhere no larger than the input itself or
    :data:`SCRATCH_FLOOR_ELEMENTS`, whichever is larger.
    """
    b, c = x.shape[:2]
    d = c // groups * math.prod(kernel)
    p = go.shape[1] // groups
    t = math.prod(go.shape[2:])
    layout, gathered = plan = plan or _plan(x, kernel, stride, dilation, count, groups, p)
    # one buffer whichever the layout (the same size): a plan that changes between steps keeps no second one
    out = layer.workspace(f"{key}:grads", (b, groups, d, p) if layout == "d" else (b, groups, p, d), x)
    per_example = groups * d * t
    chunk = min(b, _chunk(b, per_example, c * t, x.element_size(), x.device.type))
    if gathered:
        index = _gather_index(tuple(x.shape[1:]), kernel, stride, dilation, count, groups, layout).to(x.device)
    else:
        windows = _laid_out(x, kernel, stride, dilation, count, groups, layout)
    for start in range(0, b, chunk):
        n = min(chunk, b - start)
        patches = layer.workspace("conv:patches", (n, per_example), x, shared=True)
        if gathered:  # a chunk's examples flattened (a copy only where they are not contiguous: channels-last)
            torch.index_select(x[start:start + n].reshape(n, -1), 1, index, out=patches)
        else:
            patches.view(n, *windows.shape[1:]).copy_(windows[start:start + n])
        g = go[start:start + n].reshape(n * groups, p, t)
        if layout == "d":
            torch.bmm(patches.view(n * groups, d, t), g.transpose(1, 2), out=out[start:start + n].view(n * groups, d, p))
        else:
            torch.bmm(g, patches.view(n * groups, t, d), out=out[start:start + n].view(n * groups, p, d))
    return out, plan


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


def _to_weight(weight_shape, layout: str):
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
    assert layout in LAYOUTS
    return convert


def _position_terms(windowed: Tensor, other: Tensor, groups: int, kernel, stride, dilation, pad, mode: str,
                    count: list[int] | None = None) -> tuple[Tensor, tuple[Tensor, Tensor]]:
    """The magnitudes of the positions' terms of each example's weight gradient ``G_b = sum_t other[b, :, t] (x)
    window_t(windowed[b])`` (per group), summed: ``(sizes, counts)`` float64 ``(B,)`` for :class:`Dense`'s ``terms``
    (its floor, :func:`~lightning_dp.privacy.grad_sample.contributions.term_floor`); and the squared norms of
    ``other`` per position, ``(B, *T)``, whose roots are the bias's terms (a bias gradient is ``sum_t other[b, :, t]``).

    A position's term has norm ``sqrt(sum_g ||other_g||^2 ||window_g||^2)``: the windows' squared norms are one
    depthwise convolution of the input's squares (summed over each group's channels) by a kernel of ones, padded as the
    layer pads (padding copies values, so it commutes with squaring), never the windows themselves: passes over the
    input and the output gradient (ResNet-8's step 12 ms slower, the MNIST CNN's 1.5: docs/benchmarks.md). Without
    this floor, 1,023 identical examples whose two positions' terms cancel moved
    neighbouring clipped sums 50 C apart under a mean loss (docs/per_sample_gradients.md, "Floating point"). The
    squares are taken in the tensors' dtype: an entry beyond 1.8e19 in float32 overflows them, and the example is
    dropped (:func:`~lightning_dp.privacy.grad_sample.contributions.term_norms`)."""
    b, nd = windowed.shape[0], len(kernel)

    def per_group(t: Tensor) -> Tensor:  # (B, C, *S) -> squares summed over each group's channels, (B, groups, *S)
        # (torch.linalg.vector_norm over the channels: 40 times slower, a reduction over a strided dimension)
        sq = t * t
        return sq if t.shape[1] == groups else sq.unflatten(1, (groups, t.shape[1] // groups)).sum(2)

    wsq = per_group(windowed)
    if any(pad):
        wsq = F.pad(wsq, pad, mode="constant" if mode == "zeros" else mode)
    # the window sums as one depthwise convolution with the batch folded into its channels (ResNet-8's 3 x 3 at 32 x 32:
    # 0.08 ms against 0.19 with the groups' channels alone; the MNIST CNN's 8 x 8: 0.14 against 0.56)
    channels = b * groups
    ones = wsq.new_ones(1, 1, *kernel).expand(channels, 1, *kernel)
    wsq = (F.conv1d, F.conv2d, F.conv3d)[nd - 1](wsq.reshape(1, channels, *wsq.shape[2:]), ones, stride=stride,
                                                 dilation=dilation, groups=channels)
    wsq = wsq.view(b, groups, *wsq.shape[2:])
    if count is not None:  # a transposed convolution's output_padding can add a window
        for i in range(nd):
            wsq = wsq.narrow(2 + i, 0, count[i])
    osq = per_group(other)
    if groups == 1:  # the roots first: a term overflows float32 only where it is beyond float32's range itself
        terms = osq.sqrt().mul_(wsq.clamp_min(0).sqrt_())
    else:
        terms = (osq.double() * wsq.double().clamp_min(0)).sum(1).sqrt()
    # (a sum over a dimension of one: 1.5 ms on ResNet-8's stem, against a view)
    return (osq.squeeze(1) if groups == 1 else osq.sum(1)), position_terms(terms.reshape(b, -1))


def _bias(records, records_sq: list[Tensor] | None = None) -> Dense:
    """A convolution's bias gradient (the output gradient summed over positions, over every call) with its terms:
    each record's output gradient per position, whose squared norms ``records_sq`` the weight's terms computed
    already (:func:`_position_terms`), or None (the bias trained alone)."""
    if records_sq is None:
        records_sq = [r.grad_outputs[0].square().sum(1) for r in records]
    terms = position_terms(torch.cat([sq.reshape(sq.shape[0], -1) for sq in records_sq], 1).double().sqrt())
    return Dense(sum(r.grad_outputs[0].flatten(2).sum(2) for r in records), terms=terms)


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
        # the output gradient's squared norms per position, per record: the bias's terms (:func:`_position_terms`)
        go_sq: list[Tensor] = []
        if "weight" in layer.trainable:
            if self._instantiates(layer, batch_size):
                grouped_backward = m.in_channels // m.groups >= GROUPED_BACKWARD_MIN_CHANNELS \
                    and math.prod(m.kernel_size) > 1 and m.weight.device.type == "cpu" \
                    and math.prod(records[0].grad_outputs[0].shape[2:]) >= GROUPED_BACKWARD_MIN_POSITIONS
                total, plan, terms = None, None, None
                for i, r in enumerate(records):  # every call of the layer laid out as the first call's
                    x, go = r.input(0), r.grad_outputs[0]
                    if grouped_backward:
                        g = _grouped_conv_grads(m, x, go)
                    else:
                        g, plan = _grouped_grads(layer, self._padded(m, x), go, m.groups, f"call{i}", m.kernel_size,
                                                 m.stride, m.dilation, plan=plan)
                    total = g if total is None else total + g
                    sq, t = _position_terms(x, go, m.groups, m.kernel_size, m.stride, m.dilation,
                                            m._reversed_padding_repeated_twice, m.padding_mode)
                    go_sq.append(sq)
                    terms = add_terms(terms, t)
                assert total is not None and terms is not None
                if grouped_backward:
                    out["weight"] = Dense(total, m.weight.shape, terms=terms)
                else:
                    assert plan is not None
                    out["weight"] = Dense(total, m.weight.shape, to_param=_to_weight(m.weight.shape, plan[0]),
                                          terms=terms)
            else:
                out["weight"] = self._ghost(layer, records, batch_size)
        if "bias" in layer.trainable:
            out["bias"] = _bias(records, go_sq or None)
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
            total, plan, terms = None, None, None
            for i, r in enumerate(records):  # every call of the layer laid out as the first call's
                x, go = r.input(0), r.grad_outputs[0]
                pad = [p for q in reversed(m.padding) for p in (q, q)]
                g, plan = _grouped_grads(layer, F.pad(go, pad) if any(pad) else go, x, m.groups, f"call{i}",
                                         m.kernel_size, m.stride, m.dilation, count=list(x.shape[2:]), plan=plan)
                total = g if total is None else total + g
                # the roles swapped: the output gradient's windows, one per input position
                terms = add_terms(terms, _position_terms(go, x, m.groups, m.kernel_size, m.stride, m.dilation, pad,
                                                         "zeros", count=list(x.shape[2:]))[1])
            assert plan is not None and terms is not None
            out["weight"] = Dense(total, m.weight.shape, to_param=_to_weight(m.weight.shape, plan[0]), terms=terms)
        if "bias" in layer.trainable:
            out["bias"] = _bias(records)
        return out
