"""Per-sample gradient norms and clipped gradient sums, computed by book-keeping.

Why hand-written: Opacus' hooks materialize every per-sample gradient and let autograd
compute the (discarded) batch gradient as well; its ghost clipping needs a second
backward pass. Neither fits a Lightning callback that must not change the user's
``training_step``. This engine follows the book-keeping idea of Bu et al. (2023,
"Differentially private optimization on large model at small cost"): one ordinary
backward pass in which

* a forward pre-hook freezes a layer's own parameters while that layer runs (when its
  input already requires grad), so autograd computes only the input gradients the
  chain rule needs and skips the weight gradients it would otherwise throw away;
* a forward hook records the layer input and a tensor hook on the output records the
  output gradient;
* after the backward pass, per-sample gradient norms are computed layer by layer,
  either by the "ghost norm" trick (Gram matrices of activations and output
  gradients, never materializing a per-sample gradient) or by instantiating the
  per-sample gradients, whichever a FLOP/memory cost model says is cheaper
  (:func:`choose_layer_strategy`), and the clipped sum is formed directly from the
  records (one matmul per layer, the same cost as the batch gradient autograd skipped).

Layers with a fast rule: ``nn.Linear`` (any number of middle dimensions),
``nn.Conv1d``/``2d``/``3d`` (any groups, padding mode, stride, dilation; per-sample
gradients from strided input windows and one einsum), ``nn.Embedding``.
Every other module that owns trainable parameters directly (LayerNorm, GroupNorm,
PReLU, custom modules, ...) falls back to ``torch.func`` (``vmap`` over ``vjp`` of the
module alone), which is exact but slower.

Where each layer holds the batch is established, not assumed: :meth:`GradSampleEngine.probe`
runs the forward pass on probe batches of several sizes and finds, for every tensor a
hooked layer receives or returns, the dimension that follows the number of examples
(:mod:`lightning_dp.privacy.batch_dims`). Sequence-first layers (``(T, B, d)``) are
handled by moving that dimension first; a layer whose input has no batch dimension
(a positional embedding of ``torch.arange(T)`` shared by every example) is refused,
since its gradient cannot be split by example. Every training step is checked against
the probe: the same structure, and the step's batch size at every established dimension.

Contract (checked, with clear errors): the loss is the batch MEAN of per-example losses,
so the per-example gradient is ``batch_size`` times the recorded contribution; every
trainable parameter is used only inside the forward of the module that owns it; the set
of trainable parameters is the one the engine was built for (:meth:`GradSampleEngine.trainable_changed`).
Only trainable parameters count in the per-sample norm (a frozen weight beside a
trainable bias adds nothing).

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

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_dp.privacy.batch_dims import PROBE_SIZES, AmbiguousBatchDimError, batch_dim

__all__ = ["GradSampleEngine", "PerSampleGradientError", "choose_layer_strategy", "trainable_parameters"]

#: Instantiated per-sample gradients larger than this (bytes, per layer) force the ghost norm.
DEFAULT_INSTANTIATE_LIMIT = 512 * 2**20


class PerSampleGradientError(RuntimeError):
    """Raised when per-sample gradients cannot be computed for the model as used."""


def choose_layer_strategy(batch: int, positions: int, d_in: int, d_out: int, *, bytes_per_element: int = 4,
                          instantiate_limit: int = DEFAULT_INSTANTIATE_LIMIT) -> str:
    """Chooses between the ghost norm and instantiated per-sample gradients for one weight.

    Costs in multiply-adds for a weight of shape ``(d_out, d_in)`` seen at ``positions``
    positions per example (sequence length, or output pixels of a convolution):

    * ghost: Gram matrices ``B T^2 (d_in + d_out)`` plus the clipped sum ``B T d_in d_out``;
    * instantiate: ``B T d_in d_out`` for the per-sample gradients plus ``3 B d_in d_out``
      for their norms and weighted sum, and ``B d_in d_out`` elements of memory.

    Returns:
        ``"ghost"`` or ``"instantiate"``.
    """
    ghost = batch * positions * positions * (d_in + d_out) + batch * positions * d_in * d_out
    inst = batch * positions * d_in * d_out + 3 * batch * d_in * d_out
    if batch * d_in * d_out * bytes_per_element > instantiate_limit:
        return "ghost"
    return "ghost" if ghost < inst else "instantiate"


class _JoinGraph(torch.autograd.Function):
    """Makes a tensor computed without grad part of the graph, without copying it.

    The output is marked dirty (as an in-place op would be), so it keeps its storage and
    may itself be modified in place later (``nn.ReLU(inplace=True)``). ``anchor`` is a
    0-dim leaf that requires grad; it only gives the node a reason to exist.
    """

    @staticmethod
    def forward(ctx: Any, output: Tensor, anchor: Tensor) -> Tensor:
        ctx.mark_dirty(output)
        return output

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None


@dataclass
class _Call:
    """What one forward call of a hooked module left behind."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    grad_output: Tensor | None = None


def _shape(value: Any) -> tuple[int, ...] | None:
    return tuple(value.shape) if isinstance(value, Tensor) else None


@dataclass(frozen=True)
class _CallShapes:
    """The tensor shapes of one call during a probe run (None for non-tensors)."""

    args: tuple[tuple[int, ...] | None, ...]
    kwargs: tuple[tuple[str, tuple[int, ...] | None], ...]
    output: tuple[int, ...] | None


@dataclass(frozen=True)
class _BatchDims:
    """Where one layer's calls hold the batch: per positional argument, keyword argument and output."""

    args: tuple[int | None, ...]
    kwargs: dict[str, int | None]
    output: int | None
    ranks: tuple[int | None, ...]  # ranks of the positional tensor arguments, to recognise a changed structure


@dataclass
class _Layer:
    """A module that owns trainable parameters directly, with its records for one step."""

    name: str
    module: nn.Module
    params: list[tuple[str, nn.Parameter]]
    rule: str
    calls: list[_Call] = field(default_factory=list)
    # per-sample gradients kept between the norm pass and the sum pass (instantiate strategy)
    cache: dict[str, Tensor] = field(default_factory=dict)
    # established by GradSampleEngine.probe
    dims: _BatchDims | None = None
    probe_calls: list[list[_CallShapes]] = field(default_factory=list)

    @property
    def trainable(self) -> set[str]:
        return {n for n, _ in self.params}


def _rule_for(module: nn.Module) -> str:
    if type(module) is nn.Linear or isinstance(module, nn.Linear):
        return "linear"
    if isinstance(module, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
        return "conv"
    if isinstance(module, nn.Embedding) and not module.sparse and not module.scale_grad_by_freq \
            and module.max_norm is None:
        return "embedding"
    return "functorch"


def trainable_parameters(module: nn.Module) -> tuple[int, ...]:
    """Identities of the parameters of ``module`` that require grad: the engine's trainable set."""
    return tuple(id(p) for p in module.parameters() if p.requires_grad)


class GradSampleEngine:
    """Book-keeping per-sample gradient engine (see the module docstring).

    Args:
        module: the model; hooks are attached to every submodule that owns trainable
            parameters directly. The set of trainable parameters is fixed when the engine
            is built: build a new engine when it changes (:meth:`trainable_changed`).
        instantiate_limit: bytes above which a layer never instantiates per-sample
            gradients (see :func:`choose_layer_strategy`).
    """

    def __init__(self, module: nn.Module, *, instantiate_limit: int = DEFAULT_INSTANTIATE_LIMIT) -> None:
        self.module = module
        self.instantiate_limit = int(instantiate_limit)
        self.layers: list[_Layer] = []
        self._trainable = trainable_parameters(module)
        owners: dict[int, str] = {}
        for mod_name, mod in module.named_modules():
            params = [(n, p) for n, p in mod.named_parameters(recurse=False) if p.requires_grad]
            if not params:
                continue
            for n, p in params:
                if id(p) in owners:
                    raise PerSampleGradientError(
                        f"parameter {mod_name}.{n} is shared with {owners[id(p)]} (tied weights). Per-sample "
                        "gradients of a parameter used by two modules are not supported; untie the weights "
                        "or freeze one copy (requires_grad=False).")
                owners[id(p)] = f"{mod_name}.{n}"
            self.layers.append(_Layer(mod_name or type(mod).__name__, mod, params, _rule_for(mod)))
        if not self.layers:
            raise PerSampleGradientError(
                f"{type(module).__name__} has no trainable parameters (none with requires_grad=True); "
                "there is nothing to train privately. Unfreeze at least one parameter.")
        self._recording = False
        self._probing = False
        self._probed = False
        self._anchor = torch.zeros((), requires_grad=True)
        self._buffers: dict[tuple[int, str], Tensor] = {}
        self._handles: list[Any] = []
        for layer in self.layers:
            self._handles.append(layer.module.register_forward_pre_hook(self._make_pre_hook(layer)))
            self._handles.append(layer.module.register_forward_hook(self._make_hook(layer), with_kwargs=True))

    # ------------------------------------------------------------------ hooks
    @property
    def parameters(self) -> list[nn.Parameter]:
        """The trainable parameters, in the order of :meth:`clipped_sum`'s output."""
        return [p for layer in self.layers for _, p in layer.params]

    @property
    def probed(self) -> bool:
        """Whether :meth:`probe` has established the batch dimensions."""
        return self._probed

    def trainable_changed(self) -> bool:
        """Whether the module's trainable parameters differ from those this engine was built for.

        A parameter unfrozen later (Lightning's ``BackboneFinetuning``, a hook that sets
        ``requires_grad``) would otherwise receive an ordinary, unclipped gradient; a
        parameter frozen later would be unfrozen again by the hooks.
        """
        return trainable_parameters(self.module) != self._trainable

    def _make_pre_hook(self, layer: _Layer):
        def pre_hook(mod: nn.Module, args: tuple[Any, ...]) -> None:
            if self._probing:
                return
            if not (self._recording and torch.is_grad_enabled()):
                return
            # Freeze the weights while this layer runs: autograd then computes only the
            # input gradients the chain rule needs, not the batch weight gradient that the
            # engine would throw away.
            for _, p in layer.params:
                p.requires_grad_(False)
            layer.calls.append(_Call(args=(), kwargs={}))
        return pre_hook

    def _make_hook(self, layer: _Layer):
        def hook(mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
            if self._probing:
                layer.probe_calls[-1].append(_CallShapes(
                    args=tuple(_shape(a) for a in args), kwargs=tuple((k, _shape(v)) for k, v in kwargs.items()),
                    output=_shape(output)))
                return
            if not (self._recording and torch.is_grad_enabled()):
                return
            call = layer.calls[-1]
            for _, p in layer.params:
                p.requires_grad_(True)
            if not isinstance(output, Tensor):
                raise PerSampleGradientError(
                    f"module {layer.name} ({type(mod).__name__}) returned {type(output).__name__}; the "
                    "per-sample gradient engine supports modules with trainable parameters that return one "
                    "tensor. Wrap the module or freeze its parameters.")
            call.args = tuple(a.detach() if isinstance(a, Tensor) else a for a in args)
            call.kwargs = dict(kwargs)
            if not output.requires_grad:
                # no input carried the graph (typically the first layer): join the output to it
                output = _JoinGraph.apply(output, self._anchor)

            def save_grad(grad: Tensor, call: _Call = call) -> None:
                call.grad_output = grad if call.grad_output is None else call.grad_output + grad

            output.register_hook(save_grad)
            return output
        return hook

    # ------------------------------------------------------------ batch dims
    def probe(self, run: Callable[[int], Any], sizes: Sequence[int] = PROBE_SIZES) -> None:
        """Establishes where every hooked layer's inputs and outputs hold the batch.

        Calls ``run(n)`` for every ``n`` in ``sizes``; each call must run the forward pass
        of a batch of ``n`` examples exactly as training does (autograd enabled; its result
        is discarded, no backward pass is needed). The shapes seen by every layer then say
        which dimension follows the number of examples (:func:`~lightning_dp.privacy.batch_dims.batch_dim`);
        per-sample gradients are computed along it and every training step is checked
        against it. Must be called before :meth:`per_sample_norms`, and again after the
        model's structure changes.

        Raises:
            PerSampleGradientError: If a layer's input or output has no batch dimension (its
                parameters act on something shared by all examples, such as a positional
                embedding of ``torch.arange(T)``), several dimensions follow the batch, or a
                layer's calls disagree on where the batch is.

        Example:
            >>> model = torch.nn.Linear(4, 2)
            >>> engine = GradSampleEngine(model)
            >>> x = torch.randn(10, 4)
            >>> engine.probe(lambda n: model(x[:n]))
            >>> engine.remove()
        """
        sizes = tuple(int(n) for n in sizes)
        if len(set(sizes)) != len(sizes) or len(sizes) < 2 or min(sizes) < 2:
            raise ValueError(f"sizes={sizes} must hold at least two distinct numbers of examples >= 2")
        if self._recording:
            raise PerSampleGradientError("probe() cannot run while a step is being recorded")
        for layer in self.layers:
            layer.probe_calls = []
        self._probing = True
        try:
            for n in sizes:
                for layer in self.layers:
                    layer.probe_calls.append([])
                with torch.enable_grad():
                    run(n)
        finally:
            self._probing = False
        for layer in self.layers:
            layer.dims = self._establish(layer, sizes)
            layer.probe_calls = []
        self._probed = True

    def _establish(self, layer: _Layer, sizes: tuple[int, ...]) -> _BatchDims | None:
        runs = layer.probe_calls
        if any(not calls for calls in runs):
            return None  # not called in some probe (conditional computation): refused if called in training
        where = f"layer {layer.name} ({type(layer.module).__name__})"
        found: list[_BatchDims] = []
        for j in range(min(len(calls) for calls in runs)):
            shapes = [calls[j] for calls in runs]
            try:
                args = tuple(None if shapes[0].args[i] is None else batch_dim([s.args[i] for s in shapes], sizes)
                             for i in range(len(shapes[0].args)))
                kwargs = {}
                for k, _ in shapes[0].kwargs:
                    seen = [dict(s.kwargs).get(k) for s in shapes]
                    kwargs[k] = None if any(v is None for v in seen) else batch_dim(seen, sizes)
                output = None if shapes[0].output is None else batch_dim([s.output for s in shapes], sizes)
            except AmbiguousBatchDimError as err:
                raise PerSampleGradientError(f"{where}: {err}. Per-sample gradients need each example's "
                                             "data in its own slice of one batch dimension.") from None
            found.append(_BatchDims(args, kwargs, output, tuple(None if s is None else len(s)
                                                                 for s in shapes[0].args)))
        if any(f != found[0] for f in found[1:]):
            raise PerSampleGradientError(
                f"{where} is called several times per step with the batch at different dimensions "
                f"({[f.args for f in found]}); use one layer per layout, or keep the batch first.")
        dims = found[0]
        batched_input = dims.args[0] if dims.args else None
        if layer.rule == "functorch":
            batched_input = next((d for d in (*dims.args, *dims.kwargs.values()) if d is not None), None)
        if batched_input is None or dims.output is None:
            seen = {n: next((s for s in calls[0].args if s is not None), None) for n, calls in zip(sizes, runs)}
            raise PerSampleGradientError(
                f"{where} receives an input without a batch dimension (input shapes {seen} for batches of "
                f"{list(sizes)} examples: no dimension follows the number of examples). Either its parameters act on "
                "something shared by all examples, such as a positional embedding of torch.arange(T) added to every "
                "sequence, whose gradient cannot be split by example: index it with a per-example tensor (e.g. "
                "pos = torch.arange(T).expand(B, T)) or freeze it (requires_grad=False). Or the batch is folded into "
                "another dimension, as (B, T, d) -> (B*T, d) does, which would clip tokens instead of examples: "
                "keep the batch dimension, e.g. apply nn.Linear to (B, T, d).")
        if layer.rule == "conv" and dims.args[0] != 0:
            raise PerSampleGradientError(f"{where} sees the batch at dimension {dims.args[0]}; a convolution needs "
                                         "its input as (batch, channels, ...)")
        if layer.rule in ("linear", "embedding") and dims.output != dims.args[0]:
            raise PerSampleGradientError(f"{where}: output batch dimension {dims.output} differs from the input's "
                                         f"{dims.args[0]}")
        return dims

    @contextlib.contextmanager
    def record(self) -> Iterator[None]:
        """Records layer inputs and output gradients of the forward/backward run inside."""
        self.start()
        try:
            yield
        finally:
            self.stop()

    def start(self) -> None:
        """Clears the previous records and the parameters' ``.grad``, and starts recording.

        While recording, autograd computes no gradient for the hooked parameters; a
        ``.grad`` found after the backward pass therefore reveals a parameter used outside
        its module (:meth:`check_parameter_gradients`).
        """
        self.clear()
        for p in self.parameters:
            p.grad = None
        self._recording = True

    def stop(self) -> None:
        """Stops recording (the records stay until :meth:`clear`)."""
        self._recording = False

    def clear(self) -> None:
        for layer in self.layers:
            layer.calls.clear()
            layer.cache.clear()

    def remove(self) -> None:
        """Removes every hook from the model and frees the work buffers."""
        self.stop()
        self.clear()
        self._buffers.clear()
        for h in self._handles:
            h.remove()
        self._handles.clear()

    # ------------------------------------------------------------ computation
    def batch_size(self) -> int:
        """The number of examples of the recorded step, read at the established batch dimensions.

        Raises:
            PerSampleGradientError: If batch dimensions were not established (:meth:`probe`),
                no layer ran, a called layer was never seen while probing, a tensor's rank
                differs from the probe's, or the layers disagree on the batch size.
        """
        if not self._probed:
            raise PerSampleGradientError(
                "the batch dimensions are not established: call engine.probe(run) with a function that runs the "
                "forward pass on n examples (DPSGD does this when training starts).")
        sizes: dict[int, str] = {}
        for layer in self.layers:
            if layer.calls and layer.dims is None:
                raise PerSampleGradientError(
                    f"layer {layer.name} ({type(layer.module).__name__}) ran in this step but not in every probe "
                    "run, so where its input holds the batch is not established (conditional computation?). Probe "
                    "again with batches that exercise it, or freeze its parameters.")
            for call in layer.calls:
                for size in self._call_sizes(layer, call):
                    sizes.setdefault(size, layer.name)
        if not sizes:
            raise PerSampleGradientError(
                "no trainable layer was called during the recorded forward pass; did training_step run the "
                "model with gradients enabled?")
        if len(sizes) > 1:
            raise PerSampleGradientError(
                f"the layers saw different batch sizes at their established batch dimensions ({sizes}); the step's "
                "structure differs from the probe's. Keep one batch dimension per layer.")
        return sizes.popitem()[0]

    @staticmethod
    def _call_sizes(layer: _Layer, call: _Call) -> list[int]:
        """The sizes of a call's tensors at their batch dimensions, after checking the structure."""
        dims = layer.dims
        assert dims is not None
        ranks = tuple(a.dim() if isinstance(a, Tensor) else None for a in call.args)
        if ranks != dims.ranks or set(call.kwargs) != set(dims.kwargs):
            raise PerSampleGradientError(
                f"layer {layer.name} ({type(layer.module).__name__}) was called with tensors of ranks {ranks} and "
                f"keywords {sorted(call.kwargs)}, but with ranks {dims.ranks} and keywords {sorted(dims.kwargs)} when "
                "probed; its batch dimension is not established for this call.")
        sizes = [a.shape[d] for a, d in zip(call.args, dims.args) if d is not None]
        sizes += [call.kwargs[k].shape[d] for k, d in dims.kwargs.items() if d is not None]
        return sizes

    def check_parameter_gradients(self) -> None:
        """Raises if autograd gave a gradient to a parameter outside its module's forward.

        Parameters are frozen while their module runs, so they cannot receive an autograd
        gradient there; if one did, the parameter was also used elsewhere (e.g. ``F.linear(x, self.fc.weight)`` in
        ``training_step``, or ``nn.MultiheadAttention.out_proj``) and its per-sample
        gradient would be wrong.
        """
        bad = [f"{layer.name}.{name}" for layer in self.layers for name, p in layer.params if p.grad is not None]
        if bad:
            raise PerSampleGradientError(
                f"parameters {bad} received gradients outside the forward of the module that owns them, so "
                "their per-sample gradients cannot be recorded. Use each parameter only through its module's "
                "forward (no F.linear(x, module.weight) in training_step; nn.MultiheadAttention is not "
                "supported), or freeze it with requires_grad=False.")

    def _records(self, layer: _Layer, scale: float) -> list[tuple[Any, Tensor]]:
        """The step's calls with their output gradients times ``scale``.

        For the fast rules, ``(input, grad_output)`` with the batch moved to dimension 0;
        for the ``torch.func`` rule, ``(call, grad_output)`` as recorded (it batches along
        the established dimensions itself).
        """
        dims = layer.dims
        out = []
        for c in layer.calls:
            if c.grad_output is None:
                continue
            if layer.rule == "functorch":
                out.append((c, c.grad_output * scale))
            else:
                assert dims is not None and dims.args[0] is not None and dims.output is not None
                out.append((c.args[0].movedim(dims.args[0], 0), c.grad_output.movedim(dims.output, 0) * scale))
        return out

    def per_sample_norms(self, *, loss_scale: float | None = None) -> Tensor:
        """Per-sample L2 norms of the full (flat) gradient of the trainable parameters, shape ``(batch,)``.

        Args:
            loss_scale: factor turning a recorded contribution into a per-example
                gradient; defaults to the batch size (the loss is a batch mean).
        """
        b = self.batch_size()
        scale = float(b) if loss_scale is None else float(loss_scale)
        self._scale = scale
        dtype = self.parameters[0].dtype
        device = self.parameters[0].device
        sq = torch.zeros(b, dtype=dtype, device=device)
        for layer in self.layers:
            records = self._records(layer, scale)
            if not records or b == 0:
                continue
            sq += getattr(self, f"_norms_{layer.rule}")(layer, records, b)
        # Gram-matrix (ghost) norms are sums of products that can round below zero in float32
        return sq.clamp_min_(0).sqrt()

    def clipped_sum(self, factors: Tensor) -> list[Tensor]:
        """Sum over the batch of per-sample gradients times ``factors``.

        Must follow :meth:`per_sample_norms` on the same records. Returns one tensor per
        parameter, in the order of :attr:`parameters` (zeros for unused parameters).
        """
        scale = getattr(self, "_scale", None)
        if scale is None:
            raise PerSampleGradientError("call per_sample_norms() before clipped_sum()")
        out: list[Tensor] = []
        for layer in self.layers:
            records = self._records(layer, scale)
            if not records or factors.numel() == 0:
                out.extend(torch.zeros_like(p) for _, p in layer.params)
                continue
            sums = getattr(self, f"_sum_{layer.rule}")(layer, records, factors)
            out.extend(sums[name] for name, _ in layer.params)
        return out

    # ------------------------------------------------------------- rule: linear
    @staticmethod
    def _linear_mats(records: Sequence[tuple[Tensor, Tensor]], b: int) -> tuple[Tensor, Tensor]:
        xs, gs = [], []
        for x, go in records:
            xs.append(x.reshape(b, -1, x.shape[-1]))
            gs.append(go.reshape(b, -1, go.shape[-1]))
        # several calls of one layer = one call over the concatenated positions
        return (torch.cat(xs, 1), torch.cat(gs, 1)) if len(xs) > 1 else (xs[0], gs[0])

    def _weight_sq_norms(self, layer: _Layer, x: Tensor, go: Tensor) -> Tensor:
        """Squared per-sample norms of ``sum_t go[b,t] x[b,t]^T``; x: (B,T,d), go: (B,T,p)."""
        b, t, d = x.shape
        p = go.shape[-1]
        if t == 1:
            return x.square().sum((1, 2)) * go.square().sum((1, 2))
        strategy = choose_layer_strategy(b, t, d, p, bytes_per_element=x.element_size(),
                                         instantiate_limit=self.instantiate_limit)
        if strategy == "ghost":
            return (torch.bmm(x, x.transpose(1, 2)) * torch.bmm(go, go.transpose(1, 2))).sum((1, 2))
        gs = torch.bmm(go.transpose(1, 2), x)  # (B, p, d)
        layer.cache["weight"] = gs
        return gs.square().sum((1, 2))

    @staticmethod
    def _weighted_weight_sum(layer: _Layer, x: Tensor, go: Tensor, factors: Tensor) -> Tensor:
        gs = layer.cache.get("weight")
        if gs is not None:
            return torch.einsum("b,bpd->pd", factors.to(gs.dtype), gs)
        p, d = go.shape[-1], x.shape[-1]
        return (go * factors.to(go.dtype)[:, None, None]).reshape(-1, p).T @ x.reshape(-1, d)

    def _norms_linear(self, layer: _Layer, records, b: int) -> Tensor:
        x, go = self._linear_mats(records, b)
        # only trainable parameters count: a frozen weight beside a trainable bias (BitFit) adds nothing
        sq = self._weight_sq_norms(layer, x, go) if "weight" in layer.trainable else x.new_zeros(b)
        if "bias" in layer.trainable:
            sq = sq + go.sum(1).square().sum(1)
        return sq

    def _sum_linear(self, layer: _Layer, records, factors: Tensor) -> dict[str, Tensor]:
        x, go = self._linear_mats(records, factors.shape[0])
        out = {}
        if "weight" in layer.trainable:
            out["weight"] = self._weighted_weight_sum(layer, x, go, factors)
        if "bias" in layer.trainable:
            out["bias"] = factors.to(go.dtype) @ go.sum(1)
        return out

    # --------------------------------------------------------------- rule: conv
    @staticmethod
    def _conv_input(m: nn.Module, x: Tensor) -> Tensor:
        """The input padded the way the convolution pads it (so the rest uses padding 0)."""
        pad = m._reversed_padding_repeated_twice
        if any(pad):
            x = F.pad(x, pad, mode="constant" if m.padding_mode == "zeros" else m.padding_mode)
        return x

    def _workspace(self, key: tuple[int, str], shape: tuple[int, ...], like: Tensor) -> Tensor:
        """A reusable buffer of ``shape`` (grown to the largest size seen, never shrunk).

        Poisson batches change size every step; allocating the large per-layer buffers
        afresh each time made the allocator map and fault in new pages on every step,
        which cost about 40% of the conv norm pass on CPU (docs/benchmarks.md).
        """
        n = math.prod(shape)
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < n or buf.dtype != like.dtype or buf.device != like.device:
            buf = torch.empty(n, dtype=like.dtype, device=like.device)
            self._buffers[key] = buf
        return buf[:n].view(shape)

    def _conv_grad_sample(self, layer: _Layer, records, b: int) -> Tensor:
        """Per-sample weight gradients, shape ``(B, groups, d, p)`` with ``d = C_in/groups * prod(k)``
        and ``p = C_out/groups``, from strided windows of the input.

        ``Tensor.unfold`` views the (padded) input as windows; one copy lays them out as
        ``(B*groups, d, T)`` (T output positions) in a reusable buffer and one batched matmul
        with the output gradients gives every example's gradient. Measured faster and
        steadier on CPU than ``F.unfold`` (im2col), an einsum, and a grouped weight-gradient
        convolution with the batch folded into the groups (docs/benchmarks.md).
        """
        m = layer.module
        nd = m.weight.dim() - 2
        g = m.groups
        c_out, d = m.weight.shape[0], m.weight[0].numel()
        p = c_out // g
        key = id(layer)
        total = None
        for x, go in records:
            x = self._conv_input(m, x)
            if x.dim() != nd + 2:
                raise PerSampleGradientError(f"layer {layer.name} got an input of shape {tuple(x.shape)}; "
                                             "per-sample gradients need a batched input (batch first)")
            for i in range(nd):
                k, dil, st = m.kernel_size[i], m.dilation[i], m.stride[i]
                x = x.unfold(2 + i, (k - 1) * dil + 1, st)
                if dil > 1:
                    x = x[..., ::dil]
            # (B, C, *S, *K) -> (B, C, *K, *S): the d index runs over (c, k) as in weight[o].flatten()
            x = x.permute(0, 1, *range(2 + nd, 2 + 2 * nd), *range(2, 2 + nd))
            t = math.prod(go.shape[2:])
            patches = self._workspace((key, "patches"), (b, g, d, t), x)
            patches.view(b, g, x.shape[1] // g, *x.shape[2:]).copy_(x.reshape(b, g, x.shape[1] // g, *x.shape[2:]))
            out = self._workspace((key, "grads"), (b, g, d, p), x) if total is None else None
            res = torch.bmm(patches.view(b * g, d, t), go.reshape(b * g, p, t).transpose(1, 2),
                            out=None if out is None else out.view(b * g, d, p))
            total = out if total is None else total + res.view(b, g, d, p)
        return total

    @staticmethod
    def _conv_weight_from(grads: Tensor, weight: Tensor) -> Tensor:
        """(groups, d, p) -> the weight's layout (C_out, C_in/groups, *k)."""
        return grads.transpose(1, 2).reshape(weight.shape)

    def _conv_mats(self, layer: _Layer, records, b: int) -> tuple[Tensor, Tensor]:
        """Unfolded inputs (B, T, C_in*k) and output grads (B, T, C_out), for the ghost norm."""
        m = layer.module
        if m.groups != 1 or isinstance(m, nn.Conv3d):
            raise PerSampleGradientError(
                f"layer {layer.name} is too large to instantiate per-sample gradients (instantiate_limit="
                f"{self.instantiate_limit} bytes) and the ghost norm supports Conv1d/Conv2d with groups=1 only; "
                "raise instantiate_limit or lower the batch size.")
        xs, gs = [], []
        for x, go in records:
            x = self._conv_input(m, x)
            if isinstance(m, nn.Conv1d):
                x = x.unsqueeze(2)
                kernel, dilation, stride = (1, *m.kernel_size), (1, *m.dilation), (1, *m.stride)
            else:
                kernel, dilation, stride = m.kernel_size, m.dilation, m.stride
            u = F.unfold(x, kernel, dilation=dilation, padding=0, stride=stride)  # (B, C_in*k, T)
            xs.append(u.transpose(1, 2))
            gs.append(go.reshape(b, go.shape[1], -1).transpose(1, 2))
        return (torch.cat(xs, 1), torch.cat(gs, 1)) if len(xs) > 1 else (xs[0], gs[0])

    def _conv_instantiates(self, layer: _Layer, b: int) -> bool:
        w = layer.module.weight
        return b * w.numel() * w.element_size() <= self.instantiate_limit

    def _norms_conv(self, layer: _Layer, records, b: int) -> Tensor:
        sq = records[0][1].new_zeros(b)
        if "weight" in layer.trainable:  # a frozen weight (BitFit) adds nothing to the norm
            if self._conv_instantiates(layer, b):
                gs = self._conv_grad_sample(layer, records, b)
                layer.cache["weight"] = gs
                sq = torch.linalg.vector_norm(gs.view(b, -1), dim=1).square()
            else:
                x, go = self._conv_mats(layer, records, b)
                layer.cache["mats"] = (x, go)
                sq = self._weight_sq_norms(layer, x, go)
        if "bias" in layer.trainable:
            bias = sum(go.reshape(b, go.shape[1], -1).sum(2) for _, go in records)
            layer.cache["bias"] = bias
            sq = sq + bias.square().sum(1)
        return sq

    def _sum_conv(self, layer: _Layer, records, factors: Tensor) -> dict[str, Tensor]:
        m = layer.module
        b = factors.shape[0]
        if "weight" not in layer.cache and "mats" not in layer.cache and "bias" not in layer.cache:
            self._norms_conv(layer, records, b)
        f = factors.to(m.weight.dtype)
        out = {}
        if "weight" in layer.trainable:
            if "weight" in layer.cache:
                gs = layer.cache["weight"]
                summed = (f @ gs.view(b, -1)).view(gs.shape[1:])
                out["weight"] = self._conv_weight_from(summed, m.weight)
            else:
                x, go = layer.cache["mats"]
                out["weight"] = self._weighted_weight_sum(layer, x, go, factors).reshape(m.weight.shape)
        if "bias" in layer.trainable:
            out["bias"] = f @ layer.cache["bias"]
        return out

    # ---------------------------------------------------------- rule: embedding
    @staticmethod
    def _embedding_mats(layer: _Layer, records, b: int) -> tuple[Tensor, Tensor]:
        ids, gs = [], []
        pad = layer.module.padding_idx
        for idx, go in records:
            idx = idx.reshape(b, -1)
            g = go.reshape(b, -1, go.shape[-1])
            if pad is not None:
                g = g * (idx != pad).unsqueeze(-1).to(g.dtype)
            ids.append(idx)
            gs.append(g)
        return (torch.cat(ids, 1), torch.cat(gs, 1)) if len(ids) > 1 else (ids[0], gs[0])

    def _norms_embedding(self, layer: _Layer, records, b: int) -> Tensor:
        idx, go = self._embedding_mats(layer, records, b)
        same = (idx.unsqueeze(2) == idx.unsqueeze(1)).to(go.dtype)  # (B, T, T)
        return (same * torch.bmm(go, go.transpose(1, 2))).sum((1, 2))

    def _sum_embedding(self, layer: _Layer, records, factors: Tensor) -> dict[str, Tensor]:
        idx, go = self._embedding_mats(layer, records, factors.shape[0])
        w = layer.module.weight
        weighted = (go * factors.to(go.dtype)[:, None, None]).reshape(-1, go.shape[-1])
        return {"weight": torch.zeros_like(w).index_add_(0, idx.reshape(-1), weighted)}

    # ---------------------------------------------------------- rule: functorch
    def _functorch_grads(self, layer: _Layer, records, b: int) -> dict[str, Tensor]:
        """Exact per-sample gradients of one module via torch.func (vmap over vjp)."""
        from torch.func import functional_call, vjp, vmap

        names = [n for n, _ in layer.params]
        params = {n: p.detach() for n, p in layer.params}
        total: dict[str, Tensor] = {}
        was_recording, self._recording = self._recording, False  # the replay must not be recorded
        try:
            for call, go in records:
                dims = layer.dims
                assert dims is not None
                kw_dims = {k: dims.kwargs.get(k) for k in call.kwargs}

                def one(go_i: Tensor, args_i: tuple[Any, ...], kwargs_i: dict[str, Any], _dims=dims,
                        _kw_dims=kw_dims) -> dict[str, Tensor]:
                    # one example, with a batch of one at the dimensions where the layer holds the batch
                    args = tuple(a if d is None else a.unsqueeze(d) for a, d in zip(args_i, _dims.args))
                    kwargs = {k: v if _kw_dims[k] is None else v.unsqueeze(_kw_dims[k]) for k, v in kwargs_i.items()}
                    _, pullback = vjp(lambda p: functional_call(layer.module, p, args, kwargs), params)
                    return pullback(go_i.unsqueeze(_dims.output))[0]

                try:
                    grads = vmap(one, in_dims=(dims.output, dims.args, kw_dims))(go, call.args, call.kwargs)
                except Exception as err:  # torch.func raises many types; say what failed and why
                    raise PerSampleGradientError(
                        f"torch.func could not compute per-sample gradients of {layer.name} "
                        f"({type(layer.module).__name__}): {err}. Freeze this module or replace it with "
                        "supported layers (Linear, Conv1d/2d, Embedding, LayerNorm, GroupNorm, ...).") from err
                for n in names:
                    total[n] = grads[n] if n not in total else total[n] + grads[n]
        finally:
            self._recording = was_recording
        return total

    def _norms_functorch(self, layer: _Layer, records, b: int) -> Tensor:
        grads = self._functorch_grads(layer, records, b)
        layer.cache.update(grads)
        return sum(g.reshape(b, -1).square().sum(1) for g in grads.values())

    def _sum_functorch(self, layer: _Layer, records, factors: Tensor) -> dict[str, Tensor]:
        grads = layer.cache or self._functorch_grads(layer, records, factors.shape[0])
        return {n: torch.einsum("b,b...->...", factors.to(g.dtype), g) for n, g in grads.items()}
