"""The book-keeping engine: hooks, records, established batch dimensions, per-sample norms and clipped sums.

See the package docstring for the method; this module holds the mechanics every layer
rule shares, so that a rule only turns a layer's records into per-sample gradients.
"""

from __future__ import annotations

import collections
import contextlib
import math
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from typing import Any, cast

import torch
import torch.utils._pytree as pytree
from torch import Tensor, nn
from torch.nn.modules.module import _global_forward_hooks, register_module_forward_hook
from torch.nn.utils import parametrize
from torch.nn.utils.rnn import PackedSequence
from torch.nn.utils.spectral_norm import SpectralNorm
from torch.nn.utils.weight_norm import WeightNorm

from lightning_dp.privacy.finite import non_finite
from lightning_dp.privacy.grad_sample.contributions import (DEFAULT_INSTANTIATE_LIMIT, DEFAULT_KEEP_LIMIT,
                                                            Contribution, Groups, floor_of, floored)
from lightning_dp.privacy.grad_sample.probing import BatchDimProbe, _Dims
from lightning_dp.privacy.grad_sample.registry import (
    LayerRule,
    PerSampleGradientError,
    Record,
    join_graph,
    rule_for,
    withheld_rule,
)

__all__ = ["GradSampleEngine", "PerSampleGradientError", "compute_dtype", "trainable_parameters"]


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype per-sample norms and clipped sums are computed in for a parameter of ``dtype``: at least float32.

    Under mixed precision (autocast) a layer's inputs and output gradients are float16 or bfloat16; under
    ``bf16-true`` its weights are too. Norms computed in half precision round by up to 0.4 % (bfloat16), so a
    clipped contribution could exceed C by that much; they are computed from the records cast to float32.

    Example:
        >>> compute_dtype(torch.bfloat16), compute_dtype(torch.float64)
        (torch.float32, torch.float64)
    """
    found = _COMPUTE_DTYPES.get(dtype)
    if found is None:  # torch.promote_types is a dispatched operator: computed once per dtype
        found = _COMPUTE_DTYPES[dtype] = torch.promote_types(dtype, torch.float32) if dtype.is_floating_point else dtype
    return found


_COMPUTE_DTYPES: dict[torch.dtype, torch.dtype] = {}


def _as(t: Tensor, dtype: torch.dtype) -> Tensor:
    """``t`` in ``dtype`` (no dispatched operation when it is already)."""
    return t if t.dtype == dtype else t.to(dtype)


def _upcast(value: Any, dtype: torch.dtype) -> Any:
    """A floating tensor of lower precision than ``dtype`` cast to it (anything else as is)."""
    if isinstance(value, Tensor) and value.is_floating_point() and value.dtype != dtype \
            and torch.promote_types(value.dtype, dtype) == dtype:
        return value.to(dtype)
    return value


def trainable_parameters(module: nn.Module) -> tuple[int, ...]:
    """Identities of the parameters of ``module`` that require grad: the engine's trainable set."""
    return tuple(id(p) for p in module.parameters() if p.requires_grad)


def _packed(tree: Any) -> list[PackedSequence]:
    """The ``PackedSequence`` objects in a structure of arguments or outputs."""
    found: list[PackedSequence] = []
    pytree.tree_map_only(PackedSequence, found.append, tree, is_leaf=lambda x: isinstance(x, PackedSequence))
    return found


def _shape(value: Any) -> tuple[int, ...] | None:
    return tuple(value.shape) if isinstance(value, Tensor) else None


class _Call:
    """What one forward call of a hooked module left behind (a plain class with slots: one is made per layer call
    of every step)."""

    __slots__ = ("args", "kwargs", "leaves", "spec", "outputs", "grad_outputs", "extra", "context", "frozen",
                 "versions", "raw", "task", "out_versions")

    def __init__(self, frozen: list[nn.Parameter]) -> None:
        self.args: tuple[Any, ...] = ()
        self.kwargs: dict[str, Any] = {}
        self.leaves: list[Any] = []  # the input leaves (args then kwargs), detached
        self.spec: Any = None  # their pytree structure; None: positional tensors only (the common case, no pytree)
        self.outputs: list[Tensor | None] = []  # output leaves, as returned by the hook
        self.grad_outputs: list[Tensor | None] = []
        self.extra: dict[str, Any] = {}
        self.context: Any = None  # the rule's forward context while the call runs (_OPEN: the rule has none)
        self.frozen = frozen  # the parameters the pre-hook froze, to unfreeze
        self.versions: list[int | None] = []  # the input leaves' version counters after the forward
        self.raw: list[tuple[Tensor, int]] | None = None  # the forward's own output tensors and versions (watched)
        self.task: int | None = None  # the backward pass (autograd's graph task) that brought its output gradients
        self.out_versions: list[int] = []  # the output leaves' version counters when the forward returned them


#: the context of a call whose rule records nothing during the forward (LayerRule's default): nothing to enter
_OPEN = object()

_DIFFERENTIATE_ONCE = (
    "Differentiate a recorded forward once per step, with one backward pass of its loss (sum several losses before "
    "it); take other gradients (an input-gradient penalty, a saliency map, torch.autograd.grad for a diagnostic) "
    "outside the recorded step: in a forward of their own while the engine is stopped (engine.stop()), or on a "
    "detached copy of the model.")


def _one_backward(layer: _Layer, call: _Call) -> None:
    """Refuses a second backward pass through a recorded call, or one that builds a graph of the gradient.

    The output gradients the engine's hooks catch become the call's per-sample gradients. A second pass (a
    ``torch.autograd.grad`` before ``loss.backward()``, two backward calls through one forward) would add its
    output gradients to the first's, though ``torch.autograd.grad`` adds nothing to ``.grad``: the hooks cannot
    tell the two kinds apart. A pass with ``create_graph=True`` (a gradient penalty) differentiates the backward
    pass itself, whose dependence on the weights no output gradient carries: per-sample norms 5x off in a
    review's test, silently. Both are refused here, before anything is released."""
    if torch.is_grad_enabled():
        raise PerSampleGradientError(
            f"{layer.label}: a backward pass with create_graph=True (a gradient penalty, double backward) ran through "
            "a recorded step; per-sample gradients hold the loss's first-order gradient only, so they would miss "
            f"the penalty's dependence on the weights. {_DIFFERENTIATE_ONCE}")
    task = torch._C._current_graph_task_id()
    if call.task is None:
        call.task = task
    elif call.task != task:
        raise PerSampleGradientError(
            f"{layer.label}: a second backward pass reached a recorded call (torch.autograd.grad before "
            "loss.backward(), or backward(retain_graph=True) twice through one forward); the per-sample gradients "
            f"would add the passes, though torch.autograd.grad adds nothing to .grad. {_DIFFERENTIATE_ONCE}")


class _Layer:
    """A module whose trainable parameters one rule covers, with its records for one step."""

    def __init__(self, name: str, module: nn.Module, rule: LayerRule, trainable: dict[str, nn.Parameter]) -> None:
        self.name, self.module, self.rule, self.trainable = name, module, rule, trainable
        # per-sample gradients are computed in at least float32, whatever the layer ran in (autocast, bf16 weights)
        self.compute_dtype = compute_dtype(next(iter(trainable.values())).dtype)
        self.calls: list[_Call] = []
        self.dims: _Dims | None = None
        self.broadcast = False
        self.probe_calls: list[list[tuple[list, list]]] = []
        self.cache: dict[str, Any] = {}
        # what the hooks need to know of the rule, looked up once: whether it checks or prepares calls, and whether
        # it records anything during the forward (its own forward_context)
        self.checks_calls = any(getattr(rule, n, None) is not None for n in ("check_call", "prepare_call"))
        self.own_context = type(rule).forward_context is not LayerRule.forward_context
        self.after_call = getattr(rule, "after_call", None)
        #: the ids of the engine's forward pre-hook on the module, and of the hook that keeps the forward's own output
        #: while another forward hook sits on it (:meth:`GradSampleEngine._watch`)
        self.pre_id: int | None = None
        self.raw_id: int | None = None
        #: where each trainable parameter sits: (its owner's ``_parameters``, its name there, the parameter), so that
        #: each recorded call checks it is still the one the rule's gradients are for (:meth:`swapped`)
        self.slots: list[tuple[dict[str, Any], str, nn.Parameter]] = []
        for name, p in trainable.items():
            *path, attr = name.split(".")
            owner = module.get_submodule(".".join(path)) if path else module
            self.slots.append((owner._parameters, attr, p))

    def swapped(self) -> str | None:
        """The name of a trainable parameter that the module no longer holds (another Parameter assigned in its
        place, or a tensor swapped in by ``torch.func.functional_call``), else None."""
        for params, attr, p in self.slots:
            if params.get(attr) is not p:
                return attr
        return None

    @property
    def params(self) -> list[tuple[str, nn.Parameter]]:
        return list(self.trainable.items())

    @property
    def label(self) -> str:
        return f"layer {self.name} ({type(self.module).__name__})"


def _refuse_hook_reparametrization(mod: nn.Module, mod_name: str) -> None:
    """Refuse the deprecated hook-based ``torch.nn.utils.weight_norm`` / ``spectral_norm`` on trainable parameters
    (before any data): their forward pre-hook computes the weight from ``weight_g``/``weight_v`` (``weight_orig``)
    outside the forward the engine records, so those parameters' gradients could not be split by example."""
    kinds = {WeightNorm: "weight_norm", SpectralNorm: "spectral_norm"}
    for hook in mod._forward_pre_hooks.values():
        kind = next((k for cls, k in kinds.items() if isinstance(hook, cls)), None)
        if kind is None:
            continue
        tensor: str = getattr(hook, "name", "weight")
        names = [n for n, p in mod.named_parameters(recurse=False) if p.requires_grad and n.startswith(tensor)]
        if names:
            raise PerSampleGradientError(
                f"layer {mod_name or type(mod).__name__} ({type(mod).__name__}) uses the deprecated "
                f"torch.nn.utils.{kind}: a forward pre-hook computes {tensor!r} from {names}, outside the forward "
                "whose per-sample gradients are recorded. Use torch.nn.utils.parametrizations."
                f"{kind}(module), which lightning-dp supports exactly, or freeze {names}.")


def _ancestor(a: str, b: str) -> bool:
    """Whether module name ``a`` is a strict ancestor of ``b`` ("" is the root)."""
    return a != b and (a == "" or b.startswith(a + "."))


def _input_leaves(args: tuple, kwargs: dict) -> tuple[list[Any], Any]:
    return pytree.tree_flatten((args, kwargs))


def _no_autocast(device: torch.device) -> Any:
    """A context in which autocast is off for ``device``'s type (and for the CPU, whose autocast applies too)."""
    kinds = [kind for kind in dict.fromkeys((device.type, "cpu")) if torch.is_autocast_enabled(kind)]
    if not kinds:  # the common case: nothing to turn off (entering autocast contexts costs microseconds each)
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    for kind in kinds:
        stack.enter_context(torch.autocast(device_type=kind, enabled=False))
    return stack


@contextlib.contextmanager
def _named(layer: Any) -> Iterator[None]:
    """A :class:`PerSampleGradientError` raised inside names the layer (its path in the model and its type) first,
    so that every refusal says which submodule it is about."""
    label = layer if isinstance(layer, str) else layer.label
    try:
        yield
    except PerSampleGradientError as err:
        if str(err).startswith(label) or label in str(err):
            raise
        raise PerSampleGradientError(f"{label}: {err}") from err


def _unflatten_plain(leaves: list[Any], spec: Any) -> Any:
    """``pytree.tree_unflatten`` with named tuples rebuilt as plain tuples: for structures of batch dimensions
    (ints and None), which a named tuple that validates its fields (``PackedSequence``) would refuse."""
    it = iter(leaves)

    def build(node: Any) -> Any:
        if node.is_leaf():
            return next(it)
        children = [build(node.child(i)) for i in range(node.num_children)]
        if node.type is collections.namedtuple or (isinstance(node.type, type) and issubclass(node.type, tuple)
                                                    and hasattr(node.type, "_fields")):
            return tuple(children)
        return pytree.SUPPORTED_NODES[node.type].unflatten_fn(children, node.context)

    return build(spec)


class GradSampleEngine(BatchDimProbe):
    """Book-keeping per-sample gradient engine (see the package docstring).

    Args:
        module: the model; every submodule that owns trainable parameters is handled by
            the rule registered for its type (:mod:`lightning_dp.privacy.grad_sample.registry`).
            The set of trainable parameters is fixed when the engine is built: build a new
            engine when it changes (:meth:`trainable_changed`).
        instantiate_limit: bytes above which a contribution never instantiates per-sample
            gradients (see :func:`~lightning_dp.privacy.grad_sample.contributions.choose_layer_strategy`).
        keep_buffers: keep the rules' work buffers (the convolution windows) from one step
            to the next instead of freeing them at :meth:`clear`. Faster on CPU, where a
            large fresh allocation faults in new pages every step; the memory stays taken
            between steps. Default: False.
        keep_limit: bytes of instantiated per-sample gradients larger than their factors that a
            step keeps from the norms to the clipped sum (the sum is then a matrix-vector product
            of them, not a matrix product of the factors: 10-11 % of the LSTM, Transformer and
            GPT-2 steps on a CPU, docs/benchmarks.md); the rest are released after their norms.
            Default: 64 MiB; 0 keeps none (the memory of the records and the factors only).
    """

    def __init__(self, module: nn.Module, *, instantiate_limit: int = DEFAULT_INSTANTIATE_LIMIT,
                 keep_buffers: bool = False, keep_limit: int = DEFAULT_KEEP_LIMIT) -> None:
        from lightning_dp.privacy.grad_sample.rules.functorch import FunctorchRule
        from lightning_dp.privacy.grad_sample.rules.parametrized import ParametrizedRule

        self.module = module
        self.instantiate_limit = int(instantiate_limit)
        self.keep_buffers = bool(keep_buffers)
        if int(keep_limit) < 0:
            raise ValueError(f"keep_limit={keep_limit} is negative; give the bytes of per-sample gradients a step may "
                             "keep from the norms to the clipped sum (0 keeps none)")
        self.keep_limit = int(keep_limit)
        self._trainable = trainable_parameters(module)
        self.layers: list[_Layer] = []
        # A parameter registered in a module and in one of its descendants (an alias, such as
        # Opacus' RenameParamsMixin) belongs to the deepest one, which computes with it.
        registrations: dict[int, list[str]] = {}
        for mod_name, mod in module.named_modules(remove_duplicate=False):
            for n, p in mod.named_parameters(recurse=False):
                if p.requires_grad:
                    registrations.setdefault(id(p), []).append(mod_name)
        owner_of = {pid: {n for n in names if not any(_ancestor(n, o) for o in names)}
                    for pid, names in registrations.items()}
        claimed: list[str] = []
        seen_modules: set[int] = set()
        for mod_name, mod in module.named_modules():
            if id(mod) in seen_modules or any(_ancestor(c, mod_name) for c in claimed):
                continue
            seen_modules.add(id(mod))
            _refuse_hook_reparametrization(mod, mod_name)
            rule = rule_for(mod)
            if parametrize.is_parametrized(mod) or (rule is not None and rule.claims_subtree and any(
                    parametrize.is_parametrized(m) for m in mod.modules())):
                # A parametrized tensor (weight_norm, spectral_norm, orthogonal, ...) is computed from the
                # parametrization's own parameters (parametrizations.<name>.original*) whenever the forward reads
                # it: the layer's rule (or the rule of an ancestor that claims it, as MultiheadAttention's claims
                # out_proj) would give the gradient of the computed tensor, not of those parameters, and the
                # parametrization is called without the batch. The module with its parametrizations is one layer
                # of its own: a linear layer or a convolution chained through its parametrizations (its rule's
                # per-sample gradients of the tensor it reads, pulled back), anything else the exact fallback, which
                # replays its forward (the parametrization included).
                rule = ParametrizedRule(rule if parametrize.is_parametrized(mod) else None)  # its check refuses
                # what neither can compute
            elif rule is None:
                rule = FunctorchRule()
                withheld = withheld_rule(mod)
                if withheld is not None and any(p.requires_grad for p in mod.parameters(recurse=False)):
                    parent, parent_rule = withheld[0].__name__, type(withheld[1])
                    how = withheld[2]
                    hook = type(getattr(mod, "_hf_hook", None)).__name__
                    remedy = {
                        "instance": f"If its forward computes what {parent}.forward does, keep the class's own "
                                    "forward (do not replace it on the instance)",
                        "hook": "If the hook only moves tensors between devices, use accelerate's device hooks "
                                "(AlignDevicesHook, CpuOffload) on this layer instead",
                        "class": f"If its forward computes what {parent}.forward does, register that rule for it: "
                                 f"register_rule({type(mod).__qualname__})({parent_rule.__name__}) "
                                 f"({parent_rule.__module__})",
                    }[how]
                    reason = {"instance": "set on the instance",
                              "hook": f"wrapped by accelerate's {hook}, which may change its inputs or output",
                              "class": "its class overrides it"}[how]
                    warnings.warn(
                        f"layer {mod_name or type(mod).__name__} ({type(mod).__qualname__}) runs another forward than "
                        f"{parent}.forward ({reason}), so "
                        f"{parent_rule.__name__}, whose formulas are those of {parent}.forward, is not used for it: "
                        "its per-sample gradients come from the exact torch.func fallback (slower; it holds every "
                        f"example's gradient of the layer's parameters). {remedy}.", stacklevel=2)
            if rule.claims_subtree:
                trainable = {n: p for n, p in mod.named_parameters() if p.requires_grad}
            else:
                trainable = {n: p for n, p in mod.named_parameters(recurse=False)
                             if p.requires_grad and mod_name in owner_of[id(p)]}
            if not trainable:
                continue
            if rule.claims_subtree:
                claimed.append(mod_name)
            with _named(f"layer {mod_name or type(mod).__name__} ({type(mod).__name__})"):
                rule.check(mod, trainable)
            self.layers.append(_Layer(mod_name or type(mod).__name__, mod, rule, trainable))
        if not self.layers:
            raise PerSampleGradientError(
                f"{type(module).__name__} has no trainable parameters (none with requires_grad=True); "
                "there is nothing to train privately. Unfreeze at least one parameter.")
        self._params: list[nn.Parameter] = []
        seen: set[int] = set()
        for layer in self.layers:
            for p in layer.trainable.values():
                if id(p) not in seen:
                    seen.add(id(p))
                    self._params.append(p)
        self._recording = False
        self._probing = False
        self._probed = False
        self._contributions: dict[int, list[Contribution]] | None = None
        self._scale: float | Tensor = 1.0  # the loss scale of the step's contributions (per_sample_norms)
        self._probe_half = False  # a layer's output was float16/bfloat16 while probing (autocast)
        #: examples of the last step whose half-precision gradient overflowed and was dropped (per_sample_norms)
        self.dropped = 0
        self._broadcasting: set[int] = set()  # layers whose outputs the probe expands (id of _Layer)
        self._captured: dict[int, list[list[tuple[int, Tensor]]]] = {}  # outputs per call (gradient round)
        #: per layer id, per call, the first ``_inputs_rows`` examples of each input leaf that holds the examples
        #: (``(leaf index, rows)``, the examples first; the independence check of :meth:`probe`)
        self._captured_inputs: dict[int, list[list[tuple[int, Tensor]]]] = {}
        self._inputs_rows = 0
        self._batch: int | None = None
        self._anchor = torch.zeros((), requires_grad=True)
        self._buffers: dict[tuple[int | None, str], Tensor] = {}
        self._handles: list[Any] = []
        self._global_raw: Any = None  # the global hook that keeps the forward's own outputs (under global hooks)
        self._by_module: dict[int, _Layer] = {id(layer.module): layer for layer in self.layers}
        for layer in self.layers:
            handle = layer.module.register_forward_pre_hook(self._make_pre_hook(layer), with_kwargs=True)
            layer.pre_id = handle.id
            self._handles.append(handle)
            self._handles.append(layer.module.register_forward_hook(self._make_hook(layer), with_kwargs=True,
                                                                    always_call=True))

    # ------------------------------------------------------------------ state
    @property
    def parameters(self) -> list[nn.Parameter]:
        """The trainable parameters, each once (tied ones too), in the order of :meth:`clipped_sum`'s output."""
        return list(self._params)

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

    def workspace(self, layer: Any, key: str, shape: tuple[int, ...], like: Tensor, *, shared: bool = False) -> Tensor:
        """A work buffer of ``shape`` for a rule (grown to the largest size seen in the step, or across
        steps with ``keep_buffers``): Poisson batches change size every step. ``shared`` buffers are one
        per ``key`` for all layers (scratch space that no contribution keeps)."""
        n = math.prod(shape)
        k = (None if shared else id(layer), key)
        buf = self._buffers.get(k)
        if buf is None or buf.numel() < n or buf.dtype != like.dtype or buf.device != like.device:
            buf = torch.empty(n, dtype=like.dtype, device=like.device)
            self._buffers[k] = buf
        return buf[:n].view(shape)

    # ------------------------------------------------------------------ hooks
    def _make_pre_hook(self, layer: _Layer):
        def pre_hook(mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if self._probing:
                self._before_call(layer, mod, args, kwargs)
                return None
            if not (self._recording and torch.is_grad_enabled()):
                return None
            if layer.checks_calls:
                self._before_call(layer, mod, args, kwargs)
            swapped = layer.swapped()
            if swapped is not None:
                raise PerSampleGradientError(
                    f"{layer.label}: its parameter {swapped!r} is not the one the engine was built for: another "
                    "Parameter was assigned in its place, or torch.func.functional_call (stateless "
                    "reparametrization) swapped a tensor in. The per-sample gradients would be computed for the "
                    "other tensor while the released ones go to the original. Call the model with its own "
                    "parameters in a recorded step, and build the engine again after replacing a parameter (DPSGD "
                    "does when training starts).")
            if next(reversed(mod._forward_pre_hooks)) != layer.pre_id:
                raise PerSampleGradientError(
                    f"{layer.label}: a forward pre-hook was registered on it after the engine's: it runs after the "
                    "engine froze the layer's weights for the forward, so a use of the weights in it would escape the "
                    "per-sample gradients. Register the hook before training starts (before DPSGD builds its engine), "
                    "or do its work in the model's forward.")
            others = len(_global_forward_hooks) - (self._global_raw is not None)  # global hooks but the engine's
            if len(mod._forward_hooks) > 1 or others:  # another forward hook than the engine's
                self._watch(layer, others > 0)
            elif self._global_raw is not None:  # the user's global hooks are gone: so is the engine's
                self._global_raw.remove()
                self._global_raw = None
            # Freeze the weights while this layer runs: autograd then computes only the
            # input gradients the chain rule needs, not the batch weight gradient that the
            # engine would throw away. Only what requires grad now is frozen and unfrozen after:
            # a parameter the user froze meanwhile stays frozen.
            call = _Call([p for p in layer.trainable.values() if p.requires_grad])
            for p in call.frozen:
                p.requires_grad_(False)
            if layer.own_context:
                call.context = layer.rule.forward_context(mod, call.extra)
                call.context.__enter__()
            else:
                call.context = _OPEN
            layer.calls.append(call)
            return None
        return pre_hook

    def _make_hook(self, layer: _Layer):
        def hook(mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> Any:
            if self._probing:
                batch = self._batch
                out = self._expand(output, batch) if id(layer) in self._broadcasting and batch is not None else output
                inputs, _ = _input_leaves(args, kwargs)
                outputs = pytree.tree_leaves(out)
                if id(layer) in self._captured:  # (the output leaf's index, the leaf) of those that carry a gradient
                    self._captured[id(layer)].append([(k, o) for k, o in enumerate(outputs) if isinstance(o, Tensor)
                                                      and o.requires_grad and o.is_floating_point()])
                if id(layer) in self._captured_inputs and layer.dims is not None and torch.is_grad_enabled():
                    # copies (changed in place later); not a call without autograd, which no gradient comes from (a
                    # diagnostic forward under no_grad), nor a PackedSequence's tensors (the batch's tokens sorted by
                    # length, and its order: not per example), nor sparse or nested ones
                    packed = {id(t) for p in _packed((args, kwargs)) for t in p if isinstance(t, Tensor)}
                    self._captured_inputs[id(layer)].append([
                        (k, a.detach().movedim(d, 0)[:self._inputs_rows].clone())
                        for k, (a, d) in enumerate(zip(inputs, layer.dims.inputs))
                        if isinstance(a, Tensor) and d is not None and a.dim() > d and id(a) not in packed
                        and a.layout == torch.strided and not a.is_nested])
                # a PackedSequence's batch_sizes counts the sequences at each step: its length is the longest
                # sequence's, never the number of examples, even where the two coincide in every probe
                counts = {id(p.batch_sizes) for p in _packed((args, kwargs, out))}

                def shape(t: Any) -> tuple[int, ...] | None:
                    return (-1,) * t.dim() if id(t) in counts else _shape(t)  # (-1,): never follows the batch

                layer.probe_calls[-1].append(([shape(a) for a in inputs], [shape(o) for o in outputs]))
                self._probe_half = self._probe_half or any(
                    isinstance(o, Tensor) and o.dtype in (torch.float16, torch.bfloat16) for o in outputs)
                return out
            if not (self._recording and torch.is_grad_enabled()) or not layer.calls \
                    or layer.calls[-1].context is None:
                return None
            call = layer.calls[-1]
            if call.context is not _OPEN:
                call.context.__exit__(None, None, None)
            call.context = None
            for p in call.frozen:
                p.requires_grad_(True)
            if call.raw is not None and output is not None:
                self._check_raw(layer, call, output)
            if output is None:
                # The forward raised (always_call) and the exception propagates; or it was cut short on purpose,
                # as torch.utils.checkpoint(use_reentrant=False) does when it recomputes a segment during the
                # backward pass: either way the call left nothing to record.
                layer.calls.pop()
                return None
            if not kwargs and all(isinstance(a, Tensor) for a in args):  # positional tensors: no pytree
                call.leaves = [a.detach() for a in args]
                call.args = tuple(call.leaves)
            else:
                leaves, call.spec = _input_leaves(args, kwargs)
                call.leaves = [a.detach() if isinstance(a, Tensor) else a for a in leaves]
                call.args, call.kwargs = pytree.tree_unflatten(call.leaves, call.spec)
                call.args, call.kwargs = tuple(call.args), dict(call.kwargs)
            # detach() shares the version counter: an in-place change of an input after this call (which plain
            # autograd refuses when it saved the input for the weight's gradient) is caught in _records
            call.versions = [a._version if isinstance(a, Tensor) else None for a in call.leaves]
            if layer.after_call is not None and not layer.broadcast:
                with _named(layer):
                    layer.after_call(mod, args, output, call.extra)
            if layer.broadcast:
                if self._batch is None:
                    raise PerSampleGradientError(
                        f"{layer.label} computes on inputs shared by all examples, which needs the batch size when "
                        "recording starts: call engine.start(batch_size=B) or engine.record(batch_size=B).")
                output = self._expand(output, self._batch)
            if isinstance(output, Tensor):
                leaves, spec = [output], None
            else:
                leaves, spec = pytree.tree_flatten(output)
            changed = False
            for i, leaf in enumerate(leaves):
                if not isinstance(leaf, Tensor) or not leaf.is_floating_point():
                    call.outputs.append(None)
                    call.grad_outputs.append(None)
                    continue
                if not leaf.requires_grad:
                    # no input carried the graph (typically the first layer): join the output to it
                    leaf = join_graph(leaf, self._anchor)
                    leaves[i] = leaf
                    changed = True
                # detached: the hook below holds `call`, and a tensor kept here would hold the hook's graph node in
                # a cycle through autograd's C++ graph that Python's collector cannot see (a leak per step)
                call.outputs.append(leaf.detach())
                call.grad_outputs.append(None)
                call.out_versions.append(leaf._version)

                node = leaf.grad_fn
                if node is None:  # a leaf tensor returned as the output (an identity on a leaf that requires grad)
                    def save_grad(grad: Tensor, call: _Call = call, i: int = i, layer: _Layer = layer) -> None:
                        _one_backward(layer, call)
                        call.grad_outputs[i] = grad

                    leaf.register_hook(save_grad)
                    continue

                # a pre-hook of the node that made the output: it runs after the output's tensor hooks, so it takes
                # the gradient the layer's own backward receives, after a hook of the user's that changes it
                # (h.register_hook(lambda g: -g), a gradient reversal; a tensor hook registered first would take
                # it before, and the layer's per-sample gradients would miss the change, silently)
                def save_grads(grads: tuple[Tensor | None, ...], call: _Call = call, i: int = i,
                               nr: int = leaf.output_nr, layer: _Layer = layer) -> None:
                    grad = grads[nr]
                    if grad is not None:
                        _one_backward(layer, call)
                        call.grad_outputs[i] = grad

                node.register_prehook(save_grads)
            if changed or layer.broadcast:
                return leaves[0] if spec is None else pytree.tree_unflatten(leaves, spec)
            return None
        return hook

    def _watch(self, layer: _Layer, global_hooks: bool) -> None:
        """Another forward hook runs on the layer before the engine's (the user's, registered before it, or a global
        one, which runs before every module's), while the layer's weights are frozen. If it returns another output,
        or changes the output in place, the layer computed something else than its rule's formula, or its replay
        (``o * 2``, ``o * m.weight.sum()``: norms too low by that factor, silently). A hook run first keeps the
        forward's own output of each call, which the engine's hook compares with the output it receives
        (:meth:`_check_raw`): first among the module's hooks (put back first if a ``prepend`` hook came later), and,
        while global forward hooks exist, first among them."""
        hooks = cast("OrderedDict[int, Any]", layer.module._forward_hooks)  # an OrderedDict (torch annotates a dict)
        if layer.raw_id is None:
            handle = layer.module.register_forward_hook(self._raw_hook, with_kwargs=True, prepend=True)
            layer.raw_id = handle.id
            self._handles.append(handle)
        elif next(iter(hooks)) != layer.raw_id:
            hooks.move_to_end(layer.raw_id, last=False)
        if global_hooks:
            if self._global_raw is None:
                # through a weak reference: a global hook holding the engine would keep it and its model alive for
                # the whole process if the engine were dropped without remove(); removed with the engine
                engine = weakref.ref(self)

                def capture(mod: nn.Module, args: tuple[Any, ...], output: Any) -> None:
                    alive = engine()
                    if alive is not None:
                        alive._raw_hook(mod, args, output)

                self._global_raw = register_module_forward_hook(capture)
                weakref.finalize(self, self._global_raw.remove)
            if next(iter(_global_forward_hooks)) != self._global_raw.id:
                cast("OrderedDict[int, Any]", _global_forward_hooks).move_to_end(self._global_raw.id, last=False)

    def _raw_hook(self, mod: nn.Module, args: tuple[Any, ...], *rest: Any) -> None:
        """Keeps a recorded call's output as the forward returned it (the first capture of the call wins)."""
        output = rest[-1]  # (kwargs, output) as a module hook with kwargs, (output,) as a global hook
        layer = self._by_module.get(id(mod))
        if layer is None or not (self._recording and not self._probing and torch.is_grad_enabled()) \
                or not layer.calls or layer.calls[-1].context is None or layer.calls[-1].raw is not None:
            return
        call = layer.calls[-1]
        call.raw = [(t, t._version) for t in pytree.tree_leaves(output) if isinstance(t, Tensor)]
        # the weights were frozen for the layer's own forward only: the hooks that run after it (the user's) see them
        # trainable, so that a use of them there (a regularizer computed in a forward hook) gives them an autograd
        # gradient, which check_parameter_gradients refuses, instead of a term silently left out
        for p in call.frozen:
            p.requires_grad_(True)

    @staticmethod
    def _check_raw(layer: _Layer, call: _Call, output: Any) -> None:
        raw, call.raw = call.raw, None
        assert raw is not None
        final = [t for t in pytree.tree_leaves(output) if isinstance(t, Tensor)]
        if len(final) != len(raw) or any(f is not t or t._version != v for f, (t, v) in zip(final, raw)):
            raise PerSampleGradientError(
                f"{layer.label}: a forward hook on it changed its output (returned another one, or changed it in "
                f"place), so the output the loss depends on is not what {type(layer.rule).__name__}'s formula "
                "computes and its per-sample gradients would be wrong. Apply the change in the model's forward (or in "
                "a module of its own after the layer), or make the hook return None and leave the output alone.")

    @staticmethod
    def _before_call(layer: _Layer, mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """The rule's ``check_call`` and ``prepare_call`` before a probed or recorded forward of its layer."""
        with _named(layer):
            check_call = getattr(layer.rule, "check_call", None)
            if check_call is not None:
                check_call(mod, args, kwargs)
            prepare_call = getattr(layer.rule, "prepare_call", None)
            if prepare_call is not None:
                prepare_call(mod)

    @staticmethod
    def _expand(output: Any, batch: int) -> Any:
        """A shared output as a batch of identical views: (1, ...) -> (B, ...), else (...) -> (B, ...)."""
        def expand(t: Any) -> Any:
            if not isinstance(t, Tensor):
                return t
            if t.dim() > 0 and t.shape[0] == 1:
                return t.expand(batch, *t.shape[1:])
            return t.unsqueeze(0).expand(batch, *t.shape)
        return pytree.tree_map(expand, output)

    # ------------------------------------------------------------ recording
    @contextlib.contextmanager
    def record(self, *, batch_size: int | None = None) -> Iterator[None]:
        """Records layer inputs and output gradients of the forward/backward run inside."""
        self.start(batch_size=batch_size)
        try:
            yield
        finally:
            self.stop()

    def start(self, *, batch_size: int | None = None) -> None:
        """Clears the previous records and the parameters' ``.grad``, and starts recording.

        ``batch_size`` (the number of examples of the step) is needed by broadcast layers
        (see :meth:`probe`), which expand their output to it during the forward.

        While recording, autograd computes no gradient for the hooked parameters; a
        ``.grad`` found after the backward pass therefore reveals a parameter used outside
        its module (:meth:`check_parameter_gradients`).
        """
        self.clear()
        for p in self._params:
            p.grad = None
        self._batch = batch_size
        self._recording = True

    def stop(self) -> None:
        """Stops recording (the records stay until :meth:`clear`)."""
        self._recording = False

    def clear(self) -> None:
        """Drops the step's records, cached per-sample gradients and (unless ``keep_buffers``) work buffers."""
        for layer in self.layers:
            layer.calls.clear()
            layer.cache.clear()
        self._contributions = None
        if not self.keep_buffers:
            self._buffers.clear()

    def remove(self) -> None:
        """Removes every hook from the model and frees the work buffers."""
        self.stop()
        self.clear()
        self._buffers.clear()
        for h in self._handles:
            h.remove()
        self._handles.clear()
        if self._global_raw is not None:
            self._global_raw.remove()
            self._global_raw = None

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
                    f"{layer.label} ran in this step but not in every probe run, so where its input holds the batch "
                    "is not established (conditional computation?). Probe again with batches that exercise it, or "
                    "freeze its parameters.")
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
        size = sizes.popitem()[0]
        if self._batch is not None and size != self._batch:
            # two forwards of part of the batch each (or a part run without gradients) would put two examples in
            # one row, clipped together: an example's influence up to 2 C
            raise PerSampleGradientError(
                f"the step was recorded with batch_size={self._batch}, but its layers saw {size} examples: the batch "
                "was split across several forward passes in one recorded step (each layer's calls are then taken "
                "as the same examples), or part of it ran without gradients. Run the whole batch in one forward "
                "pass per recorded step (record each part as a step of its own), or pass its true size.")
        return size

    @staticmethod
    def _call_sizes(layer: _Layer, call: _Call) -> list[int]:
        """The sizes of a call's tensors at their batch dimensions, after checking the structure."""
        dims = layer.dims
        assert dims is not None
        inputs = call.leaves
        ranks = tuple(a.dim() if isinstance(a, Tensor) else None for a in inputs)
        if ranks != dims.input_ranks or len(call.outputs) != len(dims.outputs):
            raise PerSampleGradientError(
                f"{layer.label} was called with tensors of ranks {ranks}, but with ranks {dims.input_ranks} when "
                "probed; its batch dimension is not established for this call.")
        sizes = [a.shape[d] for a, d in zip(inputs, dims.inputs) if d is not None]
        sizes += [o.shape[d] for o, d in zip(call.outputs, dims.outputs) if d is not None and o is not None]
        return sizes

    def check_parameter_gradients(self) -> None:
        """Raises if autograd gave a gradient to a parameter outside its module's forward.

        Parameters are frozen while their module runs, so they cannot receive an autograd
        gradient there; if one did, the parameter was also used elsewhere (e.g.
        ``F.linear(x, self.fc.weight)`` in ``training_step``) and its per-sample gradient
        would be wrong.
        """
        bad = [f"{layer.name}.{name}" for layer in self.layers for name, p in layer.trainable.items()
               if p.grad is not None]
        if bad:
            raise PerSampleGradientError(
                f"parameters {sorted(set(bad))} received gradients outside the forward of the module that owns them, "
                "so their per-sample gradients cannot be recorded. Use each parameter only through its module's "
                "forward (no F.linear(x, module.weight) in training_step, no use of module.weight in a forward hook), "
                "or freeze it with requires_grad=False.")

    @staticmethod
    def _check_unchanged(layer: _Layer, call: _Call) -> None:
        """Raises if an input of the call was modified in place after the layer used it."""
        changed = [i for i, (a, v) in enumerate(zip(call.leaves, call.versions))
                   if isinstance(a, Tensor) and a._version != v]
        if changed:
            raise PerSampleGradientError(
                f"input {changed[0]} of {layer.label} was modified in place after the layer used it (for example "
                "x += f(x), ids.masked_fill_(...) or an in-place activation on it), so what the layer computed with "
                "is lost and its per-sample gradients cannot be computed. Plain autograd refuses this too when "
                "the layer's weight is trainable. Use the out-of-place form (x = x + f(x)) or clone() the input.")

    def check_inputs_unchanged(self) -> None:
        """The in-place check of every recorded call, made before :meth:`fused_pass` (whose graph cannot read a
        tensor's version counter)."""
        for layer in self.layers:
            for call in layer.calls:
                self._check_unchanged(layer, call)

    def _records(self, layer: _Layer, batch: int, *, checked: bool = False) -> list[Record]:
        """The layer's calls of the step, batch first, output gradients as recorded (``checked``: the in-place
        check was made already, :meth:`check_inputs_unchanged`).

        The loss scale is not applied here: every per-sample gradient is linear in the output gradients, so the
        engine multiplies the norms by ``|scale|`` and the sums' weights by ``scale`` instead (:meth:`_norms_of`,
        :meth:`_sums_of`): two operations on ``(B,)`` vectors instead of a scaled copy of every output gradient
        (on the MNIST CNN a fresh 3 MiB tensor a step, whose pages the CPU faults in again each time)."""
        dims = layer.dims
        assert dims is not None
        out = []
        for call in layer.calls:
            live = [(o, g) for o, g in zip(call.outputs, call.grad_outputs) if o is not None]  # as out_versions
            if any(g is None and o._version != v for (o, g), v in zip(live, call.out_versions)):
                raise PerSampleGradientError(
                    f"{layer.label}: its output was changed in place after the layer returned it and no gradient "
                    "reached it (an in-place operation on a view of it, such as nn.ReLU(inplace=True) on a linear "
                    "layer's (B, T, d) output): its per-sample gradients are lost. Use the out-of-place form "
                    "(nn.ReLU(), x = x * m) after the layer.")
            if all(g is None for g in call.grad_outputs):
                continue
            inputs, spec = call.leaves, call.spec
            if not checked:
                self._check_unchanged(layer, call)
            dtype = layer.compute_dtype
            inputs = [_upcast(a, dtype) for a in inputs]
            if layer.broadcast:
                normalized = [self._expand(a, batch) if isinstance(a, Tensor) else a for a in inputs]
                input_dims: list[Any] = [None] * len(inputs)
            else:
                normalized = [a.movedim(d, 0) if d and isinstance(a, Tensor) else a
                              for a, d in zip(inputs, dims.inputs)]
                input_dims = list(dims.inputs)
            grads: list[Tensor | None] = []
            for o, g, d in zip(call.outputs, call.grad_outputs, dims.outputs):
                if o is None:
                    grads.append(None)
                    continue
                if d is None and layer.rule.unbatched_outputs:
                    grads.append(None if g is None else _upcast(g, dtype))
                    continue
                if d is None:
                    if g is not None and g.abs().sum() > 0:
                        raise PerSampleGradientError(
                            f"{layer.label} returns an output without a batch dimension (shape {tuple(o.shape)}) that "
                            "the loss depends on; its gradient cannot be split by example.")
                    grads.append(None)
                    continue
                g = torch.zeros_like(o, dtype=dtype) if g is None else _upcast(g, dtype)
                grads.append(g.movedim(d, 0) if d else g)
            if spec is None:  # positional tensors only
                args, kwargs, arg_dims, kwarg_dims = tuple(normalized), {}, tuple(input_dims), {}
                call_args, call_kwargs = tuple(_upcast(a, dtype) for a in call.args), {}
            else:
                args, kwargs = pytree.tree_unflatten(normalized, spec)
                arg_dims, kwarg_dims = _unflatten_plain(input_dims, spec)
                call_args, call_kwargs = pytree.tree_map(lambda a: _upcast(a, dtype), (call.args, call.kwargs))
            out.append(Record(args=tuple(args), kwargs=dict(kwargs), grad_outputs=grads, arg_dims=tuple(arg_dims),
                              kwarg_dims=dict(kwarg_dims), output_dims=list(dims.outputs), broadcast=layer.broadcast,
                              extra=call.extra, call_args=call_args, call_kwargs=call_kwargs))
        return out

    def _contributions_of_step(self, batch: int, *, checked: bool = False) -> dict[int, list[Contribution]]:
        """Every layer's contributions, from output gradients as recorded (unscaled: :meth:`_records`)."""
        found: dict[int, list[Contribution]] = {}
        called = reached = False
        for layer in self.layers:
            if not layer.calls:  # not called in this step (a branch not taken, a module defined but unused)
                continue
            called = True
            reached = reached or any(g is not None for call in layer.calls for g in call.grad_outputs)
            records = self._records(layer, batch, checked=checked)
            if not records or batch == 0:
                continue
            with _named(layer):
                contributions = layer.rule.contributions(_LayerView(self, layer), records, batch)
            if not contributions:
                raise PerSampleGradientError(
                    f"{layer.label}: the loss depends on the layer's output, but its rule ({type(layer.rule).__name__}) "
                    "returned no per-sample gradient for it; its parameters would receive no gradient at all. "
                    "This is a bug of the rule (or of a computation path it does not see); please report it.")
            for name, contribution in contributions.items():
                found.setdefault(id(layer.trainable[name]), []).append(contribution)
            # the contributions hold what they need (the factors of a linear layer ARE its records): drop the rest
            # now, not at the end of the step, so that a convolution's inputs and output gradients free early
            del records
            layer.calls.clear()
        if called and not reached and batch:
            # the hooks never fired: every per-sample gradient would be 0 and the step would release noise alone
            raise PerSampleGradientError(
                "no output gradient reached any recorded layer: the backward pass skipped them (loss.backward(inputs="
                "...) or torch.autograd.grad of other tensors, which the engine's hooks never see), no backward pass "
                "ran after the recorded forward, or the loss does not depend on the model's trainable layers. Call "
                "loss.backward() without inputs= once after the recorded forward.")
        return found

    def per_sample_norms(self, *, loss_scale: float | None = None) -> Tensor:
        """Per-sample L2 norms of the full (flat) gradient of the trainable parameters, shape ``(batch,)``.

        A parameter used by several modules (tied weights) has one contribution per use; its
        per-sample norm includes their cross terms. Call it once per recorded step: it turns
        the records into contributions and frees each layer's records as it goes (what
        :meth:`clipped_sum` needs is kept in the contributions).

        Args:
            loss_scale: factor turning a recorded contribution into a per-example
                gradient; defaults to the batch size (the loss is a batch mean).
        """
        b = self.batch_size()
        scale = float(b) if loss_scale is None else float(loss_scale)
        # Outside any autocast region (a caller may sit inside one, as a chunked training step does): the
        # norms and the sums below must be computed in the records' float32, not in bfloat16 matrix products
        with _no_autocast(self._params[0].device):
            self._scale = scale
            self._contributions = self._contributions_of_step(b)
            norms = self._norms(b)
            self.dropped = 0
            # the sum of the norms is finite exactly when every norm is (or it overflowed: then the full check below
            # finds none): one reduction and one read in the common case
            bad = None if math.isfinite(float(norms.sum())) else non_finite(norms)
            if bad is not None and bool(bad.any()):
                # An example whose gradient is not finite (an overflow in half precision, a loss of inf) is
                # dropped: its contribution becomes 0, within any clipping bound, and its norm +inf (clipped,
                # counted as above C). Letting it through would make the whole release non-finite (unbounded
                # sensitivity), and an optimizer step skipped for that (GradScaler) would reveal that some
                # example overflowed: a statistic no accountant covers.
                for contributions in self._contributions.values():
                    for c in contributions:
                        c.drop(bad)
                self.dropped = int(bad.sum())
                norms = self._norms(b).masked_fill(bad, math.inf)
        return norms

    def group_norms(self, sizes: Sequence[int]) -> Tensor:
        """Replace the recorded examples by their groups' MEAN gradients and return the groups' norms.

        The examples come in groups of consecutive examples, ``sizes[g]`` in group ``g`` (a batch of users, each
        with its records: user-level sampling); group ``g``'s gradient is ``(1 / sizes[g]) sum_{b in g} G_b``.
        Must follow :meth:`per_sample_norms` on the same records (an example it dropped adds zero to its group);
        :meth:`clipped_sum` then takes one factor per group.
        """
        if self._contributions is None:
            raise PerSampleGradientError("call per_sample_norms() before group_norms()")
        p0 = self._params[0]
        counts = torch.tensor(list(sizes), dtype=compute_dtype(p0.dtype), device=p0.device)
        groups = Groups.of_sizes(list(sizes), torch.repeat_interleave(1.0 / counts.clamp_min(1), counts.long(),
                                                                      output_size=int(sum(sizes))))
        with _no_autocast(p0.device):
            self._contributions = {key: [c.grouped(groups) for c in parts]
                                   for key, parts in self._contributions.items()}
            return self._norms(len(sizes))

    def fused_pass(self, loss_scale: Tensor, weights_of: Callable[[Tensor], list[Tensor]]
                   ) -> tuple[Tensor, list[list[Tensor]]]:
        """:meth:`per_sample_norms` and a :meth:`clipped_sum` per weight vector, with no host synchronization and no
        state kept: one function of tensors that ``torch.compile`` captures as one graph (batches of one shape,
        ``DPSGD(compile_step=...)``).

        An example whose norm is not finite is dropped as :meth:`per_sample_norms` drops it (its contribution 0, its
        norm +inf), but by masking every contribution's rows whether any is bad or not: no branch on the data. The
        caller makes the checks a graph cannot (:meth:`check_inputs_unchanged`, :meth:`batch_size`) before, and
        calls it outside autocast.

        Args:
            loss_scale: as :meth:`per_sample_norms`' (a tensor: a changing value does not recompile).
            weights_of: the per-example weights of each sum, from the norms.

        Returns:
            The norms (+inf where dropped) and, per weight vector, one tensor per parameter (:attr:`parameters`).
        """
        b = self.batch_size()
        contributions = self._contributions_of_step(b, checked=True)
        norms = self._norms_of(contributions, b, loss_scale)
        bad = non_finite(norms)  # 1-D: one isfinite, no branch on the data
        for parts in contributions.values():
            for c in parts:
                c.drop(bad)
        norms = norms.masked_fill(bad, math.inf)
        return norms, [self._sums_of(contributions, w, loss_scale) for w in weights_of(norms)]

    def _norms(self, b: int) -> Tensor:
        assert self._contributions is not None
        return self._norms_of(self._contributions, b, self._scale)

    def _norms_of(self, found: dict[int, list[Contribution]], b: int, scale: float | Tensor) -> Tensor:
        """The per-example norms of the contributions times ``|scale|`` (the loss scale, applied here and in
        :meth:`_sums_of`, not to the records)."""
        p0 = self._params[0]
        dtype = compute_dtype(p0.dtype)
        terms: list[Tensor] = []
        crossed = False
        room = self.keep_limit  # for per-sample gradients larger than their factors, kept for the clipped sum
        for contributions in found.values():
            tied: list[Tensor] = []  # a parameter used by several layers: its squares and cross terms
            for i, c in enumerate(contributions):
                sq = c.sq_norms()
                if sq.shape != (b,):  # a rule's per-example rows must be the batch's, or clipping bounds nothing
                    raise PerSampleGradientError(
                        f"a layer rule gave per-sample norms of shape {tuple(sq.shape)} for a batch of {b} examples; "
                        "this is a bug of the rule (it must return one row per example); please report it")
                (tied if len(contributions) > 1 else terms).append(sq)
                extra = c.releasable_bytes()
                if extra:
                    if extra <= room:
                        room -= extra
                    else:
                        c.release()
                for other in contributions[i + 1:]:
                    # a tied parameter's cross terms can cancel its squares: summed in float64
                    tied.append(2 * c.dot(other).double())
            if tied:
                # and floored by all its uses' terms (docs/per_sample_gradients.md, "Floating point"): two uses
                # whose huge gradients cancel (a Siamese pair on one input) made a norm of 0, and each use's share,
                # summed on its own in float32, carried its rounding unclipped (a review: 7 such examples' clipped
                # sum 14.9 C, 255 copies' neighbouring sums 634 C apart)
                crossed = True
                sizes, counts = zip(*(c.term_sizes() for c in contributions))
                terms.append(floored(torch.stack([t.double() for t in tied]).sum(0),
                                     floor_of(torch.stack(sizes).sum(0), torch.stack(counts).sum(0))))
        if not terms:
            return torch.zeros(b, dtype=dtype, device=p0.device)
        # one summation over all terms (the terms may be tensors a contribution caches: never changed in place)
        if crossed:
            sq = torch.stack([t.double() for t in terms]).sum(0)
        else:
            sq = _as(terms[0], dtype) if len(terms) == 1 else torch.stack([_as(t, dtype) for t in terms]).sum(0)
        # Gram-matrix (ghost) norms are sums of products that can round below zero (out of place: a single term
        # may be a tensor that its contribution caches)
        norms = sq.clamp_min(0).sqrt_()
        return _as(norms, dtype).mul_(scale.abs() if isinstance(scale, Tensor) else abs(scale))

    def clipped_sum(self, factors: Tensor) -> list[Tensor]:
        """Sum over the batch of per-sample gradients times ``factors``.

        Must follow :meth:`per_sample_norms` on the same records. Returns one tensor per
        parameter, in the order of :attr:`parameters` (zeros for unused parameters).
        """
        contributions = getattr(self, "_contributions", None)
        if contributions is None:
            raise PerSampleGradientError("call per_sample_norms() before clipped_sum()")
        with _no_autocast(self._params[0].device):
            return self._sums_of(contributions, factors, self._scale)

    def _sums_of(self, contributions: dict[int, list[Contribution]], factors: Tensor,
                 scale: float | Tensor) -> list[Tensor]:
        """Per parameter, the sum over the batch of the contributions weighted by ``factors`` times ``scale``."""
        factors = factors * scale
        out = []
        for p in self._params:
            dtype = compute_dtype(p.dtype)  # at least float32: the caller casts the released gradient to p.dtype
            parts = contributions.get(id(p), [])
            if not parts or factors.numel() == 0:
                out.append(torch.zeros(p.shape, dtype=dtype, device=p.device))
                continue
            total = parts[0].weighted_sum(factors)
            for c in parts[1:]:
                total = total + c.weighted_sum(factors)
            total = _as(total, dtype)
            out.append(total if total.shape == p.shape else total.view(p.shape))
        return out


class _LayerView:
    """What a rule sees of a layer: its module, trainable parameters, name, engine settings and buffers."""

    def __init__(self, engine: GradSampleEngine, layer: _Layer) -> None:
        self._engine, self._layer = engine, layer
        self.module, self.trainable, self.name, self.cache = layer.module, layer.trainable, layer.name, layer.cache
        self.instantiate_limit = engine.instantiate_limit
        #: the dtype the records were cast to (at least float32), which a rule's own tensors should use too
        self.compute_dtype = layer.compute_dtype

    def workspace(self, key: str, shape: tuple[int, ...], like: Tensor, *, shared: bool = False) -> Tensor:
        return self._engine.workspace(self._layer, key, shape, like, shared=shared)

    @contextlib.contextmanager
    def replaying(self) -> Iterator[None]:
        """Calls of the module inside are not recorded (rules that run the module again); autocast is off. A rule
        that replays a module whose weights are in lower precision than :attr:`compute_dtype` (``bf16-true``)
        passes float32 copies (:meth:`replay_state`)."""
        engine = self._engine
        was, engine._recording = engine._recording, False
        try:
            with _no_autocast(next(self.module.parameters()).device):
                yield
        finally:
            engine._recording = was

    def replay_state(self) -> dict[str, Tensor]:
        """The module's floating parameters and buffers in :attr:`compute_dtype`, detached: what
        ``torch.func.functional_call`` replays the module with (copies only where the dtype differs)."""
        named = [*self.module.named_parameters(), *self.module.named_buffers()]
        return {n: (t.detach().to(self.compute_dtype) if t.is_floating_point() else t.detach()) for n, t in named}
