"""Hand-written per-client gradients for models that are a chain of dense layers (the ``"dense"`` client engine).

The backward pass of each client's own model, as batched matrix products per layer applied in place, instead of
``vmap(grad(...))``. :meth:`DenseChain.of` traces the model with ``torch.fx`` and accepts only a chain of
supported steps (anything else: ``None`` with the reason, and the round uses ``vmap``); the gradients are those of
:func:`~lightning_dp.federated.local.masked_loss` (tested against ``vmap(grad)`` in float64 to 1e-12). Which
models, what it gains, why by hand: docs/federated.md, "How a round trains its clients".
"""

from __future__ import annotations

import math
import operator
import weakref
from dataclasses import dataclass
from collections.abc import Callable, Iterator
from typing import Any, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_dp.federated.local import outputs_agree

__all__ = ["DenseChain", "DenseSteps", "dense_chain"]

_ACTIVATIONS: dict[Any, str] = {nn.ReLU: "relu", nn.Tanh: "tanh", nn.Sigmoid: "sigmoid", nn.Identity: "identity"}
_FUNCTIONS: dict[Any, str] = {torch.relu: "relu", F.relu: "relu", torch.tanh: "tanh", torch.sigmoid: "sigmoid",
                              F.tanh: "tanh", F.sigmoid: "sigmoid"}
_METHODS = {"relu": "relu", "tanh": "tanh", "sigmoid": "sigmoid"}


@dataclass(frozen=True)
class _Linear:
    weight: slice
    bias: slice | None
    out_features: int
    in_features: int


@dataclass(frozen=True)
class _Activation:
    kind: str


@dataclass(frozen=True)
class _Flatten:
    start: int  # of the model's (b, ...) tensor; >= 1 (the batch dimension is never merged)
    end: int


@dataclass(frozen=True)
class _Squeeze:
    dim: int  # of the model's (b, ...) tensor, negative or >= 1


_Step = Union[_Linear, _Activation, _Flatten, _Squeeze]


class _NotDense(Exception):
    pass


def _arg(node: Any, position: int, name: str, default: Any) -> Any:
    if len(node.args) > position:
        return node.args[position]
    return node.kwargs.get(name, default)


def _dim(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _NotDense(f"{what} with a non-constant dimension {value!r}")
    return value


@dataclass(frozen=True)
class DenseChain:
    """A model read as a chain of dense steps, with the offsets of its ``Linear`` parameters in the flat vector."""

    steps: tuple[_Step, ...]

    # ------------------------------------------------------------------ building
    @classmethod
    def of(cls, template: nn.Module, spec: Any) -> tuple[DenseChain | None, str]:
        """``(chain, "")`` when ``template`` is a chain of dense steps whose parameters are exactly ``spec``'s
        trainable ones, else ``(None, why not)``. ``spec`` is the model's
        :class:`~lightning_dp.federated.local.FlatParams`."""
        try:
            return cls(tuple(cls._steps(template, spec))), ""
        except _NotDense as why:
            return None, str(why)

    @staticmethod
    def _steps(template: nn.Module, spec: Any) -> list[_Step]:
        import torch.fx

        if any(True for _ in template.buffers()):
            raise _NotDense("the model has buffers")
        for name, module in template.named_modules():
            if any(_hooks(module)):  # torch.fx traces around hooks; functional_call (the vmap engine) runs them
                raise _NotDense(f"module {name or type(template).__name__!r} has hooks")
        if any(_global_hooks()):
            raise _NotDense("global module hooks are registered")
        try:
            graph = torch.fx.symbolic_trace(template).graph
        except Exception as error:  # noqa: BLE001 - any model torch.fx cannot trace is simply not a chain
            raise _NotDense(f"torch.fx cannot trace the model ({type(error).__name__}: {error})") from None
        offsets, start = {}, 0
        for name, size in zip(spec.names, spec.sizes):
            offsets[name] = slice(start, start + size)
            start += size
        nodes = list(graph.nodes)
        placeholders = [n for n in nodes if n.op == "placeholder"]
        if len(placeholders) != 1:
            raise _NotDense(f"the model's forward takes {len(placeholders)} inputs, not one")
        steps: list[_Step] = []
        used: set[str] = set()
        previous = placeholders[0]
        for node in nodes:
            if node.op == "placeholder":
                continue
            if node.op == "output":
                if node.args[0] is not previous:
                    raise _NotDense("the model's output is not the last step of a chain")
                break
            if len(previous.users) != 1:
                raise _NotDense(f"{previous.name} is used by {len(previous.users)} steps (not a chain)")
            if not node.args or node.args[0] is not previous or any(
                    isinstance(a, torch.fx.Node) for a in (*node.args[1:], *node.kwargs.values())):
                raise _NotDense(f"step {node.name} does not take the previous step as its only tensor input")
            steps.append(DenseChain._step(template, node, offsets, used))
            previous = node
        trainable = {n for n in spec.names}
        if used != trainable:
            raise _NotDense(f"parameters {sorted(trainable - used)} are trained but not used by the chain")
        if not any(isinstance(s, _Linear) for s in steps):
            raise _NotDense("the chain has no Linear layer")
        return steps

    @staticmethod
    def _step(template: nn.Module, node: Any, offsets: dict[str, slice], used: set[str]) -> _Step:
        if node.op == "call_module":
            module = template.get_submodule(node.target)
            if type(module) in _ACTIVATIONS:
                return _Activation(_ACTIVATIONS[type(module)])
            if type(module) is nn.Flatten:
                return DenseChain._flatten(module.start_dim, module.end_dim)
            if type(module) is nn.Linear:
                names = [f"{node.target}.weight"] + ([f"{node.target}.bias"] if module.bias is not None else [])
                missing = [n for n in names if n not in offsets]
                if missing:
                    raise _NotDense(f"Linear {node.target} has frozen parameters {missing}")
                if used.intersection(names):
                    raise _NotDense(f"Linear {node.target} is used twice (shared weights)")
                used.update(names)
                return _Linear(offsets[names[0]], offsets[names[1]] if len(names) > 1 else None,
                               module.out_features, module.in_features)
            raise _NotDense(f"module {node.target} ({type(module).__name__}) has no dense gradient here")
        if (node.op == "call_function" and node.target in _FUNCTIONS and len(node.args) == 1
                and set(node.kwargs.items()) <= {("inplace", False)}):
            return _Activation(_FUNCTIONS[node.target])
        if node.op == "call_method" and node.target in _METHODS and len(node.args) == 1 and not node.kwargs:
            return _Activation(_METHODS[node.target])
        if (node.op, node.target) in (("call_method", "flatten"), ("call_function", torch.flatten)):
            return DenseChain._flatten(_arg(node, 1, "start_dim", 0), _arg(node, 2, "end_dim", -1))
        if (node.op, node.target) in (("call_method", "squeeze"), ("call_function", torch.squeeze)):
            if len(node.args) < 2 and "dim" not in node.kwargs:
                raise _NotDense("squeeze() without a dimension (it would squeeze a batch of one)")
            dim = _dim(_arg(node, 1, "dim", None), "squeeze")
            if dim == 0:
                raise _NotDense("squeeze(0) squeezes the batch dimension")
            return _Squeeze(dim)
        if node.op == "call_function" and node.target is operator.getitem:
            raise _NotDense(f"indexing ({node.name})")
        raise _NotDense(f"{node.op} {getattr(node.target, '__name__', node.target)!s} has no dense gradient here")

    @staticmethod
    def _flatten(start: Any, end: Any) -> _Flatten:
        start, end = _dim(start, "flatten"), _dim(end, "flatten")
        if start == 0:
            raise _NotDense("flatten from dimension 0 merges the batch")
        return _Flatten(start, end)

    # ------------------------------------------------------------------ shapes
    def output_shape(self, example_shape: tuple[int, ...]) -> tuple[int, ...]:
        """The chain's output per example for inputs of ``example_shape``; ``ValueError`` if they do not fit."""
        shape = list(example_shape)
        for step in self.steps:
            if isinstance(step, _Linear):
                if not shape or shape[-1] != step.in_features:
                    raise ValueError(f"a Linear of {step.in_features} inputs meets examples of shape {tuple(shape)}")
                shape[-1] = step.out_features
            elif isinstance(step, _Flatten):
                dims = len(shape) + 1  # the model's tensor has the batch in front
                start, end = step.start % dims, step.end % dims
                if not (-dims <= step.start < dims and -dims <= step.end < dims and 1 <= start <= end):
                    raise ValueError(f"flatten({step.start}, {step.end}) of examples of shape {tuple(shape)}")
                shape = shape[:start - 1] + [math.prod(shape[start - 1:end])] + shape[end:]
            elif isinstance(step, _Squeeze):
                dims = len(shape) + 1
                if not -dims <= step.dim < dims or step.dim % dims == 0:
                    raise ValueError(f"squeeze({step.dim}) of examples of shape {tuple(shape)}")
                if shape[step.dim % dims - 1] == 1:
                    del shape[step.dim % dims - 1]
        return tuple(shape)

    def check(self, example_shape: tuple[int, ...], target_shape: tuple[int, ...], loss: str) -> str:
        """``""`` when inputs of shape (b, *example_shape) with targets (b, *target_shape) run through the chain
        into a loss whose gradient is written here, else why not."""
        try:
            out = self.output_shape(example_shape)
        except ValueError as why:
            return str(why)
        if loss in ("cross_entropy",) or (loss == "rmse" and len(out) == 1 and out[0] > 1):
            if len(out) != 1 or target_shape != ():
                return f"{loss} of outputs {out} against targets {target_shape} (written for (C,) logits)"
        elif math.prod(out) != 1 or target_shape != ():
            return f"{loss} of outputs {out} against targets {target_shape} (written for one output per example)"
        return ""

    def refusal(self, template: nn.Module, spec: Any, x: Tensor, y: Tensor, loss: str,
                start: Tensor | None = None) -> str:
        """``""`` when the chain may train these padded clients (``x`` (C, Nmax, ...), ``y``), else why not: the
        shapes (:meth:`check`) and, given the clients' starting points ``start`` (C, P), the inputs' dtype against
        the parameters' and the chain's output against the model's own forward on the first client's first
        examples (:meth:`disagrees`)."""
        why = self.check(tuple(x.shape[2:]), tuple(y.shape[2:]), loss)
        if why or start is None:
            return why
        if x.dtype != start.dtype:  # the other engines' F.linear refuses them too
            return (f"inputs of dtype {x.dtype} for parameters of dtype {start.dtype} (convert the inputs or the "
                    "model so that both have one floating dtype)")
        return self.disagrees(template, spec, start[0], x[0, :8]) if len(x) and x.shape[1] else ""

    def check_labels(self, y: Tensor, mask: Tensor, example_shape: tuple[int, ...]) -> None:
        """Refuse class labels outside ``[0, classes)`` among the real examples of a cross-entropy, ``classes`` the
        chain's outputs per example on inputs of ``example_shape`` (``F.cross_entropy`` refuses them on the other
        engines; the one-hot comparison here would silently train on a zero target)."""
        classes = self.output_shape(example_shape)[-1]
        real = y[mask]
        if real.numel() and (bool((real < 0).any()) or bool((real >= classes).any())):
            raise ValueError(f"a label outside [0, {classes}) among the clients' targets, and the model has "
                             f"{classes} outputs: check the labels or the model's number of classes")

    # ------------------------------------------------------------------ computing
    def gradients(self, theta: Tensor, x: Tensor, y: Tensor, mask: Tensor, loss: str) -> Tensor:
        """(C, P) gradients of every client's :func:`~lightning_dp.federated.local.masked_loss` on its batch
        ``x[c]`` (b, ...), ``y[c]``, ``mask[c]`` at its parameters ``theta[c]``."""
        grads = theta.new_zeros(theta.shape)
        for step, weight, bias in self._backward(theta, x, y, mask, loss):
            grads[:, step.weight] = weight.reshape(theta.shape[0], -1)
            if bias is not None:
                grads[:, step.bias] = bias
        return grads

    def descend(self, theta: Tensor, x: Tensor, y: Tensor, mask: Tensor, loss: str, scale: Tensor) -> None:
        """One SGD step of every client in place: ``theta[c] += scale[c] * gradient[c]`` (``scale`` (C, 1), e.g.
        ``-lr`` for active clients and 0 for the others), a layer at a time, without a (C, P) gradient."""
        c = theta.shape[0]
        for step, weight, bias in self._backward(theta, x, y, mask, loss):
            # a product then an addition, as local_sgd's vmap path (not addcmul_, a fused multiply-add)
            theta[:, step.weight].view(c, step.out_features, step.in_features).add_(weight * scale.view(c, 1, 1))
            if bias is not None:
                theta[:, step.bias].add_(bias * scale)

    def step_from(self, start: Tensor, x: Tensor, y: Tensor, mask: Tensor, loss: str, scale: Tensor) -> Tensor:
        """:meth:`descend` from ``start`` (C, P) into a new tensor: ``start[c] + scale[c] * gradient[c]``, each
        entry written once (no copy of ``start`` to step in place). A ``start`` shared by the clients (one row
        expanded, stride 0: the round's one hypothesis) runs its forward and backward through the layers as one
        matrix product over all the clients' examples instead of C batched ones; the same values to float32
        rounding (the clients' scaled gradient factors times their inputs, added to the start by one batched
        product: ``torch.baddbmm``)."""
        c = start.shape[0]
        if not self.covers(start.shape[1]):
            theta = start.clone()
            self.descend(theta, x, y, mask, loss, scale)
            return theta
        new = start.new_empty(start.shape)  # every entry written below: the Linear layers cover the flat vector
        for step, scaled, rows in self._step_factors(start, x, y, mask, loss, scale):
            torch.baddbmm(start[:, step.weight].view(c, step.out_features, step.in_features),
                          scaled.transpose(1, 2), rows, out=new[:, step.weight].view(c, step.out_features,
                                                                                    step.in_features))
            if step.bias is not None:
                torch.add(start[:, step.bias], scaled.sum(1), out=new[:, step.bias])
        return new

    def steps_from(self, start: Tensor, x: Tensor, y: Tensor, mask: Tensor, loss: str, scale: Tensor) -> DenseSteps:
        """The steps :meth:`step_from` adds to ``start`` (C, P), ``scale[c] * gradient[c]``, as their factors
        (:class:`DenseSteps`): never the (C, P) models, for a caller that reads only the steps' norms and a weighted
        sum of them (the round's clipped sum, :meth:`~lightning_dp.federated.clients.RoundClients.fused_block`).
        Needs :meth:`covers`."""
        if not self.covers(start.shape[1]):
            raise ValueError(f"the chain's Linear layers do not cover the {start.shape[1]} parameters")
        layers = tuple(self._step_factors(start, x, y, mask, loss, scale))
        return DenseSteps(layers, start.shape[1])

    def factor_entries(self, width: int) -> int:
        """The entries of one client's :class:`DenseSteps` factors over a batch of ``width`` examples: ``width``
        times the Linear layers' inputs and outputs."""
        return width * sum(s.in_features + s.out_features for s in self.steps if isinstance(s, _Linear))

    def covers(self, numel: int) -> bool:
        """Whether the Linear layers' weights and biases are the whole flat vector of ``numel`` parameters."""
        sizes = [s.out_features * s.in_features + (s.out_features if s.bias is not None else 0)
                 for s in self.steps if isinstance(s, _Linear)]
        return sum(sizes) == numel

    def _step_factors(self, start: Tensor, x: Tensor, y: Tensor, mask: Tensor, loss: str,
                      scale: Tensor) -> Iterator[tuple[_Linear, Tensor, Tensor]]:
        """Every Linear layer's factors of one SGD step from ``start``, last layer first: ``(step, scaled (C, b, out),
        inputs (C, b, in))``, the step ``scaled[c]^T inputs[c]`` on client c's weight and ``scaled[c].sum(0)`` on its
        bias, ``scaled`` the layer's output gradients times ``scale[c]`` (C, 1)."""
        c = start.shape[0]
        for step, g2, rows in self._backward_factors(start, x, y, mask, loss):
            yield step, g2 * scale.view(c, 1, 1), rows  # (C, b, out): the step's factor of each example

    def _backward(self, theta: Tensor, x: Tensor, y: Tensor, mask: Tensor,
                  loss: str) -> Iterator[tuple[_Linear, Tensor, Tensor | None]]:
        """Every Linear layer's (weight, bias) gradients, last layer first; each is yielded after the gradient
        has passed through the layer's weight, so that the caller may update the layer in place."""
        for step, g2, rows in self._backward_factors(theta, x, y, mask, loss):
            weight_grad = torch.bmm(g2.transpose(1, 2).contiguous(), rows)
            yield step, weight_grad, g2.sum(1) if step.bias is not None else None

    def _backward_factors(self, theta: Tensor, x: Tensor, y: Tensor, mask: Tensor,
                          loss: str) -> Iterator[tuple[_Linear, Tensor, Tensor]]:
        """Every Linear layer's gradient factors, last layer first: ``(step, g (C, b, out), inputs (C, b, in))``,
        the weight's gradient ``g^T inputs`` and the bias's ``g`` summed over the examples; each is yielded after
        the gradient has passed through the layer's weight, so that the caller may update the layer in place."""
        saved = self._forward(theta, x)
        c = theta.shape[0]
        shared = _shared(theta)
        g = _loss_gradient(saved[-1], y, mask, loss)
        first = min(i for i, s in enumerate(self.steps) if isinstance(s, _Linear))
        for i in range(len(self.steps) - 1, first - 1, -1):
            step, inp = self.steps[i], saved[i]
            if isinstance(step, _Linear):
                rows = inp.reshape(c, -1, step.in_features)
                g2 = g.reshape(c, -1, step.out_features)
                if i > first:
                    if shared:  # one weight for all: one product over every client's examples
                        weight = theta[0, step.weight].view(step.out_features, step.in_features)
                        g = (g2.reshape(-1, step.out_features) @ weight).reshape(inp.shape)
                    else:
                        weight = theta[:, step.weight].view(c, step.out_features, step.in_features)
                        g = torch.bmm(g2, weight).reshape(inp.shape)
                yield step, g2, rows
            elif isinstance(step, _Activation):
                g = _activation_gradient(step.kind, g, saved[i + 1])
            else:
                g = g.reshape(inp.shape)

    def _forward(self, theta: Tensor, x: Tensor) -> list[Tensor]:
        """Every step's input, then the output (C, b, ...)."""
        c = theta.shape[0]
        shared = _shared(theta)
        h = x
        saved: list[Tensor] = []  # saved[i]: step i's input, saved[i + 1] its output
        for step in self.steps:
            saved.append(h)
            if isinstance(step, _Linear):
                if shared:  # one weight for all the clients: one product over all their examples
                    flat = F.linear(h.reshape(-1, step.in_features), theta[0, step.weight].view(
                        step.out_features, step.in_features), theta[0, step.bias] if step.bias is not None else None)
                    h = flat.reshape(*h.shape[:-1], step.out_features)
                    continue
                weight = theta[:, step.weight].view(c, step.out_features, step.in_features)
                rows = h.reshape(c, -1, step.in_features)
                # (W x^T)^T: twice as fast on CPU as x W^T or baddbmm for a few outputs (measured, 100 clients of
                # batches of 16 MNIST images)
                out = torch.bmm(weight, rows.transpose(1, 2)).transpose(1, 2)
                out = out + theta[:, step.bias].unsqueeze(1) if step.bias is not None else out.contiguous()
                h = out.reshape(*h.shape[:-1], step.out_features)
            elif isinstance(step, _Activation):
                h = _activate(step.kind, h)
            elif isinstance(step, _Flatten):
                dims = h.dim() - 1
                h = h.flatten(step.start % dims + 1, step.end % dims + 1)
            else:
                dims = h.dim() - 1
                h = h.squeeze(step.dim % dims + 1)
        saved.append(h)
        return saved

    def disagrees(self, template: nn.Module, spec: Any, theta: Tensor, x: Tensor) -> str:
        """``""`` when the chain's output equals the model's own forward (``functional_call``) at one client's
        parameters ``theta`` (P,) on a batch ``x`` (b, ...), else how it differs: a trace that no longer describes
        the forward (Python state it read, a patched method) is caught before it trains."""
        from torch.func import functional_call

        with torch.no_grad():
            ours = self._forward(theta.unsqueeze(0), x.unsqueeze(0))[-1][0]
            theirs = functional_call(template, spec.unflatten(theta), (x,))
        if ours.shape != theirs.shape:
            return f"the traced chain gives outputs of shape {tuple(ours.shape)}, the model {tuple(theirs.shape)}"
        if not outputs_agree(ours, theirs):
            return (f"the traced chain's outputs differ from the model's forward by up to "
                    f"{float((ours - theirs).abs().max()):.3g}")
        return ""


#: a client whose steps' entries could reach this (bounded by :meth:`DenseSteps.norms`) is not summed from the
#: factors: the float32 models the other path writes could overflow where these float64 norms do not
_FACTOR_LIMIT = 2.0**60
#: float64 entries :meth:`DenseSteps.norms` works on at a time
_CHUNK_ENTRIES = 2**18
#: The fused round sums a block's steps from their factors only where no client's terms exceed its step's norm by
#: more than this (:meth:`DenseSteps.cancellation`); beyond, the block takes the releases' path, which clips each
#: step as it is written. Below it the float64 rounding of the Gram norm (relative ``~ 1e3 u K^2``, u = 1.1e-16: 1e-7
#: at K = 2^10) and of the float64 product such a client's terms go into (``~ n u K`` of its clipped step over n
#: examples) stay below the float32 rounding of the releases' path; an honest client's steps cancel that much only
#: when its examples nearly repeat with opposite gradients (an attacker's do at will: a review's client of two
#: examples moved its neighbour's sum by 63 C in float32 before this limit).
CANCELLATION_LIMIT = 2.0**10
#: A client's terms go into the block's product in the models' dtype where they are at most this many times its
#: step's norm (:meth:`DenseSteps.clipped`), else into one in float64: float32 rounding then moves the release by at
#: most about ``n u`` times 4 times the client's clipped step (n examples in the product, u = 6e-8), the order of the
#: releases' path's own float32 sum of the clipped steps.
LOOSE_CANCELLATION = 4.0


def _ratios(norms: Tensor, sizes: Tensor) -> Tensor:
    """``sizes / norms`` per client (1 where sizes is 0, inf where only the norm is: terms cancelled to nothing, or
    where sizes overflowed beside a finite norm)."""
    return torch.where(sizes > 0, sizes / norms, torch.ones_like(sizes)).nan_to_num(nan=math.inf)



@dataclass(frozen=True)
class DenseSteps:
    """C clients' steps of one SGD step (:meth:`DenseChain.steps_from`), held as each Linear layer's factors.

    Client c's step of a layer is ``scaled[c]^T inputs[c]`` (out, in) on its weight and ``scaled[c].sum(0)`` on its
    bias: over its b examples, the layer's output gradient rows ``g_i`` of the client's loss on its batch (a mean:
    the ``1 / b`` is in them) times the step's scale ``-lr``, and the layer's inputs ``a_i``. What the (C, P) steps
    give is computed from these: the norms from two b x b Gram matrices per layer (or the step written out, for a
    layer no larger than its factors),
    ``||sum_i g_i a_i^T||^2 = sum_ij (g_i . g_j)(a_i . a_j)`` plus the bias' ``||sum_i g_i||^2``, and a weighted sum
    over the clients as one product ``(w * g)^T a`` over all their examples (:meth:`weighted_sum`).

    Attributes:
        layers: ``(layer, scaled (C, b, out), inputs (C, b, in))`` per Linear layer, last layer first.
        numel: P, the flat vector's length (the layers cover it).
    """

    layers: tuple[tuple[_Linear, Tensor, Tensor], ...]
    numel: int

    def norms(self) -> tuple[Tensor, Tensor]:
        """``(norms, bounds)``, float64 (C,): the L2 norm of every client's flat step, and a bound on the magnitude
        of every entry of it and of every partial sum that forms one (``sum_i ||g_i|| max(1, ||a_i||)``, the largest
        over the layers).

        A layer whose step has no more entries than its factors (out x in <= b (out + in): the hospital MLP's) is
        written out in float64, per client; a larger one (a logistic regression's 10 x 784 from b <= 10 examples)
        goes through its two Gram matrices. A norm is NaN or inf exactly where a factor of the client has a
        non-finite entry, and then so does its step: a non-finite input ``a_ij`` makes column j of the weight's step
        non-finite (``g_ik a_ij`` is NaN or infinite for every k, 0 included), a non-finite ``g_ik`` row k. Finite
        float32 or float64 factors have finite float64 products below ``bounds^2``.
        """
        parts = [self._norms(clients)[:2] for clients in self._chunks()]
        return torch.cat([n for n, _ in parts]), torch.cat([m for _, m in parts])

    @staticmethod
    def _written_out(layer: _Linear, b: int) -> bool:
        """Whether a layer's step is written out (no more entries than its factors) rather than read through its Gram
        matrices."""
        return layer.out_features * layer.in_features <= b * (layer.out_features + layer.in_features)

    def _work(self, layer: _Linear, b: int) -> int:
        """The float64 entries :meth:`_norms` holds per client for ``layer``."""
        factors = b * (layer.in_features + layer.out_features)
        return factors + (b * layer.out_features * layer.in_features if self._written_out(layer, b) else 0)

    def _chunks(self) -> list[slice]:
        """The clients a chunk at a time: float64 work on at most ``_CHUNK_ENTRIES`` entries (2 MiB). A block's
        float64 copy of its inputs at once (13 MiB for 534 clients of 4 MNIST images) was a fresh allocation whose
        pages faulted in every block of a round (20 ms a block instead of 3 ms)."""
        c, b = self.layers[0][1].shape[:2]
        per = max(1, _CHUNK_ENTRIES // max(1, max(self._work(layer, b) for layer, _, _ in self.layers)))
        return [slice(i, min(i + per, c)) for i in range(0, c, per)] or [slice(0, 0)]

    def clipped(self, weights_of: Callable[[Tensor], Tensor]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """``(norms, bounds, sizes, total)``: :meth:`norms`' two, each client's float64 ``sizes`` (``sum_i ||g_i||
        ||a_i||`` over every layer, ``+ ||g_i||`` for a bias: the magnitude of the terms its step is summed from),
        and ``sum_c weights_of(norms)[c] * step_c`` (P,) in the factors' dtype over the clients whose norm is finite
        (the others add nothing: their factors are not read, ``0 * NaN`` would be NaN). ``weights_of`` maps norms to
        weights elementwise (DP-FedAvg's clip factors; a dropped client's norm is given as 0).

        A client's step is the sum of its examples' terms ``g_i a_i^T``, each as large as its ``||g_i|| ||a_i||``;
        where they cancel (the step much smaller than its ``sizes``), a product in float32 rounds the other clients'
        sum at the scale of those terms (``(S + X) - X``), and that rounding, not the clipped step, is the client's
        influence on the release. So a client's terms go into the block's product in the factors' dtype only where
        they are at most :data:`LOOSE_CANCELLATION` times its step (every client measured on honest data: 1.6-3.5);
        the others' into a product in float64. :meth:`cancellation` says how far they go; the caller refuses the
        block beyond :data:`CANCELLATION_LIMIT`."""
        parts = [self._norms(clients) for clients in self._chunks()]
        norms, bounds, sizes = (torch.cat([p[i] for p in parts]) for i in range(3))
        keep = norms.isfinite()
        weights = weights_of(norms.masked_fill(~keep, 0.0))
        loose = keep & (_ratios(norms, sizes) <= LOOSE_CANCELLATION)
        total = self.weighted_sum(weights, None if bool(loose.all()) else loose)
        tight = keep & ~loose
        if bool(tight.any()):
            exact = self.weighted_sum(weights, tight, dtype=torch.float64)
            total = (total.double() + exact).to(total.dtype)
        return norms, bounds, sizes, total

    def finite_factors(self, clients: Tensor) -> Tensor:
        """Whether every factor entry of each client selected by the boolean mask ``clients`` is finite."""
        out: Tensor | None = None
        for _, scaled, rows in self.layers:
            ok = scaled[clients].isfinite().flatten(1).all(1) & rows[clients].isfinite().flatten(1).all(1)
            out = ok if out is None else out & ok
        assert out is not None
        return out

    @staticmethod
    def cancellation(norms: Tensor, sizes: Tensor) -> float:
        """The largest ``sizes / norms`` over the clients with a finite norm (1 where none; inf where a client's
        terms cancel to a step of 0, or its sizes overflowed): how much larger the terms a client's step is summed
        from are than the step."""
        finite = norms.isfinite()
        if not bool(finite.any()):
            return 1.0
        return float(_ratios(norms[finite], sizes[finite]).max())

    def _norms(self, clients: slice) -> tuple[Tensor, Tensor, Tensor]:
        """:meth:`norms` of the clients in ``clients`` and their :meth:`clipped` sizes."""
        total: Tensor | None = None
        bound: Tensor | None = None
        magnitude: Tensor | None = None
        for layer, scaled, rows in self.layers:
            g, a = scaled[clients].double(), rows[clients].double()
            if self._written_out(layer, g.shape[1]):
                square = (g.unsqueeze(3) * a.unsqueeze(2)).sum(1).square().sum((1, 2))  # (C, b, out, in) summed
                g_sq, a_sq = g.square().sum(2), a.square().sum(2)
            else:
                gram_g, gram_a = torch.bmm(g, g.transpose(1, 2)), torch.bmm(a, a.transpose(1, 2))
                square = (gram_g * gram_a).sum((1, 2))
                g_sq, a_sq = gram_g.diagonal(dim1=1, dim2=2), gram_a.diagonal(dim1=1, dim2=2)
            g_norm, a_norm = g_sq.sqrt(), a_sq.sqrt()
            terms = (g_norm * a_norm).sum(1)
            if layer.bias is not None:
                square = square + g.sum(1).square().sum(1)
                terms = terms + g_norm.sum(1)
            size = (g_norm * a_norm.clamp(min=1.0)).sum(1)
            total = square if total is None else total + square
            bound = size if bound is None else torch.maximum(bound, size)
            magnitude = terms if magnitude is None else magnitude + terms
        assert total is not None and bound is not None and magnitude is not None  # a chain has a Linear layer
        # the Gram form's sum of squares rounds to a tiny negative value only where the step is ~1e-8 of its terms
        return total.clamp(min=0.0).sqrt(), bound, magnitude

    def weighted_sum(self, weights: Tensor, keep: Tensor | None = None, *,
                     dtype: torch.dtype | None = None) -> Tensor:
        """``sum_c weights[c] * step_c`` (P,) over the clients with ``keep[c]`` (all where None), in ``dtype`` (the
        factors' where None); each layer's weight is one product ``(w * g)^T a`` over all the kept clients'
        examples. A client left out contributes nothing (its factors are not read: ``0 * NaN`` would be NaN)."""
        first = self.layers[0][1]
        dtype = dtype or first.dtype
        total = torch.zeros(self.numel, dtype=dtype, device=first.device)
        w = weights.to(dtype)
        if keep is not None:
            w = w[keep]
        for layer, scaled, rows in self.layers:
            if keep is not None:
                scaled, rows = scaled[keep], rows[keep]
            flat_g = (scaled.to(dtype) * w.view(-1, 1, 1)).reshape(-1, layer.out_features)
            total[layer.weight] = (flat_g.T @ rows.to(dtype).reshape(-1, layer.in_features)).reshape(-1)
            if layer.bias is not None:
                total[layer.bias] = flat_g.sum(0)
        return total

    def within_limit(self, bounds: Tensor, origin: Tensor) -> bool:
        """Whether every client's step (``bounds`` from :meth:`norms`, NaN for a non-finite one) stays far from the
        float range from ``origin``: then ``origin + step`` written in the factors' dtype is finite exactly where
        the norm is."""
        finite = bounds[bounds.isfinite()]
        if not finite.numel():
            return True
        return bool(finite.max() + origin.abs().max().double() < _FACTOR_LIMIT)


def _shared(theta: Tensor) -> bool:
    """Whether the clients' parameters ``theta`` (C, P) are one row expanded (stride 0): the same for all."""
    return theta.shape[0] > 1 and theta.stride(0) == 0


def _activate(kind: str, h: Tensor) -> Tensor:
    if kind == "relu":
        return torch.relu(h)
    if kind == "tanh":
        return torch.tanh(h)
    if kind == "sigmoid":
        return torch.sigmoid(h)
    return h


def _activation_gradient(kind: str, g: Tensor, out: Tensor) -> Tensor:
    """The gradient through an activation, from its output (as autograd's relu, tanh and sigmoid backward)."""
    if kind == "identity":
        return g
    if kind == "relu":
        return torch.where(out > 0, g, torch.zeros((), dtype=g.dtype))
    if kind == "tanh":
        return g * (1 - out * out)
    return g * out * (1 - out)


def _loss_gradient(out: Tensor, y: Tensor, mask: Tensor, loss: str) -> Tensor:
    """d masked_loss / d out for every client at once: out (C, b, ...), y (C, b), mask (C, b)."""
    m = mask.to(out.dtype)
    count = torch.clamp(m.sum(1), min=1.0)  # (C,)
    weight = m / count.unsqueeze(1)  # (C, b)
    if loss == "cross_entropy" or (loss == "rmse" and out.dim() == y.dim() + 1 and out.shape[-1] > 1):
        labels = y.long()
        classes = out.shape[-1]
        # written out: torch.softmax over a last dimension of 10 took five times as long on CPU (measured)
        exp = (out - out.amax(-1, keepdim=True)).exp()
        probs = exp / exp.sum(-1, keepdim=True)
        onehot = (labels.unsqueeze(-1) == torch.arange(classes, device=out.device)).to(out.dtype)
        if loss == "cross_entropy":
            return (probs - onehot) * weight.unsqueeze(-1)
        diff = probs - onehot
        mse = (diff.square().sum(-1) * weight).sum(1)  # (C,)
        v = 2 * diff * weight.unsqueeze(-1)  # d mse / d probs
        dz = probs * (v - (v * probs).sum(-1, keepdim=True))
        return dz * _sqrt_factor(mse).view(-1, 1, 1)
    values = out.reshape(y.shape)
    if loss == "binary_cross_entropy":
        return ((torch.sigmoid(values) - y.to(out.dtype)) * weight).reshape(out.shape)
    diff = values - y.to(out.dtype)
    mse = (diff.square() * weight).sum(1)
    return (2 * diff * weight * _sqrt_factor(mse).unsqueeze(1)).reshape(out.shape)


def _sqrt_factor(mse: Tensor) -> Tensor:
    """d sqrt(mse) / d mse as masked_loss differentiates it: 0 where mse is 0 (or below the clamp), else
    1 / (2 sqrt(mse))."""
    tiny = torch.finfo(mse.dtype).tiny
    return torch.where(mse > tiny, 0.5 / torch.sqrt(torch.clamp(mse, min=tiny)), torch.zeros_like(mse))


_CACHE: weakref.WeakKeyDictionary[nn.Module, tuple[Any, tuple[DenseChain | None, str]]] = weakref.WeakKeyDictionary()


def _hooks(module: nn.Module) -> tuple[dict, ...]:
    return (module._forward_hooks, module._forward_pre_hooks, module._backward_hooks,
            getattr(module, "_backward_pre_hooks", {}))


def _global_hooks() -> tuple[dict, ...]:
    m = nn.modules.module
    return tuple(getattr(m, name, {}) for name in ("_global_forward_hooks", "_global_forward_pre_hooks",
                                                    "_global_backward_hooks", "_global_backward_pre_hooks"))


def _signature(template: nn.Module, spec: Any) -> tuple:
    """What a cached trace depends on: the parameter layout, every submodule (identity, type, training mode) and
    the hooks (a swapped layer, a mode or a hook changed since the first trace is traced again). Other Python
    state a forward reads is not seen here: :meth:`DenseChain.disagrees` compares the outputs at every call."""
    modules = [(id(m), type(m), m.training, *(len(h) for h in _hooks(m))) for m in template.modules()]
    return (spec, tuple(modules), tuple(len(h) for h in _global_hooks()))


def dense_chain(template: nn.Module, spec: Any) -> tuple[DenseChain | None, str]:
    """:meth:`DenseChain.of`, traced once per (model, parameter layout, submodules and hooks)."""
    signature = _signature(template, spec)
    hit = _CACHE.get(template)
    if hit is not None and hit[0] == signature:
        return hit[1]
    found = DenseChain.of(template, spec)
    _CACHE[template] = (signature, found)
    return found
